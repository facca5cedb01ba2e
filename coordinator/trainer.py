"""The asynchronous off-policy trainer: accepted groups in the store → optimizer steps → policy versions.

One step, in the order it happens (``Trainer.step``):

1. **Select.** The accepted groups not yet consumed, oldest first. A group's staleness is
   s = version − group.policy_version, where ``version`` is the policy nodes are told now. Groups with
   s > s_max are dropped (``dropped='stale'``, durably) and never trained on. Up to ``groups_per_step``
   fresh groups make the batch; with fewer than ``min_groups`` the trainer waits (and says so). It never
   waits for a particular node or a whole generation batch: whatever is fresh is what it trains on.
2. **Advantages.** Group-relative (``advantages.group_advantages``); groups whose completions all scored
   the same carry no signal and are skipped, counted, and consumed all the same.
3. **Loss.** ``log_softmax(logits / T)`` of the sampled tokens at positions [P−1, P+T−1) of prompt +
   completion, T the lease temperature (the node's log-probs are at that temperature too), into
   ``loss.async_ppo_loss``. With ``correction='decoupled'`` the PPO ratio is taken against the
   verifier's trusted log-probs; a group that was not verified (no trusted log-probs) falls back to
   'mixed', which is the decoupled form with trusted := behaviour.
4. **Update.** AdamW, gradient-norm clip.
5. **Commit.** One durable transaction marks the consumed groups with the step number, advances kv
   ``trainer_step``, appends the step's diagnostics to kv ``trainer_history`` and, when this step
   publishes, sets kv ``policy_version`` (the new version's files are installed just before).
6. **Checkpoint** the full training state every ``checkpoint_every`` steps (``checkpoint.py``).

Restart: the newest complete training-state checkpoint (step k) is loaded and every group with
``consumed_step > k`` is made unconsumed again, in one transaction with kv ``trainer_step = k``, so
exactly the groups not trained into the restored weights are trained again. Version numbers are never
reused: the next version is one past both kv ``policy_version`` and the newest directory on disk.

Diagnostics are computed where the step computes their ingredients (CleanRL style) and go three
ways: the ``veriroll_trainer{metric=...}`` gauge, one log line, and kv ``trainer_history``.

A step's batch is split by length into micro-batches (``micro_batch_tokens``) whose gradients add up:
each backpropagates its unnormalized Σ per_token·w, and the summed gradient is divided by the step's
max(Σw, 1) once at the end, so the split changes nothing but the padding (heavy-tailed completions
would otherwise pad every row to the longest one).

Memory and numerics: the trainer holds float32 master weights and float32 AdamW state, whatever dtype
version 0 is stored in (``load_training_model``). ``gradient_checkpointing`` recomputes each decoder
layer in the backward (non-reentrant); ``autocast`` runs the forward in bf16 where that pays
(``autocast_dtype``: CUDA by default, never silently on CPU). Measured on SmolLM2-135M on CPU, 8 samples
x 48 tokens, ``micro_batch_tokens`` 1024 (``benchmarks/trainer_memory.py``): peak RSS 3.6 GB with
checkpointing, 4.2 GB without.

Versions are published in ``model_dtype`` (``write_policy_version``): a cast copy of the weights is
written as sharded safetensors next to version 0's tokenizer files, chat template and generation
config, copied byte for byte. The write runs in the trainer's worker thread; shardcast's hashing runs
in a worker thread of the event loop (``publisher.py``); ``measure_publish`` times both.

The same step runs under ``torch.distributed`` (``distributed_train_step``): each rank takes a shard
of the batch's samples, the same accumulation runs per rank, DDP (or FSDP2) averages the gradients and
the all-reduced Σw normalizes them: the update is the single-process update.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import sqlite3
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from veriroll.coordinator import store as st
from veriroll.coordinator.advantages import group_advantages
from veriroll.coordinator.checkpoint import latest_training_state, save_training_state
from veriroll.coordinator.config import CoordinatorConfig, TrainerConfig
from veriroll.coordinator.loss import async_ppo_loss
from veriroll.coordinator.policy import PolicyState

__all__ = [
    "GroupRecord",
    "RolloutBatch",
    "StepOutcome",
    "Trainer",
    "autocast_dtype",
    "build_batch",
    "build_optimizer",
    "distributed_train_step",
    "load_groups",
    "load_training_model",
    "measure_publish",
    "micro_batches",
    "select_groups",
    "set_gradient_checkpointing",
    "shard_batch",
    "start_trainer",
    "train_step",
    "wrap_distributed",
    "write_policy_version",
]

log = logging.getLogger("veriroll.trainer")

ADAM_BETAS = (0.9, 0.99)  # as in the measured tiny-GRPO recipe (benchmarks/warm_start.py)
HISTORY_KEY = st.TRAINER_HISTORY_KEY
HISTORY_CAP = 2000  # steps kept in kv trainer_history (the dashboard reads it)
POLL_S = 0.2  # how often a waiting trainer looks for fresh groups
WAIT_LOG_EVERY_S = 30.0  # a trainer that keeps waiting says so again this often
STATE_FORMAT = 1


# ---------------------------------------------------------------------------------------------------
# Data: groups from the store, and the tensors of one step


@dataclass
class SampleRecord:
    token_ids: np.ndarray  # int32 [T], the completion (stop token included)
    logprobs: np.ndarray  # float32 [T], the node's, at the lease temperature
    trusted: np.ndarray | None  # float32 [T], the verifier's, or None when the group was not verified
    reward: float


@dataclass
class GroupRecord:
    group_id: int
    env: str
    policy_version: int
    temperature: float
    tokens: int
    prompt_ids: np.ndarray
    samples: list[SampleRecord] = field(default_factory=list)


@dataclass
class RolloutBatch:
    """B samples, right-padded: ``input_ids`` [B, L] = prompt + completion; per completion token t of
    sample b, ``positions[b, t]`` = P_b − 1 + t is the position whose logits predict it."""

    input_ids: torch.Tensor  # long [B, L]
    attention_mask: torch.Tensor  # long [B, L]
    positions: torch.Tensor  # long [B, T]
    completion_ids: torch.Tensor  # long [B, T]
    response_mask: torch.Tensor  # bool [B, T]
    temperature: torch.Tensor  # float [B]
    logp_behavior: torch.Tensor  # float [B, T]
    logp_trusted: torch.Tensor  # float [B, T] (= behaviour where the group has no trusted log-probs)
    has_trusted: torch.Tensor  # bool [B]
    advantages: torch.Tensor  # float [B]
    staleness: torch.Tensor  # long [B]
    rewards: torch.Tensor  # float [B]

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        return RolloutBatch(**{k: getattr(self, k)[rows] for k in self.__dataclass_fields__})


def select_groups(conn: sqlite3.Connection, version: int, s_max: int, limit: int,
                  reference: dict[int, int] | None = None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Unconsumed, undropped groups as ``(fresh, stale)`` lists of ``(group_id, staleness)``, oldest first.

    ``fresh`` holds at most ``limit`` groups with staleness ≤ ``s_max``; ``stale`` every group beyond it.
    ``reference`` maps group ids to the version their staleness is measured against instead of
    ``version`` (after a resume: the restored checkpoint's version, see :meth:`Trainer.resume`).
    """
    reference = reference or {}
    fresh, stale = [], []
    for gid, made_with in st.queued_group_versions(conn):
        s = max(0, reference[gid] - made_with) if gid in reference else version - made_with
        if s > s_max:
            stale.append((gid, s))
        elif len(fresh) < limit:
            fresh.append((gid, s))
    return fresh, stale


