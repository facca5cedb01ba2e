"""The door every request passes before it touches state: size, deadline, envelope, signature, replay
window, identity, ban and rate checks, in order of cost.

Nothing here knows about gRPC: :meth:`Door.admit` returns the caller or raises :class:`Refusal`, and
the service counts the refusal once (see ``ledger.py``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

from veriroll.coordinator import store as st
from veriroll.coordinator.admission import NonceStore, RateLimiter
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.ledger import Ledger, NodeInfo
from veriroll.coordinator.store import Standing
from veriroll.protos import errors as protos_errors
from veriroll.protos.envelope import SignedHeaders, verify_signature
from veriroll.protos.identity import public_key_problem
from veriroll.protos.netaddr import address_key
from veriroll.protos.reasons import Reason


class Refusal(protos_errors.Refusal):
    """A request refused for ``reason``; ``detail`` is shown to the node. ``counted`` is set once the
    refusal is recorded, so that it is never recorded twice on its way out. ``node_id`` names the caller
    when the door refuses it after looking it up (banned, over its key's rate), so it is counted against it."""

    def __init__(self, reason: Reason, detail: str = "", *, counted: bool = False, node_id: str = ""):
        super().__init__(reason, bounded_detail(detail or reason.message))
        self.counted = counted
        self.node_id = node_id  # the registered node refused, when the door knew it already


MAX_DETAIL_CHARS = 500
"""A refusal's detail goes back in the status message (gRPC metadata, 16 KiB at most) and into the store:
cut here, so that no check can echo an attacker's megabyte back or lose the reason on the way out."""


def bounded_detail(detail: str) -> str:
    return detail if len(detail) <= MAX_DETAIL_CHARS else detail[:MAX_DETAIL_CHARS - 1] + "…"


def banned(node: NodeInfo) -> Refusal:
    """The refusal of a banned key, saying why: the operator's text or the strikes that banned it."""
    return Refusal(Reason.BANNED, f"this key is banned ({node.ban_reason or 'no reason recorded'}); "
                                  "`veriroll node credits` still shows its ledger", node_id=node.node_id)


UNBANNED_METHODS = frozenset({"GetLedger"})
"""What a banned key may still call: reading its own ledger, so a volunteer can learn why it was banned."""

log = logging.getLogger("veriroll.coordinator")


class LiveEdges:
    """How many edge processes serve from the shared store now, so that each enforces its share of the
    per-key and per-address request limits.

    Those limits run on every request, too often for a store trip each. So each edge keeps its buckets in
    memory and enforces 1/N of the configured rate and burst (at least one request of burst), N being the
    edges that wrote their heartbeat row (``store.beat_edge``) within ``TTL_MS``. An edge beats at most
    every ``BEAT_MS``, from its own requests (an idle edge drops out of N after the TTL, and its first
    request beats again); the same write forgets refilled shared buckets (``store.forget_full_buckets``).

    Worst cases: an attacker whose connections land on every edge gets the configured limit in all, plus
    up to 1/(N+1) more for one beat period after an edge starts serving (the others still divide by N).
    An honest node (one connection, so one edge under SO_REUSEPORT or a TCP balancer) gets 1/N of it; a
    killed edge is counted for one TTL more, during which the others enforce less, never more. Routing by
    key instead would give each key its whole limit on one edge, but a restarted or killed edge moves its
    keys to others with full buckets; with 1/N nothing moves. Nonces are in the store either way, so no
    route lets a replay through.
    """

    BEAT_MS = 2000
    TTL_MS = 6000

    def __init__(self, db, clock: Callable[[], int], on_count: Callable[[int], None]):
        self.db = db
        self.clock = clock
        self.on_count = on_count
        self.edge_id = secrets.token_hex(8)
        self.count = 1
        self._due_ms = 0
        self._beating: asyncio.Task | None = None

    def poll(self) -> None:
        """Beat if one is due; called on every request, so it only compares a clock when none is."""
        now = self.clock()
        if now < self._due_ms or (self._beating is not None and not self._beating.done()):
            return
        self._due_ms = now + self.BEAT_MS
        self._beating = asyncio.get_running_loop().create_task(self._beat(now), name="veriroll-edge-beat")

    async def _beat(self, now: int) -> None:
        def beat(conn) -> int:
            st.forget_full_buckets(conn, now)
            return st.beat_edge(conn, self.edge_id, now, self.TTL_MS)

        try:
            count = await self.db.run(beat)
        except (RuntimeError, *st.DB_ERRORS) as exc:  # the store is down or closing: keep the last count
            log.warning("edge heartbeat failed (%s); still enforcing 1/%d of the request limits", exc, self.count)
            return
        if count != self.count:
            log.info("%d edge processes share the store: each enforces 1/%d of the request limits", count, count)
            self.count = count
            self.on_count(count)


class Door:
    """``shared_nonces``: other edge processes share the store. Nonces are then recorded in the store
    (``store.use_nonces``) rather than in this process's memory, so that a request replayed to another edge
    is refused too, and a restart forgets nothing (requests signed before this process started are then
    fine); and the request rate limits are split among the live edges (:class:`LiveEdges`)."""

    def __init__(self, cfg: CoordinatorConfig, ledger: Ledger, clock: Callable[[], int], *, db=None,
                 shared_nonces: bool = False):
        s = cfg.server
        self.cfg = cfg
        self.ledger = ledger
        self.clock = clock
        self.db = db
        self.shared_nonces = shared_nonces
        self.window_ms = int(s.timestamp_window_s * 1000)
        self.nonces = NonceStore(self.window_ms, not_before_ms=0 if shared_nonces else clock() - 1000)
        self.key_limits = RateLimiter(s.key_rate_per_s, s.key_burst)
        self.peer_limits = RateLimiter(s.peer_rate_per_s, s.peer_burst)
        self.edges = LiveEdges(db, clock, self._split_limits) if shared_nonces else None

    def _split_limits(self, edges: int) -> None:
        self.key_limits.split(edges)
        self.peer_limits.split(edges)

    async def admit(self, method: str, name: str, body: bytes, headers: SignedHeaders, peer: str) -> NodeInfo | None:
        """Signature, replay window, identity, ban and rate checks. Returns the caller (None for a Register
        from a key not yet registered); a banned key only for :data:`UNBANNED_METHODS`."""
        if self.edges is not None:
            self.edges.poll()
        if not self.peer_limits.allow(address_key(peer)):  # one party: its IPv4 address or its IPv6 /64
            raise Refusal(Reason.RATE_LIMITED, "too many requests from this address")
        # parse_headers already refused these; checked again (a cached lookup) so that no signature is
        # ever taken from a small-order or non-canonical key, however the headers were built.
        problem = public_key_problem(headers.public_key.raw)
        if problem is not None:
            raise Refusal(Reason.BAD_KEY, problem)
        now = self.clock()
        skew = self.nonces.check_time(headers.ts_ms, now)
        if skew is Reason.CLOCK_SKEW:
            raise Refusal(Reason.CLOCK_SKEW, f"request time is {(headers.ts_ms - now) / 1000:+.1f}s from the coordinator's "
                                             f"(window ±{self.cfg.server.timestamp_window_s:g}s); fix the node's clock")
        if not verify_signature(headers, method, body):
            raise Refusal(Reason.BAD_SIGNATURE)
        if skew is not None:
            raise Refusal(skew, "request was signed before the coordinator restarted; sign it again")
        if not await self._use_nonce(headers, now):
            raise Refusal(Reason.REPLAYED_NONCE)
        node = await self.ledger.lookup(headers.public_key.node_id)
        if node is not None and node.public_key != headers.public_key.raw:
            raise Refusal(Reason.UNKNOWN_KEY, "node id and key disagree")
        if node is None and name != "Register":
            raise Refusal(Reason.UNKNOWN_KEY)
        if node is not None and node.standing == Standing.BANNED and name not in UNBANNED_METHODS:
            raise banned(node)
        if not self.key_limits.allow(headers.public_key.raw):
            raise Refusal(Reason.RATE_LIMITED, f"too many requests for this key (over {self.key_limits.rate:g}/s, "
                                               f"bursts of {self.key_limits.burst:g})",
                          node_id=node.node_id if node is not None else "")
        return node

    async def _use_nonce(self, headers: SignedHeaders, now: int) -> bool:
        if not self.shared_nonces:
            return self.nonces.use(headers.public_key.raw, headers.nonce, headers.ts_ms, now)
        # Kept until its timestamp can no longer pass the window (as NonceStore keeps it). The requests that
        # share the writer's next transaction record theirs in one statement (one round trip for all).
        expires = headers.ts_ms + self.window_ms + 1
        return await self.db.run_together(st.use_nonces, (headers.public_key.raw, headers.nonce, expires))
