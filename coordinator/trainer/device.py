"""Where the trainer runs: ``trainer.device`` resolved on this machine (per rank under torchrun), the process
group's backend for that device, and what is refused at start, before anything is written: a CUDA device this
machine lacks, and a torchrun world size that does not divide the step's batch.

The config only checks that ``trainer.device`` is one of the names (``config.TRAINER_DEVICE``); whether the
device exists is a fact of the machine that runs the trainer, so it is checked here, by ``coordinator init``
and ``coordinator run`` (:func:`check_trainer_placement`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from veriroll.coordinator.config import CoordinatorConfig
from veriroll.protos.config import ConfigError

__all__ = ["check_trainer_device", "check_trainer_placement", "check_world_size", "cuda_devices", "init_process_group",
           "process_group_backend", "trainer_device", "world_size"]


def cuda_devices() -> int:
    """How many CUDA devices torch can use here (0 on a CPU-only build or machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number (torchrun sets it; so may your shell)") from None
    if value < 0:
        raise ConfigError(f"{name}={raw!r} must not be negative")
    return value


def world_size(environ: Mapping[str, str] | None = None) -> int:
    """The ranks of the training job: torchrun's ``WORLD_SIZE``, 1 without torchrun."""
    n = _env_int(os.environ if environ is None else environ, "WORLD_SIZE", 1)
    if n < 1:
        raise ConfigError(f"WORLD_SIZE={n} must be at least 1")
    return n


def trainer_device(setting: str, environ: Mapping[str, str] | None = None) -> torch.device:
    """The device ``trainer.device`` names on this machine. ``'auto'`` is CUDA where torch sees a device, else
    CPU; under torchrun (``LOCAL_RANK`` set) ``'auto'`` and ``'cuda'`` are ``cuda:LOCAL_RANK``, one GPU per rank
    (without it, ``cuda:0``). ``'cuda:N'`` is taken as it is. Whether that device exists is
    :func:`check_trainer_device`'s question, not this one's."""
    env = os.environ if environ is None else environ
    if setting == "cpu" or (setting == "auto" and cuda_devices() == 0):
        return torch.device("cpu")
    if setting in ("auto", "cuda"):
        return torch.device("cuda", _env_int(env, "LOCAL_RANK", 0))
    return torch.device(setting)


def check_trainer_device(setting: str, environ: Mapping[str, str] | None = None) -> torch.device:
    """:func:`trainer_device`, or ``ConfigError`` naming ``trainer.device`` and what this machine has when it
    names a CUDA device that is not here (or, under torchrun, pins every rank to one GPU)."""
    env = os.environ if environ is None else environ
    device = trainer_device(setting, env)
    if device.type != "cuda":
        return device
    count = cuda_devices()
    if count == 0:
        raise ConfigError(f"trainer.device = {setting!r}, but torch finds no CUDA device on this machine (torch "
                          f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); set trainer.device = "
                          f"'auto' or 'cpu', or run the trainer where a GPU is")
    if device.index >= count:
        via = f" (LOCAL_RANK {device.index})" if setting in ("auto", "cuda") else ""
        raise ConfigError(f"trainer.device = {setting!r} means cuda:{device.index}{via}, but this machine has "
                          f"{count} CUDA device{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})")
    ranks = world_size(env)
    if setting.startswith("cuda:") and ranks > 1:
        raise ConfigError(f"trainer.device = {setting!r} puts all {ranks} ranks (WORLD_SIZE) on one GPU; under "
                          f"torchrun set trainer.device = 'cuda' or 'auto' (each rank takes cuda:LOCAL_RANK)")
    return device


def check_world_size(cfg: CoordinatorConfig, environ: Mapping[str, str] | None = None) -> int:
    """The world size, or ``ConfigError`` when it does not divide the step's full batch
    (``trainer.groups_per_step`` x ``leases.group_size`` samples, which ``distributed.shard_batch`` splits
    into one contiguous share per rank) or exceeds the smallest batch the trainer steps on (``min_groups``
    groups): every rank gets the same share of a full batch, and no rank is ever left without samples."""
    ranks = world_size(environ)
    if ranks == 1:
        return ranks
    t, n = cfg.trainer, cfg.leases.group_size
    full = t.groups_per_step * n
    if full % ranks:
        raise ConfigError(f"WORLD_SIZE {ranks} does not divide the trainer's batch: trainer.groups_per_step "
                          f"{t.groups_per_step} x leases.group_size {n} = {full} samples, shared by the ranks; "
                          f"run a world size that divides {full}, or change trainer.groups_per_step")
    smallest = min(t.min_groups, t.groups_per_step) * n
    if smallest < ranks:
        raise ConfigError(f"WORLD_SIZE {ranks} is more ranks than the smallest batch the trainer steps on "
                          f"(trainer.min_groups {t.min_groups} x leases.group_size {n} = {smallest} samples): raise "
                          f"trainer.min_groups or run fewer ranks")
    return ranks


def check_trainer_placement(cfg: CoordinatorConfig, environ: Mapping[str, str] | None = None) -> torch.device | None:
    """What ``coordinator init`` and ``run`` check before they write anything: the trainer's device exists here
    and the world size fits the batch (``ConfigError`` otherwise). ``None`` when this process runs no trainer
    (``trainer.enabled`` off, or role 'edge' or 'verifier')."""
    if not cfg.trainer.enabled or cfg.role not in ("all", "trainer"):
        return None
    device = check_trainer_device(cfg.trainer.device, environ)
    check_world_size(cfg, environ)
    return device


def process_group_backend(device: torch.device | str) -> str:
    """The ``torch.distributed`` backend for ranks training on ``device``: NCCL on CUDA, gloo on CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_process_group(device: torch.device | str) -> None:
    """Join torchrun's process group (``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE`` from the environment) with the
    backend for ``device``. A CUDA rank first makes its own GPU current: NCCL binds its communicator to the
    current device, and two ranks on one GPU would deadlock."""
    import torch.distributed as dist

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device))
