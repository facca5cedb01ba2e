"""Faults of a coordinator scaled out over several processes and one PostgreSQL store, on real processes
(`veriroll coordinator run --role edge|trainer`) and a throwaway PostgreSQL cluster of this module's own
(these tests stop and restart it):

- one edge killed (SIGKILL) under load: the other keeps serving, nodes reconnect and go through, and every
  accepted group is in the store once and trained at most once;
- PostgreSQL stopped and restarted under an edge: requests are refused ``store_unavailable`` (UNAVAILABLE,
  which nodes retry), never ``internal``; the edge reconnects by itself and the same node goes through;
- limits that must hold across edges: a burst of new keys from one address, spread over two edges, gets
  one budget.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request

import grpc
import pytest
from pg_cluster import throwaway_cluster
from support import make_coordinator_dir
from test_edges import (
    edge_ports,
    free_port,
    requests_served,
    start,
    start_edges_and_trainer,
    stop_all,
    wait_http,
)
from test_server import shaped_group

from veriroll.coordinator import store as st
from veriroll.coordinator.store import pg
from veriroll.protos.identity import PrivateKey
from veriroll.protos.reasons import Reason
from veriroll.protos.service import CallError, SignedStub, secure_channel
from veriroll.protos.v1 import coordinator_pb2 as pb

STORE_DOWN = Reason.STORE_UNAVAILABLE.value
CONNECTION_LOST = {"unavailable", "cancelled", "unknown", "deadline_exceeded"}  # how a killed edge's calls end


@pytest.fixture(scope="module")
def faulty_pg():
    """A PostgreSQL cluster these tests may stop and restart without disturbing the session's."""
    yield from throwaway_cluster()


def results_by_reason(http_port: int) -> dict[str, float]:
    """``veriroll_requests_total`` of one process, summed over methods, by result."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("veriroll_requests_total{") and 'result="' in line:
            result = line.split('result="', 1)[1].split('"', 1)[0]
            counts[result] = counts.get(result, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts



class Node:
    """A node's connection, made again after a failure (a killed edge leaves its connections dead)."""

    def __init__(self, address: str, ca: bytes, key: PrivateKey | None = None):
        self.address, self.ca = address, ca
        self.key = key or PrivateKey.generate()
        self.stub = self._connect()

    def _connect(self) -> SignedStub:
        return SignedStub(secure_channel(self.address, self.ca, server_name="localhost"), self.key, timeout=10)

    async def reconnect(self) -> None:
        await self.stub.channel.close()
        self.stub = self._connect()

    async def close(self) -> None:
        await self.stub.channel.close()


# --- the store under one process ----------------------------------------------------------------------------


def test_a_postgres_store_refuses_while_the_server_is_down_and_reconnects_by_itself(faulty_pg):
    db = st.Database(faulty_pg.new_database())
    try:
        db.run_sync(lambda c: st.kv_set(c, "before", 1))
        faulty_pg.stop_server()
        with pytest.raises(st.StoreUnavailable):
            db.run_sync(lambda c: st.kv_set(c, "while_down", 1))
        with pytest.raises(st.StoreUnavailable):
            db.read(lambda c: st.kv_get(c, "before")).result()
        faulty_pg.start_server()
        failures = []
        for _ in range(50):  # reconnects are tried at most every pg.RECONNECT_EVERY_S
            try:
                db.run_sync(lambda c: st.kv_set(c, "after", 1))
                break
            except st.StoreUnavailable as exc:
                failures.append(exc)
                time.sleep(0.1)
        faulty_pg.restart()  # again, without a pause: connections closed under the store
        values = None
        for _ in range(50):
            try:
                values = db.read(lambda c: [st.kv_get(c, k) for k in ("before", "while_down", "after")]).result()
                break
            except st.StoreUnavailable as exc:
                failures.append(exc)
                time.sleep(0.1)
    finally:
        db.close()
    assert values == [1, None, 1]  # the refused write did nothing; the others are there
    assert len(failures) < 50 and all(isinstance(f, st.StoreUnavailable) for f in failures)


