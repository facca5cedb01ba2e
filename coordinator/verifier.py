"""The coordinator's verification stages: one trusted prefill per group, then TOPLOC → sampling → log-probs.

For a group that passed the cheap intake stages, :class:`TrustedVerifier` runs the trusted weights of
the claimed version over ``prompt + completion`` of every sample at once (one right-padded, teacher-
forced forward), reads the final-norm hidden states (the LM head's input, exactly what the node's
engine commits to) and the logits at the positions that produced each generated token, and judges:

1. **TOPLOC** (:func:`veriroll.toploc.verify_many`): the node's commitments against the trusted hidden
   states. Catches another model, another prompt, activations that were negated, rescaled or copied
   from another sample, and bf16 generation claimed as float32.
2. **Sampling** (:func:`veriroll.toploc.sampling.verify_samples`): every token must be the seeded
   Gumbel draw on the trusted logits at the lease's temperature, up to near-ties. Catches tokens the
   node chose itself (fabricated, cherry-picked among resamples) even when their hidden states were
   honestly recomputed, a different temperature, and a policy whose logits moved enough to flip draws.
3. **Log-probs**: the node's behaviour log-probs within a tolerance of the trusted ones at the lease's
   temperature. Catches forged log-probs (inflated importance weights) and, because float32 engines
   agree to ~1e-5, half-precision generation claimed as float32 (fp16's ~1e-3 error is below TOPLOC's
   bf16 resolution but not below this check's float32 tolerance).

A prefill on the trusted weights is the coordinator's most expensive work, and anyone can make keys,
so the verifier spends it last and in two steps, cheapest first (:class:`Stage`):

- **checks**, no forward pass: the lease and the prompt, the intake's shape stage (lengths, ids,
  finite log-probs, finish reasons against stop tokens, proof sizes) and the layout of every proof
  (:func:`veriroll.toploc.check_layout`: header, parameters, length, field ranges);
- **quick**: the prompt, then the first TOPLOC chunk of one sample drawn at random (``intake.
  quick_check_samples``), prefilled alone and judged by the three checks above; garbage stops here
  for the price of ~32 positions (why that is sound: :meth:`TrustedVerifier._quick_check`);
- **full**: every sample after the same prompt forward, and the three checks on all of it.

The accepted group's trusted log-probs (float32, one array per sample) go to the trainer for the
decoupled correction. The pure part, :func:`prefill_group` and :func:`judge_group`, works on any model
and plain tensors; the class adds the weight cache, the thread settings and the never-raise wrapper.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import inspect
import logging
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from veriroll.coordinator.intake import LeaseRecord, Rejection, Submission, SubmittedSample, check_shape
from veriroll.protos.reasons import Reason
from veriroll.toploc import check_layout, thresholds_for, truncate, verify_many
from veriroll.toploc.sampling import token_logprobs, verify_samples

log = logging.getLogger("veriroll.coordinator.verifier")

CHUNK_SIZE, TOPK = 32, 128
"""TOPLOC parameters every node's engine uses (the library defaults); proofs built otherwise fail."""

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}

QUICK_MAX_SHARE = 0.5
"""The quick stage runs only when its prefill covers at most this share of the full one's positions:
above it, refusing garbage there saves less than what it adds to every honest group."""


class Stage(str, enum.Enum):
    """How far the verifier got with a group: the last stage that ran."""

    CHECKS = "checks"  # decided without any forward pass (input, proof layout, weights of that version)
    QUICK = "quick"  # the prompt and the first TOPLOC chunk of a few samples on the trusted weights
    FULL = "full"  # the prefill of the whole group


@dataclass
class VerificationResult:
    """The verifier's answer for one group: a rejection, or the trusted log-probs (float32, one array per
    sample) for the trainer; with what it cost, so that the service can charge it to the sender."""

    rejection: Rejection | None
    trusted_logprobs: list[np.ndarray] | None = None
    seconds: float = 0.0
    """Wall time of the whole verification, in the verifier's thread."""
    stage: Stage = Stage.CHECKS
    quick_seconds: float = 0.0
    """Part of ``seconds`` spent on the quick stage (0 when it did not run)."""


