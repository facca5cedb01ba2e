"""A bare grpc.aio echo's server CPU per call at a fixed call rate, over few or many TLS connections.

What gRPC alone costs per call where a coordinator edge actually runs: a fleet of nodes, each on its own
connection, calling a few times a second, rather than a few busy connections (``intake.py``'s echo,
which measures gRPC at saturation). The server is ``intake.py``'s echo (TLS, the SubmitAndLease method,
a 7 kB request, a lease-sized answer); two client processes spread ``--channels`` connections and
``--rate`` calls/s between them, each connection calling at a jittered steady pace after one warm-up call
(its TLS handshake, outside the measured window).

    .venv/bin/python benchmarks/echo_channels.py [--channels 8,500] [--rate 300] [--seconds 15]

Prints a line per channel count, then one JSON object: ``runs`` ({channels, calls_per_s,
server_cpu_ms_per_call}), and ``ratio`` (the most channels' CPU per call over the fewest's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1] / "tests"))


def client_main(port: int, channels: int, rate: float, start_at: float, stop_at: float, ca_path: str) -> int:
    """One client process: ``channels`` connections, ``rate`` calls/s in all, counted from ``start_at``."""
    from veriroll.protos.service import secure_channel

    ca = Path(ca_path).read_bytes()
    body = os.urandom(7000)
    period = channels / rate  # seconds between one connection's calls

    async def main() -> int:
        chans = [secure_channel(f"127.0.0.1:{port}", ca, server_name="localhost") for _ in range(channels)]
        done = 0

        async def one(ch) -> None:
            nonlocal done
            call = ch.unary_unary("/bench.Echo/SubmitAndLease")
            await call(body, timeout=30)  # the handshake, before the window
            await asyncio.sleep(max(0.0, start_at - time.time()) + random.uniform(0, period))
            while time.time() < stop_at:
                t = time.time()
                await call(body, timeout=30)
                done += 1
                await asyncio.sleep(max(0.0, period - (time.time() - t)) * random.uniform(0.8, 1.2))

        await asyncio.gather(*(one(c) for c in chans))
        for c in chans:
            await c.close()
        return done

    print(asyncio.run(main()))
    return 0


def main() -> int:
    from procs import sigterm_as_interrupt  # a sibling script (not needed where this is imported)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--channels", default="8,500", help="comma-separated connection counts")
    ap.add_argument("--rate", type=float, default=300.0, help="calls/s offered in all")
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window per channel count")
    ap.add_argument("--client", nargs=6, help=argparse.SUPPRESS)  # (internal) run as a client process
    args = ap.parse_args()
    if args.client:
        port, channels, rate, start_at, stop_at, ca = args.client
        return client_main(int(port), int(channels), float(rate), float(start_at), float(stop_at), ca)
    sigterm_as_interrupt()  # so the finally blocks below stop what this started

    import psutil
    from intake import ECHO_SERVER
    from support import make_coordinator_dir

    root = Path(tempfile.mkdtemp(prefix="veriroll-bench-echo-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    server = None
    runs = []
    try:
        tls = make_coordinator_dir(root, {}) / "tls"
        port_file = root / "echo.port"
        server = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, str(tls / "server.crt"), str(tls / "server.key"),
                                   str(port_file), "300"], env=env)
        for _ in range(600):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.1)
        port = int(port_file.read_text())
        proc = psutil.Process(server.pid)
        for channels in [int(c) for c in args.channels.split(",")]:
            # Connections open and shake hands first (up to a few seconds for hundreds); the window starts after.
            start_at = time.time() + 3.0 + channels / 200
            stop_at = start_at + args.seconds
            clients = [subprocess.Popen([sys.executable, str(HERE), "--client", str(port), str(channels // 2),
                                         str(args.rate / 2), str(start_at), str(stop_at), str(tls / "ca.crt")],
                                        stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
            time.sleep(max(0.0, start_at - time.time()))
            t0 = sum(proc.cpu_times()[:2])
            time.sleep(max(0.0, stop_at - time.time()))
            t1 = sum(proc.cpu_times()[:2])
            calls = sum(int(c.communicate(timeout=120)[0].split()[-1]) for c in clients)
            run = {"channels": channels, "calls_per_s": round(calls / args.seconds, 1),
                   "server_cpu_ms_per_call": round(1000 * (t1 - t0) / calls, 3) if calls else None}
            print(f"{channels} connections: {run['calls_per_s']} calls/s, {run['server_cpu_ms_per_call']} ms of "
                  f"server CPU per call", flush=True)
            runs.append(run)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    first, last = runs[0]["server_cpu_ms_per_call"], runs[-1]["server_cpu_ms_per_call"]
    print(json.dumps({"runs": runs, "rate": args.rate, "seconds": args.seconds,
                      "ratio": round(last / first, 2) if first and last else None}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
