"""Downloads from the relays: each shard as an HTTP range request, hashed while it streams, with retries.

The shards download in parallel, each from a relay chosen by ``relays.choose_relay``; a shard is hashed
while it streams and written at its offset, so memory stays at about one 1 MiB chunk per download. A shard
that arrives with the wrong hash or length is fetched again from another relay, and the relay that served
it is reported (``FetchResult.bad_relays``, and a warning in the log) and almost never chosen again;
timeouts, resets and 5xx answers are retried elsewhere and recorded in ``FetchResult.failures``; a busy
relay (429/503) is asked again when its ``Retry-After`` says, without counting it as a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import quote

from ..errors import DeltaError, NoRelayReachableError, ShardUnavailableError, VersionGoneError
from ..manifest import Manifest, ShardEntry
from ..store import raise_if_disk_full
from . import disk
from .disk import CHUNK
from .failures import _CLIENT_ERRORS, BUSY_STATUSES, _check_range, _Failure, _failure_of, retry_after_s
from .rebuild import download_piece
from .relays import _Relay, choose_relay
from .resolve import probe

if TYPE_CHECKING:
    from .version import _Fetch

log = logging.getLogger("veriroll.shardcast.fetch")

# How often relays that did not have the version are asked again during a fetch: a mirror that starts
# streaming it after the fetch began takes its share of the load from then on.
REPROBE_S = 1.0
MAX_BUSY_WAITS = 120
"""Busy answers a shard may get before they count as failed attempts (a relay that is never free)."""

SHARD, PIECE = "shard", "piece"


@dataclass(eq=False)
class _Job:
    """One download: shard ``shard`` whole, or the delta piece that rebuilds it; and how it has gone so far."""

    kind: str
    shard: int
    tried: set[str] = field(default_factory=set)  # relays tried in this round (every one: the next round)
    bad_for: set[str] = field(default_factory=set)  # relays that served it bad bytes: never asked again
    attempts: int = 0  # attempts started, less those a busy relay turned away
    rounds: int = 0  # times every relay was tried
    busy: int = 0  # busy answers so far
    retry_at: float = 0.0  # monotonic time before which it is not started

    @property
    def piece(self) -> bool:
        return self.kind == PIECE


async def download_shard(
    fetch: _Fetch, relay: _Relay, manifest: Manifest, shard: ShardEntry, fd: int, counted: list[int]
) -> None:
    """Get shard ``shard`` from ``relay`` into ``fd`` at its offset, hashed as it streams; a _Failure when
    the relay did not deliver it intact. ``counted[0]``: the bytes counted in the progress so far."""
    entry = manifest.file(shard.file)
    url = f"{relay.url}/versions/{manifest.version}/files/{quote(shard.file)}"
    headers = {"Range": f"bytes={shard.offset}-{shard.end - 1}", "Accept-Encoding": "identity"}
    loop = asyncio.get_running_loop()
    try:
        async with fetch.session.get(url, headers=headers, timeout=fetch.timeout) as resp:
            if resp.status == 404:
                relay.gone.add(manifest.version)
                raise _Failure("gone", f"{resp.status} for {shard.file}")
            if resp.status in BUSY_STATUSES:
                raise _Failure("busy", f"answered {resp.status} for {shard.file}",
                               retry_after=retry_after_s(resp.headers.get("Retry-After")))
            if resp.status == 206:
                _check_range(resp, shard.offset, shard.end, "bytes")
            elif resp.status == 200:
                if not (shard.offset == 0 and shard.size == entry.size):
                    raise _Failure("http-200", "relay ignored the Range header")
            else:
                raise _Failure(f"http-{resp.status}", f"answered {resp.status} for {shard.file}")
            length = resp.content_length
            if length is not None and length != shard.size:
                raise _Failure(
                    "wrong-length", f"announced {length} bytes for a shard of {shard.size}", bad=True
                )
            t0 = time.monotonic()
            hasher = hashlib.sha256()
            # Pieces arrive as the socket delivers them; about 1 MiB of them at a time is hashed and
            # written by a worker thread while the event loop receives the next: memory stays at
            # ~2 MiB per download, and the pieces are never joined (no extra copy).
            pos, written, pieces, pending = 0, 0, [], None
            try:
                while pos < shard.size:
                    piece = await resp.content.readany()
                    if not piece:
                        raise _Failure("truncated", f"stream ended after {pos} of {shard.size} bytes")
                    if pos + len(piece) > shard.size:
                        raise _Failure(
                            "wrong-length", f"sent more than the shard's {shard.size} bytes", bad=True
                        )
                    pieces.append(piece)
                    pos += len(piece)
                    counted[0] += len(piece)
                    fetch.advance(len(piece))
                    if pos - written >= CHUNK or pos == shard.size:
                        if pending is not None:
                            await pending
                        pending = loop.run_in_executor(
                            None, disk._hash_and_write, hasher, fd, pieces, shard.offset + written
                        )
                        written, pieces = pos, []
                await pending
                pending = None
            finally:
                if pending is not None:
                    with contextlib.suppress(Exception):
                        await pending
            if length is None and await resp.content.read(1):
                raise _Failure("wrong-length", f"sent more than the shard's {shard.size} bytes", bad=True)
            digest = hasher.hexdigest()
            if digest != shard.sha256:
                raise _Failure(
                    "hash-mismatch", f"sha256 {digest[:16]}… instead of {shard.sha256[:16]}…", bad=True
                )
            relay.record_success(shard.size, time.monotonic() - t0)
    except _CLIENT_ERRORS as exc:
        raise _failure_of(exc, fetch.timeout.sock_read) from exc
    except OSError as exc:  # from our own writes
        raise_if_disk_full(exc, fetch.staging / shard.file)
        raise


async def download_all(fetch: _Fetch, manifest: Manifest, fds: dict[str, int], todo: list[_Job]) -> int:
    """Run the jobs in ``todo`` (and the whole-shard jobs that failed pieces turn into); returns how
    many bytes of whole shards were accepted."""
    version = manifest.version
    pending: list[_Job] = list(todo)

    def give_up_piece(job: _Job, why: str) -> None:
        pending.remove(job)
        fetch.delta_problem(f"delta piece for shard {job.shard}: {why}")
        if job.shard in fetch.rebuild and job.shard not in fetch.done:
            pending.append(_Job(SHARD, job.shard))

    active: dict[asyncio.Task, tuple[_Job, _Relay, list[int]]] = {}
    accepted = 0
    probing: asyncio.Future | None = None
    last_probe = time.monotonic()
    try:
        while pending or active:
            now = time.monotonic()
            latecomers = [r for r in fetch.relays if r.reachable and version not in r.holds]
            if latecomers and (probing is None or probing.done()) and now - last_probe >= REPROBE_S:
                probing = asyncio.gather(*(probe(fetch, r) for r in latecomers))
                last_probe = now
            launched = True
            while launched and len(active) < fetch.concurrency:
                launched = False
                for job in pending:
                    if job.retry_at > now:
                        continue
                    choice = choose_relay(fetch.relays, version, piece=job.piece, tried=job.tried,
                                          bad_for=job.bad_for, per_relay=fetch.per_relay)  # fmt: skip
                    if choice is False:
                        if not any(r.has(version) for r in fetch.relays):
                            _raise_nothing_left(fetch, version)
                        honest = [r for r in fetch.relays
                                  if r.serves(version, piece=job.piece) and r.url not in job.bad_for]  # fmt: skip
                        if job.piece and (not honest or job.attempts >= fetch.max_attempts):
                            give_up_piece(job, "no relay served it intact")
                            launched = True
                            break
                        if not honest or job.attempts >= fetch.max_attempts:
                            _raise_unavailable(fetch, manifest, job.shard, job.attempts)
                        job.rounds += 1
                        job.tried = set()
                        job.retry_at = now + min(5.0, 0.25 * 2 ** (job.rounds - 1))
                        continue
                    if choice is None:
                        continue
                    pending.remove(job)
                    choice.inflight += 1
                    job.attempts += 1
                    shard = manifest.shards[job.shard]
                    counted = [0]  # bytes counted in the progress so far (pieces count once rebuilt)
                    if job.piece:
                        work = download_piece(fetch, choice, manifest, fetch.pieces[job.shard])
                    else:
                        work = download_shard(fetch, choice, manifest, shard, fds[shard.file], counted)
                    active[asyncio.create_task(work)] = (job, choice, counted)
                    launched = True
                    break
            if not active:
                if not pending:
                    break
                wait = max(0.0, min(j.retry_at for j in pending) - time.monotonic())
                await asyncio.sleep(min(wait, 5.0) if wait > 0 else 0.05)
                continue
            future_retries = [j.retry_at for j in pending if j.retry_at > now]
            if latecomers:
                future_retries.append(last_probe + REPROBE_S)
            timeout = max(0.0, min(future_retries) - now) if future_retries else None
            done, _ = await asyncio.wait(active, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                job, relay, counted = active.pop(task)
                relay.inflight -= 1
                shard = manifest.shards[job.shard]
                exc = task.exception()
                if exc is None:
                    if not job.piece:
                        accepted += shard.size
                        fetch.shards_fetched += 1
                        fetch.mark_done(job.shard)
                    elif task.result():  # the piece rebuilt its shard
                        fetch.shards_rebuilt += 1
                        fetch.advance(shard.size)
                        fetch.mark_done(job.shard)
                    continue
                if isinstance(exc, DeltaError):
                    # The piece arrived intact (its hash is the manifest's), so the relay is not at fault:
                    # the delta or our base is. The shard comes whole instead.
                    fetch.delta_problem(f"shard {job.shard}: {exc}")
                    if job.shard not in fetch.done:
                        pending.append(_Job(SHARD, job.shard))
                    continue
                if not isinstance(exc, _Failure):
                    raise exc
                fetch.advance(-counted[0])  # the progress counted bytes that were thrown away
                fetch.report(relay, exc.kind, job.shard, exc.detail, bad=exc.bad)
                if exc.retry_after is not None and job.busy < MAX_BUSY_WAITS:
                    # Busy (its slots, or this address's share of them, are taken): not a failure of the
                    # relay or the shard. Come back when it says, with jitter so a crowd spreads out.
                    job.busy += 1
                    job.attempts -= 1
                    job.retry_at = time.monotonic() + exc.retry_after * random.uniform(1.0, 1.5)
                    pending.insert(0, job)
                    continue
                if exc.connection:
                    relay.consecutive_conn_failures += 1
                    if relay.consecutive_conn_failures >= 3:
                        relay.stats.reachable = False
                        log.warning("relay %s stopped answering; no longer used", relay.url)
                job.tried.add(relay.url)
                if exc.bad:
                    job.bad_for.add(relay.url)
                pending.insert(0, job)
    finally:
        for task in active:
            task.cancel()
        if probing is not None:
            probing.cancel()
        await asyncio.gather(*active, *([probing] if probing is not None else []), return_exceptions=True)
    return accepted


def _raise_nothing_left(fetch: _Fetch, version: int) -> None:
    if any(version in r.gone for r in fetch.relays):
        raise VersionGoneError(
            f"version {version} disappeared from every relay during the fetch (pruned); fetch a newer one"
        )
    raise NoRelayReachableError(
        f"every relay holding version {version} stopped answering during the fetch; run again to resume"
    )


def _raise_unavailable(fetch: _Fetch, manifest: Manifest, idx: int, attempts: int) -> None:
    shard = manifest.shards[idx]
    recent = [f"{i.relay}: {i.kind} ({i.detail})" for i in fetch.bad + fetch.failures if i.shard == idx][-6:]
    raise ShardUnavailableError(
        f"shard {idx} ({shard.file} @ {shard.offset}, {shard.size} bytes) failed {attempts} times on every "
        f"relay holding version {manifest.version}: {'; '.join(recent)}. Run again to resume, or add relays"
    )
