"""The relay: an aiohttp server that serves a store of signed checkpoint versions, and can mirror one.

Two modes, one server:

- **origin** (no upstreams): serves the store that ``publish`` writes into, picking up new versions
  as they are renamed into place (publish may run in another process).
- **mirror** (``upstreams`` given): every ``poll_interval`` seconds asks the upstream relays what they
  hold and fetches the newest ``keep`` versions with the same verified fetch a node uses (signature,
  every shard, every file), into a hidden directory that becomes listed only once complete. Older
  versions are pruned. Mirrors can mirror mirrors: origin → relays → relays → nodes.

Every version a relay lists has a manifest signed by the coordinator key it was started with, and files
of the sizes the manifest says; a relay never lists a version it does not hold whole.

URL scheme (all GET, HEAD too; JSON is UTF-8):

===================================  ==========================================================
``/status``                          ``{"service", "protocol", "role", "versions", "latest",
                                     "keep", "upstreams", "load": {...}, "mirror": {...}}``;
                                     ``load`` has ``active_transfers``, ``open_connections``,
                                     ``requests_total``, ``bytes_served_total``,
                                     ``busy_rejections_total``, ``send_timeouts_total``,
                                     ``uptime_s``. Not cached.
``/versions``                        ``{"versions": [N, ...], "latest": N | null}``, oldest first.
``/versions/latest/manifest``        the signed manifest of the newest version held (header
                                     ``X-Shardcast-Version: N``). Not cached.
``/versions/{N}/manifest``           the signed manifest of version N, byte for byte as published.
``/versions/{N}/files/{name}``       the bytes of file ``name`` (as listed in the manifest; ``/``
                                     allowed) of version N. ``Range: bytes=a-b`` answers 206 with
                                     just those bytes: a shard is the range (offset, offset+size-1).
===================================  ==========================================================

Versioned responses are immutable (``Cache-Control: public, max-age=31536000, immutable``), so a
plain HTTP cache in front of a relay is safe. Unknown versions and files are 404; a relay at its
transfer limit answers 503 with ``Retry-After``.

Protection against slow or silent clients: a connection that sends no complete request within
``idle_timeout`` seconds is closed (aiohttp's keep-alive timer, armed from the moment the connection is
accepted); a response that does not finish within ``send_grace + bytes / min_send_rate`` seconds is
cut off. Every transfer is its own task on one event loop, streamed with ``sendfile`` from the page
cache, so a silent client costs one socket and never delays another client; memory does not grow with
file sizes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from veriroll.protos.identity import PublicKey, load_public_key

from .errors import ShardcastError
from .fetch import fetch_version, normalize_relay_url
from .manifest import Manifest, verify_manifest
from .store import MANIFEST_NAME, list_versions, prune, remove_tree, version_dir

log = logging.getLogger("veriroll.shardcast.relay")

PROTOCOL = 1
DEFAULT_PORT = 8470
DEFAULT_KEEP = 3
DEFAULT_POLL_INTERVAL = 5.0
DEFAULT_IDLE_TIMEOUT = 15.0
DEFAULT_MIN_SEND_RATE = 256 * 1024  # bytes/s a client must keep up, on average, to keep its download
DEFAULT_SEND_GRACE = 30.0
DEFAULT_MAX_TRANSFERS = 512
IMMUTABLE = "public, max-age=31536000, immutable"
_REFRESH_EVERY = 0.5


class _FileResponseOnce(web.FileResponse):
    """A FileResponse the handler can send itself (under a deadline) before returning it.

    aiohttp calls ``prepare`` again on the returned response; FileResponse would send the file twice.
    """

    async def prepare(self, request: web.BaseRequest):
        if self.prepared:
            return self._payload_writer
        return await super().prepare(request)


@dataclass(frozen=True)
class HeldVersion:
    version: int
    manifest: Manifest
    manifest_bytes: bytes
    path: Path


class RelayServer:
    """A relay over ``store``; ``await start()``, then ``url``; ``await stop()`` when done."""

    def __init__(
        self,
        store: str | os.PathLike,
        coordinator_key: PublicKey | str | os.PathLike,
        *,
        upstreams: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        keep: int = DEFAULT_KEEP,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        min_send_rate: float = DEFAULT_MIN_SEND_RATE,
        send_grace: float = DEFAULT_SEND_GRACE,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        fetch_options: dict[str, Any] | None = None,
    ):
        self.store = Path(store)
        self.key = (
            coordinator_key if isinstance(coordinator_key, PublicKey) else load_public_key(coordinator_key)
        )
        self.upstreams = [normalize_relay_url(u) for u in upstreams]
        self.host, self.port = host, port
        self.keep = keep
        self.poll_interval = poll_interval
        self.idle_timeout = idle_timeout
        self.min_send_rate = min_send_rate
        self.send_grace = send_grace
        self.max_transfers = max_transfers
        self.fetch_options = {"progress": False, **(fetch_options or {})}
        self.held: dict[int, HeldVersion] = {}
        self._refused: dict[str, tuple[int, str]] = {}  # dir name -> (mtime_ns, why), so each is logged once
        self._last_refresh = 0.0
        self._started = time.monotonic()
        self._runner: web.AppRunner | None = None
        self._mirror_task: asyncio.Task | None = None
        self._mirror_backoff: dict[int, tuple[int, float]] = {}  # version -> (failures, retry after)
        self.mirror_fetching: int | None = None
        self.mirror_last_error: str | None = None
        self.active_transfers = 0
        self.requests_total = 0
        self.bytes_served_total = 0
        self.busy_rejections_total = 0
        self.send_timeouts_total = 0

    @property
    def role(self) -> str:
        return "mirror" if self.upstreams else "origin"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- the store

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
        except (OSError, ShardcastError) as exc:
            why = str(exc)
            log.error("not serving version %d from %s: %s", version, vdir, why)
            with contextlib.suppress(OSError):
                self._refused[vdir.name] = ((vdir / MANIFEST_NAME).stat().st_mtime_ns, why)
            return None
        return HeldVersion(version, manifest, data, vdir)

    def versions(self) -> list[int]:
        return sorted(self.held)

    def _lookup(self, which: str) -> HeldVersion:
        # Listings answer from the store as it is now (one listdir); file requests, the bulk of the
        # traffic, reuse a listing up to half a second old unless they ask for a version not yet seen.
        self.refresh(force=which == "latest")
        if which == "latest":
            if not self.held:
                raise web.HTTPNotFound(text="this relay holds no version yet\n")
            return self.held[max(self.held)]
        if not which.isdigit():
            raise web.HTTPNotFound(text="a version is an integer or 'latest'\n")
        version = int(which)
        if version not in self.held:
            self.refresh(force=True)
        if version not in self.held:
            raise web.HTTPNotFound(text=f"version {version} is not held here; see /status\n")
        return self.held[version]

    # ---- handlers

    @web.middleware
    async def _count(self, request: web.Request, handler):
        self.requests_total += 1
        return await handler(request)

    async def _status(self, request: web.Request) -> web.Response:
        self.refresh(force=True)
        versions = self.versions()
        server = self._runner.server if self._runner is not None else None
        body = {
            "service": "veriroll-shardcast-relay",
            "protocol": PROTOCOL,
            "role": self.role,
            "versions": versions,
            "latest": versions[-1] if versions else None,
            "keep": self.keep,
            "upstreams": self.upstreams,
            "load": {
                "active_transfers": self.active_transfers,
                "open_connections": len(server.connections) if server is not None else 0,
                "requests_total": self.requests_total,
                "bytes_served_total": self.bytes_served_total,
                "busy_rejections_total": self.busy_rejections_total,
                "send_timeouts_total": self.send_timeouts_total,
                "uptime_s": round(time.monotonic() - self._started, 3),
            },
            "mirror": {"fetching": self.mirror_fetching, "last_error": self.mirror_last_error},
        }
        return web.json_response(body, headers={"Cache-Control": "no-cache"})

    async def _versions(self, request: web.Request) -> web.Response:
        self.refresh(force=True)
        versions = self.versions()
        return web.json_response(
            {"versions": versions, "latest": versions[-1] if versions else None},
            headers={"Cache-Control": "no-cache"},
        )

    async def _manifest(self, request: web.Request) -> web.Response:
        which = request.match_info["version"]
        held = self._lookup(which)
        cache = "no-cache" if which == "latest" else IMMUTABLE
        self.bytes_served_total += len(held.manifest_bytes)
        return web.Response(
            body=held.manifest_bytes,
            content_type="application/json",
            headers={"Cache-Control": cache, "X-Shardcast-Version": str(held.version)},
        )

    async def _file(self, request: web.Request) -> web.StreamResponse:
        which = request.match_info["version"]
        if which == "latest":
            raise web.HTTPNotFound(text="files are addressed by version number, not 'latest'\n")
        held = self._lookup(which)
        name = request.match_info["name"]
        entry = held.manifest.file(name)  # only names the signed manifest lists: no way out of the directory
        if entry is None:
            raise web.HTTPNotFound(text=f"version {held.version} has no file {name!r}\n")
        if self.active_transfers >= self.max_transfers:
            self.busy_rejections_total += 1
            raise web.HTTPServiceUnavailable(text="relay busy, retry shortly\n", headers={"Retry-After": "1"})
        try:
            rng = request.http_range
            start = rng.start or 0
            stop = entry.size if rng.stop is None else min(rng.stop, entry.size)
            if start < 0:
                start = max(0, entry.size + start)
            nbytes = max(0, stop - start)
        except ValueError:
            nbytes = entry.size
        # FileResponse would serve a sibling "name.gz" to a client that accepts gzip: never do that.
        headers = {k: v for k, v in request.headers.items() if k.lower() != "accept-encoding"}
        request = request.clone(headers=headers)
        response = _FileResponseOnce(
            held.path / name,
            chunk_size=256 * 1024,
            headers={"Cache-Control": IMMUTABLE, "X-Shardcast-Version": str(held.version)},
        )
        deadline = self.send_grace + nbytes / self.min_send_rate
        self.active_transfers += 1
        try:
            await asyncio.wait_for(response.prepare(request), deadline)
        except TimeoutError:
            # The client reads too slowly (or not at all): drop it so its socket and slot are freed.
            self.send_timeouts_total += 1
            log.info("cut off %s: %d bytes not sent within %.1f s", request.remote, nbytes, deadline)
            if request.transport is not None:
                request.transport.close()
            return response  # already (partly) sent; aiohttp finds the connection closed and moves on
        finally:
            self.active_transfers -= 1
        if response.status in (200, 206):
            self.bytes_served_total += response.content_length or 0
        return response

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._count], client_max_size=4096)
        app.router.add_get("/status", self._status)
        app.router.add_get("/versions", self._versions)
        app.router.add_get("/versions/{version}/manifest", self._manifest)
        app.router.add_get("/versions/{version}/files/{name:.+}", self._file)
        return app

    # ---- lifecycle

    async def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        self.refresh(force=True)
        self._runner = web.AppRunner(
            self.make_app(),
            handle_signals=False,
            access_log=None,
            keepalive_timeout=self.idle_timeout,
            handler_cancellation=True,
            shutdown_timeout=5.0,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]
        log.info(
            "relay (%s) serving %s on %s, versions %s",
            self.role,
            self.store,
            self.url,
            self.versions() or "none",
        )
        if self.upstreams:
            self._mirror_task = asyncio.create_task(self._mirror_loop())

    async def stop(self) -> None:
        if self._mirror_task is not None:
            self._mirror_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._mirror_task
            self._mirror_task = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> RelayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---- mirroring

    async def _upstream_versions(self, session: aiohttp.ClientSession) -> set[int]:
        timeout = aiohttp.ClientTimeout(total=self.fetch_options.get("read_timeout", 20.0) + 5.0)

        async def one(url: str) -> list[int]:
            try:
                async with session.get(f"{url}/status", timeout=timeout) as resp:
                    if resp.status != 200:
                        return []
                    status = json.loads(await resp.read())
            except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
                log.info("upstream %s did not answer /status: %s", url, exc)
                return []
            versions = status.get("versions") if isinstance(status, dict) else None
            if not isinstance(versions, list):
                return []
            return [v for v in versions if isinstance(v, int) and not isinstance(v, bool) and v >= 0]

        results = await asyncio.gather(*(one(u) for u in self.upstreams))
        return {v for vs in results for v in vs}

    async def mirror_once(self) -> list[int]:
        """One mirroring round: fetch the newest ``keep`` upstream versions not held yet; returns those fetched."""
        async with aiohttp.ClientSession(trust_env=False) as session:
            claimed = await self._upstream_versions(session)
        now = time.monotonic()
        # Versions that failed recently wait their turn, so an upstream claiming versions it cannot back
        # with a signed manifest does not crowd out the real ones.
        usable = sorted((v for v in claimed if self._mirror_backoff.get(v, (0, 0.0))[1] <= now), reverse=True)
        self.refresh(force=True)
        held = self.versions()
        floor = held[-self.keep] if len(held) >= self.keep else -1
        wanted = [v for v in usable[: self.keep] if v not in self.held and v > floor]
        fetched = []
        for v in wanted:
            self.mirror_fetching = v
            try:
                result = await fetch_version(
                    self.upstreams, self.key, version_dir(self.store, v), v, **self.fetch_options
                )
            except ShardcastError as exc:
                failures = self._mirror_backoff.get(v, (0, 0.0))[0] + 1
                self._mirror_backoff[v] = (
                    failures,
                    time.monotonic() + min(300.0, self.poll_interval * 2**failures),
                )
                self.mirror_last_error = f"version {v}: {type(exc).__name__}: {exc}"
                log.error("mirroring version %d failed: %s", v, self.mirror_last_error)
                continue
            finally:
                self.mirror_fetching = None
            self._mirror_backoff.pop(v, None)
            self.mirror_last_error = None
            if result.bad_relays:
                log.warning("while mirroring version %d, bad upstreams: %s", v, sorted(result.bad_relay_urls))
            fetched.append(v)
            self.refresh(force=True)
        if fetched:
            prune(self.store, self.keep)
            self._remove_stale_partials()
            self.refresh(force=True)
        return fetched

    def _remove_stale_partials(self) -> None:
        held = self.versions()
        if not held:
            return
        for entry in self.store.glob(".v*.shardcast-partial"):
            number = entry.name[2:].split(".", 1)[0]
            if number.isdigit() and int(number) < held[0]:
                remove_tree(entry)

    async def _mirror_loop(self) -> None:
        while True:
            try:
                await self.mirror_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep serving whatever happens to one round
                self.mirror_last_error = f"{type(exc).__name__}: {exc}"
                log.exception("mirror round failed")
            await asyncio.sleep(self.poll_interval)


async def serve_relay(store: str | os.PathLike, coordinator_key, **options) -> None:
    """Run a relay until SIGINT or SIGTERM."""
    relay = RelayServer(store, coordinator_key, **options)
    await relay.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await relay.stop()
