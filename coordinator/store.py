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
import json
import queue
import sqlite3
import threading
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from itertools import dropwhile, islice
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

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
    ban_reason TEXT NOT NULL DEFAULT ''
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
    state TEXT NOT NULL DEFAULT 'open'
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

# Run after SCHEMA: a database from before the counter (or a fresh one) starts it from a full count,
# in one statement, so a group inserted concurrently is counted exactly once.
_INIT_COUNTERS = """
INSERT INTO counters(name, value)
SELECT 'queued_groups', (SELECT COUNT(*) FROM groups WHERE consumed_step IS NULL AND dropped IS NULL)
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'queued_groups')
"""

STANDINGS = ("probation", "trusted", "banned")


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_i32(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<i4")


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_f32(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.frombuffer(blob, dtype="<f4")


def connect(path: str | Path) -> sqlite3.Connection:
    """Open the database with the settings veriroll relies on (WAL, full fsync, foreign keys)."""
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30.0)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    # FULL: a transaction is on disk when COMMIT returns, so "accepted" survives power loss too.
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA busy_timeout=30000")
    conn.executescript(SCHEMA)
    if conn.execute("SELECT 1 FROM counters WHERE name = 'queued_groups'").fetchone() is None:
        conn.execute(_INIT_COUNTERS)
    return conn


@dataclass
class _Op:
    fn: Callable[[sqlite3.Connection], Any]
    future: concurrent.futures.Future | asyncio.Future
    # Set for callers on an event loop: their asyncio future is settled on that loop, all of a batch's
    # futures in one wake-up (cheaper than a concurrent future chained to an asyncio one per op).
    loop: asyncio.AbstractEventLoop | None = None

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


class Database:
    """Serializes every operation on one connection in one thread, committing queued work together.

    Each operation runs inside its own SAVEPOINT, so one that raises rolls back alone and reports its
    exception to its caller, while the rest of the batch commits.
    """

    MAX_BATCH = 512

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.conn = connect(self.path)
        self._q: queue.Queue[_Op | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="veriroll-db", daemon=True)
        self._closed = False
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="veriroll-db-read")
        self._local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._thread.start()

    def _loop(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.MAX_BATCH:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                batch.append(nxt)
            self._run_batch(batch)

    def _run_batch(self, batch: list[_Op]) -> None:
        # A caller that gave up (its call was cancelled, e.g. past its deadline) cancels its future while
        # the op waits in the queue: skip those ops. Once marked running, an op can no longer be
        # cancelled, so every op that runs is answered exactly once (a retry is then idempotent).
        batch = [op for op in batch if op.start()]
        if not batch:
            return
        results: list[tuple[_Op, bool, Any]] = []
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            for op in batch:
                self.conn.execute("SAVEPOINT op")
                try:
                    value = op.fn(self.conn)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller, not swallowed
                    self.conn.execute("ROLLBACK TO op")
                    self.conn.execute("RELEASE op")
                    results.append((op, False, exc))
                else:
                    self.conn.execute("RELEASE op")
                    results.append((op, True, value))
            self.conn.execute("COMMIT")
        except BaseException as exc:  # noqa: BLE001 - the whole batch failed to commit: tell everyone
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            _answer([(op, False, exc) for op in batch])
            return
        # Answer only after COMMIT returned: nothing is reported done before it is durable.
        _answer(results)

    def read(self, fn: Callable[[sqlite3.Connection], T]) -> concurrent.futures.Future:
        """Run a read-only ``fn`` on the reader connection: no write lock, no fsync, sees committed data."""
        if self._closed:
            raise RuntimeError("database is closed")
        return self._reader.submit(self._read_one, fn)

    def _read_one(self, fn):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = connect(self.path)
            self._reader_conns.append(conn)
        return fn(conn)

    async def run_read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``read`` for a coroutine: the result is set on the caller's loop directly."""
        if self._closed:
            raise RuntimeError("database is closed")
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

    def submit(self, fn: Callable[[sqlite3.Connection], T]) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("database is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(_Op(fn, fut))
        return fut

    def run_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return self.submit(fn).result()

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in the writer's next transaction; returns once that transaction is committed."""
        if self._closed:
            raise RuntimeError("database is closed")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put(_Op(fn, fut, loop))
        return await fut

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=30)
        self._reader.shutdown(wait=True)
        for conn in self._reader_conns:
            conn.close()
        self.conn.close()


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
        "ON CONFLICT(node_id, reason) DO UPDATE SET count = count + 1",
        (node_id, reason),
    )
    if log and node_id:
        conn.execute("INSERT INTO rejections(node_id, lease_id, reason, detail, time_ms) VALUES(?, ?, ?, ?, ?)",
                     (node_id, lease_id, reason, detail[:500], now_ms))


def queued_groups(conn: sqlite3.Connection) -> int:
    """Accepted groups waiting for the trainer (neither consumed nor dropped), in O(1)."""
    return int(conn.execute("SELECT value FROM counters WHERE name = 'queued_groups'").fetchone()[0])


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
        "open_leases": int(one("SELECT COUNT(*) FROM leases WHERE state = 'open'")),
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