def test_a_postgres_server_that_stops_answering_is_unavailable_not_a_hang_and_close_does_not_wait_on_it(
        faulty_pg, monkeypatch):
    """A hung server (every PostgreSQL process stopped: connections accepted, nothing answered; TCP to a dead
    path looks the same for hours): a statement fails StoreUnavailable after ANSWER_TIMEOUT_S, its session
    closed, a new connection after CONNECT_TIMEOUT_S, and nothing of the failed transaction is committed;
    once the server answers the store goes on by itself. Closing the store while its writer still waits on
    the server returns False at its timeout, with nothing closed under the writer, which then finishes."""
    monkeypatch.setattr(pg, "ANSWER_TIMEOUT_S", 1.0)
    monkeypatch.setattr(pg, "CONNECT_TIMEOUT_S", 2)
    db = st.Database(faulty_pg.new_database())
    frozen: list[int] = []
    try:
        db.run_sync(lambda c: st.kv_set(c, "before", 1))
        frozen = faulty_pg.freeze()
        with pytest.raises(st.StoreUnavailable, match="did not answer within 1 s"):
            db.run_sync(lambda c: st.kv_set(c, "while_hung", 1))
        with pytest.raises(st.StoreUnavailable):  # the reader's first connection: libpq's connect_timeout
            db.read(lambda c: st.kv_get(c, "before")).result(timeout=60)
        faulty_pg.thaw(frozen)
        for _ in range(100):  # reconnects are tried at most every RECONNECT_EVERY_S
            try:
                values = db.read(lambda c: [st.kv_get(c, k) for k in ("before", "while_hung")]).result(timeout=60)
                break
            except st.StoreUnavailable:
                time.sleep(0.1)
        assert values == [1, None]  # the timed-out transaction was never committed
        db.run_sync(lambda c: st.kv_set(c, "after", 1))  # the writer's connection is open again
        monkeypatch.setattr(pg, "ANSWER_TIMEOUT_S", 60.0)
        frozen = faulty_pg.freeze()
        waiting = db.submit(lambda c: st.kv_set(c, "held", 1))
        time.sleep(0.5)  # the writer has sent it and waits
        assert db.close(timeout=1.0) is False and not waiting.done()
        faulty_pg.thaw(frozen)
        waiting.result(timeout=60)  # the writer was left alone and finished: committed, answered
    finally:
        faulty_pg.thaw(frozen)
        db.close()
    check = st.Database(db.path)
    try:
        assert check.read(lambda c: [st.kv_get(c, k) for k in ("after", "held")]).result(timeout=60) == [1, 1]
    finally:
        check.close()


# --- real edge processes ---------------------------------------------------------------------------------------


def test_sigterm_stops_an_edge_whose_postgres_server_stopped_answering(faulty_pg, tmp_path):
    """Before, the edge logged "shutting down" and never exited: its store's writer waited on the hung server
    for good and the stop waited on the writer. Now the store gets until the stop's deadline, then is left
    behind (nothing it had not committed was acknowledged) and the process exits 0."""
    base = make_coordinator_dir(tmp_path, {"database": faulty_pg.new_database()})
    grpc_port, http_port = free_port(), free_port()
    edge = start(base, tmp_path / "edge.log", "--role=edge", f"server.port={grpc_port}", f"server.http_port={http_port}")
    frozen: list[int] = []
    try:
        wait_http(http_port, edge, tmp_path / "edge.log")
        ca = (base / "tls" / "ca.crt").read_bytes()

        async def register(node: Node) -> None:
            await node.stub.call("Register", pb.RegisterRequest(public_key=node.key.public.raw, software_version="test"),
                                 timeout=3)

        async def scenario():
            first, second = Node(f"127.0.0.1:{grpc_port}", ca), Node(f"127.0.0.1:{grpc_port}", ca)
            await register(first)
            frozen.extend(faulty_pg.freeze())
            with pytest.raises(CallError) as info:  # its write waits on the server past the call's deadline
                await register(second)
            await first.close()
            await second.close()
            return info.value.code

        assert asyncio.run(scenario()) == grpc.StatusCode.DEADLINE_EXCEEDED
        edge.send_signal(signal.SIGTERM)
        edge.wait(60)  # hang guard: before the change it never exited
    finally:
        faulty_pg.thaw(frozen)
        if edge.poll() is None:
            edge.kill()
    log = (tmp_path / "edge.log").read_text()
    assert edge.returncode == 0, log[-3000:]
    assert "the store still waits on the database" in log and "left behind" in log, log[-3000:]


