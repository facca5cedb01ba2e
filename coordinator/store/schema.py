"""The store's tables, written once, and what each database adds around them.

Every table and index is declared once below, in SQLite's type names; :func:`for_postgres` gives PostgreSQL's
(``INTEGER`` → ``BIGINT``, ``REAL`` → ``DOUBLE PRECISION``, ``BLOB`` → ``BYTEA``, an ``AUTOINCREMENT`` key →
an identity column). What cannot be one text stays per dialect, side by side here: the triggers that keep the
counters (SQLite's trigger bodies against PL/pgSQL functions; on PostgreSQL each counter is a row per writer,
:data:`COUNTER_SLOTS`), the trigger that notes standing changes, and how an older database gets newer columns
(SQLite reads ``PRAGMA table_info``, see ``sqlite.connect``; PostgreSQL runs ``ADD COLUMN IF NOT EXISTS``).

The PostgreSQL text is byte for byte what it was when it was a second copy of the schema: a connection skips
the DDL when it finds the schema's fingerprint (``pg.SCHEMA_MARK``), so a changed text would run it again on
every existing database at its next start.
"""

from __future__ import annotations

import re

# --- the tables, shared by both databases ------------------------------------------------------------------

TABLES: dict[str, str] = {
    "nodes": """
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
    ban_reason TEXT NOT NULL DEFAULT '',
    session_id TEXT NOT NULL DEFAULT '',
    session_address TEXT NOT NULL DEFAULT '',
    session_seen_ms INTEGER NOT NULL DEFAULT 0
);""",
    "prompts": """
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
CREATE INDEX IF NOT EXISTS prompts_state ON prompts(state, prompt_id);""",
    "leases": """
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
    state TEXT NOT NULL DEFAULT 'open',
    probation INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS leases_open ON leases(state, deadline_ms);
CREATE INDEX IF NOT EXISTS leases_node ON leases(node_id, state);""",
    "groups": """
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
CREATE INDEX IF NOT EXISTS groups_unconsumed ON groups(consumed_step, group_id);""",
    "samples": """
CREATE TABLE IF NOT EXISTS samples (
    group_id INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    token_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    trusted_logprobs BLOB,
    reward REAL NOT NULL,
    finish_reason TEXT NOT NULL,
    PRIMARY KEY (group_id, idx)
);""",
    "rejections": """
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id TEXT NOT NULL,
    lease_id TEXT NOT NULL DEFAULT '',
    reason TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    time_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS rejections_node ON rejections(node_id);""",
    "rejection_counts": """
CREATE TABLE IF NOT EXISTS rejection_counts (
    node_id TEXT NOT NULL,
    reason TEXT NOT NULL,
    count INTEGER NOT NULL,
    PRIMARY KEY (node_id, reason)
);""",
    "kv": """
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);""",
    # Request nonces, when several edge processes share the store (see Door): each is used once while its
    # timestamp is inside the window.
    "nonces": """
CREATE TABLE IF NOT EXISTS nonces (
    public_key BLOB NOT NULL,
    nonce TEXT NOT NULL,
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (public_key, nonce)
);
CREATE INDEX IF NOT EXISTS nonces_expiry ON nonces(expires_ms);""",
    # Shared limits (buckets.py): token buckets every edge process takes from, and the edge processes alive now.
    "limit_buckets": """
CREATE TABLE IF NOT EXISTS limit_buckets (
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    tat_ms REAL NOT NULL,
    PRIMARY KEY (kind, key)
);
CREATE INDEX IF NOT EXISTS limit_buckets_full ON limit_buckets(tat_ms);""",
    "edges": """
CREATE TABLE IF NOT EXISTS edges (
    edge_id TEXT PRIMARY KEY,
    seen_ms INTEGER NOT NULL
);""",
}

# The node process that holds each key (see ``nodes.other_live_session``): columns added to older databases.
SESSION_COLUMNS = {"session_id": "TEXT NOT NULL DEFAULT ''", "session_address": "TEXT NOT NULL DEFAULT ''",
                   "session_seen_ms": "INTEGER NOT NULL DEFAULT 0"}

