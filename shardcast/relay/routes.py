"""The relay's routes: the URL scheme (module docstring of ``relay/``), each answer sent under a deadline.

``_Routes`` is part of ``RelayServer``; it uses the catalogue (``_lookup``, ``refresh``), the admission
books (``_refusal``, ``_transfers_by_address``), the server's ``config`` and its counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from ..store import DELTA_NAME
from .admission import _PER_ADDRESS, Refusal, address_key
from .catalogue import HeldVersion, StreamingVersion

log = logging.getLogger("veriroll.shardcast.relay")

PROTOCOL = 1
IMMUTABLE = "public, max-age=31536000, immutable"


class _FileResponseOnce(web.FileResponse):
    """A FileResponse the handler can send itself (under a deadline) before returning it.

    aiohttp calls ``prepare`` again on the returned response; FileResponse would send the file twice.
    """

    async def prepare(self, request: web.BaseRequest):
        if self.prepared:
            return self._payload_writer
        return await super().prepare(request)


class _Routes:
    """The handlers of every route, the middleware that counts and bounds them, and the app that routes them."""

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
        deadline = self.config.send_grace + nbytes / self.config.min_send_rate
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
            "max_connections_per_address": self.config.max_connections_per_address,
            "max_transfers": self.config.max_transfers,
            "max_transfers_per_address": self.config.max_transfers_per_address,
            "idle_timeout_s": self.config.idle_timeout,
            "send_grace_s": self.config.send_grace,
            "min_send_rate": self.config.min_send_rate,
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
            "keep": self.config.keep,
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
        limit = self.config.max_transfers_per_address
        if limit is not None and self._transfers_by_address[source] >= limit:
            raise self._refusal(
                Refusal.ADDRESS_TRANSFERS,
                web.HTTPTooManyRequests,
                f"{limit} downloads from your address are in progress already; retry when one is done\n",
            )
        if self.active_transfers >= self.config.max_transfers:
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
        deadline = loop.time() + self.config.stream_wait
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

