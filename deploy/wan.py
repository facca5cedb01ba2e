"""Emulated WAN links on one machine: a user-space TCP proxy with bandwidth, delay and loss.

The kernel's netem qdisc is not available where veriroll is tested, and on loopback bandwidth is free
and the round trip zero, so nothing there shows how broadcast time and staleness behave on real
links. This proxy puts a link between a client and a server:

- a **link** is one host's access line (:class:`Link`): a token bucket per direction (``down`` into the
  host, ``up`` out of it) shared by every connection that crosses it, and a one-way delay of ``rtt/2``;
- a **route** listens on a port and forwards each connection to a target through the client's link
  and the server's link: client → server bytes pay the client's ``up`` and the server's ``down``, the
  other direction the server's ``up`` and the client's ``down``, and each way is delayed by the sum of
  both links' one-way delays.

The delay is applied per chunk on its way out (a chunk read at ``t`` is written at ``t + delay``), so it
never stalls the bucket: a link stays full however long its pipe. ``loss`` (per MiB) drops a
connection abruptly, as a lossy line that resets it would; clients reconnect and resume.

Profiles read ``rtt=100ms,down=100mbit,up=20mbit[,loss=0.01]`` (:func:`parse_profile`). Rates are in
bits per second (``kbit``, ``mbit``, ``gbit``, or ``bit``); a missing rate is unlimited.

    python -m veriroll.deploy.wan --spec routes.json    # {"links": {name: profile}, "routes": [...]}

stops on SIGTERM or SIGINT at once, closing every connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import signal
import time
from dataclasses import dataclass, field

from veriroll.protos.ratelimit import TokenBucket
from veriroll.protos.signals import then_release_signals

CHUNK = 64 * 1024  # bytes read at a time: 5 ms at 100 Mbit/s, so the delay and the rate stay smooth
QUEUE_CHUNKS = 256  # chunks in flight per direction: a 100 ms pipe at 1 Gbit/s fits
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Profile:
    """One host's access link. Rates in bytes per second (None: unlimited); ``loss``: drops per MiB."""

    rtt_s: float = 0.0
    down_bps: float | None = None
    up_bps: float | None = None
    loss: float = 0.0


def parse_profile(text: str) -> Profile:
    """A :class:`Profile` from ``'rtt=100ms,down=100mbit,up=20mbit,loss=0.01'`` (every key optional).

    Raises ValueError naming the part it cannot read.
    """
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        if not sep or key not in ("rtt", "down", "up", "loss") or key in values:
            raise ValueError(f"WAN profile part {part!r}: expected one each of rtt=, down=, up=, loss=")
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", value)
        units = _TIME_UNITS if key == "rtt" else _RATE_UNITS if key != "loss" else {"": 1.0}
        if match is None or match.group(2) not in units:
            raise ValueError(f"WAN profile part {part!r}: a number with one of the units {sorted(units)}")
        values[key] = float(match.group(1)) * units[match.group(2)]
    if values.get("loss", 0.0) >= 1.0:
        raise ValueError("WAN profile: loss is a probability per MiB, below 1")
    if values.get("down") == 0 or values.get("up") == 0:
        raise ValueError("WAN profile: a rate of 0 would carry nothing (leave it out for unlimited)")
    rate = {k: values[k] / 8 for k in ("down", "up") if k in values}
    return Profile(values.get("rtt", 0.0), rate.get("down"), rate.get("up"), values.get("loss", 0.0))


def line_bucket(rate: float | None) -> TokenBucket | None:
    """The bucket of one way of a line carrying ``rate`` bytes per second (None: unlimited, no bucket).

    Its burst (50 ms of the rate, at least one chunk) keeps a line that was idle from sending a second's
    worth at once."""
    return None if rate is None else TokenBucket(rate, max(CHUNK, rate * 0.05))


async def pace(bucket: TokenBucket, n: int) -> None:
    """Send ``n`` bytes through ``bucket``, shared by everyone on that line: the taker goes into debt and
    sleeps it off, so concurrent takers queue in the order they asked and together get the rate, never more."""
    left = bucket.spend(n)
    if left < 0:
        await asyncio.sleep(-left / bucket.rate)


