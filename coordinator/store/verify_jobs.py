"""Verification jobs: edges hand audited groups to the verifier pool (coordinator/verifier_pool.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from veriroll.coordinator.store.db import Connection


class JobState(StrEnum):
    """pending → claimed (a worker verifies it until its claim deadline) → done (the verdict is written);
    a claim past its deadline (the worker died) goes back to pending."""

    PENDING = "pending"
    CLAIMED = "claimed"
    DONE = "done"


@dataclass(frozen=True)
class VerifyJob:
    """What a verifier worker needs: the lease, and the node's submission as it arrived (SubmitGroupRequest)."""

    job_id: int
    lease_id: str
    content_hash: str
    node_id: str
    peer: str
    submission: bytes
    created_ms: int
    claims: int  # times claimed and not handed back, this one included (more than 1: a worker died on it)


@dataclass(frozen=True)
class Verdict:
    """A finished job: ``reason`` None when the group passed, its trusted log-probs (every sample's, concatenated
    float32, in sample order) then; the verifier seconds it cost either way."""

    reason: str | None
    detail: str = ""
    trusted_logprobs: bytes | None = None
    seconds: float = 0.0


def enqueue_verify_job(conn: Connection, lease_id: str, content_hash: str, node_id: str, peer: str,
                       submission: bytes, now_ms: int) -> int:
    """Queue a group for the verifier pool; the job id. An honest retry of the same content finds its job
    (pending, claimed or done) instead of queueing the group twice."""
    conn.execute("INSERT INTO verify_jobs(lease_id, content_hash, node_id, peer, submission, created_ms, state) "
                 "VALUES(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(lease_id, content_hash) DO NOTHING",
                 (lease_id, content_hash, node_id, peer, submission, now_ms, JobState.PENDING))
    return int(conn.execute("SELECT job_id FROM verify_jobs WHERE lease_id = ? AND content_hash = ?",
                            (lease_id, content_hash)).fetchone()[0])


def claim_verify_job(conn: Connection, worker: str, deadline_ms: int) -> VerifyJob | None:
    """The oldest pending job, now claimed by ``worker`` until ``deadline_ms``; None when none is pending."""
    # As in take_pending_prompt: SKIP LOCKED (PostgreSQL) lets workers in other processes claim side by side,
    # and the outer state check keeps two of them from claiming one job.
    row = conn.execute("UPDATE verify_jobs SET state = ?, worker = ?, claims = claims + 1, claim_deadline_ms = ? "
                       "WHERE state = ? AND job_id = (SELECT job_id FROM verify_jobs WHERE state = ? ORDER BY job_id "
                       "LIMIT 1 /*SKIP LOCKED*/) "
                       "RETURNING job_id, lease_id, content_hash, node_id, peer, submission, created_ms, claims",
                       (JobState.CLAIMED, worker, deadline_ms, JobState.PENDING, JobState.PENDING)).fetchone()
    if row is None:
        return None
    return VerifyJob(int(row[0]), row[1], row[2], row[3], row[4], bytes(row[5]), int(row[6]), int(row[7]))


def reclaim_verify_jobs(conn: Connection, now_ms: int) -> int:
    """Claims past their deadline (their worker was killed or hung) go back to pending; how many."""
    return conn.execute("UPDATE verify_jobs SET state = ?, worker = '' WHERE state = ? AND claim_deadline_ms < ?",
                        (JobState.PENDING, JobState.CLAIMED, now_ms)).rowcount


def release_verify_job(conn: Connection, job_id: int, worker: str) -> bool:
    """A worker stopping cleanly hands its claim back at once, rather than at its deadline (uncounted: the
    group did not stop that worker)."""
    return bool(conn.execute("UPDATE verify_jobs SET state = ?, worker = '', claims = claims - 1 WHERE job_id = ? "
                             "AND state = ? AND worker = ?",
                             (JobState.PENDING, job_id, JobState.CLAIMED, worker)).rowcount)


def finish_verify_job(conn: Connection, job_id: int, verdict: Verdict, now_ms: int) -> bool:
    """Write a job's verdict; False when it already had one (a worker past its deadline finished after the one
    that reclaimed it: the first verdict stands, so a group is judged once)."""
    return bool(conn.execute(
        "UPDATE verify_jobs SET state = ?, reason = ?, detail = ?, trusted_logprobs = ?, seconds = ?, finished_ms = ?, "
        "submission = ? WHERE job_id = ? AND state <> ?",
        (JobState.DONE, verdict.reason, verdict.detail, verdict.trusted_logprobs, verdict.seconds, now_ms, b"", job_id,
         JobState.DONE)).rowcount)


def verify_verdicts(conn: Connection, job_ids: list[int]) -> dict[int, Verdict]:
    """``{job id: verdict}`` of those of ``job_ids`` that have one (the others wait or are being verified)."""
    if not job_ids:
        return {}
    marks = ",".join("?" * len(job_ids))
    return {int(r[0]): Verdict(r[1], r[2], None if r[3] is None else bytes(r[3]), float(r[4])) for r in conn.execute(
        f"SELECT job_id, reason, detail, trusted_logprobs, seconds FROM verify_jobs WHERE job_id IN ({marks}) "
        "AND state = ?", [*job_ids, JobState.DONE])}


def verify_jobs_waiting(conn: Connection) -> int:
    """Jobs without a verdict yet (pending or claimed): the pool's backlog."""
    return int(conn.execute("SELECT COUNT(*) FROM verify_jobs WHERE state <> ?", (JobState.DONE,)).fetchone()[0])


def forget_verify_jobs(conn: Connection, finished_before_ms: int) -> int:
    """Verdicts finished before ``finished_before_ms`` are dropped: by then their leases have ended, so no
    retry can use them (an accepted group answers its retries from the groups table)."""
    return conn.execute("DELETE FROM verify_jobs WHERE state = ? AND finished_ms < ?",
                        (JobState.DONE, finished_before_ms)).rowcount
