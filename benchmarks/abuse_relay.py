"""A relay under abuse on loopback: one address flooding its transfer slots, idle connections, slowloris.

Each measure runs a real relay process (``veriroll.shardcast.cli relay run``, default limits and
timeouts) over a store holding one signed version with a 2 MiB file, and talks to it over real sockets.
Linux loopback answers on all of 127.0.0.0/8, so clients bind 127.0.0.x source addresses to look like
different hosts.

- :func:`slot_flood`: N connections from 127.0.0.1 each ask for the 2 MiB file with a 4 KiB receive
  window and never read a byte; once the relay has dealt with all of them, an honest client at
  127.0.0.2 fetches the version (signature and every shard checked). ``flood_refused`` is what the
  relay refused (connections closed at accept plus downloads answered 429/503, from its /status);
  the relay's memory growth is measured too.
- :func:`idle_and_slowloris`: K connections spread over 127.0.1.x that never send a byte, and one at
  127.0.0.3 that sends its request head a byte every 0.2 s; the seconds until the relay closed the
  last idle one, and until it cut the slow one.

    .venv/bin/python benchmarks/abuse_relay.py [--quick]

``--quick``: 520 flood connections (the issue's figure) and 100 idle ones; otherwise 2000 and 300.
Each measure takes ~15 s. Prints a few human lines, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import psutil

from veriroll.protos.identity import write_keypair
from veriroll.shardcast.errors import ShardcastError
from veriroll.shardcast.fetch import fetch_version
from veriroll.shardcast.publish import publish_checkpoint

FILE_BYTES = 2 * 1024 * 1024
FLOOD_ADDRESS = "127.0.0.1"
HONEST_ADDRESS = "127.0.0.2"
SLOWLORIS_ADDRESS = "127.0.0.3"
IDLE_PER_ADDRESS = 10  # idle connections from each 127.0.1.x: well under the per-address limit
_GUARD_S = 60.0  # nothing here should come near this; it only keeps a broken relay from hanging the run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _publish_store(work: Path) -> tuple[Path, Path]:
    """A store with version 1 (config.json and a 2 MiB file); returns (store, coordinator public key)."""
    key = write_keypair(work / "coordinator.key", force=True)
    ckpt = work / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (ckpt / "model.safetensors").write_bytes(os.urandom(FILE_BYTES))
    store = work / "store"
    publish_checkpoint(ckpt, store, key, 1, shard_size=1024 * 1024)
    return store, work / "coordinator.key.pub"


def _session_from(address: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0)), trust_env=False)


async def _load(url: str) -> dict:
    """The relay's /status load counters, asked from the honest address."""
    async with _session_from(HONEST_ADDRESS) as s, s.get(f"{url}/status") as r:
        return (await r.json())["load"]


