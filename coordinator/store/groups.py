"""Accepted groups and their samples: storing a group (the lease spent, the node credited), and the trainer's
side: the queue, consuming groups by step, dropping stale ones."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from veriroll.coordinator.store.columns import LeaseState, PromptState, Standing
from veriroll.coordinator.store.db import Connection
from veriroll.coordinator.store.kv import counter_total, kv_set


def queued_groups(conn: Connection) -> int:
    """Accepted groups waiting for the trainer (neither consumed nor dropped), in O(1): the counter's rows
    summed."""
    return counter_total(conn, "queued_groups")


@dataclass(frozen=True)
class AcceptedGroup:
    lease_id: str
    node_id: str
    prompt_id: int
    env: str
    policy_version: int
    temperature: float
    arrival_ms: int
    content_hash: str
    tokens: int
    rewards: list[float]
    verified: bool  # the verification stages ran and passed
    clean: bool  # counts towards leaving probation (verified, or verification is off for this coordinator)
    # Per sample: (token ids, log-probs, trusted log-probs or None) as packed blobs, and the finish reason.
    samples: list[tuple[bytes, bytes, bytes | None, str]]


@functools.lru_cache(maxsize=64)
def _insert_samples_sql(n: int) -> str:
    return ("INSERT INTO samples(group_id, idx, token_ids, logprobs, trusted_logprobs, reward, finish_reason) VALUES"
            + ", ".join(["(?, ?, ?, ?, ?, ?, ?)"] * n))


def accept_group(conn: Connection, group: AcceptedGroup, *, probation_groups: int) -> int | None:
    """Spend the lease on the group, store the group, mark its prompt done and credit the node; the group id,
    or None when the lease is no longer open (a concurrent submission won). Where the database has
    data-modifying CTEs (PostgreSQL), one statement."""
    if conn.writable_ctes:
        return _accept_group_in_one_statement(conn, group, probation_groups=probation_groups)
    n = conn.execute("UPDATE leases SET state = ? WHERE lease_id = ? AND state = ?",
                     (LeaseState.SUBMITTED, group.lease_id, LeaseState.OPEN)).rowcount
    if n != 1:
        return None
    mean_reward = sum(group.rewards) / len(group.rewards) if group.rewards else 0.0
    gid = int(conn.execute(
        "INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, arrival_ms, content_hash, "
        "tokens, mean_reward, verified) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) RETURNING group_id",
        (group.lease_id, group.node_id, group.prompt_id, group.env, group.policy_version, group.temperature,
         group.arrival_ms, group.content_hash, group.tokens, mean_reward, int(group.verified))).fetchone()[0])
    conn.execute("UPDATE prompts SET state = ? WHERE prompt_id = ?", (PromptState.DONE, group.prompt_id))
    conn.execute(*_credit_node_statement(group.node_id, group.tokens, clean=group.clean, now_ms=group.arrival_ms,
                                         probation_groups=probation_groups))
    if group.samples:  # one statement for all samples
        conn.execute(_insert_samples_sql(len(group.samples)),
                     [v for i, (tok, lp, trusted, finish) in enumerate(group.samples)
                      for v in (gid, i, tok, lp, trusted, group.rewards[i], finish)])
    return gid


@functools.lru_cache(maxsize=64)
def _accept_group_statement(n: int) -> str:
    """accept_group as one statement (data-modifying CTEs, PostgreSQL): its five writes as data-modifying CTEs, each but the first
    fed by the one before it (no group unless the lease was still open; nothing else without the group)."""
    credit, _ = _credit_node_statement("", 0, clean=False, now_ms=0, probation_groups=0)
    samples = ", ".join(["(?::bigint, ?::bytea, ?::bytea, ?::bytea, ?::float8, ?::text)"] * n)
    return ("WITH spent AS (UPDATE leases SET state = ? WHERE lease_id = ? AND state = ? RETURNING lease_id), "
            "g AS (INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, arrival_ms, "
            "content_hash, tokens, mean_reward, verified) "
            "SELECT lease_id, ?::text, ?, ?::text, ?, ?, ?, ?::text, ?, ?, ? FROM spent RETURNING group_id)"
            + (", s AS (INSERT INTO samples(group_id, idx, token_ids, logprobs, trusted_logprobs, reward, finish_reason) "
               f"SELECT g.group_id, v.* FROM g CROSS JOIN (VALUES {samples}) AS v)" if n else "")
            + ", p AS (UPDATE prompts SET state = ? WHERE prompt_id = ? AND EXISTS (SELECT 1 FROM g)), "
            f"c AS ({credit} AND EXISTS (SELECT 1 FROM g)) SELECT group_id FROM g")


def _accept_group_in_one_statement(conn: Connection, group: AcceptedGroup, *, probation_groups: int) -> int | None:
    # One round trip and one statement where the SQLite path takes five statements: an edge's writer waits on
    # PostgreSQL, and takes the GIL back from the event loop, once per group instead of three times.
    mean_reward = sum(group.rewards) / len(group.rewards) if group.rewards else 0.0
    _, credit = _credit_node_statement(group.node_id, group.tokens, clean=group.clean, now_ms=group.arrival_ms,
                                       probation_groups=probation_groups)
    params = [LeaseState.SUBMITTED, group.lease_id, LeaseState.OPEN,
              group.node_id, group.prompt_id, group.env, group.policy_version, group.temperature, group.arrival_ms,
              group.content_hash, group.tokens, mean_reward, int(group.verified)]
    for i, (tok, lp, trusted, finish) in enumerate(group.samples):
        params += (i, tok, lp, trusted, group.rewards[i], finish)
    params += (PromptState.DONE, group.prompt_id, *credit)
    row = conn.execute(_accept_group_statement(len(group.samples)), params).fetchone()
    return None if row is None else int(row[0])


def _credit_node_statement(node_id: str, tokens: int, *, clean: bool, now_ms: int,
                           probation_groups: int) -> tuple[str, tuple]:
    """The UPDATE crediting an accepted group; ``probation_groups`` clean groups since the last strike make a
    node trusted."""
    # SET expressions see the row before the update: clean_groups + ? is the new count.
    return ("UPDATE nodes SET accepted_groups = accepted_groups + 1, accepted_tokens = accepted_tokens + ?, "
            "clean_groups = clean_groups + ?, last_seen_ms = ?, standing = CASE WHEN standing = ? "
            "AND clean_groups + ? >= ? THEN ? ELSE standing END WHERE node_id = ?",
            (tokens, int(clean), now_ms, Standing.PROBATION, int(clean), probation_groups, Standing.TRUSTED, node_id))


def group_answer(conn: Connection, group_id: int) -> tuple[int, list[float]]:
    """(credited tokens, rewards by sample) of an accepted group: the answer to a retried submission."""
    g = conn.execute("SELECT tokens FROM groups WHERE group_id = ?", (group_id,)).fetchone()
    rewards = [r["reward"] for r in conn.execute("SELECT reward FROM samples WHERE group_id = ? ORDER BY idx",
                                                 (group_id,))]
    return int(g["tokens"]), rewards


# The trainer's side


def queued_group_versions(conn: Connection) -> list[tuple[int, int]]:
    """(group id, policy version) of every queued group (neither consumed nor dropped), oldest first."""
    return [(int(r[0]), int(r[1])) for r in conn.execute(
        "SELECT group_id, policy_version FROM groups WHERE consumed_step IS NULL AND dropped IS NULL ORDER BY group_id")]


def groups_with_samples(conn: Connection, group_ids: list[int]) -> dict[int, tuple[dict, list[dict]]]:
    """``{group id: (group row with its prompt's token ids, [sample rows in order])}``."""
    if not group_ids:
        return {}
    marks = ",".join("?" * len(group_ids))
    out: dict[int, tuple[dict, list[dict]]] = {}
    for r in conn.execute(f"SELECT g.group_id, g.env, g.policy_version, g.temperature, g.tokens, p.prompt_ids "
                          f"FROM groups g JOIN prompts p ON p.prompt_id = g.prompt_id WHERE g.group_id IN ({marks})",
                          group_ids):
        out[int(r["group_id"])] = (dict(r), [])
    for r in conn.execute(f"SELECT group_id, token_ids, logprobs, trusted_logprobs, reward FROM samples "
                          f"WHERE group_id IN ({marks}) ORDER BY group_id, idx", group_ids):
        if int(r["group_id"]) in out:
            out[int(r["group_id"])][1].append(dict(r))
    return out


def drop_groups(conn: Connection, group_ids: list[int], why: str) -> dict[int, int]:
    """Mark queued groups dropped (``why``: e.g. 'stale'); returns ``{group id: samples}`` of those given."""
    if not group_ids:
        return {}
    marks = ",".join("?" * len(group_ids))
    sizes = {int(g): int(n) for g, n in conn.execute(
        f"SELECT group_id, COUNT(*) FROM samples WHERE group_id IN ({marks}) GROUP BY group_id", group_ids)}
    conn.execute(f"UPDATE groups SET dropped = ? WHERE group_id IN ({marks}) AND consumed_step IS NULL "
                 "AND dropped IS NULL", [why, *group_ids])
    return sizes


def commit_step(conn: Connection, step: int, group_ids: list[int], history: list[dict],
                new_version: int | None) -> None:
    """A trainer step, all or nothing: its groups consumed, the step counter, the history and the policy
    version. Raises when a group was consumed or dropped meanwhile (the transaction then rolls back)."""
    if group_ids:
        marks = ",".join("?" * len(group_ids))
        n = conn.execute(f"UPDATE groups SET consumed_step = ? WHERE group_id IN ({marks}) "
                         "AND consumed_step IS NULL AND dropped IS NULL", [step, *group_ids]).rowcount
        if n != len(group_ids):
            raise RuntimeError(f"step {step}: {len(group_ids) - n} of its groups were consumed or dropped meanwhile")
    kv_set(conn, "trainer_step", step)
    kv_set(conn, TRAINER_HISTORY_KEY, history)
    if new_version is not None:
        kv_set(conn, "policy_version", new_version)


def unconsume_after(conn: Connection, step: int) -> list[int]:
    """Groups consumed by steps after ``step`` (lost with the weights of a crash) are queued again."""
    return [int(r[0]) for r in conn.execute(
        "UPDATE groups SET consumed_step = NULL WHERE consumed_step > ? RETURNING group_id", (step,))]


def consumed_groups(conn: Connection, up_to_step: int | None = None) -> int:
    """Groups trained on (by steps ≤ ``up_to_step``, or by any step)."""
    if up_to_step is None:
        return int(conn.execute("SELECT COUNT(*) FROM groups WHERE consumed_step IS NOT NULL").fetchone()[0])
    return int(conn.execute("SELECT COUNT(*) FROM groups WHERE consumed_step IS NOT NULL AND consumed_step <= ?",
                            (up_to_step,)).fetchone()[0])


TRAINER_HISTORY_KEY = "trainer_history"
