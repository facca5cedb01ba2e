"""The intake: what happens to a submitted group after the door let it in.

A submitted group passes, in order of cost: signature and replay window (at the door, ``edge.py``) →
lease → shape and bounds → precision → staleness → verification (``verifier.py``, the only stage that
runs the model: in this process, or in the verifier pool, ``verifier_pool.py``) → reward (a worker process) → one store transaction that accepts it, or spends the
lease and records the refusal.

The stages before verification are pure functions of plain data that return ``None`` to pass or a
:class:`Rejection` naming one :class:`~veriroll.protos.reasons.Reason`; :class:`Intake` runs them
against the store.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import random
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from veriroll.coordinator import store as st
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.edge import Refusal
from veriroll.coordinator.ledger import Ledger, NodeInfo
from veriroll.coordinator.metrics import CoordinatorMetrics
from veriroll.coordinator.policy import PolicyState
from veriroll.coordinator.store import LeaseRecord
from veriroll.protos.reasons import Reason
from veriroll.protos.v1 import coordinator_pb2 as pb

log = logging.getLogger("veriroll.coordinator")

# A proof is a small header plus at most 258 bytes per 32 generated tokens; anything far beyond that is
# junk sent to waste verifier time or disk.
PROOF_HEADER_ALLOWANCE = 64


@dataclass(frozen=True)
class Rejection:
    reason: Reason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail or self.reason.message}"


@dataclass
class SubmittedSample:
    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T] (or malformed length, caught by check_shape)
    proof: bytes
    finish_reason: str


@dataclass
class Submission:
    lease_id: str
    policy_version: int
    samples: list[SubmittedSample]
    compute_dtype: str = "float32"

    @classmethod
    def from_proto(cls, req) -> Submission:
        samples = []
        for s in req.samples:
            raw = s.logprobs
            tail = len(raw) % 4
            if tail:
                # A length that is not a multiple of 4 cannot be float32s: keep what parses, let
                # check_shape reject the count mismatch with a precise reason.
                lp = np.concatenate([np.frombuffer(raw[:-tail], dtype="<f4"), np.array([np.nan], dtype="<f4")])
            else:
                lp = np.frombuffer(raw, dtype="<f4")
            samples.append(SubmittedSample(np.asarray(s.token_ids, dtype=np.int64), lp, bytes(s.proof), s.finish_reason))
        return cls(req.lease_id, int(req.policy_version), samples, req.compute_dtype or "float32")

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


def content_hash(sub: Submission) -> str:
    """A digest of everything a submission claims; equal for an honest retry of the same group."""
    h = hashlib.sha256()
    h.update(sub.lease_id.encode())
    h.update(str(sub.policy_version).encode())
    for s in sub.samples:
        h.update(np.asarray(s.token_ids, dtype="<i8").tobytes())
        h.update(np.asarray(s.logprobs, dtype="<f4").tobytes())
        h.update(hashlib.sha256(s.proof).digest())
        h.update(s.finish_reason.encode())
    if sub.compute_dtype != "float32":  # (absent before nodes declared it: old digests stay valid)
        h.update(sub.compute_dtype.encode())
    return h.hexdigest()


def check_lease(lease: LeaseRecord | None, node_id: str, now_ms: int) -> Rejection | None:
    """The lease exists, was issued to this node, is still open and unexpired."""
    if lease is None:
        return Rejection(Reason.LEASE_UNKNOWN)
    if lease.node_id != node_id:
        return Rejection(Reason.LEASE_NOT_YOURS, f"lease {lease.lease_id} belongs to another node")
    if lease.state == st.LeaseState.SUBMITTED:
        return Rejection(Reason.LEASE_USED)
    if lease.state != st.LeaseState.OPEN or now_ms > lease.deadline_ms:
        why = lease.state if lease.state != st.LeaseState.OPEN else "past its deadline"
        return Rejection(Reason.LEASE_EXPIRED, f"lease {lease.lease_id} is {why}")
    return None


def max_proof_bytes(num_tokens: int, per_token: int) -> int:
    return PROOF_HEADER_ALLOWANCE + per_token * max(num_tokens, 1) + 258


def check_shape(sub: Submission, lease: LeaseRecord, *, vocab_size: int, max_proof_bytes_per_token: int = 16,
                require_proof: bool = True) -> Rejection | None:
    """Whole group present, lengths and ids in bounds, log-probs finite and <= 0, proofs bounded."""
    if len(sub.samples) != lease.group_size:
        return Rejection(Reason.WRONG_GROUP_SIZE, f"got {len(sub.samples)} samples, the lease asks for {lease.group_size}")
    if sub.policy_version != lease.policy_version:
        return Rejection(Reason.VERSION_MISMATCH,
                         f"generated with version {sub.policy_version}, the lease names {lease.policy_version}")
    # Vectorized over the whole group: a few numpy calls on all tokens at once, then plain-int loops
    # over the samples (this runs for every submitted group, so it is kept lean).
    samples = sub.samples
    lengths = [len(s.token_ids) for s in samples]
    for i, n in enumerate(lengths):
        if n == 0 or n > lease.max_new_tokens:
            return Rejection(Reason.TOO_LONG, f"sample {i} has {n} tokens, allowed 1..{lease.max_new_tokens}")
    starts = np.cumsum([0, *lengths[:-1]])
    tokens = np.concatenate([s.token_ids for s in samples])
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        first = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
        i = int(np.searchsorted(starts, first, side="right")) - 1
        return Rejection(Reason.TOKEN_OUT_OF_VOCAB, f"sample {i} has a token outside [0, {vocab_size})")
    for i, s in enumerate(samples):
        if len(s.logprobs) != lengths[i]:
            return Rejection(Reason.BAD_LOGPROBS, f"sample {i} has {len(s.logprobs)} log-probs for {lengths[i]} tokens")
    logprobs = np.concatenate([s.logprobs for s in samples])
    # Finite and <= 0 in one pass: NaN fails both comparisons, +inf the first, -inf the second.
    good = (logprobs <= 0.0) & (logprobs > -np.inf)
    if not good.all():
        first = int(np.flatnonzero(~good)[0])
        i = int(np.searchsorted(starts, first, side="right")) - 1
        return Rejection(Reason.BAD_LOGPROBS, f"sample {i} has a log-prob that is NaN, infinite or > 0")
    for i, s in enumerate(samples):
        if len(s.proof) > max_proof_bytes(lengths[i], max_proof_bytes_per_token) or (require_proof and not s.proof):
            return Rejection(Reason.PROOF_TOO_LARGE if s.proof else Reason.TOPLOC_FAILED,
                             f"sample {i} proof is {len(s.proof)} bytes for {lengths[i]} tokens")
    is_stop = np.zeros(len(tokens), dtype=bool)
    for stop in lease.stop_token_ids:  # a handful of ids: cheaper than np.isin
        is_stop |= tokens == stop
    stops_per_sample = np.add.reduceat(is_stop, starts, dtype=np.int64).tolist()
    end_is_stop = is_stop[starts + np.asarray(lengths) - 1].tolist()
    for i, s in enumerate(samples):
        ends_on_stop = end_is_stop[i]
        if stops_per_sample[i] - ends_on_stop or s.finish_reason not in ("stop", "length") \
                or (s.finish_reason == "stop") != ends_on_stop \
                or (s.finish_reason == "length" and lengths[i] != lease.max_new_tokens):
            return Rejection(Reason.BAD_FINISH, f"sample {i}: finish_reason {s.finish_reason[:32]!r} does not match its tokens")
    return None


def check_staleness(sub: Submission, current_version: int, s_max: int) -> Rejection | None:
    """The group's version lies within ``s_max`` of the newest policy version."""
    if sub.policy_version > current_version:
        return Rejection(Reason.VERSION_MISMATCH, f"version {sub.policy_version} does not exist yet")
    if current_version - sub.policy_version > s_max:
        return Rejection(Reason.STALE_VERSION,
                         f"version {sub.policy_version} is {current_version - sub.policy_version} behind {current_version} (s_max {s_max})")
    return None


