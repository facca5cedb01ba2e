"""Publish a checkpoint directory into a store as a signed, sharded version.

``publish_checkpoint`` copies the checkpoint's files into a hidden temporary directory of the store,
hashing each file and each shard in the same single read, signs the manifest, writes the ready marker,
fsyncs, and only then renames the directory to ``v<N>``: a relay or reader either sees the whole
version or nothing of it. Then it removes all but the newest ``keep`` versions.

Shards are byte ranges of the stored files, not copies of them: the store holds each byte once, and a
relay serves a shard as a range request on its file.

With ``delta_from``, the version also carries a delta against that older version of the store
(``delta.py``): its pieces go into the version directory's delta file, the manifest lists them, and
nodes that hold the base fetch those instead of the shards.

Hidden entries of the checkpoint directory (names starting with ``.``, such as ``.cache/`` left by
``huggingface_hub``) are not published. Publishing is synchronous and CPU-bound (SHA-256 at roughly
1 GB/s); call it from a worker thread in an event-loop process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from veriroll.protos.identity import KeyFileError, PrivateKey, load_private_key

from .delta import DEFAULT_LEVEL, build_delta
from .errors import ManifestError, PublishError, ShardcastError
from .manifest import (
    DEFAULT_SHARD_SIZE,
    MAX_SHARD_SIZE,
    Delta,
    FileEntry,
    Manifest,
    build_manifest,
    sign_manifest,
    validate_file_name,
    validate_manifest,
    verify_manifest,
)
from .store import (
    DELTA_NAME,
    MANIFEST_NAME,
    READY_NAME,
    fsync_dir,
    list_versions,
    prune,
    raise_if_disk_full,
    ready_marker_bytes,
    remove_tree,
    version_dir,
    write_file_durably,
)

log = logging.getLogger("veriroll.shardcast.publish")

DEFAULT_KEEP = 3
_COPY_CHUNK = 1024 * 1024
_STALE_TEMP_S = 3600.0


@dataclass(frozen=True)
class PublishResult:
    """What a publish wrote and removed."""

    version: int
    path: Path
    manifest: Manifest
    total_bytes: int
    seconds: float
    removed_versions: list[int]
    delta_bytes: int = 0  # size of the delta file (0: no delta was published)
    delta_seconds: float = 0.0  # time spent building it, included in ``seconds``


def _write_chunk(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd``. One seam, so tests can make the disk full."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def checkpoint_files(checkpoint_dir: str | os.PathLike) -> list[tuple[str, Path]]:
    """``(manifest name, path)`` of every file to publish, sorted by name; hidden entries are skipped."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise PublishError(f"checkpoint directory {root} does not exist or is not a directory")
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fname in sorted(filenames):
            if fname.startswith("."):
                continue
            path = Path(dirpath) / fname
            if not path.is_file():  # follows symlinks (HF caches link to blobs); skips sockets and the like
                continue
            name = path.relative_to(root).as_posix()
            try:
                validate_file_name(name)
            except ManifestError as exc:
                raise PublishError(f"cannot publish {path}: {exc}; rename the file") from exc
            found.append((name, path))
    if not found:
        raise PublishError(f"checkpoint directory {root} holds no files to publish")
    return sorted(found)


