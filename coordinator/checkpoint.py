"""The trainer's full state on disk: ``CHECKPOINTS/trainer/step-NNNNNNNN/state.pt``, written atomically.

A training-state checkpoint holds what it takes to continue training as if never stopped: weights,
optimizer moments, the step and policy version it was taken at, the RNG states and the trainer's own
bookkeeping. Which groups it has trained on is implied by its step: the store marks every consumed
group with the step that consumed it (``groups.consumed_step``), so "trained into this checkpoint"
is exactly ``consumed_step <= step``.

Each checkpoint is written into a temporary sibling directory, fsynced, and renamed into place: a
directory named ``step-N`` is complete, and a crash leaves at worst a ``.step-N.tmp-*`` directory
that the next start removes.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from veriroll.coordinator.models import fsync_dir

__all__ = ["STATE_FILE", "latest_training_state", "list_training_states", "save_training_state"]

STATE_FILE = "state.pt"
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


def save_training_state(root: str | os.PathLike, step: int, state: dict, *, keep: int) -> Path:
    """Write ``state`` as the checkpoint of ``step`` under ``root``, keep the newest ``keep``; returns its dir.

    An existing checkpoint of the same step is replaced (it can only be a leftover of an earlier run that
    was resumed from an older checkpoint and has now trained this step again).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        path = tmp / STATE_FILE
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for _, old_dir in list_training_states(root)[:-keep]:
        shutil.rmtree(old_dir, ignore_errors=True)
    return final


def latest_training_state(root: str | os.PathLike) -> tuple[int, dict] | None:
    """The newest complete checkpoint under ``root`` as ``(step, state)``, or ``None``.

    Leftover temporary directories of interrupted writes are removed first.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    for p in root.iterdir():
        if p.name.startswith(".step-"):
            shutil.rmtree(p, ignore_errors=True)
    states = list_training_states(root)
    if not states:
        return None
    step, path = states[-1]
    # weights_only: plain containers of tensors and numbers; our own file, but no pickled code either way.
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    return step, state