@dataclass(frozen=True)
class Tolerances:
    """Numerical slack of the sampling and log-prob checks for one trusted dtype (TOPLOC has its own,
    :func:`veriroll.toploc.thresholds_for`).

    Both checks compare quantities that move with the logits: two engines whose logits differ by up to
    δ flip a replay only where two perturbed scores lie within 2δ, and move a log-prob by at most 2δ/T.
    In float32 δ is ~1e-6 whatever the logits; in half precision it is a whole ulp of the largest logit,
    hence a part relative to ``max|logit|`` of the trusted row.
    """

    margin_abs: float
    """Sampling: a replay that picks another token is excused when the claimed token's perturbed score
    (times T, so in logit units) is within ``margin_abs + margin_rel * max|logit|`` of the winner's."""
    margin_rel: float
    """Relative part of both slacks: half-precision logits differ by whole ulps of their magnitude."""
    logprob: float
    """Log-probs: the largest |node − trusted| allowed for any token is
    ``logprob + margin_rel * max|logit| / T``."""

    def margin_for(self, logits: torch.Tensor) -> torch.Tensor | float:
        """The sampling slack per row of ``logits [N, V]``."""
        if self.margin_rel == 0:
            return self.margin_abs
        return self.margin_abs + self.margin_rel * logits.detach().float().abs().amax(dim=-1)

    def logprob_for(self, logits: torch.Tensor, temperature: float) -> torch.Tensor | float:
        """The log-prob tolerance per row of ``logits [N, V]`` sampled at ``temperature``."""
        if self.margin_rel == 0:
            return self.logprob
        return self.logprob + self.margin_rel * logits.detach().float().abs().amax(dim=-1) / temperature


# Calibrated by benchmarks/toploc.py (full run: 1,632 honest samples, 0 rejected) on tiny Llamas:
# 2L x 128 warm-started on arithmetic (sharp, max|logit| 5.6), 2L x 64 and 4L x 256 random init; node =
# TorchEngine (KV cache; alone, in a mixed batch, split over batches; 1 or 2 threads), verifier = one
# padded prefill, CPU. Worst honest figures, and the attacks each tolerance must still see:
#   float32: |Δ log-prob| <= 3e-6, no replay ever flipped. fp16 generation claimed as float32, below
#     TOPLOC's bf16 resolution, moves log-probs by 3e-5..1.4e-3 per sample (median 4e-4), so 1e-4
#     (30x the honest worst) catches it on the group's worst token: 9/9 groups, 4/4 in the tests.
#     It assumes engines that are float32 throughout: TF32 matmuls carry fp16-grade mantissas and fail
#     here, rightly. Sampling slack 1e-2: 1e4x the honest |Δ logit|.
#   bfloat16: replays flip honestly (17 of ~24k tokens) at margins up to 0.027 (max|logit| 5.6, where
#     one ulp is 0.031) and 0.0036 (max|logit| ~3), and log-probs differ by up to 0.045, so a fixed
#     0.05 is not safe on sharp models and far too loose on flat ones. The slack is 0.01 +
#     max|logit| / 32 (4 worst-case ulps: 0.185 at 5.6, 7x the worst flip; 0.048 at 1.2, 15x), and
#     the log-prob allowance that relative part (over T) on top of ``intake.logprob_tolerance``.
#     What lies inside it is bf16's resolution: a group whose tokens differ from the replay only by
#     near-ties that small passes, whatever produced it.
#   float16: the bfloat16 reasoning with 8x finer ulps.
#
# Recalibrated on a real model by benchmarks/real_model.py (full run + one extra honest pass, 2026-12-01):
# SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49,152, max|logit| ~25), chat-rendered math word
# problems, groups of 16 x 80 tokens at T = 1 (1,344 honest samples, 1,208 of >= 64 tokens; generated
# alone with stops, batched with another prompt, and split over small batches), verifier = prefill with
# the prompt's cache shared. Worst honest figures (share of the row's tolerance in brackets):
#   fp32 node / fp32 verifier: |Δ log-prob| 3.8e-5 (0.38 of 1e-4: 10x the tiny models' worst, so the
#     float32 allowance has 2.6x headroom here, not 30x), no replay flipped, TOPLOC 0 / 0.008 / 0.
#   bf16 node / bf16 verifier: |Δ log-prob| 0.58, replay margin 0.72, TOPLOC exponent share 0.086,
#     mantissa mean 3.35, median 3; with the former slack (max|logit| / 32) that was 0.84 of the
#     log-prob and 0.75 of the sampling allowance and 0.84 of TOPLOC's mantissa-mean limit: too close
#     for a 30-layer model. The relative slack is now max|logit| / 16 (~0.42 and ~0.38 of it) and
#     TOPLOC's bf16 mantissa limits 6 (toploc/proof.py).
#   bf16 node / fp32 verifier (the node declares bfloat16, so the bf16 tolerances apply): |Δ log-prob|
#     0.66, margin 0.60, TOPLOC 0.070 / 2.98 / 2.
# Attacks on that model (20 groups each, fp32 verifier, all refused): another temperature, greedy decoding,
# fabricated tokens, another seed (sampling); weights with 1e-3 relative noise, bf16 generation claimed
# as fp32 (TOPLOC); log-probs +0.1, the previous version one AdamW step at lr 1e-6 back (log-probs 19,
# sampling 1). What a bf16 declaration buys an attacker is bf16's resolution: a version one small step
# back, or cherry-picking among near-ties of ~max|logit| / 16, passes a bf16 check; operators who need
# more list only float32 in intake.accepted_dtypes.
TOLERANCES_FP32 = Tolerances(margin_abs=1e-2, margin_rel=0.0, logprob=1e-4)
TOLERANCES_BF16 = Tolerances(margin_abs=1e-2, margin_rel=2.0**-4, logprob=math.inf)
TOLERANCES_FP16 = Tolerances(margin_abs=2e-3, margin_rel=2.0**-8, logprob=math.inf)


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown model dtype {name!r}; use one of {sorted(_DTYPES)}") from None


