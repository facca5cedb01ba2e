"""The verifier pool: trusted workers that judge the groups edges queue in the store.

With ``verifier.pool`` on, an edge does not run the model. For a group it audits it queues a job (the
lease id, the node, its address and the submission as it arrived) and awaits the job's verdict
(:class:`VerdictWaiter`); then it goes on exactly as after in-process verification: the refusal is
recorded, or the rewards are computed and the group committed. "Accepted" still means verified and
committed. Workers (:class:`VerifierPool`, ``coordinator run --role verifier``, one process or many, on
other machines or devices) claim the oldest pending job, run :class:`~veriroll.coordinator.verifier.
TrustedVerifier` on the trusted weights of the lease's version, and write the verdict.

Failure handling, all through the store:

- a claim lasts ``verifier.claim_timeout_s``; a worker killed mid-group loses its job then, and any
  worker takes it up again (``reclaim_verify_jobs``), up to ``MAX_CLAIMS`` times; a worker stopped
  cleanly hands it back at once;
- the first verdict written stands (``finish_verify_job``), so a group is judged once even when a slow
  worker finishes after the one that reclaimed its job;
- an edge waits ``verifier.wait_s`` for a verdict, then refuses the group ``unavailable`` (retryable, the
  lease kept). The node's retry of the same content (same ``content_hash``) finds the same job, pending
  or judged, and is never queued or verified twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from veriroll.coordinator import store as st
from veriroll.coordinator.intake import Rejection, Submission
from veriroll.protos.reasons import Reason
from veriroll.protos.v1 import coordinator_pb2 as pb

log = logging.getLogger("veriroll.coordinator")

# How often an edge looks for the verdicts it awaits: at once after one arrived, backing off to the slowest
# while none does. One read per poll answers every group this process awaits.
VERDICT_POLL_MIN_S = 0.005
VERDICT_POLL_MAX_S = 0.1
# How often an idle worker looks for a job, backing off the same way.
CLAIM_POLL_MIN_S = 0.01
CLAIM_POLL_MAX_S = 0.25
HOUSEKEEPING_EVERY_S = 1.0
# A job claimed this many times without a verdict (each claimant killed or hung on it) is refused instead
# of handed to yet another worker: one group must not take the pool down worker after worker.
MAX_CLAIMS = 3


def pack_trusted(trusted: list | None) -> bytes | None:
    """Every sample's trusted log-probs, concatenated float32 in sample order (the verdict's form)."""
    if trusted is None:
        return None
    return b"".join(st.pack_f32(t) for t in trusted)


def unpack_trusted(blob: bytes | None, sub: Submission) -> list[np.ndarray] | None:
    """The verdict's trusted log-probs split back per sample, by the submission's sample lengths."""
    if blob is None:
        return None
    flat = st.unpack_f32(blob)
    ends = np.cumsum([len(s.token_ids) for s in sub.samples])
    tokens = int(ends[-1]) if len(ends) else 0
    if len(flat) != tokens:
        raise ValueError(f"a verdict holds {len(flat)} trusted log-probs for {tokens} tokens")
    return np.split(flat, ends[:-1])


def rejection_of(verdict: st.Verdict) -> Rejection | None:
    """The verdict as the intake's rejection (None: passed)."""
    if verdict.reason is None:
        return None
    try:
        return Rejection(Reason(verdict.reason), verdict.detail)
    except ValueError:  # a reason this release does not know (a newer worker): refuse, fail closed, no strike
        return Rejection(Reason.INTERNAL, f"verifier reason {verdict.reason[:32]!r}: {verdict.detail}")


# --- the edge's side --------------------------------------------------------------------------------


