"""Scale: one real coordinator against hundreds of simulated nodes on loopback, and where it saturates.

The coordinator runs as its own process (``veriroll coordinator run``: TLS, the SQLite store with group
commit, verification and trainer off, a queue that never fills, generous rate limits). Each simulated
node is a real client with its own Ed25519 key and its own TLS connection: it registers, heartbeats
every ``--heartbeat-s`` seconds, and loops lease → think (lognormal, median ``--think-s``, standing
in for generation) → SubmitGroup of a correctly shaped group (``--group-size`` x ``--tokens``); as a node
does, it asks for its next lease inside the submission (``next_leases``), so LeaseWork is called only
when none came with it (``--separate-lease-calls``: a LeaseWork call per group, the protocol before). The
nodes live in ``--client-procs`` client processes. Every scale gets a fresh coordinator; nodes start
staggered (at most ``--ramp-rate`` per second), and only calls that end inside the ``--measure-s``
window after the ramp are counted.

Per scale: leases and accepted submissions per second held (and the rate the nodes would offer if the
coordinator answered instantly), p50/p99 client latency per method and the server's own mean time per
method (from its ``/metrics``), errors by method and reason, and the coordinator's CPU (all threads,
and the main thread that runs the event loop), RSS and CPU per accepted group. Two fixed costs are
measured on the side: one Ed25519 verification and one SQLite commit in the coordinator's directory.
From these the script names the resource that runs out first and what to split.

Past one process, the same fleet (``--edge-nodes`` at ``--edge-think-s``, offering more than one edge
holds) meets one ``--role all`` process on SQLite, then one and two ``--role edge`` processes sharing
one gRPC port (SO_REUSEPORT) on a throwaway PostgreSQL cluster (tests/pg_cluster.py; fsync off), no
trainer; then ``--fleet-nodes`` at ``--think-s`` meet one SQLite process and the two edges. Each run stands beside the
planner's prediction (coordinator/plan.py) from the unit costs that run measured (CPU per accepted group
of the edges, the clients and PostgreSQL) on this machine's model: its cores, less what other processes
took in the window, shared by the edges, PostgreSQL and the clients. benchmarks/intake.py and, where it exists,
benchmarks/verify_pool.py run as children for ``intake_ratio`` and ``verify_groups_per_s_1/_2``.

    .venv/bin/python benchmarks/scale.py [--quick] [--scales 100,300,1000] [--measure-s 30] [--think-s 3]
        [--edge-nodes 600] [--edge-think-s 1.5] [--fleet-nodes 1000]

``--quick`` is 100 and 300 nodes, then the scale-out runs, with short windows (under ten minutes).
Prints one human line per run and the verdict, then one JSON line: ``groups_per_s`` (per deployment),
``edge_scaling`` (2 edges / 1 edge on PostgreSQL) and ``edge_scaling_cpu_bound`` (the most this
machine's cores allow with the clients on them), ``fleet_held_fraction`` and ``fleet_submit_p99_ms``
(``--fleet-nodes`` on 2 edges; ``fleet_sqlite_held_fraction`` and ``fleet_sqlite_submit_p99_ms`` the same
fleet on one SQLite process), ``predicted_groups_per_s`` / ``measured_groups_per_s`` (that run), ``predicted_ratio`` (predicted / measured,
per deployment),
``intake_ratio``, ``verify_groups_per_s_1/_2``, ``scale_out`` (every run's figures), ``scales`` (the
sweep's per-scale figures), ``verdict``, ``saturation``, ``fixed_costs``, ``config``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve()
METHODS = ("Register", "Heartbeat", "LeaseWork", "SubmitGroup")
# Every simulated key is new, so the probation caps (16 open leases for all probation nodes together, 240
# leases per node-hour) would be what a fleet benchmark measures, not the coordinator: they are lifted, as
# for a fleet of proven nodes. (benchmarks/abuse.py measures the caps themselves.)
PROVEN_FLEET = {"leases.probation_share": 1.0, "leases.probation_floor": 10**6, "leases.probation_max_open": 2,
                "leases.probation_leases_per_hour": 1e9, "leases.probation_lease_burst": 1e6,
                "intake.probation_groups": 0}


# --- the simulated nodes (client processes) -------------------------------------------------------


class Recorder:
    """Outcomes of calls that end inside the measurement window (wall clock, shared across processes)."""

    def __init__(self, start: float, end: float):
        self.start, self.end = start, end
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.ok: Counter = Counter()
        self.errors: dict[str, Counter] = defaultdict(Counter)
        self.examples: dict[str, str] = {}  # reason -> the first message seen, to tell causes apart
        self.no_lease: Counter = Counter()
        self.leases = 0

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end

    def record(self, method: str, t0: float, error: str | None, detail: str = "") -> None:
        t1 = time.time()
        if not self.inside(t1):
            return
        if error is None:
            self.ok[method] += 1
            self.latencies[method].append(t1 - t0)
        else:
            self.errors[method][error] += 1
            self.examples.setdefault(error, detail[:200])


async def call(rec: Recorder, method: str, awaitable):
    """Await one RPC and record it; returns the response or None (the reason is recorded)."""
    from veriroll.protos.service import CallError

    t0 = time.time()
    try:
        resp = await awaitable
    except CallError as err:
        rec.record(method, t0, err.reason, err.details)
        return None
    except (TimeoutError, OSError) as err:
        rec.record(method, t0, type(err).__name__, str(err))
        return None
    rec.record(method, t0, None)
    return resp


def group_tail(pb, group_size: int, tokens: int) -> bytes:
    """The samples of a correctly shaped group, serialized once: every submission reuses them.

    A SubmitGroupRequest is then the lease's own fields serialized and this appended (protobuf
    concatenation merges repeated fields), so a node spends no CPU building groups.
    """
    import numpy as np

    rng = random.Random(0)
    samples = [pb.Sample(token_ids=[rng.randrange(4, 14) for _ in range(tokens)],
                         logprobs=np.full(tokens, -0.5, dtype="<f4").tobytes(),
                         proof=bytes(258 * ((tokens + 31) // 32) + 16), finish_reason="length")
               for _ in range(group_size)]
    return pb.SubmitGroupRequest(samples=samples).SerializeToString()


async def run_nodes(spec: dict) -> dict:
    """Run ``spec['nodes']`` simulated nodes until ``spec['stop_at']``; returns what was recorded."""
    import resource

    from veriroll.protos.identity import PrivateKey
    from veriroll.protos.service import SignedStub, secure_channel
    from veriroll.protos.v1 import coordinator_pb2 as pb

    rec = Recorder(spec["measure_from"], spec["measure_to"])
    ca = Path(spec["ca"]).read_bytes()
    stop_at = spec["stop_at"]
    rng = random.Random(spec["seed"])
    mu, sigma = math.log(spec["think_s"]), spec["think_sigma"]
    tails: dict[tuple[int, int], bytes] = {}
    n = spec["nodes"]
    ask = pb.LeaseRequest(max_leases=1, loaded_version=0)

    async def sleep_until(t: float) -> None:
        await asyncio.sleep(max(0.0, t - time.time()))

    async def heartbeats(stub) -> None:
        await asyncio.sleep(rng.uniform(0, spec["heartbeat_s"]))
        while time.time() + spec["heartbeat_s"] < stop_at:
            await call(rec, "Heartbeat", stub.heartbeat(pb.HeartbeatRequest(loaded_version=0)))
            await asyncio.sleep(spec["heartbeat_s"] * rng.uniform(0.8, 1.2))

    async def node(i: int) -> None:
        await sleep_until(spec["t0"] + spec["ramp_s"] * i / max(n, 1))
        key = PrivateKey.generate()
        channel = secure_channel(spec["address"], ca, server_name="localhost")
        stub = SignedStub(channel, key, timeout=spec["call_timeout_s"])
        beat = None
        try:
            while time.time() < stop_at:
                if await call(rec, "Register", stub.register(pb.RegisterRequest(
                        public_key=key.public.raw, software_version="scale-sim", display_name=f"sim-{i}"))):
                    break
                await asyncio.sleep(1.0)
            beat = asyncio.create_task(heartbeats(stub))
            leased = None  # leases that came with the last accepted group (SubmitGroupRequest.next_leases)
            while time.time() < stop_at:
                resp, leased = leased, None
                if resp is None:
                    resp = await call(rec, "LeaseWork", stub.lease_work(ask))
                if resp is None:
                    await asyncio.sleep(1.0)
                    continue
                if not resp.leases:
                    if rec.inside(time.time()):
                        rec.no_lease[resp.wait_reason or "none"] += 1
                    await asyncio.sleep(max(resp.retry_after_ms, 100) / 1000)
                    continue
                if rec.inside(time.time()):
                    rec.leases += len(resp.leases)
                lease = resp.leases[0]
                think = rng.lognormvariate(mu, sigma)
                if time.time() + think >= stop_at:
                    break  # the run ends mid-generation: the lease is simply abandoned
                await asyncio.sleep(think)
                shape = (lease.group_size, lease.max_new_tokens)
                if shape not in tails:
                    tails[shape] = group_tail(pb, *shape)
                # As a node does: the next lease is asked for in the submission (unless told not to).
                body = pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version,
                                             next_leases=ask if spec["lease_in_submit"] else None
                                             ).SerializeToString() + tails[shape]
                answer = await call(rec, "SubmitGroup", stub.call_raw("SubmitGroup", body))
                if answer is not None and spec["lease_in_submit"]:
                    leased = answer.next_leases
        finally:
            if beat is not None:
                # Cancel the heartbeat task itself first: closing the channel under an in-flight call
                # would end it as a CANCELLED call and count our own shutdown as an error.
                beat.cancel()
                await asyncio.gather(beat, return_exceptions=True)
            await channel.close()

    tasks = [asyncio.create_task(node(i)) for i in range(n)]
    await sleep_until(spec["measure_from"])
    cpu_a = resource.getrusage(resource.RUSAGE_SELF)
    await sleep_until(spec["measure_to"])
    cpu_b = resource.getrusage(resource.RUSAGE_SELF)
    # Every loop checks stop_at and every call has a deadline: the nodes end by themselves.
    done, pending = await asyncio.wait(tasks, timeout=spec["call_timeout_s"] + 5)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return {
        "latencies": {m: v for m, v in rec.latencies.items()},
        "ok": dict(rec.ok),
        "errors": {m: dict(c) for m, c in rec.errors.items()},
        "error_examples": rec.examples,
        "no_lease": dict(rec.no_lease),
        "leases": rec.leases,
        "cpu_s": (cpu_b.ru_utime + cpu_b.ru_stime) - (cpu_a.ru_utime + cpu_a.ru_stime),
        "unfinished": len(pending),
    }


def worker_main(spec_json: str) -> int:
    from veriroll.coordinator.event_loop import loop_runner

    spec = json.loads(spec_json)
    result = loop_runner("auto")[1](run_nodes(spec))  # the coordinators' loop too (server.event_loop = auto)
    # os.write until all is out: after uvloop ran in this process, a write to the pipe larger than its 64 KiB
    # can return short, and sys.stdout.write then drops the rest without a word (seen with 1,000 nodes
    # measured for 30 s: the parent read 65,536 bytes of a 270 kB line).
    data = memoryview((json.dumps(result) + "\n").encode())
    while data:
        data = data[os.write(sys.stdout.fileno(), data):]
    return 0


# --- the coordinator side ---------------------------------------------------------------------------


def thread_cpu(pid: int) -> tuple[float, float]:
    """(all threads, main thread) CPU seconds of process ``pid``."""
    import psutil

    p = psutil.Process(pid)
    total = sum(p.cpu_times()[:2])
    main = next((t.user_time + t.system_time for t in p.threads() if t.id == pid), 0.0)
    return total, main


WRITER_SERIES = {"wall_s": 'veriroll_store_writer_seconds_total{clock="wall"}',
                 "cpu_s": 'veriroll_store_writer_seconds_total{clock="cpu"}',
                 "ops": "veriroll_store_writer_ops_total", "batches": "veriroll_store_writer_batches_total",
                 "round_trips": "veriroll_store_round_trips_total"}


def server_figures(http_port: int) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """From the coordinator's /metrics: method -> (sum of server seconds, count), and its store writer's
    totals (WRITER_SERIES' names)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}, {}
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for m in re.finditer(r'^veriroll_request_seconds_(sum|count)\{method="(\w+)"\} (\S+)$', text, re.M):
        out[m.group(2)][0 if m.group(1) == "sum" else 1] = float(m.group(3))
    series = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    writer = {name: float(series[key]) for name, key in WRITER_SERIES.items() if key in series}
    return {k: (v[0], v[1]) for k, v in out.items()}, writer


class RssSampler(threading.Thread):
    """The coordinator processes' peak resident memory (summed), sampled every 0.25 s until stopped."""

    def __init__(self, pids: list[int]):
        super().__init__(daemon=True)
        self.pids, self.peak, self._halt = pids, 0, threading.Event()

    def run(self) -> None:
        import psutil

        procs = [psutil.Process(pid) for pid in self.pids]
        while not self._halt.wait(0.25):
            try:
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))
            except psutil.Error:
                return

    def stop(self) -> int:
        self._halt.set()
        self.join(timeout=2)
        return self.peak


