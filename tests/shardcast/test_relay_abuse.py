"""A relay under abuse, over real sockets: slot floods from one address, slowloris, idle and
non-reading clients, oversized or bodied requests, and stop signals in every state.

A second source address is 127.0.0.2 (all of 127.0.0.0/8 is loopback on Linux): the relay listens on
127.0.0.1 and sees it as another client. Bounds on how soon something happens are guards a few times
the configured timeout, never measurements of speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest
from shardcast_helpers import REPO, FakeRelay, free_port, make_checkpoint, until

from veriroll.shardcast.fetch import fetch_version
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.relay import MAX_HEADER_FIELD, MAX_REQUEST_LINE, Refusal, RelayServer, address_key

OTHER_ADDRESS = "127.0.0.2"
FAST = {"connect_timeout": 2.0, "read_timeout": 2.0, "progress": False}
BIG_FILE = "/versions/1/files/model.safetensors"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def big_store(tmp_path, coord_key):
    """Version 1 with an 8 MiB file: far more than a non-reading client's socket buffers hold."""
    ckpt = make_checkpoint(tmp_path / "big", model_bytes=8 * 1024 * 1024)
    store = tmp_path / "big-store"
    publish_checkpoint(ckpt, store, coord_key, 1, shard_size=1024 * 1024)
    return ckpt, store


def run(coro):
    return asyncio.run(coro)


def session_from(address: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0)), trust_env=False)


async def status_of(relay_url: str) -> dict:
    """The relay's /status, asked from the second address so that a flood from the first cannot block it."""
    async with session_from(OTHER_ADDRESS) as s, s.get(f"{relay_url}/status") as r:
        assert r.status == 200
        return await r.json()


