"""The coordinator past one process: two edge processes sharing one port (SO_REUSEPORT) and one PostgreSQL
store, and a trainer process, each a real `veriroll coordinator run --role ...`. Nodes are served by
both edges; a request replayed to the other edge is refused (nonces live in the store); a node in the
swarm on one edge is announced by the other (the peer directory lives in the store); the trainer's new
version reaches both edges; killing one edge leaves the other serving."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from support import make_coordinator_dir
from test_server import shaped_group

from veriroll.coordinator import store as st
from veriroll.protos.envelope import sign_request
from veriroll.protos.identity import PrivateKey, PublicKey
from veriroll.protos.service import CallError, SignedStub, full_method, secure_channel
from veriroll.protos.v1 import coordinator_pb2 as pb
from veriroll.shardcast.swarm.hints import PeerHint, verify_peer_hints

VERIROLL = str(Path(sys.executable).parent / "veriroll")
HANG_GUARD_S = 90
PEER = "12D3KooWQrU8SK48Zi67oCxsmbZneBLv9xyULZ646RbLJ8tSCmMh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(base: Path, log: Path, *sets: str) -> subprocess.Popen:
    args = [VERIROLL, "coordinator", "run", "--dir", str(base)]
    for s in sets:
        args += [s] if s.startswith("--") else ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)


def wait_http(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"no /healthz on {port}:\n{log.read_text()[-3000:]}")


def edge_ports() -> tuple[int, dict[str, int]]:
    """A free gRPC port for the edges to share, and a free HTTP port for each process."""
    return free_port(), {"edge-a": free_port(), "edge-b": free_port(), "trainer": free_port()}


def start_edges_and_trainer(base: Path, logs: Path, grpc_port: int, http: dict[str, int],
                            procs: dict[str, subprocess.Popen]) -> None:
    """Edges 'edge-a' and 'edge-b' on one gRPC port and a trainer, each a real process (added to ``procs``
    as it starts, so the caller's ``stop_all`` stops what did), serving /healthz on its ``http`` port."""
    for name in ("edge-a", "edge-b"):
        procs[name] = start(base, logs / f"{name}.log", "--role=edge", f"server.port={grpc_port}",
                            f"server.http_port={http[name]}")
    procs["trainer"] = start(base, logs / "trainer.log", "role=trainer", f"server.http_port={http['trainer']}")
    for name, proc in procs.items():
        wait_http(http[name], proc, logs / f"{name}.log")


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    """SIGTERM to every process still running; each must exit within 30 s (else killed, and the test fails)."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for name, proc in procs.items():
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{name} did not stop on SIGTERM")


def requests_served(http_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("veriroll_requests_total{")))


def test_two_edges_and_a_trainer_share_one_postgres_store(pg_url, tmp_path):
    base = make_coordinator_dir(tmp_path, {"database": pg_url, "trainer.enabled": True, "trainer.min_groups": 4,
                                           "trainer.groups_per_step": 4, "trainer.lr": 1e-3,
                                           "leases.probation_max_open": 4, "leases.max_open_per_node": 4})
    grpc_port, http = edge_ports()
    procs = {}
    try:
        start_edges_and_trainer(base, tmp_path, grpc_port, http, procs)
        ca = (base / "tls" / "ca.crt").read_bytes()

        async def placed_nodes() -> dict[str, list[SignedStub]]:
            """Three registered nodes on each edge, each on its own connection: the kernel places a connection
            (SO_REUSEPORT hashing), and the edge whose request count moved is the one it reached."""
            placed: dict[str, list[SignedStub]] = {"edge-a": [], "edge-b": []}
            for _ in range(40):
                if all(len(on_edge) >= 3 for on_edge in placed.values()):
                    break
                before = {name: requests_served(http[name]) for name in placed}
                stub = SignedStub(secure_channel(f"127.0.0.1:{grpc_port}", ca, server_name="localhost"),
                                  PrivateKey.generate(), timeout=20)
                await stub.register(pb.RegisterRequest(public_key=stub.key.public.raw, software_version="test"))
                edge = next(name for name in placed if requests_served(http[name]) > before[name])
                if len(placed[edge]) < 3:
                    placed[edge].append(stub)
                else:
                    await stub.channel.close()
            assert all(len(on_edge) == 3 for on_edge in placed.values()), placed
            return placed

        async def nodes():
            placed = await placed_nodes()
            on_a, on_b = placed["edge-a"], placed["edge-b"]
            stubs = on_a + on_b
            for stub in on_a[:2] + on_b[:2]:
                lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
                assert (await stub.submit_group(shaped_group(lease))).accepted
            # One signed heartbeat sent on six connections, the first to edge A, then alternating: used once.
            body = pb.HeartbeatRequest().SerializeToString()
            metadata = sign_request(stubs[0].key, full_method("Heartbeat"), body)
            outcomes = []
            for stub in (x for pair in zip(on_a, on_b, strict=True) for x in pair):
                try:
                    await stub.channel.unary_unary(full_method("Heartbeat"))(body, metadata=metadata, timeout=20)
                    outcomes.append("ok")
                except grpc.aio.AioRpcError as err:
                    outcomes.append(dict(err.trailing_metadata() or ()).get("x-veriroll-reason"))
            # A node serving the swarm heartbeats to edge A; a node on edge B is told about it (the edges
            # share the peer directory through the store, every resign_s).
            swarm = pb.HeartbeatRequest(swarm_peer_id=PEER, swarm_addrs=["/ip4/127.0.0.1/tcp/4001"], swarm_versions=[0])
            await on_a[2].heartbeat(swarm)
            hinted = ()
            for _ in range(HANG_GUARD_S * 5):
                policy = (await on_b[2].get_policy()).policy
                hinted = verify_peer_hints(policy.peer_hints, PublicKey(policy.coordinator_public_key)).peers
                if hinted:
                    break
                await asyncio.sleep(0.2)
            # The trainer steps on the four groups and commits version 1; both edges follow.
            versions = {}
            for _ in range(HANG_GUARD_S * 5):
                versions = {}
                for stub in stubs:
                    versions[id(stub)] = (await stub.get_policy()).policy.version
                if set(versions.values()) == {1}:
                    break
                await asyncio.sleep(0.2)
            served = {name: requests_served(http[name]) for name in ("edge-a", "edge-b")}
            # One edge dies: the other keeps serving new connections (the nodes' retries go through).
            procs["edge-a"].send_signal(signal.SIGKILL)
            procs["edge-a"].wait(10)
            after = []
            for stub in stubs:
                await stub.channel.close()
                fresh = SignedStub(secure_channel(f"127.0.0.1:{grpc_port}", ca, server_name="localhost"), stub.key,
                                   timeout=20)
                for _ in range(20):
                    try:
                        after.append((await fresh.heartbeat(pb.HeartbeatRequest())).policy_version)
                        break
                    except CallError:
                        await asyncio.sleep(0.2)
                await fresh.channel.close()
            return outcomes, set(versions.values()), served, after, hinted

        outcomes, versions, served, after, hinted = asyncio.run(nodes())
        db = st.Database(pg_url)
        summary = db.run_sync(st.status_summary)
        db.close()
    finally:
        stop_all(procs)

    assert outcomes == ["ok"] + ["replayed_nonce"] * 5  # refused on edge B too: the nonce is in the store
    assert served["edge-a"] > 0 and served["edge-b"] > 0, served  # both edges took part
    assert hinted == (PeerHint(PEER, ("/ip4/127.0.0.1/tcp/4001",), (0,)),)
    assert versions == {1} and summary["trainer_step"] >= 1 and summary["accepted_groups"] == 4
    assert after == [1] * 6  # every node reached the surviving edge
    assert procs["edge-b"].returncode == 0 and procs["trainer"].returncode == 0
