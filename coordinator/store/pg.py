"""PostgreSQL under the store's named operations (psycopg 3), for coordinators that outgrow one SQLite file.

The operations (``nodes.py``, ``leases.py``, ...) are written once, in the SQL both databases speak (``?`` placeholders,
``INSERT ... ON CONFLICT``, ``UPDATE ... RETURNING``); :class:`PgConnection` runs them on PostgreSQL:
placeholders become ``$1, $2, ...``, SQLite's ``BEGIN IMMEDIATE`` becomes ``BEGIN``, each statement is
prepared on the server once per session and run on libpq directly, and rows answer by name and by position
like ``sqlite3.Row``. The schema is the same tables with PostgreSQL's types (``schema.py``), and the
counters (queued groups, open leases) are kept by PL/pgSQL triggers in the same transaction as the
change, as SQLite's triggers keep them, but split in one row per writer (see ``COUNTER_SLOTS``;
``/*SLOT*/`` in a statement picks the writer's row): on SQLite one writer holds the only lock anyway, here
every edge process writes at once. Reads see one snapshot (``PgConnection.read``).

Guarantees are today's: the store's writer commits a batch of operations in one transaction and
answers its callers only after COMMIT returned (``synchronous_commit`` on, PostgreSQL's default), so
"accepted" means durable.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import select
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from veriroll.coordinator.store.schema import COUNTER_SLOTS, POSTGRES_SCRIPTS
from veriroll.protos.errors import VerirollError

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg import pq
    from psycopg.adapt import PyFormat, Transformer
    from psycopg.conninfo import conninfo_to_dict
except ImportError:  # only a coordinator configured with a postgresql:// database needs it
    psycopg = None

URL = re.compile(r"^postgres(ql)?://")
T = TypeVar("T")

SLOT_LOCK = 7_294_018
"""First key of the session advisory locks ``(SLOT_LOCK, slot)`` that hold a claimed slot until the
connection closes (or dies: the server drops a lost session's locks, and the slot is free again)."""

CLAIM_SLOT = (f"SELECT set_config('veriroll.counter_slot', slot::text, false) "
              f"FROM generate_series(0, {COUNTER_SLOTS - 1}) AS slot "
              f"WHERE pg_try_advisory_lock({SLOT_LOCK}, slot) LIMIT 1")
"""Lock the first free slot for this session and set it where ``veriroll_counter_slot()`` reads it; no row
when every slot is held. Run outside a transaction: a SET undone by a ROLLBACK would leave the lock held."""

SCHEMA_LOCK = 7_294_017  # pg_advisory_xact_lock key: processes starting together create the schema once


def is_url(target) -> bool:
    return isinstance(target, str) and bool(URL.match(target))


class Row:
    """A result row that answers by column name and by position, like ``sqlite3.Row`` (``dict(row)`` works)."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[str, int], values):
        self._index, self._values = index, values

    def __getitem__(self, key):
        return self._values[self._index[key]] if isinstance(key, str) else self._values[key]

    def keys(self) -> list[str]:
        return list(self._index)

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Row({dict(zip(self._index, self._values, strict=True))!r})"


@functools.lru_cache(maxsize=1024)
def _row_maker(names: tuple[bytes, ...]):
    index = {n.decode(): i for i, n in enumerate(names)}
    return lambda values: Row(index, values)


def _result_row_maker(res):
    """One row maker per distinct set of column names, read straight from the result."""
    return _row_maker(tuple(res.fname(i) or b"" for i in range(res.nfields)))


def _row_factory(cursor):
    # For statements run through psycopg's cursors (executemany, the schema): the same rows as ``Result``'s.
    res = cursor.pgresult
    return _result_row_maker(res) if res is not None else _row_maker(())


@functools.lru_cache(maxsize=4096)
def translate(sql: str) -> str:
    """SQLite's dialect of the store's statements, as PostgreSQL reads them through psycopg (``%s``)."""
    if sql.strip().upper() == "BEGIN IMMEDIATE":
        return "BEGIN"
    return (sql.replace("?", "%s").replace("/*SKIP LOCKED*/", "FOR UPDATE SKIP LOCKED")
            .replace("/*SLOT*/", "AND slot = veriroll_counter_slot()"))


@functools.lru_cache(maxsize=4096)
def statement(sql: str) -> bytes:
    """SQLite's dialect of a statement as PostgreSQL's protocol takes it: ``$1, $2, ...`` placeholders."""
    parts = translate(sql).split("%s")
    return "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)).encode() + parts[-1].encode()


PREPARED_MAX = 512
"""Server-side prepared statements one connection keeps (a statement's text and its parameters' types name
one). The store's statements are a fixed set, but a few build an ``IN (?, ?, ...)`` list of varying length:
past this many, a statement runs unprepared (parsed and planned each time), so their number stays bounded."""

_TEXT, _BINARY = 0, 1
_INT8, _FLOAT8, _BOOL, _BYTEA, _UNKNOWN = 20, 701, 16, 17, 0


def dump_params(params, tx) -> tuple[list, tuple[int, ...], list[int]]:
    """Parameter values, their type OIDs and formats for the store's types: ints as BIGINT (psycopg's cursor
    picks the smallest type that holds the value, which would make a prepared statement per combination of
    sizes; a function that takes an INTEGER needs a CAST in the statement), floats as DOUBLE PRECISION, bools
    as BOOLEAN, strings untyped (the server takes the column's type), bytes as binary BYTEA; anything else
    through psycopg's own dumpers (``tx``)."""
    values: list = []
    types: list[int] = []
    formats: list[int] = []
    for p in params:
        if p is None:
            values.append(None), types.append(_UNKNOWN), formats.append(_TEXT)
        elif isinstance(p, bool):
            values.append(b"t" if p else b"f"), types.append(_BOOL), formats.append(_TEXT)
        elif isinstance(p, int):
            values.append(b"%d" % p), types.append(_INT8), formats.append(_TEXT)
        elif isinstance(p, str):
            values.append(str.encode(p)), types.append(_UNKNOWN), formats.append(_TEXT)
        elif isinstance(p, float):
            values.append(float.__repr__(p).encode()), types.append(_FLOAT8), formats.append(_TEXT)
        elif isinstance(p, (bytes, bytearray, memoryview)):
            values.append(bytes(p)), types.append(_BYTEA), formats.append(_BINARY)
        else:
            dumper = tx.get_dumper(p, PyFormat.TEXT)
            values.append(dumper.dump(p)), types.append(dumper.oid), formats.append(_TEXT)
    return values, tuple(types), formats


class Result:
    """What one statement answered, read like a cursor: ``fetchone``, ``fetchall``, iteration, ``rowcount``
    (rows returned by a query; rows changed by INSERT / UPDATE / DELETE), ``description`` (column names first)."""

    __slots__ = ("_rows", "_next", "rowcount", "_res")

    def __init__(self, rows: list, rowcount: int, res=None):
        self._rows, self._next, self.rowcount, self._res = rows, 0, rowcount, res

    @property
    def description(self) -> list[tuple] | None:
        res = self._res
        if res is None or res.status != TUPLES_OK:
            return None
        return [((res.fname(i) or b"").decode(), res.ftype(i), None, None, None, None, None)
                for i in range(res.nfields)]

    def fetchone(self):
        if self._next >= len(self._rows):
            return None
        self._next += 1
        return self._rows[self._next - 1]

    def fetchall(self) -> list:
        rows, self._next = self._rows[self._next:], len(self._rows)
        return rows

    def __iter__(self):
        return iter(self.fetchall())


TUPLES_OK = pq.ExecStatus.TUPLES_OK if psycopg is not None else None
PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC if psycopg is not None else None
ANSWERED = (frozenset({pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK, pq.ExecStatus.EMPTY_QUERY})
            if psycopg is not None else frozenset())

SNAPSHOT_BEGIN = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"


class _SnapshotNeeded(BaseException):
    """A read probed outside a snapshot issued its second statement (see ``PgConnection.read``). A
    BaseException, like GeneratorExit: control flow that a read's own ``except Exception`` must not catch."""


class StoreUnavailable(VerirollError):
    """The PostgreSQL server cannot be reached now (restarting, stopped, network): the statement was not run,
    or its transaction was rolled back, or (the connection lost during COMMIT) it is unknown whether it
    committed; the store's operations are safe to retry (a group submitted again is answered as the first
    time). Callers answer "unavailable, retry"; the connection reopens by itself."""


RECONNECT_EVERY_S = 0.5
"""While the server is down, a new connection is tried at most this often: every statement in between
fails at once rather than waiting on a connect."""

ANSWER_TIMEOUT_S = 30.0
"""The longest the store waits on PostgreSQL for one answer (a statement's, a pipeline's, a prepare's). The
store's statements take milliseconds; a server that answers nothing for this long (hung, stopped, a
network path that drops packets without a reset, where TCP would wait for hours) gets the connection
closed and StoreUnavailable, as a restart does, instead of a thread blocked on it for good."""

CONNECT_TIMEOUT_S = 10
"""libpq's ``connect_timeout`` when the URL sets none: a new connection to a server that accepts and then
says nothing fails after this long instead of never."""


class _NoAnswer(Exception):
    """PostgreSQL said nothing within ANSWER_TIMEOUT_S."""


class PgConnection:
    """The part of ``sqlite3.Connection`` the store uses, on one psycopg connection in autocommit mode
    (transactions are the store's own BEGIN / SAVEPOINT / COMMIT statements).

    When the server goes away (a restart closes every session) the statement raises
    :class:`StoreUnavailable`; the connection is opened again on a later statement, but only one that
    starts afresh (BEGIN, or any statement outside a transaction): a statement of a transaction that died
    with the old connection must never run on the new one, outside that transaction.

    What differs between the databases is answered here and by ``sqlite.SqliteConnection`` alike (the
    operations ask the connection, never its type): :meth:`execute_together`, :meth:`read`, :meth:`snapshot`,
    :meth:`rows_source`, :attr:`writable_ctes`, :attr:`round_trips`.
    """

    writable_ctes = True
    """Data-modifying CTEs: an operation of several writes can be one statement, and so one round trip
    (``leases.lease_one``, ``groups.accept_group``)."""

    def __init__(self, url: str):
        if psycopg is None:
            raise RuntimeError("a postgresql:// database needs psycopg: pip install 'veriroll[postgres]'")
        self._url = url
        self._in_transaction = False
        self._next_attempt = 0.0
        self._conn = self._open()
        self._tx = Transformer(self._conn)
        self._prepared: dict[tuple[str, tuple[int, ...]], bytes] = {}  # on self._conn: see PREPARED_MAX
        self._slot_claimed_on = None  # the psycopg connection (session) that claimed a counter slot
        self.statements = 0  # statements run on this connection so far (a BEGIN when it is run, not sent)
        self.round_trips = 0  # waits on the server so far (a pipeline of statements is one)
        self._alone_until = float("inf")  # see read(): the last statement a read may run outside a snapshot
        self._begin: str | None = None  # a BEGIN not sent yet: it goes with its transaction's first statement

    def _open(self):
        extra = {} if "connect_timeout" in conninfo_to_dict(self._url) else {"connect_timeout": CONNECT_TIMEOUT_S}
        try:
            return psycopg.connect(self._url, autocommit=True, row_factory=_row_factory, **extra)
        except psycopg.OperationalError as exc:
            self._next_attempt = time.monotonic() + RECONNECT_EVERY_S
            raise StoreUnavailable(f"PostgreSQL is unreachable: {first_line(exc)}") from exc

    def _usable(self, sql: str):
        """The connection to run ``sql`` on, reopened if it broke and ``sql`` may start afresh."""
        bound = transaction_bound(sql)
        was_in = self._in_transaction and bound != "begin"
        if bound is not None:
            self._in_transaction = bound == "begin"
        if not (self._conn.broken or self._conn.closed):
            return self._conn
        if was_in:
            raise StoreUnavailable("the connection to PostgreSQL was lost during this transaction; it was rolled back")
        now = time.monotonic()
        if now < self._next_attempt:
            raise StoreUnavailable("PostgreSQL is unreachable; reconnecting")
        self._conn = self._open()
        self._tx, self._prepared = Transformer(self._conn), {}  # a new session has no prepared statements
        return self._conn

    def _run(self, sql: str, run):
        self.statements += 1
        self.round_trips += 1
        if self.statements > self._alone_until:
            raise _SnapshotNeeded
        conn = self._usable(sql)
        try:
            if self._slot_claimed_on is not conn and sql.strip().upper() == "BEGIN IMMEDIATE":
                # A writer's first transaction on this session: claim it a counter slot (see COUNTER_SLOTS).
                self._slot_claimed_on = conn
                conn.execute(CLAIM_SLOT)
            return run(conn)
        except _NoAnswer:
            # What was sent may or may not run: the session goes, and with it any transaction it was in (the
            # transaction stays marked until its COMMIT/ROLLBACK, as for a lost connection).
            conn.close()
            raise StoreUnavailable(f"PostgreSQL did not answer within {ANSWER_TIMEOUT_S:.0f} s; the connection was "
                                   f"closed") from None
        except psycopg.Error as exc:
            if conn.broken or conn.closed:  # the transaction, if any, stays marked until its COMMIT/ROLLBACK
                raise StoreUnavailable(f"the connection to PostgreSQL was lost: {first_line(exc)}") from exc
            why = unavailable_reason(exc)
            if why is not None:  # the transaction, if any, is aborted: the caller's ROLLBACK ends it
                raise StoreUnavailable(f"{why}: {first_line(exc)}") from exc
            raise

    @property
    def in_transaction(self) -> bool:
        """A BEGIN ran (or waits to go with the next statement) and no COMMIT or ROLLBACK yet."""
        return self._in_transaction or self._begin is not None

    def execute(self, sql: str, params=()) -> Result:
        bound = transaction_bound(sql)
        if bound == "begin" and not params and not self.in_transaction:
            # Sent with the transaction's first statement, in one pipeline: a round trip fewer per transaction
            # (PostgreSQL takes no lock and no snapshot at BEGIN; both come with the first statement anyway).
            self._begin = sql
            self.statements += 1
            return Result([], 0)
        if self._begin is not None:
            if bound == "end":  # nothing ran in the transaction: nothing to commit or roll back
                self._begin = None
                return Result([], 0)
            return self.execute_together([(sql, params)])[0]
        return self._run(sql, lambda conn: self._execute(conn, sql, params))

    def _execute(self, conn, sql: str, params) -> Result:
        """One statement on libpq directly, prepared on the server after its first run: psycopg's cursor
        spends ~50 us of Python per statement on its generic path (query conversion, cursor state, waiting
        generators) where this spends ~20, and an edge on PostgreSQL runs about twenty statements a group.
        Types and errors are psycopg's (its dumpers for uncommon types, its loaders, its exception classes)."""
        pg = conn.pgconn
        if not params:
            pg.send_query(statement(sql))
        else:
            values, types, formats = dump_params(params, self._tx)
            name = self._prepared_name(pg, sql, types)
            if name is None:
                pg.send_query_params(statement(sql), values, types, formats)
            else:
                pg.send_query_prepared(name, values, formats)
        res = _last(self._answers(pg))
        self._check(res)
        return self._result(res)

    def _answers(self, pg, *, pipeline: bool = False) -> list:
        """The results of what was sent on ``pg`` (libpq's asynchronous calls, as a blocking call would run them
        but for the wait): sent, then read until the server said all (in pipeline mode: up to the pipeline's
        sync, past the end of each statement's results), with the GIL released while waiting and no wait
        longer than ANSWER_TIMEOUT_S (_NoAnswer)."""
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while pg.flush():  # the connection does not block: wait until it can write
            _wait(pg, deadline, write=True)
        results = []
        while True:
            while pg.is_busy():
                _wait(pg, deadline)
                pg.consume_input()
            res = pg.get_result()
            if res is None:
                if pipeline:  # the end of one statement's results
                    continue
                return results
            if pipeline and res.status == PIPELINE_SYNC:
                return results
            results.append(res)

    def _prepared_name(self, pg, sql: str, types: tuple[int, ...]) -> bytes | None:
        """The server-side name of ``sql`` with parameters of ``types`` on this session, prepared now if it is
        new; None past PREPARED_MAX (run it unprepared)."""
        key = (sql, types)
        name = self._prepared.get(key)
        if name is None and len(self._prepared) < PREPARED_MAX:
            name = b"veriroll_%d" % len(self._prepared)
            pg.send_prepare(name, statement(sql), types)
            self._check(_last(self._answers(pg)))
            self._prepared[key] = name
        return name

    def execute_together(self, statements: list[tuple[str, tuple]]) -> list[Result]:
        """Statements none of which depends on another's result, in order, in one round trip (libpq's pipeline
        mode): the store's writer pays a wait on PostgreSQL, and a hand-off of the GIL on its way back, once
        for all of them instead of once each. The first that fails raises (the ones after it did not run)."""
        if self._begin is not None:  # the transaction's BEGIN goes first, in the same round trip
            begin, self._begin = self._begin, None
            self.statements += len(statements) - 1  # (the BEGIN was counted when it was run)
            return self._run(begin, lambda conn: self._pipeline(conn, [(begin, ()), *statements]))[1:]
        self.statements += len(statements) - 1
        return self._run(statements[0][0], lambda conn: self._pipeline(conn, statements))

    def _pipeline(self, conn, statements: list[tuple[str, tuple]]) -> list[Result]:
        pg = conn.pgconn
        sends = []
        for sql, params in statements:  # prepared first, outside the pipeline (a few statements, once a session)
            values, types, formats = dump_params(params, self._tx)
            sends.append((self._prepared_name(pg, sql, types), statement(sql), values, types, formats))
        pg.enter_pipeline_mode()
        try:
            for name, stmt, values, types, formats in sends:
                if name is None:
                    pg.send_query_params(stmt, values, types, formats)
                else:
                    pg.send_query_prepared(name, values, formats)
            pg.pipeline_sync()
            results = self._answers(pg, pipeline=True)
        finally:
            if pg.pipeline_status != pq.PipelineStatus.OFF and not conn.broken:
                try:
                    pg.exit_pipeline_mode()
                except psycopg.Error:  # results left uncollected (an error or a cancel mid-way): the session
                    conn.close()       # cannot be trusted; the next statement that may start afresh reopens it
        out = []
        for res in results:  # the failed one raises; those after it are PIPELINE_ABORTED, never reached
            self._check(res)
            out.append(self._result(res))
        return out

    def _result(self, res) -> Result:
        if res.status == TUPLES_OK:
            tx = self._tx
            tx.set_pgresult(res)
            rows = tx.load_rows(0, res.ntuples, _result_row_maker(res))
            return Result(rows, len(rows), res)
        return Result([], res.command_tuples or 0, res)

    def _check(self, res) -> None:
        if res.status not in ANSWERED:  # FATAL_ERROR (the statement failed) or BAD_RESPONSE
            raise pg_errors.error_from_result(res, encoding=self._conn.info.encoding)

    def executemany(self, sql: str, seq):
        if self._begin is not None:  # psycopg's cursor runs the statements: the BEGIN goes on its own first
            begin, self._begin = self._begin, None
            self.statements -= 1  # (counted when it was run)
            self._run(begin, lambda conn: self._execute(conn, begin, ()))

        def run(conn):
            cur = conn.cursor()
            cur.executemany(translate(sql), list(seq))
            return cur
        return self._run(sql, run)

    @staticmethod
    def rows_source(rows: list[tuple], types: tuple[str, ...]) -> tuple[str, list]:
        """``rows`` as the source of an ``INSERT`` and its parameters: ``SELECT * FROM unnest(?::type[], ...)``
        with one array per column (``types``: PostgreSQL's), so one statement text, and one prepared
        statement, whatever the number of rows."""
        return ("SELECT * FROM unnest(" + ", ".join(f"?::{t}[]" for t in types) + ")",
                [[row[i] for row in rows] for i in range(len(types))])

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[PgConnection]:
        """The block's statements in one REPEATABLE READ READ ONLY transaction: they see the database as of
        its first statement (under READ COMMITTED, PostgreSQL's default, each statement sees every commit
        made before it started, so a read of several tables could straddle another edge's commit). Inside
        a transaction already, the block joins it."""
        if self._alone_until != float("inf"):
            raise _SnapshotNeeded  # a read probed outside one (see read) asks for it: read begins it
        if self.in_transaction:
            yield self
            return
        try:
            self.execute(SNAPSHOT_BEGIN)
            yield self
        except BaseException:
            # The error to report is the block's (or BEGIN's); the ROLLBACK also ends the transaction this
            # connection counts itself in, so that its next statement may reconnect.
            with contextlib.suppress(*errors()):
                self.execute("ROLLBACK")
            raise
        self.execute("COMMIT")

    def read(self, fn: Callable[[PgConnection], T], *, probe: bool = True) -> T:
        """``fn(self)``, a read, with all its statements in one snapshot.

        Most reads on the serving path are one statement (a row by key), which is one snapshot by itself:
        with ``probe``, ``fn`` runs without BEGIN and COMMIT (two round trips more than such a read), until
        it issues a second statement; that one is not run, and ``fn`` starts again in a snapshot (its first
        statement then ran twice). Without ``probe`` (reads known to take several), the snapshot comes first.
        """
        if probe:
            self._alone_until = self.statements + 1
            try:
                return fn(self)
            except _SnapshotNeeded:
                pass
            finally:
                self._alone_until = float("inf")
        with self.snapshot():
            return fn(self)

    def close(self) -> None:
        self._conn.close()


def _wait(pg, deadline: float, *, write: bool = False) -> None:
    """Until ``pg``'s socket can be read (written), at most until ``deadline`` (then _NoAnswer)."""
    sock = [pg.socket]
    ready = select.select([] if write else sock, sock if write else [], [], max(0.0, deadline - time.monotonic()))
    if not (ready[0] or ready[1]):
        raise _NoAnswer


def _last(results: list):
    """What a blocking call answers for them: the first error, else the last result."""
    for res in results:
        if res.status not in ANSWERED:
            return res
    return results[-1]


@functools.lru_cache(maxsize=4096)
def transaction_bound(sql: str) -> str | None:
    """"begin" for a statement that opens a transaction, "end" for one that closes it (COMMIT, ROLLBACK;
    not ROLLBACK TO a savepoint), else None."""
    verb = sql.strip().upper()
    if verb == "BEGIN" or verb.startswith("BEGIN "):
        return "begin"
    return "end" if verb in ("COMMIT", "ROLLBACK") else None


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


SCHEMA_MARK = "veriroll schema " + hashlib.sha256("".join(POSTGRES_SCRIPTS).encode()).hexdigest()[:16]
"""Written as the comment of table ``nodes`` once ``schema.POSTGRES_SCRIPTS`` ran: a connection that finds it skips
the DDL. Running it again is harmless to the data but not to the processes working on it: ``CREATE INDEX IF
NOT EXISTS`` takes a SHARE lock on its table before it finds the index there, and ``ALTER TABLE ... IF NOT
EXISTS`` an exclusive one, so a connection opened mid-run (a reader, another edge) deadlocked with the
writer of another process that held row locks on two of those tables (seen in the edge-kill fault test)."""


def connect(url: str) -> PgConnection:
    """Open ``url`` and make sure the schema (tables, indexes, triggers, counters) is there."""
    conn = PgConnection(url)
    if schema_mark(conn) == SCHEMA_MARK:
        return conn
    conn.execute("BEGIN")
    try:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK,))
        if schema_mark(conn) != SCHEMA_MARK:  # else a process starting beside this one ran it meanwhile
            for script in POSTGRES_SCRIPTS:
                conn._conn.execute(script)
            conn._conn.execute(f"COMMENT ON TABLE nodes IS '{SCHEMA_MARK}'")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        conn.close()
        raise
    return conn


