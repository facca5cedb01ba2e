"""The store's named operations on both backends, SQLite and PostgreSQL, with the same expected results;
and a whole coordinator on PostgreSQL: leases, accepts, refusals counted once, the trainer's step, the
status API. PostgreSQL runs as a throwaway cluster (tests/pg_cluster.py), skipped where it cannot."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from support import make_coordinator_dir, node_client, running_coordinator
from test_server import expect_refusal, shaped_group

from veriroll.coordinator import store as st
from veriroll.coordinator.http import read_status
from veriroll.protos.identity import PrivateKey
from veriroll.protos.v1 import coordinator_pb2 as pb


def lease(node_id: str, prompt_id: int, lease_id: str, *, probation: bool, deadline: int = 10_000) -> st.LeaseRecord:
    return st.LeaseRecord(lease_id=lease_id, node_id=node_id, prompt_id=prompt_id, group_size=2, temperature=1.0,
                          max_new_tokens=3, seeds=(1, 2), stop_token_ids=(2,), policy_version=0, issued_ms=0,
                          deadline_ms=deadline, state=st.LeaseState.OPEN, probation=probation)


def group(lease_id: str, node_id: str, prompt_id: int, rewards: list[float]) -> st.AcceptedGroup:
    blob = st.pack_i32([5, 6, 2])
    return st.AcceptedGroup(lease_id=lease_id, node_id=node_id, prompt_id=prompt_id, env="e", policy_version=0,
                            temperature=1.0, arrival_ms=1_000, content_hash="h" + lease_id, tokens=6, rewards=rewards,
                            verified=True, clean=True,
                            samples=[(blob, st.pack_f32([-1, -1, -1]), None, "stop") for _ in rewards])


def test_named_operations_give_the_same_results_on_both_backends(store_target):
    db = st.Database(store_target)
    a, b = PrivateKey.generate().public, PrivateKey.generate().public

    def script(conn):
        out = {}
        st.register_node(conn, a.node_id, a.raw, 0, {"cpu": "x"}, "1", "alice")
        st.register_node(conn, b.node_id, b.raw, 0, {}, "1", "bob")
        again = st.register_node(conn, a.node_id, a.raw, 5, {"cpu": "y"}, "2", "alice")
        out["standing"] = again.standing
        p1 = st.insert_leased_prompt(conn, "e", "1+1=", "2", {"k": 1}, [1, 5, 6])
        p2 = st.insert_leased_prompt(conn, "e", "1+2=", "3", {}, [1, 5, 7])
        p3 = st.insert_leased_prompt(conn, "e", "1+3=", "4", {}, [1, 5, 8])
        out["drawn"] = st.prompts_drawn(conn)
        st.insert_lease(conn, lease(a.node_id, p1, "L1", probation=True))
        st.insert_lease(conn, lease(a.node_id, p2, "L2", probation=True))
        st.insert_lease(conn, lease(b.node_id, p3, "L3", probation=False, deadline=10))
        out["open"] = st.open_lease_totals(conn)
        out["open_of_a"] = st.open_leases_of(conn, a.node_id)
        out["limits_of_b"] = st.lease_limits(conn, b.node_id)
        out["gid"] = st.accept_group(conn, group("L1", a.node_id, p1, [1.0, 0.0]), probation_groups=1) is not None
        out["limits_after_accept"] = st.lease_limits(conn, a.node_id)  # one queued group, L2 still open
        out["again"] = st.accept_group(conn, group("L1", a.node_id, p1, [1.0, 0.0]), probation_groups=1)
        out["spent"] = st.spend_lease(conn, "L2", p2)
        out["expired"] = st.expire_leases(conn, 100)
        out["open_after"] = st.open_lease_totals(conn)
        out["pending"] = st.take_pending_prompt(conn)[1:]  # the spent lease's prompt comes back first
        out["banned_at"] = st.record_refusal(conn, b.node_id, "toploc_failed", strike=True, strike_limit=1,
                                             lease_id="L3", detail="forged", now_ms=50)
        st.record_refusal(conn, "", "unknown_key", strike=False, strike_limit=1, now_ms=60)
        out["summary"] = st.status_summary(conn)
        out["ledger_a"] = {k: st.node_ledger(conn, a.node_id)[k] for k in ("standing", "accepted_groups",
                                                                            "accepted_tokens", "clean_groups")}
        out["listed"] = [n["display_name"] for n in st.list_nodes(conn)]
        out["by_node"] = st.rejections_by_node(conn)
        out["found"] = st.find_node(conn, a.node_id[:12])["node_id"] == a.node_id
        out["b"] = st.node_by_id(conn, b.node_id).standing
        return out

    out = db.run_sync(script)
    assert out["standing"] == st.Standing.PROBATION and out["drawn"] == 3
    assert out["open"] == (3, 2) and out["open_of_a"] == 2 and out["limits_of_b"] == (0, 1)
    assert out["limits_after_accept"] == (1, 1)
    assert out["gid"] and out["again"] is None and out["spent"] and out["expired"] == 1
    assert out["open_after"] == (0, 0) and out["pending"] == ([1, 5, 7], "e")
    assert out["banned_at"] == 1 and out["b"] == st.Standing.BANNED
    s = out["summary"]
    assert (s["nodes"], s["open_leases"], s["accepted_groups"], s["unconsumed_groups"], s["banned_nodes"]) == (2, 0, 1, 1, 1)
    assert s["rejections_by_reason"] == {"toploc_failed": 1, "unknown_key": 1}
    assert out["ledger_a"] == {"standing": "trusted", "accepted_groups": 1, "accepted_tokens": 6, "clean_groups": 1}
    assert out["listed"] == ["alice", "bob"] and out["by_node"] == {b.node_id: {"toploc_failed": 1}}
    assert out["found"]

    def trainer_side(conn):
        out = {"queued": st.queued_group_versions(conn)}
        gid = out["queued"][0][0]
        loaded = st.groups_with_samples(conn, [gid])[gid]
        out["samples"] = [(r["reward"], bytes(r["token_ids"]) == st.pack_i32([5, 6, 2])) for r in loaded[1]]
        out["answer"] = st.group_answer(conn, gid)
        st.commit_step(conn, 1, [gid], [{"step": 1}], 1)
        out["after_commit"] = (st.queued_groups(conn), st.consumed_groups(conn), st.kv_get(conn, "policy_version"))
        out["reset"] = st.unconsume_after(conn, 0) == [gid]
        out["dropped"] = st.drop_groups(conn, [gid], "stale")
        out["final"] = (st.queued_groups(conn), st.consumed_groups(conn, 1))
        return out

    t = db.run_sync(trainer_side)
    assert len(t["queued"]) == 1 and t["samples"] == [(1.0, True), (0.0, True)]
    assert t["answer"] == (6, [1.0, 0.0]) and t["after_commit"] == (0, 1, 1)
    assert t["reset"] and list(t["dropped"].values()) == [2] and t["final"] == (0, 0)
    status = db.read(lambda c: read_status(c, now_ms=1_000, window_s=3600)).result()
    assert status["summary"]["accepted_groups"] == 1 and status["rejections"]["by_reason"]["toploc_failed"] == 1
    db.close()


HANG_GUARD_POLLS = 3600  # 0.05 s each


def test_a_whole_coordinator_runs_on_postgres(pg_url, tmp_path):
    base = make_coordinator_dir(tmp_path, {"database": pg_url, "trainer.enabled": True, "trainer.min_groups": 2,
                                           "trainer.groups_per_step": 2, "trainer.lr": 1e-3,
                                           "leases.probation_max_open": 2})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as alice, node_client(coord) as bob:
            for stub in (alice, bob):
                first, second = (await stub.lease_work(pb.LeaseRequest(max_leases=2))).leases
                rewarded = shaped_group(first)
                await stub.submit_group(rewarded)
                bad = shaped_group(second)
                bad.samples.pop()
                await expect_refusal(stub.submit_group(bad), grpc.StatusCode.INVALID_ARGUMENT, "wrong_group_size")
            # The trainer steps on the two accepted groups; its version is current once committed and then
            # published (policy.version moves last). A hang guard, not a time limit: it may take long on a
            # loaded machine, and reading the summary before the step commits would race it.
            for _ in range(HANG_GUARD_POLLS):
                if coord.service.policy.version >= 1:
                    break
                await asyncio.sleep(0.05)
            summary = coord.db.run_sync(st.status_summary)
            metric = int(coord.service.metrics.rejections.get(reason="wrong_group_size"))
            return summary, metric, coord.service.policy.version

    started = time.perf_counter()
    summary, metric, version = asyncio.run(scenario())
    assert summary["accepted_groups"] == 2 and summary["trainer_step"] == 1, (summary, time.perf_counter() - started)
    assert summary["rejections_by_reason"] == {"wrong_group_size": 2} and metric == 2
    assert summary["unconsumed_groups"] == 0 and version == 1 and summary["policy_version"] == 1


def test_both_backends_have_the_same_tables_and_columns(tmp_path, pg_url):
    """A column added to one schema and not the other fails here, not on an operator's PostgreSQL."""
    lite = st.connect(tmp_path / "state.db")
    tables = [r[0] for r in lite.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")]
    sqlite_columns = {(t, r["name"]) for t in tables for r in lite.execute(f"PRAGMA table_info({t})")}
    pg = st.connect(pg_url)
    pg_columns = {(r[0], r[1]) for r in pg.execute(
        "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public'")}
    # PostgreSQL's counters have a row per writer slot (store.schema.COUNTER_SLOTS); SQLite has one writer.
    assert pg_columns - {("counters", "slot")} == sqlite_columns


def test_both_backends_have_the_same_indexes(tmp_path, pg_url):
    """The indexes come from one declaration (store/schema.py): the same names on the same columns, but for
    rejections_time, which only PostgreSQL has (as before the schema was written once)."""
    lite = st.connect(tmp_path / "state.db")
    sqlite_indexes = {(r[0], r[1]) for r in lite.execute(
        "SELECT name, tbl_name FROM sqlite_master WHERE type = 'index' AND name NOT LIKE 'sqlite_%'")}
    pg = st.connect(pg_url)
    pg_indexes = {(r[0], r[1]) for r in pg.execute(
        "SELECT indexname, tablename FROM pg_indexes WHERE schemaname = 'public' AND indexname NOT LIKE '%_pkey' "
        "AND indexname NOT LIKE '%_key'")}
    lite.close()
    pg.close()
    assert pg_indexes - {("rejections_time", "rejections")} == sqlite_indexes


def test_one_live_session_per_key_on_postgres(pg_url):
    db = st.Database(pg_url)
    key = PrivateKey.generate().public
    first, second = st.Session("a" * 32, "10.0.0.1"), st.Session("b" * 32, "10.0.0.2")

    def script(conn):
        st.register_node(conn, key.node_id, key.raw, 0, {}, "1", "")
        st.touch_node(conn, key.node_id, 1_000, 0, first)
        return st.other_live_session(conn, key.node_id, second, 2_000, 30_000)

    live = db.run_sync(script)
    db.close()
    assert live is not None and live.address == "10.0.0.1"


def test_a_batch_rolled_back_by_a_deadlock_runs_again(store_target):
    """PostgreSQL breaks a deadlock between two processes' writers by rolling one back (40P01): the writer
    runs the whole batch again instead of answering the caller with an internal error."""
    psycopg = pytest.importorskip("psycopg")
    db = st.Database(st.database_target(Path("."), str(store_target)))
    calls = []

    def op(conn):
        calls.append(1)
        st.kv_set(conn, "deadlock-probe", len(calls))
        if len(calls) == 1:
            raise psycopg.errors.DeadlockDetected("deadlock detected (raised by the test)")
        return len(calls)

    try:
        assert db.run_sync(op) == 2
        assert db.run_sync(lambda c: st.kv_get(c, "deadlock-probe", None)) == 2  # the first run left nothing
        calls.clear()

        def always(conn):
            calls.append(1)
            raise psycopg.errors.DeadlockDetected("deadlock detected (raised by the test)")

        with pytest.raises(psycopg.errors.DeadlockDetected):
            db.run_sync(always)
        assert len(calls) == st.TRANSIENT_RETRIES + 1  # bounded: a cycle that never clears is answered
    finally:
        db.close()


def test_a_process_that_waited_for_the_schema_lock_does_not_run_the_schema_again(pg_url):
    """Processes starting together: one runs the schema under the advisory lock, the others wait on it and
    then find the schema's mark; running the DDL again would lock tables other processes work on."""
    import threading

    from veriroll.coordinator.store import pg

    st.connect(pg_url).close()
    holder = st.connect(pg_url)
    holder.execute("COMMENT ON TABLE nodes IS 'an older schema'")
    holder.execute("BEGIN")
    holder.execute("SELECT pg_advisory_xact_lock(?)", (pg.SCHEMA_LOCK,))
    opened = []
    starting = threading.Thread(target=lambda: opened.append(st.connect(pg_url)))
    starting.start()
    for _ in range(HANG_GUARD_POLLS):  # until the other connect waits on the lock
        if holder.execute("SELECT COUNT(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()[0]:
            break
        time.sleep(0.05)
    # What the holder's schema run leaves, and a trace the DDL would undo were it run again.
    holder.execute("DROP INDEX leases_node")
    holder.execute(f"COMMENT ON TABLE nodes IS '{pg.SCHEMA_MARK}'")
    holder.execute("COMMIT")
    starting.join(timeout=HANG_GUARD_POLLS * 0.05)
    index = holder.execute("SELECT to_regclass('leases_node')").fetchone()[0]
    holder.close()
    for conn in opened:
        conn.close()
    assert len(opened) == 1 and index is None