def load_groups(conn: sqlite3.Connection, group_ids: list[int]) -> list[GroupRecord]:
    """The groups ``group_ids`` with their prompts and samples, in the order given."""
    groups = {}
    for gid, (g, samples) in st.groups_with_samples(conn, group_ids).items():
        record = GroupRecord(gid, g["env"], int(g["policy_version"]), float(g["temperature"]), int(g["tokens"]),
                             np.array(st.unpack_i32(g["prompt_ids"])))
        for r in samples:
            trusted = st.unpack_f32(r["trusted_logprobs"])
            record.samples.append(SampleRecord(
                np.array(st.unpack_i32(r["token_ids"])), np.array(st.unpack_f32(r["logprobs"])),
                None if trusted is None else np.array(trusted), float(r["reward"])))
        groups[gid] = record
    missing = [g for g in group_ids if g not in groups]
    if missing:
        raise LookupError(f"groups {missing} are not in the store (or their prompts are missing)")
    return [groups[g] for g in group_ids]


def build_batch(groups: list[GroupRecord], staleness: list[int], *, std_scale: bool = False,
                pad_id: int = 0) -> tuple[RolloutBatch | None, torch.Tensor]:
    """The step's tensors from ``groups`` (with their ``staleness``), and a ``[G]`` bool mask of the groups
    that carry a learning signal; groups whose advantages are all zero are left out of the batch
    (``None`` when no group is left)."""
    keep = []
    advantages = []
    for g in groups:
        rewards = torch.tensor([[s.reward for s in g.samples]], dtype=torch.float32)
        adv, nonzero = group_advantages(rewards, std_scale=std_scale)
        keep.append(bool(nonzero[0]))
        advantages.append(adv[0])
    keep_t = torch.tensor(keep, dtype=torch.bool)
    rows = [(g, s, sample, float(a)) for g, s, adv, k in zip(groups, staleness, advantages, keep, strict=True) if k
            for sample, a in zip(g.samples, adv.tolist(), strict=True)]
    if not rows:
        return None, keep_t
    B = len(rows)
    L = max(len(g.prompt_ids) + len(smp.token_ids) for g, _, smp, _ in rows)
    T = max(1, max(len(smp.token_ids) for _, _, smp, _ in rows))
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    completion = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    behavior = torch.zeros((B, T), dtype=torch.float32)
    trusted = torch.zeros((B, T), dtype=torch.float32)
    has_trusted = torch.zeros(B, dtype=torch.bool)
    for b, (g, _, smp, _) in enumerate(rows):
        P, n = len(g.prompt_ids), len(smp.token_ids)
        input_ids[b, :P] = torch.from_numpy(g.prompt_ids.astype(np.int64))
        input_ids[b, P:P + n] = torch.from_numpy(smp.token_ids.astype(np.int64))
        attention[b, :P + n] = 1
        positions[b, :n] = torch.arange(P - 1, P - 1 + n)
        completion[b, :n] = input_ids[b, P:P + n]
        mask[b, :n] = True
        behavior[b, :n] = torch.from_numpy(smp.logprobs.astype(np.float32))
        if smp.trusted is not None and len(smp.trusted) == n:
            trusted[b, :n] = torch.from_numpy(smp.trusted.astype(np.float32))
            has_trusted[b] = True
        else:
            trusted[b, :n] = behavior[b, :n]
    batch = RolloutBatch(
        input_ids=input_ids, attention_mask=attention, positions=positions, completion_ids=completion,
        response_mask=mask, temperature=torch.tensor([g.temperature for g, _, _, _ in rows], dtype=torch.float32),
        logp_behavior=behavior, logp_trusted=trusted, has_trusted=has_trusted,
        advantages=torch.tensor([a for _, _, _, a in rows], dtype=torch.float32),
        staleness=torch.tensor([s for _, s, _, _ in rows], dtype=torch.long),
        rewards=torch.tensor([smp.reward for _, _, smp, _ in rows], dtype=torch.float32),
    )
    return batch, keep_t


# ---------------------------------------------------------------------------------------------------
# The step