def _copy_and_hash(
    src: Path, dst: Path, name: str, shard_size: int, link: bool
) -> tuple[FileEntry, list[tuple[str, int, int, str]]]:
    """Copy (or hard-link) ``src`` to ``dst`` and hash the file and each of its shards in one pass."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    linked = False
    if link:
        try:
            os.link(src, dst)
            linked = True
        except OSError:
            linked = False  # another filesystem, or links not allowed: copy instead
    file_hash = hashlib.sha256()
    shards: list[tuple[str, int, int, str]] = []
    shard_hash = hashlib.sha256()
    shard_start = 0
    offset = 0
    out_fd = -1
    try:
        with open(dst if linked else src, "rb") as fh:
            expected = os.fstat(fh.fileno()).st_size
            if not linked:
                out_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            while True:
                # Never read across a shard boundary: each chunk belongs to exactly one shard.
                want = min(_COPY_CHUNK, shard_start + shard_size - offset)
                chunk = fh.read(want)
                if not chunk:
                    break
                file_hash.update(chunk)
                shard_hash.update(chunk)
                if out_fd >= 0:
                    _write_chunk(out_fd, chunk)
                offset += len(chunk)
                if offset - shard_start == shard_size:
                    shards.append((name, shard_start, shard_size, shard_hash.hexdigest()))
                    shard_hash, shard_start = hashlib.sha256(), offset
            if offset > shard_start:
                shards.append((name, shard_start, offset - shard_start, shard_hash.hexdigest()))
            if offset != expected:
                raise PublishError(f"{src} changed size while being published ({expected} -> {offset} bytes)")
            if out_fd >= 0:
                os.fsync(out_fd)
    except OSError as exc:
        raise_if_disk_full(exc, dst)
        raise PublishError(f"cannot copy {src} into the store: {exc}") from exc
    finally:
        if out_fd >= 0:
            os.close(out_fd)
    return FileEntry(name, offset, file_hash.hexdigest()), shards


def _remove_stale_temps(store: Path) -> None:
    """Remove temporary directories left by a publish that crashed (older than an hour)."""
    now = time.time()
    for entry in store.glob(".publish-*"):
        try:
            if now - entry.stat().st_mtime > _STALE_TEMP_S:
                remove_tree(entry)
        except OSError:
            pass


def publish_checkpoint(
    checkpoint_dir: str | os.PathLike,
    store: str | os.PathLike,
    key: PrivateKey | str | os.PathLike,
    version: int,
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    keep: int = DEFAULT_KEEP,
    link: bool = False,
    created: str | None = None,
    delta_from: int | None = None,
    delta_level: int = DEFAULT_LEVEL,
) -> PublishResult:
    """Publish ``checkpoint_dir`` as ``version`` into ``store``, signed with the coordinator's ``key``.

    ``key`` is a PrivateKey or the path of its PEM file. ``link=True`` hard-links the files into the
    store instead of copying them when both are on one filesystem (the checkpoint must then never be
    modified in place). ``delta_from``: also publish a delta against that version (zstd level
    ``delta_level``) when the store holds it; a missing or unreadable base only means no delta. Keeps
    the newest ``keep`` versions. Raises PublishError (version already
    published, older than everything kept, unreadable checkpoint) or DiskFullError; on any failure
    nothing is listed and the temporary directory is removed.
    """
    t0 = time.monotonic()
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**53:
        raise PublishError(f"version must be a non-negative integer, got {version!r}")
    if not isinstance(shard_size, int) or not 0 < shard_size <= MAX_SHARD_SIZE:
        raise PublishError(f"shard size must be 1..{MAX_SHARD_SIZE} bytes, got {shard_size!r}")
    if keep < 1:
        raise PublishError(f"keep must be at least 1, got {keep}")
    if not isinstance(key, PrivateKey):
        try:
            key = load_private_key(key)
        except KeyFileError as exc:
            raise PublishError(str(exc)) from exc
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    final = version_dir(store, version)
    if final.exists():
        raise PublishError(
            f"version {version} is already in {store}: versions are immutable, publish a new one"
        )
    held = list_versions(store)
    if len(held) >= keep and version < held[-keep]:
        raise PublishError(
            f"version {version} is older than the {keep} newest already in {store} ({held[-keep:]}); "
            "it would be pruned at once"
        )
    files = checkpoint_files(checkpoint_dir)
    _remove_stale_temps(store)

    tmp = store / f".publish-v{version}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        entries, shards = [], []
        for name, path in files:
            entry, file_shards = _copy_and_hash(path, tmp / name, name, shard_size, link)
            entries.append(entry)
            shards.extend(file_shards)
        manifest = build_manifest(version, entries, shards, shard_size=shard_size, created=created)
        delta_t0 = time.monotonic()
        if delta_from is not None:
            delta = _build_delta(store, delta_from, tmp, manifest, key, delta_level)
            if delta is not None:
                manifest = replace(manifest, delta=delta)
                validate_manifest(manifest)
        delta_seconds = time.monotonic() - delta_t0
        signed = sign_manifest(manifest, key)
        manifest_bytes = signed.to_bytes()
        write_file_durably(tmp / MANIFEST_NAME, manifest_bytes)
        write_file_durably(
            tmp / READY_NAME, ready_marker_bytes(version, hashlib.sha256(manifest_bytes).hexdigest())
        )
        for sub in {(tmp / name).parent for name, _ in files}:
            fsync_dir(sub)
        try:
            os.rename(tmp, final)  # the atomic step: before it nothing is listed, after it everything is
        except OSError as exc:
            raise PublishError(f"cannot move version {version} into place at {final}: {exc}") from exc
        fsync_dir(store)
    except BaseException:
        remove_tree(tmp)
        raise
    removed = prune(store, keep)
    seconds = time.monotonic() - t0
    delta_bytes = manifest.delta.size if manifest.delta is not None else 0
    log.info(
        "published version %d: %d files, %d shards, %d bytes in %.2f s (delta: %d bytes in %.2f s); removed %s",
        version,
        len(entries),
        len(manifest.shards),
        manifest.total_size,
        seconds,
        delta_bytes,
        delta_seconds,
        removed or "nothing",
    )
    return PublishResult(
        version, final, manifest, manifest.total_size, seconds, removed, delta_bytes, delta_seconds
    )


def _build_delta(
    store: Path, base_version: int, tmp: Path, manifest: Manifest, key: PrivateKey, level: int
) -> Delta | None:
    """The delta of ``manifest`` (files in ``tmp``) against ``base_version`` of ``store``, or None.

    A base that is missing, older than allowed or unreadable means no delta, never a failed publish:
    the version is complete without one. A full disk is still a DiskFullError.
    """
    base_dir = version_dir(store, base_version)
    out = tmp / DELTA_NAME
    try:
        if base_version >= manifest.version:
            raise PublishError(f"a delta must be against an older version than {manifest.version}")
        base = verify_manifest((base_dir / MANIFEST_NAME).read_bytes(), key.public, expect_version=base_version)
        return build_delta(base_dir, base, tmp, manifest, out, level=level)
    except (OSError, ShardcastError) as exc:
        out.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise_if_disk_full(exc, out)
        log.warning("version %d published without a delta from %d: %s", manifest.version, base_version, exc)
        return None
