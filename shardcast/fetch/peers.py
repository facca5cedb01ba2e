"""Shards from peers of the swarm first, and from the relays only what no live peer holds.

With a running Swarm (``swarm/host.py``), every second each announced peer holding the version is asked
which of its shards it has (one stream per peer); the rarest wanted shard goes first, to a peer chosen at
random weighted by measured throughput, never more at once to one peer than it serves to one peer (less
when it answered BUSY), and a busy peer is waited for. The relays serve at once this node's stripe (its
share of the shards, by its rank among the peers, so that nodes fetching at once take different shards from
the origin and then trade them), another node's stripe once that node has had time to fetch it, and whatever
is left when the peers stop delivering or none is left. A peer's bytes are hashed on arrival like a relay's;
a peer that sends bad ones is banned by the swarm and named in ``FetchResult.bad_peers``; one that stalls,
cannot be reached or lied about what it holds is backed off and, after a few failures in a row, dropped for
the fetch. Every shard verified here is served to peers at once, and the version whole once it is ready.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

from ..manifest import Manifest
from ..store import raise_if_disk_full
from ..swarm.errors import BadPeerError, PeerError, PeerNotAnnouncedError
from ..swarm.wire import Refusal
from . import disk
from .download import SHARD, _Job, download_all
from .relays import EWMA_ALPHA, PRIOR_BPS
from .results import RelayIncident

if TYPE_CHECKING:
    from .version import _Fetch

log = logging.getLogger("veriroll.shardcast.fetch")

PEER_ASK_EVERY_S = 1.0  # how often peers are asked what they hold while shards are missing (and polled)
PEER_BUSY_WAIT_S = 0.5  # a busy peer is asked again after about this long
PEER_BACKOFF_S = 1.0  # wait after a peer's first failure in a row; doubles with each further one
MAX_PEER_STRIKES = 4  # failures in a row before a peer is dropped for the fetch
WINDOW_GROWTH = 8  # a window grows by one shard after this many windows of shards served without BUSY
MIN_PATIENCE_S = 2.0  # least wait, per step of distance in the ring, before fetching another node's stripe


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


async def download_with_peers(fetch: _Fetch, manifest: Manifest, fds: dict[str, int], todo: list[_Job]) -> int:
    """Peers first, relays for what no peer holds (module docstring); returns bytes of whole shards accepted."""
    if fetch.swarm is None:
        return await download_all(fetch, manifest, fds, todo)
    ids = fetch.peer_ids if fetch.peer_ids is not None else fetch.swarm.peers_for(manifest.version)
    peers = [_Peer(p) for p in dict.fromkeys(ids)]
    if not peers:
        return await download_all(fetch, manifest, fds, todo)
    accepted = 0
    pieces = [j for j in todo if j.piece]
    if pieces:  # delta pieces come from relays only; a shard whose piece fails joins the swarm's part below
        accepted += await download_all(fetch, manifest, fds, pieces)
    remaining = {j.shard for j in todo if not j.piece} - fetch.done
    if remaining:
        before = fetch.bytes_from_peers
        accepted += await _SwarmSchedule(fetch, manifest, fds, peers, remaining).run()
        accepted += fetch.bytes_from_peers - before
    return accepted


async def _ask_peer(fetch: _Fetch, manifest: Manifest, peer: _Peer) -> None:
    """Refresh ``peer.held`` with what it says it holds (a claim: what it sends is hashed)."""
    try:
        peer.held = await fetch.swarm.shards_held_by(peer.peer_id, manifest)
        peer.heard = True
    except PeerError as exc:
        _report_peer(fetch, peer, exc, None)


async def _shard_from_peer(fetch: _Fetch, manifest: Manifest, fds: dict[str, int], idx: int, peer: _Peer) -> None:
    """Get shard ``idx`` from ``peer``; a failure is reported and leaves the shard to the schedule."""
    shard = manifest.shards[idx]
    t0 = time.monotonic()
    try:
        data = await fetch.swarm.fetch_shard(peer.peer_id, shard.sha256, shard.size)
    except PeerError as exc:
        _report_peer(fetch, peer, exc, idx)
        return
    peer.record_success(shard.size, time.monotonic() - t0)
    try:
        await asyncio.get_running_loop().run_in_executor(None, disk._write_at, fds[shard.file], [data], shard.offset)
    except OSError as exc:
        raise_if_disk_full(exc, fetch.staging / shard.file)
        raise
    fetch.bytes_from_peers += shard.size
    fetch.shards_from_peers += 1
    fetch.advance(shard.size)
    fetch.mark_done(idx)


def _report_peer(fetch: _Fetch, peer: _Peer, exc: PeerError, shard: int | None) -> None:
    incident = RelayIncident(peer.peer_id, str(exc.reason), shard, exc.detail)
    peer.heard = True
    if isinstance(exc, BadPeerError):
        peer.skip = True
        fetch.bad_peers.append(incident)
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
    fetch.failures.append(incident)
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
                            ask_tasks[asyncio.create_task(_ask_peer(fetch, self.manifest, p))] = p
                holders = {i: [p for p in live if i in p.held] for i in wanted}
                if relay_task is None:
                    relay_batch = self._relay_batch(now, live, holders)
                    if relay_batch:
                        relay_task = asyncio.create_task(
                            download_all(fetch, self.manifest, self.fds, [_Job(SHARD, i) for i in relay_batch]))
                        wanted -= set(relay_batch)
                for i in sorted((i for i in wanted if holders[i]), key=lambda i: (len(holders[i]), random.random())):
                    if len(shard_tasks) >= fetch.concurrency:
                        break
                    free = [p for p in holders[i] if p.inflight < self._cap(p) and p.ready_at <= now]
                    if free:
                        peer = random.choices(free, weights=[p.weight(self._prior_bps()) for p in free])[0]
                        task = asyncio.create_task(_shard_from_peer(fetch, self.manifest, self.fds, i, peer))
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