def completion_logprobs(model: torch.nn.Module, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[B, T]`` of the sampled tokens under ``softmax(logits / T)`` (with gradient), and the
    per-token entropy ``[B, T]`` of that distribution (detached).

    Padding is masked by ``attention_mask`` alone, never by comparing ids with the pad id: real
    tokenizers often pad with EOS (SmolLM2: pad = eos = 2), which is also the last token of a completion.
    The softmax is taken in float32 even when the forward ran under bf16 autocast.
    """
    # No KV cache: training reads every position once, and a cache would only hold memory.
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    vocab = logits.shape[-1]
    picked = logits.gather(1, batch.positions[..., None].expand(-1, -1, vocab)).float()
    logp_all = F.log_softmax(picked / batch.temperature[:, None, None], dim=-1)
    logp = logp_all.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _loss_kwargs(cfg: TrainerConfig, s_max: int, batch: RolloutBatch) -> dict:
    # Decoupled needs trusted log-probs; groups without them were filled with the behaviour log-probs,
    # which is exactly 'mixed' for those rows. A batch with none at all is plain 'mixed'.
    decoupled = cfg.correction == "decoupled" and bool(batch.has_trusted.any())
    return dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high, tis_cap=cfg.tis_cap, s_max=s_max,
                correction="decoupled" if decoupled else "mixed",
                logp_trusted=batch.logp_trusted if decoupled else None,
                staleness_gamma=cfg.staleness_gamma, kl_coef=cfg.kl_coef)


def _step_sums(model, batch: RolloutBatch, cfg: TrainerConfig, s_max: int, ref_model) -> tuple[torch.Tensor, dict]:
    """This micro-batch's share of the step: Σ per_token·w (negated, with graph) and the diagnostics as
    weighted sums, ready to be added across micro-batches and ranks (``_finish`` turns them into means)."""
    logp, entropy = completion_logprobs(model, batch)
    logp_ref = None
    if cfg.kl_coef != 0.0:
        with torch.no_grad():
            logp_ref, _ = completion_logprobs(ref_model, batch)
    loss, m = async_ppo_loss(logp, batch.logp_behavior, batch.advantages, batch.response_mask, batch.staleness,
                             logp_ref=logp_ref, **_loss_kwargs(cfg, s_max, batch))
    mask = batch.response_mask.float()
    # The loss is a sum over max(Σw, 1); times that clamp it is the plain sum again, exactly, whatever Σw.
    d = max(m["tokens_used"], 1.0)
    trusted_rows = batch.has_trusted[:, None].float() * mask
    mismatch = torch.where(batch.response_mask, batch.logp_trusted - batch.logp_behavior, torch.zeros(()))
    sums = {
        "tokens_used": m["tokens_used"],
        "loss": m["loss"] * d,
        "pg_loss": m["pg_loss"] * d,
        "approx_kl": m["approx_kl"] * d,
        "clipfrac": m["clipfrac"] * d,
        "tis_capped_frac": m["tis_capped_frac"] * d,
        "ratio_mean": m["ratio_mean"] * d,
        "kl_ref": m.get("kl_ref", 0.0) * d,
        "entropy": float((entropy * mask).sum()),
        "response_tokens": float(mask.sum()),
        "mismatch_kl": float(((torch.expm1(mismatch) - mismatch) * trusted_rows).sum()),
        "trusted_tokens": float(trusted_rows.sum()),
        "samples": float(batch.size),
        "micro_batches": 1.0,
    }
    return loss * d, sums


def _finish(sums: dict) -> dict:
    d = max(sums["tokens_used"], 1.0)  # the loss's own denominator, max(Σw, 1), over the whole step
    out = {k: sums[k] / d for k in ("loss", "pg_loss", "approx_kl", "clipfrac", "tis_capped_frac", "ratio_mean", "kl_ref")}
    out["entropy"] = sums["entropy"] / max(sums["response_tokens"], 1.0)
    out["mismatch_kl"] = sums["mismatch_kl"] / sums["trusted_tokens"] if sums["trusted_tokens"] > 0 else None
    out["tokens_used"] = sums["tokens_used"]
    out["micro_batches"] = sums["micro_batches"]
    return out


def micro_batches(batch: RolloutBatch, max_tokens: int) -> list[RolloutBatch]:
    """``batch`` split into micro-batches of at most ``max_tokens`` padded tokens (rows × longest row;
    a longer row goes alone), rows grouped by length and each micro-batch trimmed to its own longest
    row: heavy-tailed completions no longer pad every short row to the longest one."""
    lengths = batch.attention_mask.sum(1)
    order = torch.argsort(lengths, stable=True).tolist()
    chunks: list[list[int]] = []
    for row in order:
        width = int(lengths[row])
        if chunks and (len(chunks[-1]) + 1) * width <= max_tokens:
            chunks[-1].append(row)  # rows come shortest first: this row is the chunk's longest
        else:
            chunks.append([row])
    out = []
    for rows in chunks:
        mb = batch.select(torch.tensor(rows))
        L = int(mb.attention_mask.sum(1).max())
        T = max(1, int(mb.response_mask.sum(1).max()))
        out.append(RolloutBatch(
            input_ids=mb.input_ids[:, :L], attention_mask=mb.attention_mask[:, :L], positions=mb.positions[:, :T],
            completion_ids=mb.completion_ids[:, :T], response_mask=mb.response_mask[:, :T],
            temperature=mb.temperature, logp_behavior=mb.logp_behavior[:, :T], logp_trusted=mb.logp_trusted[:, :T],
            has_trusted=mb.has_trusted, advantages=mb.advantages, staleness=mb.staleness, rewards=mb.rewards))
    return out


def autocast_dtype(setting: str, device: torch.device | str) -> torch.dtype | None:
    """The dtype the forward runs in under autocast on ``device`` (``None``: no autocast, plain float32).

    ``'auto'`` is bf16 on a CUDA device that supports it, and off on CPU. Measured on a 2-core Xeon with
    AMX-BF16 (SmolLM2-135M, 8 samples x 48 tokens, ``benchmarks/trainer_memory.py``): bf16 autocast made
    the step ~1.5x faster (4.2 s vs 6.5 s) at the same peak RSS (3.6 GB), but moved the per-token
    log-probs by 0.04 on average (p99 0.12) from float32: ~4% noise in every PPO ratio, as large as
    ``intake.logprob_tolerance``, where float32 matches the behaviour and trusted log-probs. On a CPU
    without native bf16 it would be slower as well. So CPU stays float32 unless the operator asks for
    ``'bfloat16'``, which forces it on any device; ``'off'`` never autocasts.
    """
    device = torch.device(device)
    if setting == "off":
        return None
    if setting == "bfloat16":
        return torch.bfloat16
    if setting == "auto":
        if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    raise ValueError(f"trainer.autocast must be 'auto', 'bfloat16' or 'off', got {setting!r}")


def set_gradient_checkpointing(model: torch.nn.Module, enabled: bool) -> bool:
    """Turn activation checkpointing of ``model`` (a transformers model, maybe DDP-wrapped) on or off;
    returns whether it is on. A model that does not support it trains without it (with a warning)."""
    inner = getattr(model, "module", model)  # DDP keeps the model in .module; FSDP2 modifies it in place
    if not getattr(inner, "supports_gradient_checkpointing", False):
        if enabled:
            log.warning("%s does not support gradient checkpointing; training without it", type(inner).__name__)
        return False
    # transformers >= 5.24 renamed gradient → activation checkpointing; the old names warn.
    flag = "is_activation_checkpointing" if hasattr(type(inner), "is_activation_checkpointing") else "is_gradient_checkpointing"
    on = bool(getattr(inner, flag, False))
    if enabled and not on:
        # Non-reentrant checkpointing: it needs no input that requires grad, works under DDP without
        # find_unused_parameters tricks, and is what torch recommends (the reentrant one is deprecated).
        enable = getattr(inner, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif on and not enabled:
        disable = getattr(inner, "activation_checkpointing_disable", None) or inner.gradient_checkpointing_disable
        disable()
    return enabled


def _forward_context(model: torch.nn.Module, cfg: TrainerConfig):
    param = next(model.parameters())
    dtype = autocast_dtype(cfg.autocast, param.device)
    if dtype is None:
        return contextlib.nullcontext()
    # The master weights stay float32: autocast casts per op (matmuls in bf16), and the gradients
    # land on the float32 parameters, so AdamW's state and the clipping stay float32 too.
    return torch.autocast(device_type=param.device.type, dtype=dtype)


def _accumulate(model, parts: list[RolloutBatch], cfg: TrainerConfig, s_max: int, ref_model, no_sync=None) -> dict:
    """Backward Σ per_token·w of every micro-batch into the gradients (unnormalized); their summed
    diagnostics. ``no_sync`` (DDP's) defers the gradient all-reduce to the last micro-batch."""
    set_gradient_checkpointing(model, cfg.gradient_checkpointing)
    total: dict[str, float] = {}
    for i, part in enumerate(parts):
        ctx = no_sync() if no_sync is not None and i < len(parts) - 1 else contextlib.nullcontext()
        with ctx:
            with _forward_context(model, cfg):
                summed_loss, sums = _step_sums(model, part, cfg, s_max, ref_model)
            summed_loss.backward()
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _scale_gradients(model: torch.nn.Module, factor: float) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, cfg: TrainerConfig,
               s_max: int, *, ref_model: torch.nn.Module | None = None) -> dict:
    """One optimizer step on ``batch`` (in micro-batches of ``cfg.micro_batch_tokens``); returns the step's
    diagnostics (loss, approx_kl, clipfrac, entropy, mismatch_kl, grad_norm, ...)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    sums = _accumulate(model, micro_batches(batch, cfg.micro_batch_tokens), cfg, s_max, ref_model)
    # The gradients hold ∇ of the summed loss; the loss is that sum over max(Σw, 1) of the whole step.
    _scale_gradients(model, 1.0 / max(sums["tokens_used"], 1.0))
    return _apply_update(model, optimizer, cfg, _finish(sums))


def _apply_update(model, optimizer, cfg: TrainerConfig, metrics: dict) -> dict:
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    metrics["grad_norm"] = grad_norm
    metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    if math.isfinite(grad_norm):
        optimizer.step()
        metrics["skipped_nonfinite"] = 0.0
    else:
        # A non-finite gradient would poison the weights and every version after them.
        log.warning("non-finite gradient norm (%s); optimizer step skipped", grad_norm)
        metrics["skipped_nonfinite"] = 1.0
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    return metrics


# ---------------------------------------------------------------------------------------------------
# The same step under torch.distributed


def shard_batch(batch: RolloutBatch, rank: int, world_size: int) -> RolloutBatch:
    """Rank ``rank``'s contiguous share of the samples (sizes differ by at most one)."""
    if batch.size < world_size:
        raise ValueError(f"a batch of {batch.size} samples cannot be split over {world_size} ranks")
    bounds = [batch.size * r // world_size for r in range(world_size + 1)]
    return batch.select(slice(bounds[rank], bounds[rank + 1]))


def wrap_distributed(model: torch.nn.Module, strategy: str = "auto") -> torch.nn.Module:
    """``model`` prepared for data-parallel training: FSDP2 (``fully_shard`` per decoder layer and the
    root) or DDP. ``auto`` picks FSDP2 on CUDA where this torch has it, else DDP (gloo on CPU)."""
    if strategy == "auto":
        on_cuda = next(model.parameters()).is_cuda
        try:
            from torch.distributed.fsdp import fully_shard
            have_fsdp2 = True
        except ImportError:
            have_fsdp2 = False
        strategy = "fsdp2" if on_cuda and have_fsdp2 else "ddp"
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", None), "layers", None) or []
        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ValueError(f"strategy must be 'auto', 'ddp' or 'fsdp2', got {strategy!r}")


def distributed_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
                           cfg: TrainerConfig, s_max: int, *, ref_model: torch.nn.Module | None = None) -> dict:
    """:func:`train_step` across the ranks of the default process group.

    ``model`` is wrapped by :func:`wrap_distributed`, and ``batch`` is the whole step's batch, the same on
    every rank; each rank trains on its :func:`shard_batch`. Every rank backpropagates its unnormalized
    Σ per_token·w; DDP/FSDP2 average the gradients over the W ranks, so multiplying them by
    W / max(Σw, 1), with Σw all-reduced, gives the gradient of the single-process loss. The diagnostics
    are reduced the same way: every rank returns the single-process numbers.

    Under DDP a rank's shard is split into micro-batches like :func:`train_step` (gradients all-reduced
    once, on the last); FSDP2 gathers weights in every forward, a collective each rank must join equally
    often, so there each rank's shard is one micro-batch.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    local = shard_batch(batch, rank, world)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    no_sync = getattr(model, "no_sync", None)
    parts = micro_batches(local, cfg.micro_batch_tokens) if no_sync is not None else [local]
    sums = _accumulate(model, parts, cfg, s_max, ref_model, no_sync=no_sync)
    keys = sorted(sums)
    totals = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(totals)
    total = dict(zip(keys, totals.tolist(), strict=True))
    _scale_gradients(model, world / max(total["tokens_used"], 1.0))
    return _apply_update(model, optimizer, cfg, _finish(total))


# ---------------------------------------------------------------------------------------------------
# Weights in, versions out: float32 master weights, published in the operator's dtype


def load_training_model(version_dir: str | Path) -> torch.nn.Module:
    """The causal LM of a version directory with float32 weights, whatever dtype its files hold (a
    bf16 version 0 gets float32 master weights), on CPU, in eval mode."""
    import transformers

    # A server's log has no use for a progress bar per load and per published version.
    transformers.utils.logging.disable_progress_bar()

    major = int(transformers.__version__.split(".")[0])
    kwargs = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(version_dir), **kwargs)
    return model.float().eval()


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.Optimizer:
    """The trainer's AdamW over ``model``'s parameters (float32 state, like the weights)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=ADAM_BETAS, weight_decay=cfg.weight_decay)