def test_an_edge_refuses_store_unavailable_while_postgres_is_down_then_serves_the_same_node(faulty_pg, tmp_path):
    url = faulty_pg.new_database()
    base = make_coordinator_dir(tmp_path, {"database": url})
    grpc_port, http_port = free_port(), free_port()
    procs = {"edge": start(base, tmp_path / "edge.log", "--role=edge", f"server.port={grpc_port}",
                           f"server.http_port={http_port}")}
    try:
        wait_http(http_port, procs["edge"], tmp_path / "edge.log")
        ca = (base / "tls" / "ca.crt").read_bytes()

        async def scenario():
            node = Node(f"127.0.0.1:{grpc_port}", ca)
            await node.stub.register(pb.RegisterRequest(public_key=node.key.public.raw, software_version="test"))
            lease = (await node.stub.lease_work(pb.LeaseRequest())).leases[0]
            assert (await node.stub.submit_group(shaped_group(lease))).accepted
            pending = shaped_group((await node.stub.lease_work(pb.LeaseRequest())).leases[0])
            faulty_pg.stop_server()
            refused = []
            for call in (lambda: node.stub.heartbeat(pb.HeartbeatRequest()), lambda: node.stub.submit_group(pending),
                         lambda: node.stub.lease_work(pb.LeaseRequest()), lambda: node.stub.get_ledger()):
                with pytest.raises(CallError) as info:
                    await call()
                refused.append((info.value.code, info.value.reason))
            # A refusal the door makes before the store (a clock far off) is still that refusal, not a crash.
            with pytest.raises(CallError) as info:
                await node.stub.call("Heartbeat", pb.HeartbeatRequest(), now_ms=int(time.time() * 1000) - 3_600_000)
            refused.append((info.value.code, info.value.reason))
            faulty_pg.start_server()
            while_back = []

            async def served(call):
                """What a node does: retry UNAVAILABLE. Each of the edge's connections to the store finds
                the restart on its next statement, so any call may be refused once more after another passed."""
                for _ in range(100):
                    try:
                        return await call()
                    except CallError as err:
                        if err.code != grpc.StatusCode.UNAVAILABLE:
                            raise
                        while_back.append((err.code, err.reason))
                        await asyncio.sleep(0.1)
                raise AssertionError(f"not served again: {while_back[-3:]}")

            accepted = [(await served(lambda: node.stub.submit_group(pending))).accepted]  # the refused group again
            faulty_pg.restart()  # pg_ctl restart -m fast: the edge's connections are closed under it
            lease = (await served(lambda: node.stub.lease_work(pb.LeaseRequest()))).leases[0]
            accepted.append((await served(lambda: node.stub.submit_group(shaped_group(lease)))).accepted)
            await served(lambda: node.stub.heartbeat(pb.HeartbeatRequest()))
            await node.close()
            return refused, while_back, accepted

        refused, while_back, accepted = asyncio.run(scenario())
        counts = results_by_reason(http_port)
    finally:
        stop_all(procs)
    assert refused == [(grpc.StatusCode.UNAVAILABLE, STORE_DOWN)] * 4 + [(grpc.StatusCode.UNAUTHENTICATED, "clock_skew")]
    assert set(while_back) <= {(grpc.StatusCode.UNAVAILABLE, STORE_DOWN)}
    assert accepted == [True, True]  # the same node, the same edge process: served again once PostgreSQL is back
    assert counts.get(STORE_DOWN, 0) >= 4 and "internal" not in counts, counts
    assert procs["edge"].returncode == 0
    db = st.Database(url)
    try:
        assert db.run_sync(st.status_summary)["accepted_groups"] == 3
    finally:
        db.close()


def test_new_keys_from_one_address_spread_over_two_edges_get_one_budget(faulty_pg, tmp_path):
    url = faulty_pg.new_database()
    base = make_coordinator_dir(tmp_path, {"database": url, "identity.exempt_networks": [],
                                           "identity.new_burst_per_address": 3, "identity.new_per_hour_per_address": 1})
    grpc_port = free_port()
    http = {"edge-a": free_port(), "edge-b": free_port()}
    procs = {name: start(base, tmp_path / f"{name}.log", "--role=edge", f"server.port={grpc_port}",
                         f"server.http_port={port}") for name, port in http.items()}
    try:
        for name, proc in procs.items():
            wait_http(http[name], proc, tmp_path / f"{name}.log")
        ca = (base / "tls" / "ca.crt").read_bytes()

        async def burst():
            outcomes = []
            for _ in range(16):  # each on its own connection: the kernel spreads them over the two edges
                node = Node(f"127.0.0.1:{grpc_port}", ca)
                try:
                    await node.stub.register(pb.RegisterRequest(public_key=node.key.public.raw,
                                                                software_version="test"))
                    outcomes.append("ok")
                except CallError as err:
                    outcomes.append(err.reason)
                await node.close()
            return outcomes

        outcomes = asyncio.run(burst())
        served = {name: requests_served(port) for name, port in http.items()}
    finally:
        stop_all(procs)
    assert served["edge-a"] > 0 and served["edge-b"] > 0, served  # both edges took registrations
    assert sorted(outcomes) == ["new_identity_limited"] * 13 + ["ok"] * 3  # one budget of 3, not 3 per edge