async def stalled_download(port: int, path: str = BIG_FILE, *, source: str = "127.0.0.1") -> socket.socket:
    """A connection that asks for ``path`` and never reads a byte of the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window: the relay must wait
    sock.bind((source, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    with contextlib.suppress(OSError):  # a connection the relay refused at accept may be reset already
        sock.send(f"GET {path} HTTP/1.1\r\nHost: relay\r\n\r\n".encode())
    return sock


async def closed_by_peer(reader: asyncio.StreamReader, within: float) -> bool:
    """True when the relay closes the connection (EOF or reset) within ``within`` seconds (a guard)."""
    try:
        async with asyncio.timeout(within):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


def test_address_key_is_the_ipv4_address_or_the_ipv6_slash_64():
    assert address_key("203.0.113.7") == "203.0.113.7"
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("fe80::1%eth0") == "fe80::/64"
    # One owner for every port's address keys (protos/netaddr): an IPv4 client seen over a dual-stack
    # socket is the same source as over IPv4.
    assert address_key("::ffff:203.0.113.7") == "203.0.113.7"


def test_one_address_flooding_non_reading_downloads_cannot_starve_another(big_store, coord_key, tmp_path):
    ckpt, store = big_store
    flood = 300

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as relay:
            socks = [await stalled_download(relay.port) for _ in range(flood)]
            try:

                async def settled():
                    load = (await status_of(relay.url))["load"]
                    refused = load["rejections"]
                    seen = refused[Refusal.ADDRESS_CONNECTIONS] + refused[Refusal.ADDRESS_TRANSFERS]
                    return load if seen + load["active_transfers"] >= flood else None

                during = await until(settled, "the relay has answered or refused every flood connection")
                async with session_from(OTHER_ADDRESS) as honest:
                    result = await fetch_version(
                        [relay.url], coord_key.public, tmp_path / "out", session=honest, **FAST
                    )
                after = (await status_of(relay.url))["load"]
            finally:
                for sock in socks:
                    sock.close()
            return during, result, after

    during, result, after = run(go())
    assert result.version == 1 and not result.bad_relays
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    # The flood got its 16 transfers and 64 connections, no more; everything else was refused and counted.
    assert during["active_transfers"] == 16
    assert during["rejections"][Refusal.ADDRESS_CONNECTIONS] >= flood - 64
    assert during["rejections"][Refusal.ADDRESS_TRANSFERS] == 64 - 16
    assert after["busy_rejections_total"] == 0
    assert after["per_address_rejections_total"] == sum(
        after["rejections"][r] for r in (Refusal.ADDRESS_CONNECTIONS, Refusal.ADDRESS_TRANSFERS)
    )


def test_per_address_limits_refuse_with_reasons_and_count_each_refusal(big_store, coord_key):
    _, store = big_store

    async def go():
        async with RelayServer(
            store, coord_key.public, port=0, max_connections_per_address=2, max_transfers_per_address=1
        ) as relay:
            first = await stalled_download(relay.port)  # holds this address's one transfer

            async def transferring():
                return (await status_of(relay.url))["load"]["active_transfers"] == 1

            await until(transferring, "the first download is in progress")
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s,
                s.get(f"{relay.url}/versions/1/files/config.json") as r,
            ):
                second = r.status, r.headers.get("Retry-After"), r.headers.get("X-Shardcast-Refusal")
                # That keep-alive connection and the stalled one are this address's two: a third is
                # closed at accept, before the relay reads the request it sends.
                requests_before = relay.requests_total
                reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
                writer.write(b"GET /status HTTP/1.1\r\nHost: relay\r\n\r\n")
                third_closed = await closed_by_peer(reader, 10.0)
                third_read = relay.requests_total != requests_before
                writer.close()
            async with (
                session_from(OTHER_ADDRESS) as s,
                s.get(f"{relay.url}/versions/1/files/config.json") as r,
            ):
                other = r.status
            load = (await status_of(relay.url))["load"]
            first.close()
            return second, (third_closed, third_read), other, load

    second, third, other, load = run(go())
    assert second == (429, "1", "address_transfers")
    assert third == (True, False)
    assert other == 200
    assert load["rejections"][Refusal.ADDRESS_TRANSFERS] == 1
    assert load["rejections"][Refusal.ADDRESS_CONNECTIONS] == 1
    assert load["per_address_rejections_total"] == 2
    assert load["rejections"][Refusal.CONNECTIONS] == 0


def test_total_connection_limit_closes_new_connections_at_accept(store, coord_key):
    async def go():
        async with RelayServer(store, coord_key.public, port=0, max_connections=3) as relay:
            held = [await asyncio.open_connection("127.0.0.1", relay.port) for _ in range(3)]
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", relay.port, local_addr=(OTHER_ADDRESS, 0)
            )
            refused = await closed_by_peer(reader, 10.0)
            writer.close()
            requests = relay.requests_total
            for _, w in held:
                w.close()
            return refused, requests, relay.rejections[Refusal.CONNECTIONS]

    refused, requests, counted = run(go())
    assert refused and requests == 0 and counted == 1


def test_a_client_sending_its_headers_a_byte_at_a_time_is_cut_off(store, coord_key):
    idle = 1.0

    async def go():
        async with RelayServer(store, coord_key.public, port=0, idle_timeout=idle) as relay:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)

            async def trickle():
                line = b"GET /status HTTP/1.1\r\nHost: relay\r\nX-Slow: " + b"a" * 10_000
                with contextlib.suppress(ConnectionError):
                    for byte in line:
                        writer.write(bytes([byte]))
                        await writer.drain()
                        await asyncio.sleep(0.05)

            task = asyncio.create_task(trickle())
            cut = await closed_by_peer(reader, 3 * idle)
            task.cancel()
            writer.close()
            return cut, relay.requests_total

    cut, requests = run(go())
    assert cut and requests == 0


def test_an_idle_keep_alive_connection_is_closed_after_its_answer(store, coord_key):
    idle = 0.5

    async def go():
        async with RelayServer(store, coord_key.public, port=0, idle_timeout=idle) as relay:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(b"GET /versions HTTP/1.1\r\nHost: relay\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            closed = await closed_by_peer(reader, 3 * idle + 5)
            writer.close()
            return head, closed

    head, closed = run(go())
    assert head.startswith(b"HTTP/1.1 200") and closed


def test_a_client_that_never_reads_small_answers_is_dropped(store, coord_key):
    """Pipelined requests whose answers pile up unread: the send deadline covers every answer, not
    just file downloads."""

    async def go():
        async with RelayServer(store, coord_key.public, port=0, send_grace=0.2, min_send_rate=1e6) as relay:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, ("127.0.0.1", relay.port))
            request = b"GET /versions/1/manifest HTTP/1.1\r\nHost: relay\r\n\r\n"
            with contextlib.suppress(OSError):
                for _ in range(2000):
                    await loop.sock_sendall(sock, request)

            async def dropped():
                return relay.send_timeouts_total >= 1

            await until(dropped, "the relay drops the client that does not read")
            sock.close()

    run(go())


STATUS_HEAD = b"GET /status HTTP/1.1\r\nHost: relay\r\n"


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (STATUS_HEAD + b"Content-Length: 5\r\n\r\nhello", 400),
        (STATUS_HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 400),
        (b"POST /status HTTP/1.1\r\nHost: relay\r\nContent-Length: 0\r\n\r\n", 405),
        (STATUS_HEAD + b"X-Big: " + b"a" * (MAX_HEADER_FIELD + 1) + b"\r\n\r\n", 400),
        (b"GET /" + b"a" * (MAX_REQUEST_LINE + 1) + b" HTTP/1.1\r\nHost: relay\r\n\r\n", 400),
        (STATUS_HEAD + b"".join(b"X-%d: 1\r\n" % i for i in range(40)) + b"\r\n", 400),
    ],
    ids=["content-length-body", "chunked-body", "post", "huge-header", "huge-request-line", "many-headers"],
)
def test_bodies_and_oversized_request_heads_are_refused(store, coord_key, request_bytes, status):
    # aiohttp's defaults (8190-byte header fields, 128 headers) would let huge-header and many-headers in.
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as relay:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(request_bytes)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n"), 10)  # guard only
            writer.close()
            return int(head.split()[1])

    assert run(go()) == status


def test_a_request_with_a_body_is_answered_with_the_reason_and_the_connection_closed(store, coord_key):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as relay:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            writer.write(b"GET /status HTTP/1.1\r\nHost: relay\r\nContent-Length: 1000000\r\n\r\nabc")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # guard only
            closed = await closed_by_peer(reader, 10.0)
            writer.close()
            return head, closed, relay.rejections[Refusal.BODY]

    head, closed, counted = run(go())
    assert head.startswith(b"HTTP/1.1 400") and b"X-Shardcast-Refusal: body" in head
    assert closed and counted == 1


# ---- stop signals, with the relay as a real process


def start_relay_process(store, key_pub, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "veriroll.shardcast.cli",
            "relay",
            "run",
            "--store",
            str(store),
            "--port",
            str(port),
            "--coordinator-key",
            str(key_pub),
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def process_status(port: int) -> dict | None:
    try:
        return await status_of(f"http://127.0.0.1:{port}")
    except aiohttp.ClientError:
        return None


@pytest.mark.parametrize(
    "state, sig",
    [
        ("idle", signal.SIGTERM),
        ("idle", signal.SIGINT),
        ("mirroring", signal.SIGTERM),
        ("slow-client", signal.SIGTERM),
        ("slow-client", signal.SIGINT),
    ],
)
def test_a_relay_process_stops_on_a_signal_in_every_state_and_exits_0(
    big_store, coord_key, tmp_path, state, sig
):
    _, store = big_store
    key_pub = tmp_path / "keys" / "coordinator.key.pub"
    port = free_port()

    async def go():
        upstream = None
        if state == "mirroring":
            upstream = FakeRelay(store, mode="silent-files")  # the mirror's fetch hangs on its first shard
            await upstream.start()
            proc = start_relay_process(
                tmp_path / "mirror", key_pub, port, "--upstream", upstream.url, "--poll-interval", "0.2"
            )
        else:
            proc = start_relay_process(store, key_pub, port)
        held = []
        try:

            async def ready():
                status = await process_status(port)
                if status is None:
                    return None
                if state == "mirroring":
                    return status["mirror"]["fetching"] == 1
                if state == "slow-client":
                    if not held:
                        held.append(await stalled_download(port))
                    return status["load"]["active_transfers"] == 1
                return True

            await until(ready, f"the relay process is {state}", tries=1200)
            proc.send_signal(sig)
            t0 = time.monotonic()
            while proc.poll() is None and time.monotonic() - t0 < 30:  # a guard: it should take ~2 s
                await asyncio.sleep(0.05)
            stopped_in = time.monotonic() - t0
        finally:
            for sock in held:
                sock.close()
            if proc.poll() is None:
                proc.kill()
            _, stderr = proc.communicate()
            if upstream is not None:
                await upstream.stop()
        return proc.returncode, stopped_in, stderr

    returncode, stopped_in, stderr = run(go())
    assert returncode == 0, stderr
    assert stopped_in < 10, f"still running {stopped_in:.1f} s after the signal"
    assert "Traceback" not in stderr


def test_the_books_of_closed_connections_stay_bounded_as_sources_come_and_go(store, coord_key):
    async def go():
        async with RelayServer(store, coord_key.public, port=0, max_connections=4) as relay:
            sizes = []
            for i in range(40):
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", relay.port, local_addr=(f"127.0.2.{i + 1}", 0)
                )
                writer.write(b"GET /versions HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
                assert (await reader.read()).startswith(b"HTTP/1.1 200")
                writer.close()
                sizes.append(len(relay._by_address))
            return sizes

    assert max(run(go())) < 2 * 4


def test_a_fetch_behind_one_address_waits_out_busy_answers_instead_of_failing(big_store, coord_key, tmp_path):
    """Four downloads at once against a relay that gives this address one transfer: three are answered
    429 with Retry-After at a time. The fetch waits and comes back; busy answers are not failures."""
    ckpt, store = big_store

    async def go():
        async with RelayServer(store, coord_key.public, port=0, max_transfers_per_address=1) as relay:
            result = await fetch_version([relay.url], coord_key.public, tmp_path / "out", **FAST, concurrency=4,
                                         max_attempts=2)
            return result, (await status_of(relay.url))["load"]

    result, load = run(go())
    assert result.version == 1
    assert load["rejections"][Refusal.ADDRESS_TRANSFERS] > 0  # it was told to wait, more than twice per shard
    assert (tmp_path / "out").exists()