def fixed_costs(coord_dir: Path) -> dict:
    """One Ed25519 verification and one durable SQLite commit, measured on this machine."""
    from veriroll.coordinator import store as st
    from veriroll.protos.identity import PrivateKey

    key = PrivateKey.generate()
    msg = os.urandom(200)
    sig = key.sign(msg)
    t = time.process_time()
    for _ in range(300):
        key.public.verify(sig, msg)
    verify_us = (time.process_time() - t) / 300 * 1e6
    path = coord_dir / "commit-probe.db"
    conn = st.connect(path)
    conn.execute("CREATE TABLE IF NOT EXISTS probe (x INTEGER)")
    t = time.perf_counter()
    for i in range(40):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO probe VALUES (?)", (i,))
        conn.execute("COMMIT")
    commit_ms = (time.perf_counter() - t) / 40 * 1000
    conn.close()
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    return {"ed25519_verify_us": round(verify_us, 1), "sqlite_commit_ms": round(commit_ms, 2)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_coordinator(base: Path, role: str, grpc_port: int, http_port: int, env: dict) -> subprocess.Popen:
    """``veriroll coordinator run --role ROLE`` on DIR ``base``, once its /healthz answers (it reaches its store)."""
    veriroll = str(Path(sys.executable).parent / "veriroll")
    proc = subprocess.Popen([veriroll, "coordinator", "run", "--dir", str(base), "--log-level", "warning",
                             "--role", role, "--set", f"server.port={grpc_port}",
                             "--set", f"server.http_port={http_port}"], env=env)
    deadline = time.time() + 120
    try:
        while True:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"coordinator role {role} did not start (exit code {proc.poll()})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return proc
            except OSError:
                time.sleep(0.2)
    except BaseException:  # not started, or interrupted while it starts: the caller does not know it yet
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        raise


def process_tree_cpu(pid: int) -> dict[int, float]:
    """pid -> CPU seconds of process ``pid`` and its children (PostgreSQL's postmaster and backends)."""
    import psutil

    out = {}
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                out[p.pid] = sum(p.cpu_times()[:2])
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return out


def machine_busy_s() -> float:
    """CPU seconds every core of this machine has spent busy so far (all processes and the kernel)."""
    import psutil

    t = psutil.cpu_times()
    # steal is time the hypervisor gave to another machine: not a core this one could use either way.
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def machine_steal_s() -> float:
    """CPU seconds the hypervisor has given this machine's cores to another machine so far (Linux's steal
    time; 0 where it is not reported): cores this machine wanted and could not use."""
    import psutil

    return getattr(psutil.cpu_times(), "steal", 0.0)


def run_scale(nodes: int, args, root: Path, *, database: str | None = None, edges: int = 1,
              store_pid: int | None = None, label: str = "") -> dict:
    """One fresh deployment, ``nodes`` simulated nodes, one measurement window.

    With ``database`` None: one ``--role all`` process on SQLite (today's single coordinator). With a
    postgresql:// URL: ``edges`` processes ``--role edge`` sharing one gRPC port (SO_REUSEPORT), no trainer.
    ``store_pid`` (PostgreSQL's postmaster) adds the store's own CPU to the figures.
    """
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from support import make_coordinator_dir

    work = root / (label or f"n{nodes}")
    work.mkdir()
    base = make_coordinator_dir(work, {
        "leases.group_size": args.group_size, "leases.max_new_tokens": args.tokens, "leases.queue_maxsize": 10**9,
        "leases.ttl_s": 120, "leases.max_open_per_node": 2, "intake.verify": False, "trainer.enabled": False,
        "server.key_rate_per_s": 1000.0, "server.key_burst": 1000.0, "server.peer_rate_per_s": 1e6,
        "server.peer_burst": 1e6, "server.max_concurrent_rpcs": 16384, **PROVEN_FLEET,
        # The whole fleet connects from 127.0.0.1: one address's in-flight cap would refuse it as one NAT.
        "server.max_inflight_per_address": 10**6, **({"database": database} if database else {}),
    })
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    grpc_port = free_port()
    roles = ["all"] if database is None else ["edge"] * edges
    coords: list[subprocess.Popen] = []
    http_ports: list[int] = []
    workers: list[subprocess.Popen] = []
    sampler = None
    try:
        # One at a time: the first creates the schema, and each must bind before the next shares its port.
        for role in roles:
            http_ports.append(free_port())
            coords.append(start_coordinator(base, role, grpc_port, http_ports[-1], env))
        pids = [c.pid for c in coords]
        t0 = time.time() + 2.0  # client processes import and generate keys meanwhile
        # Connecting (TLS) and registering are not the steady state: start at most --ramp-rate nodes/s.
        ramp_s = max(args.ramp_s, nodes / args.ramp_rate)
        measure_from = t0 + ramp_s + args.settle_s
        spec = {"address": f"127.0.0.1:{grpc_port}", "ca": str(base / "tls" / "ca.crt"), "t0": t0,
                "ramp_s": ramp_s, "measure_from": measure_from, "measure_to": measure_from + args.measure_s,
                "stop_at": measure_from + args.measure_s, "think_s": args.think_s, "think_sigma": args.think_sigma,
                "heartbeat_s": args.heartbeat_s, "call_timeout_s": args.call_timeout_s,
                "lease_in_submit": not getattr(args, "separate_lease_calls", False)}
        procs = max(1, min(args.client_procs, nodes))
        for w in range(procs):
            share = nodes // procs + (1 if w < nodes % procs else 0)
            wspec = dict(spec, nodes=share, seed=1000 * nodes + w)
            workers.append(subprocess.Popen([sys.executable, str(HERE), "--worker", json.dumps(wspec)],
                                            env=env, stdout=subprocess.PIPE, text=True))
        sampler = RssSampler(pids)
        sampler.start()
        time.sleep(max(0.0, measure_from - time.time()))
        cpu_a = [thread_cpu(pid) for pid in pids]
        srv_a = [server_figures(port) for port in http_ports]
        store_a = process_tree_cpu(store_pid) if store_pid else {}
        busy_a, steal_a = machine_busy_s(), machine_steal_s()
        time.sleep(max(0.0, spec["measure_to"] - time.time()))
        busy_b, steal_b = machine_busy_s(), machine_steal_s()
        cpu_b = [thread_cpu(pid) for pid in pids]
        srv_b = [server_figures(port) for port in http_ports]
        store_b = process_tree_cpu(store_pid) if store_pid else {}
        import psutil

        rss = sum(psutil.Process(pid).memory_info().rss for pid in pids)
        results = []
        for w in workers:
            out, _ = w.communicate(timeout=args.call_timeout_s + 60)
            if w.returncode != 0 or not out.strip():
                raise RuntimeError(f"a client process failed (exit code {w.returncode})")
            results.append(json.loads(out.strip().splitlines()[-1]))
        peak = sampler.stop()
    finally:
        if sampler is not None:
            sampler.stop()
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=10)
        for coord in coords:
            coord.send_signal(signal.SIGTERM)
        for coord in coords:
            try:
                coord.wait(timeout=30)
            except subprocess.TimeoutExpired:
                coord.kill()
                coord.wait(timeout=10)
    spent = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(cpu_a, cpu_b, strict=True)]
    cpu = (sum(total for total, _ in spent), sum(main for _, main in spent))
    figures = summarize(nodes, args, results, cpu, merge_server_seconds([m for m, _ in srv_a]),
                        merge_server_seconds([m for m, _ in srv_b]), rss, peak)
    figures["store_writer"] = writer_figures([w for _, w in srv_a], [w for _, w in srv_b], args.measure_s,
                                             figures["submissions_per_s"] * args.measure_s)
    # Backends that lived through the window; one that came or went meanwhile is left out.
    store_s = sum(store_b[pid] - store_a[pid] for pid in store_a.keys() & store_b.keys())
    figures["deployment"] = {"store": "sqlite" if database is None else "postgresql", "roles": roles,
                             "store_cores": round(store_s / args.measure_s, 2) if store_pid else None}
    # Cores busy outside the deployment and its clients: other tenants of this machine, the kernel's
    # loopback network work not charged to a process, this driver. They are not the deployment's to use.
    ours = cpu[0] + store_s + figures["client_cpu_cores"] * args.measure_s
    figures["other_cores"] = round(max(0.0, busy_b - busy_a - ours) / args.measure_s, 2)
    # Cores the hypervisor took (a VM's noisy neighbours): not there for anyone on this machine.
    figures["steal_cores"] = round(max(0.0, steal_b - steal_a) / args.measure_s, 2)
    return figures


