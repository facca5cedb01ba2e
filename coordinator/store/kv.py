"""The ``kv`` table: single values by name (the policy version, the trainer's step and history), as JSON."""

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
