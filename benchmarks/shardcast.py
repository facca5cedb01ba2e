"""Shardcast on loopback: one client through one relay, and a fan-out tree against direct downloads.

Builds a random-weight checkpoint (a valid safetensors file of ``--size-mib`` MiB plus a config),
publishes it, and runs every server and client as its own process:

1. **single client**: a fetch through one relay (every shard hashed on arrival) against a plain
   aiohttp static download of the same bytes from a plain ``web.static`` server, alternated
   ``--repeats`` times; ``single_client_ratio`` = fetch throughput / plain throughput (medians), with
   neither side fsyncing; ``single_client_ratio_fsync`` is the same with the library's default fsync
   before the ready marker.
2. **tree**: origin → 2 mirror relays → ``--clients`` clients. The clients start first and wait;
   at t0 the version appears at the origin (an atomic rename of a published version directory);
   ``tree_s`` is t0 until the last client holds a verified checkpoint, relay mirroring included.
   ``origin_copies_tree`` = bytes the origin served / checkpoint size.
3. **direct**: the same clients fetch straight from the origin: ``direct_s``, ``origin_copies_direct``.

Mirror relays stream: they serve each shard as soon as they have verified it, so ``tree_s`` pipelines
the mirrors' downloads with the clients' instead of adding them up.

``relay_peak_rss_mb`` is the highest resident memory any relay process reached (sampled every 20 ms).

``--no-address-limits`` turns off the relays' per-address limits: on loopback every client is
127.0.0.1, so they would count 16 clients as one address and make them queue (real clients have
addresses of their own). ``--skip-single`` runs only the tree and the direct phases.
``--client-concurrency`` sets the shards each client downloads at once: with the default (8, at most 2
per relay) a client of the tree keeps 4 streams open and one of the direct phase 2, and on 2 shared
cores the extra streams cost more than they bring; ``--client-concurrency 2`` compares like with like.

    .venv/bin/python benchmarks/shardcast.py [--quick] [--size-mib 256] [--clients 16] [--repeats 3]

``--wan PROFILE`` (e.g. ``rtt=100ms,down=100mbit,up=100mbit``) puts every host behind an emulated link of
its own (``veriroll.deploy.wan``, one proxy process): the origin, each mirror and each client. A mirror
reaches the origin, and a client each relay, through the links of both ends, so the origin's uplink is
shared by whoever fetches from it. ``time_to_{50,95,100}pct_s_{tree,direct}`` say when that share of
the clients held a verified checkpoint.

``--quick`` is 64 MiB, 4 clients, 5 repeats. Prints a few human lines, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import psutil
from procs import sigterm_as_interrupt, stop_processes

from veriroll.protos.identity import write_keypair
from veriroll.shardcast.errors import NoRelayReachableError, VersionGoneError
from veriroll.shardcast.fetch import DEFAULT_CONCURRENCY, fetch_version
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.store import version_dir

HERE = Path(__file__).resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_checkpoint(path: Path, size: int) -> None:
    """config.json + model.safetensors holding one random bf16 tensor of ``size`` bytes."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 1024}))
    header = json.dumps(
        {"weight": {"dtype": "BF16", "shape": [size // 2], "data_offsets": [0, size]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    with open(path / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
        left = size
        while left:
            n = min(left, 8 << 20)
            fh.write(os.urandom(n))
            left -= n


# -- processes ---------------------------------------------------------------------------------------


def start_relay(
    store: Path, key_pub: Path, *, upstreams=(), poll: float = 0.2, address_limits: bool = True
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "veriroll.shardcast.cli", "relay", "run", "--store", str(store),
           "--port", str(port), "--coordinator-key", str(key_pub), "--poll-interval", str(poll)]  # fmt: skip
    if not address_limits:
        cmd += ["--max-transfers-per-address", "0", "--max-connections-per-address", "0"]
    for u in upstreams:
        cmd += ["--upstream", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def start_static(directory: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(HERE), "--role", "static", "--dir", str(directory), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_up(url: str, path: str = "/status") -> None:
    for _ in range(600):
        try:
            with socket.create_connection((url.split(":")[1][2:], int(url.rsplit(":", 1)[1])), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} never came up")


async def status_of(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/status") as r:
        return await r.json()


def origin_bytes(url: str) -> int:
    return asyncio.run(status_of(url))["load"]["bytes_served_total"]


class RssSampler:
    """Peak RSS of some processes, sampled in a thread."""

    def __init__(self, pids: list[int]):
        self.procs = [psutil.Process(p) for p in pids]
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def add(self, pid: int) -> None:
        self.procs.append(psutil.Process(pid))

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in list(self.procs):
                with contextlib.suppress(psutil.Error):
                    self.peak = max(self.peak, p.memory_info().rss)
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_clients(
    n: int, relays: list[str] | list[list[str]], key_pub: Path, outs: Path, go: Path, concurrency: int
) -> list[subprocess.Popen]:
    """``n`` client processes, all given ``relays``, or client ``i`` its own list ``relays[i]``."""
    procs = []
    for i in range(n):
        cmd = [sys.executable, str(HERE), "--role", "client", "--key", str(key_pub), "--out", str(outs / f"c{i}"),
               "--go", str(go), "--client-concurrency", str(concurrency)]  # fmt: skip
        for r in relays[i] if isinstance(relays[0], list) else relays:
            cmd += ["--relay", r]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def collect(procs: list[subprocess.Popen]) -> list[dict]:
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"a client failed ({p.returncode}): {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def reach_times(results: list[dict], t0: float) -> dict[str, float]:
    """Seconds from ``t0`` until 50, 95 and 100 % of the clients held the version."""
    ends = sorted(r["end"] - t0 for r in results)
    return {f"{p}pct": round(ends[max(0, math.ceil(p / 100 * len(ends)) - 1)], 3) for p in (50, 95, 100)}


def start_wan(
    work: Path, profile: str, clients: int, servers: dict[str, str], mirror_upstream: dict[str, str]
) -> tuple[subprocess.Popen, list[list[str]], list[list[str]]]:
    """The WAN proxy (``veriroll.deploy.wan``): one ``profile`` link per host; returns it and each client's
    relay URLs for the tree and for direct fetches."""
    links = {name: profile for name in [*servers, *(f"c{i}" for i in range(clients))]}
    routes = [{"listen": url.rsplit("/", 1)[1], "target": servers["origin"].rsplit("/", 1)[1],
               "client": name, "server": "origin"} for name, url in mirror_upstream.items()]  # fmt: skip
    tree: list[list[str]] = []
    direct: list[list[str]] = []
    for i in range(clients):
        mine = {}
        for server, url in servers.items():
            port = free_port()
            routes.append({"listen": f"127.0.0.1:{port}", "target": url.rsplit("/", 1)[1], "client": f"c{i}",
                           "server": server})  # fmt: skip
            mine[server] = f"http://127.0.0.1:{port}"
        tree.append([mine["r1"], mine["r2"]])
        direct.append([mine["origin"]])
    (work / "wan.json").write_text(json.dumps({"links": links, "routes": routes}))
    proc = subprocess.Popen([sys.executable, "-m", "veriroll.deploy.wan", "--spec", str(work / "wan.json")])
    return proc, tree, direct


def wait_clients_ready(outs: Path, n: int) -> None:
    for _ in range(6000):
        if len(list(outs.glob("*.ready-to-go"))) == n:
            return
        time.sleep(0.02)
    raise RuntimeError("clients never got ready")


# -- roles run in child processes --------------------------------------------------------------------


def role_static(directory: str, port: int) -> None:
    from aiohttp import web

    app = web.Application()
    app.router.add_static("/", directory)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def role_client(relays: list[str], key: str, out: str, go: str, concurrency: int) -> None:
    """Wait for the go file, then fetch version 1, retrying until the relays hold it."""
    Path(out + ".ready-to-go").touch()
    while not os.path.exists(go):
        time.sleep(0.005)
    start = time.time()
    while True:
        try:
            result = asyncio.run(fetch_version(relays, key, out, 1, progress=False, concurrency=concurrency))
            break
        except (VersionGoneError, NoRelayReachableError):
            time.sleep(0.05)  # the relays do not hold it yet
    print(json.dumps({"start": start, "end": time.time(), "bytes": result.bytes_downloaded,
                      "bad": sorted(result.bad_relay_urls)}))  # fmt: skip


# -- phases ------------------------------------------------------------------------------------------


async def plain_download(url: str, dest: Path) -> float:
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        r.raise_for_status()
        with open(dest, "wb") as fh:
            async for chunk in r.content.iter_chunked(1 << 20):
                fh.write(chunk)
    return time.perf_counter() - t0


async def our_fetch(relay: str, key_pub: Path, dest: Path, *, fsync: bool) -> float:
    t0 = time.perf_counter()
    await fetch_version([relay], key_pub, dest, 1, progress=False, fsync=fsync)
    return time.perf_counter() - t0


def measure_single(args, work: Path, origin_store: Path, relay_url: str, key_pub: Path, published, procs) -> dict:
    """Phase 1: one client through one relay against a plain static download of the same bytes."""
    total = published.total_bytes
    static, static_url = start_static(version_dir(origin_store, 1))
    procs.append(static)
    wait_up(static_url)
    plain_times, ours_times, fsync_times = [], [], []
    for i in range(args.repeats):
        dest = work / f"plain{i}.bin"
        plain_times.append(asyncio.run(plain_download(f"{static_url}/model.safetensors", dest)))
        dest.unlink()
        for fsync, times in ((False, ours_times), (True, fsync_times)):
            out = work / f"single{i}"
            times.append(asyncio.run(our_fetch(relay_url, key_pub, out, fsync=fsync)))
            shutil.rmtree(out)
    weights = published.manifest.file("model.safetensors").size
    # Throughput: the plain download carries the weights file, the fetch the whole checkpoint.
    plain_mbps = weights / statistics.median(plain_times) / 1e6
    ours_mbps = total / statistics.median(ours_times) / 1e6
    fsync_mbps = total / statistics.median(fsync_times) / 1e6
    # Like for like: the plain download neither hashes nor fsyncs; the fetch hashes every shard
    # (the ratio's "hashing included"). The library default also fsyncs before marking the
    # version ready, which on loopback measures the disk more than the transfer: reported apart.
    single_client_ratio = ours_mbps / plain_mbps
    single_client_ratio_fsync = fsync_mbps / plain_mbps
    print(f"single client: fetch {ours_mbps:.0f} MB/s (with fsync {fsync_mbps:.0f}) vs plain static "
          f"{plain_mbps:.0f} MB/s: ratio {single_client_ratio:.2f} ({single_client_ratio_fsync:.2f} with "
          f"fsync); times {[round(x, 2) for x in ours_times]} / {[round(x, 2) for x in fsync_times]} vs "
          f"{[round(x, 2) for x in plain_times]}")  # fmt: skip
    return {
        "single_client_ratio": round(single_client_ratio, 3),
        "single_client_ratio_fsync": round(single_client_ratio_fsync, 3),
        "single_client_fetch_mbps": round(ours_mbps, 1),
        "single_client_fetch_fsync_mbps": round(fsync_mbps, 1),
        "single_client_plain_mbps": round(plain_mbps, 1),
    }


def main() -> None:
    sigterm_as_interrupt()  # so the finally blocks below stop what this started (procs.py)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 4 clients, 5 repeats")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where to put stores and outputs (default: a temp dir)")
    ap.add_argument("--no-address-limits", action="store_true", help="relays without per-address limits")
    ap.add_argument("--skip-single", action="store_true", help="only the tree and direct phases")
    ap.add_argument("--client-concurrency", type=int, default=DEFAULT_CONCURRENCY,
                    help=f"shards each client downloads at once (default {DEFAULT_CONCURRENCY}, the library's)")  # fmt: skip
    ap.add_argument("--wan", help="emulated link of every host, e.g. 'rtt=100ms,down=100mbit,up=100mbit' "
                    "(veriroll.deploy.wan)")
    ap.add_argument("--role", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--relay", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--key", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--go", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "static":
        return role_static(args.dir, args.port)
    if args.role == "client":
        return role_client(args.relay, args.key, args.out, args.go, args.client_concurrency)
    if args.quick:
        args.size_mib, args.clients, args.repeats = 64, 4, 5

    work = Path(args.workdir or tempfile.mkdtemp(prefix="shardcast-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        key = write_keypair(work / "coordinator.key", force=True)
        key_pub = work / "coordinator.key.pub"
        size = args.size_mib << 20
        build_checkpoint(work / "ckpt", size)
        t = time.perf_counter()
        published = publish_checkpoint(work / "ckpt", work / "staging", key, 1)
        publish_s = time.perf_counter() - t
        total = published.total_bytes
        print(
            f"checkpoint {total / 2**20:.1f} MiB, {len(published.manifest.shards)} shards, published in {publish_s:.2f} s"
        )

        origin_store = work / "origin"
        origin_store.mkdir()
        limits = not args.no_address_limits
        origin, origin_url = start_relay(origin_store, key_pub, address_limits=limits)
        # Over an emulated WAN each host (origin, mirror, client) has its own link, and every connection
        # goes through the proxy: a mirror reaches the origin, a client each relay, over both ends' links.
        mirror_upstream = {name: f"http://127.0.0.1:{free_port()}" if args.wan else origin_url for name in ("r1", "r2")}
        r1, r1_url = start_relay(work / "r1", key_pub, upstreams=[mirror_upstream["r1"]], address_limits=limits)
        r2, r2_url = start_relay(work / "r2", key_pub, upstreams=[mirror_upstream["r2"]], address_limits=limits)
        procs += [origin, r1, r2]
        for u in (origin_url, r1_url, r2_url):
            wait_up(u)
        tree_relays: list[str] | list[list[str]] = [r1_url, r2_url]
        direct_relays: list[str] | list[list[str]] = [origin_url]
        if args.wan:
            wan, tree_relays, direct_relays = start_wan(
                work, args.wan, args.clients, {"origin": origin_url, "r1": r1_url, "r2": r2_url}, mirror_upstream
            )
            procs.append(wan)
            wait_up(direct_relays[0][0])

        with RssSampler([origin.pid, r1.pid, r2.pid]) as rss:
            # -- tree: clients wait; the version appears at the origin at t0
            outs = work / "tree"
            outs.mkdir()
            go = work / "go-tree"
            clients = run_clients(args.clients, tree_relays, key_pub, outs, go, args.client_concurrency)
            wait_clients_ready(outs, args.clients)
            t0 = time.time()
            os.rename(version_dir(work / "staging", 1), version_dir(origin_store, 1))
            go.touch()
            results = collect(clients)
            tree_s = max(r["end"] for r in results) - t0
            tree_reach = reach_times(results, t0)
            origin_copies_tree = origin_bytes(origin_url) / total
            print(f"tree: {args.clients} clients via 2 relays in {tree_s:.2f} s, origin served "
                  f"{origin_copies_tree:.2f} copies")  # fmt: skip
            shutil.rmtree(outs)

            # -- direct: the same clients straight from the origin
            before = origin_bytes(origin_url)
            outs = work / "direct"
            outs.mkdir()
            go = work / "go-direct"
            clients = run_clients(args.clients, direct_relays, key_pub, outs, go, args.client_concurrency)
            wait_clients_ready(outs, args.clients)
            t0 = time.time()
            go.touch()
            results = collect(clients)
            direct_s = max(r["end"] for r in results) - t0
            direct_reach = reach_times(results, t0)
            origin_copies_direct = (origin_bytes(origin_url) - before) / total
            print(f"direct: {args.clients} clients from the origin in {direct_s:.2f} s, origin served "
                  f"{origin_copies_direct:.2f} copies")  # fmt: skip
            shutil.rmtree(outs)

            single = None if args.skip_single else measure_single(args, work, origin_store, r1_url, key_pub, published, procs)
        relay_peak_rss_mb = rss.peak / 2**20
        print(f"relay peak RSS {relay_peak_rss_mb:.0f} MB")
        print(
            json.dumps(
                {
                    "single_client_ratio": single["single_client_ratio"] if single else None,
                    "tree_s": round(tree_s, 3),
                    "direct_s": round(direct_s, 3),
                    "origin_copies_tree": round(origin_copies_tree, 3),
                    "origin_copies_direct": round(origin_copies_direct, 3),
                    **{f"time_to_{k}_s_tree": v for k, v in tree_reach.items()},
                    **{f"time_to_{k}_s_direct": v for k, v in direct_reach.items()},
                    "wan": args.wan or None,
                    "relay_peak_rss_mb": round(relay_peak_rss_mb, 1),
                    **{k: v for k, v in (single or {}).items() if k != "single_client_ratio"},
                    "address_limits": not args.no_address_limits,
                    "client_concurrency": args.client_concurrency,
                    "publish_s": round(publish_s, 3),
                    "size_mib": round(total / 2**20, 1),
                    "clients": args.clients,
                    "repeats": args.repeats,
                    "cpus": os.cpu_count(),
                }
            )
        )
    finally:
        stop_processes(procs, 15)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
