"""N nodes fetching one version at once through the swarm and an origin: what benchmarks measure.

Every node runs its own Swarm (its own libp2p host and trio thread) in this process and is announced to
every other; all start fetching together. The figures are those of the issue: how many copies of the
version the origin had to serve (``origin_copies``; 1.0 is the floor, ``nodes`` is no swarm at all) and
when each node had it whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from veriroll.protos.identity import PublicKey

from ..fetch import FetchResult, fetch_version, normalize_relay_url
from .hints import PeerHint, PeerHints
from .host import Swarm
from .wire import SwarmLimits


@dataclass(frozen=True)
class SwarmBroadcast:
    """What one broadcast of a version to ``len(completion_s)`` nodes cost and took."""

    version_bytes: int
    origin_bytes: int  # shard bytes the origin URLs served, all nodes together (manifests not counted)
    peer_bytes: int  # shard bytes that nodes got from each other
    completion_s: list[float]  # per node, seconds from the common start until its copy was ready
    bad_peers: int  # incidents of peers serving bad bytes (0 unless a node lies)

    @property
    def origin_copies(self) -> float:
        return self.origin_bytes / self.version_bytes if self.version_bytes else 0.0

    def time_to_fraction_s(self, fraction: float) -> float:
        """Seconds until ``fraction`` of the nodes held the version (0.95: the issue's ``time_to_95pct_s``)."""
        done = sorted(self.completion_s)
        needed = math.ceil(round(fraction * len(done), 9))  # round: 0.95 * 20 must need 19 nodes, not 20
        return done[min(len(done), max(1, needed)) - 1]


async def broadcast_over_swarm(
    origin_urls: Sequence[str] | Sequence[Sequence[str]],
    coordinator_key: PublicKey,
    version: int,
    nodes: int,
    workdir: str | os.PathLike,
    *,
    swarm: bool = True,
    listen_host: str = "127.0.0.1",
    limits: SwarmLimits | None = None,
    peer_addr: Callable[[int, str], Awaitable[str]] | None = None,
    **fetch_options,
) -> SwarmBroadcast:
    """Have ``nodes`` nodes fetch ``version`` at once from ``origin_urls`` (relays or the origin) and each other.

    ``swarm=False`` runs the same nodes with no swarm (relays only), for the comparison. Each node's copy
    goes to ``workdir/node-<i>``. ``peer_addr(i, listen_addr)``: the address the other nodes are to dial
    node ``i`` at, e.g. a shaping proxy started in front of its listen address (libp2p authenticates the
    peer id, not the address, so a plain TCP proxy in between is fine). ``fetch_options`` go to every
    ``fetch_version`` (e.g. ``fsync=False``).
    """
    workdir = Path(workdir)
    # One list for every node, or a list per node (e.g. each node's own route to the origin through its link).
    per_node = [list(u) for u in origin_urls] if origin_urls and not isinstance(origin_urls[0], str) else \
        [list(origin_urls)] * nodes
    if len(per_node) != nodes:
        raise ValueError(f"{len(per_node)} lists of origin URLs for {nodes} nodes")
    swarms = [Swarm(listen=f"/ip4/{listen_host}/tcp/0", limits=limits) for _ in range(nodes)] if swarm else []
    try:
        for s in swarms:
            await s.start()
        hints = []
        for i, s in enumerate(swarms):
            addrs = tuple(s.addrs) if peer_addr is None else tuple([await peer_addr(i, a) for a in s.addrs])
            hints.append(PeerHint(s.peer_id, addrs, (version,)))
        everyone = PeerHints(version, tuple(hints))
        for s in swarms:
            s.announce(everyone)
        t0 = time.monotonic()

        async def one(i: int) -> tuple[FetchResult, float]:
            result = await fetch_version(
                per_node[i], coordinator_key, workdir / f"node-{i}", version,
                swarm=swarms[i] if swarms else None, progress=False, **fetch_options,
            )  # fmt: skip
            return result, time.monotonic() - t0

        results = await asyncio.gather(*(one(i) for i in range(nodes)))
    finally:
        for s in swarms:
            with contextlib.suppress(Exception):
                await s.stop()
    origins = {normalize_relay_url(u) for urls in per_node for u in urls}
    return SwarmBroadcast(
        version_bytes=results[0][0].manifest.total_size,
        origin_bytes=sum(stats.bytes for r, _ in results for url, stats in r.relays.items() if url in origins),
        peer_bytes=sum(r.bytes_from_peers for r, _ in results),
        completion_s=[seconds for _, seconds in results],
        bad_peers=sum(len(r.bad_peers) for r, _ in results),
    )
