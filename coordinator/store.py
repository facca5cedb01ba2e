"""The coordinator's durable state in SQLite (WAL): nodes, prompts, leases, accepted groups, the
ledger, rejections and trainer progress.

All access goes through one writer thread (:class:`Database`). Operations queued while a transaction
is running are committed together with it (group commit), so a busy intake pays one fsync for many
accepted groups, and every caller is answered only after its transaction is on disk: a node is told
"accepted" only once the group is durable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import queue
import sqlite3
import threading
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from itertools import dropwhile, islice
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from veriroll.coordinator import store_pg

T = TypeVar("T")
A = TypeVar("A")
DB_ERRORS: tuple[type[BaseException], ...] = (sqlite3.Error, *store_pg.errors())
StoreUnavailable = store_pg.StoreUnavailable

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    public_key BLOB NOT NULL,
    registered_ms INTEGER NOT NULL,
    last_seen_ms INTEGER NOT NULL,
    hardware TEXT NOT NULL DEFAULT '{}',
    software_version TEXT NOT NULL DEFAULT '',
    display_name TEXT NOT NULL DEFAULT '',
    standing TEXT NOT NULL DEFAULT 'probation',
    strikes INTEGER NOT NULL DEFAULT 0,
    clean_groups INTEGER NOT NULL DEFAULT 0,
    accepted_groups INTEGER NOT NULL DEFAULT 0,
    accepted_tokens INTEGER NOT NULL DEFAULT 0,
    loaded_version INTEGER NOT NULL DEFAULT -1,
    ban_reason TEXT NOT NULL DEFAULT '',
    session_id TEXT NOT NULL DEFAULT '',
    session_address TEXT NOT NULL DEFAULT '',
    session_seen_ms INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS prompts (
    prompt_id INTEGER PRIMARY KEY AUTOINCREMENT,
    env TEXT NOT NULL,
    text TEXT NOT NULL,
    answer TEXT NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}',
    prompt_ids BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS prompts_state ON prompts(state, prompt_id);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    prompt_id INTEGER NOT NULL,
    group_size INTEGER NOT NULL,
    temperature REAL NOT NULL,
    max_new_tokens INTEGER NOT NULL,
    seeds TEXT NOT NULL,
    stop_token_ids TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    issued_ms INTEGER NOT NULL,
    deadline_ms INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'open',
    probation INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS leases_open ON leases(state, deadline_ms);
CREATE INDEX IF NOT EXISTS leases_node ON leases(node_id, state);
CREATE TABLE IF NOT EXISTS groups (
    group_id INTEGER PRIMARY KEY AUTOINCREMENT,
    lease_id TEXT NOT NULL UNIQUE,
    node_id TEXT NOT NULL,
    prompt_id INTEGER NOT NULL,
    env TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    temperature REAL NOT NULL,
    arrival_ms INTEGER NOT NULL,
    content_hash TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    mean_reward REAL NOT NULL,
    verified INTEGER NOT NULL,
    consumed_step INTEGER,
    dropped TEXT
);
CREATE INDEX IF NOT EXISTS groups_unconsumed ON groups(consumed_step, group_id);
CREATE TABLE IF NOT EXISTS samples (
    group_id INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    trusted_logprobs BLOB,
    reward REAL NOT NULL,
    finish_reason TEXT NOT NULL,
    PRIMARY KEY (group_id, idx)
);
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id TEXT NOT NULL,
    lease_id TEXT NOT NULL DEFAULT '',
    reason TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    time_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS rejections_node ON rejections(node_id);
CREATE TABLE IF NOT EXISTS rejection_counts (
    node_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (node_id, reason)
);
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
-- Request nonces, when several edge processes share the store (see Door): each is used once while its
-- timestamp is inside the window.
CREATE TABLE IF NOT EXISTS nonces (
    public_key BLOB NOT NULL,
    nonce TEXT NOT NULL,
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (public_key, nonce)
);
CREATE INDEX IF NOT EXISTS nonces_expiry ON nonces(expires_ms);
-- Shared limits (see the section of that name below): token buckets every edge process takes from, and
-- the edge processes alive now.
CREATE TABLE IF NOT EXISTS limit_buckets (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    tat_ms REAL NOT NULL,
    PRIMARY KEY (kind, key)
);
CREATE INDEX IF NOT EXISTS limit_buckets_full ON limit_buckets(tat_ms);
CREATE TABLE IF NOT EXISTS edges (
    edge_id TEXT PRIMARY KEY,
    seen_ms INTEGER NOT NULL
);
-- The number of queued groups (accepted, neither consumed nor dropped), kept by triggers in the same
-- transaction as the change, so every lease request reads the queue depth in O(1) instead of
-- counting a table that grows with the run.
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
CREATE TRIGGER IF NOT EXISTS groups_queued_insert AFTER INSERT ON groups
WHEN NEW.consumed_step IS NULL AND NEW.dropped IS NULL
BEGIN
    UPDATE counters SET value = value + 1 WHERE name = 'queued_groups';
END;
CREATE TRIGGER IF NOT EXISTS groups_queued_update AFTER UPDATE OF consumed_step, dropped ON groups
BEGIN
    UPDATE counters SET value = value + (NEW.consumed_step IS NULL AND NEW.dropped IS NULL)
                                      - (OLD.consumed_step IS NULL AND OLD.dropped IS NULL)
    WHERE name = 'queued_groups';
END;
CREATE TRIGGER IF NOT EXISTS groups_queued_delete AFTER DELETE ON groups
WHEN OLD.consumed_step IS NULL AND OLD.dropped IS NULL
BEGIN
    UPDATE counters SET value = value - 1 WHERE name = 'queued_groups';
END;
"""

# Open leases, in all and those issued to probation nodes, kept like queued_groups: a lease request reads
# them in O(1) to apply the probation share. Run after the probation column exists (see connect).
_LEASE_COUNTERS = """
CREATE TRIGGER IF NOT EXISTS leases_open_insert AFTER INSERT ON leases WHEN NEW.state = 'open'
BEGIN
    UPDATE counters SET value = value + 1 WHERE name = 'open_leases';
    UPDATE counters SET value = value + NEW.probation WHERE name = 'open_probation_leases';
END;
CREATE TRIGGER IF NOT EXISTS leases_open_update AFTER UPDATE OF state ON leases
BEGIN
    UPDATE counters SET value = value + (NEW.state = 'open') - (OLD.state = 'open') WHERE name = 'open_leases';
    UPDATE counters SET value = value + NEW.probation * (NEW.state = 'open') - OLD.probation * (OLD.state = 'open')
    WHERE name = 'open_probation_leases';
END;
CREATE TRIGGER IF NOT EXISTS leases_open_delete AFTER DELETE ON leases WHEN OLD.state = 'open'
BEGIN
    UPDATE counters SET value = value - 1 WHERE name = 'open_leases';
    UPDATE counters SET value = value - OLD.probation WHERE name = 'open_probation_leases';
END;
"""
_INIT_LEASE_COUNTERS = """
INSERT INTO counters(name, value)
SELECT 'open_leases', (SELECT COUNT(*) FROM leases WHERE state = 'open')
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'open_leases');
INSERT INTO counters(name, value)
SELECT 'open_probation_leases', (SELECT COUNT(*) FROM leases WHERE state = 'open' AND probation = 1)
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'open_probation_leases');
"""

# Run after SCHEMA: a database from before the counter (or a fresh one) starts it from a full count,
# in one statement, so a group inserted concurrently is counted exactly once.
_INIT_COUNTERS = """
INSERT INTO counters(name, value)
SELECT 'queued_groups', (SELECT COUNT(*) FROM groups WHERE consumed_step IS NULL AND dropped IS NULL)
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'queued_groups')
"""

# The number of prompts drawn from the stream (it resumes from the seed and this number), kept like the
# others; a kv row before, which every lease of a fresh prompt updated: on PostgreSQL, one row every edge
# process's writer queued on. Its value moves over once.
_INIT_DRAW_COUNTER = """
INSERT INTO counters(name, value)
SELECT 'prompts_drawn', COALESCE((SELECT CAST(value AS INTEGER) FROM kv WHERE key = 'prompts_drawn'), 0)
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'prompts_drawn');
DELETE FROM kv WHERE key = 'prompts_drawn';
"""


# The node process that holds each key (see ``other_live_session``): columns added to older databases.
_SESSION_COLUMNS = {"session_id": "TEXT NOT NULL DEFAULT ''", "session_address": "TEXT NOT NULL DEFAULT ''",
                    "session_seen_ms": "INTEGER NOT NULL DEFAULT 0"}


class Standing(StrEnum):
    """A node's standing: new keys start on probation, clean verified groups make them trusted, strikes or
    an operator ban them."""

    PROBATION = "probation"
    TRUSTED = "trusted"
    BANNED = "banned"


class LeaseState(StrEnum):
    """open → submitted (group accepted) | rejected (content failed; prompt back to the pool) | expired."""

    OPEN = "open"
    SUBMITTED = "submitted"
    REJECTED = "rejected"
    EXPIRED = "expired"


class PromptState(StrEnum):
    """pending (in the pool) → leased → done (a group was accepted for it), or back to pending."""

    PENDING = "pending"
    LEASED = "leased"
    DONE = "done"


