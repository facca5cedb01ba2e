"""SQLite under the store's named operations: a file in WAL mode with full fsync, the default database.

:class:`SqliteConnection` is ``sqlite3.Connection`` itself (statements run on its C methods, at no cost over
a plain connection) with what ``pg.PgConnection`` answers too, so the operations ask the connection what the
database can do instead of checking its type.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from veriroll.coordinator.store import schema
from veriroll.coordinator.store.pg import Result, StoreUnavailable

T = TypeVar("T")

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


def unavailable(exc: sqlite3.Error) -> StoreUnavailable | None:
    """``exc`` as the :class:`StoreUnavailable` it amounts to (see :data:`SQLITE_UNAVAILABLE`), or None for an
    error of the operation itself."""
    why = SQLITE_UNAVAILABLE.get((getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF)
    if why is None:
        return None
    out = StoreUnavailable(f"{why}: {exc}; nothing of this operation was committed")
    out.__cause__ = exc
    return out


class SqliteConnection(sqlite3.Connection):
    """A SQLite connection that answers what ``pg.PgConnection`` answers about its database."""

    writable_ctes = False
    """SQLite has no data-modifying CTEs: an operation of several writes is several statements (each a call
    into the library, no round trip)."""

    round_trips = None
    """Waits on a server so far: none, SQLite has no server."""

    def execute_together(self, statements: list[tuple[str, tuple]]) -> list[Result]:
        """Statements none of which depends on another's result, one after another; their results (rows
        fetched, rowcount), as ``PgConnection.execute_together`` gives them."""
        out = []
        for sql, params in statements:
            cur = self.execute(sql, params)
            out.append(Result(cur.fetchall(), cur.rowcount))
        return out

    @staticmethod
    def rows_source(rows: list[tuple], types: tuple[str, ...]) -> tuple[str, list]:
        """``rows`` as the source of an ``INSERT`` and its parameters: ``VALUES (?, ...), ...``, flattened
        (``types`` are PostgreSQL's, which SQLite does not need)."""
        marks = "(" + ", ".join(["?"] * len(types)) + ")"
        return "VALUES " + ", ".join([marks] * len(rows)), [v for row in rows for v in row]

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[SqliteConnection]:
        """The block's reads in one transaction: one consistent snapshot of the file (WAL). Committed even
        when the block raises, as it only read."""
        self.execute("BEGIN")
        try:
            yield self
        finally:
            self.execute("COMMIT")

    def read(self, fn: Callable[[SqliteConnection], T], *, probe: bool = True) -> T:
        """``fn(self)``, a read (``probe`` is PostgreSQL's: a read of one statement needs no transaction here
        either); the machine's errors raised as :class:`StoreUnavailable`."""
        try:
            return fn(self)
        except sqlite3.Error as exc:
            gone = unavailable(exc)
            if gone is None:
                raise
            raise gone from exc


def connect(path: str | Path) -> SqliteConnection:
    """Open a SQLite file with the settings veriroll relies on (WAL, full fsync), its schema made or brought
    up to date."""
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0,
                           factory=SqliteConnection)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    # FULL: a transaction is on disk when COMMIT returns, so "accepted" survives power loss too.
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA busy_timeout=30000")
    # The writer runs each op in a SAVEPOINT, whose undo journal SQLite otherwise keeps in a temporary
    # file created and unlinked per transaction (~6 file syscalls and a write per page). It only undoes
    # a failed op inside a transaction: crash recovery is the WAL's, so memory loses nothing.
    conn.execute("PRAGMA temp_store=MEMORY")
    conn.executescript(schema.SQLITE_SCHEMA)
    conn.executescript(schema.VERIFY_JOBS_TABLE)
    conn.executescript(schema.SWARM_TABLES)
    conn.executescript(schema.SQLITE_STANDING_CHANGES)
    if conn.execute("SELECT 1 FROM counters WHERE name = 'queued_groups'").fetchone() is None:
        conn.execute(schema.SQLITE_INIT_QUEUED_GROUPS)
    if "probation" not in {r["name"] for r in conn.execute("PRAGMA table_info(leases)")}:
        # A database from before probation caps: its open leases count as trusted ones.
        conn.execute("ALTER TABLE leases ADD COLUMN probation INTEGER NOT NULL DEFAULT 0")
    node_columns = {r["name"] for r in conn.execute("PRAGMA table_info(nodes)")}
    for column, declaration in schema.SESSION_COLUMNS.items():
        if column not in node_columns:  # a database from before sessions: no key has a live one
            conn.execute(f"ALTER TABLE nodes ADD COLUMN {column} {declaration}")
    conn.executescript(schema.SQLITE_LEASE_COUNTERS)
    if conn.execute("SELECT COUNT(*) FROM counters WHERE name IN ('open_leases', 'open_probation_leases')").fetchone()[0] < 2:
        conn.executescript("BEGIN IMMEDIATE;" + schema.SQLITE_INIT_LEASE_COUNTERS + "COMMIT;")
    if conn.execute("SELECT 1 FROM counters WHERE name = 'prompts_drawn'").fetchone() is None:
        conn.executescript("BEGIN IMMEDIATE;" + schema.SQLITE_INIT_DRAW_COUNTER + "COMMIT;")
    return conn