def writer_figures(before: list[dict[str, float]], after: list[dict[str, float]], window_s: float,
                   accepted: float) -> dict | None:
    """The store writers' work over the window (each edge process has one): the share of the window each was
    busy in a transaction (mean over processes), its wall and CPU time per accepted group, ops per group and
    per transaction, and on PostgreSQL its round trips per group. The writers' ops include the heartbeats'."""
    if not accepted or not all(before) or len(before) != len(after):
        return None
    d = {name: sum(b.get(name, 0.0) - a.get(name, 0.0) for a, b in zip(before, after, strict=True))
         for name in WRITER_SERIES}
    return {"busy_fraction": round(d["wall_s"] / window_s / len(before), 3),
            "wall_ms_per_group": round(d["wall_s"] / accepted * 1000, 3),
            "cpu_ms_per_group": round(d["cpu_s"] / accepted * 1000, 3),
            "ops_per_group": round(d["ops"] / accepted, 2),
            "ops_per_transaction": round(d["ops"] / d["batches"], 1) if d["batches"] else None,
            "round_trips_per_group": round(d["round_trips"] / accepted, 2) if d["round_trips"] else None}


def merge_server_seconds(per_process: list[dict[str, tuple[float, float]]]) -> dict[str, tuple[float, float]]:
    """One /metrics view of several processes: seconds and counts summed per method."""
    out: dict[str, tuple[float, float]] = {}
    for seconds in per_process:
        for method, (s, n) in seconds.items():
            s0, n0 = out.get(method, (0.0, 0.0))
            out[method] = (s0 + s, n0 + n)
    return out


