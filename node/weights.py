"""Where a node gets policy versions from: shardcast relays (the network) or a local directory.

Both give the same thing: ``path_for(version)``, a verified HF checkpoint directory, or ``None`` while
it is not there yet. Fetching runs in the background so generation never waits on a download that
is not needed for the lease at hand.

A version the coordinator names is not on the relays at once: the coordinator announces it when the
trainer commits it, and publishing (hashing, signing) and mirroring follow. A relay answering "no
such version" is therefore normal for the newest version for a while (``PUBLISH_GRACE_S``), and for an
older one once the policy has moved past it and the relays pruned it. Only a newest version that stays
missing, or any other failure, is a problem worth a warning.

With a Swarm (``shardcast/swarm/``), versions come from peers first and the node serves every version it
holds to its peers; a peer that served bad bytes is listed in ``RelayVersions.bad_peers`` for the node to
report to the coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # libp2p is optional: only a node started with a swarm imports it
    from veriroll.shardcast.swarm.host import Swarm

log = logging.getLogger("veriroll.node.weights")

PUBLISH_GRACE_S = 120.0  # how long the newest version may be missing from every relay before it is a problem
RETRY_S = 2.0  # a fetch that failed is not started again sooner than this (the lease loop asks every 0.2 s)...
RETRY_MAX_S = 60.0  # ...and, while it keeps failing for another reason than "not published yet", twice as late each time
WARN_EVERY_S = 60.0  # the same fetch problem is logged at most this often


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

    def gone(self, version: int) -> bool:
        return False

    def progress(self) -> dict:
        return {}


class RelayVersions:
    """Versions fetched through shardcast relays, verified against the coordinator's key.

    ``progress()`` says what is under way, by version: ``fetching``, ``waiting`` (not on the relays
    yet), ``failed`` (retried when asked again) or ``gone`` (pruned from the relays after the policy
    moved on; never asked for again).
    """

    def __init__(self, cache_dir: str | Path, coordinator_key, *, keep: int = 3, relays: list[str] | None = None,
                 clock: Callable[[], float] = time.monotonic, swarm: Swarm | None = None,
                 announce: list[str] | None = None):
        self.root = Path(cache_dir).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.coordinator_key = coordinator_key
        self.keep = keep
        self.fixed_relays = list(relays or [])
        self.clock = clock
        self.last_error: str = ""
        self.bad_relays: set[str] = set()
        self.swarm = swarm
        self.announce = list(announce or [])  # the swarm's addresses as others dial them (default: where it listens)
        self.bad_peers: set[str] = set()  # peer ids that served bad bytes, for the node to report
        self._served: dict[int, object] = {}  # version -> its Manifest, while the swarm serves it
        self.newest_wanted = -1
        self._tasks: dict[int, asyncio.Task] = {}
        self._state: dict[int, str] = {}
        self._first_wanted: dict[int, float] = {}
        self._retry_at: dict[int, float] = {}
        self._failures: dict[int, int] = {}
        self._warned: tuple[str, float] = ("", -float("inf"))

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def path_for(self, version: int) -> Path | None:
        from veriroll.shardcast.store import is_ready

        d = self._dir(version)
        return d if is_ready(d) else None

    def available(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.iterdir()
                      if p.name.startswith("v") and p.name[1:].isdigit() and self.path_for(int(p.name[1:])))

    def gone(self, version: int) -> bool:
        """True once ``version`` is known to have left the relays for good (the policy moved past it)."""
        return self._state.get(version) == "gone" and self.path_for(version) is None

    async def ensure(self, version: int, relays: list[str]) -> Path | None:
        """Start (or keep) fetching ``version`` in the background; return its path once it is ready."""
        ready = self.path_for(version)
        if ready is not None:
            return ready
        now = self.clock()
        self._first_wanted.setdefault(version, now)
        self.newest_wanted = max(self.newest_wanted, version)
        task = self._tasks.get(version)
        if self.gone(version) or (task is not None and not task.done()) or now < self._retry_at.get(version, 0.0):
            return None
        task = self._tasks[version] = asyncio.create_task(self._fetch(version, self.fixed_relays or relays))
        self._state[version] = "fetching"
        task.add_done_callback(lambda t: self._fetch_ended(version, t))
        return None

    def _fetch_ended(self, version: int, task: asyncio.Task) -> None:
        # The error is retrieved here, so a fetch nobody asks for again never ends as asyncio's "Task
        # exception was never retrieved".
        if task.cancelled():
            self._state.pop(version, None)
            return
        exc = task.exception()
        if exc is None:
            self._state[version] = "done"
            self._failures.pop(version, None)
            return
        from veriroll.shardcast.errors import VersionGoneError

        now = self.clock()
        self._retry_at[version] = now + RETRY_S
        if isinstance(exc, VersionGoneError):
            if version < self.newest_wanted:
                self._state[version] = "gone"
                log.info("version %d left the relays before this node fetched it; the policy has moved on to "
                         "version %d", version, self.newest_wanted)
                return
            waited = now - self._first_wanted.get(version, now)
            if waited < PUBLISH_GRACE_S:
                self._state[version] = "waiting"
                log.debug("version %d is not on the relays yet (%.0f s after it was named); retrying", version, waited)
                return
            problem = (f"version {version} is still on no relay {waited:.0f} s after the coordinator named it; its "
                       f"publisher or relays may be stuck ({exc})")
        else:
            problem = f"fetching version {version} failed (retried when needed): {exc}"
        failures = self._failures[version] = self._failures.get(version, 0) + 1
        self._retry_at[version] = now + min(RETRY_MAX_S, RETRY_S * 2 ** (failures - 1))
        self._state[version] = "failed"
        self.last_error = problem
        text, at = self._warned
        if problem != text or now - at >= WARN_EVERY_S:
            log.warning("%s", problem)
            self._warned = (problem, now)

    async def _fetch(self, version: int, relays: list[str]) -> Path:
        from veriroll.shardcast.fetch import fetch_version

        if self.coordinator_key is None:
            raise RuntimeError("no coordinator key to check checkpoints against yet")
        self._serve_held()
        # Versions held already are bases: a version published as a delta against one of them is rebuilt from it.
        result = await fetch_version(relays, self.coordinator_key, self._dir(version), version=version, progress=False,
                                     bases=[self._dir(v) for v in reversed(self.available())], swarm=self.swarm)
        if self.swarm is not None:
            self._served[version] = result.manifest
        for bad in result.bad_peers:
            self.bad_peers.add(bad.relay)
            log.warning("peer %s served bad data for version %d (%s: %s); it was banned", bad.relay, version,
                        bad.kind, bad.detail)
        for bad in result.bad_relays:
            self.bad_relays.add(bad.relay)
            log.warning("relay %s served bad data for version %d (%s: %s); it was avoided", bad.relay, version,
                        bad.kind, bad.detail)
        self._prune(version)
        return self._dir(version)

    def swarm_listing(self) -> dict:
        """This node's swarm as HeartbeatRequest fields, for the coordinator to announce to the other nodes."""
        if self.swarm is None:
            return {}
        return {"swarm_peer_id": self.swarm.peer_id, "swarm_addrs": self.announce or list(self.swarm.addrs),
                "swarm_versions": sorted(self._served)[-64:], "bad_peers": sorted(self.bad_peers)[:16]}

    def take_peer_hints(self, document: bytes) -> None:
        """The peers announced in the policy (``PolicyInfo.peer_hints``): the only ones this node dials."""
        if self.swarm is None or not document or self.coordinator_key is None:
            return
        from veriroll.shardcast.swarm.errors import PeerHintsError
        from veriroll.shardcast.swarm.hints import verify_peer_hints

        try:
            self.swarm.announce(verify_peer_hints(document, self.coordinator_key))
        except PeerHintsError as exc:  # keep the peers announced before: a forged list changes nothing
            log.warning("peer hints refused: %s", exc)

    def _serve_held(self) -> None:
        """Serve to peers the versions this node held before it started (once each)."""
        if self.swarm is None:
            return
        from veriroll.shardcast.errors import ShardcastError
        from veriroll.shardcast.manifest import verify_manifest
        from veriroll.shardcast.store import MANIFEST_NAME

        for v in self.available():
            if v not in self._served:
                try:
                    manifest = verify_manifest((self._dir(v) / MANIFEST_NAME).read_bytes(), self.coordinator_key)
                except (OSError, ShardcastError) as exc:
                    log.warning("not serving version %d to peers: %s", v, exc)
                    continue
                self.swarm.serve(self._dir(v), manifest)
                self._served[v] = manifest

    def _prune(self, newest: int) -> None:
        versions = self.available()
        for v in versions[: max(0, len(versions) - self.keep)]:
            if v != newest:
                if v in self._served:  # peers stop being answered from a directory about to go
                    self.swarm.forget(self._served.pop(v))
                shutil.rmtree(self._dir(v), ignore_errors=True)
        # What the node noted about versions far behind is of no use any more.
        running = {v for v, t in self._tasks.items() if not t.done()}
        for v in [v for v in self._first_wanted if v < newest - 2 * self.keep and v not in running]:
            for book in (self._tasks, self._state, self._first_wanted, self._retry_at, self._failures):
                book.pop(v, None)

    def progress(self) -> dict:
        """``{version: state}`` of what is worth showing: a fetch under way, and the newest version asked for
        while the node lacks it (an older one that was waiting is moot once a newer one is wanted)."""
        return {v: state for v, state in self._state.items()
                if (state == "fetching" or v == self.newest_wanted) and state != "done" and self.path_for(v) is None}
