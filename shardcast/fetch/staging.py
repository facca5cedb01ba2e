"""Where a fetch writes: the staging directory, its journal of finished shards, and the atomic finish.

Downloads go into ``<parent>/.<name>.shardcast-partial/`` with a journal of finished shards; a fetch that
is interrupted (killed, disk full, relays gone) and run again skips the shards it already has, after
hashing them again from disk: a journal that lies costs a refetch, never a bad checkpoint. When every
shard is in, the files are fsynced, the ready marker written, and the staging directory renamed to
``out_dir`` in one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from veriroll.protos.identity import PublicKey

from ..errors import OutputDirError, ShardcastError
from ..manifest import Manifest, ShardEntry, signing_message, verify_manifest
from ..store import (
    DELTA_NAME,
    MANIFEST_NAME,
    READY_NAME,
    fsync_dir,
    is_ready,
    raise_if_disk_full,
    ready_marker_bytes,
    remove_tree,
    write_file_durably,
)
from . import disk

log = logging.getLogger("veriroll.shardcast.fetch")

JOURNAL_NAME = ".shardcast-progress"
PARTIAL_SUFFIX = ".shardcast-partial"
SYNC_EVERY = 64 * 1024 * 1024  # flush written data to disk in the background every this many bytes per file


def staging_dir(out_dir: Path) -> Path:
    """The hidden directory next to ``out_dir`` that a fetch of it writes into."""
    return out_dir.parent / f".{out_dir.name}{PARTIAL_SUFFIX}"


def check_out_dir(out: Path) -> None:
    """Refuse an ``out_dir`` that a fetch must not replace (a file, or a directory that is not ours)."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory")
    if out.is_dir() and not is_ready(out) and any(out.iterdir()):
        raise OutputDirError(
            f"{out} exists, is not empty and is not a shardcast checkpoint; refusing to replace it "
            "(choose an empty or new directory)"
        )


def already_present(out: Path, key: PublicKey, manifest: Manifest) -> bool:
    """Whether ``out`` is already the ready checkpoint ``manifest`` describes."""
    if not is_ready(out):
        return False
    try:
        held = verify_manifest((out / MANIFEST_NAME).read_bytes(), key)
    except (OSError, ShardcastError):
        return False
    return signing_message(held) == signing_message(manifest)


def prepare_staging(
    staging: Path, key: PublicKey, manifest: Manifest, manifest_bytes: bytes, *, fsync: bool
) -> set[int]:
    """Create or reuse the staging directory; the set of shards an earlier run already finished."""
    done: set[int] = set()
    staged = staging / MANIFEST_NAME
    if staged.is_file():
        try:
            old = verify_manifest(staged.read_bytes(), key)
            same = signing_message(old) == signing_message(manifest)
        except (OSError, ShardcastError):
            same = False
        if same:
            with contextlib.suppress(OSError):
                for line in (staging / JOURNAL_NAME).read_text().split():
                    if line.isdigit() and int(line) < len(manifest.shards):
                        done.add(int(line))
        else:
            log.info("discarding %s: it holds a different version", staging)
            remove_tree(staging)
    elif staging.exists():
        remove_tree(staging)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        if not staged.is_file():
            write_file_durably(staged, manifest_bytes, fsync=fsync)
        (staging / READY_NAME).unlink(missing_ok=True)
    except OSError as exc:
        raise_if_disk_full(exc, staging)
        raise
    return done


def open_files(staging: Path, manifest: Manifest, *, keep_delta: bool) -> dict[str, int]:
    """A descriptor for each file of the staging directory, sized and reserved (the delta file too,
    under DELTA_NAME, when it is to be kept)."""
    fds: dict[str, int] = {}
    files = [(f.name, f.size) for f in manifest.files]
    if keep_delta and manifest.delta is not None:
        files.append((DELTA_NAME, manifest.delta.size))
    try:
        for name, size in files:
            path = staging / name
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fds[name] = fd
            if size:
                # Reserve the space now: a full disk is reported before the download, not after.
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    # EOPNOTSUPP/EINVAL: the filesystem cannot reserve; writes will tell
            os.ftruncate(fd, size)
    except OSError as exc:
        for fd in fds.values():
            os.close(fd)
        raise_if_disk_full(exc, staging)
        raise
    return fds