def write_policy_version(model: torch.nn.Module, base_dir: str | Path, out_dir: str | Path,
                         dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model``'s weights in ``dtype`` as an HF directory at ``out_dir`` (atomically, safetensors,
    sharded past ``models.MAX_SHARD_SIZE``), with every non-weight file of ``base_dir`` (tokenizer, chat
    template, generation config) copied unchanged. The model's float32 master weights are not touched."""
    from veriroll.coordinator.models import save_pretrained_checkpoint

    return save_pretrained_checkpoint(getattr(model, "module", model), Path(base_dir), out_dir, dtype=dtype)


def measure_publish(model: torch.nn.Module, tokenizer_dir: str | Path, out_root: str | Path, dtype: torch.dtype | str,
                    key, *, version: int = 1, shard_size: int | None = None) -> dict:
    """Time what the trainer and publisher do for one new version of ``model``: write the checkpoint in
    ``dtype`` (:func:`write_policy_version`, ``save_s``), then shard, hash, link and sign it into a
    shardcast store (``publish_checkpoint``, ``shard_s``). Everything lands under ``out_root``
    (``checkpoint/`` and ``store/``); ``key`` is the coordinator's PrivateKey or its PEM path.

    Returns ``{publish_s, save_s, shard_s, bytes, files, dtype}``: ``bytes`` is what the manifest ships.
    """
    from veriroll.coordinator.models import DTYPES
    from veriroll.shardcast.publish import publish_checkpoint

    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    out_root = Path(out_root)
    checkpoint = out_root / "checkpoint"
    t0 = time.perf_counter()
    write_policy_version(model, tokenizer_dir, checkpoint, dtype)
    t1 = time.perf_counter()
    # link=True as the coordinator's publisher does: installed versions are never modified in place.
    result = publish_checkpoint(checkpoint, out_root / "store", key, version, link=True,
                                **({"shard_size": shard_size} if shard_size else {}))
    t2 = time.perf_counter()
    return {"publish_s": t2 - t0, "save_s": t1 - t0, "shard_s": t2 - t1, "bytes": int(result.total_bytes),
            "files": len(result.manifest.files), "dtype": str(dtype).removeprefix("torch.")}