class VerdictWaiter:
    """Queues groups for the pool and awaits their verdicts (``Intake.use_verifier_pool``).

    One polling task per process, running only while some group is awaited, reads the verdicts of all of
    them in one store read, so the store sees one read per poll however many nodes wait.
    """

    def __init__(self, db: st.Database, *, wait_s: float, clock):
        self.db = db
        self.wait_s = wait_s
        self.clock = clock  # milliseconds, the service's clock
        self._waiting: dict[int, list[asyncio.Future]] = {}
        self._poller: asyncio.Task | None = None

    async def verify(self, lease: st.LeaseRecord, node_id: str, peer: str, digest: str, submission: bytes,
                     sub: Submission) -> tuple[Rejection | None, list[np.ndarray] | None, float]:
        """(rejection or None, trusted log-probs per sample when passed, verifier seconds) for one group, or an
        ``unavailable`` rejection with no seconds when no verdict came within ``wait_s``."""
        job_id = await self.db.run(lambda conn: st.enqueue_verify_job(
            conn, lease.lease_id, digest, node_id, peer, submission, self.clock()))
        fut = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(job_id, []).append(fut)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(), name="veriroll-verdicts")
        try:
            verdict = await asyncio.wait_for(fut, self.wait_s)
        except TimeoutError:
            return Rejection(Reason.UNAVAILABLE, f"the verifier pool has not judged this group within {self.wait_s:g} s; "
                                                 "submit the same group again (it stays queued)"), None, 0.0
        finally:
            waiters = self._waiting.get(job_id, [])
            if fut in waiters:
                waiters.remove(fut)
            if not waiters:
                self._waiting.pop(job_id, None)
        return rejection_of(verdict), unpack_trusted(verdict.trusted_logprobs, sub), verdict.seconds

    async def _poll(self) -> None:
        delay = VERDICT_POLL_MIN_S
        while self._waiting:
            job_ids = list(self._waiting)
            try:
                verdicts = await self.db.run_read(lambda conn, ids=job_ids: st.verify_verdicts(conn, ids))
            except st.StoreUnavailable as exc:
                log.warning("reading verdicts: the store is unavailable (%s)", exc)
                verdicts = {}
            except st.DB_ERRORS:
                log.exception("reading verdicts failed; retrying")  # waiters run into wait_s meanwhile
                verdicts = {}
            for job_id, verdict in verdicts.items():
                for fut in self._waiting.pop(job_id, []):
                    if not fut.done():
                        fut.set_result(verdict)
            delay = VERDICT_POLL_MIN_S if verdicts else min(delay * 2, VERDICT_POLL_MAX_S)
            await asyncio.sleep(delay)

    def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()


# --- the workers ------------------------------------------------------------------------------------


