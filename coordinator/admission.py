"""The door: replay protection, rate limits and the cost of a new identity, before any request touches state.

The nonce store remembers every accepted nonce until its timestamp leaves the window, so a replay is
refused whether it arrives inside the window (seen nonce) or after it (timestamp too old). After a
restart the store is empty, so requests signed before the process started are refused as well
(``not_before``): a node's retry simply signs again with a fresh timestamp.

Keys are free, so a key the coordinator has never seen pays twice before it is stored: a proof of work
bound to it (:func:`check_register_pow`, ``protos/pow.py``), then a place in the hourly budget of new
keys of its address and of its /24 (IPv6 /64) (:class:`NewIdentityLimiter`). Known keys pay neither.
"""

from __future__ import annotations

import heapq
import ipaddress
import time
from collections.abc import Callable, Iterable

from veriroll.coordinator import store as st
from veriroll.protos.envelope import SignedHeaders
from veriroll.protos.netaddr import host_key, ip_of, prefix_key
from veriroll.protos.pow import Challenge
from veriroll.protos.ratelimit import BucketMap
from veriroll.protos.reasons import Reason
from veriroll.protos.v1 import coordinator_pb2 as pb


class NonceStore:
    """Nonces seen within ``window_ms`` either side of now; bounded by the rate limits upstream."""

    def __init__(self, window_ms: int, *, not_before_ms: int | None = None):
        self.window_ms = window_ms
        self.not_before_ms = int(time.time() * 1000) if not_before_ms is None else not_before_ms
        self._seen: set[tuple[bytes, str]] = set()
        self._expiry: list[tuple[int, tuple[bytes, str]]] = []

    def _evict(self, now_ms: int) -> None:
        while self._expiry and self._expiry[0][0] < now_ms:
            _, key = heapq.heappop(self._expiry)
            self._seen.discard(key)

    def check_time(self, ts_ms: int, now_ms: int) -> Reason | None:
        if abs(now_ms - ts_ms) > self.window_ms:
            return Reason.CLOCK_SKEW
        if ts_ms < self.not_before_ms:
            # Signed before this process started: its nonce may have been used against the previous one.
            return Reason.REPLAYED_NONCE
        return None

    def use(self, public_key: bytes, nonce: str, ts_ms: int, now_ms: int) -> bool:
        """Record ``nonce``; False if it was already used by this key inside the window."""
        self._evict(now_ms)
        key = (public_key, nonce)
        if key in self._seen:
            return False
        self._seen.add(key)
        # Keep it until its timestamp can no longer pass check_time.
        heapq.heappush(self._expiry, (ts_ms + self.window_ms + 1, key))
        return True

    def __len__(self) -> int:
        return len(self._seen)


class RateLimiter(BucketMap):
    """Requests per second per key (node key, address key), of which ``max_keys`` are kept; the edge
    processes sharing a store each enforce their share of it (:meth:`split`)."""

    def __init__(self, rate: float, burst: float, *, max_keys: int = 100_000):
        super().__init__(rate, burst, max_keys=max_keys)
        self.configured = (rate, burst)

    def split(self, parts: int) -> None:
        """Enforce ``1/parts`` of the configured rate and burst: the other ``parts - 1`` edge processes
        enforce the rest. The burst stays at least one request, or nothing would ever pass."""
        rate, burst = self.configured
        self.set_rate(rate / parts, max(1.0, burst / parts))

    def allow(self, key: object, now: float | None = None) -> bool:
        """Take one request from ``key``'s bucket; False (nothing taken) when it is empty."""
        return self.take(key, 1.0, now)


def check_envelope_time(nonces: NonceStore, headers: SignedHeaders, now_ms: int) -> Reason | None:
    return nonces.check_time(headers.ts_ms, now_ms)


# --- the cost of a new identity -----------------------------------------------------------------------


