"""A store that cannot write for reasons of the machine, not of the request: a full disk, a read-only file, a
PostgreSQL server that is read-only (a standby) or out of disk. Nodes are answered ``store_unavailable``
(UNAVAILABLE, which they retry), never ``internal`` or gRPC's bare UNKNOWN; the operator gets the cause in
one log line, not a traceback per request; nothing accepted is lost, and the same requests go through once
the disk has room again.

The full disk here is SQLite's own: ``PRAGMA max_page_count`` caps the file, and a transaction that would
grow it fails with SQLITE_FULL, the same error a full filesystem gives (tried by hand on a 12 MiB tmpfs
under a coordinator process and 8 nodes: see docs/hardening.md).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3

import grpc
import pytest
from support import make_coordinator_dir, node_client, running_coordinator
from test_server import shaped_group

from veriroll.coordinator import store as st
from veriroll.coordinator.service import StoreOutageLog
from veriroll.coordinator.store import pg
from veriroll.protos.reasons import Reason
from veriroll.protos.service import CallError
from veriroll.protos.v1 import coordinator_pb2 as pb

STORE_DOWN = Reason.STORE_UNAVAILABLE.value


def sqlite_error(setup: str, statement: str) -> sqlite3.Error:
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t(x INTEGER PRIMARY KEY, b BLOB)")
    conn.execute("INSERT INTO t VALUES (1, zeroblob(10))")
    conn.execute(setup)
    try:
        conn.execute(statement)
    except sqlite3.Error as exc:
        return exc
    raise AssertionError(f"{statement} did not fail")


async def fill_the_disk(db: st.Database) -> None:
    """Cap the file at its size, then fill what is left in it, one transaction at a time, to 64 bytes."""
    pages = await db.run(lambda c: c.execute("PRAGMA page_count").fetchone()[0])
    await db.run(lambda c: c.execute(f"PRAGMA max_page_count = {pages}"))
    size, n = 1 << 16, 0
    while size >= 64:
        try:
            await db.run(lambda c, n=n, size=size: st.kv_set(c, f"filler{n}", "x" * size))
            n += 1
        except st.StoreUnavailable:
            size //= 2


def test_errors_of_the_machine_are_store_unavailable_and_errors_of_an_operation_are_not():
    full = st.unavailable(sqlite_error("PRAGMA max_page_count = 2", "INSERT INTO t VALUES (2, zeroblob(100000))"))
    read_only = st.unavailable(sqlite_error("PRAGMA query_only = 1", "INSERT INTO t VALUES (2, NULL)"))
    assert isinstance(full, st.StoreUnavailable) and "full (SQLITE_FULL)" in str(full)
    assert isinstance(read_only, st.StoreUnavailable) and "read-only" in str(read_only)
    assert isinstance(full.__cause__, sqlite3.OperationalError)
    # The operation's own errors stay what they are: the writer undoes that operation alone.
    assert st.unavailable(sqlite_error("SELECT 1", "INSERT INTO t VALUES (1, NULL)")) is None  # a constraint
    assert st.unavailable(sqlite_error("SELECT 1", "SELECT nope FROM t")) is None  # a bug in a statement
    assert st.unavailable(ValueError("x")) is None
    if pg.psycopg is not None:
        errors = pg.psycopg.errors
        assert "out of a resource" in pg.unavailable_reason(errors.DiskFull("could not extend file"))
        assert "read-only" in pg.unavailable_reason(errors.ReadOnlySqlTransaction("read-only"))
        assert "system error" in pg.unavailable_reason(errors.IoError("could not write"))
        assert pg.unavailable_reason(errors.UniqueViolation("duplicate key")) is None
        assert pg.unavailable_reason(errors.UndefinedColumn("no such column")) is None


def test_a_batch_on_a_full_disk_fails_whole_as_unavailable_and_commits_nothing(tmp_path):
    db = st.Database(tmp_path / "state.db")
    try:
        db.run_sync(lambda c: st.kv_set(c, "before", 1))
        pages = db.run_sync(lambda c: c.execute("PRAGMA page_count").fetchone()[0])
        db.run_sync(lambda c: c.execute(f"PRAGMA max_page_count = {pages}"))
        # Two ops in one batch (queued before the writer takes them): one small, one that needs new pages.
        small = db.submit(lambda c: st.kv_set(c, "small", 1))
        big = db.submit(lambda c: st.kv_set(c, "big", "x" * 200_000))
        for fut in (small, big):
            with pytest.raises(st.StoreUnavailable, match="SQLITE_FULL"):
                fut.result(timeout=30)
        assert db.read(lambda c: st.kv_get(c, "before")).result() == 1  # reads go on
        db.run_sync(lambda c: c.execute("PRAGMA max_page_count = 1000000"))  # the operator freed the disk
        db.run_sync(lambda c: st.kv_set(c, "after", 1))
        values = db.read(lambda c: [st.kv_get(c, k) for k in ("before", "small", "big", "after")]).result()
    finally:
        db.close()
    assert values == [1, None, None, 1]


def test_a_full_disk_refuses_store_unavailable_loses_nothing_and_serves_again_once_freed(tmp_path, caplog):
    # Groups of 8x64 tokens: over 4 KiB of samples, more than the free room of any one page the file has.
    base = make_coordinator_dir(tmp_path, {"leases.group_size": 8, "leases.max_new_tokens": 64})
    caplog.set_level(logging.WARNING, logger="veriroll.coordinator")

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            first = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            assert (await stub.submit_group(shaped_group(first))).accepted
            pending = shaped_group((await stub.lease_work(pb.LeaseRequest())).leases[0])
            await fill_the_disk(coord.db)
            refused = []
            for _ in range(3):  # the same group, as a node retries it
                with pytest.raises(CallError) as info:
                    await stub.submit_group(pending)
                # What a node logs says the reason once, then the coordinator's words (the wire's details
                # start with the reason too: CallError.said leaves it out).
                said = str(info.value)
                assert said.startswith("store_unavailable (UNAVAILABLE): the disk holding the database is full"), said
                refused.append((info.value.code, info.value.reason, "SQLITE_FULL" in info.value.details))

            # A bug below the door while the disk is full: the refusal cannot be stored either, and is still
            # answered `internal` (before: the failed store write escaped as gRPC's bare UNKNOWN).
            def broken(node, request, peer=""):
                raise RuntimeError("a bug")

            handler, coord.service._handlers["Heartbeat"] = coord.service._handlers["Heartbeat"], broken
            with pytest.raises(CallError) as info:
                await stub.heartbeat(pb.HeartbeatRequest())
            coord.service._handlers["Heartbeat"] = handler
            internal = (info.value.code, info.value.reason)

            await coord.db.run(lambda c: c.execute("PRAGMA max_page_count = 1000000"))  # the operator freed it
            coord.service.store_outage.quiet_s = 0.0
            answer = await stub.submit_group(pending)  # the refused group, once more
            counts = {k[0]: v for k, v in dict(coord.service.metrics.rejections.values).items() if v}
            return refused, internal, answer.accepted, counts

    refused, internal, accepted, counts = asyncio.run(scenario())
    assert refused == [(grpc.StatusCode.UNAVAILABLE, STORE_DOWN, True)] * 3
    assert internal == (grpc.StatusCode.INTERNAL, Reason.INTERNAL.value)
    assert accepted
    assert counts.get(STORE_DOWN) == 3 and counts.get(Reason.INTERNAL.value) == 1, counts
    db = st.Database(base / "state.db")
    try:
        summary = db.run_sync(st.status_summary)
    finally:
        db.close()
    assert summary["accepted_groups"] == 2 and summary["open_leases"] == 0
    lines = [r.getMessage() for r in caplog.records]
    outage = [m for m in lines if m.startswith("the store is unavailable")]
    assert len(outage) == 1 and "SQLITE_FULL" in outage[0], lines  # one line, not one per refusal
    assert any(m.startswith("the store serves requests again") for m in lines), lines


def test_the_outage_log_says_the_cause_once_then_a_line_per_period_and_the_end_after_a_quiet_spell(caplog):
    now = [100.0]
    outage = StoreOutageLog(every_s=10.0, quiet_s=2.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="veriroll.coordinator")
    for t in (100.0, 101.0, 105.0, 111.0, 112.0):
        now[0] = t
        outage.refused(st.StoreUnavailable("disk full"))
    now[0] = 113.0
    outage.served()  # a read went through 1 s after the last refusal: not over yet
    now[0] = 114.5
    outage.served()
    outage.served()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0].startswith("the store is unavailable: disk full (1 request(s) could not use it")
    assert "(3 request(s) could not use it" in lines[1]  # 101, 105 and 111 (the one that logged)
    assert lines[2] == "the store serves requests again, 12.0 s after the first refused (1 more refused since the last line)"
    assert outage.down_since is None


def test_a_read_only_postgres_server_is_unavailable_for_writes_and_still_serves_reads(pg_url):
    """An operator who points the coordinator at a standby (or a server left read-only after a failover):
    writes are refused as unavailable (retried), reads go on."""
    db = st.Database(pg_url)
    try:
        db.run_sync(lambda c: st.kv_set(c, "before", 1))
    finally:
        db.close()
    admin = pg.psycopg.connect(pg_url, autocommit=True)
    try:
        dbname = admin.info.dbname
        admin.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
    finally:
        admin.close()
    db = st.Database(pg_url)  # new sessions: read-only
    try:
        with pytest.raises(st.StoreUnavailable, match="read-only"):
            db.run_sync(lambda c: st.kv_set(c, "during", 1))
        with pytest.raises(st.StoreUnavailable, match="read-only"):
            db.run_sync(lambda c: st.kv_set(c, "during", 2))  # the failed transaction was ended: same answer
        assert db.read(lambda c: st.kv_get(c, "before")).result() == 1
    finally:
        db.close()