_COARSENESS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def coarser_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The less precise of two dtypes (float32 < float16 < bfloat16): a group is judged with the noise
    of the coarser of the node's engine and the trusted prefill."""
    return a if _COARSENESS.get(a, 0) >= _COARSENESS.get(b, 0) else b


def tolerances_for(dtype: torch.dtype, logprob_cap: float | None = None) -> Tolerances:
    """The calibrated tolerances for a trusted model of ``dtype``. ``logprob_cap`` (the configured
    ``intake.logprob_tolerance``) bounds the absolute log-prob allowance: float32 verification
    tightens it further, half precision adds its relative part on top."""
    tol = {torch.bfloat16: TOLERANCES_BF16, torch.float16: TOLERANCES_FP16}.get(dtype, TOLERANCES_FP32)
    if logprob_cap is not None and logprob_cap < tol.logprob:
        tol = Tolerances(tol.margin_abs, tol.margin_rel, logprob_cap)
    return tol


# --------------------------------------------------------------------------------------------------
# The functional core: one prefill, then the three checks over plain tensors.


@dataclass
class TrustedGroup:
    """What the trusted prefill says about each sample: hidden states ``[T, H]`` in the model's dtype
    (TOPLOC picks its thresholds from it) and logits ``[T, V]`` at the positions that produced the
    sample's tokens, ``[P - 1, P + T - 1)`` of prompt + completion."""

    hidden: list[torch.Tensor]
    logits: list[torch.Tensor]


