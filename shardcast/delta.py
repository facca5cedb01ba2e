"""Lossless weight deltas: a shard of version N+1 as the XOR of its bytes with version N's, zstd-compressed.

One optimizer step moves every weight a little, so most bytes of a weight keep their sign, exponent and
high mantissa: the XOR of the old and new bytes is mostly zeros, and zstd shrinks it to a fraction of
the shard (measured in ``benchmarks/broadcast.py``). XOR is exact in both directions, so a node that
holds the base rebuilds the new bytes bit for bit; verification depends on bit-identical weights, so
nothing here is lossy.

A piece is made only where the two files have the same layout (same name, same size, and for
safetensors the same header, so that every tensor sits at the same offset in both) and only where it
is smaller than the shard it rebuilds. Everything else ships whole.

Rebuilding never trusts a piece further than it must: the piece's own hash is checked on arrival (a
relay that alters it is blamed, as for a shard), decompression stops at the shard's size from the
manifest (a zip bomb costs at most one shard of output, in 1 MiB steps), and the rebuilt bytes are
checked against the manifest's hash of the *result*. Any failure is a :class:`DeltaError`, and the
fetch gets that shard whole instead.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import numpy as np
import zstandard

from .errors import DeltaError
from .manifest import Delta, DeltaPiece, Manifest, manifest_sha256

DEFAULT_LEVEL = 3  # zstd level: ~0.34 of fp32 and ~0.05 of bf16 after one step; higher levels gain little
# The most memory one decompression may ask for. Pieces are compressed in one frame of at most a shard;
# a frame that asks for more is refused instead of allocated.
MAX_WINDOW_SIZE = 1 << 27
STEP = 1024 * 1024  # decompress, XOR, hash and write this much at a time
_SAFETENSORS_HEADER_MAX = 100 * 1024 * 1024


def xor(a: bytes | memoryview, b: bytes | memoryview) -> np.ndarray:
    """The byte-wise XOR of two buffers of the same length, as a uint8 array."""
    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))


def compress_piece(target: bytes, base: bytes, level: int = DEFAULT_LEVEL) -> bytes:
    """One zstd frame (with its content size) of ``target XOR base``."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(xor(target, base))


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise DeltaError(f"the base file ends before byte {offset + size}: it is not the base the delta names")
        data += more
    return data


def rebuild_shard(piece: bytes, base_fd: int, out_fd: int, offset: int, size: int) -> str:
    """Write ``base XOR decompress(piece)`` at ``offset`` of ``out_fd``; return the SHA-256 hex of what was written.

    Reads the base at the same offset of ``base_fd``. Raises DeltaError when the piece is not a zstd
    frame, declares or yields another size than ``size``, or asks for a window over MAX_WINDOW_SIZE.
    The caller compares the returned hash with the manifest's: only then are the bytes a shard.
    """
    try:
        declared = zstandard.frame_content_size(piece)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"the delta piece is not a zstd frame: {exc}") from exc
    if declared not in (-1, size):  # -1: the frame does not say; the loop below bounds it
        raise DeltaError(f"the delta piece declares {declared} bytes, the shard has {size}")
    window = zstandard.get_frame_parameters(piece).window_size
    if window > MAX_WINDOW_SIZE:
        raise DeltaError(f"the delta piece asks for a {window >> 20} MiB window, over the "
                         f"{MAX_WINDOW_SIZE >> 20} MiB a rebuild may use")
    hasher = hashlib.sha256()
    produced = 0
    # Across frames: bytes after the first frame count towards the shard's size (and are refused past
    # it) instead of being skipped unread.
    reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_SIZE).stream_reader(piece, read_across_frames=True)
    try:
        with reader:
            while True:
                # Ask for one byte past the shard at the end: a piece that has more is refused, and no read
                # ever returns more than STEP bytes, whatever the frame claims.
                chunk = reader.read(min(STEP, size - produced + 1))
                if not chunk:
                    break
                if produced + len(chunk) > size:
                    raise DeltaError(f"the delta piece decompresses past the shard's {size} bytes (refused there)")
                rebuilt = xor(chunk, _pread_exact(base_fd, len(chunk), offset + produced))
                hasher.update(rebuilt)
                _write_all(out_fd, rebuilt, offset + produced)
                produced += len(chunk)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"the delta piece is corrupt: {exc}") from exc
    if produced != size:
        raise DeltaError(f"the delta piece decompresses to {produced} bytes, the shard has {size}")
    return hasher.hexdigest()


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _safetensors_header(path: Path) -> bytes | None:
    """The length prefix and JSON header of a safetensors file, or None when it does not look like one."""
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            return None
        (length,) = struct.unpack("<Q", prefix)
        if length > _SAFETENSORS_HEADER_MAX:
            return None
        return prefix + fh.read(length)


def same_layout(base: Path, target: Path) -> bool:
    """True when XOR of the two files lines up value for value: same size and, for safetensors, same header.

    Same-size files with different headers would XOR one tensor against another: lossless still, but
    no smaller; such files ship whole.
    """
    try:
        if base.stat().st_size != target.stat().st_size:
            return False
        if target.suffix == ".safetensors":
            header = _safetensors_header(target)
            return header is not None and header == _safetensors_header(base)
    except OSError:
        return False
    return True


def build_delta(
    base_dir: Path, base: Manifest, target_dir: Path, target: Manifest, out: Path, *, level: int = DEFAULT_LEVEL
) -> Delta | None:
    """The delta of ``target`` (files in ``target_dir``) against ``base`` (in ``base_dir``), its pieces written to ``out``.

    A shard gets a piece when the base has a shard at the same place (same file, offset and size) whose
    bytes on disk hash as the base manifest says: a delta against bytes the base manifest does not vouch
    for would only make every node fall back. Returns None when no shard gets a piece (``out`` is then
    removed).
    """
    base_shards = {(s.file, s.offset, s.size): s.sha256 for s in base.shards}
    pieces: list[DeltaPiece] = []
    offset = 0
    with open(out, "wb") as sink:
        for entry in target.files:
            if base.file(entry.name) is None or not same_layout(base_dir / entry.name, target_dir / entry.name):
                continue
            with open(base_dir / entry.name, "rb") as old, open(target_dir / entry.name, "rb") as new:
                for shard in target.shards_of(entry.name):
                    before, after = old.read(shard.size), new.read(shard.size)
                    if base_shards.get((shard.file, shard.offset, shard.size)) != hashlib.sha256(before).hexdigest():
                        continue
                    data = compress_piece(after, before, level)
                    if len(data) >= shard.size:  # a piece that saves nothing is not worth a round trip
                        continue
                    sink.write(data)
                    pieces.append(DeltaPiece(shard.index, offset, len(data), hashlib.sha256(data).hexdigest()))
                    offset += len(data)
        sink.flush()
        os.fsync(sink.fileno())
    if not pieces:
        out.unlink()
        return None
    return Delta(base.version, manifest_sha256(base), tuple(pieces))
