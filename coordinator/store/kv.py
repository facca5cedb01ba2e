"""Single values by name: the ``kv`` table (the policy version, the trainer's step and history, as JSON) and
the ``counters`` table's totals."""

from __future__ import annotations

import json
from typing import Any

from veriroll.coordinator.store.db import Connection


def kv_get(conn: Connection, key: str, default: Any = None) -> Any:
    row = conn.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
    return default if row is None else json.loads(row["value"])


def kv_set(conn: Connection, key: str, value: Any) -> None:
    conn.execute("INSERT INTO kv(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                 (key, json.dumps(value)))


def counter_total(conn: Connection, name: str) -> int:
    """A counter's total in O(1): its rows summed (one on SQLite, one per writer slot on PostgreSQL:
    ``schema.COUNTER_SLOTS``)."""
    return int(conn.execute("SELECT COALESCE(SUM(value), 0) FROM counters WHERE name = ?", (name,)).fetchone()[0])