# Verification jobs: edges hand audited groups to the verifier pool (verify_jobs.py).
VERIFY_JOBS_TABLE = """
CREATE TABLE IF NOT EXISTS verify_jobs (
    job_id INTEGER PRIMARY KEY AUTOINCREMENT,
    lease_id TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    node_id TEXT NOT NULL,
    peer TEXT NOT NULL DEFAULT '',
    submission BLOB NOT NULL,
    created_ms INTEGER NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    worker TEXT NOT NULL DEFAULT '',
    claims INTEGER NOT NULL DEFAULT 0,
    claim_deadline_ms INTEGER NOT NULL DEFAULT 0,
    reason TEXT,
    detail TEXT NOT NULL DEFAULT '',
    trusted_logprobs BLOB,
    seconds REAL NOT NULL DEFAULT 0,
    finished_ms INTEGER NOT NULL DEFAULT 0,
    UNIQUE (lease_id, content_hash)
);
CREATE INDEX IF NOT EXISTS verify_jobs_state ON verify_jobs(state, job_id);
"""

# The swarm's peer directory, shared by edge processes (swarm.py).
SWARM_TABLES = """
CREATE TABLE IF NOT EXISTS swarm_listings (
    node_id TEXT PRIMARY KEY,
    peer_id TEXT NOT NULL,
    addrs TEXT NOT NULL,
    versions TEXT NOT NULL,
    listed_ms INTEGER NOT NULL,
    seen_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS swarm_reports (
    peer_id TEXT NOT NULL,
    network TEXT NOT NULL,
    reported_ms INTEGER NOT NULL,
    PRIMARY KEY (peer_id, network)
);
"""

# Standing changes, what every process caching nodes follows (nodes.py): a trigger of each database notes
# each change of a node's standing or ban reason, whoever made it.
STANDING_CHANGES_TABLE = """
CREATE TABLE IF NOT EXISTS standing_changes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    node_id TEXT NOT NULL,
    changed_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS standing_changes_time ON standing_changes(changed_ms);
"""

_POSTGRES_TYPES = (
    (re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b"), "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bBLOB\b"), "BYTEA"),
)


def for_postgres(ddl: str) -> str:
    """``ddl`` (tables and indexes in SQLite's type names) with PostgreSQL's types: 64-bit integers (SQLite's
    INTEGER is 64 bits), doubles, BYTEA, and identity columns for SQLite's AUTOINCREMENT keys."""
    for pattern, postgres in _POSTGRES_TYPES:
        ddl = pattern.sub(postgres, ddl)
    return ddl


# --- SQLite's own ---------------------------------------------------------------------------------------------

# The number of queued groups (accepted, neither consumed nor dropped), kept by triggers in the same transaction
# as the change, so every lease request reads the queue depth in O(1) instead of counting a table that grows
# with the run.
_SQLITE_QUEUED_GROUPS = """
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

SQLITE_SCHEMA = "".join(TABLES.values()) + "\n" + _SQLITE_QUEUED_GROUPS
"""SQLite's tables, indexes and the queued-groups counter; then :data:`VERIFY_JOBS_TABLE`, :data:`SWARM_TABLES`,
:data:`SQLITE_STANDING_CHANGES`, and the migrations and counters that ``sqlite.connect`` runs after them."""

# Open leases, in all and those issued to probation nodes, kept like queued_groups: a lease request reads
# them in O(1) to apply the probation share. Run after the probation column exists (see sqlite.connect).
SQLITE_LEASE_COUNTERS = """
CREATE TRIGGER IF NOT EXISTS leases_open_insert AFTER INSERT ON leases WHEN NEW.state = 'open'
BEGIN
    UPDATE counters SET value = value + 1 WHERE name = 'open_leases';
    UPDATE counters SET value = value + NEW.probation WHERE name = 'open_probation_leases';
END;
CREATE TRIGGER IF NOT EXISTS leases_open_update AFTER UPDATE OF state ON leases
BEGIN
    UPDATE counters SET value = value + (NEW.state = 'open') - (OLD.state = 'open') WHERE name = 'open_leases';
    UPDATE counters SET value = value + NEW.probation * (NEW.state = 'open') - OLD.probation * (OLD.state = 'open')
    WHERE name = 'open_probation_leases';
END;
CREATE TRIGGER IF NOT EXISTS leases_open_delete AFTER DELETE ON leases WHEN OLD.state = 'open'
BEGIN
    UPDATE counters SET value = value - 1 WHERE name = 'open_leases';
    UPDATE counters SET value = value - OLD.probation WHERE name = 'open_probation_leases';
END;
"""
SQLITE_INIT_LEASE_COUNTERS = """
INSERT INTO counters(name, value)
SELECT 'open_leases', (SELECT COUNT(*) FROM leases WHERE state = 'open')
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'open_leases');
INSERT INTO counters(name, value)
SELECT 'open_probation_leases', (SELECT COUNT(*) FROM leases WHERE state = 'open' AND probation = 1)
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'open_probation_leases');
"""

# Run after SQLITE_SCHEMA: a database from before the counter (or a fresh one) starts it from a full count,
# in one statement, so a group inserted concurrently is counted exactly once.
SQLITE_INIT_QUEUED_GROUPS = """
INSERT INTO counters(name, value)
SELECT 'queued_groups', (SELECT COUNT(*) FROM groups WHERE consumed_step IS NULL AND dropped IS NULL)
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'queued_groups')
"""

# The number of prompts drawn from the stream (it resumes from the seed and this number), kept like the
# others; a kv row before, which every lease of a fresh prompt updated: on PostgreSQL, one row every edge
# process's writer queued on. Its value moves over once.
SQLITE_INIT_DRAW_COUNTER = """
INSERT INTO counters(name, value)
SELECT 'prompts_drawn', COALESCE((SELECT CAST(value AS INTEGER) FROM kv WHERE key = 'prompts_drawn'), 0)
WHERE NOT EXISTS (SELECT 1 FROM counters WHERE name = 'prompts_drawn');
DELETE FROM kv WHERE key = 'prompts_drawn';
"""

SQLITE_STANDING_CHANGES = STANDING_CHANGES_TABLE + """CREATE TRIGGER IF NOT EXISTS nodes_standing_changed AFTER UPDATE OF standing, ban_reason ON nodes
WHEN OLD.standing IS NOT NEW.standing OR OLD.ban_reason IS NOT NEW.ban_reason
BEGIN
    INSERT INTO standing_changes(node_id, changed_ms)
    VALUES (NEW.node_id, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));
