"""The coordinator's durable state: nodes, prompts, leases, accepted groups, the ledger, rejections, trainer
progress, and what several edge processes share (nonces, rate buckets, verify jobs, the swarm directory), in
SQLite (WAL, the default) or PostgreSQL.

All writes go through one writer thread (:class:`Database`, ``db.py``). Operations queued while a transaction
is running are committed together with it (group commit), so a busy intake pays one fsync for many accepted
groups, and every caller is answered only after its transaction is on disk: a node is told "accepted" only
once the group is durable.

Where things are:

- ``db.py``: the writer, its group commit and retries, the reader, ``connect``;
- ``schema.py``: every table, written once, and each database's triggers and migrations;
- ``sqlite.py``, ``pg.py``: the two connections, which answer the same questions about their database
  (``execute_together``, ``read``, ``snapshot``, ``rows_source``, ``writable_ctes``), and their errors
  mapped to :class:`StoreUnavailable`;
- one module per family of tables, each a set of plain functions of a connection: ``nodes.py`` (nodes,
  refusals, standing and its changes), ``leases.py`` (leases, the prompt pool, nonces), ``groups.py``
  (accepted groups, the trainer's queue), ``dashboard.py`` (the status API's reads), ``verify_jobs.py``,
  ``buckets.py`` (shared rate limits, live edges), ``swarm.py`` (the peer directory), ``kv.py``, and
  ``columns.py`` (states and packed blobs).

Callers use the names below (``from veriroll.coordinator import store as st``; ``st.register_node(conn, ...)``).
"""

from veriroll.coordinator.store import pg, schema
from veriroll.coordinator.store.buckets import (
    BucketRate,
    beat_edge,
    bucket_level,
    bucket_levels,
    forget_edge,
    forget_full_buckets,
    return_to_bucket,
    take_from_bucket,
)
from veriroll.coordinator.store.columns import (
    STANDINGS,
    LeaseState,
    PromptState,
    Standing,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)
from veriroll.coordinator.store.dashboard import (
    arrivals_per_bucket,
    first_arrival_ms,
    first_rejection_ms,
    list_nodes,
    observer_snapshot,
    queue_staleness,
    rejections_per_bucket,
    standing_counts,
    status_summary,
)
from veriroll.coordinator.store.db import (
    DB_ERRORS,
    TRANSIENT_RETRIES,
    Connection,
    Database,
    connect,
    database_target,
    execute_together,
    read_transaction,
    unavailable,
)
from veriroll.coordinator.store.groups import (
    TRAINER_HISTORY_KEY,
    AcceptedGroup,
    accept_group,
    commit_step,
    consumed_groups,
    drop_groups,
    group_answer,
    groups_with_samples,
    queued_group_versions,
    queued_groups,
    unconsume_after,
)
from veriroll.coordinator.store.kv import (
    kv_get,
    kv_set,
)
from veriroll.coordinator.store.leases import (
    LEASE_COLUMNS,
    PROMPT_COLUMNS,
    FreshPrompt,
    LeasedOne,
    LeaseRecord,
    expire_leases,
    forget_nonces,
    insert_lease,
    insert_leased_prompt,
    lease_limits,
    lease_one,
    load_lease,
    open_lease_totals,
    open_leases_of,
    prompts_drawn,
    release_open_leases,
    spend_lease,
    take_pending_prompt,
    use_nonces,
)
from veriroll.coordinator.store.nodes import (
    HARDWARE_TEXT_CHARS,
    MAX_GPUS,
    NAME_CHARS,
    STANDING_CHANGES_KEPT_MS,
    LiveSession,
    NodeRow,
    Session,
    bound_node_fields,
    bounded_text,
    count_rejection,
    end_session,
    find_node,
    forget_standing_changes,
    newest_standing_change,
    newest_standing_change_ms,
    node_by_id,
    node_ledger,
    other_live_session,
    record_refusal,
    register_node,
    rejections_by_node,
    rejections_by_reason,
    set_standing,
    standing_changes,
    touch_node,
)
from veriroll.coordinator.store.pg import StoreUnavailable, is_url
from veriroll.coordinator.store.sqlite import SQLITE_UNAVAILABLE
from veriroll.coordinator.store.swarm import (
    SwarmListing,
    SwarmReport,
    exchange_swarm_directory,
    refresh_swarm_listings,
    swarm_directory,
    write_swarm_listings,
    write_swarm_reports,
)
from veriroll.coordinator.store.verify_jobs import (
    JobState,
    Verdict,
    VerifyJob,
    claim_verify_job,
    enqueue_verify_job,
    finish_verify_job,
    forget_verify_jobs,
    reclaim_verify_jobs,
    release_verify_job,
    verify_jobs_waiting,
    verify_verdicts,
)

__all__ = [
    "DB_ERRORS", "accept_group", "AcceptedGroup", "arrivals_per_bucket", "beat_edge", "bound_node_fields",
    "bounded_text", "bucket_level", "bucket_levels", "BucketRate", "claim_verify_job", "commit_step",
    "connect", "Connection", "consumed_groups", "count_rejection", "Database", "database_target",
    "drop_groups", "end_session", "enqueue_verify_job", "exchange_swarm_directory", "execute_together",
    "expire_leases", "find_node", "finish_verify_job", "first_arrival_ms", "first_rejection_ms",
    "forget_edge", "forget_full_buckets", "forget_nonces", "forget_standing_changes",
    "forget_verify_jobs", "FreshPrompt", "group_answer", "groups_with_samples", "HARDWARE_TEXT_CHARS",
    "insert_lease", "insert_leased_prompt", "is_url", "JobState", "kv_get", "kv_set", "LEASE_COLUMNS",
    "lease_limits", "lease_one", "LeasedOne", "LeaseRecord", "LeaseState", "list_nodes", "LiveSession",
    "load_lease", "MAX_GPUS", "NAME_CHARS", "newest_standing_change", "newest_standing_change_ms",
    "node_by_id", "node_ledger", "NodeRow", "observer_snapshot", "open_lease_totals", "open_leases_of",
    "other_live_session", "pack_f32", "pack_i32", "pg", "PROMPT_COLUMNS", "prompts_drawn", "PromptState",
    "queue_staleness", "queued_group_versions", "queued_groups", "read_transaction",
    "reclaim_verify_jobs", "record_refusal", "refresh_swarm_listings", "register_node",
    "rejections_by_node", "rejections_by_reason", "rejections_per_bucket", "release_open_leases",
    "release_verify_job", "return_to_bucket", "schema", "Session", "set_standing", "spend_lease",
    "SQLITE_UNAVAILABLE", "Standing", "standing_changes", "STANDING_CHANGES_KEPT_MS", "standing_counts",
    "STANDINGS", "status_summary", "StoreUnavailable", "swarm_directory", "SwarmListing", "SwarmReport",
    "take_from_bucket", "take_pending_prompt", "touch_node", "TRAINER_HISTORY_KEY", "TRANSIENT_RETRIES",
    "unavailable", "unconsume_after", "unpack_f32", "unpack_i32", "use_nonces", "Verdict",
    "verify_jobs_waiting", "verify_verdicts", "VerifyJob", "write_swarm_listings", "write_swarm_reports",
]
