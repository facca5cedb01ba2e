"""Fetch one checkpoint version from untrusted relays and prove every byte against the coordinator's key.

``fetch_version`` (async) and ``fetch_version_sync`` do, in order:

1. ask every relay for ``GET /status`` (bounded by a timeout each): who is up, which versions each holds;
2. pick the version (``latest`` = the newest any relay claims, falling back to older ones when the
   claim cannot be backed by a valid manifest) and fetch its manifest from a relay that claims it,
   checking the signature first, then the manifest's rules, then that its version is the one asked
   for (a relay serving an old version under a new name is caught here);
3. download the shards in parallel as HTTP range requests on the relays' files, choosing each shard's
   relay at random weighted by measured throughput, success rate and load, at most a few shards per
   relay at once; each shard is hashed while it streams and written at its offset, so memory stays at
   about one 1 MiB chunk per download;
4. a shard that arrives with the wrong hash or length is fetched again from another relay, and the
   relay that served it is reported (``FetchResult.bad_relays``, and a warning in the log) and almost
   never chosen again; timeouts, resets and 5xx answers are retried elsewhere and recorded in
   ``FetchResult.failures``;
5. when every shard is in, the files are fsynced, the ready marker written, and the staging
   directory renamed to ``out_dir`` in one step.

Why every file hashes right without a second pass over it: the manifest is signed, its shards cover
each file exactly (no gap, no overlap: ``validate_manifest``), and each shard's bytes are hashed in
memory and written at their offset in the same step, so the file on disk is the concatenation of
verified shards. Reading the file back to hash it again would read the same bytes from the page cache
and catch nothing more, at the cost of a second SHA-256 pass (on 2 cores, a third of the fetch time).
``verify_files=True`` does it anyway, in order, while the download runs (for audits, or a disk you do
not trust); a file that then hashes wrong has its bad shards fetched again.

Deltas (``delta.py``): when the manifest carries a delta against a version found among ``bases`` (the
checkpoints the caller already holds), the shards it covers are rebuilt from the base and the delta's
pieces instead of being downloaded: each piece is hashed on arrival like a shard (a relay that alters
one is reported), decompressed no further than the shard's size, XORed with the base, and the result is
checked against the manifest's hash of the shard. Whatever goes wrong with a delta (no base, a base
whose manifest differs from the one the delta names, a piece that decompresses to the wrong size or
rebuilds wrong bytes, no relay serving the delta) costs only the download of that shard whole; the
reasons are in ``FetchResult.delta_problems``. A mirror (``keep_delta``) also keeps every piece, so that
it can serve the delta in turn.

Peers (``swarm``, ``swarm/host.py``): with a running Swarm, shards come from peers, and from the HTTP
relays only what no live peer holds (``_SwarmSchedule``). Every second each announced peer holding the
version is asked which of its shards it has (one stream per peer); the rarest wanted shard goes first, to
a peer chosen at random weighted by measured throughput, never more at once to one peer than it serves to
one peer (less when it answered BUSY), and a busy peer is waited for. The relays serve at once this node's
stripe (its share of the shards, by its rank among the peers, so that nodes fetching at once take
different shards from the origin and then trade them), another node's stripe once that node has had time
to fetch it, and whatever is left when the peers stop delivering or none is left. A peer's bytes are hashed
on arrival like a relay's; a peer that sends bad ones is banned by the swarm and named in
``FetchResult.bad_peers``; one that stalls, cannot be reached or lied about what it holds is backed off
and, after a few failures in a row, dropped for the fetch. Every shard verified here is served to peers at
once, and the version whole once it is ready.

Downloads go into ``<parent>/.<name>.shardcast-partial/`` with a journal of finished shards; a fetch
that is interrupted (killed, disk full, relays gone) and run again skips the shards it already has,
after hashing them again from disk: a journal that lies costs a refetch, never a bad checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import aiohttp

from veriroll.protos.identity import KeyFileError, PublicKey, load_public_key

from .delta import rebuild_shard
from .errors import (
    DeltaError,
    ManifestError,
    ManifestSignatureError,
    NoRelayReachableError,
    OutputDirError,
    ShardcastError,
    ShardUnavailableError,
    VersionGoneError,
    WrongVersionError,
)
from .manifest import (
    MAX_MANIFEST_BYTES,
    DeltaPiece,
    Manifest,
    ShardEntry,
    manifest_sha256,
    signing_message,
    verify_manifest,
)
from .store import (
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
from .swarm.errors import BadPeerError, PeerError, PeerNotAnnouncedError
from .swarm.wire import Refusal

if TYPE_CHECKING:  # libp2p is an optional dependency: only a caller that passes a Swarm imports it
    from .swarm.host import Swarm

log = logging.getLogger("veriroll.shardcast.fetch")

DEFAULT_CONCURRENCY = 8
DEFAULT_PER_RELAY = 2  # on loopback 2 streams beat 4; over a WAN, several relays add streams
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_READ_TIMEOUT = 20.0  # seconds without a single byte before a download is abandoned
SMALL_ANSWER_S = 5.0
"""The longest a relay may take to send a small answer (``/status``, a manifest) once connected, if less than
``read_timeout``. A healthy relay answers them from memory in milliseconds, even while it streams shards
to hundreds of clients; one that stopped answering (a paused machine, a path that drops packets) is given
up after this instead of the whole read timeout, which every fetch paid again (and a mirror twice per
round: its own probe, then the fetch's)."""


def small_answer_timeout(connect_timeout: float, read_timeout: float) -> aiohttp.ClientTimeout:
    """The whole-request timeout of a small answer (``/status``, a manifest): see ``SMALL_ANSWER_S``."""
    return aiohttp.ClientTimeout(total=connect_timeout + min(read_timeout, SMALL_ANSWER_S))
CHUNK = 1024 * 1024
JOURNAL_NAME = ".shardcast-progress"
PARTIAL_SUFFIX = ".shardcast-partial"
PRIOR_BPS = 100e6  # throughput assumed for a relay not yet measured: optimistic, so each gets tried
BAD_PENALTY = 0.02  # weight factor per bad shard served: a relay that lied is a last resort
EWMA_ALPHA = 0.3
# How often relays that did not have the version are asked again during a fetch: a mirror that starts
# streaming it after the fetch began takes its share of the load from then on.
REPROBE_S = 1.0
SYNC_EVERY = 64 * 1024 * 1024  # flush written data to disk in the background every this many bytes per file
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


# -- results -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RelayIncident:
    """Something a relay (or a peer of the swarm: ``relay`` is then its peer id) did wrong. ``kind`` is a
    short tag: for bad relays ``hash-mismatch``,
    ``wrong-length``, ``bad-signature``, ``wrong-version``, ``invalid-manifest``; for failures
    ``timeout``, ``connection``, ``truncated``, ``http-<status>``, ``gone``."""

    relay: str
    kind: str
    shard: int | None
    detail: str


@dataclass
class RelayStats:
    """What one relay did for this fetch."""

    url: str
    reachable: bool = False
    versions: list[int] = field(default_factory=list)
    bytes: int = 0
    shards: int = 0
    failures: int = 0
    bad: int = 0
    throughput_bps: float | None = None


@dataclass
class FetchResult:
    """A complete, verified checkpoint at ``path`` (the ready marker is written)."""

    version: int
    path: Path
    manifest: Manifest
    already_present: bool
    bytes_downloaded: int  # bytes of shards accepted in this call
    bytes_reused: int  # bytes of shards kept from an interrupted earlier call
    shards_downloaded: int
    shards_reused: int
    seconds: float
    bad_relays: list[RelayIncident]
    failures: list[RelayIncident]
    relays: dict[str, RelayStats]
    delta_bytes: int = 0  # bytes of delta pieces accepted in this call
    shards_rebuilt: int = 0  # shards rebuilt from a base and a delta piece instead of downloaded
    delta_problems: list[str] = field(default_factory=list)  # why a delta, or a piece of it, was not used
    bytes_from_peers: int = 0  # of bytes_downloaded, those that came from peers of the swarm
    shards_from_peers: int = 0
    bad_peers: list[RelayIncident] = field(default_factory=list)  # peers that sent bad bytes (banned)

    @property
    def bad_relay_urls(self) -> set[str]:
        return {i.relay for i in self.bad_relays}

    @property
    def bytes_shipped(self) -> int:
        """Bytes that crossed the network for this call: whole shards plus delta pieces."""
        return self.bytes_downloaded + self.delta_bytes


# -- relay state -------------------------------------------------------------------------------------


class _Relay:
    def __init__(self, url: str):
        self.url = url
        self.stats = RelayStats(url)
        self.holds: set[int] = set()
        self.gone: set[int] = set()  # versions it answered 404 for during this fetch
        self.no_delta: set[int] = set()  # versions whose delta it answered 404 for
        self.successes = 0
        self.failures = 0
        self.bad_events = 0
        self.consecutive_conn_failures = 0
        self.inflight = 0
        self.ewma_bps: float | None = None

    @property
    def reachable(self) -> bool:
        return self.stats.reachable

    def has(self, version: int) -> bool:
        return self.reachable and version in self.holds and version not in self.gone

    def serves(self, job: _Job, version: int) -> bool:
        return self.has(version) and (job.kind != PIECE or version not in self.no_delta)

    def weight(self, prior_bps: float) -> float:
        score = (self.successes + 1) / (self.successes + self.failures + 2)
        bps = self.ewma_bps if self.ewma_bps is not None else prior_bps
        return score * bps * (BAD_PENALTY**self.bad_events) / (1 + self.inflight)

    def record_success(self, nbytes: int, seconds: float) -> None:
        self.successes += 1
        self.consecutive_conn_failures = 0
        bps = nbytes / max(seconds, 1e-6)
        self.ewma_bps = bps if self.ewma_bps is None else (1 - EWMA_ALPHA) * self.ewma_bps + EWMA_ALPHA * bps
        self.stats.bytes += nbytes
        self.stats.shards += 1
        self.stats.throughput_bps = self.ewma_bps


class _Peer:
    """A peer of the swarm as a source for this fetch: what it says it holds, its measured throughput."""

    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.ewma_bps: float | None = None
        self.inflight = 0  # shards asked of it now (the schedule counts them)
        self.window: float | None = None  # shards it takes at once, once it answered BUSY (the schedule sets the cap)
        self.held: set[int] = set()  # its last HAVE answer, less the shards it then did not serve
        self.heard = False  # it answered HAVE, or failed, at least once
        self.strikes = 0  # failures in a row (a success forgives them)
        self.ready_at = 0.0  # monotonic time before which it is not asked (busy, or backing off)
        self.skip = False  # banned, or failed MAX_PEER_STRIKES times in a row: not asked again in this fetch

    def weight(self, prior_bps: float) -> float:
        return (self.ewma_bps if self.ewma_bps is not None else prior_bps) / (1 + self.inflight)

    def record_success(self, nbytes: int, seconds: float) -> None:
        self.strikes = 0
        if self.window is not None:  # grow back slowly (one more after WINDOW_GROWTH windows' worth of successes):
            self.window += 1 / (WINDOW_GROWTH * self.window)  # a BUSY may have been a race with a stream's close
        bps = nbytes / max(seconds, 1e-6)
        self.ewma_bps = bps if self.ewma_bps is None else (1 - EWMA_ALPHA) * self.ewma_bps + EWMA_ALPHA * bps


PEER_ASK_EVERY_S = 1.0  # how often peers are asked what they hold while shards are missing (and polled)
PEER_BUSY_WAIT_S = 0.5  # a busy peer is asked again after about this long
PEER_BACKOFF_S = 1.0  # wait after a peer's first failure in a row; doubles with each further one
MAX_PEER_STRIKES = 4  # failures in a row before a peer is dropped for the fetch
WINDOW_GROWTH = 8  # a window grows by one shard after this many windows of shards served without BUSY
MIN_PATIENCE_S = 2.0  # least wait, per step of distance in the ring, before fetching another node's stripe


SHARD, PIECE = "shard", "piece"


@dataclass(frozen=True)
class _Job:
    """One download: shard ``shard`` whole, or the delta piece that rebuilds it."""

    kind: str
    shard: int


class _Failure(Exception):
    """A download attempt failed; ``bad`` when the relay served wrong data (not just a flaky network)."""

    def __init__(self, kind: str, detail: str, *, bad: bool = False, connection: bool = False,
                 retry_after: float | None = None):
        super().__init__(detail)
        self.kind, self.detail, self.bad, self.connection = kind, detail, bad, connection
        self.retry_after = retry_after  # set when the relay was busy (429/503): come back then, it is not a fault


BUSY_STATUSES = (429, 503)
MAX_RETRY_AFTER_S = 30.0
MAX_BUSY_WAITS = 120
"""Busy answers a shard may get before they count as failed attempts (a relay that is never free)."""


def retry_after_s(value: str | None) -> float:
    """A busy relay's ``Retry-After`` in seconds (delta form), in [0.5, MAX_RETRY_AFTER_S]; 1 s if absent or odd."""
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        seconds = 1.0
    if seconds != seconds:  # NaN
        seconds = 1.0
    return min(MAX_RETRY_AFTER_S, max(0.5, seconds))


def normalize_relay_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"https?://", url):
        url = "http://" + url
    return url


