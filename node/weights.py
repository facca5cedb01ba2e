"""Where a node gets policy versions from: shardcast relays (the network) or a local directory.

Both give the same thing: ``path_for(version)``, a verified HF checkpoint directory, or ``None`` while
it is not there yet. Fetching runs in the background so generation never waits on a download that
is not needed for the lease at hand.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

log = logging.getLogger("veriroll.node.weights")


class LocalVersions:
    """Versions read from a directory laid out like the coordinator's (``vNNNNNN/``): tests and one-box runs."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()

    def path_for(self, version: int) -> Path | None:
        p = self.root / f"v{version:06d}"
        return p if (p / "config.json").exists() else None

    def available(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name[1:]) for p in self.root.iterdir() if p.name.startswith("v") and p.name[1:].isdigit()
                      and (p / "config.json").exists())

    async def ensure(self, version: int, relays: list[str]) -> Path | None:
        return self.path_for(version)

    def progress(self) -> dict:
        return {}


class RelayVersions:
    """Versions fetched through shardcast relays, verified against the coordinator's key."""

    def __init__(self, cache_dir: str | Path, coordinator_key, *, keep: int = 3, relays: list[str] | None = None):
        self.root = Path(cache_dir).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.coordinator_key = coordinator_key
        self.keep = keep
        self.fixed_relays = list(relays or [])
        self._tasks: dict[int, asyncio.Task] = {}
        self.last_error: str = ""
        self.bad_relays: set[str] = set()

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def path_for(self, version: int) -> Path | None:
        from veriroll.shardcast.store import is_ready

        d = self._dir(version)
        return d if is_ready(d) else None

    def available(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.iterdir()
                      if p.name.startswith("v") and p.name[1:].isdigit() and self.path_for(int(p.name[1:])))

    async def ensure(self, version: int, relays: list[str]) -> Path | None:
        """Start (or keep) fetching ``version`` in the background; return its path once it is ready."""
        ready = self.path_for(version)
        if ready is not None:
            return ready
        task = self._tasks.get(version)
        if task is None or task.done():
            task = self._tasks[version] = asyncio.create_task(self._fetch(version, self.fixed_relays or relays))
            task.add_done_callback(self._note_failure)
        return None

    def _note_failure(self, task: asyncio.Task) -> None:
        # Retrieve the error here: a fetch that fails (a relay that has not mirrored the version yet) and is
        # never asked for again would otherwise end as asyncio's "Task exception was never retrieved".
        if task.cancelled() or task.exception() is None:
            return
        self.last_error = str(task.exception())
        log.warning("fetching a policy version failed (retried when needed): %s", self.last_error)

    async def _fetch(self, version: int, relays: list[str]) -> Path:
        from veriroll.shardcast.fetch import fetch_version

        if self.coordinator_key is None:
            raise RuntimeError("no coordinator key to check checkpoints against yet")
        # Versions held already are bases: a version published as a delta against one of them is rebuilt from it.
        result = await fetch_version(relays, self.coordinator_key, self._dir(version), version=version, progress=False,
                                     bases=[self._dir(v) for v in reversed(self.available())])
        for bad in result.bad_relays:
            self.bad_relays.add(bad.relay)
            log.warning("relay %s served bad data for version %d (%s: %s); it was avoided", bad.relay, version,
                        bad.kind, bad.detail)
        self._prune(version)
        return self._dir(version)

    def _prune(self, newest: int) -> None:
        versions = self.available()
        for v in versions[: max(0, len(versions) - self.keep)]:
            if v != newest:
                shutil.rmtree(self._dir(v), ignore_errors=True)

    def progress(self) -> dict:
        return {v: ("fetching" if not t.done() else "done") for v, t in self._tasks.items()}
