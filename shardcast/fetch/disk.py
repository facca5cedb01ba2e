"""The places a fetch's bytes touch the disk: writes at an offset, and hashes of what is there.

``_write_at`` and ``_hash_and_write`` are the seams tests replace to fill the disk (or flip a byte);
callers reach them through this module (``disk._write_at``), so that a replacement takes effect.
"""

from __future__ import annotations

import errno
import hashlib
import os

CHUNK = 1024 * 1024

def _write_at(fd: int, pieces: list[bytes], offset: int) -> None:
    """Write ``pieces`` contiguously at ``offset`` (pwritev, repeated if the kernel writes less)."""
    views = [memoryview(p) for p in pieces]
    while views:
        n = os.pwritev(fd, views[:512], offset)  # stay under IOV_MAX (1024 on Linux)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _hash_and_write(hasher, fd: int, pieces: list[bytes], offset: int) -> None:
    for piece in pieces:
        hasher.update(piece)  # hashlib releases the GIL on large buffers: this runs beside the event loop
    _write_at(fd, pieces, offset)


def _hash_range(hasher, fd: int, offset: int, size: int) -> None:
    end = offset + size
    while offset < end:
        data = os.pread(fd, min(CHUNK, end - offset), offset)
        if not data:
            raise OSError(errno.EIO, "file shorter than expected while hashing")
        hasher.update(data)
        offset += len(data)


def _sha256_range(fd: int, offset: int, size: int) -> str:
    h = hashlib.sha256()
    _hash_range(h, fd, offset, size)
    return h.hexdigest()
