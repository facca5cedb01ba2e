"""The relay: an aiohttp server that serves a store of signed checkpoint versions, and can mirror one.

Two modes, one server:

- **origin** (no upstreams): serves the store that ``publish`` writes into, picking up new versions
  as they are renamed into place (publish may run in another process).
- **mirror** (``upstreams`` given): every ``poll_interval`` seconds asks the upstream relays what they
  hold and fetches the newest ``keep`` versions with the same verified fetch a node uses (signature,
  every shard, every file; from the delta against a version it holds where there is one, keeping the
  delta to serve it in turn), into a hidden directory that is renamed into place once complete. Older
  versions are pruned. Mirrors can mirror mirrors: origin → relays → relays → nodes. ``fallbacks``
  (the origin, say) are mirrored from only for a version the upstreams have not listed for
  ``fallback_after`` seconds while a fallback has: an upstream that stopped answering, or one stuck
  behind its own, holds its subtree back that long and no longer.

**Streaming.** While a mirror fetches a version it already serves it, shard by shard: as soon as the
verified manifest is in, the version is listed under ``streaming`` in ``/status`` (not under
``versions``, which stays "held whole"), and each byte range is served once every shard (or delta
piece) under it is verified. A request for a range not verified yet waits for it, up to
``stream_wait`` seconds, then gets ``503`` with ``Retry-After`` (refusal ``not-yet``): it is coming, ask
again. So a tree of relays pipelines a version instead of adding one whole download per level.

Every version a relay lists has a manifest signed by the coordinator key it was started with; one under
``versions`` has files of the sizes the manifest says, and a relay serves no byte it has not verified.

URL scheme (all GET, HEAD too; JSON is UTF-8):

===================================  ==========================================================
``/status``                          ``{"service", "protocol", "role", "versions", "latest",
                                     "keep", "upstreams", "fallbacks", "load": {...}, "limits": {...},
                                     "mirror": {...}}``;
                                     ``load`` has ``active_transfers``, ``open_connections``,
                                     ``requests_total``, ``bytes_served_total``,
                                     ``busy_rejections_total``, ``send_timeouts_total``,
                                     ``rejections`` (by reason),
                                     ``per_address_rejections_total``, ``uptime_s``;
                                     ``limits`` has the limits below; ``streaming``: versions
                                     being mirrored and served as they arrive. Not cached.
``/versions``                        ``{"versions": [N, ...], "latest": N | null}``, oldest first.
``/versions/latest/manifest``        the signed manifest of the newest version held (header
                                     ``X-Shardcast-Version: N``). Not cached.
``/versions/{N}/manifest``           the signed manifest of version N, byte for byte as published.
``/versions/{N}/files/{name}``       the bytes of file ``name`` (as listed in the manifest; ``/``
                                     allowed) of version N. ``Range: bytes=a-b`` answers 206 with
                                     just those bytes: a shard is the range (offset, offset+size-1).
``/versions/{N}/delta``              the delta file of version N (its pieces end to end, as the
                                     manifest's ``delta`` lists them), ranges as for files; 404 where
                                     the version has no delta, or this relay does not hold it.
===================================  ==========================================================

Versioned responses are immutable (``Cache-Control: public, max-age=31536000, immutable``), so a
plain HTTP cache in front of a relay is safe. Unknown versions and files are 404.

Anyone may connect, so no client can take what the others need (``docs/relay.md`` for operators):

- **Connections.** At most ``max_connections`` in all and ``max_connections_per_address`` from one
  address (an IPv4 address, or an IPv6 /64: one subscriber's allocation). The relay accepts
  connections itself (aiohttp has no hook at accept) and closes one over either limit at once, before
  reading a byte of it.
- **Transfers.** At most ``max_transfers`` file downloads at once (beyond: 503) and
  ``max_transfers_per_address`` from one address (beyond: 429), refused before the file is opened.
  Refusals carry ``Retry-After`` and ``X-Shardcast-Refusal: <reason>``; ``/status`` counts every
  refusal by reason (``load.rejections``; the per-address ones also in
  ``load.per_address_rejections_total``).
- **Slow or silent clients.** A connection that has not sent a complete request head within
  ``idle_timeout`` seconds of being accepted or of its last answer is closed: that covers idle
  keep-alive connections and clients that send their headers a byte at a time. An answer that is not
  sent within ``send_grace + bytes / min_send_rate`` seconds is cut off and its connection dropped.
  Request lines and headers are bounded (``MAX_REQUEST_LINE``, ``MAX_HEADER_FIELD``, ``MAX_HEADERS``)
  and a request with a body is refused (400, connection closed): a relay takes GET and HEAD only.

Every transfer is its own task on one event loop, streamed with ``sendfile`` from the page cache, so a
silent client costs one socket and never delays another client; memory does not grow with file sizes.
``serve_relay`` stops on SIGTERM or SIGINT within seconds whatever is in flight (transfers are cut;
clients resume elsewhere or later).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import ipaddress
import json
import logging
import os
import resource
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from veriroll.protos.identity import PublicKey, load_public_key

from .errors import ShardcastError
from .fetch import (
    DEFAULT_CONNECT_TIMEOUT,
    FetchResult,
    fetch_version,
    normalize_relay_url,
    small_answer_timeout,
)
from .manifest import Manifest, verify_manifest
from .store import DELTA_NAME, MANIFEST_NAME, list_versions, prune, remove_tree, version_dir

log = logging.getLogger("veriroll.shardcast.relay")

PROTOCOL = 1
DEFAULT_PORT = 8470
DEFAULT_KEEP = 3
DEFAULT_POLL_INTERVAL = 5.0
DEFAULT_IDLE_TIMEOUT = 10.0  # also the header timeout: a request head must be complete by then
DEFAULT_MIN_SEND_RATE = 256 * 1024  # bytes/s a client must keep up, on average, to keep its download
DEFAULT_SEND_GRACE = 30.0
# How long a request for bytes a streaming mirror has not verified yet waits for them before a 503: under
# a fetch's read timeout (20 s by default), so the client hears "not yet" rather than silence, and long
# enough that a shard on its way is usually sent the moment it is verified.
DEFAULT_STREAM_WAIT = 10.0
DEFAULT_MAX_TRANSFERS = 512
DEFAULT_FALLBACK_AFTER = 15.0  # seconds a version may be on the fallback upstreams alone before a mirror takes it there
DEFAULT_MAX_CONNECTIONS = 2048
# A node downloads at most 2 shards from one relay at once (fetch.DEFAULT_PER_RELAY) over a few pooled
# connections: these leave room for several nodes behind one NAT, and none for one address to take
# more than a small share of the relay.
DEFAULT_MAX_TRANSFERS_PER_ADDRESS = 16
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 64
MAX_REQUEST_LINE = 8190  # a 1024-character file name, percent-encoded, fits
MAX_HEADER_FIELD = 4096
MAX_HEADERS = 32
IMMUTABLE = "public, max-age=31536000, immutable"
_REFRESH_EVERY = 0.5
# Seconds an in-flight answer gets on stop, twice over (aiohttp waits for it, then for its cancellation);
# a transfer cut short is resumed by its client.
_SHUTDOWN_GRACE = 1.0
_FD_RESERVE = 128  # descriptors kept for the store, the mirror's fetch and logging


class Refusal(StrEnum):
    """Why a relay turned a connection or a request away; ``/status`` counts each."""

    CONNECTIONS = "connections"  # max_connections open already: closed at accept
    ADDRESS_CONNECTIONS = "address_connections"  # max_connections_per_address from there: closed at accept
    TRANSFERS = "transfers"  # max_transfers in flight: 503
    ADDRESS_TRANSFERS = "address_transfers"  # max_transfers_per_address from there: 429
    BODY = "body"  # a request with a body: 400 and the connection closed
    NOT_YET = "not-yet"  # bytes of a streaming version not verified within stream_wait: 503


_PER_ADDRESS = (Refusal.ADDRESS_CONNECTIONS, Refusal.ADDRESS_TRANSFERS)


def address_key(host: str) -> str:
    """The source a per-address limit counts: the IPv4 address, or the /64 an IPv6 address is in.

    An IPv6 subscriber usually holds a whole /64, so counting single addresses would give one client
    2^64 identities.
    """
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _listening_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for every address ``host`` resolves to.

    With ``port`` 0, every socket gets the port the first one was given.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        seen = set()
        for family, _, proto, _, sockaddr in infos:
            if sockaddr in seen:
                continue
            seen.add(sockaddr)
            sock = socket.socket(family, socket.SOCK_STREAM, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                sockaddr = (sockaddr[0], sockets[0].getsockname()[1], *sockaddr[2:])
            sock.bind(sockaddr)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


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
    has_delta: bool = False  # the delta file the manifest lists is there, whole


class _Coverage:
    """The verified byte ranges of one file, kept merged: ``starts[i]..ends[i]`` are disjoint, in order."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        first = bisect.bisect_left(self.ends, start)  # the first range that touches or follows start
        past = bisect.bisect_right(self.starts, end)  # ranges from here on start after end
        if first < past:
            start, end = min(start, self.starts[first]), max(end, self.ends[past - 1])
        self.starts[first:past] = [start]
        self.ends[first:past] = [end]

    def covers(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self.starts, start) - 1
        return start >= end or (i >= 0 and self.ends[i] >= end)