# -- seams: the two places bytes touch the disk, so tests can fill it ------------------------------------


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


# -- the fetch ---------------------------------------------------------------------------------------


class _Fetch:
    def __init__(
        self,
        relays: Sequence[str],
        key: PublicKey,
        out_dir: Path,
        version: int | str,
        *,
        min_version: int | None,
        concurrency: int,
        per_relay: int,
        connect_timeout: float,
        read_timeout: float,
        max_attempts: int | None,
        fsync: bool,
        verify_files: bool,
        progress: bool | None,
        on_progress: Callable[[int, int], None] | None,
        session: aiohttp.ClientSession | None,
        bases: Sequence[str | os.PathLike],
        keep_delta: bool,
        on_staged: Callable[[Manifest, bytes, Path], None] | None,
        on_verified: Callable[[str, int, int], None] | None,
        swarm: Swarm | None,
        peers: Sequence[str] | None,
    ):
        if not relays:
            raise ValueError("give at least one relay URL")
        urls = list(dict.fromkeys(normalize_relay_url(r) for r in relays))
        self.relays = [_Relay(u) for u in urls]
        self.key = key
        self.out_dir = out_dir
        self.version_arg = version
        self.min_version = min_version
        self.concurrency = max(1, concurrency)
        self.per_relay = max(1, per_relay)
        self.timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout, connect=connect_timeout * 2
        )
        # the status probe and manifests are small: bound them as a whole
        self.small_timeout = small_answer_timeout(connect_timeout, read_timeout)
        self.max_attempts = max_attempts or max(5, 3 * len(self.relays))
        self.fsync = fsync
        self.verify_files = verify_files
        self.show_progress = sys.stderr.isatty() if progress is None else progress
        self.on_progress = on_progress
        self.own_session = session is None
        self.session = session
        self.bad: list[RelayIncident] = []
        self.failures: list[RelayIncident] = []
        self.staging = out_dir.parent / f".{out_dir.name}{PARTIAL_SUFFIX}"
        self.done_bytes = 0
        self.bases = [Path(b) for b in bases]
        self.keep_delta = keep_delta
        self.on_staged = on_staged
        self.on_verified = on_verified
        self.delta_bytes = 0
        self.shards_rebuilt = 0
        self.delta_problems: list[str] = []
        self.pieces_kept: set[int] = set()  # shards whose delta piece is in the staging delta file
        self.swarm = swarm
        self.peer_ids = peers
        self.bad_peers: list[RelayIncident] = []
        self.bytes_from_peers = 0
        self.shards_from_peers = 0

    # ---- incidents

    def _report(self, relay: _Relay, kind: str, shard: int | None, detail: str, *, bad: bool) -> None:
        incident = RelayIncident(relay.url, kind, shard, detail)
        if bad:
            relay.bad_events += 1
            relay.stats.bad += 1
            self.bad.append(incident)
            where = f"shard {shard}" if shard is not None else "the manifest"
            log.warning("relay %s served bad data (%s, %s): %s; avoiding it", relay.url, kind, where, detail)
        else:
            relay.failures += 1
            relay.stats.failures += 1
            self.failures.append(incident)
            log.info("relay %s failed (%s, shard %s): %s", relay.url, kind, shard, detail)

    # ---- discovery

    async def _probe(self, relay: _Relay) -> None:
        try:
            async with self.session.get(f"{relay.url}/status", timeout=self.small_timeout) as resp:
                if resp.status != 200:
                    raise _Failure(f"http-{resp.status}", f"GET /status answered {resp.status}")
                body = await _read_capped(resp, 1024 * 1024)
            status = json.loads(body)
            versions = status.get("versions") if isinstance(status, dict) else None
            # A mirror lists what it holds whole in "versions" and what it is still mirroring, and already
            # serves shard by shard, in "streaming": either is a version to ask it for.
            streaming = status.get("streaming", []) if isinstance(status, dict) else None
            if not isinstance(versions, list) or not isinstance(streaming, list):
                raise _Failure("bad-status", "GET /status did not list versions")
            versions = versions + streaming
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions):
                raise _Failure("bad-status", "GET /status did not list versions as integers")
        except _Failure as exc:
            self._report(relay, exc.kind, None, exc.detail, bad=False)
            return
        except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
            self._report(relay, _kind_of(exc), None, f"GET /status: {_describe(exc)}", bad=False)
            return
        relay.stats.reachable = True
        relay.holds = set(versions)
        relay.stats.versions = sorted(versions)

    async def _manifest_from(self, relay: _Relay, version: int) -> tuple[Manifest, bytes] | None:
        url = f"{relay.url}/versions/{version}/manifest"
        try:
            async with self.session.get(url, timeout=self.small_timeout) as resp:
                if resp.status == 404:
                    relay.gone.add(version)
                    self._report(relay, "gone", None, f"version {version} manifest: 404", bad=False)
                    return None
                if resp.status != 200:
                    self._report(
                        relay, f"http-{resp.status}", None, f"manifest answered {resp.status}", bad=False
                    )
                    return None
                data = await _read_capped(resp, MAX_MANIFEST_BYTES)
        except _Failure as exc:
            self._report(relay, exc.kind, None, f"manifest: {exc.detail}", bad=False)
            return None
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            self._report(relay, _kind_of(exc), None, f"manifest: {_describe(exc)}", bad=False)
            return None
        try:
            manifest = verify_manifest(data, self.key, expect_version=version)
        except ManifestSignatureError as exc:
            self._report(relay, "bad-signature", None, str(exc), bad=True)
            raise
        except WrongVersionError as exc:
            self._report(relay, "wrong-version", None, f"listed as version {version}: {exc}", bad=True)
            raise
        except ManifestError as exc:
            self._report(relay, "invalid-manifest", None, str(exc), bad=True)
            raise
        return manifest, data

    async def _resolve(self) -> tuple[Manifest, bytes]:
        await asyncio.gather(*(self._probe(r) for r in self.relays))
        up = [r for r in self.relays if r.reachable]
        if not up:
            details = "; ".join(f"{i.relay}: {i.detail}" for i in self.failures) or "no answer"
            raise NoRelayReachableError(
                f"none of the {len(self.relays)} relays answered ({details}); check the URLs and that "
                "the relays are running"
            )
        if self.version_arg == "latest":
            claimed = sorted({v for r in up for v in r.holds}, reverse=True)
            if self.min_version is not None:
                claimed = [v for v in claimed if v >= self.min_version]
        else:
            claimed = [int(self.version_arg)]
        sig_errors: list[str] = []
        invalid: list[ManifestError] = []
        for version in claimed:
            holders = [r for r in up if r.has(version)]
            random.shuffle(holders)
            for relay in holders:
                try:
                    got = await self._manifest_from(relay, version)
                except ManifestSignatureError as exc:
                    sig_errors.append(f"{relay.url}: {exc}")
                    continue
                except ManifestError as exc:
                    invalid.append(type(exc)(f"{relay.url}: {exc}"))
                    continue
                if got is not None:
                    return got
        wanted = self.version_arg if self.version_arg != "latest" else "the latest version"
        if sig_errors:
            raise ManifestSignatureError(
                f"no relay served a manifest for {wanted} signed by the coordinator key; "
                + "; ".join(sig_errors)
            )
        if invalid:
            # All refusals were an old version passed off as the wanted one: say exactly that.
            cls = (
                WrongVersionError if all(isinstance(e, WrongVersionError) for e in invalid) else ManifestError
            )
            raise cls(f"every manifest served for {wanted} was refused: " + "; ".join(map(str, invalid)))
        floor = f" (at least version {self.min_version})" if self.min_version is not None else ""
        held = {r.url: sorted(r.holds) for r in up}
        raise VersionGoneError(
            f"no reachable relay holds {wanted}{floor}; they hold {held}. The version was never published "
            "or was pruned everywhere: fetch a newer one"
        )

    # ---- output directory

    def _check_out_dir(self) -> None:
        out = self.out_dir
        if out.exists() and not out.is_dir():
            raise OutputDirError(f"{out} exists and is not a directory")
        if out.is_dir() and not is_ready(out) and any(out.iterdir()):
            raise OutputDirError(
                f"{out} exists, is not empty and is not a shardcast checkpoint; refusing to replace it "
                "(choose an empty or new directory)"
            )

    def _already_present(self, manifest: Manifest) -> bool:
        if not is_ready(self.out_dir):
            return False
        try:
            held = verify_manifest((self.out_dir / MANIFEST_NAME).read_bytes(), self.key)
        except (OSError, ShardcastError):
            return False
        return signing_message(held) == signing_message(manifest)

    def _prepare_staging(self, manifest: Manifest, manifest_bytes: bytes) -> set[int]:
        """Create or reuse the staging directory; the set of shards an earlier run already finished."""
        done: set[int] = set()
        staged = self.staging / MANIFEST_NAME
        if staged.is_file():
            try:
                old = verify_manifest(staged.read_bytes(), self.key)
                same = signing_message(old) == signing_message(manifest)
            except (OSError, ShardcastError):
                same = False
            if same:
                with contextlib.suppress(OSError):
                    for line in (self.staging / JOURNAL_NAME).read_text().split():
                        if line.isdigit() and int(line) < len(manifest.shards):
                            done.add(int(line))
            else:
                log.info("discarding %s: it holds a different version", self.staging)
                remove_tree(self.staging)
        elif self.staging.exists():
            remove_tree(self.staging)
        try:
            self.staging.mkdir(parents=True, exist_ok=True)
            if not staged.is_file():
                write_file_durably(staged, manifest_bytes, fsync=self.fsync)
            (self.staging / READY_NAME).unlink(missing_ok=True)
        except OSError as exc:
            raise_if_disk_full(exc, self.staging)
            raise
        return done

    def _open_files(self, manifest: Manifest) -> dict[str, int]:
        """A descriptor for each file of the staging directory, sized and reserved (the delta file too,
        under DELTA_NAME, when it is to be kept)."""
        fds: dict[str, int] = {}
        files = [(f.name, f.size) for f in manifest.files]
        if self.keep_delta and manifest.delta is not None:
            files.append((DELTA_NAME, manifest.delta.size))
        try:
            for name, size in files:
                path = self.staging / name
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
            raise_if_disk_full(exc, self.staging)
            raise
        return fds

    def _open_base(self, manifest: Manifest) -> dict[int, int]:
        """Shard index -> descriptor of the base file to rebuild it from, for each shard still to get that
        the manifest's delta covers and one of ``bases`` can rebuild."""
        delta = manifest.delta
        if delta is None:
            return {}
        for base in self.bases:
            if base.absolute() in (self.out_dir, self.staging) or not is_ready(base):
                continue
            try:
                held = verify_manifest((base / MANIFEST_NAME).read_bytes(), self.key)
            except (OSError, ShardcastError):
                continue
            if held.version != delta.base_version:
                continue
            if manifest_sha256(held) != delta.base_manifest_sha256:
                self._delta_problem(
                    f"{base} holds version {held.version}, but not the one the delta was made against "
                    "(its manifest differs)"
                )
                continue
            plan: dict[int, int] = {}
            for piece in delta.pieces:
                shard = manifest.shards[piece.shard]
                if piece.shard in self.done:
                    continue
                entry = held.file(shard.file)
                if entry is None or entry.size != manifest.file(shard.file).size:
                    self._delta_problem(f"the base has no {shard.file!r} of the same size (shard {piece.shard})")
                    continue
                if shard.file not in self.base_fds:
                    self.base_fds[shard.file] = os.open(base / shard.file, os.O_RDONLY)
                plan[piece.shard] = self.base_fds[shard.file]
            return plan
        return {}

    def _finish(self, manifest: Manifest, manifest_bytes: bytes, fds: dict[str, int]) -> None:
        """fsync, write the ready marker, and move the staging directory to ``out_dir`` atomically."""
        if DELTA_NAME in fds and self.pieces_kept != set(self.pieces):
            # A delta file with holes would be served as if whole: keep none rather than that.
            log.warning("not keeping the delta of version %d: %d of its %d pieces could not be had",
                        manifest.version, len(self.pieces) - len(self.pieces_kept), len(self.pieces))
            (self.staging / DELTA_NAME).unlink(missing_ok=True)
        try:
            if self.fsync:
                for fd in fds.values():
                    os.fsync(fd)
            write_file_durably(
                self.staging / READY_NAME,
                ready_marker_bytes(manifest.version, hashlib.sha256(manifest_bytes).hexdigest()),
                fsync=self.fsync,
            )
            (self.staging / JOURNAL_NAME).unlink(missing_ok=True)
            if self.fsync:
                fsync_dir(self.staging)
        except OSError as exc:
            raise_if_disk_full(exc, self.staging)
            raise
        out = self.out_dir
        old = None
        if out.is_dir():
            if any(out.iterdir()):
                old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
                os.rename(out, old)
            else:
                out.rmdir()
        os.rename(self.staging, out)
        if self.fsync:
            fsync_dir(out.parent)
        if old is not None:
            remove_tree(old)

    # ---- choosing a relay

    def _choose(self, version: int, job: _Job, tried: set[str], bad_for: set[str]) -> _Relay | None | bool:
        """A relay for ``job``; None when all candidates are busy; False when none is left untried."""
        candidates = [
            r for r in self.relays if r.serves(job, version) and r.url not in tried and r.url not in bad_for
        ]
        if not candidates:
            return False
        free = [r for r in candidates if r.inflight < self.per_relay]
        if not free:
            return None
        known = [r.ewma_bps for r in self.relays if r.ewma_bps is not None]
        prior = max(known) if known else PRIOR_BPS
        weights = [r.weight(prior) for r in free]
        return random.choices(free, weights=weights)[0]

    # ---- one shard

    def _failure_of(self, exc: BaseException) -> _Failure:
        """A client error of a ranged download (``_CLIENT_ERRORS``) as the failure it counts as."""
        if isinstance(exc, TimeoutError):  # also aiohttp's ServerTimeoutError (connect or read)
            return _Failure("timeout", f"{_describe(exc)} (read timeout {self.timeout.sock_read} s)")
        if isinstance(exc, aiohttp.ClientPayloadError):
            return _Failure("truncated", _describe(exc))
        return _Failure(_kind_of(exc), _describe(exc), connection=_is_connection(exc))

    async def _download(
        self, relay: _Relay, manifest: Manifest, shard: ShardEntry, fd: int, counted: list[int]
    ) -> None:
        entry = manifest.file(shard.file)
        url = f"{relay.url}/versions/{manifest.version}/files/{quote(shard.file)}"
        headers = {"Range": f"bytes={shard.offset}-{shard.end - 1}", "Accept-Encoding": "identity"}
        loop = asyncio.get_running_loop()
        try:
            async with self.session.get(url, headers=headers, timeout=self.timeout) as resp:
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
                        self._advance(len(piece))
                        if pos - written >= CHUNK or pos == shard.size:
                            if pending is not None:
                                await pending
                            pending = loop.run_in_executor(
                                None, _hash_and_write, hasher, fd, pieces, shard.offset + written
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
            raise self._failure_of(exc) from exc
        except OSError as exc:  # from our own writes
            raise_if_disk_full(exc, self.staging / shard.file)
            raise

    async def _download_piece(self, relay: _Relay, manifest: Manifest, piece: DeltaPiece) -> bool:
        """Get delta piece ``piece`` intact, keep it (``keep_delta``) and rebuild its shard if planned.

        Returns True when the shard was rebuilt. A relay that sends other bytes is a _Failure (bad); a
        piece that arrives intact but does not rebuild its shard is a DeltaError (not the relay's fault).
        """
        url = f"{relay.url}/versions/{manifest.version}/delta"
        headers = {"Range": f"bytes={piece.offset}-{piece.end - 1}", "Accept-Encoding": "identity"}
        try:
            async with self.session.get(url, headers=headers, timeout=self.timeout) as resp:
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
            raise self._failure_of(exc) from exc
        data = b"".join(parts)
        digest = hashlib.sha256(data).hexdigest()
        if digest != piece.sha256:
            raise _Failure(
                "hash-mismatch", f"delta piece sha256 {digest[:16]}… instead of {piece.sha256[:16]}…", bad=True
            )
        relay.record_success(piece.size, time.monotonic() - t0)
        self.delta_bytes += piece.size
        loop = asyncio.get_running_loop()
        try:
            if self.keep_delta:
                await loop.run_in_executor(None, _write_at, self.delta_fd, [data], piece.offset)
                self.pieces_kept.add(piece.shard)
                if self.on_verified is not None:
                    self.on_verified(DELTA_NAME, piece.offset, piece.size)
            if piece.shard not in self.rebuild or piece.shard in self.done:
                return False
            shard = manifest.shards[piece.shard]
            digest = await loop.run_in_executor(
                None, rebuild_shard, data, self.rebuild[piece.shard], self.fds[shard.file], shard.offset, shard.size
            )
        except OSError as exc:
            raise_if_disk_full(exc, self.staging)
            raise
        if digest != shard.sha256:
            raise DeltaError(
                f"the rebuilt bytes hash {digest[:16]}…, the manifest says {shard.sha256[:16]}…: the base on disk "
                "is not the base the delta was made against"
            )
        return True

    def _advance(self, n: int) -> None:
        self.done_bytes += n
        if self._bar is not None:
            self._bar[0].update(self._bar[1], advance=n)
        if self.on_progress is not None:
            self.on_progress(self.done_bytes, self.total_bytes)

    # ---- the whole download

    async def _download_all(self, manifest: Manifest, fds: dict[str, int], todo: list[_Job]) -> int:
        """Run the jobs in ``todo`` (and the whole-shard jobs that failed pieces turn into); returns how
        many bytes of whole shards were accepted."""
        version = manifest.version
        pending: list[_Job] = []
        tried: dict[_Job, set[str]] = {}
        bad_for: dict[_Job, set[str]] = {}
        attempts: dict[_Job, int] = {}
        rounds: dict[_Job, int] = {}
        busy: dict[_Job, int] = {}
        retry_at: dict[_Job, float] = {}

        def add(job: _Job) -> None:
            pending.append(job)
            tried[job], bad_for[job] = set(), set()
            attempts[job] = rounds[job] = busy[job] = 0

        def give_up_piece(job: _Job, why: str) -> None:
            pending.remove(job)
            self._delta_problem(f"delta piece for shard {job.shard}: {why}")
            if job.shard in self.rebuild and job.shard not in self.done:
                add(_Job(SHARD, job.shard))

        for job in todo:
            add(job)
        active: dict[asyncio.Task, tuple[_Job, _Relay, list[int]]] = {}
        accepted = 0
        probing: asyncio.Future | None = None
        last_probe = time.monotonic()
        try:
            while pending or active:
                now = time.monotonic()
                latecomers = [r for r in self.relays if r.reachable and version not in r.holds]
                if latecomers and (probing is None or probing.done()) and now - last_probe >= REPROBE_S:
                    probing = asyncio.gather(*(self._probe(r) for r in latecomers))
                    last_probe = now
                launched = True
                while launched and len(active) < self.concurrency:
                    launched = False
                    for job in pending:
                        if retry_at.get(job, 0.0) > now:
                            continue
                        choice = self._choose(version, job, tried[job], bad_for[job])
                        if choice is False:
                            if not any(r.has(version) for r in self.relays):
                                self._raise_nothing_left(version)
                            honest = [r for r in self.relays if r.serves(job, version) and r.url not in bad_for[job]]
                            if job.kind == PIECE and (not honest or attempts[job] >= self.max_attempts):
                                give_up_piece(job, "no relay served it intact")
                                launched = True
                                break
                            if not honest or attempts[job] >= self.max_attempts:
                                self._raise_unavailable(manifest, job.shard, attempts[job])
                            rounds[job] += 1
                            tried[job] = set()
                            retry_at[job] = now + min(5.0, 0.25 * 2 ** (rounds[job] - 1))
                            continue
                        if choice is None:
                            continue
                        pending.remove(job)
                        choice.inflight += 1
                        attempts[job] += 1
                        shard = manifest.shards[job.shard]
                        counted = [0]  # bytes counted in the progress so far (pieces count once rebuilt)
                        if job.kind == PIECE:
                            work = self._download_piece(choice, manifest, self.pieces[job.shard])
                        else:
                            work = self._download(choice, manifest, shard, fds[shard.file], counted)
                        active[asyncio.create_task(work)] = (job, choice, counted)
                        launched = True
                        break
                if not active:
                    if not pending:
                        break
                    wait = max(0.0, min(retry_at.get(j, now) for j in pending) - time.monotonic())
                    await asyncio.sleep(min(wait, 5.0) if wait > 0 else 0.05)
                    continue
                future_retries = [t for j in pending if (t := retry_at.get(j, 0.0)) > now]
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
                        if job.kind == SHARD:
                            accepted += shard.size
                            self.shards_fetched += 1
                            self._mark_done(job.shard)
                        elif task.result():  # the piece rebuilt its shard
                            self.shards_rebuilt += 1
                            self._advance(shard.size)
                            self._mark_done(job.shard)
                        continue
                    if isinstance(exc, DeltaError):
                        # The piece arrived intact (its hash is the manifest's), so the relay is not at fault:
                        # the delta or our base is. The shard comes whole instead.
                        self._delta_problem(f"shard {job.shard}: {exc}")
                        if job.shard not in self.done:
                            add(_Job(SHARD, job.shard))
                        continue
                    if not isinstance(exc, _Failure):
                        raise exc
                    self._advance(-counted[0])  # the progress counted bytes that were thrown away
                    self._report(relay, exc.kind, job.shard, exc.detail, bad=exc.bad)
                    if exc.retry_after is not None and busy[job] < MAX_BUSY_WAITS:
                        # Busy (its slots, or this address's share of them, are taken): not a failure of the
                        # relay or the shard. Come back when it says, with jitter so a crowd spreads out.
                        busy[job] += 1
                        attempts[job] -= 1
                        retry_at[job] = time.monotonic() + exc.retry_after * random.uniform(1.0, 1.5)
                        pending.insert(0, job)
                        continue
                    if exc.connection:
                        relay.consecutive_conn_failures += 1
                        if relay.consecutive_conn_failures >= 3:
                            relay.stats.reachable = False
                            log.warning("relay %s stopped answering; no longer used", relay.url)
                    tried[job].add(relay.url)
                    if exc.bad:
                        bad_for[job].add(relay.url)
                    pending.insert(0, job)
        finally:
            for task in active:
                task.cancel()
            if probing is not None:
                probing.cancel()
            await asyncio.gather(*active, *([probing] if probing is not None else []), return_exceptions=True)
        return accepted

    def _delta_problem(self, why: str) -> None:
        self.delta_problems.append(why)
        log.warning("delta not used: %s; fetching whole instead", why)

    def _raise_nothing_left(self, version: int) -> None:
        if any(version in r.gone for r in self.relays):
            raise VersionGoneError(
                f"version {version} disappeared from every relay during the fetch (pruned); fetch a newer one"
            )
        raise NoRelayReachableError(
            f"every relay holding version {version} stopped answering during the fetch; run again to resume"
        )

    def _raise_unavailable(self, manifest: Manifest, idx: int, attempts: int) -> None:
        shard = manifest.shards[idx]
        recent = [f"{i.relay}: {i.kind} ({i.detail})" for i in self.bad + self.failures if i.shard == idx][
            -6:
        ]
        raise ShardUnavailableError(
            f"shard {idx} ({shard.file} @ {shard.offset}, {shard.size} bytes) failed {attempts} times on every "
            f"relay holding version {manifest.version}: {'; '.join(recent)}. Run again to resume, or add relays"
        )

    def _mark_done(self, idx: int) -> None:
        self.done.add(idx)
        shard = self.manifest.shards[idx]
        if self.fsync:
            self._sync_in_background(shard)
        try:
            os.write(self.journal_fd, f"{idx}\n".encode())
        except OSError as exc:
            raise_if_disk_full(exc, self.staging / JOURNAL_NAME)
            raise
        self.file_event.set()
        if self.swarm is not None:
            self.swarm.serve_shard(self.staging, self.manifest, idx)
        if self.on_verified is not None:
            self.on_verified(shard.file, shard.offset, shard.size)

    def _sync_in_background(self, shard: ShardEntry) -> None:
        # Flushing as we go keeps the final fsync (before the ready marker) short: the disk writes
        # overlap the download instead of following it.
        name = shard.file
        self._unsynced[name] = self._unsynced.get(name, 0) + shard.size
        if self._unsynced[name] < SYNC_EVERY or name in self._syncing:
            return
        self._unsynced[name] = 0
        self._syncing.add(name)
        future = asyncio.get_running_loop().run_in_executor(None, os.fdatasync, self.fds[name])
        self._sync_futures.add(future)

        def done(f: asyncio.Future) -> None:
            self._syncing.discard(name)
            self._sync_futures.discard(f)
            f.exception()  # errors surface in the final fsync; do not warn about an unretrieved one

        future.add_done_callback(done)

    async def _hash_files(self, manifest: Manifest, fds: dict[str, int]) -> dict[str, str]:
        """Hash each file in order as its shards complete; returns name -> sha256 hex."""
        loop = asyncio.get_running_loop()
        order = {f.name: [s.index for s in manifest.shards_of(f.name)] for f in manifest.files}
        hashers = {name: hashlib.sha256() for name in order}
        nxt = dict.fromkeys(order, 0)
        while True:
            progressed = False
            for name, idxs in order.items():
                while nxt[name] < len(idxs) and idxs[nxt[name]] in self.done:
                    s = manifest.shards[idxs[nxt[name]]]
                    await loop.run_in_executor(None, _hash_range, hashers[name], fds[name], s.offset, s.size)
                    nxt[name] += 1
                    progressed = True
            if all(nxt[n] == len(i) for n, i in order.items()):
                return {name: h.hexdigest() for name, h in hashers.items()}
            if not progressed:
                await self.file_event.wait()
                self.file_event.clear()

    async def _find_bad_shards(
        self, manifest: Manifest, fds: dict[str, int], names: list[str], only: set[int] | None = None
    ) -> list[int]:
        """The shards of files ``names`` (restricted to ``only``) whose bytes on disk hash wrong."""
        loop = asyncio.get_running_loop()
        bad = []
        for name in names:
            for s in manifest.shards_of(name):
                if only is not None and s.index not in only:
                    continue
                digest = await loop.run_in_executor(None, _sha256_range, fds[name], s.offset, s.size)
                if digest != s.sha256:
                    bad.append(s.index)
        return bad

    async def run(self) -> FetchResult:
        t0 = time.monotonic()
        self._bar = None
        if self.own_session:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency + len(self.relays) + 4),
                auto_decompress=False,
                trust_env=False,
            )
        try:
            self._check_out_dir()
            manifest, manifest_bytes = await self._resolve()
            stats = {r.url: r.stats for r in self.relays}
            if self._already_present(manifest):
                return FetchResult(
                    manifest.version, self.out_dir, manifest, True, 0, 0, 0, 0,
                    time.monotonic() - t0, self.bad, self.failures, stats,
                )  # fmt: skip
            return await self._fetch(manifest, manifest_bytes, t0, stats)
        finally:
            if self.own_session and self.session is not None:
                await self.session.close()

    async def _fetch(self, manifest: Manifest, manifest_bytes: bytes, t0: float, stats) -> FetchResult:
        loop = asyncio.get_running_loop()
        reused = await loop.run_in_executor(None, self._prepare_staging, manifest, manifest_bytes)
        fds = await loop.run_in_executor(None, self._open_files, manifest)
        if reused:
            # The journal of an interrupted run is only a hint: re-hash what it claims before trusting it.
            names = [f.name for f in manifest.files]
            reused -= set(await self._find_bad_shards(manifest, fds, names, only=reused))
        self.done: set[int] = set(reused)
        self.manifest, self.fds = manifest, fds
        self.delta_fd = fds.get(DELTA_NAME)
        self.pieces = {p.shard: p for p in manifest.delta.pieces} if manifest.delta is not None else {}
        self.base_fds: dict[str, int] = {}
        self.shards_fetched = 0
        self._unsynced: dict[str, int] = {}
        self._syncing: set[str] = set()
        self._sync_futures: set[asyncio.Future] = set()
        self.file_event = asyncio.Event()
        self.total_bytes = manifest.total_size
        reused_bytes = sum(manifest.shards[i].size for i in reused)
        self.done_bytes = reused_bytes
        progress_ctx = contextlib.nullcontext()
        if self.show_progress:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            bar = Progress(
                TextColumn(f"version {manifest.version}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._bar = (bar, bar.add_task("fetch", total=manifest.total_size, completed=reused_bytes))
            progress_ctx = bar
        downloaded = 0
        try:
            self.rebuild = await loop.run_in_executor(None, self._open_base, manifest)
            if self.on_staged is not None:
                self.on_staged(manifest, manifest_bytes, self.staging)
            if self.on_verified is not None:
                for shard in (manifest.shards[i] for i in self.done):
                    self.on_verified(shard.file, shard.offset, shard.size)
            self.journal_fd = os.open(
                self.staging / JOURNAL_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
            )
            with progress_ctx:
                todo = [_Job(PIECE if s.index in self.rebuild else SHARD, s.index)
                        for s in manifest.shards if s.index not in self.done]  # fmt: skip
                if self.delta_fd is not None:
                    # A mirror keeps every piece, to serve them in turn; first, since they are small and the
                    # nodes downstream that hold the base ask for them before anything else.
                    todo = [_Job(PIECE, i) for i in self.pieces if i not in self.rebuild] + todo
                for _repair in range(2):
                    hashing = (
                        asyncio.create_task(self._hash_files(manifest, fds)) if self.verify_files else None
                    )
                    try:
                        downloaded += await self._download_with_peers(manifest, fds, todo)
                        digests = await hashing if hashing is not None else None
                    finally:
                        if hashing is not None and not hashing.done():
                            hashing.cancel()
                            with contextlib.suppress(BaseException):
                                await hashing
                    if digests is None:
                        break
                    wrong = [f.name for f in manifest.files if digests[f.name] != f.sha256]
                    if not wrong:
                        break
                    # Only possible when the bytes read back differ from the bytes hashed on arrival (the
                    # disk, or memory, changed them): find those shards and fetch them again.
                    log.warning("files %s hash wrong on disk; rechecking their shards", wrong)
                    bad = await self._find_bad_shards(manifest, fds, wrong)
                    self.done -= set(bad)
                    reused_bytes -= sum(manifest.shards[i].size for i in bad if i in reused)
                    reused -= set(bad)
                    todo = [_Job(SHARD, i) for i in bad]
                else:
                    raise ShardUnavailableError(
                        f"files {wrong} still hash wrong after refetching their shards: the disk under "
                        f"{self.staging} may be failing"
                    )
                await loop.run_in_executor(None, self._finish, manifest, manifest_bytes, fds)
                if self.swarm is not None:
                    self.swarm.serve(self.out_dir, manifest)
        finally:
            with contextlib.suppress(OSError, AttributeError):
                os.close(self.journal_fd)
            if self._sync_futures:  # never close a file descriptor a worker thread still syncs
                await asyncio.gather(*list(self._sync_futures), return_exceptions=True)
            for fd in [*fds.values(), *self.base_fds.values()]:
                os.close(fd)
        seconds = time.monotonic() - t0
        log.info(
            "fetched version %d into %s: %d bytes downloaded, %d of delta (%d shards rebuilt), %d reused, "
            "%.2f s, bad relays: %s",
            manifest.version, self.out_dir, downloaded, self.delta_bytes, self.shards_rebuilt, reused_bytes,
            seconds, sorted({i.relay for i in self.bad}) or "none",
        )  # fmt: skip
        return FetchResult(
            version=manifest.version,
            path=self.out_dir,
            manifest=manifest,
            already_present=False,
            bytes_downloaded=downloaded,
            bytes_reused=reused_bytes,
            shards_downloaded=self.shards_fetched,
            shards_reused=len(reused),
            seconds=seconds,
            bad_relays=list(self.bad),
            failures=list(self.failures),
            relays=stats,
            delta_bytes=self.delta_bytes,
            shards_rebuilt=self.shards_rebuilt,
            delta_problems=list(self.delta_problems),
            bytes_from_peers=self.bytes_from_peers,
            shards_from_peers=self.shards_from_peers,
            bad_peers=list(self.bad_peers),
        )

    # ---- peers of the swarm

    async def _download_with_peers(self, manifest: Manifest, fds: dict[str, int], todo: list[_Job]) -> int:
        """Peers first, relays for what no peer holds (module docstring); returns bytes of whole shards accepted."""
        if self.swarm is None:
            return await self._download_all(manifest, fds, todo)
        ids = self.peer_ids if self.peer_ids is not None else self.swarm.peers_for(manifest.version)
        peers = [_Peer(p) for p in dict.fromkeys(ids)]
        if not peers:
            return await self._download_all(manifest, fds, todo)
        accepted = 0
        pieces = [j for j in todo if j.kind != SHARD]
        if pieces:  # delta pieces come from relays only; a shard whose piece fails joins the swarm's part below
            accepted += await self._download_all(manifest, fds, pieces)
        remaining = {j.shard for j in todo if j.kind == SHARD} - self.done
        if remaining:
            before = self.bytes_from_peers
            accepted += await _SwarmSchedule(self, manifest, fds, peers, remaining).run()
            accepted += self.bytes_from_peers - before
        return accepted

    async def _ask_peer(self, manifest: Manifest, peer: _Peer) -> None:
        """Refresh ``peer.held`` with what it says it holds (a claim: what it sends is hashed)."""
        try:
            peer.held = await self.swarm.shards_held_by(peer.peer_id, manifest)
            peer.heard = True
        except PeerError as exc:
            self._report_peer(peer, exc, None)

    async def _shard_from_peer(self, manifest: Manifest, fds: dict[str, int], idx: int, peer: _Peer) -> None:
        """Get shard ``idx`` from ``peer``; a failure is reported and leaves the shard to the schedule."""
        shard = manifest.shards[idx]
        t0 = time.monotonic()
        try:
            data = await self.swarm.fetch_shard(peer.peer_id, shard.sha256, shard.size)
        except PeerError as exc:
            self._report_peer(peer, exc, idx)
            return
        peer.record_success(shard.size, time.monotonic() - t0)
        try:
            await asyncio.get_running_loop().run_in_executor(None, _write_at, fds[shard.file], [data], shard.offset)
        except OSError as exc:
            raise_if_disk_full(exc, self.staging / shard.file)
            raise
        self.bytes_from_peers += shard.size
        self.shards_from_peers += 1
        self._advance(shard.size)
        self._mark_done(idx)

    def _report_peer(self, peer: _Peer, exc: PeerError, shard: int | None) -> None:
        incident = RelayIncident(peer.peer_id, str(exc.reason), shard, exc.detail)
        peer.heard = True
        if isinstance(exc, BadPeerError):
            peer.skip = True
            self.bad_peers.append(incident)
            log.warning("peer %s served bad data (%s, shard %s): %s; banned", peer.peer_id, exc.reason, shard,
                        exc.detail)
            return
        now = time.monotonic()
        if exc.reason == "refused":
            # Busy or rate-limited: we asked more at once than it allows. Ask fewer at once and come back soon;
            # the shard waits for it, not the origin.
            peer.window = max(1.0, peer.inflight - 1)
            peer.ready_at = max(peer.ready_at, now + PEER_BUSY_WAIT_S * random.uniform(0.5, 1.5))
            return
        # Unreachable (a dial storm at the start of a broadcast times out many dials), stalled, cut off, or it
        # lied about what it holds: back off, doubling, and drop it for this fetch after a few in a row.
        # A peer the coordinator did not announce, or one banned meanwhile, is dropped at once.
        peer.strikes += 1
        if shard is not None:
            peer.held.discard(shard)
        if isinstance(exc, PeerNotAnnouncedError) or exc.reason == Refusal.BANNED or peer.strikes >= MAX_PEER_STRIKES:
            peer.skip = True
        peer.ready_at = now + PEER_BACKOFF_S * 2 ** (peer.strikes - 1)
        self.failures.append(incident)
        log.info("peer %s failed (%s, shard %s): %s%s", peer.peer_id, exc.reason, shard, exc.detail,
                 "; dropped for this fetch" if peer.skip else "")


class _SwarmSchedule:
    """Which shard to ask of which peer, and which ones the relays must serve, for one fetch.

    Like BitTorrent: each peer is asked at most as many shards at once as it serves to one peer (less one
    stream, kept for ``HAVE``), the rarest offered shard first; a busy peer is waited for. The relays (the
    origin among them) serve only what no live peer holds: at once, this node's stripe (its share of the
    shards, by its rank among the peers, so that nodes fetching together each take different shards from
    the origin and then trade them); another node's stripe once that node has had ``patience`` times its
    distance in the ring of ranks to fetch it (patience: twice what this node's own stripe took), so that a
    node that dropped out costs about one more copy of its stripe, not one per node; and, when no peer has
    delivered a shard for long (``stuck_s``, from the peers' measured throughput), a batch of whatever is
    left. With no live peer left, the relays serve everything.
    """

    def __init__(self, fetch: _Fetch, manifest: Manifest, fds: dict[str, int], peers: list[_Peer],
                 remaining: set[int]):
        self.fetch, self.manifest, self.fds, self.peers, self.remaining = fetch, manifest, fds, peers, remaining
        swarm = fetch.swarm
        self.per_peer = max(1, swarm.limits.max_streams_per_peer - 1)
        self.stream_timeout_s = swarm.limits.stream_timeout_s
        everyone = sorted({*(p.peer_id for p in peers), swarm.peer_id})
        n, ranks, rank = len(manifest.shards), len(everyone), everyone.index(swarm.peer_id)
        # Stripe k is shards [k*n//ranks, (k+1)*n//ranks): every shard is in exactly one node's stripe.
        self.distance = {i: (rank - k) % ranks for k in range(ranks) for i in range(k * n // ranks, (k + 1) * n // ranks)}
        own = [i for i in remaining if self.distance[i] == 0]
        self.relay_s: float | None = None if own else 0.0  # how long this node's stripe took from the relays
        self.t0 = self.last_progress = time.monotonic()

    async def run(self) -> int:
        """Until every remaining shard is done; returns bytes the relays served."""
        fetch, accepted = self.fetch, 0
        shard_tasks: dict[asyncio.Task, int] = {}
        ask_tasks: dict[asyncio.Task, _Peer] = {}
        relay_task: asyncio.Task | None = None
        relay_batch: list[int] = []
        last_ask = -PEER_ASK_EVERY_S
        try:
            while self.remaining - fetch.done:
                now = time.monotonic()
                live = [p for p in self.peers if not p.skip]
                wanted = self.remaining - fetch.done - set(relay_batch) - set(shard_tasks.values())
                asking = set(ask_tasks.values())
                if now - last_ask >= PEER_ASK_EVERY_S and len(shard_tasks) < fetch.concurrency:
                    last_ask = now
                    for p in live:  # one that already offers all we want has nothing to add
                        if p not in asking and p.ready_at <= now and not wanted <= p.held:
                            ask_tasks[asyncio.create_task(fetch._ask_peer(self.manifest, p))] = p
                holders = {i: [p for p in live if i in p.held] for i in wanted}
                if relay_task is None:
                    relay_batch = self._relay_batch(now, live, holders)
                    if relay_batch:
                        relay_task = asyncio.create_task(
                            fetch._download_all(self.manifest, self.fds, [_Job(SHARD, i) for i in relay_batch]))
                        wanted -= set(relay_batch)
                for i in sorted((i for i in wanted if holders[i]), key=lambda i: (len(holders[i]), random.random())):
                    if len(shard_tasks) >= fetch.concurrency:
                        break
                    free = [p for p in holders[i] if p.inflight < self._cap(p) and p.ready_at <= now]
                    if free:
                        peer = random.choices(free, weights=[p.weight(self._prior_bps()) for p in free])[0]
                        task = asyncio.create_task(fetch._shard_from_peer(self.manifest, self.fds, i, peer))
                        peer.inflight += 1  # counted now, so this pass does not give the peer more than it allows
                        task.add_done_callback(lambda _t, p=peer: setattr(p, "inflight", p.inflight - 1))
                        shard_tasks[task] = i
                # Look again when a task ends, a busy or backing-off peer may be asked again, or it is time to ask.
                wake_s = min([PEER_ASK_EVERY_S, *(p.ready_at - now for p in live if p.ready_at > now)])
                pending = [*shard_tasks, *ask_tasks, *([relay_task] if relay_task is not None else [])]
                if not pending:
                    await asyncio.sleep(wake_s)
                    continue
                finished, _ = await asyncio.wait(pending, timeout=wake_s, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    if task is relay_task:
                        accepted += task.result()  # what the relays could not serve ends the fetch, as without peers
                        if self.relay_s is None:
                            self.relay_s = time.monotonic() - self.t0
                        relay_task, relay_batch = None, []
                        self.last_progress = time.monotonic()
                        continue
                    task.result()  # a peer's failure is handled inside; anything else (disk full) ends the fetch
                    if shard_tasks.pop(task, None) in fetch.done:
                        self.last_progress = time.monotonic()
                    ask_tasks.pop(task, None)
        finally:
            leftover = [*shard_tasks, *ask_tasks, *([relay_task] if relay_task is not None else [])]
            for task in leftover:
                task.cancel()
            await asyncio.gather(*leftover, return_exceptions=True)
        return accepted

    def _cap(self, peer: _Peer) -> int:
        """Shards to ask of ``peer`` at once: what it allows one peer, less the stream kept for HAVE, or less
        once it answered BUSY."""
        return self.per_peer if peer.window is None else min(self.per_peer, int(peer.window))

    def _prior_bps(self) -> float:
        known = [p.ewma_bps for p in self.peers if p.ewma_bps is not None]
        return max(known) if known else PRIOR_BPS

    def _relay_batch(self, now: float, live: list[_Peer], holders: dict[int, list[_Peer]]) -> list[int]:
        """The shards to take from the relays now (class docstring), at most ``concurrency``."""
        limit = self.fetch.concurrency
        if not live:
            return sorted(holders, key=lambda i: self.distance[i])[:limit]
        if not all(p.heard for p in live):  # first learn what the peers hold
            return []
        own_s = self.relay_s if self.relay_s is not None else now - self.t0
        patience = max(MIN_PATIENCE_S, 2 * own_s)
        due = [i for i, hs in holders.items() if not hs and now - self.t0 >= self.distance[i] * patience]
        if due:
            return sorted(due, key=lambda i: self.distance[i])[:limit]
        known = [p.ewma_bps for p in live if p.ewma_bps is not None]
        shard_s = max(s.size for s in self.manifest.shards) / (sum(known) / len(known)) if known else 0.0
        stuck_s = max(2 * self.stream_timeout_s, 4 * shard_s)
        if holders and now - self.last_progress > stuck_s:
            self.last_progress = now
            return sorted(holders, key=lambda i: (len(holders[i]), self.distance[i]))[:limit]
        return []


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body, or a _Failure when it is longer than ``cap`` (a relay must not make us buffer more)."""
    if resp.content_length is not None and resp.content_length > cap:
        raise _Failure("too-large", f"body of {resp.content_length} bytes, more than {cap}")
    parts, size = [], 0
    while chunk := await resp.content.read(65536):
        size += len(chunk)
        if size > cap:
            raise _Failure("too-large", f"body longer than {cap} bytes")
        parts.append(chunk)
    return b"".join(parts)


_CLIENT_ERRORS = (TimeoutError, aiohttp.ClientError)


def _check_range(resp: aiohttp.ClientResponse, start: int, end: int, what: str) -> None:
    """A 206 answer covers exactly bytes ``start..end-1``, or the relay is bad."""
    m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
    if not m or (int(m.group(1)), int(m.group(2))) != (start, end - 1):
        raise _Failure("wrong-length", f"asked {what} {start}-{end - 1}, got Content-Range "
                       f"{resp.headers.get('Content-Range')!r}", bad=True)


def _kind_of(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "truncated"
    return "connection"


def _is_connection(exc: BaseException) -> bool:
    return isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(exc, aiohttp.ServerTimeoutError)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _load_key(key: PublicKey | str | os.PathLike) -> PublicKey:
    if isinstance(key, PublicKey):
        return key
    try:
        return load_public_key(key)
    except KeyFileError as exc:
        raise ManifestSignatureError(f"cannot load the coordinator key: {exc}") from exc


def _parse_version(version: int | str) -> int | str:
    if version == "latest":
        return version
    if isinstance(version, int) and not isinstance(version, bool) and version >= 0:
        return version
    if isinstance(version, str) and version.isdigit():
        return int(version)
    raise ValueError(f"version must be a non-negative integer or 'latest', got {version!r}")


async def fetch_version(
    relays: Sequence[str],
    coordinator_key: PublicKey | str | os.PathLike,
    out_dir: str | os.PathLike,
    version: int | str = "latest",
    *,
    min_version: int | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    per_relay: int = DEFAULT_PER_RELAY,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    read_timeout: float = DEFAULT_READ_TIMEOUT,
    max_attempts: int | None = None,
    fsync: bool = True,
    verify_files: bool = False,
    progress: bool | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    session: aiohttp.ClientSession | None = None,
    bases: Sequence[str | os.PathLike] = (),
    keep_delta: bool = False,
    on_staged: Callable[[Manifest, bytes, Path], None] | None = None,
    on_verified: Callable[[str, int, int], None] | None = None,
    swarm: Swarm | None = None,
    peers: Sequence[str] | None = None,
) -> FetchResult:
    """Fetch ``version`` (an integer, or ``"latest"``) from ``relays`` into ``out_dir``, verified.

    ``coordinator_key`` is the PublicKey the manifest must be signed by, or the path of its ``.pub``
    file. ``out_dir`` becomes the checkpoint directory (HF files plus the manifest and ready marker);
    it must be new, empty, or an earlier shardcast checkpoint, which is replaced atomically.
    ``min_version`` refuses anything older when asking for ``latest`` (a relay cannot pass an old
    version off as the newest one if the caller knows how new it must be). ``concurrency`` shards
    download at once, at most ``per_relay`` from one relay. ``read_timeout`` is how long a connection
    may stay silent before the download is abandoned and retried elsewhere. ``progress``: a rich
    progress bar on stderr (None: only when stderr is a terminal). ``on_progress(done, total)`` is
    called with byte counts as data arrives. ``fsync`` (default) flushes every file to disk before the
    ready marker is written, so a power loss cannot leave a ready checkpoint with lost bytes; turn it
    off only for throwaway copies. ``verify_files`` re-reads and hashes whole files too (see the
    module docstring for why the shard hashes already prove them). ``bases``: checkpoint directories
    the caller holds (earlier fetches); when the manifest has a delta against one of them, the shards it
    covers are rebuilt from it (module docstring). ``keep_delta`` keeps the delta's pieces in the
    checkpoint too, for a relay to serve. ``on_staged(manifest, manifest_bytes, staging_dir)`` is called
    once the staging directory is set up, and ``on_verified(name, offset, size)`` each time bytes of a
    file there (a shard, or a piece of the delta file) are written and verified: a relay serves them
    from then on, before the version is whole. ``swarm``: a started Swarm to fetch shards from peers first
    (module docstring) and to serve them from; ``peers``: the peer ids to ask (default: the swarm's
    announced peers holding the version).

    Returns a FetchResult; raises NoRelayReachableError, ManifestSignatureError, VersionGoneError,
    ShardUnavailableError, ManifestError, DiskFullError or OutputDirError. A failed fetch never leaves
    ``out_dir`` marked ready with anything but a complete, verified checkpoint; run it again to resume.
    """
    fetch = _Fetch(
        relays,
        _load_key(coordinator_key),
        Path(out_dir).absolute(),
        _parse_version(version),
        min_version=min_version,
        concurrency=concurrency,
        per_relay=per_relay,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_attempts=max_attempts,
        fsync=fsync,
        verify_files=verify_files,
        progress=progress,
        on_progress=on_progress,
        session=session,
        bases=bases,
        keep_delta=keep_delta,
        on_staged=on_staged,
        on_verified=on_verified,
        swarm=swarm,
        peers=peers,
    )
    return await fetch.run()


def fetch_version_sync(*args, **kwargs) -> FetchResult:
    """:func:`fetch_version` for code without an event loop (same arguments, same errors)."""
    return asyncio.run(fetch_version(*args, **kwargs))
