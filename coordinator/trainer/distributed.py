"""The step under ``torch.distributed``: each rank trains on its shard of the batch, DDP (or FSDP2)
averages the gradients, and the all-reduced Σw normalizes them: the update is the single-process update."""

from __future__ import annotations

import torch

from veriroll.coordinator.config import TrainerConfig
from veriroll.coordinator.trainer.batch import RolloutBatch, micro_batches
from veriroll.coordinator.trainer.step import accumulate, apply_update, scale_gradients, step_means

__all__ = ["distributed_train_step", "shard_batch", "wrap_distributed"]


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
    parts = micro_batches(local, cfg.micro_batch_tokens, packing=cfg.packing) if no_sync is not None else [local]
    sums = accumulate(model, parts, cfg, s_max, ref_model, no_sync=no_sync)
    keys = sorted(sums)
    # On the model's device: NCCL reduces CUDA tensors only (gloo, CPU ones).
    totals = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=next(model.parameters()).device)
    dist.all_reduce(totals)
    total = dict(zip(keys, totals.tolist(), strict=True))
    scale_gradients(model, world / max(total["tokens_used"], 1.0))
    return apply_update(model, optimizer, cfg, step_means(total))