@functools.cache
def _forward_params(model_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


def prefill_group(model: torch.nn.Module, prompt_ids: list[int], completions: list[list[int]], *,
                  share_prompt: bool | None = None) -> TrustedGroup:
    """The trusted hidden states and logits of every sample of a group, teacher-forced.

    All samples share the prompt, so by default (``share_prompt``: when the model takes a KV cache) the
    prompt is run once, its cache repeated for every sample, and only the completions are run as a
    batch: for a 60-token prompt and 16 x 64 tokens that is 1,084 positions instead of 1,984. The
    numbers are those of a KV-cached decode, which is what the node's engine computed (cached and
    full forwards differ by ~1e-6; the tolerances are calibrated on it). ``share_prompt=False`` runs one
    padded forward of ``prompt + completion`` per row instead (models without a cache).

    Rows are right-padded with an attention mask, so every real token keeps its position. The hidden
    state is read where the engine reads it: the input of the LM head, by a forward pre-hook, so it is
    the final-norm state the logits came from for any architecture.
    """
    return PromptPrefill(model, prompt_ids, share_prompt=share_prompt).complete(completions)


class PromptPrefill:
    """The prompt run once on the trusted model, for :meth:`complete` to run completions after it.

    The quick stage completes a few short prefixes on a copy of the prompt's cache, the full stage all
    completions on the cache itself: the prompt costs one forward for both, and the full stage's
    numbers are those of :func:`prefill_group`, whether a quick stage ran before it or not.
    """

    @torch.no_grad()
    def __init__(self, model: torch.nn.Module, prompt_ids: list[int], *, share_prompt: bool | None = None):
        self.model, self.prompt_ids = model, list(prompt_ids)
        self._params = _forward_params(type(model))
        if share_prompt is None:
            share_prompt = "past_key_values" in self._params or "cache" in self._params
        self.shares_prompt = share_prompt
        if not share_prompt:
            return
        device = next(model.parameters()).device
        keep = {"logits_to_keep": 1} if "logits_to_keep" in self._params else {}
        with _HeadInputs(model) as heads:
            out = model(input_ids=torch.as_tensor([self.prompt_ids], dtype=torch.long, device=device), use_cache=True,
                        **keep)
            # The last prompt position predicts every sample's token 0.
            self._first_hidden, self._first_logits = heads.pop()[:, -1], out.logits[:, -1]
        self._cache = getattr(out, "cache", None) or out.past_key_values
        self._cache_used = False

    @torch.no_grad()
    def complete(self, completions: list[list[int]], *, keep_cache: bool = False) -> TrustedGroup:
        """The trusted states of ``completions`` after the prompt. ``keep_cache`` runs them on a copy of
        the prompt's cache, so that another call can follow; without it the cache is used up."""
        if not self.shares_prompt:
            return _prefill_full(self.model, self.prompt_ids, completions, self._params)
        if self._cache_used:
            raise RuntimeError("the prompt's cache was used up by an earlier complete(); pass keep_cache=True")
        model, p, n = self.model, len(self.prompt_ids), len(completions)
        device = next(model.parameters()).device
        lengths = [len(c) for c in completions]
        t_max = max(lengths)
        first_hidden, first_logits = self._first_hidden.cpu(), self._first_logits.cpu()
        if t_max == 1:
            return TrustedGroup(hidden=[first_hidden] * n, logits=[first_logits] * n)
        if keep_cache:
            cache = copy.deepcopy(self._cache)
        else:
            cache, self._cache_used = self._cache, True
        cache.batch_repeat_interleave(n)
        # Tokens 0..t_max-2 of each completion (the last token predicts nothing we check), right-padded.
        ids = torch.zeros(n, t_max - 1, dtype=torch.long)
        mask = torch.zeros(n, p + t_max - 1, dtype=torch.long)
        mask[:, :p] = 1
        for i, c in enumerate(completions):
            ids[i, : len(c) - 1] = torch.as_tensor(c[:-1], dtype=torch.long)
            mask[i, p : p + len(c) - 1] = 1
        positions = torch.arange(p, p + t_max - 1, dtype=torch.long).expand(n, -1)
        cache_arg = "cache" if "cache" in self._params else "past_key_values"
        with _HeadInputs(model) as heads:
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                        use_cache=True, **{cache_arg: cache})
            hidden, logits = heads.pop(), out.logits
        if logits.shape[:2] != (n, t_max - 1) or hidden.shape[:2] != (n, t_max - 1):
            raise RuntimeError(f"LM head saw {tuple(hidden.shape)}, logits are {tuple(logits.shape)}")
        return TrustedGroup(
            hidden=[torch.cat([first_hidden, hidden[i, : t - 1].cpu()]) for i, t in enumerate(lengths)],
            logits=[torch.cat([first_logits, logits[i, : t - 1].cpu()]) for i, t in enumerate(lengths)],
        )


