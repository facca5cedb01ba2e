"""The coordinator's HTTP side, on its own port: ``/metrics``, ``/healthz``, ``/api/status`` and the dashboard.

This port is for the operator (Prometheus, a browser), never for nodes: nodes speak signed gRPC. It is
still open to anyone who can reach it, so each address may hold ``server.http_connections_per_address``
connections, and a connection that does not send its request head in time is closed (see
:class:`ConnectionLimits`); refusals are counted in ``veriroll_http_refused_total``.

Status queries run on the store's reader connection (``Database.run_read``), not on its writer
thread, so a dashboard left open (or a slow aggregate over many groups) never delays intake; WAL
lets the reader see every committed transaction without blocking the writer. One answer is cached
for a second, so any number of open dashboards cost one query set per second.

``/api/status`` shape (every key always present; lists may be empty)::

    query: window_s  seconds of rejections/throughput shown, in (0, 365 days], default 1 day
           points    most trainer_history entries, an integer in [1, 2000], default 2000
    A value that is missing is the default; one that is empty, not a finite number or out of range
    (nan, inf, -1, 0, 1e999, "abc", "") is answered 400 with {"error", "parameter", "allowed"}.


    {
      "time_ms": int,                       # coordinator clock
      "verification": "on" | "off",         # "off" only with intake.verify = false (groups checked for shape only)
      "summary": {policy_version, nodes, open_leases, accepted_groups, unconsumed_groups,
                  rejections_by_reason: {reason: n}, banned_nodes, trainer_step},
      "policy": {"version": int, "s_max": int, "relays": [url]},
      "nodes_by_standing": {"probation": n, "trusted": n, "banned": n},
      "nodes": [{node_id, display_name, standing, strikes, credits, accepted_groups, accepted_tokens,
                 clean_groups, loaded_version, last_seen_ms, ban_reason, rejected, rejections: {reason: n},
                 hardware: {...}}],     # the MAX_LISTED_NODES most recently seen, newest first
      "nodes_total": int,                   # all registered nodes (nodes_by_standing counts all of them too)
      "rejections": {"by_reason": {reason: n},       # every refusal ever counted (= summary's)
                     "unattributed": {reason: n},    # of those, refused before the node was identified
                                                     # (signature, nonce, unknown key, per-address limits):
                                                     # counted, but no event is kept, so never on the timeline
                     "window_s": s,                  # the timeline's span
                     "timeline": {"bucket_s": s, "reasons": [reason],
                                  "buckets": [{"t_ms": start, "counts": {reason: n}}]}},
      "throughput": {"bucket_s": s, "buckets": [{"t_ms": start, "groups": n, "tokens": n}]},
      "staleness": {"source": "trainer" | "queue" | "none", "steps": n, "histogram": {"0": n, "1": n}},
      "trainer": {metric: value},           # the veriroll_trainer gauges (last step)
      "trainer_history": [{step, version, time, time_ms, reward, approx_kl, clipfrac, mismatch_kl,
                           staleness_hist: {s: n}, groups_per_s, tokens_per_s, ...}],
                           # the trainer's kv "trainer_history" (oldest first, downsampled to ?points),
                           # each entry as the trainer wrote it plus time_ms
      "relays": [{"url", "ok", "latest", "versions", "error", "checked_ms"}]
    }
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from veriroll.coordinator import store as st
from veriroll.coordinator.environments import sandbox_state
from veriroll.coordinator.limits import PeerGate
from veriroll.coordinator.metrics import Counter
from veriroll.protos.errors import VerirollError

log = logging.getLogger("veriroll.coordinator.http")

STATIC_DIR = Path(__file__).parent / "static"
TRAINER_HISTORY_KEY = "trainer_history"
MAX_HISTORY_POINTS = 2000  # the page never needs more points than a screen has pixels
STALENESS_STEPS = 20  # the staleness chart sums this many most recent trainer steps
TIMELINE_BUCKETS = 60
DEFAULT_WINDOW_S = 24 * 3600
MAX_WINDOW_S = 365 * 86400
MAX_LISTED_NODES = 200  # /api/status lists this many nodes (most recently seen); nodes_total counts all
BUCKET_SIZES_S = (10, 30, 60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 24 * 3600)
STATUS_CACHE_S = 1.0
# Request heads are small here (the page's URLs, a browser's headers); nothing the port serves takes a body.
MAX_REQUEST_LINE = 4096
MAX_HEADER_FIELD = 8190
MAX_HEADERS = 64
MAX_BODY_BYTES = 64 * 1024
SHUTDOWN_WAIT_S = 1.0  # an answer still being written at shutdown gets this long
RELAY_POLL_S = 10.0
RELAY_TIMEOUT_S = 3.0
# The page's scripts and styles are ours and same-origin; node-supplied text (display names) is only
# ever set as textContent, and the policy below forbids inline script as a second line of defence.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


# --- pure parts: bucketing and shaping ------------------------------------------------------------------


def bucket_size_s(span_s: float, max_buckets: int = TIMELINE_BUCKETS) -> int:
    """The smallest round bucket width that covers ``span_s`` in at most ``max_buckets`` buckets."""
    for size in BUCKET_SIZES_S:
        if span_s / size <= max_buckets:
            return size
    return int(math.ceil(span_s / max_buckets / 86400.0)) * 86400


def timeline_bounds(first_ms: int | None, now_ms: int, max_buckets: int = TIMELINE_BUCKETS) -> tuple[int, int]:
    """``(start_ms, bucket_ms)`` of a contiguous timeline from ``first_ms`` to ``now_ms``, aligned to the bucket."""
    if first_ms is None:
        return now_ms, BUCKET_SIZES_S[0] * 1000
    size_ms = bucket_size_s(max(0.0, (now_ms - first_ms) / 1000.0), max_buckets) * 1000
    return (first_ms // size_ms) * size_ms, size_ms


def downsample(items: list, max_points: int = MAX_HISTORY_POINTS) -> list:
    """Every k-th item so at most ``max_points`` remain; the newest item is always kept."""
    if len(items) <= max_points:
        return list(items)
    stride = math.ceil(len(items) / max_points)
    out = items[::stride]
    if out[-1] is not items[-1]:
        out = out[:-1] + [items[-1]] if len(out) >= max_points else out + [items[-1]]
    return out


def staleness_from_history(history: list[dict], steps: int = STALENESS_STEPS) -> dict[str, int]:
    """Samples by staleness summed over the newest ``steps`` entries.

    Each entry's ``staleness_hist`` (the trainer's key; ``staleness`` is read too) is ``{s: n}`` or ``[n0, n1, ...]``.
    """
    total: dict[int, int] = {}
    for entry in history[-steps:]:
        hist = entry.get("staleness_hist", entry.get("staleness"))
        pairs = enumerate(hist) if isinstance(hist, list) else (hist or {}).items() if isinstance(hist, dict) else ()
        for s, n in pairs:
            try:
                total[int(s)] = total.get(int(s), 0) + int(n)
            except (TypeError, ValueError):
                continue
    return {str(s): total[s] for s in sorted(total)}


def normalize_history(history) -> list[dict]:
    """The trainer's entries, each with ``time_ms`` (from its ``time`` in seconds) for the page's time axes."""
    out = []
    for entry in history if isinstance(history, list) else []:
        if not isinstance(entry, dict):
            continue
        if "time_ms" not in entry and isinstance(entry.get("time"), int | float):
            entry = {**entry, "time_ms": int(entry["time"] * 1000)}
        out.append(entry)
    return out


def _finite(value):
    """JSON has no NaN/Infinity: the page gets ``null`` (a gap) instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# --- the read side --------------------------------------------------------------------------------------


