"""The store's statements on PostgreSQL run on libpq directly (``PgConnection._execute``), not through
psycopg's cursor: what goes in and comes out must be what psycopg's cursor sends and returns, errors are
psycopg's own classes, prepared statements stay bounded and are re-made on a new session.
PostgreSQL runs as a throwaway cluster (tests/pg_cluster.py), skipped where it cannot."""

from __future__ import annotations

import contextlib
import math
import time
from decimal import Decimal

import numpy as np
import pytest

from veriroll.coordinator import store as st
from veriroll.coordinator.store import pg


@pytest.fixture
def conn(pg_url):
    c = pg.PgConnection(pg_url)
    c.execute("CREATE TABLE t (k TEXT PRIMARY KEY, i BIGINT, f DOUBLE PRECISION, b BYTEA, s TEXT)")
    yield c
    c.close()


def test_statement_numbers_placeholders_and_keeps_the_rest():
    assert pg.statement("SELECT a FROM t WHERE x = ? AND y IN (?, ?)") == \
        b"SELECT a FROM t WHERE x = $1 AND y IN ($2, $3)"
    assert pg.statement("BEGIN IMMEDIATE") == b"BEGIN"
    assert pg.statement("UPDATE c SET v = v + 1 WHERE name = ? /*SLOT*/") == \
        b"UPDATE c SET v = v + 1 WHERE name = $1 AND slot = veriroll_counter_slot()"


def test_values_go_in_and_come_back_as_psycopgs_cursor_gives_them(conn):
    blob = bytes(range(256)) * 3  # every byte value, binary on the wire
    rows = [("a", 2**62, 0.1, blob, st.LeaseState.OPEN), ("b", -7, math.inf, b"", "\u00e9\u4e2d\U0001f600"),
            ("c", None, -math.inf, None, None), ("d", np.int64(5), np.float64(2.5), bytearray(b"\x00\x01"), "")]
    for row in rows:
        assert conn.execute("INSERT INTO t(k, i, f, b, s) VALUES(?, ?, ?, ?, ?)", row).rowcount == 1
    conn.execute("INSERT INTO t(k, f) VALUES(?, ?)", ("n", math.nan))
    got = {r["k"]: tuple(r) for r in conn.execute("SELECT k, i, f, b, s FROM t ORDER BY k")}
    assert got["a"] == ("a", 2**62, 0.1, blob, "open")
    assert got["b"] == ("b", -7, math.inf, b"", "\u00e9\u4e2d\U0001f600")
    assert got["c"] == ("c", None, -math.inf, None, None)
    assert got["d"] == ("d", 5, 2.5, b"\x00\x01", "")
    assert math.isnan(got["n"][2])
    # The same statement through psycopg's own cursor reads the same values.
    with conn._conn.cursor() as cur:
        cur.execute("SELECT k, i, f, b, s FROM t WHERE k <> 'n' ORDER BY k")
        assert [tuple(r) for r in cur.fetchall()] == [v for k, v in sorted(got.items()) if k != "n"]
    # Aggregates keep PostgreSQL's types (SUM of BIGINT is NUMERIC), as they did through the cursor.
    total = conn.execute("SELECT COALESCE(SUM(i), 0) FROM t WHERE k IN (?, ?)", ("a", "b")).fetchone()[0]
    assert total == Decimal(2**62 - 7)
    # A bool parameter is a boolean; rows answer by name and by position.
    row = conn.execute("SELECT ? AS yes, ? AS no", (True, False)).fetchone()
    assert (row["yes"], row[1]) == (True, False)
    assert conn.execute("SELECT k FROM t WHERE k = ?", ("zz",)).fetchone() is None


def test_rowcount_description_and_fetching(conn):
    conn.execute("INSERT INTO t(k, i) VALUES(?, ?), (?, ?), (?, ?)", ("x", 1, "y", 2, "z", 3))
    assert conn.execute("UPDATE t SET i = i + 1 WHERE i >= ?", (2,)).rowcount == 2
    res = conn.execute("SELECT k, i FROM t ORDER BY k")
    assert [d[0] for d in res.description] == ["k", "i"]
    assert res.rowcount == 3
    assert res.fetchone()["k"] == "x"
    assert [r["k"] for r in res.fetchall()] == ["y", "z"]
    assert res.fetchall() == [] and res.fetchone() is None
    assert conn.execute("DELETE FROM t WHERE k = ?", ("nope",)).rowcount == 0
    assert conn.execute("SELECT k FROM t LIMIT 0").description[0][0] == "k"