END;
"""


# --- PostgreSQL's own -----------------------------------------------------------------------------------------

# Added on PostgreSQL only, as when the schema was two copies: on SQLite the dashboard's reads by time scan
# ``rejections``; adding the index there would build it on every existing coordinator's file at its next start.
_POSTGRES_ONLY_AFTER = {
    "nodes": "\n-- Databases created before sessions (the node process that holds each key) get their columns.\n"
             + "\n".join(f"ALTER TABLE nodes ADD COLUMN IF NOT EXISTS {column} {for_postgres(declaration)};"
                         for column, declaration in SESSION_COLUMNS.items()),
    "rejections": "\nCREATE INDEX IF NOT EXISTS rejections_time ON rejections(time_ms);",
}

POSTGRES_SCHEMA = "".join(for_postgres(ddl) + _POSTGRES_ONLY_AFTER.get(name, "") for name, ddl in TABLES.items()) + "\n"
"""PostgreSQL's tables and indexes; then :data:`POSTGRES_COUNTERS` and the rest (``pg.connect``)."""

COUNTER_SLOTS = 32
"""Each counter (queued groups, open leases, open probation leases, prompts drawn) is this many rows on
PostgreSQL, one per writer slot. A writer adds to its own connection's slot (triggers; ``/*SLOT*/`` in a
statement), so two processes' write transactions never queue on one counter row, whose lock each would hold to
its COMMIT; readers sum a counter's slots. A connection claims a free slot when it first begins a write
transaction (``pg.PgConnection._run``); one that found none free, or never claimed (a single autocommit
statement), adds to slot ``pg_backend_pid() % COUNTER_SLOTS``: right, only not free of contention."""