def schema_mark(conn: PgConnection) -> str | None:
    """The comment on table ``nodes``: :data:`SCHEMA_MARK` once this schema ran (None before any did)."""
    return conn.execute("SELECT obj_description(to_regclass('nodes'), 'pg_class')").fetchone()[0]


TRANSIENT_SQLSTATES = frozenset({"40P01", "40001"})
"""deadlock_detected and serialization_failure: PostgreSQL rolled the statement back to break a cycle of
waits between transactions (two edges' writers updating the same rows in different orders); the same
transaction run again goes through."""


UNAVAILABLE_SQLSTATES = {
    "53": "PostgreSQL is out of a resource (disk, memory or connections)",
    "58": "PostgreSQL reports a system error (I/O)",
    "25006": "the PostgreSQL server is read-only (a standby?)",
    "57P01": "PostgreSQL is shutting down",
    "57P02": "PostgreSQL is shutting down",
    "57P03": "PostgreSQL is not accepting connections yet",
}
"""Errors that are the server's state, not the statement's (by SQLSTATE, or its two-character class):
insufficient resources (a full disk, 53100), system errors (I/O, 58030), a read-only server, a shutdown.
They raise :class:`StoreUnavailable` (the caller answers "unavailable, retry"), never an internal error:
the same statement goes through once the operator has freed the disk or promoted the server."""


def unavailable_reason(exc: BaseException) -> str | None:
    """Why ``exc`` means the server cannot take the statement now (see ``UNAVAILABLE_SQLSTATES``), or None."""
    if psycopg is None or not isinstance(exc, psycopg.Error) or not exc.sqlstate:
        return None
    return UNAVAILABLE_SQLSTATES.get(exc.sqlstate) or UNAVAILABLE_SQLSTATES.get(exc.sqlstate[:2])


def is_transient(exc: BaseException) -> bool:
    """True for an error that running the whole transaction again resolves (see ``TRANSIENT_SQLSTATES``)."""
    return psycopg is not None and isinstance(exc, psycopg.Error) and exc.sqlstate in TRANSIENT_SQLSTATES


def errors() -> tuple[type[BaseException], ...]:
    """The exception types a PostgreSQL failure raises (for callers that catch database errors)."""
    return (StoreUnavailable,) if psycopg is None else (psycopg.Error, StoreUnavailable)
