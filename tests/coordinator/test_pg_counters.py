"""PostgreSQL with several writer processes: the counters (kept by triggers, and prompts drawn) are one row
per writer slot, so two writers' transactions never queue on a counter row and the summed slots still equal
the rows; an old single-row counters table migrates with its values (prompts drawn from kv); and a read of
several statements sees one snapshot.
PostgreSQL runs as a throwaway cluster (tests/pg_cluster.py), skipped where it cannot."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from veriroll.coordinator import store as st
from veriroll.coordinator.store import pg

HANG_GUARD_S = 120  # a wait that never ends fails here instead of hanging the run; not a time limit
LOCK_TIMEOUT = "&options=-c%20lock_timeout%3D2000"  # a lock wait fails (55P03) instead of hanging
COUNTERS = ("open_leases", "open_probation_leases", "queued_groups", "prompts_drawn")  # as counted() orders them


def lease(lease_id: str, prompt_id: int, *, probation: bool, deadline: int = 10_000) -> st.LeaseRecord:
    return st.LeaseRecord(lease_id=lease_id, node_id="n", prompt_id=prompt_id, group_size=1, temperature=1.0,
                          max_new_tokens=3, seeds=(1,), stop_token_ids=(2,), policy_version=0, issued_ms=0,
                          deadline_ms=deadline, state=st.LeaseState.OPEN, probation=probation)


def group(lease_id: str, prompt_id: int) -> st.AcceptedGroup:
    return st.AcceptedGroup(lease_id=lease_id, node_id="n", prompt_id=prompt_id, env="e", policy_version=0,
                            temperature=1.0, arrival_ms=0, content_hash="h" + lease_id, tokens=3, rewards=[1.0],
                            verified=False, clean=True,
                            samples=[(st.pack_i32([5, 6, 2]), st.pack_f32([-1, -1, -1]), None, "stop")])


def lease_and_group(conn, name: str, *, probation: bool, accept: bool, deadline: int = 10_000) -> None:
    """A freshly drawn prompt and its open lease, and the group for it when ``accept``: each a counter change."""
    prompt_id = st.insert_leased_prompt(conn, "e", name, "a", {}, [1, 2])
    st.insert_lease(conn, lease(name, prompt_id, probation=probation, deadline=deadline))
    if accept:
        assert st.accept_group(conn, group(name, prompt_id), probation_groups=1) is not None


def counted(conn) -> tuple[int, int, int, int]:
    """(open leases, open probation leases, queued groups, prompts drawn) counted from the rows themselves."""
    one = lambda sql: int(conn.execute(sql).fetchone()[0])  # noqa: E731
    return (one("SELECT COUNT(*) FROM leases WHERE state = 'open'"),
            one("SELECT COUNT(*) FROM leases WHERE state = 'open' AND probation = 1"),
            one("SELECT COUNT(*) FROM groups WHERE consumed_step IS NULL AND dropped IS NULL"),
            one("SELECT COUNT(*) FROM prompts"))


def summed(conn) -> tuple[int, int, int, int]:
    """The same four from the counters, as the store's readers see them."""
    return (*st.open_lease_totals(conn), st.queued_groups(conn), st.prompts_drawn(conn))


def claimed_slot(db: st.Database) -> str:
    return db.run_sync(lambda c: c.execute("SELECT current_setting('veriroll.counter_slot', true)").fetchone()[0])


def test_two_writers_at_once_keep_the_summed_counters_equal_to_the_rows(pg_url):
    first, second = st.Database(pg_url), st.Database(pg_url)
    start = threading.Barrier(2)

    def write(db: st.Database, who: str) -> None:
        start.wait(timeout=HANG_GUARD_S)
        futures = []
        for i in range(60):  # queued without waiting: the writer commits them in batches
            futures.append(db.submit(lambda c, name=f"{who}-{i}", i=i: lease_and_group(
                c, name, probation=i % 2 == 0, accept=i % 3 == 0, deadline=10 if i % 5 == 0 else 10_000)))
        for f in futures:
            f.result(timeout=HANG_GUARD_S)
        # Each writer also changes rows the other one inserted: those deltas land in its own slot.
        db.run_sync(lambda c: st.expire_leases(c, 100))
        db.run_sync(lambda c: st.drop_groups(c, [g for g, _ in st.queued_group_versions(c)][:5], "stale"))

    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for done in [pool.submit(write, first, "a"), pool.submit(write, second, "b")]:
                done.result(timeout=HANG_GUARD_S)
        slots = {claimed_slot(first), claimed_slot(second)}
        totals = first.read(lambda c: (summed(c), counted(c))).result(timeout=HANG_GUARD_S)
    finally:
        first.close()
        second.close()
    assert len(slots) == 2 and None not in slots  # each writer added to a slot of its own
    assert totals[0] == totals[1]
    assert totals[1][0] > 0 and totals[1][1] > 0 and totals[1][2] > 0  # nothing trivially zero