POSTGRES_COUNTERS = f"""
CREATE TABLE IF NOT EXISTS counters (
    name TEXT NOT NULL,
    slot BIGINT NOT NULL DEFAULT 0,
    value BIGINT NOT NULL,
    PRIMARY KEY (name, slot)
);
-- A database from before slots kept one row per counter: it becomes slot 0, its value kept.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()
                   AND table_name = 'counters' AND column_name = 'slot') THEN
        ALTER TABLE counters ADD COLUMN slot BIGINT NOT NULL DEFAULT 0;
        ALTER TABLE counters DROP CONSTRAINT counters_pkey;
        ALTER TABLE counters ADD PRIMARY KEY (name, slot);
    END IF;
END $$;

CREATE OR REPLACE FUNCTION veriroll_counter_slot() RETURNS BIGINT LANGUAGE sql STABLE AS $$
    SELECT COALESCE(NULLIF(current_setting('veriroll.counter_slot', true), '')::BIGINT,
                    pg_backend_pid() % {COUNTER_SLOTS})
$$;

CREATE OR REPLACE FUNCTION veriroll_queued_groups() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    delta BIGINT := 0;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        delta := delta - (OLD.consumed_step IS NULL AND OLD.dropped IS NULL)::int;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        delta := delta + (NEW.consumed_step IS NULL AND NEW.dropped IS NULL)::int;
    END IF;
    IF delta <> 0 THEN
        UPDATE counters SET value = value + delta
        WHERE name = 'queued_groups' AND slot = veriroll_counter_slot();
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER groups_queued AFTER INSERT OR UPDATE OF consumed_step, dropped OR DELETE ON groups
FOR EACH ROW EXECUTE FUNCTION veriroll_queued_groups();

CREATE OR REPLACE FUNCTION veriroll_open_leases() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    open_delta BIGINT := 0;
    probation_delta BIGINT := 0;
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.state = 'open' THEN
        open_delta := open_delta - 1;
        probation_delta := probation_delta - OLD.probation;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.state = 'open' THEN
        open_delta := open_delta + 1;
        probation_delta := probation_delta + NEW.probation;
    END IF;
    IF open_delta <> 0 THEN
        UPDATE counters SET value = value + open_delta
        WHERE name = 'open_leases' AND slot = veriroll_counter_slot();
    END IF;
    IF probation_delta <> 0 THEN
        UPDATE counters SET value = value + probation_delta
        WHERE name = 'open_probation_leases' AND slot = veriroll_counter_slot();
    END IF;
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER leases_open AFTER INSERT OR UPDATE OF state OR DELETE ON leases
FOR EACH ROW EXECUTE FUNCTION veriroll_open_leases();

-- A fresh database starts each counter from a full count in slot 0 (a migrated one has its slot 0
-- already); every other slot starts at zero.
INSERT INTO counters(name, slot, value)
SELECT 'queued_groups', 0, (SELECT COUNT(*) FROM groups WHERE consumed_step IS NULL AND dropped IS NULL)
ON CONFLICT (name, slot) DO NOTHING;
INSERT INTO counters(name, slot, value)
SELECT 'open_leases', 0, (SELECT COUNT(*) FROM leases WHERE state = 'open')
ON CONFLICT (name, slot) DO NOTHING;
INSERT INTO counters(name, slot, value)
SELECT 'open_probation_leases', 0, (SELECT COUNT(*) FROM leases WHERE state = 'open' AND probation = 1)
ON CONFLICT (name, slot) DO NOTHING;
-- Prompts drawn, a kv row before (store.py's _INIT_DRAW_COUNTER says why): its value moves to slot 0.
INSERT INTO counters(name, slot, value)
SELECT 'prompts_drawn', 0, COALESCE((SELECT CAST(value AS BIGINT) FROM kv WHERE key = 'prompts_drawn'), 0)
ON CONFLICT (name, slot) DO NOTHING;
DELETE FROM kv WHERE key = 'prompts_drawn';
INSERT INTO counters(name, slot, value)
SELECT name, slot, 0
FROM unnest(ARRAY['queued_groups', 'open_leases', 'open_probation_leases', 'prompts_drawn']) AS name,
     generate_series(0, {COUNTER_SLOTS - 1}) AS slot
ON CONFLICT (name, slot) DO NOTHING;
"""
# (The comment "store.py's _INIT_DRAW_COUNTER" above is SQLITE_INIT_DRAW_COUNTER now; it stays as it was: the
# text is part of the schema's fingerprint.)

POSTGRES_STANDING_CHANGES = for_postgres(STANDING_CHANGES_TABLE) + """CREATE OR REPLACE FUNCTION veriroll_standing_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO standing_changes(node_id, changed_ms)
    VALUES (NEW.node_id, (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT);
    RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER nodes_standing_changed AFTER UPDATE OF standing, ban_reason ON nodes
FOR EACH ROW WHEN (OLD.standing IS DISTINCT FROM NEW.standing OR OLD.ban_reason IS DISTINCT FROM NEW.ban_reason)
EXECUTE FUNCTION veriroll_standing_changed();
"""

POSTGRES_SCRIPTS = (POSTGRES_SCHEMA, POSTGRES_COUNTERS, for_postgres(VERIFY_JOBS_TABLE), for_postgres(SWARM_TABLES),
                    POSTGRES_STANDING_CHANGES)
"""What ``pg.connect`` runs on a database without this schema's fingerprint, in this order."""
