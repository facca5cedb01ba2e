"""The on-disk layout of checkpoint versions, shared by publish, relays and fetch.

A *version directory* holds one checkpoint exactly as HF ``from_pretrained`` reads it, plus two files of
shardcast's own::

    DIR/config.json, DIR/model.safetensors, ...   the checkpoint files, named as in the manifest
    DIR/.shardcast-manifest.json                   the signed manifest, byte for byte as served
    DIR/.shardcast-ready                           written last: every file hashed right
    DIR/.shardcast-delta                           the delta pieces the manifest lists, if any (delta.py)

A *store* (what publish writes and a relay serves) is a directory of version directories named
``v<N>`` (``v0``, ``v12``). Anything else in it, in particular the dot-prefixed temporary directories
that publish and mirroring fill before their atomic rename, is never listed or served. A version
directory is complete the moment it appears under its final name, because it is only ever renamed
into place whole.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from .errors import DiskFullError

MANIFEST_NAME = ".shardcast-manifest.json"
READY_NAME = ".shardcast-ready"
DELTA_NAME = ".shardcast-delta"
_VERSION_DIR = re.compile(r"v(0|[1-9][0-9]{0,15})")
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


def version_dir_name(version: int) -> str:
    return f"v{version}"


def version_dir(store: str | os.PathLike, version: int) -> Path:
    return Path(store) / version_dir_name(version)


def is_ready(vdir: str | os.PathLike) -> bool:
    """True when ``vdir`` is a complete version directory (its ready marker is there)."""
    vdir = Path(vdir)
    return (vdir / READY_NAME).is_file() and (vdir / MANIFEST_NAME).is_file()


def list_versions(store: str | os.PathLike) -> list[int]:
    """The complete versions in ``store``, oldest first. A missing store holds none."""
    try:
        names = os.listdir(store)
    except FileNotFoundError:
        return []
    versions = []
    for name in names:
        m = _VERSION_DIR.fullmatch(name)
        if m and is_ready(Path(store) / name):
            versions.append(int(m.group(1)))
    return sorted(versions)


def remove_tree(path: str | os.PathLike) -> None:
    """Remove a directory so that it disappears from listings at once: rename it aside, then delete.

    Readers that still have files open keep reading them (POSIX), so pruning never breaks a download
    that already started; it only makes the version unlistable for new ones.
    """
    path = Path(path)
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def prune(store: str | os.PathLike, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` versions of ``store``; returns the versions removed."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    versions = list_versions(store)
    removed = versions[:-keep]
    for v in removed:
        remove_tree(version_dir(store, v))
    return removed


def ready_marker_bytes(version: int, manifest_sha256: str) -> bytes:
    return json.dumps({"version": version, "manifest_sha256": manifest_sha256}).encode() + b"\n"


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in ``path`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_durably(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` and fsync it unless told not to (disk full raises DiskFullError)."""
    try:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
    except OSError as exc:
        raise_if_disk_full(exc, path)
        raise


def raise_if_disk_full(exc: OSError, path: str | os.PathLike) -> None:
    """Re-raise an out-of-space OSError as DiskFullError, with a message that says what to do."""
    if exc.errno in _FULL_ERRNOS:
        raise DiskFullError(
            exc.errno,
            f"no space left writing {path}: free some space on that filesystem (or point the output "
            "elsewhere) and run again; a fetch resumes where it stopped",
        ) from exc