KNOWN_DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(sub: Submission, accepted: list[str] | tuple[str, ...]) -> Rejection | None:
    """The precision the node generated in is one this coordinator verifies (``intake.accepted_dtypes``).

    The claim selects the verifier's tolerances, so it is bounded to known names; claiming a coarser
    precision than the engine used only loosens the checks to what the operator already accepts.
    """
    if sub.compute_dtype not in KNOWN_DTYPES:
        return Rejection(Reason.DTYPE_NOT_ACCEPTED, f"unknown compute dtype {sub.compute_dtype[:32]!r}; "
                                                   f"use one of {', '.join(KNOWN_DTYPES)}")
    if sub.compute_dtype not in accepted:
        return Rejection(Reason.DTYPE_NOT_ACCEPTED, f"groups generated in {sub.compute_dtype} are not accepted here "
                                                   f"(accepted: {', '.join(accepted)})")
    return None


def token_credit(sub: Submission) -> int:
    return sub.num_tokens


def is_finite_reward(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x)


# --- the intake against the store -------------------------------------------------------------------

MESSAGES_META_KEY = "_messages"
"""Key of the rendered conversation in a stored prompt's meta (taken out again before the reward sees meta)."""


class GroupVerifier(Protocol):
    """The verification stages (TOPLOC, sampling, log-probs) on the trusted model of ``lease.policy_version``;
    returns a ``verifier.VerificationResult`` (rejection, trusted_logprobs, seconds)."""

    def verify_group(self, lease: LeaseRecord, prompt_ids: list[int], sub: Submission): ...


