"""Nodes: registration and sessions, heartbeats, refusals and strikes, standing, what nodes may say about
themselves, and the feed of standing changes every process caching nodes follows (``Ledger``).

Each operation here and in the other table modules is a plain function of a connection, run by the caller
inside one writer transaction (``Database.run``) or one read (``Database.run_read``); callers compose them,
never write SQL.
"""

from __future__ import annotations

import json
import sqlite3
import unicodedata
from dataclasses import dataclass
from itertools import dropwhile, islice

from veriroll.coordinator.store.columns import STANDINGS, Standing
from veriroll.coordinator.store.db import Connection


def count_rejection(conn: Connection, node_id: str, reason: str, lease_id: str = "", detail: str = "",
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


def rejections_by_reason(conn: Connection, node_id: str | None = None) -> dict[str, int]:
    if node_id is None:
        rows = conn.execute("SELECT reason, SUM(count) AS n FROM rejection_counts GROUP BY reason").fetchall()
    else:
        rows = conn.execute("SELECT reason, count AS n FROM rejection_counts WHERE node_id = ?", (node_id,)).fetchall()
    return {r["reason"]: int(r["n"]) for r in rows}


def rejections_by_node(conn: Connection) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in conn.execute("SELECT node_id, reason, count FROM rejection_counts WHERE node_id != ''"):
        out.setdefault(r["node_id"], {})[r["reason"]] = int(r["count"])
    return out


@dataclass(frozen=True)
class NodeRow:
    """What the door needs to know about a registered node."""

    node_id: str
    public_key: bytes
    standing: Standing
    ban_reason: str = ""


def node_by_id(conn: Connection, node_id: str) -> NodeRow | None:
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


def other_live_session(conn: Connection, node_id: str, session: Session, now_ms: int,
                       ttl_ms: int) -> LiveSession | None:
    """Another session of this key that registered or heartbeated within ``ttl_ms``, or None (no such
    session, or ``session`` claims nothing): then ``session`` may hold the key."""
    if not session.session_id:
        return None
    r = conn.execute("SELECT session_address, session_seen_ms FROM nodes WHERE node_id = ? AND session_id NOT IN ('', ?) "
                     "AND session_seen_ms >= ?", (node_id, session.session_id, now_ms - ttl_ms)).fetchone()
    return None if r is None else LiveSession(r["session_address"], int(r["session_seen_ms"]))


def _hold_session(conn: Connection, node_id: str, session: Session | None, now_ms: int) -> None:
    if session is not None and session.session_id:
        conn.execute("UPDATE nodes SET session_id = ?, session_address = ?, session_seen_ms = ? WHERE node_id = ?",
                     (session.session_id, session.address, now_ms, node_id))


def register_node(conn: Connection, node_id: str, public_key: bytes, now_ms: int, hardware: dict,
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


def end_session(conn: Connection, node_id: str, session_id: str) -> None:
    """``session_id`` stopped: if it held the key, the key is free for another process at once."""
    conn.execute("UPDATE nodes SET session_id = '' WHERE node_id = ? AND session_id = ? AND session_id != ''",
                 (node_id, session_id))


def touch_node(conn: Connection, node_id: str, now_ms: int, loaded_version: int,
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


def node_ledger(conn: Connection, node_id: str) -> dict | None:
    """A node's row and its refusals by reason (GetLedger)."""
    row = conn.execute("SELECT * FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
    if row is None:
        return None
    return {**dict(row), "rejections_by_reason": rejections_by_reason(conn, node_id)}


def record_refusal(conn: Connection, node_id: str, reason: str, *, strike: bool, strike_limit: int,
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


def find_node(conn: Connection, key_or_id: str) -> sqlite3.Row | None:
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


def set_standing(conn: Connection, node_id: str, standing: str, reason: str = "") -> None:
    if standing not in STANDINGS:
        raise ValueError(f"standing must be one of {STANDINGS}")
    strikes_reset = ", strikes = 0, clean_groups = 0" if standing == "probation" else ""
    conn.execute(f"UPDATE nodes SET standing = ?, ban_reason = ?{strikes_reset} WHERE node_id = ?",
                 (standing, reason, node_id))


# --- standing changes: what every process caching nodes (Ledger) follows ----------------------------------

# A trigger notes each change of a node's standing or ban reason, whoever made it: this process, another
# edge, the operator's CLI on the same file (schema.py). A process's node cache follows this table (one read
# a second, whatever the number of nodes) instead of reading every node again every few seconds.

STANDING_CHANGES_KEPT_MS = 3_600_000
"""How long a noted change is kept (past the newest one): far longer than any process goes without reading."""


def standing_changes(conn: Connection, since_ms: int, limit: int, after_seq: int = -1
                     ) -> list[tuple[int, str, int]]:
    """(seq, node id, changed ms) of the changes noted at or after ``since_ms`` (the database's clock), oldest
    first, at most ``limit``; of those noted at ``since_ms`` itself only the ones past ``after_seq`` (a reader
    that went past a page of them goes on from there, rather than skipping the rest of that millisecond)."""
    return [(int(r[0]), r[1], int(r[2])) for r in conn.execute(
        "SELECT seq, node_id, changed_ms FROM standing_changes WHERE changed_ms >= ? AND (changed_ms > ? OR seq > ?) "
        "ORDER BY seq LIMIT ?", (since_ms, since_ms, after_seq, limit))]


def newest_standing_change_ms(conn: Connection) -> int | None:
    return newest_standing_change(conn)[0]


def newest_standing_change(conn: Connection) -> tuple[int | None, int]:
    """The newest change's millisecond and the highest seq noted so far ((None, -1) before any)."""
    ms, seq = conn.execute("SELECT MAX(changed_ms), MAX(seq) FROM standing_changes").fetchone()
    return (None, -1) if ms is None else (int(ms), int(seq))


def forget_standing_changes(conn: Connection) -> int:
    """Drop noted changes older than STANDING_CHANGES_KEPT_MS before the newest (an index range)."""
    return conn.execute("DELETE FROM standing_changes WHERE changed_ms < "
                        "(SELECT MAX(changed_ms) FROM standing_changes) - ?", (STANDING_CHANGES_KEPT_MS,)).rowcount