def test_killing_one_edge_under_load_loses_no_group_and_trains_none_twice(faulty_pg, tmp_path):
    url = faulty_pg.new_database()
    # A step every 4 groups moves the version fast: a node delayed by reconnects under a loaded machine could
    # find its group more than the default s_max (2) behind and be refused stale_version, which is right but
    # not what this test is about (seen once in a loaded full run); the window is widened for it.
    base = make_coordinator_dir(tmp_path, {"database": url, "trainer.enabled": True, "trainer.min_groups": 4,
                                           "trainer.groups_per_step": 4, "trainer.lr": 1e-3, "intake.s_max": 1000,
                                           "leases.probation_max_open": 8, "leases.max_open_per_node": 8})
    grpc_port, http = edge_ports()
    procs = {}
    try:
        start_edges_and_trainer(base, tmp_path, grpc_port, http, procs)
        ca = (base / "tls" / "ca.crt").read_bytes()
        acked: list[str] = []
        killed = asyncio.Event()
        after_kill: dict[int, int] = {}

        async def work(i: int, node: Node, until: int) -> list[str]:
            """Lease and submit until ``until`` groups are acknowledged in all; a failed call reconnects and
            is sent again (freshly signed), a submission until it is answered."""
            errors = []
            while len(acked) < until:
                try:
                    leased = await node.stub.lease_work(pb.LeaseRequest())
                except CallError as err:
                    errors.append(err.reason)
                    if err.reason not in CONNECTION_LOST:
                        return errors  # a refusal: this node stops (and the assertion on errors says why)
                    await node.reconnect()
                    continue
                if not leased.leases:
                    await asyncio.sleep(max(0.05, leased.retry_after_ms / 1000))
                    continue
                group = shaped_group(leased.leases[0])
                answer = None
                for _ in range(50):
                    try:
                        answer = await node.stub.submit_group(group)
                        break
                    except CallError as err:
                        errors.append(err.reason)
                        if err.reason not in CONNECTION_LOST:
                            return errors
                        await node.reconnect()
                if answer is not None and answer.accepted:
                    acked.append(group.lease_id)
                    if killed.is_set():
                        after_kill[i] = after_kill.get(i, 0) + 1
            return errors

        async def two_per_edge() -> list[Node]:
            """Registered nodes, two connected to each edge (the kernel places a connection; the edge whose
            request count moved is the one it reached)."""
            placed: dict[str, list[Node]] = {"edge-a": [], "edge-b": []}
            for _ in range(40):
                if all(len(on_edge) >= 2 for on_edge in placed.values()):
                    break
                before = {name: requests_served(http[name]) for name in placed}
                node = Node(f"127.0.0.1:{grpc_port}", ca)
                await node.stub.register(pb.RegisterRequest(public_key=node.key.public.raw, software_version="test"))
                edge = next(name for name in placed if requests_served(http[name]) > before[name])
                if len(placed[edge]) < 2:
                    placed[edge].append(node)
                else:
                    await node.close()
            assert all(len(on_edge) == 2 for on_edge in placed.values()), placed
            return placed["edge-a"] + placed["edge-b"]

        async def load():
            nodes = await two_per_edge()
            workers = [asyncio.create_task(work(i, node, until=40)) for i, node in enumerate(nodes)]
            while len(acked) < 12 and not all(worker.done() for worker in workers):
                await asyncio.sleep(0.05)
            procs["edge-a"].send_signal(signal.SIGKILL)  # under the first two nodes
            procs["edge-a"].wait(10)
            killed.set()
            errors = await asyncio.gather(*workers)
            for node in nodes:
                await node.close()
            return errors

        errors = asyncio.run(asyncio.wait_for(load(), 240))
        # Let the trainer take what is queued, then stop everything and read the store.
        time.sleep(3)
    finally:
        stop_all(procs)
    db = st.Database(url)
    try:
        stored = db.run_sync(lambda c: [r[0] for r in c.execute("SELECT lease_id FROM groups")])
        consumed = db.run_sync(lambda c: c.execute("SELECT COUNT(*) FROM groups WHERE consumed_step IS NOT NULL")
                               .fetchone()[0])
        history = db.run_sync(lambda c: st.kv_get(c, "trainer_history", []))
    finally:
        db.close()
    assert len(acked) >= 40 and len(set(acked)) == len(acked)
    assert sorted(stored) == sorted(acked)  # every acknowledged group stored exactly once, nothing else
    assert len(after_kill) == 4, after_kill  # every node went through the surviving edge, those of edge-a too
    assert consumed >= 4 and sum(step["groups"] for step in history) == consumed  # no group trained twice
    assert procs["edge-b"].returncode == 0 and procs["trainer"].returncode == 0
    # What a node saw of the kill: its connection failing, never a refusal of its work.
    assert {e for errs in errors for e in errs} <= CONNECTION_LOST, errors