STANDINGS = tuple(s.value for s in Standing)


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_i32(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<i4")


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_f32(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.frombuffer(blob, dtype="<f4")


def database_target(base_dir: Path, value: str) -> str | Path:
    """Where ``database`` in a coordinator's config points: a ``postgresql://`` URL as it is, a SQLite file
    relative to the coordinator's directory."""
    if store_pg.is_url(value):
        return value
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path


def connect(path: str | Path) -> sqlite3.Connection:
    """Open the database: a SQLite file with the settings veriroll relies on (WAL, full fsync), or a
    ``postgresql://`` URL (``store_pg.py``)."""
    if store_pg.is_url(path):
        return store_pg.connect(path)
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    # FULL: a transaction is on disk when COMMIT returns, so "accepted" survives power loss too.
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA busy_timeout=30000")
    # The writer runs each op in a SAVEPOINT, whose undo journal SQLite otherwise keeps in a temporary
    # file created and unlinked per transaction (~6 file syscalls and a write per page). It only undoes
    # a failed op inside a transaction: crash recovery is the WAL's, so memory loses nothing.
    conn.execute("PRAGMA temp_store=MEMORY")
    conn.executescript(SCHEMA)
    conn.executescript(VERIFY_JOBS_SCHEMA)
    conn.executescript(SWARM_SCHEMA)
    conn.executescript(STANDING_CHANGES_SCHEMA)
    if conn.execute("SELECT 1 FROM counters WHERE name = 'queued_groups'").fetchone() is None:
        conn.execute(_INIT_COUNTERS)
    if "probation" not in {r["name"] for r in conn.execute("PRAGMA table_info(leases)")}:
        # A database from before probation caps: its open leases count as trusted ones.
        conn.execute("ALTER TABLE leases ADD COLUMN probation INTEGER NOT NULL DEFAULT 0")
    node_columns = {r["name"] for r in conn.execute("PRAGMA table_info(nodes)")}
    for column, declaration in _SESSION_COLUMNS.items():
        if column not in node_columns:  # a database from before sessions: no key has a live one
            conn.execute(f"ALTER TABLE nodes ADD COLUMN {column} {declaration}")
    conn.executescript(_LEASE_COUNTERS)
    if conn.execute("SELECT COUNT(*) FROM counters WHERE name IN ('open_leases', 'open_probation_leases')").fetchone()[0] < 2:
        conn.executescript("BEGIN IMMEDIATE;" + _INIT_LEASE_COUNTERS + "COMMIT;")
    if conn.execute("SELECT 1 FROM counters WHERE name = 'prompts_drawn'").fetchone() is None:
        conn.executescript("BEGIN IMMEDIATE;" + _INIT_DRAW_COUNTER + "COMMIT;")
    return conn


@dataclass
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    future: concurrent.futures.Future | asyncio.Future
    # Set for callers on an event loop: their asyncio future is settled on that loop, all of a batch's
    # futures in one wake-up (cheaper than a concurrent future chained to an asyncio one per op).
    loop: asyncio.AbstractEventLoop | None = None
    # (many, arg) for an op of Database.run_together: the batch's ops of one ``many`` run as one call of it.
    together: tuple[Callable[[sqlite3.Connection, list], list], Any] | None = None

    def start(self) -> bool:
        """False when the caller already gave up (cancelled): the op is then skipped."""
        if self.loop is None:
            return self.future.set_running_or_notify_cancel()
        return not self.future.cancelled()


def _settle(items: list[tuple[asyncio.Future, bool, Any]]) -> None:
    for fut, ok, value in items:
        if fut.done():  # cancelled meanwhile: its caller is gone
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)


def _answer(results: list[tuple[_Op, bool, Any]]) -> None:
    """Hand each op its result: concurrent futures directly, asyncio futures on their loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for op, ok, value in results:
        if op.loop is None:
            if op.future.done():
                continue
            if ok:
                op.future.set_result(value)
            else:
                op.future.set_exception(value)
        else:
            by_loop.setdefault(op.loop, []).append((op.future, ok, value))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_settle, items)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


TRANSIENT_RETRIES = 3
"""How often the writer runs a batch again after PostgreSQL broke a deadlock by rolling it back."""

SQLITE_UNAVAILABLE = {
    5: "another process holds the database's lock (SQLITE_BUSY)",
    6: "the database is locked (SQLITE_LOCKED)",
    7: "SQLite is out of memory (SQLITE_NOMEM)",
    8: "the database cannot be written: a read-only file, directory or filesystem (SQLITE_READONLY)",
    10: "the disk holding the database failed to read or write (SQLITE_IOERR)",
    13: "the disk holding the database is full (SQLITE_FULL)",
    14: "the database file cannot be opened (SQLITE_CANTOPEN)",
}
"""SQLite's primary result codes that are the machine's state, not the operation's: a full disk, an I/O error,
a read-only filesystem, another process holding the lock past ``busy_timeout``. The store raises them as
:class:`StoreUnavailable` ("unavailable, retry", counted as ``store_unavailable``), never as an internal
error: the same operation goes through once the operator has freed the disk. Nothing of the failed
transaction is committed (SQLite rolls it back, or the writer does)."""


def unavailable(exc: BaseException) -> StoreUnavailable | None:
    """``exc`` as the :class:`StoreUnavailable` it amounts to (the store cannot take any operation now, through
    no fault of the operation: the server gone or silent, a full disk, an I/O error, a read-only file), or
    None for an error of the operation itself."""
    if isinstance(exc, StoreUnavailable):
        return exc
    if isinstance(exc, sqlite3.Error):
        why = SQLITE_UNAVAILABLE.get((getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF)
        if why is not None:
            out = StoreUnavailable(f"{why}: {exc}; nothing of this operation was committed")
            out.__cause__ = exc
            return out
    return None


def _not_the_ops_fault(exc: BaseException) -> bool:
    """An error on which a batch fails (or runs again) whole rather than an op alone: a deadlock PostgreSQL
    broke (run again, see ``_commit``), the store unavailable, or an interrupt."""
    return store_pg.is_transient(exc) or unavailable(exc) is not None or not isinstance(exc, Exception)


class Database:
    """Serializes every operation on one connection in one thread, committing queued work together.

    An op that raises is undone alone and its caller gets the exception, while the rest of its batch
    commits (see :meth:`_transaction`). One writer: SQLite has a single write lock, and on PostgreSQL
    more writer connections per process measured slower (GIL hand-offs between the threads cost more
    than the round trips they overlap: 283 groups/s with one, 253 with two, 213 with eight).
    """

    MAX_BATCH = 512

    def __init__(self, path: str | Path):
        self.path = path if store_pg.is_url(path) else Path(path)
        self.conn = connect(self.path)
        self._q: queue.Queue[_Op | tuple[_Op, ...] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="veriroll-db", daemon=True)
        self._closed = False
        self._closing = threading.Lock()
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="veriroll-db-read")
        self._local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        # What the writer spent on transactions so far, written by its thread alone (read by /metrics): wall
        # and CPU seconds from a batch's first statement until its COMMIT returned, batches and ops.
        self.writer_busy_s = self.writer_cpu_s = 0.0
        self.writer_batches = self.writer_ops = 0
        self._thread.start()

    def _loop(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            batch = list(first) if isinstance(first, tuple) else [first]
            while len(batch) < self.MAX_BATCH:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                if isinstance(nxt, tuple):  # ops queued together (run_chain): never split across batches
                    batch.extend(nxt)
                else:
                    batch.append(nxt)
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Op]) -> None:
        # A caller that gave up (its call was cancelled, e.g. past its deadline) cancels its future while
        # the op waits in the queue: skip those ops. Once marked running, an op can no longer be
        # cancelled, so every op that runs is answered exactly once (a retry is then idempotent).
        batch = [op for op in batch if op.start()]
        if not batch:
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        results = self._commit(batch)
        self.writer_busy_s += time.perf_counter() - wall
        self.writer_cpu_s += time.thread_time() - cpu
        self.writer_batches += 1
        self.writer_ops += len(batch)
        # Answer only after COMMIT returned: nothing is reported done before it is durable.
        _answer(results)

    @property
    def round_trips(self) -> int | None:
        """Waits on PostgreSQL the writer's connection made so far (None on SQLite, which has no server)."""
        return self.conn.round_trips if isinstance(self.conn, store_pg.PgConnection) else None

    def _commit(self, batch: list[_Op]) -> list[tuple[_Op, bool, Any]]:
        """Run ``batch`` to its COMMIT (or its failure); what to answer each op."""
        attempt = 0
        while True:
            try:
                return self._transaction(batch)
            except BaseException as exc:  # noqa: BLE001 - the whole batch failed to commit: tell everyone
                try:
                    self.conn.execute("ROLLBACK")
                except DB_ERRORS:
                    pass
                if not (store_pg.is_transient(exc) and attempt < TRANSIENT_RETRIES):
                    exc = unavailable(exc) or exc
                    return [(op, False, exc) for op in batch]
                # A deadlock with another process's writer (PostgreSQL): rolled back whole, nothing of it
                # committed; this batch's locks are gone, the other transaction goes on, and ours runs again.
                attempt += 1

    def _transaction(self, batch: list[_Op]) -> list[tuple[_Op, bool, Any]]:
        """Every op of ``batch`` in one transaction, committed once; an op that fails is undone alone and
        answered with its error.

        Ops almost never fail, so the batch first runs without savepoints (two statements per op fewer: on
        PostgreSQL two round trips each). When one raises, that attempt is rolled back whole and the batch
        runs again with a savepoint per op; nothing of the first attempt was committed, and ops are plain
        functions of the connection (the writer already runs a batch again after a deadlock). The ops of
        :meth:`run_together` run as one call per kind at the first of them, and one by one with savepoints.
        """
        self.conn.execute("BEGIN IMMEDIATE")
        results: list[tuple[_Op, bool, Any]] = []
        together: dict[Callable, list[_Op]] = {}
        for op in batch:
            if op.together is not None:
                together.setdefault(op.together[0], []).append(op)
        try:
            for op in batch:
                if op.together is None:
                    results.append((op, True, op.fn(self.conn)))
                elif (ops := together.pop(op.together[0], None)) is not None:  # at the first of its kind
                    values = op.together[0](self.conn, [o.together[1] for o in ops])
                    results.extend((o, True, v) for o, v in zip(ops, values, strict=True))
        except BaseException as exc:  # re-raised, retried with savepoints, or handed to the caller
            if _not_the_ops_fault(exc):
                # A deadlock victim runs again whole (_commit); an interrupt, or the store unavailable (the server
                # gone or silent, a full disk), is not the op's fault: every op of the batch gets it (a ROLLBACK
                # here would only hide it behind its own).
                raise
            self.conn.execute("ROLLBACK")
            if len(batch) == 1:  # the op was the whole transaction: nothing to keep
                return [(batch[0], False, exc)]
            return self._transaction_with_savepoints(batch)
        self.conn.execute("COMMIT")
        return results

    def _transaction_with_savepoints(self, batch: list[_Op]) -> list[tuple[_Op, bool, Any]]:
        """Every op of ``batch`` in one transaction, each in a savepoint of its own, committed once."""
        results: list[tuple[_Op, bool, Any]] = []
        self.conn.execute("BEGIN IMMEDIATE")
        for op in batch:
            self.conn.execute("SAVEPOINT op")
            try:
                value = op.fn(self.conn)
            except BaseException as exc:  # re-raised, or handed to the caller: never swallowed
                if _not_the_ops_fault(exc):
                    raise  # the whole batch runs again (_commit), or fails whole
                self.conn.execute("ROLLBACK TO op")
                self.conn.execute("RELEASE op")
                results.append((op, False, exc))
            else:
                self.conn.execute("RELEASE op")
                results.append((op, True, value))
        self.conn.execute("COMMIT")
        return results

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> concurrent.futures.Future:
        """Run a read-only ``fn`` on the reader connection: no write lock, no fsync, sees committed data (on
        PostgreSQL, all of ``fn``'s statements one snapshot of it, begun first: the trainer's reads, which
        take several)."""
        if self._closed:
            raise RuntimeError("database is closed")
        return self._reader.submit(self._read_one, fn, False)

    def _read_one(self, fn, probe: bool = True):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = connect(self.path)
            self._reader_conns.append(conn)
        if isinstance(conn, store_pg.PgConnection):
            return conn.read(fn, probe=probe)
        try:
            return fn(conn)
        except sqlite3.Error as exc:
            gone = unavailable(exc)
            if gone is None:
                raise
            raise gone from exc

    async def run_read(self, fn: Callable[[sqlite3.Connection], T], *, inline: bool = False) -> T:
        """``read`` for a coroutine: the result is set on the caller's loop directly. ``inline``: a short read
        (a few rows by key) on a SQLite file runs on the caller's thread, where the hop to the reader thread
        and back would cost more than the read (WAL: a reader does not wait for the writer). On PostgreSQL
        a read of one statement runs alone, one of more in one snapshot (``PgConnection.read``)."""
        if self._closed:
            raise RuntimeError("database is closed")
        if inline and isinstance(self.path, Path):
            return self._read_one(fn)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._reader.submit(self._read_into, _Op(fn, fut, loop))
        return await fut

    def _read_into(self, op: _Op) -> None:
        if not op.start():
            return
        try:
            value = self._read_one(op.fn)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, not swallowed
            _answer([(op, False, exc)])
        else:
            _answer([(op, True, value)])

    def _enqueue(self, op: _Op | tuple[_Op, ...]) -> None:
        # Under the lock that close() takes: an op is either queued before the stop marker (and answered)
        # or refused, never queued behind it to wait forever.
        with self._closing:
            if self._closed:
                raise RuntimeError("database is closed")
            self._q.put(op)

    def submit(self, fn: Callable[[sqlite3.Connection], T]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(_Op(fn, fut))
        return fut

    def run_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return self.submit(fn).result()

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in the writer's next transaction; returns once that transaction is committed."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._enqueue(_Op(fn, fut, loop))
        return await fut

    async def run_together(self, many: Callable[[sqlite3.Connection, list[A]], list[T]], arg: A) -> T:
        """``many(conn, [arg])[0]`` in the writer's next transaction, as :meth:`run`; the calls of one ``many``
        that share a transaction run as one call, ``many(conn, [their args])`` (one statement and one round
        trip for all of them, where :meth:`run` would take one each). ``many`` returns a result per arg, in
        order, and must give each the result it would have had alone, first to last."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._enqueue(_Op(lambda conn: many(conn, [arg])[0], fut, loop, (many, arg)))
        return await fut

    async def run_chain(self, first: Callable[[sqlite3.Connection], T],
                        then: Callable[[sqlite3.Connection, T], Any]) -> tuple[T, Any, Exception | None]:
        """``first(conn)``, then ``then(conn, first's result)``, in one writer transaction: queued as one item, so
        they share a batch and its commit (the caller waits on the writer once instead of twice).

        Answered apart: ``first``'s error is raised as :meth:`run` raises it (``then`` is not run). An error of
        ``then`` is undone alone (the writer runs the batch again with a savepoint per op, as for any op that
        raises) and returned, not raised: (first's result, then's result or None, then's error or None).
        """
        loop = asyncio.get_running_loop()
        head, tail = loop.create_future(), loop.create_future()
        ran: list = []  # first's result in this attempt of the batch (the writer may run a batch again)

        def one(conn):
            ran.clear()
            value = first(conn)
            ran.append(value)
            return value

        def two(conn):
            return then(conn, ran[0]) if ran else None

        self._enqueue((_Op(one, head, loop), _Op(two, tail, loop)))
        try:
            value = await head
        except BaseException:
            tail.cancel()  # skipped if it has not started; answered and dropped if it has
            raise
        try:
            return value, await tail, None
        except Exception as exc:  # noqa: BLE001 - handed to the caller beside first's result
            return value, None, exc

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the writer once everything it was handed is committed (or failed), then the reader, and close
        the connections. False, with nothing closed, when either is still busy after ``timeout`` seconds (a
        statement PostgreSQL has not answered yet, see ``store_pg.ANSWER_TIMEOUT_S``): the caller leaves them
        behind, which is safe, since nothing they have not committed was acknowledged. Closing a connection
        under a thread still using it could crash the process."""
        with self._closing:
            if self._closed:
                return True
            self._closed = True
            self._q.put(None)
        deadline = time.monotonic() + timeout
        self._thread.join(timeout)
        idle = self._reader.submit(lambda: None)  # done once the reader has finished what it had
        with contextlib.suppress(concurrent.futures.TimeoutError):
            idle.result(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() or not idle.done():
            self._reader.shutdown(wait=False, cancel_futures=True)
            return False
        self._reader.shutdown(wait=True)
        for conn in [*self._reader_conns, self.conn]:
            conn.close()
        return True


# --- operations: plain functions of a connection, composed by the callers ----------------------


def kv_get(conn: sqlite3.Connection, key: str, default: Any = None) -> Any:
    row = conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
    return default if row is None else json.loads(row["value"])


def kv_set(conn: sqlite3.Connection, key: str, value: Any) -> None:
    conn.execute("INSERT INTO kv(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                 (key, json.dumps(value)))


def count_rejection(conn: sqlite3.Connection, node_id: str, reason: str, lease_id: str = "", detail: str = "",
                    now_ms: int = 0, log: bool = True) -> None:
    """Count a rejection per (node, reason); keep the event itself only for authenticated nodes."""
    conn.execute(
        "INSERT INTO rejection_counts(node_id, reason, count) VALUES(?, ?, 1) "
        "ON CONFLICT(node_id, reason) DO UPDATE SET count = rejection_counts.count + 1",
        (node_id, reason),
    )
    if log and node_id:
        conn.execute("INSERT INTO rejections(node_id, lease_id, reason, detail, time_ms) VALUES(?, ?, ?, ?, ?)",
                     (node_id, lease_id, reason, detail[:500], now_ms))


def queued_groups(conn: sqlite3.Connection) -> int:
    """Accepted groups waiting for the trainer (neither consumed nor dropped), in O(1): the counter's rows
    summed (one on SQLite, one per writer slot on PostgreSQL: ``store_pg.COUNTER_SLOTS``)."""
    return int(conn.execute("SELECT COALESCE(SUM(value), 0) FROM counters WHERE name = 'queued_groups'")
               .fetchone()[0])


def rejections_by_reason(conn: sqlite3.Connection, node_id: str | None = None) -> dict[str, int]:
    if node_id is None:
        rows = conn.execute("SELECT reason, SUM(count) AS n FROM rejection_counts GROUP BY reason").fetchall()
    else:
        rows = conn.execute("SELECT reason, count AS n FROM rejection_counts WHERE node_id = ?", (node_id,)).fetchall()
    return {r["reason"]: int(r["n"]) for r in rows}


def rejections_by_node(conn: sqlite3.Connection) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in conn.execute("SELECT node_id, reason, count FROM rejection_counts WHERE node_id != ''"):
        out.setdefault(r["node_id"], {})[r["reason"]] = int(r["count"])
    return out


def status_summary(conn: sqlite3.Connection) -> dict:
    """The numbers of ``veriroll coordinator status``."""
    one = lambda sql: conn.execute(sql).fetchone()[0]  # noqa: E731
    return {
        "policy_version": int(kv_get(conn, "policy_version", 0)),
        "nodes": int(one("SELECT COUNT(*) FROM nodes")),
        "open_leases": open_lease_totals(conn)[0],
        "accepted_groups": int(one("SELECT COUNT(*) FROM groups")),
        "unconsumed_groups": queued_groups(conn),
        "rejections_by_reason": rejections_by_reason(conn),
        "banned_nodes": int(one("SELECT COUNT(*) FROM nodes WHERE standing = 'banned'")),
        "trainer_step": int(kv_get(conn, "trainer_step", 0)),
    }


def list_nodes(conn: sqlite3.Connection, limit: int | None = None) -> list[dict]:
    """Every node in registration order; with ``limit``, only the ``limit`` most recently seen (newest first).

    Node-supplied fields go through :func:`bound_node_fields` again on the way out, so a row stored before
    the bounds existed cannot make a listing large either.
    """
    cols = ("SELECT node_id, standing, strikes, accepted_groups, accepted_tokens, clean_groups, "
            "last_seen_ms, loaded_version, display_name, hardware, ban_reason FROM nodes ")
    if limit is None:
        rows = conn.execute(cols + "ORDER BY registered_ms").fetchall()
    else:
        rows = conn.execute(cols + "ORDER BY last_seen_ms DESC, node_id LIMIT ?", (int(limit),)).fetchall()
    out = []
    for r in rows:
        d = dict(r)
        try:
            hardware = json.loads(d["hardware"] or "{}")
        except ValueError:
            hardware = {}
        d["hardware"], _, d["display_name"] = bound_node_fields(hardware, "", d["display_name"] or "")
        out.append(d)
    return out


def standing_counts(conn: sqlite3.Connection) -> dict[str, int]:
    """``{standing: number of nodes}`` over all nodes, every standing present."""
    counts = {s: 0 for s in STANDINGS}
    for r in conn.execute("SELECT standing, COUNT(*) AS n FROM nodes GROUP BY standing"):
        counts[r["standing"]] = int(r["n"])
    return counts


# --- named operations: every statement the coordinator runs on its state ------------------------------
#
# Each is a plain function of a connection, run by the caller inside one writer transaction
# (``Database.run``) or one read (``Database.run_read``); callers compose them, never write SQL.


@dataclass(frozen=True)
class NodeRow:
    """What the door needs to know about a registered node."""

    node_id: str
    public_key: bytes
    standing: Standing
    ban_reason: str = ""


def node_by_id(conn: sqlite3.Connection, node_id: str) -> NodeRow | None:
    """One node by its id (the primary key): the same cost at 10 or 10,000 registered nodes."""
    r = conn.execute("SELECT node_id, public_key, standing, ban_reason FROM nodes WHERE node_id = ?",
                     (node_id,)).fetchone()
    return None if r is None else NodeRow(r["node_id"], bytes(r["public_key"]), Standing(r["standing"]), r["ban_reason"])


@dataclass(frozen=True)
class Session:
    """One node process's claim on its key: a random id it made at start, and the address it calls from.
    An empty id claims nothing (a tool such as ``node doctor`` using the key while the node runs)."""

    session_id: str
    address: str


@dataclass(frozen=True)
class LiveSession:
    """The session that holds a key: where it calls from and when it last registered or heartbeated."""

    address: str
    seen_ms: int


def other_live_session(conn: sqlite3.Connection, node_id: str, session: Session, now_ms: int,
                       ttl_ms: int) -> LiveSession | None:
    """Another session of this key that registered or heartbeated within ``ttl_ms``, or None (no such
    session, or ``session`` claims nothing): then ``session`` may hold the key."""
    if not session.session_id:
        return None
    r = conn.execute("SELECT session_address, session_seen_ms FROM nodes WHERE node_id = ? AND session_id NOT IN ('', ?) "
                     "AND session_seen_ms >= ?", (node_id, session.session_id, now_ms - ttl_ms)).fetchone()
    return None if r is None else LiveSession(r["session_address"], int(r["session_seen_ms"]))


def _hold_session(conn: sqlite3.Connection, node_id: str, session: Session | None, now_ms: int) -> None:
    if session is not None and session.session_id:
        conn.execute("UPDATE nodes SET session_id = ?, session_address = ?, session_seen_ms = ? WHERE node_id = ?",
                     (session.session_id, session.address, now_ms, node_id))


def register_node(conn: sqlite3.Connection, node_id: str, public_key: bytes, now_ms: int, hardware: dict,
                  software_version: str, display_name: str, session: Session | None = None) -> NodeRow:
    """Insert a new node on probation, or refresh a known one's self-description (its standing is kept);
    ``session`` becomes the key's live one (check :func:`other_live_session` first)."""
    r = conn.execute(
        "INSERT INTO nodes(node_id, public_key, registered_ms, last_seen_ms, hardware, software_version, display_name) "
        "VALUES(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE SET last_seen_ms = excluded.last_seen_ms, "
        "hardware = excluded.hardware, software_version = excluded.software_version, display_name = excluded.display_name "
        "RETURNING standing, ban_reason",
        (node_id, public_key, now_ms, now_ms, json.dumps(hardware), software_version, display_name),
    ).fetchone()
    _hold_session(conn, node_id, session, now_ms)
    return NodeRow(node_id, public_key, Standing(r["standing"]), r["ban_reason"])


def end_session(conn: sqlite3.Connection, node_id: str, session_id: str) -> None:
    """``session_id`` stopped: if it held the key, the key is free for another process at once."""
    conn.execute("UPDATE nodes SET session_id = '' WHERE node_id = ? AND session_id = ? AND session_id != ''",
                 (node_id, session_id))


def touch_node(conn: sqlite3.Connection, node_id: str, now_ms: int, loaded_version: int,
               session: Session | None = None) -> None:
    """A heartbeat: when the node was last seen and which version it has loaded; ``session`` stays the
    key's live one (check :func:`other_live_session` first)."""
    if session is not None and session.session_id:  # one statement: a heartbeat is a write on every edge
        conn.execute("UPDATE nodes SET last_seen_ms = ?, loaded_version = ?, session_id = ?, session_address = ?, "
                     "session_seen_ms = ? WHERE node_id = ?",
                     (now_ms, loaded_version, session.session_id, session.address, now_ms, node_id))
    else:
        conn.execute("UPDATE nodes SET last_seen_ms = ?, loaded_version = ? WHERE node_id = ?",
                     (now_ms, loaded_version, node_id))


def node_ledger(conn: sqlite3.Connection, node_id: str) -> dict | None:
    """A node's row and its refusals by reason (GetLedger)."""
    row = conn.execute("SELECT * FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
    if row is None:
        return None
    return {**dict(row), "rejections_by_reason": rejections_by_reason(conn, node_id)}


def record_refusal(conn: sqlite3.Connection, node_id: str, reason: str, *, strike: bool, strike_limit: int,
                   lease_id: str = "", detail: str = "", now_ms: int = 0, log_event: bool = True) -> int | None:
    """Count a refusal (and keep the event, for a known node, unless ``log_event`` is False); for a hard
    failure, strike the node (a trusted node goes back on probation) and ban it at ``strike_limit`` strikes.
    Returns the node's strikes when this refusal banned it, else None."""
    count_rejection(conn, node_id, reason, lease_id, detail, now_ms, log=bool(node_id) and log_event)
    if not (node_id and strike):
        return None
    row = conn.execute("UPDATE nodes SET strikes = strikes + 1, clean_groups = 0, "
                       "standing = CASE WHEN standing = ? THEN ? ELSE standing END "
                       "WHERE node_id = ? RETURNING strikes, standing",
                       (Standing.TRUSTED, Standing.PROBATION, node_id)).fetchone()
    if row is None or row["strikes"] < strike_limit or row["standing"] == Standing.BANNED:
        return None
    set_standing(conn, node_id, Standing.BANNED, f"{row['strikes']} strikes, last: {reason}")
    return int(row["strikes"])


def expire_leases(conn: sqlite3.Connection, now_ms: int) -> int:
    """Open leases past their deadline become expired; their prompts go back to the pool."""
    # SKIP LOCKED (PostgreSQL): a lease another edge's transaction is expiring (or submitting) right now is
    # left to it, instead of this writer waiting on its row lock until that transaction commits.
    rows = conn.execute("UPDATE leases SET state = ? WHERE state = ? AND lease_id IN (SELECT lease_id FROM leases "
                        "WHERE state = ? AND deadline_ms < ? /*SKIP LOCKED*/) RETURNING prompt_id",
                        (LeaseState.EXPIRED, LeaseState.OPEN, LeaseState.OPEN, now_ms)).fetchall()
    for r in rows:
        _return_prompt(conn, r["prompt_id"])
    return len(rows)


def release_open_leases(conn: sqlite3.Connection, node_id: str) -> int:
    """A node that stops gives its open leases back: they expire now and their prompts return to the pool,
    instead of waiting out their deadlines (and holding the node's lease slots for its next start)."""
    rows = conn.execute("UPDATE leases SET state = ? WHERE node_id = ? AND state = ? RETURNING prompt_id",
                        (LeaseState.EXPIRED, node_id, LeaseState.OPEN)).fetchall()
    for r in rows:
        _return_prompt(conn, r["prompt_id"])
    return len(rows)


def _return_prompt(conn: sqlite3.Connection, prompt_id: int) -> None:
    conn.execute("UPDATE prompts SET state = ? WHERE prompt_id = ? AND state = ?",
                 (PromptState.PENDING, prompt_id, PromptState.LEASED))


def lease_limits(conn: sqlite3.Connection, node_id: str) -> tuple[int, int]:
    """(groups queued for the trainer, open leases of ``node_id``): what a lease request checks first, in one
    statement (``queued_groups`` and ``open_leases_of`` together)."""
    r = conn.execute("SELECT (SELECT COALESCE(SUM(value), 0) FROM counters WHERE name = 'queued_groups'), "
                     "(SELECT COUNT(*) FROM leases WHERE node_id = ? AND state = ?)", (node_id, LeaseState.OPEN)).fetchone()
    return int(r[0]), int(r[1])


def open_leases_of(conn: sqlite3.Connection, node_id: str) -> int:
    """Open leases held by one node (an index range of at most ``max_open_per_node`` rows)."""
    return int(conn.execute("SELECT COUNT(*) FROM leases WHERE node_id = ? AND state = ?",
                            (node_id, LeaseState.OPEN)).fetchone()[0])


def open_lease_totals(conn: sqlite3.Connection) -> tuple[int, int]:
    """(open leases, open leases issued to probation nodes), in O(1) from the trigger-kept counters."""
    rows = dict(conn.execute("SELECT name, SUM(value) FROM counters "
                             "WHERE name IN ('open_leases', 'open_probation_leases') GROUP BY name").fetchall())
    return int(rows.get("open_leases", 0)), int(rows.get("open_probation_leases", 0))


def take_pending_prompt(conn: sqlite3.Connection) -> tuple[int, list[int], str] | None:
    """The oldest prompt back in the pool (its lease expired or was spent), now leased: (id, token ids, env)."""
    # The outer state check and SKIP LOCKED (PostgreSQL; see store_pg.translate) keep two edge processes
    # from leasing one prompt twice: the loser finds no row and draws a new prompt instead.
    row = conn.execute("UPDATE prompts SET state = ?, attempts = attempts + 1 WHERE state = ? AND prompt_id = "
                       "(SELECT prompt_id FROM prompts WHERE state = ? ORDER BY prompt_id LIMIT 1 /*SKIP LOCKED*/) "
                       "RETURNING prompt_id, prompt_ids, env",
                       (PromptState.LEASED, PromptState.PENDING, PromptState.PENDING)).fetchone()
    return None if row is None else (int(row[0]), unpack_i32(row[1]).tolist(), row[2])


def insert_leased_prompt(conn: sqlite3.Connection, env: str, text: str, answer: str, meta: dict,
                         prompt_ids: list[int]) -> int:
    """Store a freshly drawn prompt as leased and count the draw (``prompts_drawn``, to resume the stream)."""
    inserted, _ = execute_together(conn, [
        ("INSERT INTO prompts(env, text, answer, meta, prompt_ids, state, attempts) VALUES(?, ?, ?, ?, ?, ?, 1) "
         "RETURNING prompt_id", (env, text, answer, json.dumps(meta), pack_i32(prompt_ids), PromptState.LEASED)),
        # /*SLOT*/: on PostgreSQL, this writer's own row of the counter (store_pg.COUNTER_SLOTS).
        ("UPDATE counters SET value = value + 1 WHERE name = 'prompts_drawn' /*SLOT*/", ()),
    ])
    return int(inserted.fetchone()[0])


def use_nonces(conn: sqlite3.Connection, entries: list[tuple[bytes, str, int]]) -> list[bool]:
    """Record requests' nonces (public key, nonce, expiry) in one statement: for each, True when its nonce
    was new, False when it was used already (a replay), whichever edge process saw it first. Of entries with
    the same key and nonce only the first can be (a request and its replay in one transaction)."""
    first: dict[tuple[bytes, str], int] = {}
    for i, (key, nonce, _) in enumerate(entries):
        first.setdefault((bytes(key), nonce), i)
    # In key order: edges that insert the same nonces at once lock them in one order (no deadlock).
    unique = sorted(first)
    if isinstance(conn, store_pg.PgConnection):  # one statement whatever the count (one prepared statement)
        rows = conn.execute(
            "INSERT INTO nonces(public_key, nonce, expires_ms) SELECT * FROM unnest(?::bytea[], ?::text[], ?::bigint[]) "
            "ON CONFLICT(public_key, nonce) DO NOTHING RETURNING public_key, nonce",
            ([k for k, _ in unique], [n for _, n in unique], [entries[first[k]][2] for k in unique]))
    else:
        rows = conn.execute(
            "INSERT INTO nonces(public_key, nonce, expires_ms) VALUES " + ", ".join(["(?, ?, ?)"] * len(unique))
            + " ON CONFLICT(public_key, nonce) DO NOTHING RETURNING public_key, nonce",
            [v for k in unique for v in (k[0], k[1], entries[first[k]][2])])
    new = {(bytes(r[0]), r[1]) for r in rows}
    return [first[(bytes(key), nonce)] == i and (bytes(key), nonce) in new for i, (key, nonce, _) in enumerate(entries)]


def forget_nonces(conn: sqlite3.Connection, now_ms: int) -> int:
    """Nonces whose timestamps can no longer pass the window are dropped."""
    return conn.execute("DELETE FROM nonces WHERE expires_ms < ?", (now_ms,)).rowcount


def prompts_drawn(conn: sqlite3.Connection) -> int:
    """Prompts drawn from the stream so far, by every process (the counter's rows summed)."""
    return int(conn.execute("SELECT COALESCE(SUM(value), 0) FROM counters WHERE name = 'prompts_drawn'")
               .fetchone()[0])


@dataclass(frozen=True)
class LeaseRecord:
    """A lease as issued and stored: what the node was asked to generate, and the state of the ask."""

    lease_id: str
    node_id: str
    prompt_id: int
    group_size: int
    temperature: float
    max_new_tokens: int
    seeds: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    policy_version: int
    issued_ms: int
    deadline_ms: int
    state: LeaseState
    probation: bool = False  # issued to a node on probation (counts towards leases.probation_share)

    @classmethod
    def from_row(cls, row) -> LeaseRecord:
        return cls(
            lease_id=row["lease_id"], node_id=row["node_id"], prompt_id=int(row["prompt_id"]),
            group_size=int(row["group_size"]), temperature=float(row["temperature"]),
            max_new_tokens=int(row["max_new_tokens"]), seeds=tuple(json.loads(row["seeds"])),
            stop_token_ids=tuple(json.loads(row["stop_token_ids"])), policy_version=int(row["policy_version"]),
            issued_ms=int(row["issued_ms"]), deadline_ms=int(row["deadline_ms"]), state=LeaseState(row["state"]),
            probation=bool(row["probation"]),
        )


def insert_lease(conn: sqlite3.Connection, lease: LeaseRecord) -> None:
    conn.execute(
        "INSERT INTO leases(lease_id, node_id, prompt_id, group_size, temperature, max_new_tokens, seeds, "
        "stop_token_ids, policy_version, issued_ms, deadline_ms, state, probation) "
        "VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (lease.lease_id, lease.node_id, lease.prompt_id, lease.group_size, lease.temperature, lease.max_new_tokens,
         json.dumps(list(lease.seeds)), json.dumps(list(lease.stop_token_ids)), lease.policy_version, lease.issued_ms,
         lease.deadline_ms, lease.state, int(lease.probation)),
    )


@dataclass(frozen=True)
class FreshPrompt:
    """A prompt drawn from the environment's stream, not stored yet."""

    env: str
    text: str
    answer: str
    meta: dict
    prompt_ids: list[int]


@dataclass(frozen=True)
class LeasedOne:
    """What ``lease_one`` did: the limits it read, and the prompt leased (None: refused by a limit)."""

    queued: int  # groups queued for the trainer
    open_of_node: int  # the node's open leases before this one
    prompt_id: int | None
    prompt_ids: list[int] | None
    env: str | None
    leftover: FreshPrompt | None  # the fresh prompt asked for and not stored (a pooled one went first)


def lease_one(conn: sqlite3.Connection, lease: LeaseRecord, fresh: Callable[[], FreshPrompt], *, queue_max: int,
              max_open: int) -> LeasedOne:
    """Issue ``lease`` (its ``prompt_id`` is filled here) unless the trainer's queue holds ``queue_max`` groups or
    the node ``max_open`` open leases: a prompt back in the pool goes first, else ``fresh()`` is stored as
    leased and counted as drawn. LeaseWork's common case (one lease, a trusted node) as one operation."""
    if isinstance(conn, store_pg.PgConnection):
        return _lease_one_pg(conn, lease, fresh, queue_max=queue_max, max_open=max_open)
    queued, open_of_node = lease_limits(conn, lease.node_id)
    if queued >= queue_max or open_of_node >= max_open:
        return LeasedOne(queued, open_of_node, None, None, None, None)
    taken = take_pending_prompt(conn)
    if taken is not None:
        prompt_id, ids, env = taken
    else:
        p = fresh()
        prompt_id, ids, env = insert_leased_prompt(conn, p.env, p.text, p.answer, p.meta, p.prompt_ids), p.prompt_ids, p.env
    insert_lease(conn, dataclasses.replace(lease, prompt_id=prompt_id))
    return LeasedOne(queued, open_of_node, prompt_id, ids, env, None)


_LEASE_ONE_PG = (
    # One statement, so one round trip: the limits, a pooled prompt or the fresh one, the lease and the count
    # of draws as data-modifying CTEs over one snapshot. Each write runs only when the one before it let it:
    # `ok` is empty past a limit, `fresh` only when no pooled prompt was taken, the lease only with a prompt.
    "WITH lim AS (SELECT (SELECT COALESCE(SUM(value), 0) FROM counters WHERE name = 'queued_groups') AS queued, "
    "(SELECT COUNT(*) FROM leases WHERE node_id = ? AND state = ?) AS open_of_node), "
    "ok AS (SELECT 1 FROM lim WHERE queued < ? AND open_of_node < ?), "
    "taken AS (UPDATE prompts SET state = ?, attempts = attempts + 1 WHERE EXISTS (SELECT 1 FROM ok) AND state = ? "
    "AND prompt_id = (SELECT prompt_id FROM prompts WHERE state = ? ORDER BY prompt_id LIMIT 1 /*SKIP LOCKED*/) "
    "RETURNING prompt_id, prompt_ids, env), "
    "fresh AS (INSERT INTO prompts(env, text, answer, meta, prompt_ids, state, attempts) "
    "SELECT ?::text, ?::text, ?::text, ?::text, ?::bytea, ?::text, 1 FROM ok WHERE NOT EXISTS (SELECT 1 FROM taken) "
    "RETURNING prompt_id, prompt_ids, env), "
    "chosen AS (SELECT prompt_id, prompt_ids, env, false AS is_fresh FROM taken "
    "UNION ALL SELECT prompt_id, prompt_ids, env, true FROM fresh), "
    "issued AS (INSERT INTO leases(lease_id, node_id, prompt_id, group_size, temperature, max_new_tokens, seeds, "
    "stop_token_ids, policy_version, issued_ms, deadline_ms, state, probation) "
    "SELECT ?::text, ?::text, prompt_id, ?, ?, ?, ?::text, ?::text, ?, ?, ?, ?::text, ? FROM chosen), "
    "drawn AS (UPDATE counters SET value = value + 1 WHERE name = 'prompts_drawn' /*SLOT*/ "
    "AND EXISTS (SELECT 1 FROM fresh)) "
    "SELECT lim.queued, lim.open_of_node, chosen.prompt_id, chosen.prompt_ids, chosen.env, chosen.is_fresh "
    "FROM lim LEFT JOIN chosen ON true")


def _lease_one_pg(conn, lease: LeaseRecord, fresh: Callable[[], FreshPrompt], *, queue_max: int,
                  max_open: int) -> LeasedOne:
    # The fresh prompt is drawn before the statement knows whether it needs it; when a pooled prompt went
    # first (or a limit refused) it is handed back as ``leftover`` for the next lease, so the stream skips none.
    p = fresh()
    row = conn.execute(_LEASE_ONE_PG, (
        lease.node_id, LeaseState.OPEN, queue_max, max_open,
        PromptState.LEASED, PromptState.PENDING, PromptState.PENDING,
        p.env, p.text, p.answer, json.dumps(p.meta), pack_i32(p.prompt_ids), PromptState.LEASED,
        lease.lease_id, lease.node_id, lease.group_size, lease.temperature, lease.max_new_tokens,
        json.dumps(list(lease.seeds)), json.dumps(list(lease.stop_token_ids)), lease.policy_version,
        lease.issued_ms, lease.deadline_ms, lease.state, int(lease.probation))).fetchone()
    queued, open_of_node, prompt_id, blob, env, is_fresh = row
    if prompt_id is None:
        return LeasedOne(int(queued), int(open_of_node), None, None, None, p)
    return LeasedOne(int(queued), int(open_of_node), int(prompt_id), unpack_i32(blob).tolist(), env,
                     None if is_fresh else p)


LEASE_COLUMNS = ("lease_id", "node_id", "prompt_id", "group_size", "temperature", "max_new_tokens", "seeds",
                 "stop_token_ids", "policy_version", "issued_ms", "deadline_ms", "state", "probation")
PROMPT_COLUMNS = ("prompt_id", "env", "text", "answer", "meta", "prompt_ids", "state", "attempts")
_LOAD_LEASE = ("SELECT " + ", ".join([f"l.{c}" for c in LEASE_COLUMNS] + [f"p.{c}" for c in PROMPT_COLUMNS])
               + ", g.group_id, g.content_hash FROM leases l JOIN prompts p ON p.prompt_id = l.prompt_id "
               "LEFT JOIN groups g ON g.lease_id = l.lease_id WHERE l.lease_id = ?")


def load_lease(conn: sqlite3.Connection, lease_id: str) -> tuple[dict | None, dict | None, dict | None]:
    """A lease row, its prompt, and the group already accepted for it (if any).

    One statement, so the three are one snapshot on either backend without a transaction around it, and one
    round trip on PostgreSQL: the intake reads it for every submitted group."""
    row = conn.execute(_LOAD_LEASE, (lease_id,)).fetchone()
    if row is None:
        return None, None, None
    values = tuple(row)
    prompt_at, group_at = len(LEASE_COLUMNS), len(LEASE_COLUMNS) + len(PROMPT_COLUMNS)
    group_id, content_hash = values[group_at:]
    return (dict(zip(LEASE_COLUMNS, values[:prompt_at], strict=True)),
            dict(zip(PROMPT_COLUMNS, values[prompt_at:group_at], strict=True)),
            None if group_id is None else {"group_id": group_id, "content_hash": content_hash})


def spend_lease(conn: sqlite3.Connection, lease_id: str, prompt_id: int) -> bool:
    """An open lease whose group failed a content check is spent; its prompt goes back to the pool."""
    n = conn.execute("UPDATE leases SET state = ? WHERE lease_id = ? AND state = ?",
                     (LeaseState.REJECTED, lease_id, LeaseState.OPEN)).rowcount
    if n:
        _return_prompt(conn, prompt_id)
    return bool(n)


@dataclass(frozen=True)
class AcceptedGroup:
    lease_id: str
    node_id: str
    prompt_id: int
    env: str
    policy_version: int
    temperature: float
    arrival_ms: int
    content_hash: str
    tokens: int
    rewards: list[float]
    verified: bool  # the verification stages ran and passed
    clean: bool  # counts towards leaving probation (verified, or verification is off for this coordinator)
    # Per sample: (token ids, log-probs, trusted log-probs or None) as packed blobs, and the finish reason.
    samples: list[tuple[bytes, bytes, bytes | None, str]]


def execute_together(conn: sqlite3.Connection, statements: list[tuple[str, tuple]]) -> list:
    """Statements none of which depends on another's result, in order; their results (rows fetched, rowcount).
    On PostgreSQL in one round trip (``PgConnection.execute_together``); on SQLite one after another."""
    if isinstance(conn, store_pg.PgConnection):
        return conn.execute_together(statements)
    out = []
    for sql, params in statements:
        cur = conn.execute(sql, params)
        out.append(store_pg.Result(cur.fetchall(), cur.rowcount))
    return out


@functools.lru_cache(maxsize=64)
def _insert_samples_sql(n: int) -> str:
    return ("INSERT INTO samples(group_id, idx, token_ids, logprobs, trusted_logprobs, reward, finish_reason) VALUES"
            + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * n))


def accept_group(conn: sqlite3.Connection, group: AcceptedGroup, *, probation_groups: int) -> int | None:
    """Spend the lease on the group, store the group, mark its prompt done and credit the node; the group id,
    or None when the lease is no longer open (a concurrent submission won)."""
    if isinstance(conn, store_pg.PgConnection):
        return _accept_group_pg(conn, group, probation_groups=probation_groups)
    n = conn.execute("UPDATE leases SET state = ? WHERE lease_id = ? AND state = ?",
                     (LeaseState.SUBMITTED, group.lease_id, LeaseState.OPEN)).rowcount
    if n != 1:
        return None
    mean_reward = sum(group.rewards) / len(group.rewards) if group.rewards else 0.0
    gid = int(conn.execute(
        "INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, arrival_ms, content_hash, "
        "tokens, mean_reward, verified) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING group_id",
        (group.lease_id, group.node_id, group.prompt_id, group.env, group.policy_version, group.temperature,
         group.arrival_ms, group.content_hash, group.tokens, mean_reward, int(group.verified))).fetchone()[0])
    conn.execute("UPDATE prompts SET state = ? WHERE prompt_id = ?", (PromptState.DONE, group.prompt_id))
    conn.execute(*_credit_node_statement(group.node_id, group.tokens, clean=group.clean, now_ms=group.arrival_ms,
                                         probation_groups=probation_groups))
    if group.samples:  # one statement for all samples
        conn.execute(_insert_samples_sql(len(group.samples)),
                     [v for i, (tok, lp, trusted, finish) in enumerate(group.samples)
                      for v in (gid, i, tok, lp, trusted, group.rewards[i], finish)])
    return gid


@functools.lru_cache(maxsize=64)
def _accept_group_pg_sql(n: int) -> str:
    """accept_group on PostgreSQL as one statement: its five writes as data-modifying CTEs, each but the first
    fed by the one before it (no group unless the lease was still open; nothing else without the group)."""
    credit, _ = _credit_node_statement("", 0, clean=False, now_ms=0, probation_groups=0)
    samples = ", ".join(["(?::bigint, ?::bytea, ?::bytea, ?::bytea, ?::float8, ?::text)"] * n)
    return ("WITH spent AS (UPDATE leases SET state = ? WHERE lease_id = ? AND state = ? RETURNING lease_id), "
            "g AS (INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, arrival_ms, "
            "content_hash, tokens, mean_reward, verified) "
            "SELECT lease_id, ?::text, ?, ?::text, ?, ?, ?, ?::text, ?, ?, ? FROM spent RETURNING group_id)"
            + (", s AS (INSERT INTO samples(group_id, idx, token_ids, logprobs, trusted_logprobs, reward, finish_reason) "
               f"SELECT g.group_id, v.* FROM g CROSS JOIN (VALUES {samples}) AS v)" if n else "")
            + ", p AS (UPDATE prompts SET state = ? WHERE prompt_id = ? AND EXISTS (SELECT 1 FROM g)), "
            f"c AS ({credit} AND EXISTS (SELECT 1 FROM g)) SELECT group_id FROM g")


def _accept_group_pg(conn, group: AcceptedGroup, *, probation_groups: int) -> int | None:
    # One round trip and one statement where the SQLite path takes five statements: an edge's writer waits on
    # PostgreSQL, and takes the GIL back from the event loop, once per group instead of three times.
    mean_reward = sum(group.rewards) / len(group.rewards) if group.rewards else 0.0
    _, credit = _credit_node_statement(group.node_id, group.tokens, clean=group.clean, now_ms=group.arrival_ms,
                                       probation_groups=probation_groups)
    params = [LeaseState.SUBMITTED, group.lease_id, LeaseState.OPEN,
              group.node_id, group.prompt_id, group.env, group.policy_version, group.temperature, group.arrival_ms,
              group.content_hash, group.tokens, mean_reward, int(group.verified)]
    for i, (tok, lp, trusted, finish) in enumerate(group.samples):
        params += (i, tok, lp, trusted, group.rewards[i], finish)
    params += (PromptState.DONE, group.prompt_id, *credit)
    row = conn.execute(_accept_group_pg_sql(len(group.samples)), params).fetchone()
    return None if row is None else int(row[0])


def _credit_node_statement(node_id: str, tokens: int, *, clean: bool, now_ms: int,
                           probation_groups: int) -> tuple[str, tuple]:
    """The UPDATE crediting an accepted group; ``probation_groups`` clean groups since the last strike make a
    node trusted."""
    # SET expressions see the row before the update: clean_groups + ? is the new count.
    return ("UPDATE nodes SET accepted_groups = accepted_groups + 1, accepted_tokens = accepted_tokens + ?, "
            "clean_groups = clean_groups + ?, last_seen_ms = ?, standing = CASE WHEN standing = ? "
            "AND clean_groups + ? >= ? THEN ? ELSE standing END WHERE node_id = ?",
            (tokens, int(clean), now_ms, Standing.PROBATION, int(clean), probation_groups, Standing.TRUSTED, node_id))


def group_answer(conn: sqlite3.Connection, group_id: int) -> tuple[int, list[float]]:
    """(credited tokens, rewards by sample) of an accepted group: the answer to a retried submission."""
    g = conn.execute("SELECT tokens FROM groups WHERE group_id = ?", (group_id,)).fetchone()
    rewards = [r["reward"] for r in conn.execute("SELECT reward FROM samples WHERE group_id = ? ORDER BY idx",
                                                 (group_id,))]
    return int(g["tokens"]), rewards


# The trainer's side


def queued_group_versions(conn: sqlite3.Connection) -> list[tuple[int, int]]:
    """(group id, policy version) of every queued group (neither consumed nor dropped), oldest first."""
    return [(int(r[0]), int(r[1])) for r in conn.execute(
        "SELECT group_id, policy_version FROM groups WHERE consumed_step IS NULL AND dropped IS NULL ORDER BY group_id")]


def groups_with_samples(conn: sqlite3.Connection, group_ids: list[int]) -> dict[int, tuple[dict, list[dict]]]:
    """``{group id: (group row with its prompt's token ids, [sample rows in order])}``."""
    if not group_ids:
        return {}
    marks = ",".join("?" * len(group_ids))
    out: dict[int, tuple[dict, list[dict]]] = {}
    for r in conn.execute(f"SELECT g.group_id, g.env, g.policy_version, g.temperature, g.tokens, p.prompt_ids "
                          f"FROM groups g JOIN prompts p ON p.prompt_id = g.prompt_id WHERE g.group_id IN ({marks})",
                          group_ids):
        out[int(r["group_id"])] = (dict(r), [])
    for r in conn.execute(f"SELECT group_id, token_ids, logprobs, trusted_logprobs, reward FROM samples "
                          f"WHERE group_id IN ({marks}) ORDER BY group_id, idx", group_ids):
        if int(r["group_id"]) in out:
            out[int(r["group_id"])][1].append(dict(r))
    return out


def drop_groups(conn: sqlite3.Connection, group_ids: list[int], why: str) -> dict[int, int]:
    """Mark queued groups dropped (``why``: e.g. 'stale'); returns ``{group id: samples}`` of those given."""
    if not group_ids:
        return {}
    marks = ",".join("?" * len(group_ids))
    sizes = {int(g): int(n) for g, n in conn.execute(
        f"SELECT group_id, COUNT(*) FROM samples WHERE group_id IN ({marks}) GROUP BY group_id", group_ids)}
    conn.execute(f"UPDATE groups SET dropped = ? WHERE group_id IN ({marks}) AND consumed_step IS NULL "
                 "AND dropped IS NULL", [why, *group_ids])
    return sizes


def commit_step(conn: sqlite3.Connection, step: int, group_ids: list[int], history: list[dict],
                new_version: int | None) -> None:
    """A trainer step, all or nothing: its groups consumed, the step counter, the history and the policy
    version. Raises when a group was consumed or dropped meanwhile (the transaction then rolls back)."""
    if group_ids:
        marks = ",".join("?" * len(group_ids))
        n = conn.execute(f"UPDATE groups SET consumed_step = ? WHERE group_id IN ({marks}) "
                         "AND consumed_step IS NULL AND dropped IS NULL", [step, *group_ids]).rowcount
        if n != len(group_ids):
            raise RuntimeError(f"step {step}: {len(group_ids) - n} of its groups were consumed or dropped meanwhile")
    kv_set(conn, "trainer_step", step)
    kv_set(conn, TRAINER_HISTORY_KEY, history)
    if new_version is not None:
        kv_set(conn, "policy_version", new_version)


def unconsume_after(conn: sqlite3.Connection, step: int) -> list[int]:
    """Groups consumed by steps after ``step`` (lost with the weights of a crash) are queued again."""
    return [int(r[0]) for r in conn.execute(
        "UPDATE groups SET consumed_step = NULL WHERE consumed_step > ? RETURNING group_id", (step,))]


def consumed_groups(conn: sqlite3.Connection, up_to_step: int | None = None) -> int:
    """Groups trained on (by steps ≤ ``up_to_step``, or by any step)."""
    if up_to_step is None:
        return int(conn.execute("SELECT COUNT(*) FROM groups WHERE consumed_step IS NOT NULL").fetchone()[0])
    return int(conn.execute("SELECT COUNT(*) FROM groups WHERE consumed_step IS NOT NULL AND consumed_step <= ?",
                            (up_to_step,)).fetchone()[0])


TRAINER_HISTORY_KEY = "trainer_history"


# The status API's reads


def first_rejection_ms(conn: sqlite3.Connection, since_ms: int) -> int | None:
    return conn.execute("SELECT MIN(time_ms) FROM rejections WHERE time_ms >= ?", (since_ms,)).fetchone()[0]


def rejections_per_bucket(conn: sqlite3.Connection, start_ms: int, bucket_ms: int) -> list[tuple[int, str, int]]:
    """(bucket index, reason, count) of logged rejections since ``start_ms``."""
    return [(int(r["b"]), r["reason"], int(r["n"])) for r in conn.execute(
        "SELECT (time_ms - ?) / ? AS b, reason, COUNT(*) AS n FROM rejections WHERE time_ms >= ? GROUP BY b, reason",
        (start_ms, bucket_ms, start_ms))]


def first_arrival_ms(conn: sqlite3.Connection, since_ms: int) -> int | None:
    return conn.execute("SELECT MIN(arrival_ms) FROM groups WHERE arrival_ms >= ?", (since_ms,)).fetchone()[0]


def arrivals_per_bucket(conn: sqlite3.Connection, start_ms: int, bucket_ms: int) -> list[tuple[int, int, int]]:
    """(bucket index, accepted groups, their tokens) since ``start_ms``."""
    return [(int(r["b"]), int(r["g"]), int(r["t"] or 0)) for r in conn.execute(
        "SELECT (arrival_ms - ?) / ? AS b, COUNT(*) AS g, SUM(tokens) AS t FROM groups WHERE arrival_ms >= ? GROUP BY b",
        (start_ms, bucket_ms, start_ms))]


def queue_staleness(conn: sqlite3.Connection, version: int) -> dict[int, int]:
    """``{staleness against version: queued groups}``."""
    return {int(r["s"]): int(r["n"]) for r in conn.execute(
        "SELECT ? - policy_version AS s, COUNT(*) AS n FROM groups WHERE consumed_step IS NULL AND dropped IS NULL "
        "GROUP BY s ORDER BY s", (version,))}


def observer_snapshot(conn: sqlite3.Connection) -> dict:
    """What a watcher of a run reads (the testnet's progress): kv, nodes with their standing and credit,
    refusals by node and reason, group counts and the mean reward of the 32 newest groups."""
    kv = {r["key"]: json.loads(r["value"]) for r in conn.execute("SELECT key, value FROM kv")}
    nodes = {r["node_id"]: dict(r) for r in conn.execute(
        "SELECT node_id, display_name, standing, strikes, accepted_groups, accepted_tokens FROM nodes")}
    recent = [r[0] for r in conn.execute("SELECT mean_reward FROM groups ORDER BY group_id DESC LIMIT 32")]
    return {
        "kv": kv, "nodes": nodes, "rejections": rejections_by_node(conn),
        "accepted_groups": int(conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0]),
        "dropped_groups": int(conn.execute("SELECT COUNT(*) FROM groups WHERE dropped IS NOT NULL").fetchone()[0]),
        "recent_reward": sum(recent) / len(recent) if recent else 0.0,
    }


def read_transaction(conn: sqlite3.Connection):
    """A context manager: one consistent snapshot for several reads on a reader connection (on PostgreSQL,
    ``Database`` reads run in one already: the block joins it)."""
    if isinstance(conn, store_pg.PgConnection):
        return conn.snapshot()
    return _ReadTransaction(conn)


class _ReadTransaction:
    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN")
        return self.conn

    def __exit__(self, *exc) -> None:
        self.conn.execute("COMMIT")


# --- bounds on what nodes say about themselves ---------------------------------------------------------

NAME_CHARS = 64  # display_name, software_version (the cut display names always had)
HARDWARE_TEXT_CHARS = 128  # hardware.cpu, .os, .engine, .device, .gpus[].name
MAX_GPUS = 16


def bounded_text(value, limit: int) -> str:
    """``value`` without control/format characters (Unicode category C: NUL, newlines, bidi overrides...),
    cut to ``limit`` characters, outer whitespace stripped. Non-strings give ``""``.

    Reads only as much of ``value`` as the cut needs, so a megabyte of input costs a few hundred steps."""
    if not isinstance(value, str):
        return ""
    kept = (c for c in value if not unicodedata.category(c).startswith("C"))
    return "".join(islice(dropwhile(str.isspace, kept), limit)).rstrip()


def _count(value) -> int:
    """A non-negative int64 (negative, non-integer or out-of-range counts give 0)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else 0


def bound_node_fields(hardware: dict, software_version: str, display_name: str) -> tuple[dict, str, str]:
    """What a node says about itself in Register, bounded before it is stored or shown.

    The one rule for every node-supplied string and list that the coordinator keeps or echoes (the
    ``nodes`` row, ``/api/status``, ``veriroll-coordinator nodes``): strings lose control characters and are
    cut (:data:`NAME_CHARS` for ``display_name`` and ``software_version``, :data:`HARDWARE_TEXT_CHARS` for
    hardware text), at most :data:`MAX_GPUS` GPUs are kept, counts are non-negative ints, and unknown
    hardware keys are dropped. Returns ``(hardware, software_version, display_name)``; pure, never raises.
    """
    hardware = hardware if isinstance(hardware, dict) else {}
    gpus = hardware.get("gpus")
    gpus = gpus if isinstance(gpus, list) else []
    hw = {
        "cpu": bounded_text(hardware.get("cpu", ""), HARDWARE_TEXT_CHARS),
        "cpu_count": _count(hardware.get("cpu_count", 0)),
        "ram_bytes": _count(hardware.get("ram_bytes", 0)),
        "disk_free_bytes": _count(hardware.get("disk_free_bytes", 0)),
        "os": bounded_text(hardware.get("os", ""), HARDWARE_TEXT_CHARS),
        "engine": bounded_text(hardware.get("engine", ""), HARDWARE_TEXT_CHARS),
        "device": bounded_text(hardware.get("device", ""), HARDWARE_TEXT_CHARS),
        "gpus": [{"name": bounded_text(g.get("name", ""), HARDWARE_TEXT_CHARS), "memory_bytes": _count(g.get("memory_bytes", 0))}
                 for g in islice((g for g in gpus if isinstance(g, dict)), MAX_GPUS)],
    }
    return hw, bounded_text(software_version, NAME_CHARS), bounded_text(display_name, NAME_CHARS)


def find_node(conn: sqlite3.Connection, key_or_id: str) -> sqlite3.Row | None:
    """A node by id, by hex public key, or by unique id prefix (operators paste what they have)."""
    row = conn.execute("SELECT * FROM nodes WHERE node_id = ?", (key_or_id,)).fetchone()
    if row is not None:
        return row
    try:
        raw = bytes.fromhex(key_or_id.split()[-1])
    except ValueError:
        raw = b""
    if raw:
        row = conn.execute("SELECT * FROM nodes WHERE public_key = ?", (raw,)).fetchone()
        if row is not None:
            return row
    rows = conn.execute("SELECT * FROM nodes WHERE node_id LIKE ?", (key_or_id + "%",)).fetchall()
    return rows[0] if len(rows) == 1 else None


def set_standing(conn: sqlite3.Connection, node_id: str, standing: str, reason: str = "") -> None:
    if standing not in STANDINGS:
        raise ValueError(f"standing must be one of {STANDINGS}")
    strikes_reset = ", strikes = 0, clean_groups = 0" if standing == "probation" else ""
    conn.execute(f"UPDATE nodes SET standing = ?, ban_reason = ?{strikes_reset} WHERE node_id = ?",
                 (standing, reason, node_id))


# --- standing changes: what every process caching nodes (Ledger) follows ----------------------------------

# A trigger notes each change of a node's standing or ban reason, whoever made it: this process, another
# edge, the operator's CLI on the same file. A process's node cache follows this table (one read a second,
# whatever the number of nodes) instead of reading every node again every few seconds.
STANDING_CHANGES_SCHEMA = """
CREATE TABLE IF NOT EXISTS standing_changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id TEXT NOT NULL,
    changed_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS standing_changes_time ON standing_changes(changed_ms);
CREATE TRIGGER IF NOT EXISTS nodes_standing_changed AFTER UPDATE OF standing, ban_reason ON nodes
WHEN OLD.standing IS NOT NEW.standing OR OLD.ban_reason IS NOT NEW.ban_reason
BEGIN
    INSERT INTO standing_changes(node_id, changed_ms)
    VALUES (NEW.node_id, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;
"""

STANDING_CHANGES_KEPT_MS = 3_600_000
"""How long a noted change is kept (past the newest one): far longer than any process goes without reading."""


def standing_changes(conn: sqlite3.Connection, since_ms: int, limit: int, after_seq: int = -1
                     ) -> list[tuple[int, str, int]]:
    """(seq, node id, changed ms) of the changes noted at or after ``since_ms`` (the database's clock), oldest
    first, at most ``limit``; of those noted at ``since_ms`` itself only the ones past ``after_seq`` (a reader
    that went past a page of them goes on from there, rather than skipping the rest of that millisecond)."""
    return [(int(r[0]), r[1], int(r[2])) for r in conn.execute(
        "SELECT seq, node_id, changed_ms FROM standing_changes WHERE changed_ms >= ? AND (changed_ms > ? OR seq > ?) "
        "ORDER BY seq LIMIT ?", (since_ms, since_ms, after_seq, limit))]


def newest_standing_change_ms(conn: sqlite3.Connection) -> int | None:
    return newest_standing_change(conn)[0]


def newest_standing_change(conn: sqlite3.Connection) -> tuple[int | None, int]:
    """The newest change's millisecond and the highest seq noted so far ((None, -1) before any)."""
    ms, seq = conn.execute("SELECT MAX(changed_ms), MAX(seq) FROM standing_changes").fetchone()
    return (None, -1) if ms is None else (int(ms), int(seq))


def forget_standing_changes(conn: sqlite3.Connection) -> int:
    """Drop noted changes older than STANDING_CHANGES_KEPT_MS before the newest (an index range)."""
    return conn.execute("DELETE FROM standing_changes WHERE changed_ms < "
                        "(SELECT MAX(changed_ms) FROM standing_changes) - ?", (STANDING_CHANGES_KEPT_MS,)).rowcount


# --- verification jobs: edges hand audited groups to the verifier pool (coordinator/verifier_pool.py) ---

VERIFY_JOBS_SCHEMA = """
CREATE TABLE IF NOT EXISTS verify_jobs (
    job_id INTEGER PRIMARY KEY AUTOINCREMENT,
    lease_id TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    node_id TEXT NOT NULL,
    peer TEXT NOT NULL DEFAULT '',
    submission BLOB NOT NULL,
    created_ms INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    worker TEXT NOT NULL DEFAULT '',
    claims INTEGER NOT NULL DEFAULT 0,
    claim_deadline_ms INTEGER NOT NULL DEFAULT 0,
    reason TEXT,
    detail TEXT NOT NULL DEFAULT '',
    trusted_logprobs BLOB,
    seconds REAL NOT NULL DEFAULT 0,
    finished_ms INTEGER NOT NULL DEFAULT 0,
    UNIQUE (lease_id, content_hash)
);
CREATE INDEX IF NOT EXISTS verify_jobs_state ON verify_jobs(state, job_id);
"""


class JobState(StrEnum):
    """pending → claimed (a worker verifies it until its claim deadline) → done (the verdict is written);
    a claim past its deadline (the worker died) goes back to pending."""

    PENDING = "pending"
    CLAIMED = "claimed"
    DONE = "done"


@dataclass(frozen=True)
class VerifyJob:
    """What a verifier worker needs: the lease, and the node's submission as it arrived (SubmitGroupRequest)."""

    job_id: int
    lease_id: str
    content_hash: str
    node_id: str
    peer: str
    submission: bytes
    created_ms: int
    claims: int  # times claimed and not handed back, this one included (more than 1: a worker died on it)


@dataclass(frozen=True)
class Verdict:
    """A finished job: ``reason`` None when the group passed, its trusted log-probs (every sample's, concatenated
    float32, in sample order) then; the verifier seconds it cost either way."""

    reason: str | None
    detail: str = ""
    trusted_logprobs: bytes | None = None
    seconds: float = 0.0


def enqueue_verify_job(conn: sqlite3.Connection, lease_id: str, content_hash: str, node_id: str, peer: str,
                       submission: bytes, now_ms: int) -> int:
    """Queue a group for the verifier pool; the job id. An honest retry of the same content finds its job
    (pending, claimed or done) instead of queueing the group twice."""
    conn.execute("INSERT INTO verify_jobs(lease_id, content_hash, node_id, peer, submission, created_ms, state) "
                 "VALUES(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(lease_id, content_hash) DO NOTHING",
                 (lease_id, content_hash, node_id, peer, submission, now_ms, JobState.PENDING))
    return int(conn.execute("SELECT job_id FROM verify_jobs WHERE lease_id = ? AND content_hash = ?",
                            (lease_id, content_hash)).fetchone()[0])


def claim_verify_job(conn: sqlite3.Connection, worker: str, deadline_ms: int) -> VerifyJob | None:
    """The oldest pending job, now claimed by ``worker`` until ``deadline_ms``; None when none is pending."""
    # As in take_pending_prompt: SKIP LOCKED (PostgreSQL) lets workers in other processes claim side by side,
    # and the outer state check keeps two of them from claiming one job.
    row = conn.execute("UPDATE verify_jobs SET state = ?, worker = ?, claims = claims + 1, claim_deadline_ms = ? "
                       "WHERE state = ? AND job_id = (SELECT job_id FROM verify_jobs WHERE state = ? ORDER BY job_id "
                       "LIMIT 1 /*SKIP LOCKED*/) "
                       "RETURNING job_id, lease_id, content_hash, node_id, peer, submission, created_ms, claims",
                       (JobState.CLAIMED, worker, deadline_ms, JobState.PENDING, JobState.PENDING)).fetchone()
    if row is None:
        return None
    return VerifyJob(int(row[0]), row[1], row[2], row[3], row[4], bytes(row[5]), int(row[6]), int(row[7]))


def reclaim_verify_jobs(conn: sqlite3.Connection, now_ms: int) -> int:
    """Claims past their deadline (their worker was killed or hung) go back to pending; how many."""
    return conn.execute("UPDATE verify_jobs SET state = ?, worker = '' WHERE state = ? AND claim_deadline_ms < ?",
                        (JobState.PENDING, JobState.CLAIMED, now_ms)).rowcount


def release_verify_job(conn: sqlite3.Connection, job_id: int, worker: str) -> bool:
    """A worker stopping cleanly hands its claim back at once, rather than at its deadline (uncounted: the
    group did not stop that worker)."""
    return bool(conn.execute("UPDATE verify_jobs SET state = ?, worker = '', claims = claims - 1 WHERE job_id = ? "
                             "AND state = ? AND worker = ?",
                             (JobState.PENDING, job_id, JobState.CLAIMED, worker)).rowcount)


def finish_verify_job(conn: sqlite3.Connection, job_id: int, verdict: Verdict, now_ms: int) -> bool:
    """Write a job's verdict; False when it already had one (a worker past its deadline finished after the one
    that reclaimed it: the first verdict stands, so a group is judged once)."""
    return bool(conn.execute(
        "UPDATE verify_jobs SET state = ?, reason = ?, detail = ?, trusted_logprobs = ?, seconds = ?, finished_ms = ?, "
        "submission = ? WHERE job_id = ? AND state <> ?",
        (JobState.DONE, verdict.reason, verdict.detail, verdict.trusted_logprobs, verdict.seconds, now_ms, b"", job_id,
         JobState.DONE)).rowcount)


def verify_verdicts(conn: sqlite3.Connection, job_ids: list[int]) -> dict[int, Verdict]:
    """``{job id: verdict}`` of those of ``job_ids`` that have one (the others wait or are being verified)."""
    if not job_ids:
        return {}
    marks = ",".join("?" * len(job_ids))
    return {int(r[0]): Verdict(r[1], r[2], None if r[3] is None else bytes(r[3]), float(r[4])) for r in conn.execute(
        f"SELECT job_id, reason, detail, trusted_logprobs, seconds FROM verify_jobs WHERE job_id IN ({marks}) "
        "AND state = ?", [*job_ids, JobState.DONE])}


def verify_jobs_waiting(conn: sqlite3.Connection) -> int:
    """Jobs without a verdict yet (pending or claimed): the pool's backlog."""
    return int(conn.execute("SELECT COUNT(*) FROM verify_jobs WHERE state <> ?", (JobState.DONE,)).fetchone()[0])


def forget_verify_jobs(conn: sqlite3.Connection, finished_before_ms: int) -> int:
    """Verdicts finished before ``finished_before_ms`` are dropped: by then their leases have ended, so no
    retry can use them (an accepted group answers its retries from the groups table)."""
    return conn.execute("DELETE FROM verify_jobs WHERE state = ? AND finished_ms < ?",
                        (JobState.DONE, finished_before_ms)).rowcount


# --- shared limits: token buckets and live edges, for several edge processes on one store ------------------
#
# Rate limits that must hold across every edge process (new identities per address, verifier seconds per
# scope) are token buckets in ``limit_buckets``, one row per (kind, key), kept as a "theoretical arrival
# time" (GCRA): the bucket is full when ``tat_ms`` <= now, each token moves ``tat_ms`` on by one interval,
# and a take is allowed while ``tat_ms`` stays within ``burst`` intervals of now. One conditional upsert
# takes a token atomically on both backends (PostgreSQL locks the row for the statement), and a full
# bucket needs no row: rows are forgotten once full (``forget_full_buckets``), so the table holds only the
# keys that spent something recently. ``edges`` holds one heartbeat row per live edge process.


@dataclass(frozen=True)
class BucketRate:
    """A token bucket's refill (tokens per second, > 0) and size (tokens)."""

    per_s: float
    burst: float

    @property
    def interval_ms(self) -> float:
        return 1000.0 / self.per_s

    @property
    def tolerance_ms(self) -> float:
        return self.burst * self.interval_ms


def take_from_bucket(conn: sqlite3.Connection, kind: str, key: str, rate: BucketRate, cost: float, now_ms: float,
                     *, overdraw: bool = False) -> bool:
    """Take ``cost`` tokens from the (kind, key) bucket if it holds them; True when taken. With ``overdraw``
    they are always taken and the bucket may go into debt (paid back by refill before the next take)."""
    if cost > rate.burst and not overdraw:
        return False
    step_ms = cost * rate.interval_ms
    condition = "" if overdraw else "WHERE (CASE WHEN limit_buckets.tat_ms > ? THEN limit_buckets.tat_ms ELSE ? END) <= ?"
    params = () if overdraw else (now_ms, now_ms, now_ms + rate.tolerance_ms - step_ms)
    return conn.execute(
        "INSERT INTO limit_buckets(kind, key, tat_ms) VALUES(?, ?, ?) ON CONFLICT(kind, key) DO UPDATE SET "
        "tat_ms = (CASE WHEN limit_buckets.tat_ms > ? THEN limit_buckets.tat_ms ELSE ? END) + ? "
        f"{condition} RETURNING 1",
        (kind, key, now_ms + step_ms, now_ms, now_ms, step_ms, *params)).fetchone() is not None


def return_to_bucket(conn: sqlite3.Connection, kind: str, key: str, rate: BucketRate, cost: float) -> None:
    """Give back ``cost`` tokens taken in this transaction (the other half of an all-or-nothing take)."""
    conn.execute("UPDATE limit_buckets SET tat_ms = tat_ms - ? WHERE kind = ? AND key = ?",
                 (cost * rate.interval_ms, kind, key))


def bucket_level(conn: sqlite3.Connection, kind: str, key: str, rate: BucketRate, now_ms: float) -> float:
    """Tokens in the (kind, key) bucket at ``now_ms``: ``rate.burst`` when full, negative when in debt."""
    row = conn.execute("SELECT tat_ms FROM limit_buckets WHERE kind = ? AND key = ?", (kind, key)).fetchone()
    return _level(now_ms if row is None else float(row[0]), rate, now_ms)


def bucket_levels(conn: sqlite3.Connection, buckets: list[tuple[str, str, BucketRate]],
                  now_ms: float) -> list[float]:
    """:func:`bucket_level` of each ``(kind, key, rate)``, in one statement: a read of one statement is one
    snapshot on PostgreSQL without a transaction around it (``PgConnection.read``), and one round trip."""
    if not buckets:
        return []
    where = " OR ".join(["(kind = ? AND key = ?)"] * len(buckets))
    keys = [v for kind, key, _ in buckets for v in (kind, key)]
    tats = {(r[0], r[1]): float(r[2])
            for r in conn.execute(f"SELECT kind, key, tat_ms FROM limit_buckets WHERE {where}", keys)}
    return [_level(tats.get((kind, key), now_ms), rate, now_ms) for kind, key, rate in buckets]


def _level(tat_ms: float, rate: BucketRate, now_ms: float) -> float:
    return (now_ms + rate.tolerance_ms - max(tat_ms, now_ms)) / rate.interval_ms


def forget_full_buckets(conn: sqlite3.Connection, now_ms: float) -> int:
    """Buckets that have refilled completely are dropped: a missing row is a full bucket."""
    return conn.execute("DELETE FROM limit_buckets WHERE tat_ms <= ?", (now_ms,)).rowcount


def beat_edge(conn: sqlite3.Connection, edge_id: str, now_ms: int, ttl_ms: int) -> int:
    """Record that edge process ``edge_id`` is alive; returns how many edges beat within ``ttl_ms`` (itself
    included). Rows of edges silent for ten TTLs are dropped (a killed edge leaves its row behind)."""
    conn.execute("INSERT INTO edges(edge_id, seen_ms) VALUES(?, ?) ON CONFLICT(edge_id) DO UPDATE SET seen_ms = ?",
                 (edge_id, now_ms, now_ms))
    conn.execute("DELETE FROM edges WHERE seen_ms < ?", (now_ms - 10 * ttl_ms,))
    return int(conn.execute("SELECT COUNT(*) FROM edges WHERE seen_ms >= ?", (now_ms - ttl_ms,)).fetchone()[0])


def forget_edge(conn: sqlite3.Connection, edge_id: str) -> None:
    """An edge stopping on purpose leaves the count at once, rather than after its TTL."""
    conn.execute("DELETE FROM edges WHERE edge_id = ?", (edge_id,))


# --- the swarm's peer directory, shared by edge processes (shardcast/swarm/hints.py PeerDirectory) ---------
#
# On one SQLite process the directory lives in memory; edges sharing a PostgreSQL store each write what their
# heartbeats said and read every edge's, every ``resign_s``, in one transaction (``exchange_swarm_directory``).
# Both tables are bounded: at most ``max_listings`` listings (a node silent for the TTL is forgotten), reports
# about at most ``max_listings`` peers, each peer's ``reports_per_peer`` newest networks (enough to decide
# whether it is withheld), forgotten after the report TTL.

SWARM_SCHEMA = """
CREATE TABLE IF NOT EXISTS swarm_listings (
    node_id TEXT PRIMARY KEY,
    peer_id TEXT NOT NULL,
    addrs TEXT NOT NULL,
    versions TEXT NOT NULL,
    listed_ms INTEGER NOT NULL,
    seen_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS swarm_reports (
    peer_id TEXT NOT NULL,
    network TEXT NOT NULL,
    reported_ms INTEGER NOT NULL,
    PRIMARY KEY (peer_id, network)
);
"""

SwarmListing = tuple[str, str, tuple[str, ...], tuple[int, ...], int]  # node id, peer id, addrs, versions, seen ms
SwarmReport = tuple[str, str, int]  # reported peer id, reporter's network, reported ms


def _present(conn: sqlite3.Connection, sql: str, keys: list[str]) -> set[str]:
    """Those of ``keys`` that ``sql`` (a query with one ``IN ({marks})``) finds."""
    if not keys:
        return set()
    return {r[0] for r in conn.execute(sql.format(marks=",".join("?" * len(keys))), keys)}


def write_swarm_listings(conn: sqlite3.Connection, listed: list[SwarmListing], dropped: list[tuple[str, int]],
                         now_ms: int, ttl_ms: int, max_listings: int) -> None:
    """Forget listings silent for ``ttl_ms``; write ``listed`` (a listing older than the stored one changes
    nothing) and take ``dropped`` (node id, when its heartbeat unlisted it) off. A node not listed yet is
    added only while fewer than ``max_listings`` are; edges that add at the same moment may overshoot, and
    the last listed go first."""
    # Every edge forgets the same expired rows: SKIP LOCKED (PostgreSQL) leaves a row another edge is deleting
    # to that edge instead of waiting on it inside a batch that holds other locks (a deadlock to retry).
    conn.execute("DELETE FROM swarm_listings WHERE node_id IN "
                 "(SELECT node_id FROM swarm_listings WHERE seen_ms < ? /*SKIP LOCKED*/)", (now_ms - ttl_ms,))
    if dropped:
        conn.executemany("DELETE FROM swarm_listings WHERE node_id = ? AND seen_ms <= ?", dropped)
    if listed:
        known = _present(conn, "SELECT node_id FROM swarm_listings WHERE node_id IN ({marks})", [x[0] for x in listed])
        room = max_listings - int(conn.execute("SELECT COUNT(*) FROM swarm_listings").fetchone()[0])
        rows = []
        for node_id, peer_id, addrs, versions, seen_ms in sorted(listed):  # rows locked in key order
            if node_id not in known:
                if room <= 0:
                    continue
                room -= 1
            rows.append((node_id, peer_id, json.dumps(list(addrs)), json.dumps(list(versions)), seen_ms, seen_ms))
        conn.executemany(
            "INSERT INTO swarm_listings(node_id, peer_id, addrs, versions, listed_ms, seen_ms) VALUES(?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(node_id) DO UPDATE SET peer_id = excluded.peer_id, addrs = excluded.addrs, "
            "versions = excluded.versions, seen_ms = excluded.seen_ms WHERE excluded.seen_ms >= swarm_listings.seen_ms",
            rows)
    over = int(conn.execute("SELECT COUNT(*) FROM swarm_listings").fetchone()[0]) - max_listings
    if over > 0:
        conn.execute("DELETE FROM swarm_listings WHERE node_id IN "
                     "(SELECT node_id FROM swarm_listings ORDER BY listed_ms DESC, node_id DESC LIMIT ?)", (over,))


def refresh_swarm_listings(conn: sqlite3.Connection, node_ids: list[str], seen_ms: int) -> None:
    """Nodes whose listing did not change beat again: seen at ``seen_ms``, in one statement."""
    if node_ids:
        node_ids = sorted(node_ids)
        conn.execute(f"UPDATE swarm_listings SET seen_ms = ? WHERE seen_ms < ? AND node_id IN ({','.join('?' * len(node_ids))})",
                     (seen_ms, seen_ms, *node_ids))


def write_swarm_reports(conn: sqlite3.Connection, reported: list[SwarmReport], now_ms: int, ttl_ms: int,
                        max_peers: int, per_peer: int) -> None:
    """Forget reports older than ``ttl_ms``; add ``reported``, about at most ``max_peers`` peers (the last
    reported go first when edges overshoot together), keeping each peer's ``per_peer`` newest networks."""
    conn.execute("DELETE FROM swarm_reports WHERE (peer_id, network) IN "
                 "(SELECT peer_id, network FROM swarm_reports WHERE reported_ms <= ? /*SKIP LOCKED*/)", (now_ms - ttl_ms,))
    if not reported:
        return
    peers = list(dict.fromkeys(x[0] for x in reported))
    known = _present(conn, "SELECT DISTINCT peer_id FROM swarm_reports WHERE peer_id IN ({marks})", peers)
    room = max_peers - int(conn.execute("SELECT COUNT(DISTINCT peer_id) FROM swarm_reports").fetchone()[0])
    for peer in peers:
        if peer not in known and room > 0:
            known.add(peer)
            room -= 1
    conn.executemany(
        "INSERT INTO swarm_reports(peer_id, network, reported_ms) VALUES(?, ?, ?) ON CONFLICT(peer_id, network) "
        "DO UPDATE SET reported_ms = excluded.reported_ms WHERE excluded.reported_ms > swarm_reports.reported_ms",
        [x for x in reported if x[0] in known])
    conn.executemany("DELETE FROM swarm_reports WHERE peer_id = ? AND network NOT IN (SELECT network FROM swarm_reports "
                     "WHERE peer_id = ? ORDER BY reported_ms DESC, network LIMIT ?)",
                     [(peer, peer, per_peer) for peer in peers if peer in known])
    over = int(conn.execute("SELECT COUNT(DISTINCT peer_id) FROM swarm_reports").fetchone()[0]) - max_peers
    if over > 0:
        conn.execute("DELETE FROM swarm_reports WHERE peer_id IN (SELECT peer_id FROM swarm_reports GROUP BY peer_id "
                     "ORDER BY MIN(reported_ms) DESC, peer_id DESC LIMIT ?)", (over,))


def swarm_directory(conn: sqlite3.Connection, now_ms: int, ttl_ms: int,
                    max_listings: int) -> tuple[list[SwarmListing], list[SwarmReport]]:
    """Every edge's listings seen within ``ttl_ms`` (at most ``max_listings``) and every stored report."""
    listings = [(r[0], r[1], tuple(json.loads(r[2])), tuple(json.loads(r[3])), int(r[4])) for r in conn.execute(
        "SELECT node_id, peer_id, addrs, versions, seen_ms FROM swarm_listings WHERE seen_ms >= ? "
        "ORDER BY listed_ms, node_id LIMIT ?", (now_ms - ttl_ms, max_listings))]
    reports = [(r[0], r[1], int(r[2])) for r in conn.execute("SELECT peer_id, network, reported_ms FROM swarm_reports")]
    return listings, reports


def exchange_swarm_directory(conn: sqlite3.Connection, listed: list[SwarmListing], seen: list[str],
                             dropped: list[tuple[str, int]], reported: list[SwarmReport], *, seen_ms: int, now_ms: int,
                             listing_ttl_ms: int, report_ttl_ms: int, max_listings: int,
                             reports_per_peer: int) -> tuple[list[SwarmListing], list[SwarmReport]]:
    """One edge's exchange (``PeerDirectory.share``): write what its heartbeats said (new or changed listings
    whole, the nodes in ``seen`` only seen again at ``seen_ms``), then read every edge's."""
    refresh_swarm_listings(conn, seen, seen_ms)
    write_swarm_listings(conn, listed, dropped, now_ms, listing_ttl_ms, max_listings)
    write_swarm_reports(conn, reported, now_ms, report_ttl_ms, max_listings, reports_per_peer)
    return swarm_directory(conn, now_ms, listing_ttl_ms, max_listings)