class VerifierPool:
    """``workers`` worker loops in this process, and the pool's housekeeping (expired claims back to pending,
    old verdicts dropped). Each loop verifies one group at a time in its own thread."""

    def __init__(self, db: st.Database, verifier, *, workers: int, claim_timeout_s: float, keep_verdicts_s: float,
                 metrics=None, name: str | None = None):
        self.db = db
        self.verifier = verifier  # a TrustedVerifier (or anything with its verify_group)
        self.workers = workers
        self.claim_ms = int(claim_timeout_s * 1000)
        self.keep_verdicts_ms = int(keep_verdicts_s * 1000)
        self.metrics = metrics
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.judged = 0  # verdicts this process wrote
        self._threads = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="veriroll-verifier")

    def start(self) -> list[asyncio.Task]:
        """The worker loops and the housekeeping loop, as tasks (cancel them to stop; a held job is released)."""
        tasks = [asyncio.create_task(self.work(f"{self.name}/{i}"), name=f"veriroll-verifier-{i}")
                 for i in range(self.workers)]
        tasks.append(asyncio.create_task(self._housekeeping(), name="veriroll-verifier-housekeeping"))
        return tasks

    async def work(self, worker: str) -> None:
        """Claim, verify, write the verdict; forever (until cancelled)."""
        delay = CLAIM_POLL_MIN_S
        while True:
            try:
                claimed = await self.claim(worker)
            except st.StoreUnavailable as exc:  # PostgreSQL restarting: a line, not a traceback per poll
                log.warning("claiming a verification job: the store is unavailable (%s)", exc)
                claimed = None
            except st.DB_ERRORS:
                log.exception("claiming a verification job failed; retrying")
                claimed = None
            if claimed is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, CLAIM_POLL_MAX_S)
                continue
            delay = CLAIM_POLL_MIN_S
            try:
                await self._settle(worker, *claimed)
            except st.DB_ERRORS:  # the worker lives on; the job goes back to the queue at its claim deadline
                log.exception("writing the verdict of job %d failed", claimed[0].job_id)

    async def claim(self, worker: str) -> tuple[st.VerifyJob, st.LeaseRecord | None, dict | None] | None:
        """The oldest pending job, now claimed by ``worker``, with its lease and prompt (one store transaction)."""
        def claim_with_lease(conn):
            job = st.claim_verify_job(conn, worker, _now_ms() + self.claim_ms)
            if job is None:
                return None
            row, prompt, _ = st.load_lease(conn, job.lease_id)
            return job, None if row is None else st.LeaseRecord.from_row(row), prompt

        return await self.db.run(claim_with_lease)

    async def _settle(self, worker: str, job: st.VerifyJob, lease: st.LeaseRecord | None, prompt: dict | None) -> None:
        try:
            verdict = await self.judge(job, lease, prompt)
        except asyncio.CancelledError:
            # Stopping cleanly: hand the job back now rather than at its claim deadline.
            await self.db.run(lambda conn: st.release_verify_job(conn, job.job_id, worker))
            raise
        if await self.db.run(lambda conn: st.finish_verify_job(conn, job.job_id, verdict, _now_ms())):
            self.judged += 1

    async def judge(self, job: st.VerifyJob, lease: st.LeaseRecord | None, prompt: dict | None) -> st.Verdict:
        """The verdict on one job: the lease must still be open, then the verifier's stages."""
        if job.claims > MAX_CLAIMS:
            log.error("job %d (lease %s) was claimed %d times without a verdict: refused", job.job_id, job.lease_id,
                      job.claims - 1)
            return st.Verdict(Reason.INTERNAL.value, f"{job.claims - 1} verifier workers stopped on this group")
        if lease is None or lease.state != st.LeaseState.OPEN or _now_ms() > lease.deadline_ms:
            # Ended while queued (expired, or another submission won it): no model time for it.
            return st.Verdict(Reason.LEASE_EXPIRED.value, f"lease {job.lease_id} ended before it was verified")
        try:
            sub = Submission.from_proto(pb.SubmitGroupRequest.FromString(job.submission))
        except Exception as exc:  # the edge parsed these bytes already; fail closed, without a strike
            log.exception("job %d holds an unreadable submission", job.job_id)
            return st.Verdict(Reason.INTERNAL.value, f"unreadable queued submission: {type(exc).__name__}")
        prompt_ids = st.unpack_i32(prompt["prompt_ids"]).tolist()
        result = await asyncio.get_running_loop().run_in_executor(
            self._threads, self.verifier.verify_group, lease, prompt_ids, sub)
        if self.metrics is not None:
            self.metrics.verify_latency.observe(result.seconds)
        if result.rejection is not None:
            return st.Verdict(result.rejection.reason.value, result.rejection.detail, None, result.seconds)
        return st.Verdict(None, "", pack_trusted(result.trusted_logprobs), result.seconds)

    async def _housekeeping(self) -> None:
        while True:
            try:
                now = _now_ms()
                reclaimed = await self.db.run(lambda conn, now=now: st.reclaim_verify_jobs(conn, now))
                if reclaimed:
                    log.warning("%d verification job(s) held past their claim deadline went back to the queue",
                                reclaimed)
                await self.db.run(lambda conn, before=now - self.keep_verdicts_ms: st.forget_verify_jobs(conn, before))
            except st.DB_ERRORS:
                log.exception("verifier pool housekeeping failed")
            await asyncio.sleep(HOUSEKEEPING_EVERY_S)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


def _now_ms() -> int:
    """Wall-clock milliseconds: claim deadlines are compared across processes and machines."""
    return int(time.time() * 1000)