def sample_blobs(sub: Submission) -> list[tuple[bytes, bytes, bytes | None, str]]:
    """Each sample as stored: token ids, log-probs, trusted log-probs (filled by verification), finish reason."""
    return [(st.pack_i32(s.token_ids), st.pack_f32(s.logprobs), None, s.finish_reason) for s in sub.samples]


# Refusals that leave the lease as it was: not this node's or already closed, or (rate_limited: the
# verifier budget; unavailable: no verdict from the verifier pool in time) not judged yet, so the node may
# submit the same group again while the lease lasts.
_KEEPS_THE_LEASE = frozenset({Reason.LEASE_EXPIRED, Reason.LEASE_USED, Reason.LEASE_UNKNOWN, Reason.RATE_LIMITED,
                              Reason.UNAVAILABLE})


class Intake:
    """SubmitGroup: checks, verification, rewards, then one store transaction for the verdict.

    Every rejection is recorded here with its lease (and the lease spent where the content failed), and
    raised as a counted :class:`Refusal`. The verifier and the rewards run off the event loop and off the
    store's writer, which every node's submission waits on.
    """

    def __init__(self, cfg: CoordinatorConfig, db: st.Database, *, ledger: Ledger, policy: PolicyState,
                 metrics: CoordinatorMetrics, clock, vocab_size: int, rewards, codec, stop_token_ids: list[int],
                 verifier: GroupVerifier | None = None, verify_budget=None):
        self.cfg = cfg
        self.db = db
        self.ledger = ledger
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.vocab_size = vocab_size
        self.rewards = rewards
        self.codec = codec
        self.verifier = verifier
        self.verify_budget = verify_budget  # a VerifierBudget, or None: verifier time unbounded
        self._stop_ids = frozenset(int(t) for t in stop_token_ids)
        self._audit_rng = random.Random()
        self._verify_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="veriroll-verify")
        self.verdicts = None  # a verifier_pool.VerdictWaiter once verification is handed to the pool

    def use_verifier_pool(self, verdicts) -> None:
        """Verify audited groups in the verifier pool (``verifier.pool``): queue them in the store and await the
        verdict of a worker (a ``verifier_pool.VerdictWaiter``), instead of running the model in this process."""
        self.verdicts = verdicts

    async def submit_group(self, node: NodeInfo, req: pb.SubmitGroupRequest, *,
                           peer: str = "unknown") -> pb.SubmitGroupResponse:
        return (await self.submit_group_then(node, req, peer=peer))[0]

    async def submit_group_then(self, node: NodeInfo, req: pb.SubmitGroupRequest, *, peer: str = "unknown",
                                then: Callable[[], Awaitable[Callable | None]] | None = None
                                ) -> tuple[pb.SubmitGroupResponse, Any, Exception | None]:
        """SubmitGroup; ``then``, awaited once the group has passed every check and has its rewards, gives a
        writer op (or None) to run in the transaction that accepts the group, right after it, and only if it
        does (``Database.run_chain``): (the response, the op's result, the op's error). An error of the op is
        undone alone and never refuses the group. A retry of an accepted group does not call ``then``."""
        now = self.clock()
        sub = Submission.from_proto(req)
        digest = content_hash(sub)
        packed = sample_blobs(sub)  # here, so the serialized writer only writes
        # A reader trip for the lease, its prompt and the cheap checks; the verification stages (when this
        # group is audited) and the rewards off the store; then one writer op to accept, or to spend the
        # lease and count the refusal. The accept re-checks that the lease is still open, so a
        # concurrent submission of the same lease between the read and the write is caught there.
        lease, prompt, prior, rejection = await self.db.run_read(lambda conn: self._precheck(conn, node, sub, digest, now),
                                                                   inline=True)
        if prior is not None:
            return await self._accepted_response(prior["group_id"]), None, None
        verified = False
        if rejection is None and self.verifier is not None and self._should_audit(node):
            # The only stage that runs the model: only for a group that passed every cheap check, and only
            # while its key, address and network have verifier time left this minute.
            rejection = await self.verify_budget.check(node.node_id, peer) if self.verify_budget is not None else None
            if rejection is None:
                rejection, trusted = await self._verify(lease, prompt, sub, node, peer, digest, req)
                verified = rejection is None
                if trusted is not None:
                    packed = [(tok, lp, st.pack_f32(t), fin) for (tok, lp, _, fin), t in zip(packed, trusted, strict=True)]
        if rejection is not None:
            await self._reject(node, lease, rejection)
        rewards = await self.score(prompt, sub)
        # Without verification there is no other evidence of honesty: accepted groups count as clean.
        clean = verified or not self.cfg.intake.verify
        def accept(conn):
            return st.accept_group(conn, st.AcceptedGroup(
                lease_id=lease.lease_id, node_id=node.node_id, prompt_id=lease.prompt_id, env=prompt["env"],
                policy_version=sub.policy_version, temperature=lease.temperature, arrival_ms=now, content_hash=digest,
                tokens=sub.num_tokens, rewards=rewards, verified=verified, clean=clean, samples=packed),
                probation_groups=self.cfg.intake.probation_groups)

        op = await then() if then is not None else None
        if op is None:
            group_id, after, error = await self.db.run(accept), None, None
        else:
            group_id, after, error = await self.db.run_chain(accept, lambda conn, gid: None if gid is None else op(conn))
        if group_id is None:
            # Another submission of this lease was accepted between the check and the write.
            await self._reject(node, lease, Rejection(Reason.LEASE_USED, "the lease was submitted concurrently"))
        if clean and node.standing == st.Standing.PROBATION:
            self.ledger.forget(node.node_id)  # it may have just become trusted
        self.metrics.accepted_groups.inc()
        self.metrics.accepted_tokens.inc(sub.num_tokens)
        return (pb.SubmitGroupResponse(accepted=True, rewards=rewards, credited_tokens=sub.num_tokens,
                                       group_id=str(group_id)), after, error)

    async def _verify(self, lease: LeaseRecord, prompt: dict, sub: Submission, node: NodeInfo, peer: str, digest: str,
                      req: pb.SubmitGroupRequest) -> tuple[Rejection | None, list | None]:
        if self.verdicts is not None:
            rejection, trusted, seconds = await self.verdicts.verify(lease, node.node_id, peer, digest,
                                                                     req.SerializeToString(), sub)
        else:
            prompt_ids = st.unpack_i32(prompt["prompt_ids"]).tolist()
            result = await asyncio.get_running_loop().run_in_executor(
                self._verify_pool, self.verifier.verify_group, lease, prompt_ids, sub)
            rejection, trusted, seconds = result.rejection, result.trusted_logprobs, result.seconds
        if seconds > 0:  # (0: the pool gave no verdict in time; nothing ran for this submission yet)
            self.metrics.verify_latency.observe(seconds)
        if self.verify_budget is not None:
            await self.verify_budget.spend(node.node_id, peer, seconds)
        return rejection, trusted

    async def _reject(self, node: NodeInfo, lease: LeaseRecord | None, rejection: Rejection) -> None:
        """Record the refusal with its lease and raise it, counted. A lease that was legitimately this
        node's and failed a content check is spent; its prompt goes back to the pool for someone else."""
        spend = lease is not None and lease.node_id == node.node_id and lease.state == st.LeaseState.OPEN and \
            rejection.reason not in _KEEPS_THE_LEASE
        also = (lambda conn: st.spend_lease(conn, lease.lease_id, lease.prompt_id)) if spend else None
        await self.ledger.refuse(node.node_id, rejection.reason, rejection.detail, lease.lease_id if lease else "", also)
        raise Refusal(rejection.reason, rejection.detail, counted=True)

    def _precheck(self, conn, node: NodeInfo, sub: Submission, digest: str, now: int) -> tuple:
        """(lease, prompt, prior group if this is an honest retry, rejection)."""
        row, prompt, prior = st.load_lease(conn, sub.lease_id)
        lease = None if row is None else LeaseRecord.from_row(row)
        if prior is not None and lease is not None and lease.node_id == node.node_id and prior["content_hash"] == digest:
            # An honest retry after a lost answer: the same content was accepted already. Answer the same.
            return lease, prompt, prior, None
        return lease, prompt, None, self.check_group(lease, node, sub, now)

    def check_group(self, lease: LeaseRecord | None, node: NodeInfo, sub: Submission, now: int) -> Rejection | None:
        """The pure stages before verification: lease, shape and bounds, precision, staleness."""
        ic = self.cfg.intake
        rejection = check_lease(lease, node.node_id, now)
        if rejection is None:
            rejection = check_shape(sub, lease, vocab_size=self.vocab_size,
                                    max_proof_bytes_per_token=ic.max_proof_bytes_per_token, require_proof=ic.verify)
        if rejection is None:
            rejection = check_dtype(sub, ic.accepted_dtypes)
        if rejection is None:
            rejection = check_staleness(sub, self.policy.version, ic.s_max)
        return rejection

    def _should_audit(self, node: NodeInfo) -> bool:
        if node.standing != st.Standing.TRUSTED:
            return True
        return self._audit_rng.random() < self.cfg.intake.audit_fraction

    async def _accepted_response(self, group_id: int) -> pb.SubmitGroupResponse:
        tokens, rewards = await self.db.run_read(lambda conn: st.group_answer(conn, group_id))
        return pb.SubmitGroupResponse(accepted=True, rewards=rewards, credited_tokens=tokens, group_id=str(group_id))

    # --- rewards ----------------------------------------------------------------------------------------

    async def score(self, prompt: dict, sub: Submission) -> list[float]:
        """Rewards recomputed from the tokens by the environment's rubric, never read from the node: in a
        reward worker process with a time limit per sample, awaited off the store's writer and without
        blocking the event loop. A failed reward is 0, counted and logged."""
        result = await self.rewards.score(self._reward_prompt(prompt), self.completions(sub))
        return self._counted(prompt, result)

    def score_blocking(self, prompt: dict, sub: Submission) -> list[float]:
        """:meth:`score`, blocking (for tests and tools that re-check stored rewards)."""
        return self._counted(prompt, self.rewards.score_group(self._reward_prompt(prompt), self.completions(sub)))

    @staticmethod
    def _reward_prompt(prompt: dict):
        from veriroll.coordinator.environments import Prompt

        meta = json.loads(prompt["meta"] or "{}")
        messages = meta.pop(MESSAGES_META_KEY, [])
        return Prompt(text=prompt["text"], answer=prompt["answer"], env=prompt["env"], meta=meta, messages=messages)

    def completions(self, sub: Submission) -> list[str]:
        """Each sample's text as the rubric sees it: decoded without stop tokens or special tokens."""
        stop = self._stop_ids
        texts = []
        for s in sub.samples:
            ids = np.asarray(s.token_ids).tolist()
            if ids and ids[-1] in stop:  # the one place check_shape lets a stop token be
                ids.pop()
            if not stop.isdisjoint(ids):  # (a group that skipped check_shape: a tool re-scoring stored rows)
                ids = [t for t in ids if t not in stop]
            texts.append(self.codec.decode(ids))
        return texts

    def _counted(self, prompt: dict, result) -> list[float]:
        for kind in result.errors:
            if kind is not None:
                self.metrics.reward_errors.inc(kind=kind)
        for reason, count in result.sandbox_kills.items():
            self.metrics.sandbox_kills.inc(count, reason=reason)
        if result.details:
            log.warning("reward errors in prompt %s of environment %s (scored 0): %s",
                        prompt["prompt_id"], prompt["env"], "; ".join(result.details))
        return result.rewards

    def close(self) -> None:
        self._verify_pool.shutdown(wait=False, cancel_futures=True)
        if self.verdicts is not None:
            self.verdicts.close()
