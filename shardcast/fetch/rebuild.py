"""Shards rebuilt from a base the caller holds and a delta piece, instead of downloaded whole.

When the manifest carries a delta against a version found among ``bases`` (the checkpoints the caller
already holds), the shards it covers are rebuilt from the base and the delta's pieces: each piece is hashed
on arrival like a shard (a relay that alters one is reported), decompressed no further than the shard's
size, XORed with the base, and the result is checked against the manifest's hash of the shard. Whatever
goes wrong with a delta (no base, a base whose manifest differs from the one the delta names, a piece that
decompresses to the wrong size or rebuilds wrong bytes, no relay serving the delta) costs only the download
of that shard whole; the reasons are in ``FetchResult.delta_problems``. A mirror (``keep_delta``) also keeps
every piece, so that it can serve the delta in turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from typing import TYPE_CHECKING

from ..delta import rebuild_shard
from ..errors import DeltaError, ShardcastError
from ..manifest import DeltaPiece, Manifest, manifest_sha256, verify_manifest
from ..store import DELTA_NAME, MANIFEST_NAME, is_ready, raise_if_disk_full
from . import disk
from .disk import CHUNK
from .failures import _CLIENT_ERRORS, BUSY_STATUSES, _check_range, _Failure, _failure_of, retry_after_s
from .relays import _Relay

if TYPE_CHECKING:
    from .version import _Fetch


def open_base(fetch: _Fetch, manifest: Manifest) -> dict[int, int]:
    """Shard index -> descriptor of the base file to rebuild it from, for each shard still to get that
    the manifest's delta covers and one of ``bases`` can rebuild."""
    delta = manifest.delta
    if delta is None:
        return {}
    for base in fetch.bases:
        if base.absolute() in (fetch.out_dir, fetch.staging) or not is_ready(base):
            continue
        try:
            held = verify_manifest((base / MANIFEST_NAME).read_bytes(), fetch.key)
        except (OSError, ShardcastError):
            continue
        if held.version != delta.base_version:
            continue
        if manifest_sha256(held) != delta.base_manifest_sha256:
            fetch.delta_problem(
                f"{base} holds version {held.version}, but not the one the delta was made against "
                "(its manifest differs)"
            )
            continue
        plan: dict[int, int] = {}
        for piece in delta.pieces:
            shard = manifest.shards[piece.shard]
            if piece.shard in fetch.done:
                continue
            entry = held.file(shard.file)
            if entry is None or entry.size != manifest.file(shard.file).size:
                fetch.delta_problem(f"the base has no {shard.file!r} of the same size (shard {piece.shard})")
                continue
            if shard.file not in fetch.base_fds:
                fetch.base_fds[shard.file] = os.open(base / shard.file, os.O_RDONLY)
            plan[piece.shard] = fetch.base_fds[shard.file]
        return plan
    return {}


async def download_piece(fetch: _Fetch, relay: _Relay, manifest: Manifest, piece: DeltaPiece) -> bool:
    """Get delta piece ``piece`` intact, keep it (``keep_delta``) and rebuild its shard if planned.

    Returns True when the shard was rebuilt. A relay that sends other bytes is a _Failure (bad); a
    piece that arrives intact but does not rebuild its shard is a DeltaError (not the relay's fault).
    """
    url = f"{relay.url}/versions/{manifest.version}/delta"
    headers = {"Range": f"bytes={piece.offset}-{piece.end - 1}", "Accept-Encoding": "identity"}
    try:
        async with fetch.session.get(url, headers=headers, timeout=fetch.timeout) as resp:
            if resp.status == 404:
                relay.no_delta.add(manifest.version)
                raise _Failure("no-delta", f"no delta of version {manifest.version} there (404)")
            if resp.status in BUSY_STATUSES:
                raise _Failure("busy", f"answered {resp.status} for the delta",
                               retry_after=retry_after_s(resp.headers.get("Retry-After")))
            if resp.status != 206:
                raise _Failure(f"http-{resp.status}", f"answered {resp.status} for a range of the delta")
            _check_range(resp, piece.offset, piece.end, "delta bytes")
            t0 = time.monotonic()
            parts, size = [], 0
            while chunk := await resp.content.read(CHUNK):
                size += len(chunk)
                if size > piece.size:
                    raise _Failure("wrong-length", f"sent more than the piece's {piece.size} bytes", bad=True)
                parts.append(chunk)
            if size < piece.size:
                raise _Failure("truncated", f"delta piece ended after {size} of {piece.size} bytes")
    except _CLIENT_ERRORS as exc:
        raise _failure_of(exc, fetch.timeout.sock_read) from exc
    data = b"".join(parts)
    digest = hashlib.sha256(data).hexdigest()
    if digest != piece.sha256:
        raise _Failure(
            "hash-mismatch", f"delta piece sha256 {digest[:16]}… instead of {piece.sha256[:16]}…", bad=True
        )
    relay.record_success(piece.size, time.monotonic() - t0)
    fetch.delta_bytes += piece.size
    loop = asyncio.get_running_loop()
    try:
        if fetch.keep_delta:
            await loop.run_in_executor(None, disk._write_at, fetch.delta_fd, [data], piece.offset)
            fetch.pieces_kept.add(piece.shard)
            if fetch.on_verified is not None:
                fetch.on_verified(DELTA_NAME, piece.offset, piece.size)
        if piece.shard not in fetch.rebuild or piece.shard in fetch.done:
            return False
        shard = manifest.shards[piece.shard]
        digest = await loop.run_in_executor(
            None, rebuild_shard, data, fetch.rebuild[piece.shard], fetch.fds[shard.file], shard.offset, shard.size
        )
    except OSError as exc:
        raise_if_disk_full(exc, fetch.staging)
        raise
    if digest != shard.sha256:
        raise DeltaError(
            f"the rebuilt bytes hash {digest[:16]}…, the manifest says {shard.sha256[:16]}…: the base on disk "
            "is not the base the delta was made against"
        )
    return True