def test_errors_are_psycopgs_classes_with_their_sqlstate(conn):
    conn.execute("INSERT INTO t(k) VALUES(?)", ("a",))
    with pytest.raises(pg.psycopg.errors.UniqueViolation) as info:
        conn.execute("INSERT INTO t(k) VALUES(?)", ("a",))
    assert info.value.sqlstate == "23505"
    with pytest.raises(pg.psycopg.errors.UndefinedTable):
        conn.execute("SELECT * FROM missing WHERE k = ?", ("a",))
    # A failed statement inside a transaction fails the rest of it until ROLLBACK, as PostgreSQL says.
    conn.execute("BEGIN")
    with pytest.raises(pg.psycopg.errors.UniqueViolation):
        conn.execute("INSERT INTO t(k) VALUES(?)", ("a",))
    with pytest.raises(pg.psycopg.errors.InFailedSqlTransaction):
        conn.execute("SELECT k FROM t WHERE k = ?", ("a",))
    conn.execute("ROLLBACK")
    assert conn.execute("SELECT COUNT(*) FROM t WHERE k = ?", ("a",)).fetchone()[0] == 1


def test_prepared_statements_are_bounded_and_remade_on_a_new_session(conn, monkeypatch):
    monkeypatch.setattr(pg, "PREPARED_MAX", 4)
    for n in range(1, 9):  # eight distinct statements (IN lists of different lengths)
        keys = [f"k{i}" for i in range(n)]
        assert conn.execute(f"SELECT COUNT(*) FROM t WHERE k IN ({', '.join('?' * n)})", keys).fetchone()[0] == 0
    server_side = conn.execute("SELECT COUNT(*) FROM pg_prepared_statements WHERE name LIKE ?",
                               ("veriroll_%",)).fetchone()[0]
    assert len(conn._prepared) == 4 and server_side == 4  # the rest ran unprepared
    # The same statement with a parameter of another type is another prepared statement, not a type error.
    conn.execute("INSERT INTO t(k, i) VALUES(?, ?)", ("p", 1))
    conn.execute("UPDATE t SET i = ? WHERE k = ?", (None, "p"))
    # A server restart closes the session and its prepared statements: the reopened connection prepares
    # them again instead of executing names the new session never saw.
    other = pg.PgConnection(conn._url)
    pid = conn.execute("SELECT pg_backend_pid() WHERE 1 = ?", (1,)).fetchone()[0]
    other.execute("SELECT pg_terminate_backend(CAST(? AS INTEGER))", (pid,))  # ints go as BIGINT
    other.close()
    with pytest.raises(pg.StoreUnavailable):
        conn.execute("SELECT pg_backend_pid() WHERE 1 = ?", (1,))
    for _ in range(50):  # reconnects are tried at most every RECONNECT_EVERY_S
        try:
            row = conn.execute("SELECT pg_backend_pid() WHERE 1 = ?", (1,)).fetchone()
            break
        except pg.StoreUnavailable:
            time.sleep(pg.RECONNECT_EVERY_S / 5)
    assert row[0] != pid
    assert conn.execute("SELECT COUNT(*) FROM t WHERE k = ?", ("p",)).fetchone()[0] == 1


def test_statements_together_answer_in_order_in_one_round_trip_and_fail_like_one_by_one(conn):
    conn.execute("INSERT INTO t(k, i) VALUES(?, ?), (?, ?)", ("a", 1, "b", 2))
    before = conn.statements
    inserted, updated, read = conn.execute_together([
        ("INSERT INTO t(k, i) VALUES(?, ?) RETURNING i * 10", ("c", 3)),
        ("UPDATE t SET i = i + ? WHERE k IN (?, ?)", (100, "a", "b")),
        ("SELECT k, i FROM t ORDER BY k", ()),
    ])
    assert conn.statements - before == 3
    assert inserted.fetchone()[0] == 30 and updated.rowcount == 2
    assert [tuple(r) for r in read] == [("a", 101), ("b", 102), ("c", 3)]  # each sees the ones before it
    # Inside a transaction, a failing statement raises its own error, the ones after it never run, and the
    # transaction is failed until ROLLBACK, as with one statement at a time.
    conn.execute("BEGIN")
    with pytest.raises(pg.psycopg.errors.UniqueViolation):
        conn.execute_together([("UPDATE t SET i = 0 WHERE k = ?", ("a",)), ("INSERT INTO t(k) VALUES(?)", ("a",)),
                               ("UPDATE t SET i = 0 WHERE k = ?", ("b",))])
    with pytest.raises(pg.psycopg.errors.InFailedSqlTransaction):
        conn.execute("SELECT 1 WHERE 1 = ?", (1,))
    conn.execute("ROLLBACK")
    assert [tuple(r) for r in conn.execute("SELECT k, i FROM t WHERE k <> ? ORDER BY k", ("c",))] == \
        [("a", 101), ("b", 102)]
    # The connection is usable at once (out of pipeline mode), and a lost session is StoreUnavailable.
    other = pg.PgConnection(conn._url)
    pid = conn.execute("SELECT pg_backend_pid() WHERE 1 = ?", (1,)).fetchone()[0]
    other.execute("SELECT pg_terminate_backend(CAST(? AS INTEGER))", (pid,))
    other.close()
    with pytest.raises(pg.StoreUnavailable):
        conn.execute_together([("UPDATE t SET i = 1 WHERE k = ?", ("a",)), ("UPDATE t SET i = 1 WHERE k = ?", ("b",))])