# ---------------------------------------------------------------------------------------------------
# The trainer: store in, versions out


@dataclass
class StepOutcome:
    """What one call of :meth:`Trainer.step` did: ``'trained'``, ``'waiting'`` (too few fresh groups) or
    ``'done'`` (a stop condition holds); ``published`` is the new policy version, if this step made one."""

    kind: str
    step: int = 0
    published: int | None = None
    metrics: dict = field(default_factory=dict)


class Trainer:
    """Trains the policy on the groups in ``db``, publishing versions into ``policy_store``.

    Synchronous and single-threaded: the coordinator drives it from one worker thread
    (:func:`start_trainer`); benchmarks and tests may call :meth:`resume` and :meth:`step` directly.
    ``metrics`` is the coordinator's :class:`CoordinatorMetrics` (or ``None``).
    """

    def __init__(self, cfg: CoordinatorConfig, db: st.Database, policy_store, *, metrics=None,
                 clock=time.time, policy: PolicyState | None = None, advances_policy: bool = True) -> None:
        self.cfg = cfg
        self.tcfg: TrainerConfig = cfg.trainer
        self.s_max = cfg.intake.s_max
        # A batch holds at most groups_per_step groups, so waiting for more would be waiting forever.
        self.min_groups = min(self.tcfg.min_groups, self.tcfg.groups_per_step)
        if self.min_groups < self.tcfg.min_groups:
            log.warning("trainer.min_groups %d > groups_per_step %d; using %d", self.tcfg.min_groups,
                        self.tcfg.groups_per_step, self.min_groups)
        from veriroll.coordinator.models import DTYPES

        if cfg.model_dtype not in DTYPES:
            raise ValueError(f"model_dtype must be one of {', '.join(DTYPES)}, got {cfg.model_dtype!r}")
        # Published versions are in the operator's dtype; the trainer's own weights stay float32.
        self.publish_dtype = DTYPES[cfg.model_dtype]
        self.db = db
        self.policy_store = policy_store
        self.metrics = metrics
        self.clock = clock
        self.state_dir = Path(policy_store.root) / "trainer"
        self.staging_dir = Path(policy_store.root) / ".staging"
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step_no = 0
        # The current policy version, which the lease desk and intake read: the trainer's pipeline is its one
        # owner. A step's version becomes current once committed and, under a coordinator, published
        # (advances_policy False: start_trainer advances it after shardcast holds the version, so that no
        # node is told a version no relay serves yet); standalone, the trainer advances it at the commit.
        self.policy = policy if policy is not None else PolicyState()
        self.advances_policy = advances_policy
        self._version = self.policy.version  # the newest version committed: staleness counts from it
        self.broken = False
        self.resume_reference: dict[int, int] = {}  # group id → version its staleness counts from
        self.done = False
        self.history: list[dict] = []
        self._stale_pending: Counter = Counter()  # staleness → samples dropped since the last step
        self._stale_groups_pending = 0
        self._last_step_end = clock()
        self._waiting_since: float | None = None
        self._last_wait_log = 0.0

    @property
    def version(self) -> int:
        """The newest policy version the trainer committed (its weights' version)."""
        return self._version

    # -- start -------------------------------------------------------------------------------------

    def _load_model(self, version: int) -> torch.nn.Module:
        return load_training_model(self.policy_store.version_dir(version))

    def resume(self) -> None:
        """Load the newest complete training state (or start at step 0 from the oldest version on disk,
        version 0) and make every group consumed after that step unconsumed again."""
        torch.set_num_threads(self.tcfg.threads)
        base_version = self.policy_store.available()[0]
        self.model = self._load_model(base_version)
        self.optimizer = build_optimizer(self.model, self.tcfg)
        found = latest_training_state(self.state_dir)
        if found is not None:
            step, state = found
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            for group in self.optimizer.param_groups:  # the configured lr wins over the saved one
                group["lr"] = self.tcfg.lr
                group["weight_decay"] = self.tcfg.weight_decay
            torch.set_rng_state(state["torch_rng"])
            random.setstate(_tuplify(state["python_rng"]))
        else:
            step, state = 0, {"consumed_groups": 0}
        self.step_no = step
        if self.tcfg.kl_coef != 0.0:
            self.ref_model = self._load_model(base_version).requires_grad_(False)

        def op(conn):
            reset = st.unconsume_after(conn, step)
            # Those groups were trained into weights that the crash lost. The restored weights are the
            # checkpoint's version: their staleness counts from it, not from the newest version number,
            # or the resume would drop as stale exactly the groups it promised to train again.
            reference = {gid: int(state.get("version", 0)) for gid in reset}
            st.kv_set(conn, "trainer_step", step)
            history = [h for h in st.kv_get(conn, HISTORY_KEY, []) if h.get("step", 0) <= step]
            st.kv_set(conn, HISTORY_KEY, history)
            version = int(st.kv_get(conn, "policy_version", 0))
            was_done = bool(st.kv_get(conn, "trainer_done", False))
            return len(reset), reference, history, version, was_done, st.consumed_groups(conn)

        reset, reference, self.history, version, was_done, trained = self.db.run_sync(op)
        self.resume_reference = reference
        self._version = version
        if version > self.policy.version:
            self.policy.advance(version)
        if trained != state.get("consumed_groups", trained):
            # The store and the checkpoint disagree on what the weights have seen (a store restored from
            # another backup than the checkpoints?): training goes on, but an operator should know.
            log.warning("the checkpoint of step %d was taken after %d consumed groups, the store now shows %d",
                        step, state["consumed_groups"], trained)
        # The stop conditions are checked against the current config: raising max_steps continues training.
        self.done = self._stop_reason() is not None
        if self.done != was_done:
            done = self.done
            self.db.run_sync(lambda c: st.kv_set(c, "trainer_done", done))
        log.info("trainer at step %d, policy version %d (%s)%s; %d groups consumed after step %d will be trained again",
                 step, self.version, "from checkpoint" if found else f"fresh start from version {base_version}",
                 "; training finished" if self.done else "", reset, step)
        self._last_step_end = self.clock()

    # -- one step ----------------------------------------------------------------------------------

    def _stop_reason(self) -> str | None:
        t = self.tcfg
        if t.max_steps and self.step_no >= t.max_steps:
            return f"max_steps {t.max_steps} reached"
        if t.target_reward > 0:
            recent = [h["reward"] for h in self.history[-t.target_window:] if h.get("reward") is not None]
            if len(recent) >= t.target_window and sum(recent) / len(recent) >= t.target_reward:
                return f"mean reward {sum(recent) / len(recent):.3f} over {len(recent)} steps ≥ target {t.target_reward}"
        return None

    def step(self) -> StepOutcome:
        """Train one step if enough fresh groups wait; otherwise report waiting (or done)."""
        if self.model is None:
            raise RuntimeError("call resume() first")
        if self.done:
            return StepOutcome("done", self.step_no)
        t = self.tcfg
        fresh, stale = self.db.read(lambda c: select_groups(c, self.version, self.s_max, t.groups_per_step,
                                                            self.resume_reference)).result()
        if stale:
            self._drop_stale(stale)
        if len(fresh) < self.min_groups:
            self._note_waiting(len(fresh))
            return StepOutcome("waiting", self.step_no)
        self._waiting_since = None
        started = self.clock()
        groups = self.db.read(lambda c: load_groups(c, [g for g, _ in fresh])).result()
        staleness = [s for _, s in fresh]
        batch, signal = build_batch(groups, staleness, std_scale=t.std_scale,
                                    pad_id=int(getattr(self.policy_store.tokenizer, "pad_token_id", 0) or 0))
        next_step = self.step_no + 1
        try:
            # From here the weights change: the step counts only once its commit (groups consumed, step,
            # history, version) is durable. Until then nothing else moves; if anything fails, the weights
            # go back to the last checkpoint and its groups are trained again, never twice.
            if batch is not None:
                m = train_step(self.model, self.optimizer, batch, t, self.s_max, ref_model=self.ref_model)
            else:
                m = {}
                log.info("step %d: no group in the batch has a learning signal; no update", next_step)
            # A version installed here but never committed is skipped, not reused (see _install_version).
            new_version = self._install_version() if next_step % t.publish_weights_every == 0 else None
            record = self._record(groups, staleness, signal, m, started, new_version, next_step)
            history = [*self.history, record][-HISTORY_CAP:]
            self.db.run_sync(lambda conn: st.commit_step(conn, next_step, [g.group_id for g in groups], history,
                                                         new_version))
        except BaseException:
            self._recover(next_step)
            raise
        self.step_no, self.history = next_step, history
        if new_version is not None:
            self._version = new_version
            if self.advances_policy:
                self.policy.advance(new_version)
            # Versions older than the staleness window are accepted nowhere any more; one extra is kept
            # for a verification that started just before this publish.
            self.policy_store.prune(new_version - self.s_max - 1, protect=(0,))
        reason = self._stop_reason()
        if self.step_no % t.checkpoint_every == 0 or reason is not None:
            self.save_state()
        if reason is not None:
            self.done = True
            self.db.run_sync(lambda c: st.kv_set(c, "trainer_done", True))
            log.info("training finished at step %d: %s; the coordinator keeps serving", self.step_no, reason)
        self._export(record)
        return StepOutcome("trained", self.step_no, new_version, record)

    def _recover(self, failed_step: int) -> None:
        """After a failed step: back to the newest checkpoint (weights, optimizer, step, history) and the
        store's view of what is trained. If even that fails the trainer stops (``broken``) rather than
        train on weights nobody can account for."""
        log.error("trainer step %d failed; going back to the last checkpoint", failed_step)
        try:
            self.resume()
        except BaseException:
            self.broken = True
            log.critical("trainer could not go back to its checkpoint; training stops (the coordinator keeps "
                         "serving; restart it to resume from the checkpoint)")
            raise

    def _note_waiting(self, fresh: int) -> None:
        now = self.clock()
        if self._waiting_since is None or now - self._last_wait_log >= WAIT_LOG_EVERY_S:
            waited = "" if self._waiting_since is None else f" (for {now - self._waiting_since:.0f} s)"
            log.info("trainer waiting for groups: %d fresh queued, min_groups is %d%s", fresh, self.min_groups, waited)
            self._last_wait_log = now
            if self._waiting_since is None:
                self._waiting_since = now

    def _drop_stale(self, stale: list[tuple[int, int]]) -> None:
        ids = [g for g, _ in stale]

        sizes = self.db.run_sync(lambda conn: st.drop_groups(conn, ids, "stale"))
        for g, s in stale:
            self._stale_pending[s] += int(sizes.get(g, 0))
        self._stale_groups_pending += len(stale)
        log.info("dropped %d stale groups (staleness %s > s_max %d)", len(stale),
                 ",".join(str(s) for s in sorted({s for _, s in stale})), self.s_max)

    def _install_version(self) -> int:
        """Write the current weights as the next policy version (HF format, ``cfg.model_dtype``) and install
        it; returns it. Runs in the trainer's worker thread, never on the event loop.

        The number is one past both the announced version and anything on disk, so a version a crashed
        run installed but never announced is never reused. Tokenizer files, chat template and generation
        config are copied from the oldest version on disk (version 0) byte for byte.
        """
        on_disk = self.policy_store.available()
        version = max([self.version, *on_disk]) + 1
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.staging_dir / f"v{version:06d}-{int(self.clock() * 1000)}"
        started = time.perf_counter()
        write_policy_version(self.model, self.policy_store.version_dir(on_disk[0]), tmp, self.publish_dtype)
        dest = self.policy_store.install(tmp, version)
        size = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
        log.info("wrote version %d (%s, %.1f MB) in %.2f s", version, self.cfg.model_dtype, size / 1e6,
                 time.perf_counter() - started)
        return version

    def _record(self, groups, staleness, signal, m: dict, started: float, new_version: int | None, step: int) -> dict:
        now = self.clock()
        rewards = [s.reward for g in groups for s in g.samples]
        by_env: dict[str, list[float]] = {}
        for g in groups:
            by_env.setdefault(g.env, []).extend(s.reward for s in g.samples)
        hist = Counter(self._stale_pending)
        for g, s in zip(groups, staleness, strict=True):
            hist[s] += len(g.samples)
        stale_samples = sum(self._stale_pending.values())
        considered = stale_samples + sum(len(g.samples) for g in groups)
        tokens = sum(g.tokens for g in groups)
        interval = max(now - self._last_step_end, 1e-9)
        queue_depth = self.db.read(st.queued_groups).result()
        # The batch's own groups are still unconsumed until the commit below.
        queue_depth = max(0, int(queue_depth) - len(groups))
        record = {
            "step": step,
            "version": new_version if new_version is not None else self.version,
            "time": now,
            "reward": sum(rewards) / len(rewards) if rewards else None,
            "reward_by_env": {k: sum(v) / len(v) for k, v in by_env.items() if v},
            "loss": m.get("loss"),
            "approx_kl": m.get("approx_kl"),
            "clipfrac": m.get("clipfrac"),
            "entropy": m.get("entropy"),
            "grad_norm": m.get("grad_norm"),
            "mismatch_kl": m.get("mismatch_kl"),
            "lr": self.optimizer.param_groups[0]["lr"],
            "frac_stale": stale_samples / considered if considered else 0.0,
            "dropped_stale_groups": self._stale_groups_pending,
            "staleness_hist": {str(k): int(v) for k, v in sorted(hist.items())},
            "groups": len(groups),
            "tokens": tokens,
            "groups_per_s": len(groups) / interval,
            "tokens_per_s": tokens / interval,
            "zero_adv_groups": int((~signal).sum()),
            "queue_depth": queue_depth,
            "step_seconds": now - started,
        }
        self._stale_pending.clear()
        self._stale_groups_pending = 0
        self._last_step_end = now
        # JSON has no inf or nan (a browser's JSON.parse rejects them): a non-finite number is recorded as null.
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}

    def _export(self, r: dict) -> None:
        env_part = " ".join(f"{k} {v:.3f}" for k, v in r["reward_by_env"].items())
        log.info("step %d v%d | reward %s (%s) | loss %s kl %s clip %s ent %s gnorm %s mismatch %s | groups %d "
                 "(%d zero-adv, %d stale dropped) tokens %d | %.1f groups/s %.0f tok/s | queue %d | staleness %s",
                 r["step"], r["version"], _f(r["reward"]), env_part, _f(r["loss"]), _f(r["approx_kl"], 4),
                 _f(r["clipfrac"]), _f(r["entropy"]), _f(r["grad_norm"]), _f(r["mismatch_kl"], 4), r["groups"],
                 r["zero_adv_groups"], r["dropped_stale_groups"], r["tokens"], r["groups_per_s"], r["tokens_per_s"],
                 r["queue_depth"], json.dumps(r["staleness_hist"]))
        if self.metrics is None:
            return
        gauge = self.metrics.trainer
        for key in ("reward", "loss", "approx_kl", "clipfrac", "entropy", "grad_norm", "mismatch_kl", "lr",
                    "frac_stale", "dropped_stale_groups", "groups", "tokens", "groups_per_s", "tokens_per_s",
                    "zero_adv_groups", "queue_depth", "step_seconds", "version"):
            if r.get(key) is not None:
                gauge.set(r[key], metric=key)
        for env, value in r["reward_by_env"].items():
            gauge.set(value, metric=f"reward_{env}")
        gauge.set(r["step"], metric="step")
        self.metrics.trainer_steps.inc()
        self.metrics.trainer_staleness.clear()
        for s, n in r["staleness_hist"].items():
            self.metrics.trainer_staleness.set(n, staleness=s)

    # -- state -------------------------------------------------------------------------------------

    def save_state(self) -> Path:
        """Checkpoint the full training state at the current step (atomically)."""
        state = {
            "format": STATE_FORMAT,
            "step": self.step_no,
            "version": self.version,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": _listify(random.getstate()),
            "time": self.clock(),
            # What the weights have been trained on is the groups with consumed_step <= step; their
            # number is kept as a cross-check against the store on resume.
            "consumed_groups": self.db.read(lambda c: st.consumed_groups(c, self.step_no)).result(),
        }
        return save_training_state(self.state_dir, self.step_no, state, keep=self.tcfg.keep_checkpoints)


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, tuple) else x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# ---------------------------------------------------------------------------------------------------
# The coordinator's side


