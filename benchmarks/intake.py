"""Intake throughput: signed clients submitting 8x64-token groups to the real coordinator (verification
off), against a bare grpc.aio echo of the same message sizes, in the same run.

Each simulated node submits a group and gets its next lease in the same call (SubmitGroupRequest's
next_leases, as the node does; LeaseWork only when none came with it); the echo server answers one call
per group with the same sizes (a group in, a lease out). The protocol before, LeaseWork then SubmitGroup
per group, is measured too, against an echo of those two calls. The coordinator runs as its own process (`veriroll coordinator run`) with TLS,
the SQLite store and group commit; the echo server likewise with TLS. Clients run in one process, apart
from both servers; each intake client signs every request and builds its group's samples once (the
echo client sends prebuilt bytes), since what a node spends generating a group is no part of intake.
The coordinator, the echo server and the clients run on the same kind of event loop (``--event-loop``,
default ``auto``: uvloop where it is installed, as the coordinator's ``server.event_loop``).

Prints one JSON line last: intake_groups_per_s, echo_per_s, ratio (totals over all rounds), ratio_median
(of the rounds' ratios: on a shared machine one round can catch a burst of someone else's load),
p50_ms, p99_ms (submit latency), and the CPU each server spent: edge_cpu_ms_per_group (the coordinator's
process and its reward workers, over the intake rounds) and echo_cpu_ms_per_call (the echo server, per
group's calls); the same with the suffix _two_calls for the protocol before. Target: ratio >= 0.5.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import PROVEN_FLEET

from veriroll.coordinator.event_loop import EVENT_LOOPS, loop_runner

ECHO_SERVER = r'''
import asyncio, sys, grpc
from veriroll.coordinator.event_loop import loop_runner
async def main(cert, key, port_file, lease_size, event_loop):
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 32 << 20)])
    small = b"\x08\x01" * 8
    leased = bytes(int(lease_size))
    async def echo(body, context):
        return small
    async def echo_lease(body, context):
        return leased
    handlers = {"/bench.Echo/Lease": grpc.unary_unary_rpc_method_handler(echo),
                "/bench.Echo/Submit": grpc.unary_unary_rpc_method_handler(echo),
                "/bench.Echo/SubmitAndLease": grpc.unary_unary_rpc_method_handler(echo_lease)}
    class H(grpc.GenericRpcHandler):
        def service(self, d):
            return handlers.get(d.method)
    server.add_generic_rpc_handlers((H(),))
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(open(key, "rb").read(), open(cert, "rb").read())]))
    await server.start()
    open(port_file, "w").write(str(port))
    await server.wait_for_termination()
loop_runner(sys.argv[5])[1](main(*sys.argv[1:]))
'''


def make_samples(lease, pb) -> list:
    """A group's samples for ``lease``'s shape: the same every time (generating them is no part of intake)."""
    t = lease.max_new_tokens
    rng = np.random.default_rng(0)
    return [pb.Sample(token_ids=rng.integers(4, 14, t).tolist(), logprobs=np.full(t, -0.5, "<f4").tobytes(),
                      proof=bytes(258 * 2 + 16), finish_reason="length") for _ in range(lease.group_size)]


def make_group(lease, pb, samples: list | None = None):
    return pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version,
                                 samples=samples if samples is not None else make_samples(lease, pb))


async def intake_load(address: str, ca: bytes, clients: int, seconds: float, *,
                      lease_in_submit: bool = True) -> tuple[int, list[float]]:
    from veriroll.protos.identity import PrivateKey
    from veriroll.protos.service import SignedStub, secure_channel
    from veriroll.protos.v1 import coordinator_pb2 as pb

    channels = [secure_channel(address, ca, server_name="localhost") for _ in range(max(1, clients // 8))]
    latencies: list[float] = []
    done = 0
    stop_at = time.perf_counter() + seconds

    async def node(i: int):
        nonlocal done
        key = PrivateKey.generate()
        stub = SignedStub(channels[i % len(channels)], key, timeout=30)
        await stub.register(pb.RegisterRequest(public_key=key.public.raw))
        samples = None  # built once per client: every lease of this run has the same shape
        ask = pb.LeaseRequest(max_leases=1)
        leased = None
        while time.perf_counter() < stop_at:
            resp, leased = leased, None
            if resp is None:
                resp = await stub.lease_work(ask)
            if not resp.leases:
                await asyncio.sleep(0.01)
                continue
            samples = samples or make_samples(resp.leases[0], pb)
            group = make_group(resp.leases[0], pb, samples)
            if lease_in_submit:
                group.next_leases.CopyFrom(ask)
            t0 = time.perf_counter()
            answer = await stub.submit_group(group)
            latencies.append(time.perf_counter() - t0)
            if lease_in_submit:
                leased = answer.next_leases
            done += 1

    await asyncio.gather(*(node(i) for i in range(clients)))
    for c in channels:
        await c.close()
    return done, latencies


async def echo_load(address: str, ca: bytes, clients: int, seconds: float, lease_bytes: bytes, group_bytes: bytes,
                    *, lease_in_submit: bool = True) -> int:
    import grpc

    from veriroll.protos.service import secure_channel
    from veriroll.protos.v1 import coordinator_pb2 as pb

    channels = [secure_channel(address, ca, server_name="localhost") for _ in range(max(1, clients // 8))]
    done = 0
    stop_at = time.perf_counter() + seconds
    ask_bytes = pb.SubmitGroupRequest(next_leases=pb.LeaseRequest(max_leases=1)).SerializeToString()

    async def client(i: int):
        nonlocal done
        ch = channels[i % len(channels)]
        lease = ch.unary_unary("/bench.Echo/Lease")
        submit = ch.unary_unary("/bench.Echo/Submit")
        submit_and_lease = ch.unary_unary("/bench.Echo/SubmitAndLease")
        while time.perf_counter() < stop_at:
            if lease_in_submit:
                # Same sizes on the wire as the protocol: a group (and its lease request) answered by a lease.
                await submit_and_lease(group_bytes + ask_bytes, timeout=30)
            else:
                # The protocol before: a lease-sized exchange, then a group-sized request.
                await lease(lease_bytes, timeout=30)
                await submit(group_bytes, timeout=30)
            done += 1

    await asyncio.gather(*(client(i) for i in range(clients)))
    for c in channels:
        await c.close()
    _ = grpc
    return done


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its live children (the coordinator's reward workers)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def main() -> int:
    from procs import sigterm_as_interrupt  # a sibling script (not needed where this is imported)

    sigterm_as_interrupt()  # so the finally blocks below stop what this started
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (under a minute)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=20.0, help="of each load, over all rounds")
    ap.add_argument("--rounds", type=int, default=2, help="echo and intake take turns this many times")
    ap.add_argument("--event-loop", default="auto", choices=EVENT_LOOPS,
                    help="the loop of the coordinator, the echo server and the clients alike (server.event_loop)")
    args = ap.parse_args()
    loop_name, run, _ = loop_runner(args.event_loop)
    seconds = 8.0 if args.quick else args.seconds
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from support import make_coordinator_dir

    from veriroll.protos.v1 import coordinator_pb2 as pb

    root = Path(tempfile.mkdtemp(prefix="veriroll-bench-intake-"))
    base = make_coordinator_dir(root, {
        "leases.group_size": 8, "leases.max_new_tokens": 64, "leases.queue_maxsize": 10**9,
        "leases.max_open_per_node": 4, "leases.ttl_s": 600, "server.key_rate_per_s": 1e6, "server.key_burst": 1e6,
        "server.peer_rate_per_s": 1e6, "server.peer_burst": 1e6, "intake.verify": False,
        **PROVEN_FLEET, "leases.probation_max_open": 4, "server.event_loop": args.event_loop,
    })
    ca = (base / "tls" / "ca.crt").read_bytes()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    veriroll = str(Path(sys.executable).parent / "veriroll")
    coord = subprocess.Popen([veriroll, "coordinator", "run", "--dir", str(base), "--log-level", "warning"], env=env)
    lease_example = pb.LeaseResponse(leases=[pb.Lease(lease_id="0" * 24, prompt_ids=list(range(5)), group_size=8,
                                                      temperature=1.0, max_new_tokens=64, seeds=[2**63] * 8,
                                                      policy_version=0, deadline_ms=2**40, stop_token_ids=[2],
                                                      environment="arithmetic")])
    lease_bytes = lease_example.SerializeToString()
    group_example = make_group(lease_example.leases[0], pb).SerializeToString()
    echo_port_file = root / "echo.port"
    echo = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, str(base / "tls" / "server.crt"),
                             str(base / "tls" / "server.key"), str(echo_port_file), str(len(lease_bytes)),
                             args.event_loop], env=env)
    result: dict = {}
    try:
        for _ in range(600):
            if (base / "ports.json").exists() and echo_port_file.exists():
                break
            time.sleep(0.1)
        port = json.loads((base / "ports.json").read_text())["grpc"]
        echo_port = int(echo_port_file.read_text())
        # Warm both up, then measure echo and intake back to back.
        run(echo_load(f"127.0.0.1:{echo_port}", ca, 4, 1.0, lease_bytes, group_example))
        run(intake_load(f"127.0.0.1:{port}", ca, 4, 1.0))
        for suffix, lease_in_submit in (("", True), ("_two_calls", False)):
            # Alternate the two loads in rounds so a change in background load hits both alike.
            echo_n = intake_n = 0
            echo_cpu = intake_cpu = 0.0
            lat: list[float] = []
            ratios: list[float] = []
            for _ in range(args.rounds):
                before = cpu_seconds(echo.pid)
                e = run(echo_load(f"127.0.0.1:{echo_port}", ca, args.clients, seconds / args.rounds,
                                  lease_bytes, group_example, lease_in_submit=lease_in_submit))
                echo_cpu += cpu_seconds(echo.pid) - before
                before = cpu_seconds(coord.pid)
                n, round_lat = run(intake_load(f"127.0.0.1:{port}", ca, args.clients, seconds / args.rounds,
                                               lease_in_submit=lease_in_submit))
                intake_cpu += cpu_seconds(coord.pid) - before
                echo_n += e
                intake_n += n
                lat += round_lat
                ratios.append(n / e if e else float("nan"))
            intake_rate, echo_rate = intake_n / seconds, echo_n / seconds
            lat_ms = np.array(lat) * 1000 if lat else np.array([float("nan")])
            result |= {
                f"intake_groups_per_s{suffix}": round(intake_rate, 1),
                f"echo_per_s{suffix}": round(echo_rate, 1),
                f"ratio{suffix}": round(intake_rate / echo_rate, 3) if echo_rate else None,
                f"ratio_median{suffix}": round(float(np.median(ratios)), 3),
                f"edge_cpu_ms_per_group{suffix}": round(1000 * intake_cpu / intake_n, 3) if intake_n else None,
                f"echo_cpu_ms_per_call{suffix}": round(1000 * echo_cpu / echo_n, 3) if echo_n else None,
                f"p50_ms{suffix}": round(float(np.percentile(lat_ms, 50)), 2),
                f"p99_ms{suffix}": round(float(np.percentile(lat_ms, 99)), 2),
            }
    finally:
        coord.terminate()
        echo.terminate()
        coord.wait(timeout=30)
        echo.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
    result |= {
        "clients": args.clients,
        "seconds": seconds,
        "rounds": args.rounds,
        "group": "8x64 tokens",
        "event_loop": loop_name,
        "target_ratio": 0.5,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