def test_reasons_the_faults_use_are_retried_by_nodes():
    """store_unavailable is UNAVAILABLE, which a node retries with its backoff; it is never a strike."""
    from veriroll.node.agent import RETRYABLE

    assert Reason.STORE_UNAVAILABLE.code is grpc.StatusCode.UNAVAILABLE and Reason.STORE_UNAVAILABLE.code in RETRYABLE
    assert not Reason.STORE_UNAVAILABLE.strike




def test_edges_count_each_other_through_the_store_and_split_the_request_limits(store_target):
    """Each edge enforces 1/N of the per-key and per-address limits, N from the heartbeat rows; an edge that
    stops beating leaves N after the TTL, and the survivors take the whole limit back."""
    from veriroll.coordinator.admission import RateLimiter
    from veriroll.coordinator.edge import LiveEdges

    db = st.Database(store_target)
    now = [10_000_000]
    limits = [RateLimiter(20.0, 60.0), RateLimiter(20.0, 60.0)]
    edges = [LiveEdges(db, lambda: now[0], limit.split) for limit in limits]

    async def beat(*which: int) -> None:
        for i in which:
            edges[i].poll()
            await edges[i]._beating

    async def scenario():
        await beat(0, 1)
        counts = [edges[0].count, edges[1].count]  # the first beat of edge 0 saw only itself
        now[0] += LiveEdges.BEAT_MS
        await beat(0, 1)
        counts += [edges[0].count, edges[1].count]
        shares = [(limit.rate, limit.burst) for limit in limits]
        now[0] += LiveEdges.TTL_MS + 1  # edge 1 went silent (killed, or idle)
        await beat(0)
        return counts, shares

    try:
        counts, shares = asyncio.run(scenario())
    finally:
        db.close()
    assert counts == [1, 2, 2, 2]
    assert shares == [(10.0, 30.0), (10.0, 30.0)]
    assert edges[0].count == 1 and (limits[0].rate, limits[0].burst) == (20.0, 60.0)


def test_a_connection_opened_mid_run_takes_no_lock_on_the_tables(pg_url):
    """Every process opens connections while others work (readers, a restarted edge, a reconnect): once the
    schema is there, opening one runs no DDL, whose table locks deadlocked with another process's writer."""
    first = st.connect(pg_url)  # creates the schema
    writer = st.connect(pg_url)
    try:
        writer.execute("BEGIN")
        writer.execute("INSERT INTO kv(key, value) VALUES('busy', '1')")
        writer.execute("UPDATE counters SET value = value WHERE name = 'open_leases'")
        writer.execute("INSERT INTO nodes(node_id, public_key, registered_ms, last_seen_ms) VALUES('n', ?, 0, 0)",
                       (b"k" * 32,))
        # A lock wait fails in 2 s instead of hanging: what a DDL statement would meet here.
        mid_run = st.connect(pg_url + "&options=-c%20lock_timeout%3D2000")
        assert mid_run.execute("SELECT COUNT(*) FROM nodes").fetchone()[0] == 0  # it does not see the open write
        mid_run.close()
        writer.execute("ROLLBACK")
    finally:
        writer.close()
        first.close()