def test_a_writer_does_not_wait_for_another_writers_open_transaction(pg_url):
    """One writer's transaction is held open after it inserted a lease and accepted a group (each a counter
    change, whose row lock it keeps to its COMMIT); another writer does the same meanwhile and commits. On
    one row per counter the second would wait for the first's COMMIT: here its lock_timeout would fail it."""
    psycopg = pytest.importorskip("psycopg")
    held, other = st.Database(pg_url), st.Database(pg_url + LOCK_TIMEOUT)
    held_slot = claimed_slot(held)  # claimed by its first write transaction
    inside, release = threading.Event(), threading.Event()

    def hold_open(conn):
        lease_and_group(conn, "held", probation=True, accept=True)
        lease_and_group(conn, "held-open", probation=True, accept=False)
        inside.set()
        assert release.wait(HANG_GUARD_S)

    try:
        holding = held.submit(hold_open)
        assert inside.wait(HANG_GUARD_S)

        def meanwhile(conn):
            lease_and_group(conn, "other", probation=True, accept=True)
            lease_and_group(conn, "other-open", probation=True, accept=False)

        other.run_sync(meanwhile)
        committed_first = holding.done()
        seen_meanwhile = other.read(summed).result(timeout=HANG_GUARD_S)
        # The control: a connection that adds to the held writer's slot does wait for it.
        same_slot = st.connect(pg_url + LOCK_TIMEOUT)
        same_slot.execute("SELECT set_config('veriroll.counter_slot', ?, false)", (held_slot,))
        same_slot.execute("BEGIN")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            lease_and_group(same_slot, "same-slot", probation=False, accept=False)
        same_slot.execute("ROLLBACK")
        same_slot.close()
        release.set()
        holding.result(timeout=HANG_GUARD_S)
        after = held.read(lambda c: (summed(c), counted(c))).result(timeout=HANG_GUARD_S)
    finally:
        release.set()
        held.close()
        other.close()
    assert not committed_first
    assert seen_meanwhile == (1, 1, 1, 2)  # the other writer's rows only: the held ones were not committed
    assert after[0] == after[1] == (2, 2, 2, 4)


def test_an_old_single_row_counters_table_becomes_slots_with_its_values(pg_url):
    db = st.Database(pg_url)
    for i in range(6):
        db.run_sync(lambda c, i=i: lease_and_group(c, f"old-{i}", probation=i < 2, accept=i % 2 == 1))
    db.close()
    old = st.connect(pg_url)
    before = counted(old)
    # The layout before slots: one row per counter, prompts drawn in kv, the schema's fingerprint of then.
    old.execute("DROP TABLE counters")
    old.execute("CREATE TABLE counters (name TEXT PRIMARY KEY, value BIGINT NOT NULL)")
    for name, value in zip(COUNTERS[:3], before, strict=False):
        old.execute("INSERT INTO counters(name, value) VALUES(?, ?)", (name, value))
    st.kv_set(old, "prompts_drawn", before[3])
    old.execute("COMMENT ON TABLE nodes IS 'veriroll schema 0123456789abcdef'")
    old.close()

    db = st.Database(pg_url)  # opening it migrates
    try:
        rows = db.read(lambda c: c.execute("SELECT name, slot, value FROM counters ORDER BY name, slot").fetchall()
                       ).result(timeout=HANG_GUARD_S)
        migrated = db.read(summed).result(timeout=HANG_GUARD_S)
        db.run_sync(lambda c: lease_and_group(c, "new", probation=True, accept=True))
        db.run_sync(lambda c: lease_and_group(c, "new-open", probation=True, accept=False))
        after = db.read(lambda c: (summed(c), counted(c))).result(timeout=HANG_GUARD_S)
        left_in_kv = db.read(lambda c: st.kv_get(c, "prompts_drawn")).result(timeout=HANG_GUARD_S)
        mark = db.read(lambda c: c.execute("SELECT obj_description(to_regclass('nodes'), 'pg_class')").fetchone()[0]
                       ).result(timeout=HANG_GUARD_S)
    finally:
        db.close()
    assert before == (3, 1, 3, 6)
    by_name = {}
    for name, slot, value in rows:
        by_name.setdefault(name, {})[slot] = value
    assert by_name == {name: {0: value, **{s: 0 for s in range(1, st.schema.COUNTER_SLOTS)}}
                       for name, value in zip(COUNTERS, before, strict=True)}
    assert migrated == before and left_in_kv is None
    assert after[0] == after[1] == (4, 2, 4, 8)
    assert mark == pg.SCHEMA_MARK


