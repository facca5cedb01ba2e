"""Who gets in: connection and transfer limits per relay and per address, and the accept loop that enforces
them before a byte is read (module docstring of ``relay/`` for the rules).

``_Admission`` is part of ``RelayServer``; it uses the server's ``config``, ``max_connections`` (the
effective cap, fitted to the descriptor limit at start), ``_runner`` and ``rejections``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket

from aiohttp import web

from veriroll.protos.errors import RefusalReason
from veriroll.protos.netaddr import address_key

log = logging.getLogger("veriroll.shardcast.relay")

MAX_REQUEST_LINE = 8190  # a 1024-character file name, percent-encoded, fits
MAX_HEADER_FIELD = 4096
MAX_HEADERS = 32
_FD_RESERVE = 128  # descriptors kept for the store, the mirror's fetch and logging


class Refusal(RefusalReason):
    """Why a relay turned a connection or a request away; ``/status`` counts each."""

    CONNECTIONS = "connections"  # max_connections open already: closed at accept
    ADDRESS_CONNECTIONS = "address_connections"  # max_connections_per_address from there: closed at accept
    TRANSFERS = "transfers"  # max_transfers in flight: 503
    ADDRESS_TRANSFERS = "address_transfers"  # max_transfers_per_address from there: 429
    BODY = "body"  # a request with a body: 400 and the connection closed
    NOT_YET = "not-yet"  # bytes of a streaming version not verified within stream_wait: 503


_PER_ADDRESS = (Refusal.ADDRESS_CONNECTIONS, Refusal.ADDRESS_TRANSFERS)


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


class _Admission:
    """Who is let in at accept, the books that count connections by source, and refusals, counted."""

    def _admit(self, source: str) -> Refusal | None:
        """Whether a new connection from ``source`` fits the limits (None) or why not."""
        assert self._runner is not None and self._runner.server is not None
        if len(self._runner.server.connections) >= self.max_connections:
            return Refusal.CONNECTIONS
        limit = self.config.max_connections_per_address
        if limit is not None:
            live = [t for t in self._by_address.get(source, ()) if not t.is_closing()]
            self._by_address[source] = live
            if len(live) >= limit:
                return Refusal.ADDRESS_CONNECTIONS
        return None

    def _book(self, source: str, transport: asyncio.BaseTransport) -> None:
        """Note an accepted connection under its source, for the per-address limit."""
        if self.config.max_connections_per_address is None:
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


    def _refusal(self, reason: Refusal, status: type[web.HTTPException], text: str) -> web.HTTPException:
        self.rejections[reason] += 1
        headers = {"X-Shardcast-Refusal": reason.value}
        if reason is not Refusal.BODY:
            headers["Retry-After"] = "1"
        return status(text=text, headers=headers)


    def _fit_connections_to_descriptors(self) -> None:
        """Lower ``max_connections`` so that connections plus open files fit the descriptor limit.

        Running out of descriptors would break every client, the store and the mirror at once.
        """
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return
        room = soft - self.config.max_transfers - _FD_RESERVE
        if self.max_connections > room:
            log.warning(
                "max_connections lowered from %d to %d: the descriptor limit is %d (raise it with ulimit -n)",
                self.max_connections,
                max(1, room),
                soft,
            )
            self.max_connections = max(1, room)