class NewIdentityLimiter:
    """How many NEW keys one address and one /24 (IPv6: /64) may register per hour.

    Call :meth:`allow` only for a key the coordinator does not know yet, and only once its proof of work
    passed, so that refused attempts do not spend an honest neighbour's budget. A token is taken from
    both the address's and the prefix's bucket, or from neither. ``per_hour`` 0 switches a level off.
    Memory: at most ``max_tracked`` buckets per level.
    """

    def __init__(self, *, per_hour_per_address: float, burst_per_address: float, per_hour_per_prefix: float,
                 burst_per_prefix: float, prefix_v4: int = 24, prefix_v6: int = 64, exempt: Iterable[str] = (),
                 max_tracked: int = 50_000, clock: Callable[[], float] = time.monotonic):
        self.prefix_v4, self.prefix_v6 = prefix_v4, prefix_v6
        self.exempt = [ipaddress.ip_network(net, strict=False) for net in exempt]
        self.clock = clock
        # A bucket is kept only once a token is taken from it (refusals cost a neighbour nothing).
        self.by_address = BucketMap(per_hour_per_address / 3600.0, burst_per_address, max_keys=max_tracked)
        self.by_prefix = BucketMap(per_hour_per_prefix / 3600.0, burst_per_prefix, max_keys=max_tracked)

    @classmethod
    def from_config(cls, cfg, *, shared_db=None) -> NewIdentityLimiter | SharedNewIdentityLimiter:
        """From the coordinator's ``[identity]`` section (``coordinator.config.IdentityConfig``); kept in
        ``shared_db`` when given (a store that other edge processes share), else in this process."""
        if shared_db is not None:
            return SharedNewIdentityLimiter(cls.from_config(cfg), shared_db)
        return cls(per_hour_per_address=cfg.new_per_hour_per_address, burst_per_address=cfg.new_burst_per_address,
                   per_hour_per_prefix=cfg.new_per_hour_per_prefix, burst_per_prefix=cfg.new_burst_per_prefix,
                   prefix_v4=cfg.prefix_v4, prefix_v6=cfg.prefix_v6, exempt=cfg.exempt_networks,
                   max_tracked=cfg.max_tracked)

    def levels(self, address: str) -> list[tuple[BucketMap, str, str]]:
        """The budgets a new key from ``address`` takes from: (budget, key, what it is), the address's then
        the prefix's, leaving out levels switched off and every level of an exempt network."""
        ip = ip_of(address)
        if ip is not None and any(ip in net for net in self.exempt):
            return []
        host, network = host_key(address), prefix_key(address, v4=self.prefix_v4, v6=self.prefix_v6)
        return [(budget, key, what) for budget, key, what in (
            (self.by_address, host, f"address {host}"), (self.by_prefix, network, f"network {network}"))
            if budget.rate > 0]

    def allow(self, address: str) -> tuple[Reason, str] | None:
        """None when a new key from ``address`` may register now (a token is taken); else the refusal and why."""
        levels = self.levels(address)
        now = self.clock()
        for budget, key, what in levels:
            if (tokens := budget.level(key, now)) < 1.0:
                return over_new_key_limit(what, budget.rate, budget.burst, tokens)
        for budget, key, _ in levels:
            budget.spend(key, 1.0, now)
        return None

    async def take(self, address: str) -> tuple[Reason, str] | None:
        """:meth:`allow`, with the signature of :meth:`SharedNewIdentityLimiter.take`."""
        return self.allow(address)


def over_new_key_limit(what: str, per_s: float, burst: float, tokens: float) -> tuple[Reason, str]:
    wait_s = (1.0 - tokens) / per_s
    return (Reason.NEW_IDENTITY_LIMITED, f"{what} is over its limit of new keys ({per_s * 3600:g} per hour, "
                                         f"{burst:g} at once); retry in {wait_s:.0f} s")


class SharedNewIdentityLimiter:
    """:class:`NewIdentityLimiter`'s budgets kept in the store, so that they hold across every edge process
    that shares it: N edges give an address one budget, not N.

    One store round trip per Register of an unknown key (rare, and it already paid a proof of work): both
    levels are taken in one transaction, each by one atomic statement, or neither (``store.take_from_bucket``,
    ``store.return_to_bucket``). The address parsing, exemptions and limits are ``limits``'s.
    """

    def __init__(self, limits: NewIdentityLimiter, db, *, clock_ms: Callable[[], float] = lambda: time.time() * 1000):
        self.limits = limits
        self.db = db
        self.clock_ms = clock_ms

    async def take(self, address: str) -> tuple[Reason, str] | None:
        """None when a new key from ``address`` may register now (a token was taken from every level in the
        store); else the refusal and why. Raises ``store.StoreUnavailable`` when the store is down."""
        budgets = [("new_keys_address" if budget is self.limits.by_address else "new_keys_prefix", key, what,
                    st.BucketRate(budget.rate, budget.burst)) for budget, key, what in self.limits.levels(address)]
        if not budgets:
            return None
        now = self.clock_ms()

        def take_all(conn) -> tuple[str, st.BucketRate, float] | None:
            taken = []
            for kind, key, what, rate in budgets:
                if not st.take_from_bucket(conn, kind, key, rate, 1.0, now):
                    for taken_kind, taken_key, taken_rate in taken:
                        st.return_to_bucket(conn, taken_kind, taken_key, taken_rate, 1.0)
                    return what, rate, st.bucket_level(conn, kind, key, rate, now)
                taken.append((kind, key, rate))
            return None

        refused = await self.db.run(take_all)
        if refused is None:
            return None
        what, rate, tokens = refused
        return over_new_key_limit(what, rate.per_s, rate.burst, tokens)


def check_register_pow(required_bits: int, coordinator_key: bytes, req: pb.RegisterRequest,
                       headers: SignedHeaders) -> tuple[Reason, str] | None:
    """None when ``req`` carries ``required_bits`` of work for its key, this coordinator and the signed timestamp.

    Otherwise ``pow_required`` (no proof, or one solved at fewer bits than now required) or ``pow_invalid``
    (claims enough bits but does not hash to them), each with the challenge the node must solve in the
    detail. One SHA-256: cheap enough for every Register of an unknown key. Never a strike.
    """
    if required_bits <= 0:
        return None
    challenge = Challenge(required_bits, bytes(coordinator_key))
    if req.pow_bits < required_bits:
        return Reason.POW_REQUIRED, challenge.detail()
    if not challenge.accepts(headers.public_key.raw, headers.ts_ms, req.pow_nonce):
        return Reason.POW_INVALID, challenge.detail()
    return None
