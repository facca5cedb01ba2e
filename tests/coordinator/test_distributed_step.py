"""The trainer's step under torch.distributed (2 CPU processes, gloo) matches the single-process step:
the same loss, diagnostics and parameter update on the same batch.

Two optimizers pin two things: plain SGD (lr 1) makes the update the clipped gradient itself, so the
gradients must agree; AdamW is what the trainer uses. Its first step is lr · g / (|g| + eps), which
amplifies float rounding in elements whose gradient is near eps ~ 1e-8, so it is compared at the
trainer's default lr (1e-4), where the update is ~1e-4 and any such element moves < 1e-6 apart.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from veriroll.coordinator.config import TrainerConfig
from veriroll.coordinator.trainer import (
    GroupRecord,
    SampleRecord,
    build_batch,
    distributed_train_step,
    train_step,
)

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1.0),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.99)),
}


def make_model():
    from veriroll.coordinator.model_factory import build_char_tokenizer, build_tiny_model

    return build_tiny_model(build_char_tokenizer("0123456789+="), layers=2, hidden=64, heads=4, seed=0)


def make_batch():
    """Five groups of four with ragged prompts and completions, some with trusted log-probs."""
    rng = np.random.default_rng(0)
    groups = []
    for g in range(5):
        prompt = np.array([1, *rng.integers(4, 16, size=2 + g % 3)], dtype=np.int32)
        samples = []
        for i in range(4):
            n = 1 + (g + i) % 4
            tokens = rng.integers(4, 16, size=n).astype(np.int32)
            behaviour = (-rng.uniform(0.5, 3.0, size=n)).astype(np.float32)
            trusted = (behaviour + rng.normal(0, 0.05, size=n)).astype(np.float32) if g % 2 else None
            samples.append(SampleRecord(tokens, behaviour, trusted, float(rng.integers(0, 2))))
        samples[0].reward, samples[1].reward = 1.0, 0.0  # every group carries a signal
        groups.append(GroupRecord(g, "arithmetic", 0, 0.8 if g == 3 else 1.0, 0, prompt, samples))
    batch, keep = build_batch(groups, [0, 1, 0, 2, 1])
    assert bool(keep.all())
    return batch


CFG = TrainerConfig(correction="decoupled", max_grad_norm=0.5)
# Small enough that every rank's shard (and the single process's batch) is split into several micro-batches.
SPLIT = {"ddp": CFG.model_copy(update={"micro_batch_tokens": 40}), "fsdp2": CFG}


def params_of(model) -> dict[str, torch.Tensor]:
    inner = model.module if hasattr(model, "module") else model
    # FSDP2 shards are DTensors; full_tensor() gathers them.
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in inner.named_parameters()}


def _rank(rank: int, world: int, init_file: str, out_dir: str, strategy: str) -> None:
    import torch.distributed as dist

    from veriroll.coordinator.trainer import wrap_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out = {}
        for name, make_optimizer in OPTIMIZERS.items():
            model = wrap_distributed(make_model(), strategy)
            metrics = distributed_train_step(model, make_optimizer(model.parameters()), make_batch(), SPLIT[strategy],
                                             s_max=4)
            out[name] = {"metrics": metrics, "params": params_of(model)}
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "rank0.pt"))
        # Both ranks reach here before either tears gloo down: a rank whose peer closed the connections
        # under it aborted ("terminate called without an active exception"), seen once under FSDP2.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _fsdp2_on_cpu() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401 - imported only to probe this torch build
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.skipif(
    not _fsdp2_on_cpu(), reason="this torch has no FSDP2 (fully_shard)"))])
def test_two_process_step_matches_one_process_step(tmp_path, strategy):
    torch.set_num_threads(1)
    single = {}
    for name, make_optimizer in OPTIMIZERS.items():
        model = make_model()
        before = params_of(model)
        metrics = train_step(model, make_optimizer(model.parameters()), make_batch(), SPLIT[strategy], s_max=4)
        single[name] = before, metrics, params_of(model)

    # spawn, not fork: by now this process has threads of earlier tests (gRPC, SQLite writers, reward
    # pools), and a child forked while one of them holds a lock can hang for ever (seen once in a full
    # run: one rank stuck, no CPU used); fork also crashed children that garbage-collected inherited
    # gRPC objects. Spawned ranks import torch afresh (a few seconds) and share nothing.
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(tmp_path), strategy), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)

    for name, (before, metrics, after) in single.items():
        dist_metrics, dist_params = got[name]["metrics"], got[name]["params"]
        assert dist_metrics["micro_batches"] > 2 if strategy == "ddp" else dist_metrics["micro_batches"] == 2
        for key in ("loss", "pg_loss", "approx_kl", "clipfrac", "entropy", "mismatch_kl", "grad_norm", "tokens_used"):
            assert dist_metrics[key] == pytest.approx(metrics[key], rel=1e-6, abs=1e-6), (name, key)
        assert dist_params.keys() == after.keys()
        for p in after:
            assert not torch.equal(after[p], before[p]), f"{name}: the step left {p} unchanged"
            torch.testing.assert_close(dist_params[p] - before[p], after[p] - before[p], rtol=0, atol=1e-6,
                                       msg=f"{name}: {p}")


def test_micro_batches_change_nothing_but_the_padding():
    torch.set_num_threads(1)
    batch = make_batch()
    results = []
    for budget in (10_000, 40, 1):
        model = make_model()
        metrics = train_step(model, OPTIMIZERS["sgd"](model.parameters()), batch,
                             CFG.model_copy(update={"micro_batch_tokens": budget}), s_max=4)
        results.append((metrics, params_of(model)))
    (whole, p0), *split = results
    counts = [m["micro_batches"] for m, _ in results]
    assert counts[0] == 1 and 2 < counts[1] < batch.size and counts[2] == batch.size
    for metrics, params in split:
        for key in ("loss", "approx_kl", "clipfrac", "entropy", "mismatch_kl", "grad_norm"):
            assert metrics[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-7), key
        for name in p0:
            torch.testing.assert_close(params[name], p0[name], rtol=0, atol=1e-6)
