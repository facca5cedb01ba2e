"""The store's one writer: every operation on the coordinator's state goes through :class:`Database`.

Operations queued while a transaction is running are committed together with it (group commit), so a busy
intake pays one fsync (one COMMIT) for many accepted groups, and every caller is answered only after its
transaction is on disk: a node is told "accepted" only once the group is durable. Reads go to a reader
connection of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from veriroll.coordinator.store import pg, sqlite
from veriroll.coordinator.store.pg import Result, StoreUnavailable

T = TypeVar("T")
A = TypeVar("A")
DB_ERRORS: tuple[type[BaseException], ...] = (sqlite3.Error, *pg.errors())

Connection = sqlite.SqliteConnection | pg.PgConnection
"""What an operation is handed: either database's connection, which answer the same questions about it."""


def database_target(base_dir: Path, value: str) -> str | Path:
    """Where ``database`` in a coordinator's config points: a ``postgresql://`` URL as it is, a SQLite file
    relative to the coordinator's directory."""
    if pg.is_url(value):
        return value
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path


def connect(path: str | Path) -> Connection:
    """Open the database: a SQLite file with the settings veriroll relies on (WAL, full fsync, ``sqlite.py``),
    or a ``postgresql://`` URL (``pg.py``)."""
    if pg.is_url(path):
        return pg.connect(path)
    return sqlite.connect(path)


def execute_together(conn: Connection, statements: list[tuple[str, tuple]]) -> list[Result]:
    """Statements none of which depends on another's result, in order; their results (rows fetched, rowcount).
    On PostgreSQL in one round trip (``PgConnection.execute_together``); on SQLite one after another."""
    return conn.execute_together(statements)


def read_transaction(conn: Connection):
    """A context manager: one consistent snapshot for several reads on a reader connection (on PostgreSQL,
    ``Database`` reads run in one already: the block joins it)."""
    return conn.snapshot()


@dataclass
class _Op:
    fn: Callable[[Connection], Any]
    future: concurrent.futures.Future | asyncio.Future
    # Set for callers on an event loop: their asyncio future is settled on that loop, all of a batch's
    # futures in one wake-up (cheaper than a concurrent future chained to an asyncio one per op).
    loop: asyncio.AbstractEventLoop | None = None
    # (many, arg) for an op of Database.run_together: the batch's ops of one ``many`` run as one call of it.
    together: tuple[Callable[[Connection, list], list], Any] | None = None

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


def unavailable(exc: BaseException) -> StoreUnavailable | None:
    """``exc`` as the :class:`StoreUnavailable` it amounts to (the store cannot take any operation now, through
    no fault of the operation: the server gone or silent, a full disk, an I/O error, a read-only file), or
    None for an error of the operation itself. (``PgConnection`` raises PostgreSQL's as StoreUnavailable
    already; SQLite's are mapped here, ``sqlite.SQLITE_UNAVAILABLE``.)"""
    if isinstance(exc, StoreUnavailable):
        return exc
    if isinstance(exc, sqlite3.Error):
        return sqlite.unavailable(exc)
    return None


def _not_the_ops_fault(exc: BaseException) -> bool:
    """An error on which a batch fails (or runs again) whole rather than an op alone: a deadlock PostgreSQL
    broke (run again, see ``_commit``), the store unavailable, or an interrupt."""
    return pg.is_transient(exc) or unavailable(exc) is not None or not isinstance(exc, Exception)


class Database:
    """Serializes every operation on one connection in one thread, committing queued work together.

    An op that raises is undone alone and its caller gets the exception, while the rest of its batch
    commits (see :meth:`_transaction`). One writer: SQLite has a single write lock, and on PostgreSQL
    more writer connections per process measured slower (GIL hand-offs between the threads cost more
    than the round trips they overlap: 283 groups/s with one, 253 with two, 213 with eight).
    """

    MAX_BATCH = 512

    def __init__(self, path: str | Path):
        self.path = path if pg.is_url(path) else Path(path)
        self.conn = connect(self.path)
        self._q: queue.Queue[_Op | tuple[_Op, ...] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="veriroll-db", daemon=True)
        self._closed = False
        self._closing = threading.Lock()
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="veriroll-db-read")
        self._local = threading.local()
        self._reader_conns: list[Connection] = []
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
        return self.conn.round_trips

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
                if not (pg.is_transient(exc) and attempt < TRANSIENT_RETRIES):
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

    def read(self, fn: Callable[[Connection], T]) -> concurrent.futures.Future:
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
        return conn.read(fn, probe=probe)

    async def run_read(self, fn: Callable[[Connection], T], *, inline: bool = False) -> T:
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

    def submit(self, fn: Callable[[Connection], T]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._enqueue(_Op(fn, fut))
        return fut

    def run_sync(self, fn: Callable[[Connection], T]) -> T:
        return self.submit(fn).result()

    async def run(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in the writer's next transaction; returns once that transaction is committed."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._enqueue(_Op(fn, fut, loop))
        return await fut

    async def run_together(self, many: Callable[[Connection, list[A]], list[T]], arg: A) -> T:
        """``many(conn, [arg])[0]`` in the writer's next transaction, as :meth:`run`; the calls of one ``many``
        that share a transaction run as one call, ``many(conn, [their args])`` (one statement and one round
        trip for all of them, where :meth:`run` would take one each). ``many`` returns a result per arg, in
        order, and must give each the result it would have had alone, first to last."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._enqueue(_Op(lambda conn: many(conn, [arg])[0], fut, loop, (many, arg)))
        return await fut

    async def run_chain(self, first: Callable[[Connection], T],
                        then: Callable[[Connection, T], Any]) -> tuple[T, Any, Exception | None]:
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
        statement PostgreSQL has not answered yet, see ``pg.ANSWER_TIMEOUT_S``): the caller leaves them
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