class _HeadInputs:
    """Captures the LM head's input of this thread's forward passes (another thread may share the model)."""

    def __init__(self, model: torch.nn.Module):
        self.head = model.get_output_embeddings()
        if self.head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (LM head) to read hidden states from")
        self.captured: list[torch.Tensor] = []
        self._me = threading.get_ident()

    def __enter__(self):
        def capture(_module, args):
            if threading.get_ident() == self._me:
                self.captured.append(args[0])

        self._hook = self.head.register_forward_pre_hook(capture)
        return self

    def __exit__(self, *exc):
        self._hook.remove()

    def pop(self) -> torch.Tensor:
        if len(self.captured) != 1:
            raise RuntimeError(f"expected one LM-head call per forward, saw {len(self.captured)}")
        return self.captured.pop()


def _prefill_full(model, prompt_ids, completions, params) -> TrustedGroup:
    device = next(model.parameters()).device
    p = len(prompt_ids)
    lengths = [len(c) for c in completions]
    t_max = max(lengths)
    ids = torch.zeros(len(completions), p + t_max, dtype=torch.long)
    mask = torch.zeros_like(ids)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, :p] = prompt
        ids[i, p : p + len(c)] = torch.as_tensor(c, dtype=torch.long)
        mask[i, : p + len(c)] = 1
    # Only the last t_max + 1 positions need the LM head: all samples share the prompt.
    kwargs = {"logits_to_keep": t_max + 1} if "logits_to_keep" in params else {}
    with _HeadInputs(model) as heads:
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False, **kwargs)
        hidden, logits = heads.pop(), out.logits
    # Both now span the last `keep` positions of the padded rows; position P - 1 sits at `keep - t_max - 1`.
    start = hidden.shape[1] - t_max - 1
    if logits.shape[1] != hidden.shape[1] or start < 0:
        raise RuntimeError(f"LM head saw {tuple(hidden.shape)}, logits are {tuple(logits.shape)}")
    return TrustedGroup(
        hidden=[hidden[i, start : start + t].cpu() for i, t in enumerate(lengths)],
        logits=[logits[i, start : start + t].cpu() for i, t in enumerate(lengths)],
    )


def judge_group(
    lease: LeaseRecord, sub: Submission, trusted: TrustedGroup, tol: Tolerances, thresholds=None, *,
    sample_ids: Sequence[int] | None = None,
) -> tuple[Rejection | None, list[np.ndarray] | None]:
    """TOPLOC → sampling → log-probs for a whole group against its trusted prefill.

    Returns ``(rejection, None)`` at the first stage a sample fails (the detail names the sample, the
    verdict's reason and its figures), else ``(None, trusted log-probs per sample)``. ``sample_ids``
    names the samples in the details when ``sub`` holds a part of a group.
    """
    samples = sub.samples
    name = list(range(len(samples))) if sample_ids is None else list(sample_ids)
    lengths = [len(s.token_ids) for s in samples]

    verdicts = verify_many([s.proof for s in samples], trusted.hidden, chunk_size=CHUNK_SIZE, topk=TOPK,
                           thresholds=thresholds)
    for i, v in enumerate(verdicts):
        if not v.ok:
            # The trusted model's own states being non-finite is our problem, not the node's.
            reason = Reason.INTERNAL if v.reason == "non_finite_hidden" else Reason.TOPLOC_FAILED
            return Rejection(reason, f"sample {name[i]}: {v.reason}: {v.detail}"), None

    # Sampling, all samples in one replay: one row per generated token, each with its sample's seed.
    logits = torch.cat(trusted.logits)
    tokens = torch.as_tensor(np.concatenate([s.token_ids for s in samples]), dtype=torch.int64)
    seeds = torch.cat([torch.full((t,), _seed_bits(seed), dtype=torch.int64) for t, seed in zip(lengths, lease.seeds, strict=True)])
    positions = torch.cat([torch.arange(t, dtype=torch.int64) for t in lengths])
    ends = np.cumsum(lengths)
    # verify_samples compares the margins with its tolerance elementwise, so a per-row slack works.
    slack = tol.margin_for(logits)
    v = verify_samples(logits, tokens, lease.temperature, seeds, positions, margin_tolerance=slack)
    if not v.ok:
        if v.mismatched_positions:
            flat = v.mismatched_positions[0]
            i = int(np.searchsorted(ends, flat, side="right"))
            start = int(ends[i - 1]) if i else 0
            bad = sum(1 for f in v.mismatched_positions if start <= f < ends[i])
            at_slack = float(slack[flat]) if isinstance(slack, torch.Tensor) else slack
            where = (f"sample {name[i]}: {bad} of {lengths[i]} tokens are not the seeded draw, first at token "
                     f"{flat - start} (slack there {at_slack:.3g}; largest margin in the group {v.max_margin:.4g})")
        else:
            where = v.detail
        return Rejection(Reason.SAMPLING_FAILED, f"{v.reason}: {where}"), None

    trusted_lp = token_logprobs(logits, tokens, lease.temperature)
    claimed = torch.as_tensor(np.concatenate([np.asarray(s.logprobs, dtype=np.float32) for s in samples]))
    allowed = tol.logprob_for(logits, lease.temperature)
    excess = (claimed - trusted_lp).abs() - allowed
    worst = int(excess.argmax())
    if not float(excess[worst]) <= 0:  # also rejects NaN
        i = int(np.searchsorted(ends, worst, side="right"))
        at = worst - (int(ends[i - 1]) if i else 0)
        limit = float(allowed[worst]) if isinstance(allowed, torch.Tensor) else allowed
        return Rejection(
            Reason.LOGPROB_MISMATCH,
            f"sample {name[i]} token {at}: node log-prob {float(claimed[worst]):.5g}, trusted {float(trusted_lp[worst]):.5g} "
            f"(|diff| {float(claimed[worst] - trusted_lp[worst]):+.3g} beyond the tolerance {limit:.3g})",
        ), None
    split = np.split(trusted_lp.numpy().astype(np.float32), ends[:-1])
    return None, [np.ascontiguousarray(a) for a in split]


