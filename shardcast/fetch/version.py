"""Fetching one version: the steps in order, the state they share, and the public entry points.

``fetch_version`` (async) and ``fetch_version_sync`` do, in order:

1. ask every relay for ``GET /status`` and pick the version and its manifest (``resolve.py``);
2. set up the staging directory, reusing the shards an interrupted earlier run finished
   (``staging.py``), and plan which shards to rebuild from a base the caller holds (``rebuild.py``);
3. download the rest in parallel from the relays (``download.py``), or from peers of the swarm first
   (``peers.py``), each shard checked as it arrives;
4. when every shard is in, fsync, write the ready marker, and rename the staging directory to
   ``out_dir`` in one step (``staging.py``).

Why every file hashes right without a second pass over it: the manifest is signed, its shards cover
each file exactly (no gap, no overlap: ``validate_manifest``), and each shard's bytes are hashed in
memory and written at their offset in the same step, so the file on disk is the concatenation of
verified shards. Reading the file back to hash it again would read the same bytes from the page cache
and catch nothing more, at the cost of a second SHA-256 pass (on 2 cores, a third of the fetch time).
``verify_files=True`` does it anyway, in order, while the download runs (for audits, or a disk you do
not trust); a file that then hashes wrong has its bad shards fetched again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from veriroll.protos.identity import KeyFileError, PublicKey, load_public_key

from ..errors import ManifestSignatureError, ShardUnavailableError
from ..manifest import Manifest
from ..store import DELTA_NAME
from . import staging as st
from .download import PIECE, SHARD, _Job
from .peers import download_with_peers
from .rebuild import open_base
from .relays import _Relay, normalize_relay_url
from .resolve import resolve, small_answer_timeout
from .results import FetchResult, RelayIncident

if TYPE_CHECKING:  # libp2p is an optional dependency: only a caller that passes a Swarm imports it
    from ..swarm.host import Swarm

log = logging.getLogger("veriroll.shardcast.fetch")

DEFAULT_CONCURRENCY = 8
DEFAULT_PER_RELAY = 2  # on loopback 2 streams beat 4; over a WAN, several relays add streams
DEFAULT_CONNECT_TIMEOUT = 5.0
DEFAULT_READ_TIMEOUT = 20.0  # seconds without a single byte before a download is abandoned


class _Fetch:
    """One call of ``fetch_version``: its settings, the relays and peers it uses, and what it has so far.

    The steps live in the modules named in the module docstring and take this object; what they share
    is here: the incidents (``report``), the progress (``advance``) and the shards done (``mark_done``).
    """

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
        self.staging = st.staging_dir(out_dir)
        self.done_bytes = 0
        self.total_bytes = 0
        self._bar = None
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
        # Set once the staging directory is ready (_fetch):
        self.manifest: Manifest | None = None
        self.fds: dict[str, int] = {}
        self.done: set[int] = set()  # shards verified and written (one set for the whole fetch: mutated in place)
        self.file_event = asyncio.Event()  # set each time a shard is done (verify_files hashes behind them)
        self.journal_fd: int | None = None
        self.syncer: st._BackgroundSync | None = None
        self.delta_fd: int | None = None
        self.pieces: dict = {}  # shard index -> its DeltaPiece
        self.rebuild: dict[int, int] = {}  # shard index -> descriptor of the base file to rebuild it from
        self.base_fds: dict[str, int] = {}
        self.shards_fetched = 0

    # ---- what the steps share

    def report(self, relay: _Relay, kind: str, shard: int | None, detail: str, *, bad: bool) -> None:
        """Note what ``relay`` did wrong: ``bad`` data (it is avoided from then on), or a failure."""
        incident = RelayIncident(relay.url, kind, shard, detail)
        if bad:
            relay.record_bad()
            self.bad.append(incident)
            where = f"shard {shard}" if shard is not None else "the manifest"
            log.warning("relay %s served bad data (%s, %s): %s; avoiding it", relay.url, kind, where, detail)
        else:
            relay.record_failure()
            self.failures.append(incident)
            log.info("relay %s failed (%s, shard %s): %s", relay.url, kind, shard, detail)

    def delta_problem(self, why: str) -> None:
        self.delta_problems.append(why)
        log.warning("delta not used: %s; fetching whole instead", why)

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes in the progress (negative: bytes counted and thrown away)."""
        self.done_bytes += n
        if self._bar is not None:
            self._bar[0].update(self._bar[1], advance=n)
        if self.on_progress is not None:
            self.on_progress(self.done_bytes, self.total_bytes)

    def mark_done(self, idx: int) -> None:
        """Shard ``idx`` is verified and written: journal it, and serve it (peers, a mirror's clients)."""
        self.done.add(idx)
        shard = self.manifest.shards[idx]
        if self.fsync:
            self.syncer.written(shard)
        st.note_done(self.journal_fd, self.staging, idx)
        self.file_event.set()
        if self.swarm is not None:
            self.swarm.serve_shard(self.staging, self.manifest, idx)
        if self.on_verified is not None:
            self.on_verified(shard.file, shard.offset, shard.size)

    # ---- the steps

    async def run(self) -> FetchResult:
        t0 = time.monotonic()
        if self.own_session:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency + len(self.relays) + 4),
                auto_decompress=False,
                trust_env=False,
            )
        try:
            st.check_out_dir(self.out_dir)
            manifest, manifest_bytes = await resolve(self)
            stats = {r.url: r.stats for r in self.relays}
            if st.already_present(self.out_dir, self.key, manifest):
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
        reused = await loop.run_in_executor(
            None, lambda: st.prepare_staging(self.staging, self.key, manifest, manifest_bytes, fsync=self.fsync)
        )
        fds = await loop.run_in_executor(
            None, lambda: st.open_files(self.staging, manifest, keep_delta=self.keep_delta)
        )
        if reused:
            # The journal of an interrupted run is only a hint: re-hash what it claims before trusting it.
            names = [f.name for f in manifest.files]
            reused -= set(await st.find_bad_shards(manifest, fds, names, only=reused))
        self.done = set(reused)
        self.manifest, self.fds = manifest, fds
        self.delta_fd = fds.get(DELTA_NAME)
        self.pieces = {p.shard: p for p in manifest.delta.pieces} if manifest.delta is not None else {}
        self.syncer = st._BackgroundSync(fds)
        self.total_bytes = manifest.total_size
        reused_bytes = sum(manifest.shards[i].size for i in reused)
        self.done_bytes = reused_bytes
        progress_ctx = contextlib.nullcontext()
        if self.show_progress:
            progress_ctx = self._progress_bar(manifest, reused_bytes)
        downloaded = 0
        try:
            self.rebuild = await loop.run_in_executor(None, open_base, self, manifest)
            if self.on_staged is not None:
                self.on_staged(manifest, manifest_bytes, self.staging)
            if self.on_verified is not None:
                for shard in (manifest.shards[i] for i in self.done):
                    self.on_verified(shard.file, shard.offset, shard.size)
            self.journal_fd = st.open_journal(self.staging)
            with progress_ctx:
                todo = [_Job(PIECE if s.index in self.rebuild else SHARD, s.index)
                        for s in manifest.shards if s.index not in self.done]  # fmt: skip
                if self.delta_fd is not None:
                    # A mirror keeps every piece, to serve them in turn; first, since they are small and the
                    # nodes downstream that hold the base ask for them before anything else.
                    todo = [_Job(PIECE, i) for i in self.pieces if i not in self.rebuild] + todo
                for _repair in range(2):
                    hashing = (
                        asyncio.create_task(st.hash_files(manifest, fds, self.done, self.file_event))
                        if self.verify_files
                        else None
                    )
                    try:
                        downloaded += await download_with_peers(self, manifest, fds, todo)
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
                    bad = await st.find_bad_shards(manifest, fds, wrong)
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
            if self.journal_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self.journal_fd)
            await self.syncer.wait()  # never close a file descriptor a worker thread still syncs
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

    def _progress_bar(self, manifest: Manifest, reused_bytes: int):
        """A rich progress bar on stderr, counting from the bytes reused."""
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
        return bar

    def _finish(self, manifest: Manifest, manifest_bytes: bytes, fds: dict[str, int]) -> None:
        """Drop a delta file with holes, then make the staging directory ``out_dir`` (``staging.finish``)."""
        if DELTA_NAME in fds and self.pieces_kept != set(self.pieces):
            # A delta file with holes would be served as if whole: keep none rather than that.
            log.warning("not keeping the delta of version %d: %d of its %d pieces could not be had",
                        manifest.version, len(self.pieces) - len(self.pieces_kept), len(self.pieces))
            (self.staging / DELTA_NAME).unlink(missing_ok=True)
        st.finish(self.staging, self.out_dir, manifest, manifest_bytes, fds, fsync=self.fsync)


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