def summarize(nodes: int, args, results: list[dict], cpu: tuple[float, float], srv_a: dict, srv_b: dict,
              rss: int, peak_rss: int) -> dict:
    window = args.measure_s
    lat: dict[str, list[float]] = defaultdict(list)
    ok: Counter = Counter()
    errors: dict[str, Counter] = defaultdict(Counter)
    no_lease: Counter = Counter()
    examples: dict[str, str] = {}
    leases = 0
    client_cpu = 0.0
    for r in results:
        for reason, text in r["error_examples"].items():
            examples.setdefault(reason, text)
        for m, v in r["latencies"].items():
            lat[m] += v
        ok.update(r["ok"])
        for m, c in r["errors"].items():
            errors[m].update(c)
        no_lease.update(r["no_lease"])
        leases += r["leases"]
        client_cpu += r["cpu_s"]
    accepted = ok["SubmitGroup"]
    mean_think = args.think_s * math.exp(args.think_sigma ** 2 / 2)
    latency = {m: {"p50_ms": _ms(percentile(lat[m], 50)), "p99_ms": _ms(percentile(lat[m], 99)), "n": len(lat[m])}
               for m in METHODS if lat[m]}
    server = {}
    for m in METHODS:
        (s_a, n_a), (s_b, n_b) = srv_a.get(m, (0.0, 0.0)), srv_b.get(m, (0.0, 0.0))
        if n_b > n_a:
            server[m] = _ms((s_b - s_a) / (n_b - n_a))
    calls = sum(ok.values()) + sum(sum(c.values()) for c in errors.values())
    return {
        "nodes": nodes,
        "leases_per_s": round(leases / window, 1),
        "submissions_per_s": round(accepted / window, 1),
        "heartbeats_per_s": round(ok["Heartbeat"] / window, 1),
        # What the nodes would submit if every call were answered at once: nodes / mean think time.
        "offered_submissions_per_s": round(nodes / mean_think, 1),
        "held_fraction": round(accepted / window / (nodes / mean_think), 3),
        "latency": latency,
        "server_mean_ms": server,
        "errors": {m: dict(c) for m, c in errors.items() if c},
        "error_examples": examples,
        "error_fraction": round(sum(sum(c.values()) for c in errors.values()) / max(calls, 1), 4),
        "no_lease": dict(no_lease),
        "coordinator": {
            "cpu_cores": round(cpu[0] / window, 2),
            "main_thread_cores": round(cpu[1] / window, 2),
            "cpu_ms_per_group": round(cpu[0] / accepted * 1000, 2) if accepted else None,
            "rss_mb": round(rss / 2**20, 1),
            "peak_rss_mb": round(peak_rss / 2**20, 1),
        },
        "client_cpu_cores": round(client_cpu / window, 2),
        "load_avg": round(os.getloadavg()[0], 2),
        "unfinished_nodes": sum(r["unfinished"] for r in results),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


# --- where it saturates ------------------------------------------------------------------------------

SPLIT = {
    "event_loop_cpu": "split the edge from the store: several edge processes (TLS, signature and replay checks, "
                      "parsing and shape checks, rewards; stateless, behind SO_REUSEPORT or a load balancer) in front "
                      "of one store process that issues leases and commits accepted groups; beyond that, shard nodes "
                      "across coordinators by key",
    "store_writer": "keep one edge, give the store its own process and batch harder (larger group commits), or shard "
                    "nodes across coordinators by key, each with its own store",
    "machine_cpu": "rerun on a quieter machine, or with the clients on another one, before splitting anything",
}


def mean_think_s(scales: list[dict]) -> float:
    s = scales[-1]
    return s["nodes"] / s["offered_submissions_per_s"] if s["offered_submissions_per_s"] else float("nan")



def saturated(s: dict) -> bool:
    """The coordinator no longer keeps up: it holds under 80% of the offered rate, or calls fail or crawl."""
    p99 = (s["latency"].get("SubmitGroup") or {}).get("p99_ms") or 0.0
    return s["held_fraction"] < 0.8 or s["error_fraction"] > 0.01 or p99 > 2000


def verdict(scales: list[dict], costs: dict) -> tuple[dict, str]:
    """Name the resource that ran out first (or the headroom left) and what to split, from the figures."""
    best = max(scales, key=lambda s: s["submissions_per_s"])
    knee = next((s for s in scales if saturated(s)), None)
    top = knee or scales[-1]
    c = top["coordinator"]
    per_group_ms = c["cpu_ms_per_group"] or float("nan")
    # Requests per accepted group the coordinator verifies: a lease, a submission, and the heartbeats.
    calls_per_group = 2 + (top["heartbeats_per_s"] / top["submissions_per_s"] if top["submissions_per_s"] else 0)
    verify_share = costs["ed25519_verify_us"] / 1000 * calls_per_group / per_group_ms if c["cpu_ms_per_group"] else None
    submit_client = (top["latency"].get("SubmitGroup") or {}).get("p50_ms") or 0.0
    submit_server = top["server_mean_ms"].get("SubmitGroup") or 0.0
    commit_ceiling = 1000 / costs["sqlite_commit_ms"] if costs["sqlite_commit_ms"] else float("inf")
    # One Python process runs Python on one core at a time (the GIL): near one core busy, or the
    # event-loop thread near it, is CPU-bound; a store that answers slowly while CPU is spare is not.
    if c["cpu_cores"] >= 0.8 or c["main_thread_cores"] >= 0.6:
        resource = "event_loop_cpu"
        why = (f"the coordinator process is CPU-bound at {c['cpu_cores']:.2f} cores ({c['main_thread_cores']:.2f} on the "
               f"event-loop thread; one Python process runs Python on one core at a time), {per_group_ms:.1f} ms of CPU "
               f"per accepted group; Ed25519 checks are ~{(verify_share or 0):.0%} of it, the rest gRPC/TLS, protobuf, "
               f"the intake checks and the store ops")
    elif submit_server > 0.5 * submit_client and submit_server > 20:
        resource = "store_writer"
        why = (f"SubmitGroup spends {submit_server:.0f} of its {submit_client:.0f} ms (p50) inside the coordinator "
               f"waiting on the single store writer (a durable commit costs {costs['sqlite_commit_ms']:.1f} ms here, "
               f"~{commit_ceiling:.0f} commits/s, shared by a batch) while the process uses only "
               f"{c['cpu_cores']:.2f} cores")
    else:
        resource = "machine_cpu"
        why = (f"neither the coordinator's CPU ({c['cpu_cores']:.2f} cores) nor its store (SubmitGroup "
               f"{submit_server:.0f} ms inside of {submit_client:.0f} ms p50) is exhausted: the machine is (load "
               f"average {top['load_avg']:.1f}, clients {top['client_cpu_cores']:.2f} cores)")
    split = SPLIT[resource]
    if knee is None:
        last = scales[-1]
        # Python work in one process runs on one core at a time: groups per coordinator core-second
        # bounds what this coordinator could hold once that core is full.
        ceiling = last["submissions_per_s"] / c["cpu_cores"] if c["cpu_cores"] else float("inf")
        text = (f"No saturation up to {last['nodes']} nodes: it held {last['submissions_per_s']:.0f} groups/s and "
                f"{last['leases_per_s']:.0f} leases/s ({last['held_fraction']:.0%} of offered) on "
                f"{c['cpu_cores']:.2f} coordinator cores ({c['main_thread_cores']:.2f} event loop), "
                f"{per_group_ms:.1f} ms of CPU per group, Ed25519 ~{(verify_share or 0):.0%} of it; at one full core "
                f"that is a ceiling near {ceiling:.0f} groups/s (~{ceiling * mean_think_s(scales):.0f} nodes at this "
                f"think time), reached first by the event loop's CPU unless the store writer "
                f"(SubmitGroup {submit_server:.0f} ms inside of {submit_client:.0f} ms p50) is. When it comes: "
                f"{SPLIT['event_loop_cpu']}.")
    else:
        text = (f"One coordinator holds ~{best['submissions_per_s']:.0f} accepted groups/s and "
                f"{best['leases_per_s']:.0f} leases/s (best at {best['nodes']} nodes); at {knee['nodes']} nodes it "
                f"holds {knee['held_fraction']:.0%} of the offered {knee['offered_submissions_per_s']:.0f}/s "
                f"(SubmitGroup p99 {(knee['latency'].get('SubmitGroup') or {}).get('p99_ms')} ms). It saturates "
                f"because {why}. Split: {split}.")
    summary = {"resource": resource if knee else "not_reached", "at_nodes": knee["nodes"] if knee else None,
               "held_groups_per_s": best["submissions_per_s"], "held_leases_per_s": best["leases_per_s"],
               "verify_share_of_cpu": round(verify_share, 3) if verify_share is not None else None}
    return summary, text


# --- past one process: edges on one port, PostgreSQL, the planner, the other benchmarks -----------------


def run_costs(s: dict, args, commit_ms: float) -> dict:
    """The planner's unit costs as run ``s`` measured them (the defaults for everything it did not measure).

    The edges' CPU per accepted group includes their heartbeats at this run's rate, so heartbeats cost
    nothing apart. ``commit_ms`` is a durable SQLite commit in this run's directory; on PostgreSQL (fsync
    off) a commit is cheaper, so the store's write bound is a floor there.
    """
    from veriroll.coordinator.plan import DEFAULT_COSTS

    source = f"benchmarks/scale.py, this run ({s['deployment']['store']}, {len(s['deployment']['roles'])} edge(s))"
    measured = {"edge_s_per_group": s["coordinator"]["cpu_ms_per_group"] / 1000, "edge_s_per_heartbeat": 0.0,
                "edge_reference_tokens": args.group_size * args.tokens, "store_commit_s": commit_ms / 1000}
    if s["deployment"]["store_cores"] is not None:
        measured["store_cpu_s_per_group"] = s["deployment"]["store_cores"] / s["submissions_per_s"]
    writer = s.get("store_writer")
    if writer:
        # The writers' wall time per group, heartbeats' writes included (as the edges' CPU): PostgreSQL's
        # execution (the defaults' pg_stat_statements figures) and, per round trip, whatever else the writer
        # waited for. On SQLite the writer runs the statements itself: all of it is execution.
        wall_s = writer["wall_ms_per_group"] / 1000
        measured |= {"store_exec_s_per_heartbeat": 0.0, "store_round_trips_per_heartbeat": 0.0}
        trips = writer["round_trips_per_group"]
        if trips:
            beats = s["heartbeats_per_s"] / s["submissions_per_s"]
            exec_s = (DEFAULT_COSTS["store_exec_s_per_group"].value
                      + beats * DEFAULT_COSTS["store_exec_s_per_heartbeat"].value)
            measured |= {"store_exec_s_per_group": exec_s, "store_round_trips_per_group": trips,
                         "store_s_per_round_trip": max(0.0, wall_s - exec_s) / trips}
        else:  # (no network between them: a round trip costs nothing apart)
            measured |= {"store_exec_s_per_group": wall_s, "store_s_per_round_trip": 0.0}
    costs = dict(DEFAULT_COSTS)
    for name, value in measured.items():
        costs[name] = dataclasses.replace(costs[name], value=value, source=source, measured=True)
    return costs


def default_writer_ms_per_group(s: dict) -> float | None:
    """An edge writer's wall time per accepted group on PostgreSQL as the planner's default costs put it (its
    execution and a round trip per statement at no network latency), at run ``s``'s heartbeats per group."""
    from veriroll.coordinator.plan import DEFAULT_COSTS

    if not s["submissions_per_s"]:
        return None
    c = {name: cost.value for name, cost in DEFAULT_COSTS.items()}
    own = c["store_s_per_round_trip"]
    beats = s["heartbeats_per_s"] / s["submissions_per_s"]
    return round(1000 * (c["store_exec_s_per_group"] + c["store_round_trips_per_group"] * own
                         + beats * (c["store_exec_s_per_heartbeat"] + c["store_round_trips_per_heartbeat"] * own)), 3)


def deployment_plan(s: dict, args, edges: int, commit_ms: float, *, cores: float | None) -> dict:
    """The planner's figures for run ``s``'s deployment, from the unit costs that run measured.

    With ``cores``: this machine's model, that many cores shared by the edges, PostgreSQL (when it is the
    store) and the simulated nodes' client processes (a co-located load at their CPU per group). With
    None: a dedicated deployment, a core per edge and nothing else on it.
    """
    from veriroll.coordinator.plan import Machine, Workload, plan

    mean_think = args.think_s * math.exp(args.think_sigma ** 2 / 2)
    w = Workload(model_params=1.0, nodes=s["nodes"], tokens_per_sample=args.tokens, group_size=args.group_size,
                 audit_fraction=0.0, prompt_tokens=0, node_tokens_per_s=args.group_size * args.tokens / mean_think,
                 heartbeat_s=args.heartbeat_s)
    machine = Machine(edges=edges)
    if cores is not None:
        machine = Machine(edges=edges, cores=cores,
                          colocated=("store",) if s["deployment"]["store"] == "postgresql" else (),
                          colocated_cpu_s_per_group=s["client_cpu_cores"] / s["submissions_per_s"])
    return plan(w, run_costs(s, args, commit_ms), machine)


def cores_left(s: dict) -> float:
    """This machine's cores less what other processes and the hypervisor (steal) took during run ``s``'s window."""
    return os.cpu_count() - s["other_cores"] - s.get("steal_cores", 0.0)


def predicted_from(source: dict, target: dict, args, edges: int, commit_ms: float) -> dict:
    """The planner on run ``target``'s deployment from the unit costs run ``source`` measured: out of sample.

    The fleet (``target``'s nodes, ``args``' think time) and the cores other tenants left it are the
    target's conditions; the CPU per group of the edges, clients and PostgreSQL are the source's. (The
    edges' cost per group carries the source's heartbeats per group.)
    """
    conditions = dict(source, nodes=target["nodes"], other_cores=target["other_cores"],
                      steal_cores=target.get("steal_cores", 0.0))
    planned = deployment_plan(conditions, args, edges, commit_ms, cores=cores_left(target))["predicted_groups_per_s"]
    measured = target["submissions_per_s"]
    return {"predicted_groups_per_s": round(planned, 1),
            "predicted_ratio": round(planned / measured, 2) if measured else None}


def deployment_figures(s: dict, args, edges: int, commit_ms: float) -> dict:
    """One deployment's run, in the few figures the scale-out comparison reads, beside the planner's."""
    submit = s["latency"].get("SubmitGroup") or {}
    c = s["coordinator"]
    accepted = s["submissions_per_s"]
    store_cores = s["deployment"]["store_cores"]
    figures = {
        "nodes": s["nodes"], "roles": s["deployment"]["roles"], "store": s["deployment"]["store"],
        "groups_per_s": accepted, "offered_groups_per_s": s["offered_submissions_per_s"],
        "held_fraction": s["held_fraction"],
        "submit_p50_ms": submit.get("p50_ms"), "submit_p99_ms": submit.get("p99_ms"),
        "error_fraction": s["error_fraction"], "errors": s["errors"], "error_examples": s["error_examples"],
        "unfinished_nodes": s["unfinished_nodes"],
        "edge_cores": c["cpu_cores"], "edge_main_thread_cores": c["main_thread_cores"],
        "client_cores": s["client_cpu_cores"], "store_cores": store_cores, "other_cores": s["other_cores"],
        "steal_cores": s.get("steal_cores", 0.0),
        # CPU per accepted group, by who spends it.
        "edge_ms_per_group": c["cpu_ms_per_group"],
        "client_ms_per_group": round(s["client_cpu_cores"] / accepted * 1000, 2) if accepted else None,
        "store_ms_per_group": round(store_cores / accepted * 1000, 2) if accepted and store_cores else None,
        "load_avg": s["load_avg"],
        "store_writer": s.get("store_writer"),
    }
    if not accepted:
        return figures | {"predicted_groups_per_s": None, "predicted_ratio": None, "bottleneck": None}
    shared = deployment_plan(s, args, edges, commit_ms, cores=cores_left(s))
    idle = deployment_plan(s, args, edges, commit_ms, cores=os.cpu_count())
    dedicated = deployment_plan(s, args, edges, commit_ms, cores=None)
    return figures | {
        "predicted_groups_per_s": round(shared["predicted_groups_per_s"], 1),
        "predicted_ratio": round(shared["predicted_groups_per_s"] / accepted, 2),
        "bottleneck": shared["bottleneck"],
        "cores_for_deployment": round(shared["host_cores"], 2),
        "predicted_edges_groups_per_s": round(shared["groups_per_s_edges"], 1),
        # The writer's wall time per group the planner's default costs assume (heartbeats' writes included),
        # beside store_writer's measured wall_ms_per_group (which this run's predictions use).
        "default_writer_ms_per_group": default_writer_ms_per_group(s)
        if s["deployment"]["store"] == "postgresql" else None,
        # What the cores left to the deployment hold, its clients on them too.
        "machine_bound_groups_per_s": round(shared["groups_per_s_host"], 1),
        # The same, were nothing else running on this machine.
        "predicted_idle_machine_groups_per_s": round(idle["predicted_groups_per_s"], 1),
        # The same unit costs with a core per edge and nothing else on it: the planner before its machine model.
        "predicted_dedicated_groups_per_s": round(dedicated["predicted_groups_per_s"], 1),
    }


def postmaster_pid(cluster) -> int:
    return int((cluster.data / "postmaster.pid").read_text().split()[0])


def scale_out(args, root: Path, commit_ms: float) -> dict:
    """groups/s with 1 and 2 edge processes on SQLite and PostgreSQL against one fleet, and 1,000 nodes.

    The same fleet (``--edge-nodes`` at ``--edge-think-s``, offering more than one edge holds) meets one
    ``--role all`` process on SQLite, then one and two ``--role edge`` processes on a throwaway PostgreSQL
    cluster (tests/pg_cluster.py: fsync off, so the store's durability cost is not in these figures).
    """
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    from pg_cluster import Cluster, unavailable

    fleet = argparse.Namespace(**{**vars(args), "think_s": args.edge_think_s})
    runs = {"sqlite_1_edge": deployment_figures(run_scale(args.edge_nodes, fleet, root, label="sqlite-1"), fleet, 1,
                                                commit_ms)}
    # The large fleet also meets one process on SQLite: on a small box with no PostgreSQL to run, that is the
    # deployment (and no store process shares the cores).
    fleet_sqlite = deployment_figures(run_scale(args.fleet_nodes, args, root, label=f"fleet-sqlite-{args.fleet_nodes}"),
                                      args, 1, commit_ms)
    why = unavailable()
    if why is not None:
        return {"runs": runs, "fleet_sqlite": fleet_sqlite, "postgresql": f"not measured: {why}"}
    cluster = Cluster()
    try:
        pid = postmaster_pid(cluster)
        on_postgres = {}
        for edges in (1, 2):
            on_postgres[edges] = run_scale(args.edge_nodes, fleet, root, database=cluster.new_database(),
                                           edges=edges, store_pid=pid, label=f"postgres-{edges}")
            runs[f"postgres_{edges}_edge{'s' if edges > 1 else ''}"] = deployment_figures(
                on_postgres[edges], fleet, edges, commit_ms)
        at_fleet = run_scale(args.fleet_nodes, args, root, database=cluster.new_database(), edges=2, store_pid=pid,
                             label=f"fleet-{args.fleet_nodes}")
        fleet_run = deployment_figures(at_fleet, args, 2, commit_ms)
    finally:
        cluster.stop()
    one, two = runs["postgres_1_edge"], runs["postgres_2_edges"]
    if on_postgres[1]["submissions_per_s"]:
        two["out_of_sample"] = {"from": "postgres_1_edge", **predicted_from(on_postgres[1], on_postgres[2], fleet, 2,
                                                                           commit_ms)}
    if on_postgres[2]["submissions_per_s"]:
        fleet_run["out_of_sample"] = {"from": "postgres_2_edges", **predicted_from(on_postgres[2], at_fleet, args,
                                                                                   2, commit_ms)}
    return {
        "runs": runs,
        "edge_scaling": round(two["groups_per_s"] / one["groups_per_s"], 2) if one["groups_per_s"] else None,
        "edge_scaling_cpu_bound": edge_scaling_cpu_bound(on_postgres[2], fleet, commit_ms),
        "fleet": fleet_run,
        "fleet_sqlite": fleet_sqlite,
    }


def edge_scaling_cpu_bound(s: dict, args, commit_ms: float) -> float | None:
    """The most a second edge can gain on this machine, were it otherwise idle, from two-edge run ``s``.

    The planner's capacity of one and of two edges, the fleet's own rate left out: an edge holds at
    most a core's worth of groups, unless the cores the clients and PostgreSQL share run out first.
    (Other tenants are left out: their share differs from one run to the next.)
    """
    if not s["submissions_per_s"]:
        return None

    def capacity(edges: int) -> float:
        p = deployment_plan(s, args, edges, commit_ms, cores=os.cpu_count())
        return min(p["groups_per_s_edges"], p["groups_per_s_host"], p["groups_per_s_store"])

    return round(capacity(2) / capacity(1), 2)


def child_figures(script: str, quick: bool, keys: tuple[str, ...]) -> dict:
    """Run another benchmark as a child and take ``keys`` from its last JSON line (a note if it is absent)."""
    path = HERE.parent / script
    if not path.exists():
        return {key: None for key in keys} | {"note": f"benchmarks/{script} is absent: not measured"}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, str(path), *(["--quick"] if quick else [])], capture_output=True,
                         text=True, env=env, timeout=1200, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {key: None for key in keys} | {"note": f"benchmarks/{script} failed (exit code {out.returncode}): "
                                                      f"{out.stderr.strip()[-300:]}"}
    result = json.loads(lines[-1])
    return {key: result.get(key) for key in keys}