def test_begin_goes_with_the_transactions_first_statement_and_an_empty_transaction_costs_nothing(conn):
    """BEGIN waits for the transaction's first statement and goes with it in one round trip; the transaction
    is the same (its writes are seen only after COMMIT, undone by ROLLBACK; a failing first statement fails
    it until ROLLBACK: test_errors_are_psycopgs_classes_with_their_sqlstate); a transaction that ran no
    statement sends nothing at all."""
    other = pg.PgConnection(conn._url)
    try:
        trips = conn.round_trips
        conn.execute("BEGIN IMMEDIATE")
        assert conn.in_transaction and conn.round_trips == trips
        assert conn.execute("INSERT INTO t(k, i) VALUES(?, ?) RETURNING i", ("a", 1)).fetchone()[0] == 1
        assert conn.round_trips == trips + 1  # BEGIN and the INSERT together
        assert other.execute("SELECT COUNT(*) FROM t WHERE k = ?", ("a",)).fetchone()[0] == 0  # not committed
        conn.execute("COMMIT")
        assert conn.round_trips == trips + 2 and not conn.in_transaction
        assert other.execute("SELECT COUNT(*) FROM t WHERE k = ?", ("a",)).fetchone()[0] == 1
        # Undone by ROLLBACK, statements together after a deferred BEGIN too.
        conn.execute("BEGIN")
        conn.execute_together([("UPDATE t SET i = ? WHERE k = ?", (5, "a")), ("INSERT INTO t(k) VALUES(?)", ("b",))])
        conn.execute("ROLLBACK")
        assert [tuple(r) for r in other.execute("SELECT k, i FROM t ORDER BY k")] == [("a", 1)]
        # Nothing in it: neither the BEGIN nor the COMMIT (or ROLLBACK) reaches the server.
        trips = conn.round_trips
        for end in ("COMMIT", "ROLLBACK"):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(end)
        assert conn.round_trips == trips and not conn.in_transaction
        # A snapshot read inside a transaction joins it; one of its own begins with its first statement.
        with conn.snapshot():
            assert conn.execute("SELECT COUNT(*) FROM t WHERE i = ?", (1,)).fetchone()[0] == 1
            assert conn.execute("SELECT current_setting('transaction_isolation')").fetchone()[0] == "repeatable read"
        assert conn.round_trips == trips + 3
        # The session dies while a BEGIN waits: the first statement finds it gone (StoreUnavailable, as a
        # BEGIN sent alone would have); after the ROLLBACK the next transaction opens a new session.
        conn.execute("BEGIN")
        pid = other.execute("SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND datname = "
                            "current_database() AND backend_type = ?", ("client backend",)).fetchall()
        for (p,) in pid:
            other.execute("SELECT pg_terminate_backend(CAST(? AS INTEGER))", (p,))
        for _ in range(50):
            try:
                conn.execute("INSERT INTO t(k, i) VALUES(?, ?)", ("c", 3))
                break
            except pg.StoreUnavailable:
                with contextlib.suppress(pg.StoreUnavailable):  # the session is gone: so is its transaction
                    conn.execute("ROLLBACK")  # as the store's writer does; the next BEGIN waits again
                conn.execute("BEGIN")
                time.sleep(pg.RECONNECT_EVERY_S / 5)
        conn.execute("COMMIT")
        assert other.execute("SELECT i FROM t WHERE k = ?", ("c",)).fetchone()[0] == 3
    finally:
        other.close()
