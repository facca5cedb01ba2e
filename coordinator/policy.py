"""Policy versions on disk: ``CHECKPOINTS/versions/vNNNNNN/`` in HF format, written atomically."""

from __future__ import annotations

import json
import os
import re
import shutil
from functools import cached_property
from pathlib import Path

_VERSION_DIR = re.compile(r"^v(\d{6})$")


class PolicyStore:
    """Where policy versions live, and the tokenizer facts every other part needs."""

    def __init__(self, checkpoints_dir: str | Path):
        self.root = Path(checkpoints_dir)
        self.versions_dir = self.root / "versions"

    def version_dir(self, version: int) -> Path:
        return self.versions_dir / f"v{version:06d}"

    def available(self) -> list[int]:
        if not self.versions_dir.is_dir():
            return []
        out = []
        for p in self.versions_dir.iterdir():
            m = _VERSION_DIR.match(p.name)
            if m and (p / "config.json").exists():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> int:
        versions = self.available()
        if not versions:
            raise FileNotFoundError(f"no policy version under {self.versions_dir}; run `veriroll coordinator init`")
        return versions[-1]

    def install(self, src_dir: Path, version: int) -> Path:
        """Move a fully written checkpoint directory into place as ``version`` (atomic rename)."""
        dest = self.version_dir(version)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(src_dir, dest)
        return dest

    def prune(self, keep_from: int, *, protect: tuple[int, ...] = (0,)) -> None:
        """Delete versions older than ``keep_from`` (except ``protect``: version 0 is the KL reference)."""
        for v in self.available():
            if v < keep_from and v not in protect:
                shutil.rmtree(self.version_dir(v), ignore_errors=True)

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.version_dir(self.available()[0])))

    @cached_property
    def model_config(self) -> dict:
        return json.loads((self.version_dir(self.available()[0]) / "config.json").read_text())

    @property
    def vocab_size(self) -> int:
        return int(self.model_config["vocab_size"])

    @cached_property
    def generation_config(self) -> dict:
        path = self.version_dir(self.available()[0]) / "generation_config.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @property
    def stop_token_ids(self) -> list[int]:
        """The model's own stop tokens: EOS (config, generation config, tokenizer) and the chat template's
        end-of-turn token (``models.checkpoint_facts``). What leases carry is decided from them by
        ``PromptRenderer.stop_token_ids``, where ``leases.stop_token_ids`` replaces them."""
        from veriroll.coordinator.models import checkpoint_facts

        return checkpoint_facts(self.version_dir(self.available()[0]), self.tokenizer).stop_token_ids


class PolicyState:
    """The current policy version: what nodes are told to generate with and what intake and the trainer
    measure staleness against. It is the one holder of that number in a process, and :meth:`advance` is
    its one write: it also sets the ``veriroll_policy_version`` gauge (:meth:`report_to`), so the gauge can
    never disagree with it. Everything else reads :attr:`version`.

    Who advances it: where the trainer runs, the trainer (:meth:`Trainer.make_current
    <veriroll.coordinator.trainer.Trainer.make_current>`), once a step's commit naming the new version is
    durable and, under a coordinator, shardcast holds it (``app.start_trainer``); in an edge or verifier
    process, which has no trainer, the follower of the store (``app._follow_policy``). ``relays`` and
    ``manifest_path`` are what GetPolicy announces with it.
    """

    def __init__(self, version: int = 0, relays: list[str] | None = None, manifest_path: str = "",
                 on_advance=None):
        self._version = int(version)
        self.relays = list(relays or [])
        self.manifest_path = manifest_path
        self._on_advance = on_advance
        self._gauge = None

    @property
    def version(self) -> int:
        return self._version

    def report_to(self, gauge) -> None:
        """Keep ``gauge`` (a metrics gauge with ``set``) at the current version from now on."""
        self._gauge = gauge
        gauge.set(self._version)

    def advance(self, version: int) -> None:
        """Make ``version`` current. Versions only move forward; going back is a bug, refused loudly."""
        if version < self._version:
            raise ValueError(f"policy version cannot go back from {self._version} to {version}")
        self._version = int(version)
        if self._gauge is not None:
            self._gauge.set(self._version)
        if self._on_advance is not None:
            self._on_advance(self._version)