def main() -> int:
    from procs import sigterm_as_interrupt  # a sibling script (not needed where this is imported)

    from veriroll.coordinator.event_loop import loop_runner

    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2])
    sigterm_as_interrupt()  # so the finally blocks below stop what this started
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="50, 100 and 200 nodes, short windows (under two minutes)")
    ap.add_argument("--scales", default="100,300,1000", help="comma-separated node counts")
    ap.add_argument("--measure-s", type=float, default=30.0, help="measurement window per scale")
    ap.add_argument("--ramp-s", type=float, default=5.0, help="nodes start staggered over at least this long")
    ap.add_argument("--ramp-rate", type=float, default=50.0, help="and at most this many nodes start per second")
    ap.add_argument("--settle-s", type=float, default=5.0, help="wait after the ramp before measuring")
    ap.add_argument("--think-s", type=float, default=3.0, help="median think (generation) time per lease")
    ap.add_argument("--think-sigma", type=float, default=0.5, help="lognormal sigma of the think time")
    ap.add_argument("--heartbeat-s", type=float, default=5.0, help="heartbeat period per node")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per sample")
    ap.add_argument("--client-procs", type=int, default=2, help="processes the simulated nodes are spread over")
    ap.add_argument("--call-timeout-s", type=float, default=30.0, help="deadline of every call")
    ap.add_argument("--edge-nodes", type=int, default=600, help="the fleet that meets 1 and 2 edge processes")
    ap.add_argument("--edge-think-s", type=float, default=1.5, help="its median think time (it must offer more "
                                                                     "than one edge holds)")
    ap.add_argument("--fleet-nodes", type=int, default=1000, help="the large fleet, at --think-s, on 2 edges")
    ap.add_argument("--separate-lease-calls", action="store_true",
                    help="nodes lease with a LeaseWork call per group, as before SubmitGroupRequest.next_leases "
                         "(by default they ask for the next lease inside each submission, as the node does)")
    args = ap.parse_args()
    if args.quick:
        args.scales, args.measure_s, args.ramp_s, args.settle_s = "100,300", 10.0, 3.0, 2.0
    scales = [int(x) for x in args.scales.split(",") if x.strip()]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    root = Path(tempfile.mkdtemp(prefix="veriroll-bench-scale-"))
    t_start = time.time()
    try:
        figures = []
        for n in scales:
            s = run_scale(n, args, root)
            figures.append(s)
            lw, sg = s["latency"].get("LeaseWork") or {}, s["latency"].get("SubmitGroup") or {}
            print(f"{n:5d} nodes: {s['leases_per_s']:6.1f} leases/s {s['submissions_per_s']:6.1f} groups/s "
                  f"({s['held_fraction']:.0%} of offered {s['offered_submissions_per_s']:.0f}/s) | p50/p99 ms "
                  f"lease {lw.get('p50_ms')}/{lw.get('p99_ms')} submit {sg.get('p50_ms')}/{sg.get('p99_ms')} | "
                  f"coordinator {s['coordinator']['cpu_cores']:.2f} cores (loop {s['coordinator']['main_thread_cores']:.2f}), "
                  f"{s['coordinator']['rss_mb']:.0f} MB | errors {s['errors'] or 0} | load {s['load_avg']}", flush=True)
        costs = fixed_costs(root)
        summary, text = verdict(figures, costs)
        print(text, flush=True)
        out = scale_out(args, root, costs["sqlite_commit_ms"])
        for name, run in [*out["runs"].items(), ("fleet", out.get("fleet")), ("fleet_sqlite", out.get("fleet_sqlite"))]:
            if run:
                print(f"{name}: {run['nodes']} nodes, measured {run['groups_per_s']:.1f} groups/s, predicted "
                      f"{run['predicted_groups_per_s']} (x{run['predicted_ratio']}, {run['bottleneck']}; edges "
                      f"{run.get('predicted_edges_groups_per_s')}, {run.get('cores_for_deployment')} cores "
                      f"{run.get('machine_bound_groups_per_s')}; machine idle "
                      f"{run.get('predicted_idle_machine_groups_per_s')}, a core per edge "
                      f"{run.get('predicted_dedicated_groups_per_s')}), {run['held_fraction']:.0%} of offered, "
                      f"submit p99 {run['submit_p99_ms']} ms | cores: edges {run['edge_cores']}, clients "
                      f"{run['client_cores']}, store {run['store_cores']}, other {run['other_cores']}, stolen by the "
                      f"hypervisor {run['steal_cores']} | "
                      f"load {run['load_avg']}", flush=True)
                if "out_of_sample" in run:
                    o = run["out_of_sample"]
                    print(f"  from the unit costs of {o['from']}: predicted {o['predicted_groups_per_s']} "
                          f"(x{o['predicted_ratio']})", flush=True)
        print(f"edge_scaling {out.get('edge_scaling')} (this machine's CPU allows at most "
              f"{out.get('edge_scaling_cpu_bound')})", flush=True)
        intake = child_figures("intake.py", args.quick, ("ratio", "intake_groups_per_s", "echo_per_s", "ratio_two_calls",
                                                         "intake_groups_per_s_two_calls", "echo_per_s_two_calls"))
        verify = child_figures("verify_pool.py", args.quick, ("verify_groups_per_s_1", "verify_groups_per_s_2"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs, fleet = out["runs"], out.get("fleet") or {}
    print(json.dumps({
        "groups_per_s": {name: run["groups_per_s"] for name, run in runs.items()},
        "edge_scaling": out.get("edge_scaling"), "edge_scaling_cpu_bound": out.get("edge_scaling_cpu_bound"),
        "fleet_nodes": fleet.get("nodes"), "fleet_held_fraction": fleet.get("held_fraction"),
        "fleet_submit_p99_ms": fleet.get("submit_p99_ms"),
        "fleet_sqlite_held_fraction": (out.get("fleet_sqlite") or {}).get("held_fraction"),
        "fleet_sqlite_submit_p99_ms": (out.get("fleet_sqlite") or {}).get("submit_p99_ms"),
        "predicted_groups_per_s": fleet.get("predicted_groups_per_s"),
        "measured_groups_per_s": fleet.get("groups_per_s"),
        # Every deployment: the planner's prediction from that run's unit costs / what it held.
        "predicted_ratio": {name: run.get("predicted_ratio") for name, run in [*runs.items(), ("fleet", fleet),
                                                                               ("fleet_sqlite", out.get("fleet_sqlite") or {})]},
        "verify_groups_per_s_1": verify["verify_groups_per_s_1"], "verify_groups_per_s_2": verify["verify_groups_per_s_2"],
        "intake_ratio": intake["ratio"], "intake_ratio_two_calls": intake["ratio_two_calls"], "intake": intake, "verify": verify, "scale_out": out,
        "scales": figures, "saturation": summary, "verdict": text, "fixed_costs": costs,
        "config": {"think_median_s": args.think_s, "think_sigma": args.think_sigma, "heartbeat_s": args.heartbeat_s,
                   "group": f"{args.group_size}x{args.tokens} tokens", "measure_s": args.measure_s,
                   "client_procs": args.client_procs, "edge_nodes": args.edge_nodes,
                   "edge_think_median_s": args.edge_think_s, "fleet_nodes": args.fleet_nodes,
                   "cpus": os.cpu_count(), "wall_s": round(time.time() - t_start, 1),
                   "event_loop": loop_runner("auto")[0]},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