async def start_trainer(coord) -> Trainer:
    """Resume the trainer of ``coord`` and keep it stepping in a worker thread until the coordinator stops.

    After a step that publishes, the new version is announced on the event loop: nodes are told it
    (``coord.service.policy.version``) and, where the coordinator has a publisher, it is handed to
    shardcast (``coord.publish_version``).
    """
    trainer = Trainer(coord.cfg, coord.db, coord.policy_store, metrics=coord.service.metrics,
                      policy=coord.service.policy, advances_policy=False)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="veriroll-trainer")
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(pool, trainer.resume)
    coord.trainer = trainer
    coord.tasks.append(asyncio.create_task(_train_forever(coord, trainer, pool), name="veriroll-trainer"))

    async def close() -> None:
        # Let a step in flight finish (and commit) before the store closes.
        await asyncio.to_thread(pool.shutdown, True)

    coord.closers.append(close)
    return trainer


async def _train_forever(coord, trainer: Trainer, pool: ThreadPoolExecutor) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            outcome = await loop.run_in_executor(pool, trainer.step)
        except asyncio.CancelledError:
            raise
        except Exception:  # the coordinator keeps serving; the step was rolled back, or training stops
            if trainer.broken:
                log.exception("trainer stopped")
                return
            log.exception("trainer step failed and was rolled back to the last checkpoint; retrying in 5 s")
            await asyncio.sleep(5.0)
            continue
        if outcome.published is not None:
            await _announce(coord, outcome.published)
        if outcome.kind != "trained":
            await asyncio.sleep(POLL_S if outcome.kind == "waiting" else 1.0)


async def _announce(coord, version: int) -> None:
    """Make a committed version current once shardcast holds it: published first (signed manifest, origin
    relay), then ``coord.service.policy`` advanced, so nodes are never told a version no relay serves."""
    if hasattr(coord, "publish_version"):
        try:
            await coord.publish_version(version)
        except Exception:  # announced anyway: nodes get it from the disk-backed origin on retry
            log.exception("handing version %d to shardcast failed", version)
    coord.service.policy.advance(version)
    coord.service.metrics.policy_version.set(version)
