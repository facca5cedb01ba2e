"""The intake pipeline's pure stages.

A submitted group passes, in order of cost: signature and replay window (at the door, see
``admission.py``) → lease → shape and bounds → staleness → verification (``verifier.py``) → reward.
Each stage here is a function of plain data that returns ``None`` to pass or a :class:`Rejection`
naming one :class:`~veriroll.protos.reasons.Reason`. No stage touches the network or the database.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

from veriroll.protos.reasons import Reason

# A proof is a small header plus at most 258 bytes per 32 generated tokens; anything far beyond that is
# junk sent to waste verifier time or disk.
PROOF_HEADER_ALLOWANCE = 64


@dataclass(frozen=True)
class Rejection:
    reason: Reason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail or self.reason.message}"


@dataclass(frozen=True)
class LeaseRecord:
    lease_id: str
    node_id: str
    prompt_id: int
    group_size: int
    temperature: float
    max_new_tokens: int
    seeds: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    policy_version: int
    issued_ms: int
    deadline_ms: int
    state: str

    @classmethod
    def from_row(cls, row) -> LeaseRecord:
        return cls(
            lease_id=row["lease_id"], node_id=row["node_id"], prompt_id=int(row["prompt_id"]),
            group_size=int(row["group_size"]), temperature=float(row["temperature"]),
            max_new_tokens=int(row["max_new_tokens"]), seeds=tuple(json.loads(row["seeds"])),
            stop_token_ids=tuple(json.loads(row["stop_token_ids"])), policy_version=int(row["policy_version"]),
            issued_ms=int(row["issued_ms"]), deadline_ms=int(row["deadline_ms"]), state=row["state"],
        )


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
    if lease.state == "submitted":
        return Rejection(Reason.LEASE_USED)
    if lease.state != "open" or now_ms > lease.deadline_ms:
        return Rejection(Reason.LEASE_EXPIRED, f"lease {lease.lease_id} is {lease.state if lease.state != 'open' else 'past its deadline'}")
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
            return Rejection(Reason.BAD_FINISH, f"sample {i}: finish_reason {s.finish_reason!r} does not match its tokens")
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