def read_status(conn: sqlite3.Connection, now_ms: int, window_s: float = DEFAULT_WINDOW_S,
                max_points: int = MAX_HISTORY_POINTS, max_nodes: int = MAX_LISTED_NODES) -> dict:
    """Everything ``/api/status`` says that lives in the database, in one read transaction."""
    with st.read_transaction(conn):
        summary = st.status_summary(conn)
        nodes = st.list_nodes(conn, limit=max_nodes)
        by_node = st.rejections_by_node(conn)
        since = now_ms - int(window_s * 1000)
        standings = st.standing_counts(conn)
        for n in nodes:
            rej = by_node.get(n["node_id"], {})
            n["rejections"] = rej
            n["rejected"] = sum(rej.values())
            n["credits"] = float(n["accepted_tokens"])  # the ledger's credit unit (GetLedger): accepted tokens

        first = st.first_rejection_ms(conn, since)
        start, size = timeline_bounds(first, now_ms)
        n_buckets = 0 if first is None else (now_ms - start) // size + 1
        buckets = [{"t_ms": start + i * size, "counts": {}} for i in range(n_buckets)]
        reasons: set[str] = set()
        for b, reason, n in st.rejections_per_bucket(conn, start, size):
            if 0 <= b < n_buckets:
                buckets[b]["counts"][reason] = n
                reasons.add(reason)
        rejections = {"by_reason": summary["rejections_by_reason"],
                      "unattributed": st.rejections_by_reason(conn, node_id=""), "window_s": window_s,
                      "timeline": {"bucket_s": size // 1000, "reasons": sorted(reasons), "buckets": buckets}}

        first = st.first_arrival_ms(conn, since)
        start, size = timeline_bounds(first, now_ms)
        n_buckets = 0 if first is None else (now_ms - start) // size + 1
        tbuckets = [{"t_ms": start + i * size, "groups": 0, "tokens": 0} for i in range(n_buckets)]
        for b, groups, tokens in st.arrivals_per_bucket(conn, start, size):
            if 0 <= b < n_buckets:
                tbuckets[b].update(groups=groups, tokens=tokens)
        throughput = {"bucket_s": size // 1000, "buckets": tbuckets}

        history = normalize_history(st.kv_get(conn, TRAINER_HISTORY_KEY, None))
        if history:
            staleness = {"source": "trainer", "steps": min(len(history), STALENESS_STEPS),
                         "histogram": staleness_from_history(history)}
        else:
            # No trainer steps yet: what the queue would give it, measured against the newest version.
            version = summary["policy_version"]
            queued = st.queue_staleness(conn, version)
            staleness = {"source": "queue" if queued else "none", "steps": 0,
                         "histogram": {str(s): n for s, n in queued.items()}}
    return {
        "summary": summary,
        "nodes_by_standing": standings,
        "nodes": nodes,
        "nodes_total": summary["nodes"],
        "rejections": rejections,
        "throughput": throughput,
        "staleness": staleness,
        "trainer_history": downsample(history, max_points),
    }


class StatusSource:
    """Builds ``/api/status`` answers for one coordinator; caches the last one briefly; polls relays."""

    def __init__(self, coord):
        self.coord = coord
        self._cache: tuple[float, tuple, dict] | None = None
        self._lock = asyncio.Lock()
        self.relays: dict[str, dict] = {}

    async def status(self, window_s: float = DEFAULT_WINDOW_S, max_points: int = MAX_HISTORY_POINTS) -> dict:
        key = (window_s, max_points)
        async with self._lock:
            if self._cache and self._cache[1] == key and time.monotonic() - self._cache[0] < STATUS_CACHE_S:
                return self._cache[2]
            svc = self.coord.service
            now = svc.clock()
            body = await self.coord.db.run_read(lambda c: read_status(c, now, window_s, max_points))
            body["time_ms"] = now
            body["verification"] = "on" if self.coord.cfg.intake.verify else "off"
            body["sandbox"] = sandbox_state(self.coord.cfg)  # None unless the environment runs model code
            body["policy"] = {"version": svc.policy.version, "s_max": self.coord.cfg.intake.s_max,
                              "relays": list(svc.policy.relays)}
            body["trainer"] = {k[0]: v for k, v in sorted(svc.metrics.trainer.values.items())}
            body["relays"] = [self.relays.get(u) or {"url": u, "ok": None, "latest": None, "versions": [], "error": "",
                                                     "checked_ms": 0} for u in self.relay_urls()]
            body = _finite(body)
            self._cache = (time.monotonic(), key, body)
            return body

    def relay_urls(self) -> list[str]:
        from veriroll.shardcast.fetch import normalize_relay_url

        urls = list(self.coord.service.policy.relays)
        origin = getattr(self.coord, "origin_url", None)
        if origin:
            urls.append(origin)
        return list(dict.fromkeys(normalize_relay_url(u) for u in urls))

    async def poll_relays(self, session: aiohttp.ClientSession) -> None:
        """Ask every announced relay which versions it holds; export them as ``veriroll_relay_version``."""
        metrics = self.coord.service.metrics

        async def one(url: str) -> dict:
            entry = {"url": url, "ok": False, "latest": None, "versions": [], "error": "",
                     "checked_ms": self.coord.service.clock()}
            try:
                async with session.get(url + "/versions", timeout=aiohttp.ClientTimeout(total=RELAY_TIMEOUT_S)) as r:
                    if r.status != 200:
                        raise ValueError(f"HTTP {r.status}")
                    data = await r.json(content_type=None)
                entry.update(ok=True, latest=data.get("latest"), versions=list(data.get("versions") or []))
            except (aiohttp.ClientError, TimeoutError, ValueError, json.JSONDecodeError) as exc:
                entry["error"] = str(exc) or type(exc).__name__
            return entry

        urls = self.relay_urls()
        results = await asyncio.gather(*(one(u) for u in urls))
        self.relays = {e["url"]: e for e in results}
        metrics.relay_versions.clear()
        metrics.relay_up.clear()
        for e in results:
            metrics.relay_up.set(1 if e["ok"] else 0, relay=e["url"])
            metrics.relay_versions.set(e["latest"] if e["latest"] is not None else -1, relay=e["url"])


# --- the handlers (translation only) --------------------------------------------------------------------


class BadParameter(VerirollError, ValueError):
    """A query parameter that is not in its allowed range; answered 400, never logged."""

    def __init__(self, name: str, allowed: str):
        super().__init__(f"{name} must be {allowed}")
        self.name, self.allowed = name, allowed


def parse_number(query, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False,
                 integer: bool = False) -> float:
    """``query[name]`` as a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), or ``default`` if absent.

    Raises :class:`BadParameter` for anything else: empty, repeated, not a number, nan/inf, out of range,
    or (with ``integer``) not a whole number. Nothing is clamped: the caller is told what is allowed."""
    def show(x: float) -> str:
        return str(int(x)) if float(x).is_integer() else f"{x:g}"

    allowed = ("an integer" if integer else "a number") + f" in {'(' if lo_open else '['}{show(lo)}, {show(hi)}]"
    values = query.getall(name, [])
    if not values:
        return default
    if len(values) != 1 or len(values[0]) > 32:
        raise BadParameter(name, allowed)
    try:
        value = int(values[0]) if integer else float(values[0])
    except ValueError:
        raise BadParameter(name, allowed) from None
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        raise BadParameter(name, allowed)
    return value


def grpc_call_counts() -> dict[str, int]:
    """Calls gRPC itself counted on this process's gRPC servers (channelz): started, succeeded, failed.

    ``failed`` includes the calls gRPC refused before the edge saw them (a body over the transport cap,
    the concurrent-call limit), which carry no veriroll reason. Empty where channelz is not available.
    """
    try:
        from grpc._cython import cygrpc  # channelz's only API short of the grpcio-channelz package

        servers = json.loads(cygrpc.channelz_get_servers(0)).get("server", [])
    except (ImportError, AttributeError, ValueError):
        return {}
    totals = {"started": 0, "succeeded": 0, "failed": 0}
    for server in servers:
        data = server.get("data", {})
        for result in totals:
            totals[result] += int(data.get("calls" + result.capitalize(), 0))
    return totals


def make_app(coord, source: StatusSource) -> web.Application:
    metrics = coord.service.metrics
    grpc_calls = metrics.registry.gauge("veriroll_grpc_calls", "calls gRPC counted since start by result (started, "
                                        "succeeded, failed); failed includes refusals before the edge, such as "
                                        "bodies over the transport cap", ("result",), mode="livesum")

    async def metrics_handler(request: web.Request) -> web.Response:
        summary = await coord.service.refresh_gauges()
        metrics.open_leases.set(summary["open_leases"])
        for result, n in grpc_call_counts().items():
            grpc_calls.set(n, result=result)
        db = coord.db
        metrics.store_writer_seconds.set(db.writer_busy_s, clock="wall")
        metrics.store_writer_seconds.set(db.writer_cpu_s, clock="cpu")
        metrics.store_writer_ops.set(db.writer_ops)
        metrics.store_writer_batches.set(db.writer_batches)
        if db.round_trips is not None:
            metrics.store_round_trips.set(db.round_trips)
        return web.Response(text=metrics.registry.render(), content_type="text/plain",
                            headers={"Cache-Control": "no-cache"}, charset="utf-8")

    async def healthz(request: web.Request) -> web.Response:
        try:
            # Healthy is: the store answers (any cheap read will do).
            await asyncio.wait_for(coord.db.run(st.queued_groups), timeout=5)
        except Exception as exc:  # noqa: BLE001 - any failure to reach the store is "unhealthy"
            return web.json_response({"ok": False, "error": f"database: {exc or type(exc).__name__}"}, status=503)
        # The version this process tells nodes, read from its one holder (policy.PolicyState).
        return web.json_response({"ok": True, "policy_version": coord.service.policy.version,
                                  "time_ms": coord.service.clock()},
                                 headers={"Cache-Control": "no-cache"})

    async def status(request: web.Request) -> web.Response:
        try:
            window = parse_number(request.query, "window_s", DEFAULT_WINDOW_S, 0, MAX_WINDOW_S, lo_open=True)
            points = int(parse_number(request.query, "points", MAX_HISTORY_POINTS, 1, MAX_HISTORY_POINTS, integer=True))
        except BadParameter as exc:
            return web.json_response({"error": str(exc), "parameter": exc.name, "allowed": exc.allowed}, status=400,
                                     headers={"Cache-Control": "no-cache"})
        body = await source.status(window, points)
        return web.json_response(body, headers={"Cache-Control": "no-cache"})

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @web.middleware
    async def security_headers(request: web.Request, handler):
        response = await handler(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    app = web.Application(middlewares=[_head_deadlines, security_headers], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/", index)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/status", status)
    app.router.add_static("/static/", STATIC_DIR, show_index=False, follow_symlinks=False)
    return app


async def _relay_loop(source: StatusSource) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                await source.poll_relays(session)
            except Exception:  # keep polling; one bad round must not end the loop
                log.exception("relay poll failed")
            await asyncio.sleep(RELAY_POLL_S)


async def start_http(coord) -> web.AppRunner:
    """Serve the operator's HTTP port for ``coord``; sets ``coord.http_port`` and registers cleanup."""
    server_cfg = coord.cfg.server
    source = StatusSource(coord)
    app = make_app(coord, source)
    # The head deadlines of _LimitedConnection decide (and count) when an idle connection goes; aiohttp's
    # own keep-alive timer is set past them, a backstop only.
    backstop_s = 2 * max(server_cfg.idle_timeout_s, server_cfg.handshake_timeout_s)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_WAIT_S,
                           keepalive_timeout=backstop_s, max_line_size=MAX_REQUEST_LINE,
                           max_field_size=MAX_HEADER_FIELD, max_headers=MAX_HEADERS)
    await runner.setup()
    limits = ConnectionLimits(PeerGate(server_cfg.http_connections_per_address),
                              first_head_s=server_cfg.handshake_timeout_s, idle_s=server_cfg.idle_timeout_s,
                              refused=coord.service.metrics.registry.counter(
                                  "veriroll_http_refused_total", "connections to the HTTP port closed by a limit, "
                                  "by reason (connections, connections_per_address, request_head_timeout)",
                                  ("reason",)),
                              max_open=coord.descriptors.http_connections)  # set before the ports start
    site = _LimitedSite(runner, server_cfg.host, server_cfg.http_port, limits,
                        reuse_port=server_cfg.reuse_port or coord.cfg.role == "edge")
    await site.start()
    coord.http_port = site.port
    coord.http_status = source
    poller = asyncio.create_task(_relay_loop(source), name="veriroll-relay-poll")

    async def close() -> None:
        poller.cancel()
        try:
            await poller
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
            pass
        await runner.cleanup()

    coord.closers.append(close)
    log.info("dashboard and metrics on http://%s:%d/", server_cfg.host, coord.http_port)
    return runner


# --- connection limits ----------------------------------------------------------------------------------
# aiohttp has no per-address connection limit and no deadline for a request head (a client sending its
# headers a byte at a time held a connection for as long as it liked), so each accepted connection is
# wrapped before aiohttp sees it.


@dataclass
class ConnectionLimits:
    """What one HTTP port allows: connections in all (``max_open``) and per address, and how long a request
    head may take to arrive (``first_head_s`` from connecting, ``idle_s`` from the end of the previous request)."""

    connections: PeerGate
    first_head_s: float
    idle_s: float
    refused: Counter
    max_open: int = 256
    open: int = 0


class _LimitedConnection(asyncio.Protocol):
    """One accepted connection in front of aiohttp's protocol: counted against its address's limit (closed
    at once over it, before aiohttp sees it), and closed unless each request head arrives before its deadline."""

    def __init__(self, make_inner, limits: ConnectionLimits):
        self._make_inner, self._limits = make_inner, limits
        self._inner: asyncio.Protocol | None = None  # aiohttp's protocol, made once the connection is admitted
        self._address = ""
        self._transport: asyncio.Transport | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._served = 0

    def connection_made(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if peer else "unknown"
        limits = self._limits
        if limits.open >= limits.max_open:
            limits.refused.inc(reason="connections")
            transport.abort()
            return
        if not limits.connections.acquire(address):
            limits.refused.inc(reason="connections_per_address")
            transport.abort()
            return
        limits.open += 1
        self._address, self._transport, self._inner = address, transport, self._make_inner()
        self._expect_head(self._limits.first_head_s)
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._inner is None:
            return
        self._cancel_deadline()
        self._limits.connections.release(self._address)
        self._limits.open -= 1
        inner, self._inner = self._inner, None
        inner.connection_lost(exc)

    def request_started(self) -> None:
        self._cancel_deadline()

    def request_finished(self) -> None:
        self._served += 1
        if self._inner is not None:
            self._expect_head(self._limits.idle_s)

    def _expect_head(self, within_s: float) -> None:
        self._cancel_deadline()
        self._deadline = asyncio.get_running_loop().call_later(within_s, self._head_too_late)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_too_late(self) -> None:
        self._deadline = None
        if self._served == 0:  # idle after answered requests is ordinary keep-alive; before any, it is not
            self._limits.refused.inc(reason="request_head_timeout")
        self._transport.abort()


@web.middleware
async def _head_deadlines(request: web.Request, handler):
    """A request being served has no head deadline; the next head's runs from the end of this one."""
    connection = request.transport.get_protocol() if request.transport is not None else None
    if not isinstance(connection, _LimitedConnection):
        return await handler(request)
    connection.request_started()
    try:
        return await handler(request)
    finally:
        connection.request_finished()


class _LimitedSite(web.BaseSite):
    """A TCP site whose connections go through :class:`_LimitedConnection`."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limits: ConnectionLimits, *,
                 reuse_port: bool = False):
        super().__init__(runner)
        self._host, self._port, self._limits, self._reuse_port = host, port, limits, reuse_port

    @property
    def port(self) -> int:
        return int(self._server.sockets[0].getsockname()[1]) if self._server is not None else self._port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        make_protocol, limits = self._runner.server, self._limits
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _LimitedConnection(make_protocol, limits), self._host, self._port, reuse_address=True,
            reuse_port=self._reuse_port or None)
