"""Leases and the prompt pool: issuing a lease (a pooled prompt first, else a fresh one), loading, spending
and expiring leases, and the request nonces edge processes share."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

from veriroll.coordinator.store.columns import LeaseState, PromptState, pack_i32, unpack_i32
from veriroll.coordinator.store.db import Connection, execute_together
from veriroll.coordinator.store.kv import counter_total


def expire_leases(conn: Connection, now_ms: int) -> int:
    """Open leases past their deadline become expired; their prompts go back to the pool."""
    # SKIP LOCKED (PostgreSQL): a lease another edge's transaction is expiring (or submitting) right now is
    # left to it, instead of this writer waiting on its row lock until that transaction commits.
    rows = conn.execute("UPDATE leases SET state = ? WHERE state = ? AND lease_id IN (SELECT lease_id FROM leases "
                        "WHERE state = ? AND deadline_ms < ? /*SKIP LOCKED*/) RETURNING prompt_id",
                        (LeaseState.EXPIRED, LeaseState.OPEN, LeaseState.OPEN, now_ms)).fetchall()
    for r in rows:
        _return_prompt(conn, r["prompt_id"])
    return len(rows)


def release_open_leases(conn: Connection, node_id: str) -> int:
    """A node that stops gives its open leases back: they expire now and their prompts return to the pool,
    instead of waiting out their deadlines (and holding the node's lease slots for its next start)."""
    rows = conn.execute("UPDATE leases SET state = ? WHERE node_id = ? AND state = ? RETURNING prompt_id",
                        (LeaseState.EXPIRED, node_id, LeaseState.OPEN)).fetchall()
    for r in rows:
        _return_prompt(conn, r["prompt_id"])
    return len(rows)


def _return_prompt(conn: Connection, prompt_id: int) -> None:
    conn.execute("UPDATE prompts SET state = ? WHERE prompt_id = ? AND state = ?",
                 (PromptState.PENDING, prompt_id, PromptState.LEASED))


def lease_limits(conn: Connection, node_id: str) -> tuple[int, int]:
    """(groups queued for the trainer, open leases of ``node_id``): what a lease request checks first, in one
    statement (``queued_groups`` and ``open_leases_of`` together)."""
    r = conn.execute("SELECT (SELECT COALESCE(SUM(value), 0) FROM counters WHERE name = 'queued_groups'), "
                     "(SELECT COUNT(*) FROM leases WHERE node_id = ? AND state = ?)", (node_id, LeaseState.OPEN)).fetchone()
    return int(r[0]), int(r[1])


def open_leases_of(conn: Connection, node_id: str) -> int:
    """Open leases held by one node (an index range of at most ``max_open_per_node`` rows)."""
    return int(conn.execute("SELECT COUNT(*) FROM leases WHERE node_id = ? AND state = ?",
                            (node_id, LeaseState.OPEN)).fetchone()[0])


def open_lease_totals(conn: Connection) -> tuple[int, int]:
    """(open leases, open leases issued to probation nodes), in O(1) from the trigger-kept counters."""
    rows = dict(conn.execute("SELECT name, SUM(value) FROM counters "
                             "WHERE name IN ('open_leases', 'open_probation_leases') GROUP BY name").fetchall())
    return int(rows.get("open_leases", 0)), int(rows.get("open_probation_leases", 0))


def take_pending_prompt(conn: Connection) -> tuple[int, list[int], str] | None:
    """The oldest prompt back in the pool (its lease expired or was spent), now leased: (id, token ids, env)."""
    # The outer state check and SKIP LOCKED (PostgreSQL; see pg.translate) keep two edge processes
    # from leasing one prompt twice: the loser finds no row and draws a new prompt instead.
    row = conn.execute("UPDATE prompts SET state = ?, attempts = attempts + 1 WHERE state = ? AND prompt_id = "
                       "(SELECT prompt_id FROM prompts WHERE state = ? ORDER BY prompt_id LIMIT 1 /*SKIP LOCKED*/) "
                       "RETURNING prompt_id, prompt_ids, env",
                       (PromptState.LEASED, PromptState.PENDING, PromptState.PENDING)).fetchone()
    return None if row is None else (int(row[0]), unpack_i32(row[1]).tolist(), row[2])


def insert_leased_prompt(conn: Connection, env: str, text: str, answer: str, meta: dict,
                         prompt_ids: list[int]) -> int:
    """Store a freshly drawn prompt as leased and count the draw (``prompts_drawn``, to resume the stream)."""
    inserted, _ = execute_together(conn, [
        ("INSERT INTO prompts(env, text, answer, meta, prompt_ids, state, attempts) VALUES(?, ?, ?, ?, ?, ?, 1) "
         "RETURNING prompt_id", (env, text, answer, json.dumps(meta), pack_i32(prompt_ids), PromptState.LEASED)),
        # /*SLOT*/: on PostgreSQL, this writer's own row of the counter (schema.COUNTER_SLOTS).
        ("UPDATE counters SET value = value + 1 WHERE name = 'prompts_drawn' /*SLOT*/", ()),
    ])
    return int(inserted.fetchone()[0])


def use_nonces(conn: Connection, entries: list[tuple[bytes, str, int]]) -> list[bool]:
    """Record requests' nonces (public key, nonce, expiry) in one statement: for each, True when its nonce
    was new, False when it was used already (a replay), whichever edge process saw it first. Of entries with
    the same key and nonce only the first can be (a request and its replay in one transaction)."""
    first: dict[tuple[bytes, str], int] = {}
    for i, (key, nonce, _) in enumerate(entries):
        first.setdefault((bytes(key), nonce), i)
    # In key order: edges that insert the same nonces at once lock them in one order (no deadlock).
    unique = sorted(first)
    # On PostgreSQL one statement text whatever the count: one prepared statement (PgConnection.rows_source).
    values = [(key, nonce, entries[first[key, nonce]][2]) for key, nonce in unique]
    source, params = conn.rows_source(values, ("bytea", "text", "bigint"))
    rows = conn.execute("INSERT INTO nonces(public_key, nonce, expires_ms) " + source
                        + " ON CONFLICT(public_key, nonce) DO NOTHING RETURNING public_key, nonce", params)
    new = {(bytes(r[0]), r[1]) for r in rows}
    return [first[(bytes(key), nonce)] == i and (bytes(key), nonce) in new for i, (key, nonce, _) in enumerate(entries)]


def forget_nonces(conn: Connection, now_ms: int) -> int:
    """Nonces whose timestamps can no longer pass the window are dropped."""
    return conn.execute("DELETE FROM nonces WHERE expires_ms < ?", (now_ms,)).rowcount


def prompts_drawn(conn: Connection) -> int:
    """Prompts drawn from the stream so far, by every process (the counter's rows summed)."""
    return counter_total(conn, "prompts_drawn")


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


def insert_lease(conn: Connection, lease: LeaseRecord) -> None:
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


def lease_one(conn: Connection, lease: LeaseRecord, fresh: Callable[[], FreshPrompt], *, queue_max: int,
              max_open: int) -> LeasedOne:
    """Issue ``lease`` (its ``prompt_id`` is filled here) unless the trainer's queue holds ``queue_max`` groups or
    the node ``max_open`` open leases: a prompt back in the pool goes first, else ``fresh()`` is stored as
    leased and counted as drawn. LeaseWork's common case (one lease, a trusted node) as one operation.

    Where the database has data-modifying CTEs (PostgreSQL) the whole of it is one statement, one round trip:
    ``fresh()`` is then called first, and handed back as ``leftover`` when it was not stored."""
    if conn.writable_ctes:
        return _lease_one_in_one_statement(conn, lease, fresh, queue_max=queue_max, max_open=max_open)
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


_LEASE_ONE_STATEMENT = (
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


def _lease_one_in_one_statement(conn: Connection, lease: LeaseRecord, fresh: Callable[[], FreshPrompt], *,
                                queue_max: int, max_open: int) -> LeasedOne:
    # The fresh prompt is drawn before the statement knows whether it needs it; when a pooled prompt went
    # first (or a limit refused) it is handed back as ``leftover`` for the next lease, so the stream skips none.
    p = fresh()
    row = conn.execute(_LEASE_ONE_STATEMENT, (
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


def load_lease(conn: Connection, lease_id: str) -> tuple[dict | None, dict | None, dict | None]:
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


def spend_lease(conn: Connection, lease_id: str, prompt_id: int) -> bool:
    """An open lease whose group failed a content check is spent; its prompt goes back to the pool."""
    n = conn.execute("UPDATE leases SET state = ? WHERE lease_id = ? AND state = ?",
                     (LeaseState.REJECTED, lease_id, LeaseState.OPEN)).rowcount
    if n:
        _return_prompt(conn, prompt_id)
    return bool(n)
