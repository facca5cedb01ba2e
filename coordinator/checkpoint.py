"""The trainer's full state on disk: ``CHECKPOINTS/trainer/step-NNNNNNNN/state.pt``, written atomically.

A training-state checkpoint holds what it takes to continue training as if never stopped: weights,
optimizer moments, the step and policy version it was taken at, the RNG states and the trainer's own
bookkeeping. Which groups it has trained on is implied by its step: the store marks every consumed
group with the step that consumed it (``groups.consumed_step``), so "trained into this checkpoint"
is exactly ``consumed_step <= step``.

Each checkpoint is written into a temporary sibling directory, fsynced, and renamed into place: a
directory named ``step-N`` is complete, and a crash leaves at worst a ``.step-N.tmp-*`` directory
that the next start removes.

The weights and the optimizer state are sharded training state (``step-N/sharded/``, written with
``torch.distributed.checkpoint``): every rank of a job writes its own shards, and a job of any other
number of ranks (one process included) loads them (:func:`load_sharded_state`); ``state.pt`` then holds
the rest. A checkpoint of the first format, everything in ``state.pt``, is still read as it is.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from veriroll.coordinator.models import fsync_dir

__all__ = ["SHARDED_DIR", "STATE_FILE", "latest_training_state", "list_training_states", "load_sharded_state",
           "save_training_state"]

STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"  # the model and optimizer state, torch.distributed.checkpoint's files
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def list_training_states(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, directory)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / STATE_FILE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _group() -> tuple[bool, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank()
    return False, 0


@contextlib.contextmanager
def _single_process_quietly():
    # A single-process trainer is the normal case, not a mistake: DCP warns at every save and load without
    # a process group, which would repeat in the log at every checkpoint.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def sharded_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"model", "optimizer"}`` state dicts keyed by parameter name, whatever wraps ``model`` (DDP, FSDP2's
    DTensor shards): the form torch.distributed.checkpoint saves and reshards on load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # An optimizer without state yet gets it here (one step with zero gradients at lr 0: no weight moves).
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def save_training_state(root: str | os.PathLike, step: int, state: dict, *, keep: int,
                        model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> Path:
    """Write ``state`` as the checkpoint of ``step`` under ``root``, keep the newest ``keep``; returns its dir.

    With ``model`` and ``optimizer`` their state is written as sharded training state (``sharded/``), and
    under ``torch.distributed`` every rank must call this: each writes its shards, rank 0 the rest
    (``state``) and the rename; all return once the checkpoint is in place.

    An existing checkpoint of the same step is replaced (it can only be a leftover of an earlier run that
    was resumed from an older checkpoint and has now trained this step again).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    distributed, rank = _group()
    root = Path(root)
    final = root / f"step-{step:08d}"
    tmp = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    if distributed:
        named = [str(tmp) if tmp is not None else None]
        dist.broadcast_object_list(named, src=0)  # every rank writes into rank 0's temporary directory
        tmp = Path(named[0])
    try:
        if model is not None:
            # Returns on every rank once all shards and the metadata are written (and fsynced: sync_files).
            with _single_process_quietly():
                dcp.save(sharded_state_dict(model, optimizer), storage_writer=dcp.FileSystemWriter(tmp / SHARDED_DIR),
                         no_dist=not distributed)
        if rank == 0:
            _write_in_place(tmp, final, state)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if distributed:
        dist.barrier()  # no rank goes on to train before the checkpoint is in place
    if rank == 0:
        for _, old_dir in list_training_states(root)[:-keep]:
            shutil.rmtree(old_dir, ignore_errors=True)
    return final


def _write_in_place(tmp: Path, final: Path, state: dict) -> None:
    root = final.parent
    path = tmp / STATE_FILE
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if (tmp / SHARDED_DIR).is_dir():
        fsync_dir(tmp / SHARDED_DIR)
    fsync_dir(tmp)
    if final.exists():
        old = root / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)


def load_sharded_state(checkpoint_dir: str | os.PathLike, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer) -> None:
    """Load the sharded model and optimizer state of ``checkpoint_dir`` (a ``step-N`` directory) into ``model``
    and ``optimizer``, in place and on their devices, however many ranks wrote it and however ``model`` is
    wrapped now; under ``torch.distributed`` every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    target = sharded_state_dict(model, optimizer)
    with _single_process_quietly():
        dcp.load(target, storage_reader=dcp.FileSystemReader(Path(checkpoint_dir) / SHARDED_DIR),
                 no_dist=not _group()[0])
    set_state_dict(model, optimizer, model_state_dict=target["model"], optim_state_dict=target["optimizer"])


def latest_training_state(root: str | os.PathLike) -> tuple[int, dict] | None:
    """The newest complete checkpoint under ``root`` as ``(step, state)``, or ``None``. ``state["dir"]`` is its
    directory: without ``"model"`` in it, the weights and optimizer are there (:func:`load_sharded_state`).

    Leftover temporary directories of interrupted writes are removed first (by rank 0 only, under
    ``torch.distributed``: another rank's leftover may be a checkpoint rank 0 is writing).
    """
    root = Path(root)
    if not root.is_dir():
        return None
    if _group()[1] == 0:
        for p in root.iterdir():
            if p.name.startswith(".step-"):
                shutil.rmtree(p, ignore_errors=True)
    states = list_training_states(root)
    if not states:
        return None
    step, path = states[-1]
    # weights_only: plain containers of tensors and numbers; our own file, but no pickled code either way.
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    state["dir"] = path
    return step, state
