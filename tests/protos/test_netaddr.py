"""Peer addresses as limit keys (protos/netaddr.py): one client is one key whichever form its address takes."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from veriroll.protos.netaddr import UNPARSED, address_key, host_key, ip_of, peer_address, prefix_key

# Every way the same IPv4 client reaches a limit: a bare address (aiohttp's request.remote, a socket's
# peername), gRPC's peer string, and the IPv4-mapped IPv6 a dual-stack listener reports, bare or as gRPC writes it.
ONE_IPV4_CLIENT = ["203.0.113.7", " 203.0.113.7 ", "ipv4:203.0.113.7:5432", "::ffff:203.0.113.7",
                   "ipv6:[::ffff:203.0.113.7]:5", "ipv6:%5B::ffff:203.0.113.7%5D:6", "[::ffff:203.0.113.7]"]
ONE_IPV6_CLIENT = ["2001:db8:1:2::9", "ipv6:[2001:db8:1:2::9]:443", "ipv6:%5B2001:db8:1:2::9%5D:443",
                   "[2001:db8:1:2::9]", "2001:db8:1:2:0:0:0:9"]
GARBAGE = ["unknown", "", None, "unix:/tmp/coordinator.sock", "unix:", "1.2.3", "::g", "999.1.1.1",
           "ipv4:garbage:5", "ipv6:[nonsense]:5", "ipv4:", "1.2.3.4:5", "x" * 10_000]


@pytest.mark.parametrize("address", ONE_IPV4_CLIENT)
def test_every_form_of_an_ipv4_client_is_one_key(address):
    assert host_key(address) == address_key(address) == "203.0.113.7"
    assert prefix_key(address) == "203.0.113.0/24"


@pytest.mark.parametrize("address", ONE_IPV6_CLIENT)
def test_every_form_of_an_ipv6_client_is_one_key(address):
    assert host_key(address) == "2001:db8:1:2::9"
    assert address_key(address) == prefix_key(address) == "2001:db8:1:2::/64"


@pytest.mark.parametrize("garbage", GARBAGE)
def test_anything_that_is_not_an_ip_is_the_one_unparsed_key(garbage):
    assert ip_of(garbage) is None
    assert host_key(garbage) == address_key(garbage) == prefix_key(garbage) == UNPARSED


def test_ipv4_is_keyed_by_address_and_ipv6_by_its_64():
    assert address_key("192.0.2.7") == "192.0.2.7"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert address_key("fe80::1%eth0") == "fe80::/64"
    assert address_key("unknown") == "unknown"


def test_the_host_keeps_the_whole_ipv6_address_and_drops_the_zone():
    assert host_key("2001:db8:1:2:aaaa::1") != host_key("2001:db8:1:2:ffff::9")
    assert host_key("fe80::1%eth0") == host_key("fe80::1") == "fe80::1"
    assert host_key("ipv6:[::1]:5") == "::1"


@pytest.mark.parametrize("address, prefix", [
    ("203.0.113.7", "203.0.113.0/24"),
    ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
    ("::ffff:203.0.113.7", "203.0.113.0/24"),  # IPv4-mapped IPv6 (a dual-stack listener) is its IPv4
    ("fe80::1%eth0", "fe80::/64"),
    (" 203.0.113.7 ", "203.0.113.0/24"),
    ("2001:db8:aa:bb:cc::1", "2001:db8:aa:bb::/64"),
])
def test_prefix_key_names_the_network_an_address_belongs_to(address, prefix):
    assert prefix_key(address) == prefix


def test_prefix_lengths_are_configurable():
    assert prefix_key("203.0.113.7", v4=16) == "203.0.0.0/16"
    assert prefix_key("2001:db8:1:2::9", v6=48) == "2001:db8:1::/48"
    assert prefix_key("ipv4:203.0.113.7:9", v4=32) == "203.0.113.7/32"


@pytest.mark.parametrize("peer, address", [
    ("ipv4:203.0.113.7:5432", "203.0.113.7"),
    ("ipv6:%5B2001:db8::1%5D:5432", "2001:db8::1"),  # how gRPC writes an IPv6 peer
    ("ipv6:[::1]:5432", "::1"),
    ("unix:/tmp/c.sock", "unix:/tmp/c.sock"),
    (None, "unknown"),
    ("", "unknown"),
])
def test_peer_address_strips_the_port_and_brackets(peer, address):
    assert peer_address(peer) == address


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_address_of_a_real_ipv6_grpc_peer_parses():
    async def main() -> str:
        seen = []

        async def echo(body, context):
            seen.append(context.peer())
            return body

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                return grpc.unary_unary_rpc_method_handler(echo)

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((Handler(),))
        port = server.add_insecure_port("[::1]:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"[::1]:{port}") as channel:
                await channel.unary_unary("/test/Echo")(b"x", timeout=30)
        finally:
            await server.stop(0)
        return seen[0]

    peer = asyncio.run(main())
    assert peer_address(peer) == "::1", peer
    assert prefix_key(peer_address(peer)) == prefix_key(peer) == "::/64"
    assert host_key(peer) == "::1"