@contextlib.asynccontextmanager
async def _relay_process(store: Path, key_pub: Path) -> AsyncIterator[tuple[str, psutil.Process]]:
    """A relay process with its default limits; yields its URL and process once it answers; SIGTERM at
    the end."""
    port = _free_port()
    cmd = [sys.executable, "-m", "veriroll.shardcast.cli", "relay", "run", "--store", str(store),
           "--port", str(port), "--coordinator-key", str(key_pub)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _GUARD_S
        while True:
            try:
                await _load(url)
                break
            except aiohttp.ClientError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the relay never came up (exit status {proc.poll()})") from None
                await asyncio.sleep(0.05)
        yield url, psutil.Process(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=_GUARD_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _stalled_download(port: int) -> socket.socket:
    """A connection from the flood address that asks for the 2 MiB file and never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((FLOOD_ADDRESS, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    with contextlib.suppress(OSError):  # the relay may have closed it at accept already
        sock.send(b"GET /versions/1/files/model.safetensors HTTP/1.1\r\nHost: relay\r\n\r\n")
    return sock


def _refused(load: dict) -> int:
    """Everything the relay turned away: by reason where it counts them, else its 503s."""
    return sum(load["rejections"].values()) if "rejections" in load else load["busy_rejections_total"]


async def _slot_flood(store: Path, key_pub: Path, flood: int, out: Path) -> dict:
    async with _relay_process(store, key_pub) as (url, relay):
        port = int(url.rsplit(":", 1)[1])
        before = await _load(url)
        rss_before = relay.memory_info().rss
        socks = [await _stalled_download(port) for _ in range(flood)]
        try:
            # Settled once every flood connection was refused at accept or had its request read.
            deadline, polls = time.monotonic() + _GUARD_S, 0
            while True:
                load = await _load(url)
                polls += 1  # each /status poll is a request too
                refused_at_accept = sum(
                    load.get("rejections", {}).get(r, 0) for r in ("connections", "address_connections")
                )
                read = load["requests_total"] - before["requests_total"] - polls
                if refused_at_accept + read >= flood or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            t0 = time.perf_counter()
            try:
                async with _session_from(HONEST_ADDRESS) as honest:
                    result = await fetch_version([url], key_pub, out, session=honest, progress=False)
                ok = result.version == 1 and not result.bad_relays
            except ShardcastError as exc:
                print(f"  honest fetch failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                ok = False
            honest_s = time.perf_counter() - t0
            rss_growth = relay.memory_info().rss - rss_before
        finally:
            for sock in socks:
                sock.close()
    return {
        "honest_fetch_ok_under_slot_flood": ok,
        "flood_connections": flood,
        "flood_refused": _refused(load),
        "flood_transfers_held": load["active_transfers"],
        "honest_fetch_s": round(honest_s, 3),
        "relay_rss_growth_mb_under_slot_flood": round(rss_growth / 2**20, 1),
    }


def slot_flood(quick: bool = True) -> dict:
    """Flood a relay's transfer slots from one address, then fetch a version from another.

    Returns ``honest_fetch_ok_under_slot_flood``, ``flood_connections``, ``flood_refused`` (connections
    closed at accept plus downloads refused), ``flood_transfers_held``, ``honest_fetch_s`` and
    ``relay_rss_growth_mb_under_slot_flood`` (the relay's resident memory after the flood and the fetch,
    less before).
    """
    flood = 520 if quick else 2000
    with tempfile.TemporaryDirectory(prefix="abuse-relay-") as tmp:
        store, key_pub = _publish_store(Path(tmp))
        return asyncio.run(_slot_flood(store, key_pub, flood, Path(tmp) / "honest"))


async def _seconds_until_closed(reader: asyncio.StreamReader, t0: float) -> float:
    """Seconds from ``t0`` until the relay closes the connection (EOF or reset); inf past the guard."""
    try:
        async with asyncio.timeout(_GUARD_S):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return float("inf")
    except ConnectionError:
        pass
    return time.monotonic() - t0


async def _idle_and_slowloris(store: Path, key_pub: Path, idle: int) -> dict:
    async with _relay_process(store, key_pub) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        t0 = time.monotonic()
        idle_conns = [
            await asyncio.open_connection(
                "127.0.0.1", port, local_addr=(f"127.0.1.{1 + i // IDLE_PER_ADDRESS}", 0)
            )
            for i in range(idle)
        ]
        slow_reader, slow_writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=(SLOWLORIS_ADDRESS, 0)
        )
        slow_t0 = time.monotonic()

        async def trickle() -> None:
            head = b"GET /status HTTP/1.1\r\nHost: relay\r\nX-Slow: " + b"a" * 4000
            with contextlib.suppress(ConnectionError):
                for byte in head:
                    slow_writer.write(bytes([byte]))
                    await slow_writer.drain()
                    await asyncio.sleep(0.2)

        trickler = asyncio.create_task(trickle())
        idle_closed, slow_cut = await asyncio.gather(
            asyncio.gather(*(_seconds_until_closed(r, t0) for r, _ in idle_conns)),
            _seconds_until_closed(slow_reader, slow_t0),
        )
        trickler.cancel()
        for _, w in [*idle_conns, (slow_reader, slow_writer)]:
            w.close()
    return {
        "relay_idle_connections": idle,
        "relay_idle_connections_closed_within_s": round(max(idle_closed), 3),
        "relay_slowloris_cut_within_s": round(slow_cut, 3),
    }


def idle_and_slowloris(quick: bool = True) -> dict:
    """Idle connections and a slowloris against a relay with its default timeouts.

    Returns ``relay_idle_connections_closed_within_s`` (the last idle connection, counted from when
    the first was opened), ``relay_slowloris_cut_within_s`` and ``relay_idle_connections``.
    """
    idle = 100 if quick else 300
    with tempfile.TemporaryDirectory(prefix="abuse-relay-") as tmp:
        store, key_pub = _publish_store(Path(tmp))
        return asyncio.run(_idle_and_slowloris(store, key_pub, idle))


def main() -> None:
    from procs import sigterm_as_interrupt  # a sibling script (not needed where this is imported)

    sigterm_as_interrupt()  # so the finally blocks below stop what this started
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="520 flood connections, 100 idle ones")
    args = ap.parse_args()
    flood = slot_flood(args.quick)
    print(
        f"slot flood: {flood['flood_connections']} non-reading downloads from one address, "
        f"{flood['flood_refused']} refused, {flood['flood_transfers_held']} held, relay RSS "
        f"+{flood['relay_rss_growth_mb_under_slot_flood']} MB; honest fetch from another address "
        f"ok={flood['honest_fetch_ok_under_slot_flood']} in {flood['honest_fetch_s']} s"
    )
    slow = idle_and_slowloris(args.quick)
    print(
        f"idle: {slow['relay_idle_connections']} idle connections all closed within "
        f"{slow['relay_idle_connections_closed_within_s']} s; slowloris cut after "
        f"{slow['relay_slowloris_cut_within_s']} s"
    )
    print(json.dumps({**flood, **slow}))


if __name__ == "__main__":
    main()
