"""Sharded training state (torch.distributed.checkpoint): what 2 ranks (gloo, CPU) save after two steps, one
process resumes with equal parameters and optimizer state, and the reverse, under DDP and FSDP2.

The ranks run in spawned processes (see test_distributed_step for why spawn); each side compares full,
unsharded state dicts keyed by parameter name, so a DDP replica, an FSDP2 shard and a plain model compare
alike. Save and load are lossless: the comparison is exact.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from veriroll.coordinator.checkpoint import latest_training_state, load_sharded_state, save_training_state
from veriroll.coordinator.config import TrainerConfig
from veriroll.coordinator.trainer import (
    GroupRecord,
    SampleRecord,
    build_batch,
    distributed_train_step,
    train_step,
)

CFG = TrainerConfig(correction="mixed", max_grad_norm=1.0, lr=1e-3)
STEPS = 2


def make_model():
    from veriroll.coordinator.model_factory import build_char_tokenizer, build_tiny_model

    return build_tiny_model(build_char_tokenizer("0123456789+="), layers=2, hidden=32, heads=4, seed=0)


def make_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=CFG.lr, betas=(0.9, 0.99))


def make_batch(step: int):
    """Four groups of two, different per step, every group with a learning signal."""
    rng = np.random.default_rng(step)
    groups = []
    for g in range(4):
        prompt = np.array([1, *rng.integers(4, 16, size=3)], dtype=np.int32)
        samples = [SampleRecord(rng.integers(4, 16, size=2 + i).astype(np.int32),
                                (-rng.uniform(0.5, 3.0, size=2 + i)).astype(np.float32), None, float(i % 2))
                   for i in range(2)]
        groups.append(GroupRecord(g, "arithmetic", 0, 1.0, 0, prompt, samples))
    batch, _ = build_batch(groups, [0] * 4)
    return batch


def full_state(model, optimizer) -> dict:
    """Model and optimizer state unsharded, keyed by parameter name, on CPU (rank 0's; under
    torch.distributed every rank must call it)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    distributed = dist.is_available() and dist.is_initialized()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True) if distributed else None
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if distributed and dist.get_rank() != 0:
        return {}  # cpu_offload gathers the full state on rank 0 only

    def plain(x):
        if hasattr(x, "full_tensor"):
            x = x.full_tensor()
        return x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x

    return {"model": {k: plain(v) for k, v in model_state.items()},
            "state": {k: {n: plain(t) for n, t in s.items()} for k, s in optim_state["state"].items()},
            "param_groups": optim_state["param_groups"]}


def assert_same_state(got: dict, want: dict) -> None:
    assert got["model"].keys() == want["model"].keys()
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["state"].keys() == want["state"].keys() and want["state"]
    for k, s in want["state"].items():
        assert s.keys() == got["state"][k].keys()
        for n, t in s.items():
            assert torch.equal(torch.as_tensor(got["state"][k][n]), torch.as_tensor(t)), (k, n)
    strip = [{k: v for k, v in g.items() if k != "params"} for g in want["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in got["param_groups"]] == strip


def _rank(rank: int, world: int, init_file: str, root: str, strategy: str, mode: str) -> None:
    import torch.distributed as dist

    from veriroll.coordinator.trainer import wrap_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = wrap_distributed(make_model(), strategy)
        optimizer = make_optimizer(model)
        if mode == "save":
            for step in range(STEPS):
                distributed_train_step(model, optimizer, make_batch(step), CFG, s_max=4)
            save_training_state(root, STEPS, {"step": STEPS}, keep=2, model=model, optimizer=optimizer)
        else:
            step, state = latest_training_state(root)
            load_sharded_state(state["dir"], model, optimizer)
        got = full_state(model, optimizer)
        if rank == 0:
            torch.save(got, os.path.join(root, f"ranks-{mode}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _two_ranks(tmp_path, strategy: str, mode: str) -> dict:
    mp.start_processes(_rank, args=(2, str(tmp_path / f"init-{mode}"), str(tmp_path / "trainer"), strategy, mode),
                       nprocs=2, join=True, start_method="spawn")
    return torch.load(tmp_path / "trainer" / f"ranks-{mode}.pt", weights_only=False)


def _fsdp2() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401 - imported only to probe this torch build
    except ImportError:
        return False
    return True


STRATEGIES = ["ddp", pytest.param("fsdp2", marks=pytest.mark.skipif(not _fsdp2(), reason="this torch has no FSDP2"))]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_ranks_save_and_one_process_resumes_equal_parameters_and_optimizer_state(tmp_path, strategy):
    torch.set_num_threads(1)
    saved = _two_ranks(tmp_path, strategy, "save")
    step, state = latest_training_state(tmp_path / "trainer")
    assert step == STEPS and state["step"] == STEPS
    model = make_model()
    optimizer = make_optimizer(model)
    load_sharded_state(state["dir"], model, optimizer)
    assert_same_state(full_state(model, optimizer), saved)
    assert int(next(iter(optimizer.state.values()))["step"]) == STEPS  # Adam's bias correction carries on


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_process_saves_and_two_ranks_resume_equal_parameters_and_optimizer_state(tmp_path, strategy):
    torch.set_num_threads(1)
    model = make_model()
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        train_step(model, optimizer, make_batch(step), CFG, s_max=4)
    save_training_state(tmp_path / "trainer", STEPS, {"step": STEPS}, keep=2, model=model, optimizer=optimizer)
    assert_same_state(_two_ranks(tmp_path, strategy, "load"), full_state(model, optimizer))