class Link:
    """One host's access line: its buckets and its one-way delay, shared by all its connections."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.down = line_bucket(profile.down_bps)
        self.up = line_bucket(profile.up_bps)
        self.one_way_s = profile.rtt_s / 2


@dataclass
class Route:
    """Connections to ``listen`` go to ``target`` over the ``client`` link, then the ``server`` link."""

    listen: tuple[str, int]
    target: tuple[str, int]
    client: Link | None = None
    server: Link | None = None
    bytes_to_server: int = 0
    bytes_to_client: int = 0
    connections: int = 0
    dropped: int = 0
    _server: asyncio.AbstractServer | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        """The port it listens on (the bound one, once started)."""
        if self._server is not None and self._server.sockets:
            return self._server.sockets[0].getsockname()[1]
        return self.listen[1]


class _Dropped(Exception):
    """The emulated line lost the connection."""


class WanProxy:
    """Serves :class:`Route` s until stopped. ``async with WanProxy(routes):`` or ``start()``/``stop()``."""

    def __init__(self, routes: list[Route], *, seed: int | None = None):
        self.routes = routes
        self.random = random.Random(seed)
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        for route in self.routes:
            route._server = await asyncio.start_server(
                lambda r, w, route=route: self._spawn(self._connect(route, r, w)), *route.listen
            )

    async def stop(self) -> None:
        """Stop listening and cut every connection now."""
        for route in self.routes:
            if route._server is not None:
                route._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for route in self.routes:
            if route._server is not None:
                await route._server.wait_closed()

    async def __aenter__(self) -> WanProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _connect(self, route: Route, client_reader, client_writer) -> None:
        route.connections += 1
        self._writers.add(client_writer)
        server_writer = None
        try:
            server_reader, server_writer = await asyncio.wait_for(asyncio.open_connection(*route.target), 10)
            self._writers.add(server_writer)
            client, server = route.client, route.server
            up = [b for b in (client and client.up, server and server.down) if b is not None]
            down = [b for b in (server and server.up, client and client.down) if b is not None]
            delay = sum(link.one_way_s for link in (route.client, route.server) if link)
            loss = max((link.profile.loss for link in (route.client, route.server) if link), default=0.0)
            pumps = [self._spawn(self._pump(client_reader, server_writer, up, delay, loss, route, "bytes_to_server")),
                     self._spawn(self._pump(server_reader, client_writer, down, delay, loss, route, "bytes_to_client"))]
            done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() is not None for t in done if not t.cancelled()):
                route.dropped += any(isinstance(t.exception(), _Dropped) for t in done if not t.cancelled())
                for writer in (client_writer, server_writer):
                    writer.transport.abort()
            await asyncio.gather(*pumps, return_exceptions=True)
        except (TimeoutError, OSError):
            pass  # the target is down: the client sees its connection closed, as with a dead host
        finally:
            for writer in (client_writer, server_writer):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()

    async def _pump(self, reader, writer, buckets, delay: float, loss: float, route: Route, counter: str) -> None:
        """Copy one direction: read, pay every bucket, and hand the chunk on to be written ``delay`` later."""
        queue: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)
        failed: list[BaseException] = []

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if chunk is None:
                    if not failed and writer.can_write_eof():
                        with contextlib.suppress(OSError):  # the other end left first: nothing to tell it
                            writer.write_eof()
                    return
                if failed:
                    continue  # keep taking, so the reader never blocks on a queue nobody empties
                try:
                    if (wait := due - time.monotonic()) > 0:
                        await asyncio.sleep(wait)
                    writer.write(chunk)
                    await writer.drain()
                except OSError as exc:
                    failed.append(exc)
                    continue
                setattr(route, counter, getattr(route, counter) + len(chunk))

        sender = self._spawn(deliver())
        try:
            while not failed and (chunk := await reader.read(CHUNK)):
                for bucket in buckets:
                    await pace(bucket, len(chunk))
                if loss and self.random.random() < 1 - (1 - loss) ** (len(chunk) / 2**20):
                    raise _Dropped()
                await queue.put((time.monotonic() + delay, chunk))
            await queue.put((0.0, None))
            await sender
            if failed:
                raise failed[0]
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)


def routes_from_spec(spec: dict) -> list[Route]:
    """Routes from ``{"links": {name: profile text}, "routes": [{"listen": "host:port", "target": "host:port",
    "client": link name or null, "server": link name or null}]}``; one :class:`Link` per name, shared."""
    links = {name: Link(parse_profile(text)) for name, text in spec.get("links", {}).items()}

    def address(text: str) -> tuple[str, int]:
        host, _, port = text.rpartition(":")
        return host or "127.0.0.1", int(port)

    return [Route(address(r["listen"]), address(r["target"]), links.get(r.get("client") or ""),
                  links.get(r.get("server") or "")) for r in spec["routes"]]


async def serve(spec: dict) -> None:
    """Run the routes of ``spec`` until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with WanProxy(routes_from_spec(spec)):
        await stop.wait()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m veriroll.deploy.wan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", required=True, help="JSON file: links (name → profile) and routes")
    args = ap.parse_args(argv)
    with open(args.spec) as fh:
        spec = json.load(fh)
    asyncio.run(then_release_signals(serve(spec)))  # once serving is over, one more signal leaves at once


if __name__ == "__main__":
    main()
