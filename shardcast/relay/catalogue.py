"""The versions a relay serves: those held whole in its store, and those a mirror is still fetching.

``_Catalogue`` is part of ``RelayServer``; it uses the server's ``store``, ``key``, ``held`` and
``streaming``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from ..errors import ShardcastError
from ..manifest import Manifest, verify_manifest
from ..store import DELTA_NAME, MANIFEST_NAME, list_versions, version_dir

log = logging.getLogger("veriroll.shardcast.relay")

_REFRESH_EVERY = 0.5


@dataclass(frozen=True)
class HeldVersion:
    version: int
    manifest: Manifest
    manifest_bytes: bytes
    path: Path
    has_delta: bool = False  # the delta file the manifest lists is there, whole


class _Coverage:
    """The verified byte ranges of one file, kept merged: ``starts[i]..ends[i]`` are disjoint, in order."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        first = bisect.bisect_left(self.ends, start)  # the first range that touches or follows start
        past = bisect.bisect_right(self.starts, end)  # ranges from here on start after end
        if first < past:
            start, end = min(start, self.starts[first]), max(end, self.ends[past - 1])
        self.starts[first:past] = [start]
        self.ends[first:past] = [end]

    def covers(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1
        return start >= end or (i >= 0 and self.ends[i] >= end)


@dataclass
class StreamingVersion:
    """A version a mirror is fetching: served from its staging directory, range by verified range."""

    version: int
    manifest: Manifest
    manifest_bytes: bytes
    staging: Path
    final: Path  # where it will be once whole: a request that races the rename finds it there
    verified: dict[str, _Coverage] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False

    def add(self, name: str, offset: int, size: int) -> None:
        self.verified.setdefault(name, _Coverage()).add(offset, offset + size)
        self._wake()

    def covers(self, name: str, start: int, stop: int) -> bool:
        return start >= stop or (name in self.verified and self.verified[name].covers(start, stop))

    def end(self) -> None:
        """The fetch is over (the version is now held whole, or the fetch failed)."""
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        # Every waiter holds the event of its moment; setting it and starting a new one wakes them all.
        self.changed.set()
        self.changed = asyncio.Event()

    def verified_bytes(self) -> int:
        return sum(e - s for c in self.verified.values() for s, e in zip(c.starts, c.ends, strict=True))



class _Catalogue:
    """The store's listing, its manifests checked, and the versions being mirrored."""

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the store's listing; load and check the manifest of each version not seen before."""
        now = time.monotonic()
        if not force and now - self._last_refresh < _REFRESH_EVERY:
            return
        self._last_refresh = now
        versions = set(list_versions(self.store))
        for v in list(self.held):
            if v not in versions:
                del self.held[v]
        for v in versions - set(self.held):
            held = self._load(v)
            if held is not None:
                self.held[v] = held

    def _load(self, version: int) -> HeldVersion | None:
        vdir = version_dir(self.store, version)
        try:
            mtime = (vdir / MANIFEST_NAME).stat().st_mtime_ns
            if vdir.name in self._refused and self._refused[vdir.name][0] == mtime:
                return None
            data = (vdir / MANIFEST_NAME).read_bytes()
            manifest = verify_manifest(data, self.key, expect_version=version)
            for f in manifest.files:
                size = (vdir / f.name).stat().st_size
                if size != f.size:
                    raise ShardcastError(f"{f.name} is {size} bytes on disk, the manifest says {f.size}")
            has_delta = False
            if manifest.delta is not None:
                # A version without its delta is still whole; only the delta route answers 404 then.
                with contextlib.suppress(FileNotFoundError):
                    has_delta = (vdir / DELTA_NAME).stat().st_size == manifest.delta.size
        except (OSError, ShardcastError) as exc:
            why = str(exc)
            log.error("not serving version %d from %s: %s", version, vdir, why)
            with contextlib.suppress(OSError):
                self._refused[vdir.name] = ((vdir / MANIFEST_NAME).stat().st_mtime_ns, why)
            return None
        return HeldVersion(version, manifest, data, vdir, has_delta)

    def versions(self) -> list[int]:
        return sorted(self.held)

    def streaming_versions(self) -> list[int]:
        """Versions being mirrored, served as they arrive (never one that is also held whole)."""
        return sorted(v for v in self.streaming if v not in self.held)

    def _lookup(self, which: str) -> HeldVersion | StreamingVersion:
        # Listings answer from the store as it is now (one listdir); file requests, the bulk of the
        # traffic, reuse a listing up to half a second old unless they ask for a version not yet seen.
        self.refresh(force=which == "latest")
        if which == "latest":
            if not self.held and not self.streaming:
                raise web.HTTPNotFound(text="this relay holds no version yet\n")
            newest = max([*self.held, *self.streaming])
            return self.held.get(newest) or self.streaming[newest]
        if not which.isdigit():
            raise web.HTTPNotFound(text="a version is an integer or 'latest'\n")
        version = int(which)
        if version not in self.held:
            self.refresh(force=True)
        if version in self.held:
            return self.held[version]
        if version in self.streaming:
            return self.streaming[version]
        raise web.HTTPNotFound(text=f"version {version} is not held here; see /status\n")

