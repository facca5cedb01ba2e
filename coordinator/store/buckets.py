"""Shared limits: token buckets and live edges, for several edge processes on one store.

Rate limits that must hold across every edge process (new identities per address, verifier seconds per
scope) are token buckets in ``limit_buckets``, one row per (kind, key), kept as a "theoretical arrival
time" (GCRA): the bucket is full when ``tat_ms`` <= now, each token moves ``tat_ms`` on by one interval,
and a take is allowed while ``tat_ms`` stays within ``burst`` intervals of now. One conditional upsert
takes a token atomically on both backends (PostgreSQL locks the row for the statement), and a full
bucket needs no row: rows are forgotten once full (``forget_full_buckets``), so the table holds only the
keys that spent something recently. ``edges`` holds one heartbeat row per live edge process.
"""

from __future__ import annotations

from dataclasses import dataclass

from veriroll.coordinator.store.db import Connection


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


def take_from_bucket(conn: Connection, kind: str, key: str, rate: BucketRate, cost: float, now_ms: float,
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


def return_to_bucket(conn: Connection, kind: str, key: str, rate: BucketRate, cost: float) -> None:
    """Give back ``cost`` tokens taken in this transaction (the other half of an all-or-nothing take)."""
    conn.execute("UPDATE limit_buckets SET tat_ms = tat_ms - ? WHERE kind = ? AND key = ?",
                 (cost * rate.interval_ms, kind, key))


def bucket_level(conn: Connection, kind: str, key: str, rate: BucketRate, now_ms: float) -> float:
    """Tokens in the (kind, key) bucket at ``now_ms``: ``rate.burst`` when full, negative when in debt."""
    row = conn.execute("SELECT tat_ms FROM limit_buckets WHERE kind = ? AND key = ?", (kind, key)).fetchone()
    return _level(now_ms if row is None else float(row[0]), rate, now_ms)


def bucket_levels(conn: Connection, buckets: list[tuple[str, str, BucketRate]],
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


def forget_full_buckets(conn: Connection, now_ms: float) -> int:
    """Buckets that have refilled completely are dropped: a missing row is a full bucket."""
    return conn.execute("DELETE FROM limit_buckets WHERE tat_ms <= ?", (now_ms,)).rowcount


def beat_edge(conn: Connection, edge_id: str, now_ms: int, ttl_ms: int) -> int:
    """Record that edge process ``edge_id`` is alive; returns how many edges beat within ``ttl_ms`` (itself
    included). Rows of edges silent for ten TTLs are dropped (a killed edge leaves its row behind)."""
    conn.execute("INSERT INTO edges(edge_id, seen_ms) VALUES(?, ?) ON CONFLICT(edge_id) DO UPDATE SET seen_ms = ?",
                 (edge_id, now_ms, now_ms))
    conn.execute("DELETE FROM edges WHERE seen_ms < ?", (now_ms - 10 * ttl_ms,))
    return int(conn.execute("SELECT COUNT(*) FROM edges WHERE seen_ms >= ?", (now_ms - ttl_ms,)).fetchone()[0])


def forget_edge(conn: Connection, edge_id: str) -> None:
    """An edge stopping on purpose leaves the count at once, rather than after its TTL."""
    conn.execute("DELETE FROM edges WHERE edge_id = ?", (edge_id,))