def _seed_bits(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (what the sampler hashes)."""
    seed = int(seed)
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def _check_input(lease: LeaseRecord, prompt_ids: list[int], sub: Submission, *, vocab_size: int, hidden_size: int,
                 max_proof_bytes_per_token: int) -> Rejection | None:
    """Everything about a group that costs no forward pass: what the lease and the prompt must be for a
    prefill to mean anything, the intake's shape stage (the verifier stands on its own: it never
    raises, whatever it is given, and relies on no earlier stage), then the layout of every proof."""
    if len(lease.seeds) != lease.group_size:
        return Rejection(Reason.WRONG_GROUP_SIZE, f"the lease has {len(lease.seeds)} seeds for group size "
                                                  f"{lease.group_size}")
    if not prompt_ids or any(not 0 <= int(t) < vocab_size for t in prompt_ids):
        return Rejection(Reason.INTERNAL, "the lease's prompt is empty or outside the trusted model's vocabulary")
    if not lease.temperature > 0:
        return Rejection(Reason.INTERNAL, f"lease temperature {lease.temperature} is not positive")
    for i, s in enumerate(sub.samples):
        tokens = np.asarray(s.token_ids)
        if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
            return Rejection(Reason.TOKEN_OUT_OF_VOCAB, f"sample {i}: token ids are not a list of integers")
        if not isinstance(s.proof, (bytes, bytearray)):
            return Rejection(Reason.TOPLOC_FAILED, f"sample {i}: the proof is not bytes")
    rejection = check_shape(sub, lease, vocab_size=vocab_size, max_proof_bytes_per_token=max_proof_bytes_per_token)
    if rejection is not None:
        return rejection
    for i, s in enumerate(sub.samples):
        v = check_layout(s.proof, len(s.token_ids), hidden_size, chunk_size=CHUNK_SIZE, topk=TOPK)
        if not v.ok:
            return Rejection(Reason.TOPLOC_FAILED, f"sample {i}: {v.reason}: {v.detail}")
    return None


# --------------------------------------------------------------------------------------------------
# The shell: trusted weights per version, thread settings, timing, never raise.


class TrustedVerifier:
    """The verification stages on the coordinator's own weights (``GroupVerifier`` in ``service.py``).

    Keeps one model per policy version inside the staleness window, loaded lazily from
    ``policy_store.version_dir(v)`` in ``cfg.model_dtype``, and drops versions older than the newest
    leased one minus ``cfg.intake.s_max``. Safe to call from a worker thread while the trainer publishes:
    versions are installed by atomic rename, and the cache is guarded by a lock. Every outcome is a
    :class:`VerificationResult`; an exception never leaves :meth:`verify_group`.
    """

    def __init__(self, policy_store, cfg, *, device: str | torch.device = "cpu", rng: random.Random | None = None):
        self.policy_store = policy_store
        # Which samples the quick stage checks: unpredictable to the node (tests pass a seeded one).
        self._rng = rng or random.SystemRandom()
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = resolve_dtype(cfg.model_dtype)
        self.tolerances = tolerances_for(self.dtype, cfg.intake.logprob_tolerance)
        self._models: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self._lock = threading.Lock()  # guards _models and _newest
        self._load_lock = threading.Lock()  # one load at a time: no version is read from disk twice
        self._newest = -1
        self._thread_setup = threading.local()

    # -- weights -------------------------------------------------------------------------------------

    def loaded_versions(self) -> list[int]:
        with self._lock:
            return list(self._models)

    def _note_newest(self, version: int) -> None:
        """Raise the newest version seen in a lease and drop what fell out of the window below it.

        Only leases move the window: every lease passed the service's staleness stage, so the verifier
        never refuses a version the service still accepts (the store may already hold a version the
        service has not announced yet).
        """
        with self._lock:
            self._newest = max(self._newest, version)
            floor = self._newest - self.cfg.intake.s_max
            for v in [v for v in self._models if v < floor]:
                del self._models[v]
                log.info("verifier dropped the weights of version %d (newest %d, s_max %d)", v, self._newest,
                         self.cfg.intake.s_max)

    def model_for(self, version: int) -> torch.nn.Module | None:
        """The trusted model of ``version``, loaded on first use; ``None`` if it fell out of the window
        or is not on disk (anymore)."""
        self._note_newest(version)
        with self._lock:
            model = self._models.get(version)
            if model is not None or version < self._newest - self.cfg.intake.s_max:
                return model
        with self._load_lock:
            with self._lock:
                model = self._models.get(version)
            if model is not None:
                return model
            path = Path(self.policy_store.version_dir(version))
            if not (path / "config.json").exists():
                return None
            model = self._load(path)
            with self._lock:
                if version >= self._newest - self.cfg.intake.s_max:
                    self._models[version] = model
            return model

    def _load(self, path: Path) -> torch.nn.Module:
        import transformers

        key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **{key: self.dtype})
        return model.to(self.device).eval().requires_grad_(False)

    # -- the stages ----------------------------------------------------------------------------------

    def verify_group(self, lease: LeaseRecord, prompt_ids: list[int], sub: Submission) -> VerificationResult:
        """Judge the group on the trusted weights of ``lease.policy_version``: every check that needs no
        forward pass, then the quick stage, then the full prefill and its checks."""
        started = time.perf_counter()
        if not getattr(self._thread_setup, "done", False):
            # OpenMP thread counts are per calling thread: set ours once, in the thread we run in.
            torch.set_num_threads(self.cfg.verifier_threads)
            self._thread_setup.done = True
        result = VerificationResult(None)
        try:
            self._verify(lease, prompt_ids, sub, result)
        except Exception as exc:  # a verdict, never a crash: the group is refused, the node not struck
            log.exception("verification of lease %s failed", getattr(lease, "lease_id", "?"))
            result.rejection = Rejection(Reason.INTERNAL, f"verifier error: {type(exc).__name__}: {exc}")
            result.trusted_logprobs = None
        result.seconds = time.perf_counter() - started
        return result

    def _verify(self, lease: LeaseRecord, prompt_ids: list[int], sub: Submission, result: VerificationResult) -> None:
        """Fill ``result`` stage by stage; ``result.stage`` names the stage running if one raises."""
        if sub.policy_version != lease.policy_version:
            result.rejection = Rejection(Reason.VERSION_MISMATCH, f"generated with version {sub.policy_version}, the "
                                                                  f"lease names {lease.policy_version}")
            return
        model = self.model_for(lease.policy_version)
        if model is None:
            result.rejection = Rejection(Reason.STALE_VERSION, f"the trusted weights of version {lease.policy_version} "
                                                               f"are no longer kept (newest {self._newest}, s_max "
                                                               f"{self.cfg.intake.s_max})")
            return
        vocab, hidden_size = model.get_output_embeddings().weight.shape
        result.rejection = _check_input(lease, prompt_ids, sub, vocab_size=int(vocab), hidden_size=int(hidden_size),
                                        max_proof_bytes_per_token=self.cfg.intake.max_proof_bytes_per_token)
        if result.rejection is not None:
            return
        # The node declares its precision (intake checked it is accepted): judge with the noise of the
        # coarser of its engine and ours. A bf16 node under an fp32 verifier gets bf16 slack, nothing more.
        effective = coarser_dtype(self.dtype, resolve_dtype(sub.compute_dtype or "float32"))
        tol = self.tolerances if effective == self.dtype else tolerances_for(effective, self.cfg.intake.logprob_tolerance)
        thresholds = thresholds_for(effective)
        completions = [[int(t) for t in s.token_ids] for s in sub.samples]

        picked = self._quick_samples(completions)
        result.stage = Stage.QUICK if picked else Stage.FULL
        quick_started = time.perf_counter()
        prompt = PromptPrefill(model, [int(t) for t in prompt_ids])
        if picked:
            result.rejection = self._quick_check(prompt, lease, sub, picked, tol, thresholds)
            result.quick_seconds = time.perf_counter() - quick_started
            if result.rejection is not None:
                return
        result.stage = Stage.FULL
        result.rejection, result.trusted_logprobs = judge_group(lease, sub, prompt.complete(completions), tol, thresholds)

    def _quick_samples(self, completions: list[list[int]]) -> list[int]:
        """The samples, drawn at random, whose first chunk the quick stage checks; none when the quick
        stage is off or would cover more than ``QUICK_MAX_SHARE`` of the full prefill's positions."""
        n = len(completions)
        k = min(self.cfg.intake.quick_check_samples, n)
        if k == 0:
            return []
        picked = sorted(self._rng.sample(range(n), k))
        quick = k * (min(CHUNK_SIZE, max(len(completions[i]) for i in picked)) - 1)
        full = n * (max(len(c) for c in completions) - 1)
        return picked if quick <= QUICK_MAX_SHARE * full else []

    @staticmethod
    def _quick_check(prompt: PromptPrefill, lease: LeaseRecord, sub: Submission, picked: list[int], tol: Tolerances,
                     thresholds) -> Rejection | None:
        """TOPLOC, sampling and log-probs on the first chunk (``CHUNK_SIZE`` tokens) of the ``picked``
        samples, prefilled after the prompt on their own, before the whole group is.

        Sound because nothing the full stage judges in those tokens depends on anything after them:
        attention is causal, so the hidden states and logits of positions ``< CHUNK_SIZE`` of a sample
        are functions of the prompt and its tokens before them only, whatever follows; each TOPLOC chunk
        is committed on its own (``toploc.truncate`` of a proof is the proof of its first chunk); each
        token's sampling and log-prob checks read only its own row of logits and its own seed. So the
        quick stage computes the same quantities as the full stage, with the same tolerances and
        thresholds; they differ only by the prefill's batch composition (one short row here, the padded
        group there), which is the honest variation those tolerances were calibrated across (a node
        batches as it likes). A group refused here would be refused by the full stage on the same
        tokens; a group passed here is still judged whole, so a proof honest in its first chunk and
        forged later is caught by the full stage.

        The samples are drawn at random after the group arrived: a group that is garbage in a share
        ``g`` of its samples is refused here with probability at least ``g`` per sample checked.
        """
        lengths = [min(CHUNK_SIZE, len(sub.samples[i].token_ids)) for i in picked]
        part = Submission(sub.lease_id, sub.policy_version, [
            SubmittedSample(sub.samples[i].token_ids[:c], sub.samples[i].logprobs[:c], truncate(sub.samples[i].proof, c),
                            sub.samples[i].finish_reason) for i, c in zip(picked, lengths, strict=True)],
            sub.compute_dtype)
        part_lease = dataclasses.replace(lease, group_size=len(picked), seeds=tuple(lease.seeds[i] for i in picked))
        trusted = prompt.complete([[int(t) for t in s.token_ids] for s in part.samples], keep_cache=True)
        rejection, _ = judge_group(part_lease, part, trusted, tol, thresholds, sample_ids=picked)
        if rejection is None:
            return None
        return Rejection(rejection.reason, f"quick check of the first {CHUNK_SIZE} tokens: {rejection.detail}")
