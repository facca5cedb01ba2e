"""The status API's and the operator's reads: summaries, node listings, rejections and arrivals over time, the
queue's staleness, a watcher's snapshot."""

from __future__ import annotations

import json

from veriroll.coordinator.store.columns import STANDINGS
from veriroll.coordinator.store.db import Connection
from veriroll.coordinator.store.groups import queued_groups
from veriroll.coordinator.store.kv import kv_get
from veriroll.coordinator.store.leases import open_lease_totals
from veriroll.coordinator.store.nodes import bound_node_fields, rejections_by_node, rejections_by_reason


def status_summary(conn: Connection) -> dict:
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


def list_nodes(conn: Connection, limit: int | None = None) -> list[dict]:
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


def standing_counts(conn: Connection) -> dict[str, int]:
    """``{standing: number of nodes}`` over all nodes, every standing present."""
    counts = {s: 0 for s in STANDINGS}
    for r in conn.execute("SELECT standing, COUNT(*) AS n FROM nodes GROUP BY standing"):
        counts[r["standing"]] = int(r["n"])
    return counts


def first_rejection_ms(conn: Connection, since_ms: int) -> int | None:
    return conn.execute("SELECT MIN(time_ms) FROM rejections WHERE time_ms >= ?", (since_ms,)).fetchone()[0]


def rejections_per_bucket(conn: Connection, start_ms: int, bucket_ms: int) -> list[tuple[int, str, int]]:
    """(bucket index, reason, count) of logged rejections since ``start_ms``."""
    return [(int(r["b"]), r["reason"], int(r["n"])) for r in conn.execute(
        "SELECT (time_ms - ?) / ? AS b, reason, COUNT(*) AS n FROM rejections WHERE time_ms >= ? GROUP BY b, reason",
        (start_ms, bucket_ms, start_ms))]


def first_arrival_ms(conn: Connection, since_ms: int) -> int | None:
    return conn.execute("SELECT MIN(arrival_ms) FROM groups WHERE arrival_ms >= ?", (since_ms,)).fetchone()[0]


def arrivals_per_bucket(conn: Connection, start_ms: int, bucket_ms: int) -> list[tuple[int, int, int]]:
    """(bucket index, accepted groups, their tokens) since ``start_ms``."""
    return [(int(r["b"]), int(r["g"]), int(r["t"] or 0)) for r in conn.execute(
        "SELECT (arrival_ms - ?) / ? AS b, COUNT(*) AS g, SUM(tokens) AS t FROM groups WHERE arrival_ms >= ? GROUP BY b",
        (start_ms, bucket_ms, start_ms))]


def queue_staleness(conn: Connection, version: int) -> dict[int, int]:
    """``{staleness against version: queued groups}``."""
    return {int(r["s"]): int(r["n"]) for r in conn.execute(
        "SELECT ? - policy_version AS s, COUNT(*) AS n FROM groups WHERE consumed_step IS NULL AND dropped IS NULL "
        "GROUP BY s ORDER BY s", (version,))}


def observer_snapshot(conn: Connection) -> dict:
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