@dataclass
class StreamingVersion:
    """A version a mirror is fetching: served from its staging directory, range by verified range."""

    version: int
    manifest: Manifest
    manifest_bytes: bytes
    staging: Path
    final: Path  # where it will be once whole: a request that races the rename finds it there
    verified: dict[str, _Coverage] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: bool = False

    def add(self, name: str, offset: int, size: int) -> None:
        self.verified.setdefault(name, _Coverage()).add(offset, offset + size)
        self._wake()

    def covers(self, name: str, start: int, stop: int) -> bool:
        return start >= stop or (name in self.verified and self.verified[name].covers(start, stop))

    def end(self) -> None:
        """The fetch is over (the version is now held whole, or the fetch failed)."""
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        # Every waiter holds the event of its moment; setting it and starting a new one wakes them all.
        self.changed.set()
        self.changed = asyncio.Event()

    def verified_bytes(self) -> int:
        return sum(e - s for c in self.verified.values() for s, e in zip(c.starts, c.ends, strict=True))


class RelayServer:
    """A relay over ``store``; ``await start()``, then ``url``; ``await stop()`` when done.

    ``max_connections_per_address`` and ``max_transfers_per_address`` may be None (no per-address
    limit: a relay behind a reverse proxy sees every client at the proxy's address).
    """

    def __init__(
        self,
        store: str | os.PathLike,
        coordinator_key: PublicKey | str | os.PathLike,
        *,
        upstreams: Sequence[str] = (),
        fallbacks: Sequence[str] = (),
        fallback_after: float = DEFAULT_FALLBACK_AFTER,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        keep: int = DEFAULT_KEEP,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        min_send_rate: float = DEFAULT_MIN_SEND_RATE,
        send_grace: float = DEFAULT_SEND_GRACE,
        max_transfers: int = DEFAULT_MAX_TRANSFERS,
        max_transfers_per_address: int | None = DEFAULT_MAX_TRANSFERS_PER_ADDRESS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_address: int | None = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        stream_wait: float = DEFAULT_STREAM_WAIT,
        fetch_options: dict[str, Any] | None = None,
    ):
        self.store = Path(store)
        self.key = (
            coordinator_key if isinstance(coordinator_key, PublicKey) else load_public_key(coordinator_key)
        )
        self.upstreams = [normalize_relay_url(u) for u in upstreams]
        # Mirrored from only for a version the upstreams have not listed for fallback_after seconds while a
        # fallback has (an upstream that stopped answering, or one stuck behind its own): see mirror_once.
        self.fallbacks = [normalize_relay_url(u) for u in fallbacks]
        if self.fallbacks and not self.upstreams:
            raise ValueError("fallback upstreams are for a mirror: give it an upstream too")
        self.fallback_after = fallback_after
        self._only_on_fallbacks: dict[int, float] = {}  # version -> when a fallback was first seen to hold it alone
        self.host, self.port = host, port
        self.keep = keep
        self.poll_interval = poll_interval
        self.idle_timeout = idle_timeout
        self.min_send_rate = min_send_rate
        self.send_grace = send_grace
        self.max_transfers = max_transfers
        self.max_transfers_per_address = max_transfers_per_address
        self.max_connections = max_connections
        self.max_connections_per_address = max_connections_per_address
        self.stream_wait = stream_wait
        self.fetch_options = {"progress": False, **(fetch_options or {})}
        self.held: dict[int, HeldVersion] = {}
        self.streaming: dict[int, StreamingVersion] = {}
        self._refused: dict[str, tuple[int, str]] = {}  # dir name -> (mtime_ns, why), so each is logged once
        self._last_refresh = 0.0
        self._started = time.monotonic()
        self._runner: web.AppRunner | None = None
        self._listeners: list[socket.socket] = []
        self._accept_tasks: list[asyncio.Task] = []
        # Connections by source (aiohttp's server counts them in all). A closed one stays on the books
        # until its source connects again or a sweep (see _book): no callback per closed connection.
        self._by_address: dict[str, list[asyncio.BaseTransport]] = {}
        self._transfers_by_address: Counter[str] = Counter()
        self._mirror_task: asyncio.Task | None = None
        self._mirror_backoff: dict[int, tuple[int, float]] = {}  # version -> (failures, retry after)
        self.mirror_fetching: int | None = None
        self.mirror_last_error: str | None = None
        self.active_transfers = 0
        self.requests_total = 0
        self.bytes_served_total = 0
        self.send_timeouts_total = 0
        self.rejections: Counter[Refusal] = Counter()

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
            has_delta = False
            if manifest.delta is not None:
                # A version without its delta is still whole; only the delta route answers 404 then.
                with contextlib.suppress(FileNotFoundError):
                    has_delta = (vdir / DELTA_NAME).stat().st_size == manifest.delta.size
        except (OSError, ShardcastError) as exc:
            why = str(exc)
            log.error("not serving version %d from %s: %s", version, vdir, why)
            with contextlib.suppress(OSError):
                self._refused[vdir.name] = ((vdir / MANIFEST_NAME).stat().st_mtime_ns, why)
            return None
        return HeldVersion(version, manifest, data, vdir, has_delta)

    def versions(self) -> list[int]:
        return sorted(self.held)

    def streaming_versions(self) -> list[int]:
        """Versions being mirrored, served as they arrive (never one that is also held whole)."""
        return sorted(v for v in self.streaming if v not in self.held)

    def _lookup(self, which: str) -> HeldVersion | StreamingVersion:
        # Listings answer from the store as it is now (one listdir); file requests, the bulk of the
        # traffic, reuse a listing up to half a second old unless they ask for a version not yet seen.
        self.refresh(force=which == "latest")
        if which == "latest":
            if not self.held and not self.streaming:
                raise web.HTTPNotFound(text="this relay holds no version yet\n")
            newest = max([*self.held, *self.streaming])
            return self.held.get(newest) or self.streaming[newest]
        if not which.isdigit():
            raise web.HTTPNotFound(text="a version is an integer or 'latest'\n")
        version = int(which)
        if version not in self.held:
            self.refresh(force=True)
        if version in self.held:
            return self.held[version]
        if version in self.streaming:
            return self.streaming[version]
        raise web.HTTPNotFound(text=f"version {version} is not held here; see /status\n")

    # ---- connections

    def _admit(self, source: str) -> Refusal | None:
        """Whether a new connection from ``source`` fits the limits (None) or why not."""
        assert self._runner is not None and self._runner.server is not None
        if len(self._runner.server.connections) >= self.max_connections:
            return Refusal.CONNECTIONS
        limit = self.max_connections_per_address
        if limit is not None:
            live = [t for t in self._by_address.get(source, ()) if not t.is_closing()]
            self._by_address[source] = live
            if len(live) >= limit:
                return Refusal.ADDRESS_CONNECTIONS
        return None

    def _book(self, source: str, transport: asyncio.BaseTransport) -> None:
        """Note an accepted connection under its source, for the per-address limit."""
        if self.max_connections_per_address is None:
            return
        self._by_address.setdefault(source, []).append(transport)
        # Sources whose connections all closed are dropped in a sweep when their number reaches twice
        # the most that can be live; a sweep leaves at most half, so its cost is spread over as many
        # new sources as it went through.
        if len(self._by_address) >= 2 * self.max_connections:
            self._by_address = {
                src: live
                for src, transports in self._by_address.items()
                if (live := [t for t in transports if not t.is_closing()])
            }

    async def _accept_forever(self, listener: socket.socket) -> None:
        """Accept connections on ``listener``; one over a limit is closed before anything is read."""
        loop = asyncio.get_running_loop()
        assert self._runner is not None and self._runner.server is not None
        protocol_factory = self._runner.server  # aiohttp's server makes the protocol of each connection
        while True:
            try:
                sock, peer = await loop.sock_accept(listener)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("cannot accept connections: %s; retrying in 1 s", exc)
                    await asyncio.sleep(1.0)
                continue  # ECONNABORTED and the like: that client is gone, the next one is not
            source = address_key(peer[0])
            refusal = self._admit(source)
            if refusal is not None:
                self.rejections[refusal] += 1
                sock.close()
                continue
            try:
                transport, _ = await loop.connect_accepted_socket(protocol_factory, sock)
            except OSError:
                sock.close()
                continue
            self._book(source, transport)

    # ---- handlers

    def _refusal(self, reason: Refusal, status: type[web.HTTPException], text: str) -> web.HTTPException:
        self.rejections[reason] += 1
        headers = {"X-Shardcast-Refusal": reason.value}
        if reason is not Refusal.BODY:
            headers["Retry-After"] = "1"
        return status(text=text, headers=headers)

    @web.middleware
    async def _serve(self, request: web.Request, handler):
        """Count the request, refuse a body, and send the answer under a deadline.

        File answers are sent by their handler, which holds a transfer slot meanwhile.
        """
        self.requests_total += 1
        try:
            if request.can_read_body:
                raise self._refusal(
                    Refusal.BODY, web.HTTPBadRequest, "relays take GET and HEAD requests, without a body\n"
                )
            response = await handler(request)
        except web.HTTPException as exc:
            response = web.Response(status=exc.status, reason=exc.reason, text=exc.text, headers=exc.headers)
            if exc.headers.get("X-Shardcast-Refusal") == Refusal.BODY:
                response.force_close()
        if not response.prepared:
            body = response.body if isinstance(response, web.Response) else None
            await self._send(request, response, len(body) if isinstance(body, bytes) else 0)
        return response

    async def _send(
        self, request: web.Request, response: web.StreamResponse, nbytes: int, body=None
    ) -> bool:
        """Send ``response`` (and ``await body()`` between its head and its end, unless HEAD); False when
        the client did not take ``nbytes`` in time and was dropped."""
        deadline = self.send_grace + nbytes / self.min_send_rate
        try:
            async with asyncio.timeout(deadline):
                await response.prepare(request)
                if body is not None and request.method != "HEAD":
                    await body()
                await response.write_eof()
        except TimeoutError:
            # The client reads too slowly (or not at all): drop it so its socket and slot are freed.
            # abort, not close: close would wait for the unread bytes to drain, which they never do.
            self.send_timeouts_total += 1
            log.info("cut off %s: %d bytes not sent within %.1f s", request.remote, nbytes, deadline)
            if request.transport is not None:
                request.transport.abort()
            return False
        return True

    def _load_counters(self) -> dict[str, Any]:
        server = self._runner.server if self._runner is not None else None
        return {
            "active_transfers": self.active_transfers,
            "open_connections": len(server.connections) if server is not None else 0,
            "requests_total": self.requests_total,
            "bytes_served_total": self.bytes_served_total,
            "busy_rejections_total": self.rejections[Refusal.TRANSFERS],
            "send_timeouts_total": self.send_timeouts_total,
            "rejections": {reason.value: self.rejections[reason] for reason in Refusal},
            "per_address_rejections_total": sum(self.rejections[r] for r in _PER_ADDRESS),
            "uptime_s": round(time.monotonic() - self._started, 3),
        }

    def limits(self) -> dict[str, Any]:
        """The limits this relay enforces, as ``/status`` shows them."""
        return {
            "max_connections": self.max_connections,
            "max_connections_per_address": self.max_connections_per_address,
            "max_transfers": self.max_transfers,
            "max_transfers_per_address": self.max_transfers_per_address,
            "idle_timeout_s": self.idle_timeout,
            "send_grace_s": self.send_grace,
            "min_send_rate": self.min_send_rate,
        }

    async def _status(self, request: web.Request) -> web.Response:
        self.refresh(force=True)
        versions = self.versions()
        body = {
            "service": "veriroll-shardcast-relay",
            "protocol": PROTOCOL,
            "role": self.role,
            "versions": versions,
            "latest": versions[-1] if versions else None,
            "keep": self.keep,
            "upstreams": self.upstreams,
            "fallbacks": self.fallbacks,
            "load": self._load_counters(),
            "limits": self.limits(),
            "streaming": self.streaming_versions(),
            "mirror": {
                "fetching": self.mirror_fetching,
                "last_error": self.mirror_last_error,
                "verified_bytes": {str(v): sv.verified_bytes() for v, sv in self.streaming.items()},
            },
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
        return await self._transfer(request, request.match_info["name"])

    async def _delta(self, request: web.Request) -> web.StreamResponse:
        return await self._transfer(request, DELTA_NAME)

    async def _transfer(self, request: web.Request, name: str) -> web.StreamResponse:
        """Send bytes of file ``name`` of a version (or its delta file), holding a transfer slot meanwhile."""
        # The slot checks come first: a refused request costs no lookup and no open file.
        source = address_key(request.remote or "")
        limit = self.max_transfers_per_address
        if limit is not None and self._transfers_by_address[source] >= limit:
            raise self._refusal(
                Refusal.ADDRESS_TRANSFERS,
                web.HTTPTooManyRequests,
                f"{limit} downloads from your address are in progress already; retry when one is done\n",
            )
        if self.active_transfers >= self.max_transfers:
            raise self._refusal(Refusal.TRANSFERS, web.HTTPServiceUnavailable, "relay busy, retry shortly\n")
        which = request.match_info["version"]
        if which == "latest":
            raise web.HTTPNotFound(text="files are addressed by version number, not 'latest'\n")
        found = self._lookup(which)
        size = _size_of(found, name)  # only names the signed manifest lists: no way out of the directory
        self.active_transfers += 1
        self._transfers_by_address[source] += 1
        try:
            if isinstance(found, StreamingVersion):
                response, sent = await self._send_streaming(request, found, name, size)
            else:
                response, sent = await self._send_held(request, found, name, size)
        finally:
            self.active_transfers -= 1
            self._transfers_by_address[source] -= 1
            if not self._transfers_by_address[source]:
                del self._transfers_by_address[source]
        if sent and response.status in (200, 206):
            self.bytes_served_total += response.content_length or 0
        return response

    async def _send_held(
        self, request: web.Request, held: HeldVersion, name: str, size: int
    ) -> tuple[web.StreamResponse, bool]:
        try:
            start, stop, _ = _byte_range(request, size)
            nbytes = stop - start
        except ValueError:
            nbytes = size  # FileResponse answers 416 itself
        # FileResponse would serve a sibling "name.gz" to a client that accepts gzip: never do that.
        headers = {k: v for k, v in request.headers.items() if k.lower() != "accept-encoding"}
        request = request.clone(headers=headers)
        response = _FileResponseOnce(
            held.path / name,
            chunk_size=256 * 1024,
            headers={"Cache-Control": IMMUTABLE, "X-Shardcast-Version": str(held.version)},
        )
        return response, await self._send(request, response, nbytes)

    async def _send_streaming(
        self, request: web.Request, sv: StreamingVersion, name: str, size: int
    ) -> tuple[web.StreamResponse, bool]:
        """Send a range of a version still being mirrored, once every byte of it is verified."""
        try:
            start, stop, ranged = _byte_range(request, size)
        except ValueError:
            raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{size}"}) from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stream_wait
        while not sv.covers(name, start, stop):
            if sv.ended:
                found = self._lookup(str(sv.version))  # 404 when the fetch failed and nothing is held
                if isinstance(found, HeldVersion):
                    if name == DELTA_NAME and not found.has_delta:
                        raise web.HTTPNotFound(text=f"this relay does not hold the delta of version {sv.version}\n")
                    return await self._send_held(request, found, name, size)
                sv = found  # the mirror is fetching it again
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._refusal(
                    Refusal.NOT_YET,
                    web.HTTPServiceUnavailable,
                    f"version {sv.version} is still arriving here and these bytes are not verified yet; retry\n",
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await sv.changed.wait()
        headers = {"Cache-Control": IMMUTABLE, "X-Shardcast-Version": str(sv.version), "Accept-Ranges": "bytes"}
        if ranged:
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        response = web.StreamResponse(status=206 if ranged else 200, headers=headers)
        response.content_length = stop - start
        try:
            # The staging directory is renamed into place when the version is whole: look there second.
            fobj = await loop.run_in_executor(None, _open_first, [sv.staging / name, sv.final / name])
        except FileNotFoundError:
            raise web.HTTPNotFound(text=f"version {sv.version} is gone from this relay\n") from None
        try:

            async def body() -> None:
                if request.transport is None:
                    raise ConnectionResetError("connection lost")
                await loop.sendfile(request.transport, fobj, start, stop - start)

            return response, await self._send(request, response, stop - start, body)
        finally:
            fobj.close()

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._serve], client_max_size=4096)
        app.router.add_get("/status", self._status)
        app.router.add_get("/versions", self._versions)
        app.router.add_get("/versions/{version}/manifest", self._manifest)
        app.router.add_get("/versions/{version}/files/{name:.+}", self._file)
        app.router.add_get("/versions/{version}/delta", self._delta)
        return app

    # ---- lifecycle

    def _fit_connections_to_descriptors(self) -> None:
        """Lower ``max_connections`` so that connections plus open files fit the descriptor limit.

        Running out of descriptors would break every client, the store and the mirror at once.
        """
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return
        room = soft - self.max_transfers - _FD_RESERVE
        if self.max_connections > room:
            log.warning(
                "max_connections lowered from %d to %d: the descriptor limit is %d (raise it with ulimit -n)",
                self.max_connections,
                max(1, room),
                soft,
            )
            self.max_connections = max(1, room)

    async def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        self.refresh(force=True)
        self._fit_connections_to_descriptors()
        self._runner = web.AppRunner(
            self.make_app(),
            handle_signals=False,
            access_log=None,
            keepalive_timeout=self.idle_timeout,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_GRACE,
            max_line_size=MAX_REQUEST_LINE,
            max_field_size=MAX_HEADER_FIELD,
            max_headers=MAX_HEADERS,
            lingering_time=0,  # never read a body a client sends anyway: close on it
        )
        await self._runner.setup()
        self._listeners = _listening_sockets(self.host, self.port, backlog=1024)
        self.port = self._listeners[0].getsockname()[1]
        self._accept_tasks = [asyncio.create_task(self._accept_forever(s)) for s in self._listeners]
        log.info(
            "relay (%s) serving %s on %s, versions %s; limits %s",
            self.role,
            self.store,
            self.url,
            self.versions() or "none",
            self.limits(),
        )
        if self.upstreams:
            self._mirror_task = asyncio.create_task(self._mirror_loop())

    async def stop(self) -> None:
        """Stop accepting, stop mirroring, and close every connection (within 2 × ``_SHUTDOWN_GRACE``)."""
        tasks = [*self._accept_tasks, *([self._mirror_task] if self._mirror_task is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._accept_tasks, self._mirror_task = [], None
        for listener in self._listeners:
            listener.close()
        self._listeners = []
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> RelayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---- mirroring

    async def _upstream_versions(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> set[int]:
        timeout = small_answer_timeout(DEFAULT_CONNECT_TIMEOUT, self.fetch_options.get("read_timeout", 20.0))

        async def one(url: str) -> list[int]:
            try:
                async with session.get(f"{url}/status", timeout=timeout) as resp:
                    if resp.status != 200:
                        return []
                    status = json.loads(await resp.read())
            except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
                log.info("upstream %s did not answer /status: %s", url, exc)
                return []
            if not isinstance(status, dict):
                return []
            versions, streaming = status.get("versions"), status.get("streaming", [])
            if not isinstance(versions, list) or not isinstance(streaming, list):
                return []
            return [v for v in versions + streaming if isinstance(v, int) and not isinstance(v, bool) and v >= 0]

        results = await asyncio.gather(*(one(u) for u in urls))
        return {v for vs in results for v in vs}

    def _overdue_on_fallbacks(self, upstream: set[int], fallback: set[int], now: float) -> set[int]:
        """Versions a fallback has listed, and no upstream, for ``fallback_after`` seconds or more."""
        alone = {v for v in fallback - upstream if v not in self.held}
        for v in list(self._only_on_fallbacks):
            if v not in alone:
                del self._only_on_fallbacks[v]
        for v in alone:
            self._only_on_fallbacks.setdefault(v, now)
        return {v for v, since in self._only_on_fallbacks.items() if now - since >= self.fallback_after}

    async def mirror_once(self) -> list[int]:
        """One mirroring round: fetch the newest ``keep`` upstream versions not held yet; returns them.

        A version that only the fallbacks have listed, for ``fallback_after`` seconds, is fetched from them:
        an upstream that stopped answering (it lists nothing) or one stuck behind its own upstream (it
        lists older versions only) holds back no version for longer. While the upstreams keep up, the
        fallbacks are asked for their list and nothing else."""
        async with aiohttp.ClientSession(trust_env=False) as session:
            claimed, listed = await asyncio.gather(self._upstream_versions(session, self.upstreams),
                                                   self._upstream_versions(session, self.fallbacks))
        rescued = self._overdue_on_fallbacks(claimed, listed, time.monotonic()) if self.fallbacks else set()
        claimed |= rescued
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

            def staged(manifest: Manifest, manifest_bytes: bytes, staging: Path, v: int = v) -> None:
                self.streaming[v] = StreamingVersion(v, manifest, manifest_bytes, staging, version_dir(self.store, v))

            def verified(name: str, offset: int, size: int, v: int = v) -> None:
                if v in self.streaming:
                    self.streaming[v].add(name, offset, size)

            if v in rescued:
                log.warning("version %d is on the fallback upstreams only, for %.0f s or more: mirroring it from %s",
                            v, self.fallback_after, ", ".join(self.fallbacks))
            try:
                result = await _fetch_on_own_loop(
                    self.fallbacks if v in rescued else self.upstreams, self.key, version_dir(self.store, v), v,
                    bases=[version_dir(self.store, h) for h in reversed(self.versions())], keep_delta=True,
                    on_staged=staged, on_verified=verified, **self.fetch_options,
                )  # fmt: skip
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
                self.refresh(force=True)  # a version just renamed into place is held before waiters wake
                streaming = self.streaming.pop(v, None)
                if streaming is not None:
                    streaming.end()
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
            # Blind on purpose: whatever one round hits (it is logged with its traceback and shown in
            # /status), the relay keeps serving what it holds and tries again next round.
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from exc  # stopping: whatever the round hit on its way out
                self.mirror_last_error = f"{type(exc).__name__}: {exc}"
                log.exception("mirror round failed")
            await asyncio.sleep(self.poll_interval)


async def _fetch_on_own_loop(*args, on_staged, on_verified, **kwargs) -> FetchResult:
    """``fetch_version`` on an event loop of its own, in a thread; its callbacks run on the caller's loop.

    A mirror serves while it fetches. On one loop, its download's socket reads queue behind the
    ``sendfile`` calls of every client it streams to, so the head of the pipeline slows as the tree
    fills (measured: the mirrors' download took as long as the whole tree). On a loop of its own the
    download is not starved, and both threads spend their time in system calls, without the GIL.
    Cancelling the caller cancels the fetch and waits for it to end.
    """
    caller = asyncio.get_running_loop()
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = []
    cancelled = threading.Event()

    async def fetch() -> FetchResult:
        running.append((asyncio.get_running_loop(), asyncio.current_task()))
        if cancelled.is_set():
            raise asyncio.CancelledError
        return await fetch_version(
            *args,
            on_staged=lambda *a: caller.call_soon_threadsafe(on_staged, *a),
            on_verified=lambda *a: caller.call_soon_threadsafe(on_verified, *a),
            **kwargs,
        )

    done = caller.run_in_executor(None, asyncio.run, fetch())
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        # Set before looking, and the thread registers before it checks: one of the two sees the other.
        cancelled.set()
        for loop, task in running:
            # A loop already closed ran its fetch to the end: there is nothing left to cancel. (Raising here
            # turned the cancellation into a RuntimeError, which the mirror loop logged and went on from,
            # so that a relay stopping at that moment never stopped; seen under load.)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)
        with contextlib.suppress(BaseException):
            await done
        raise


def _size_of(found: HeldVersion | StreamingVersion, name: str) -> int:
    """The size of file ``name`` (or of the delta file) of a version; 404 when it has none such."""
    version = found.version
    if name == DELTA_NAME:
        delta = found.manifest.delta
        if delta is None:
            raise web.HTTPNotFound(text=f"version {version} has no delta\n")
        if isinstance(found, HeldVersion) and not found.has_delta:
            raise web.HTTPNotFound(text=f"this relay does not hold the delta of version {version}\n")
        return delta.size
    entry = found.manifest.file(name)
    if entry is None:
        raise web.HTTPNotFound(text=f"version {version} has no file {name!r}\n")
    return entry.size


def _byte_range(request: web.Request, size: int) -> tuple[int, int, bool]:
    """``(start, stop, ranged)`` of the bytes a request asks for out of ``size``; ValueError when unsatisfiable."""
    rng = request.http_range  # ValueError for a malformed header
    if rng.start is None and rng.stop is None:
        return 0, size, False
    start = rng.start or 0
    stop = size if rng.stop is None else min(rng.stop, size)
    if start < 0:
        start = max(0, size + start)
    if start >= size or stop <= start:
        raise ValueError(f"range {start}-{stop} outside a file of {size} bytes")
    return start, stop, True


def _open_first(paths: Sequence[Path]):
    """The first of ``paths`` that exists, open for reading; FileNotFoundError when none does."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            return open(path, "rb")  # the caller closes it once sent
    raise FileNotFoundError(paths[-1])


async def serve_relay(store: str | os.PathLike, coordinator_key, **options) -> None:
    """Run a relay (``options``: RelayServer's) until SIGINT or SIGTERM, then stop within seconds."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Handlers first: a signal that arrives while the relay starts still stops it, cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    relay = RelayServer(store, coordinator_key, **options)
    await relay.start()
    try:
        await stop.wait()
        log.info("relay on %s stopping", relay.url)
    finally:
        await relay.stop()
