"""The WAN shaping proxy: real sockets through it, with its rate, its delay, its losses, and its stop.

Only lower bounds on time are asserted (the proxy must not be faster than its link: a loaded machine
can only make it slower); the throughput it reaches is printed for the record.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from veriroll.deploy.wan import CHUNK, Link, Route, WanProxy, parse_profile

pytestmark = pytest.mark.timeout(120)


def run(coro):
    return asyncio.run(coro)


async def byte_server(size: int):
    """A server that sends ``size`` bytes to each connection, then closes it; also echoes anything sent."""

    async def handle(reader, writer):
        request = await reader.readline()
        if request.startswith(b"echo"):
            writer.write(request)
        else:
            writer.write(b"x" * size)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def fetch(port: int, ask: bytes = b"send\n") -> tuple[bytes, float]:
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(ask)
    await writer.drain()
    data = b""
    try:
        while chunk := await reader.read(1 << 20):
            data += chunk
    except ConnectionResetError:
        pass
    writer.close()
    return data, time.monotonic() - t0


def test_profiles_parse_with_units_and_bad_ones_are_refused_by_name():
    p = parse_profile("rtt=100ms,down=100mbit,up=20mbit,loss=0.01")
    assert (p.rtt_s, p.down_bps, p.up_bps, p.loss) == (0.1, 12.5e6, 2.5e6, 0.01)
    assert parse_profile("rtt=0.2s") == parse_profile(" rtt = 200ms ")
    assert parse_profile("").down_bps is None
    for bad, word in [("rtt=100", "units"), ("down=fast", "units"), ("jitter=5ms", "one each"),
                      ("rtt=1ms,rtt=2ms", "one each"), ("loss=1", "below 1"), ("up=0mbit", "rate of 0")]:
        with pytest.raises(ValueError, match=word):
            parse_profile(bad)


def test_a_transfer_through_a_link_is_held_to_its_rate():
    size, rate = 3 << 20, parse_profile("down=8mbit").down_bps  # 1 MB/s: 3 s at the limit

    async def go():
        server, port = await byte_server(size)
        route = Route(("127.0.0.1", 0), ("127.0.0.1", port), client=Link(parse_profile("down=8mbit")))
        async with server, WanProxy([route]):
            data, elapsed = await fetch(route.port)
        return data, elapsed, route

    data, elapsed, route = run(go())
    assert data == b"x" * size and route.bytes_to_client == size
    burst = max(CHUNK, rate * 0.05)
    print(f"throughput {size / elapsed / 1e6:.3f} MB/s against a limit of {rate / 1e6:.3f}")
    assert size / elapsed <= rate * 1.15 and elapsed >= (size - burst) / rate * 0.85


def test_connections_over_one_link_share_its_rate():
    size = 1 << 20
    server_link = Link(parse_profile("up=8mbit"))  # the server's uplink: 1 MB/s for all of its clients

    async def go():
        server, port = await byte_server(size)
        route = Route(("127.0.0.1", 0), ("127.0.0.1", port), server=server_link)
        async with server, WanProxy([route]):
            t0 = time.monotonic()
            results = await asyncio.gather(*(fetch(route.port) for _ in range(3)))
            return results, time.monotonic() - t0

    results, elapsed = run(go())
    assert all(data == b"x" * size for data, _ in results)
    assert elapsed >= (3 * size - server_link.up.burst) / server_link.up.rate * 0.85


def test_each_way_is_delayed_by_half_the_round_trip_of_both_links():
    async def go():
        server, port = await byte_server(0)
        route = Route(("127.0.0.1", 0), ("127.0.0.1", port), client=Link(parse_profile("rtt=200ms")),
                      server=Link(parse_profile("rtt=100ms")))
        async with server, WanProxy([route]):
            return await fetch(route.port, b"echo me\n")

    data, elapsed = run(go())
    assert data == b"echo me\n"
    assert elapsed >= 0.3  # 150 ms each way


def test_a_lossy_link_drops_connections_and_a_clean_one_never_does():
    size = 8 << 20

    async def go(profile: str):
        server, port = await byte_server(size)
        route = Route(("127.0.0.1", 0), ("127.0.0.1", port), client=Link(parse_profile(profile)))
        async with server, WanProxy([route], seed=1):
            outcomes = [await fetch(route.port) for _ in range(3)]
        return [len(data) for data, _ in outcomes], route

    lengths, lossy = run(go("loss=0.5"))
    assert lossy.dropped >= 1 and min(lengths) < size  # cut short, as a reset line would
    lengths, clean = run(go(""))
    assert clean.dropped == 0 and lengths == [size] * 3


def test_stop_cuts_transfers_in_flight_and_closes_the_port():
    async def go():
        server, port = await byte_server(64 << 20)
        route = Route(("127.0.0.1", 0), ("127.0.0.1", port), client=Link(parse_profile("down=8mbit")))
        proxy = WanProxy([route])
        await proxy.start()
        listen = route.port
        transfer = asyncio.ensure_future(fetch(listen))
        while route.bytes_to_client == 0:
            await asyncio.sleep(0.05)
        await proxy.stop()
        data, _ = await asyncio.wait_for(transfer, 10)
        server.close()
        return len(data), listen

    got, listen = run(go())
    assert 0 < got < 64 << 20
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", listen), timeout=2).close()


def test_the_proxy_process_serves_a_spec_and_exits_zero_on_sigterm(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        listen = s.getsockname()[1]

    async def serve_and_fetch():
        server, port = await byte_server(100_000)
        spec = {"links": {"home": "rtt=20ms,down=50mbit,up=10mbit"},
                "routes": [{"listen": f"127.0.0.1:{listen}", "target": f"127.0.0.1:{port}", "client": "home"}]}
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.Popen([sys.executable, "-m", "veriroll.deploy.wan", "--spec", str(tmp_path / "spec.json")],
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            async with server:
                for _ in range(200):
                    try:
                        data, _ = await fetch(listen)
                        if data:
                            break
                    except OSError:
                        await asyncio.sleep(0.1)
            return proc, data
        except BaseException:
            proc.kill()
            raise

    proc, data = run(serve_and_fetch())
    assert data == b"x" * 100_000
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