def open_journal(staging: Path) -> int:
    """The journal of finished shards, open for appending."""
    return os.open(staging / JOURNAL_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def note_done(journal_fd: int, staging: Path, idx: int) -> None:
    """Append shard ``idx`` to the journal: a run after an interruption may skip it (after hashing it)."""
    try:
        os.write(journal_fd, f"{idx}\n".encode())
    except OSError as exc:
        raise_if_disk_full(exc, staging / JOURNAL_NAME)
        raise


def finish(
    staging: Path, out: Path, manifest: Manifest, manifest_bytes: bytes, fds: dict[str, int], *, fsync: bool
) -> None:
    """fsync, write the ready marker, and move the staging directory to ``out`` atomically."""
    try:
        if fsync:
            for fd in fds.values():
                os.fsync(fd)
        write_file_durably(
            staging / READY_NAME,
            ready_marker_bytes(manifest.version, hashlib.sha256(manifest_bytes).hexdigest()),
            fsync=fsync,
        )
        (staging / JOURNAL_NAME).unlink(missing_ok=True)
        if fsync:
            fsync_dir(staging)
    except OSError as exc:
        raise_if_disk_full(exc, staging)
        raise
    old = None
    if out.is_dir():
        if any(out.iterdir()):
            old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(staging, out)
    if fsync:
        fsync_dir(out.parent)
    if old is not None:
        remove_tree(old)


class _BackgroundSync:
    """Flushes each file's written data to disk every SYNC_EVERY bytes, in a worker thread.

    Flushing as we go keeps the final fsync (before the ready marker) short: the disk writes overlap the
    download instead of following it.
    """

    def __init__(self, fds: dict[str, int]):
        self.fds = fds
        self._unsynced: dict[str, int] = {}
        self._syncing: set[str] = set()
        self._futures: set[asyncio.Future] = set()

    def written(self, shard: ShardEntry) -> None:
        name = shard.file
        self._unsynced[name] = self._unsynced.get(name, 0) + shard.size
        if self._unsynced[name] < SYNC_EVERY or name in self._syncing:
            return
        self._unsynced[name] = 0
        self._syncing.add(name)
        future = asyncio.get_running_loop().run_in_executor(None, os.fdatasync, self.fds[name])
        self._futures.add(future)

        def done(f: asyncio.Future) -> None:
            self._syncing.discard(name)
            self._futures.discard(f)
            f.exception()  # errors surface in the final fsync; do not warn about an unretrieved one

        future.add_done_callback(done)

    async def wait(self) -> None:
        """Until no worker thread syncs a file: never close a descriptor one still uses."""
        if self._futures:
            await asyncio.gather(*list(self._futures), return_exceptions=True)


async def hash_files(manifest: Manifest, fds: dict[str, int], done: set[int], event: asyncio.Event) -> dict[str, str]:
    """Hash each file in order as its shards complete (``done``, ``event`` set on each); name -> sha256 hex."""
    loop = asyncio.get_running_loop()
    order = {f.name: [s.index for s in manifest.shards_of(f.name)] for f in manifest.files}
    hashers = {name: hashlib.sha256() for name in order}
    nxt = dict.fromkeys(order, 0)
    while True:
        progressed = False
        for name, idxs in order.items():
            while nxt[name] < len(idxs) and idxs[nxt[name]] in done:
                s = manifest.shards[idxs[nxt[name]]]
                await loop.run_in_executor(None, disk._hash_range, hashers[name], fds[name], s.offset, s.size)
                nxt[name] += 1
                progressed = True
        if all(nxt[n] == len(i) for n, i in order.items()):
            return {name: h.hexdigest() for name, h in hashers.items()}
        if not progressed:
            await event.wait()
            event.clear()


async def find_bad_shards(
    manifest: Manifest, fds: dict[str, int], names: Iterable[str], only: set[int] | None = None
) -> list[int]:
    """The shards of files ``names`` (restricted to ``only``) whose bytes on disk hash wrong."""
    loop = asyncio.get_running_loop()
    bad = []
    for name in names:
        for s in manifest.shards_of(name):
            if only is not None and s.index not in only:
                continue
            digest = await loop.run_in_executor(None, disk._sha256_range, fds[name], s.offset, s.size)
            if digest != s.sha256:
                bad.append(s.index)
    return bad
