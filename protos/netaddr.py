"""How a peer's address becomes the key a per-address limit counts it under: one client, one key, everywhere.

Every per-address limit (the coordinator's door, its in-flight gate, the new-identity and verifier
budgets, a relay's connection and transfer slots) keys its peers with these functions, so that the same
client is never two keys in one place and one key in another:

- gRPC peer strings (``ipv4:1.2.3.4:5``, ``ipv6:[::1]:5``, ``ipv6:%5B::1%5D:5``) and aiohttp's
  ``request.remote`` (a bare IP) are read as the IP they name; the port is left out;
- an IPv4-mapped IPv6 address (``::ffff:1.2.3.4``: what a dual-stack listener reports for an IPv4
  client) is the IPv4 address it carries, so a client is one key whichever socket it came in on;
- an IPv6 zone id (``fe80::1%eth0``) is dropped: the same host either way;
- anything that is not an IP address (``unix:/path``, ``unknown``, ``""``, None, garbage) is
  :data:`UNPARSED`: all such peers share one key, so an address that does not parse cannot escape a
  limit (fail closed).

Three keys, from finest to coarsest: :func:`host_key` (the host), :func:`address_key` (one party: the
IPv4 address, or the IPv6 /64, since one subscriber is usually given a whole /64 and keying by the full
address would let one party appear as 2^64 peers) and :func:`prefix_key` (the network: /24, /64).
"""

from __future__ import annotations

import functools
import ipaddress
import urllib.parse

IP = ipaddress.IPv4Address | ipaddress.IPv6Address

UNPARSED = "unknown"
"""The one key of every peer whose address is not an IP address."""

IPV4_PREFIX = 24
IPV6_PREFIX = 64
"""The network of an address, by default: the /24 of an IPv4 address, the /64 of an IPv6 one."""

_CACHED = 65536  # every request keys its peer a few times; parsing is ~1 µs, a cache hit ~0.1 µs


def peer_address(peer: str | None) -> str:
    """The address a gRPC peer string names, without port or brackets (``ipv4:127.0.0.1:5432`` ->
    ``127.0.0.1``, ``ipv6:%5B::1%5D:5432`` -> ``::1``); ``unknown`` for no peer; any other string as it is.

    What the coordinator passes around and shows; the limits key it with the ``*_key`` functions."""
    if not peer:
        return UNPARSED
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":  # gRPC percent-encodes the brackets: ipv6:%5B::1%5D:5432
        return urllib.parse.unquote(rest).rsplit(":", 1)[0].strip("[]")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


def ip_of(address: str | None) -> IP | None:
    """The IP ``address`` names (a bare IP, a gRPC peer string, ``[v6]`` in brackets), an IPv4-mapped IPv6
    address as its IPv4, without IPv6 zone id; None when it names none."""
    if not address:
        return None
    text = address.strip()
    if text.startswith(("ipv4:", "ipv6:")):
        text = peer_address(text)
    elif text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])  # no zone id ("fe80::1%eth0")
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@functools.lru_cache(maxsize=_CACHED)
def host_key(address: str | None) -> str:
    """The host ``address`` names (``1.2.3.4``, ``2001:db8::1``), or :data:`UNPARSED`."""
    ip = ip_of(address)
    return UNPARSED if ip is None else str(ip)


@functools.lru_cache(maxsize=_CACHED)
def address_key(address: str | None) -> str:
    """The party ``address`` belongs to: the IPv4 address (``1.2.3.4``), or the IPv6 /64 it lies in
    (``2001:db8:1:2::/64``), or :data:`UNPARSED`."""
    ip = ip_of(address)
    if ip is None:
        return UNPARSED
    if ip.version == 4:
        return str(ip)
    return str(ipaddress.ip_network((ip, IPV6_PREFIX), strict=False))


@functools.lru_cache(maxsize=_CACHED)
def prefix_key(address: str | None, *, v4: int = IPV4_PREFIX, v6: int = IPV6_PREFIX) -> str:
    """The network ``address`` belongs to: its IPv4 /``v4`` (``1.2.3.0/24``) or IPv6 /``v6``
    (``2001:db8::/64``), or :data:`UNPARSED`."""
    ip = ip_of(address)
    if ip is None:
        return UNPARSED
    return str(ipaddress.ip_network((ip, v4 if ip.version == 4 else v6), strict=False))
