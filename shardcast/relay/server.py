"""``RelayServer``: one relay's state and lifecycle; the jobs it does are in the modules it is made of.

- ``catalogue.py``: the versions it serves (held whole, or streaming while a mirror fetches them);
- ``admission.py``: who gets a connection and a transfer slot;
- ``routes.py``: the URL scheme and how each answer is sent;
- ``mirror.py``: the mirror's rounds;
- ``config.py``: ``RelayConfig``, every setting of a relay (and ``relay run``'s flags).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

from veriroll.protos.identity import PublicKey, load_public_key

from .admission import (
    MAX_HEADER_FIELD,
    MAX_HEADERS,
    MAX_REQUEST_LINE,
    Refusal,
    _Admission,
    _listening_sockets,
)
from .catalogue import HeldVersion, StreamingVersion, _Catalogue
from .config import RelayConfig, relay_config
from .mirror import _Mirror
from .routes import _Routes

log = logging.getLogger("veriroll.shardcast.relay")

# Seconds an in-flight answer gets on stop, twice over (aiohttp waits for it, then for its cancellation);
# a transfer cut short is resumed by its client.
_SHUTDOWN_GRACE = 1.0


class RelayServer(_Catalogue, _Admission, _Routes, _Mirror):
    """A relay over ``store``; ``await start()``, then ``url``; ``await stop()`` when done.

    Its settings are ``config`` (a RelayConfig), or RelayConfig's fields as keyword arguments (over
    ``config`` when both are given): ``RelayServer(store, key, port=0, upstreams=[url])``. A value out of
    range is refused here, with the field named (pydantic's ValidationError, a ValueError).
    """

    def __init__(
        self,
        store: str | os.PathLike,
        coordinator_key: PublicKey | str | os.PathLike,
        config: RelayConfig | None = None,
        **settings: Any,
    ):
        self.config = relay_config(config, **settings)
        self.store = Path(store)
        self.key = (
            coordinator_key if isinstance(coordinator_key, PublicKey) else load_public_key(coordinator_key)
        )
        self.host, self.port = self.config.host, self.config.port  # port: the one bound, once started
        self.max_connections = self.config.max_connections  # lowered at start to fit the descriptor limit
        self.fetch_options = {"progress": False, **self.config.fetch_options}
        self._only_on_fallbacks: dict[int, float] = {}  # version -> when a fallback was first seen to hold it alone
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
    def upstreams(self) -> list[str]:
        return self.config.upstreams

    @property
    def fallbacks(self) -> list[str]:
        return self.config.fallbacks

    @property
    def role(self) -> str:
        return "mirror" if self.upstreams else "origin"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ---- lifecycle

    async def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        self.refresh(force=True)
        self._fit_connections_to_descriptors()
        self._runner = web.AppRunner(
            self.make_app(),
            handle_signals=False,
            access_log=None,
            keepalive_timeout=self.config.idle_timeout,
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



async def serve_relay(
    store: str | os.PathLike, coordinator_key, config: RelayConfig | None = None, **settings: Any
) -> None:
    """Run a relay (``config`` and ``settings``: RelayServer's) until SIGINT or SIGTERM, then stop within seconds."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Handlers first: a signal that arrives while the relay starts still stops it, cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    relay = RelayServer(store, coordinator_key, config, **settings)
    await relay.start()
    try:
        await stop.wait()
        log.info("relay on %s stopping", relay.url)
    finally:
        await relay.stop()
