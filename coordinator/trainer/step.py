"""One optimizer step on a batch: log-probs at the lease temperature, the async PPO loss summed over
micro-batches (packed: several samples per row; or padded), one normalization by the step's Σw, gradient
clipping, AdamW.

Each micro-batch backpropagates its unnormalized Σ per_token·w (:func:`accumulate`); the summed gradient is
divided by max(Σw, 1) of the whole step once (:func:`scale_gradients`), so the split changes nothing but the
padding. ``distributed.py`` runs the same pieces on every rank of a process group.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.nn.functional as F

from veriroll.coordinator.config import PACKING_ATTENTION, TrainerConfig
from veriroll.coordinator.loss import async_ppo_loss
from veriroll.coordinator.trainer.batch import RolloutBatch, micro_batches, pack_rows

__all__ = ["accumulate", "apply_update", "autocast_dtype", "check_packing_attention", "completion_logprobs", "scale_gradients",
           "set_gradient_checkpointing", "step_means", "train_step"]

log = logging.getLogger("veriroll.trainer")


def completion_logprobs(model: torch.nn.Module, batch: RolloutBatch, *,
                        packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[B, T]`` of the sampled tokens under ``softmax(logits / T)`` (with gradient), and the
    per-token entropy ``[B, T]`` of that distribution (detached).

    Padded: one row per sample, padding masked by ``attention_mask`` alone, never by comparing ids with the
    pad id: real tokenizers often pad with EOS (SmolLM2: pad = eos = 2), which is also the last token of a
    completion. Packed (``packed=True``): the samples end to end in one row (:func:`pack_rows`), position
    ids restarting at 0 per sample and no 2-D mask, which is transformers' packed-sequence format: sdpa and
    eager build a block-diagonal causal mask from the position ids, flash-attention runs its varlen kernel on
    the cu_seqlens they imply. Either way the result is per sample, in ``batch``'s rows: the loss, masks,
    advantages and importance weights downstream are the same tensors. The softmax is taken in float32 even
    when the forward ran under bf16 autocast.
    """
    # No KV cache: training reads every position once, and a cache would only hold memory (and a cache
    # would also switch transformers' packed-sequence detection off).
    if packed:
        return _packed_logprobs(model, batch)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    vocab = logits.shape[-1]
    picked = logits.gather(1, batch.positions[..., None].expand(-1, -1, vocab)).float()
    logp_all = F.log_softmax(picked / batch.temperature[:, None, None], dim=-1)
    logp = logp_all.gather(-1, batch.completion_ids[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _packed_logprobs(model: torch.nn.Module, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`completion_logprobs` of a packed forward. The softmax is taken at the real completion tokens
    only: a packed micro-batch mixes lengths, and ``[B, T, vocab]`` over its longest completion would spend
    most of its time on padding; the positions outside ``response_mask`` come back 0, as the loss ignores."""
    check_packing_attention(model)
    row = pack_rows(batch)
    logits = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False).logits[0]
    real = batch.response_mask
    temperature = batch.temperature[:, None].expand_as(real)[real]
    logp_all = F.log_softmax(logits[row.index[real]].float() / temperature[:, None], dim=-1)  # [tokens, vocab]
    where = real.nonzero(as_tuple=True)
    logp = logits.new_zeros(real.shape, dtype=torch.float32).index_put(
        where, logp_all.gather(-1, batch.completion_ids[real][:, None]).squeeze(-1))
    with torch.no_grad():
        entropy = torch.zeros(real.shape, dtype=torch.float32, device=real.device).index_put(
            where, -(logp_all.exp() * logp_all).sum(-1))
    return logp, entropy


def check_packing_attention(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` unless ``model`` (maybe DDP-wrapped) runs an attention implementation that
    confines attention to each sample of a packed row (``config.PACKING_ATTENTION``)."""
    inner = getattr(model, "module", model)
    name = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if name not in PACKING_ATTENTION or name == "auto":
        raise ValueError(f"packed micro-batches need an attention implementation that confines attention to each "
                         f"sample ({', '.join(a for a in PACKING_ATTENTION if a != 'auto')}); this model runs "
                         f"{name!r}: set trainer.packing = false or load it with one of those")


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
    weighted sums, ready to be added across micro-batches and ranks (``step_means`` turns them into means)."""
    logp, entropy = completion_logprobs(model, batch, packed=cfg.packing)
    logp_ref = None
    if cfg.kl_coef != 0.0:
        with torch.no_grad():
            logp_ref, _ = completion_logprobs(ref_model, batch, packed=cfg.packing)
    loss, m = async_ppo_loss(logp, batch.logp_behavior, batch.advantages, batch.response_mask, batch.staleness,
                             logp_ref=logp_ref, **_loss_kwargs(cfg, s_max, batch))
    mask = batch.response_mask.float()
    # The loss is a sum over max(Σw, 1); times that clamp it is the plain sum again, exactly, whatever Σw.
    d = max(m["tokens_used"], 1.0)
    trusted_rows = batch.has_trusted[:, None].float() * mask
    mismatch = (batch.logp_trusted - batch.logp_behavior).where(batch.response_mask, 0.0)
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


def step_means(sums: dict) -> dict:
    """The step's diagnostics as means, from the weighted sums of all its micro-batches (and ranks)."""
    d = max(sums["tokens_used"], 1.0)  # the loss's own denominator, max(Σw, 1), over the whole step
    out = {k: sums[k] / d for k in ("loss", "pg_loss", "approx_kl", "clipfrac", "tis_capped_frac", "ratio_mean", "kl_ref")}
    out["entropy"] = sums["entropy"] / max(sums["response_tokens"], 1.0)
    out["mismatch_kl"] = sums["mismatch_kl"] / sums["trusted_tokens"] if sums["trusted_tokens"] > 0 else None
    out["tokens_used"] = sums["tokens_used"]
    out["micro_batches"] = sums["micro_batches"]
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


def accumulate(model, parts: list[RolloutBatch], cfg: TrainerConfig, s_max: int, ref_model, no_sync=None) -> dict:
    """Backward Σ per_token·w of every micro-batch into the gradients (unnormalized); their summed
    diagnostics. ``no_sync`` (DDP's) defers the gradient all-reduce to the last micro-batch.

    The batch is built and split on CPU (sorting lengths there costs no device syncs); each micro-batch
    goes to the model's device (``trainer.device``) just before its forward."""
    set_gradient_checkpointing(model, cfg.gradient_checkpointing)
    device = next(model.parameters()).device
    total: dict[str, float] = {}
    for i, part in enumerate(parts):
        part = part.to(device)
        ctx = no_sync() if no_sync is not None and i < len(parts) - 1 else contextlib.nullcontext()
        with ctx:
            with _forward_context(model, cfg):
                summed_loss, sums = _step_sums(model, part, cfg, s_max, ref_model)
            summed_loss.backward()
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + v
    return total


def scale_gradients(model: torch.nn.Module, factor: float) -> None:
    """Multiply every gradient by ``factor`` (the summed loss's gradient into the normalized one)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch, cfg: TrainerConfig,
               s_max: int, *, ref_model: torch.nn.Module | None = None) -> dict:
    """One optimizer step on ``batch`` (in micro-batches of ``cfg.micro_batch_tokens``, packed or padded as
    ``cfg.packing`` says); returns the step's diagnostics (loss, approx_kl, clipfrac, entropy, mismatch_kl,
    grad_norm, ...)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    parts = micro_batches(batch, cfg.micro_batch_tokens, packing=cfg.packing)
    sums = accumulate(model, parts, cfg, s_max, ref_model)
    # The gradients hold ∇ of the summed loss; the loss is that sum over max(Σw, 1) of the whole step.
    scale_gradients(model, 1.0 / max(sums["tokens_used"], 1.0))
    return apply_update(model, optimizer, cfg, step_means(sums))


def apply_update(model, optimizer, cfg: TrainerConfig, metrics: dict) -> dict:
    """Clip the gradients and take the optimizer step (skipped when their norm is not finite); ``metrics``
    with ``grad_norm``, ``lr`` and ``skipped_nonfinite`` added."""
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