def test_a_read_of_several_statements_sees_one_snapshot(pg_url):
    """Another writer commits between a read's two statements (placed there by events, not timing): a
    Database read sees the value of before in both; the same read on a bare connection would not."""
    db = st.Database(pg_url)
    db.run_sync(lambda c: st.kv_set(c, "probe", 1))
    between, committed = threading.Event(), threading.Event()

    def two_statements(conn):
        first = st.kv_get(conn, "probe")
        between.set()
        assert committed.wait(HANG_GUARD_S)
        return first, st.kv_get(conn, "probe")

    def commit_between(value: int) -> None:
        assert between.wait(HANG_GUARD_S)
        db.run_sync(lambda c: st.kv_set(c, "probe", value))
        committed.set()

    try:
        reading = db.read(two_statements)
        commit_between(2)
        in_database_read = reading.result(timeout=HANG_GUARD_S)

        between.clear()
        committed.clear()
        bare = st.connect(pg_url)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            on_bare = pool.submit(two_statements, bare)
            commit_between(3)
            on_bare_connection = on_bare.result(timeout=HANG_GUARD_S)
        bare.close()
    finally:
        committed.set()
        db.close()
    assert in_database_read == (1, 1)
    assert on_bare_connection == (2, 3)  # the control: READ COMMITTED straddles the commit


def test_a_read_of_one_statement_runs_alone_and_one_of_more_starts_again_in_a_snapshot(pg_url):
    """``run_read`` on PostgreSQL: one statement runs without BEGIN/COMMIT (it is one snapshot by itself); a
    read's second statement is not run outside a snapshot: the read starts again in one, and its answer is
    that run's. ``read`` (the trainer's) begins the snapshot first."""
    db = st.Database(pg_url)
    db.run_sync(lambda c: st.kv_set(c, "probe", 1))
    isolation = lambda c: c.execute("SELECT current_setting('transaction_isolation')").fetchone()[0]  # noqa: E731
    between, committed = threading.Event(), threading.Event()
    runs = []

    def two_statements(conn):
        runs.append(isolation(conn))
        first = st.kv_get(conn, "probe")
        between.set()
        assert committed.wait(HANG_GUARD_S)
        return first, st.kv_get(conn, "probe")

    def in_read_transaction(conn):
        with st.read_transaction(conn):  # as the status API's read does: it joins the read's snapshot
            return isolation(conn), st.kv_get(conn, "probe")

    async def scenario():
        alone = await db.run_read(isolation)
        first_in_snapshot = await asyncio.to_thread(lambda: db.read(isolation).result(HANG_GUARD_S))
        reading = asyncio.ensure_future(db.run_read(two_statements))
        assert await asyncio.to_thread(between.wait, HANG_GUARD_S)
        await db.run(lambda c: st.kv_set(c, "probe", 2))
        committed.set()
        answer = await reading
        nested = await db.run_read(in_read_transaction)
        return alone, first_in_snapshot, answer, nested, await db.run_read(isolation)

    try:
        alone, first_in_snapshot, answer, nested, after = asyncio.run(scenario())
    finally:
        committed.set()
        db.close()
    assert alone == "read committed" and first_in_snapshot == "repeatable read"
    assert runs == ["read committed", "repeatable read"] and answer == (1, 1)
    assert nested == ("repeatable read", 2)
    assert after == "read committed"  # no transaction left open on the reader connection
