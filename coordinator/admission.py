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
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from veriroll.coordinator import store as st
from veriroll.protos.envelope import SignedHeaders
from veriroll.protos.pow import Challenge
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


@dataclass
class TokenBucket:
    rate: float
    burst: float
    tokens: float = -1.0
    updated: float = field(default_factory=time.monotonic)

    def take(self, now: float | None = None, cost: float = 1.0) -> bool:
        now = time.monotonic() if now is None else now
        if self.tokens < 0:
            self.tokens = self.burst
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False


class RateLimiter:
    """Token buckets keyed by anything (node key, peer address); idle buckets are forgotten."""

    def __init__(self, rate: float, burst: float, *, max_keys: int = 100_000):
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self.configured = (rate, burst)
        self._buckets: dict[object, TokenBucket] = {}

    def split(self, parts: int) -> None:
        """Enforce ``1/parts`` of the configured rate and burst: the other ``parts - 1`` edge processes
        enforce the rest. The burst stays at least one request, or nothing would ever pass."""
        rate, burst = self.configured
        self.rate, self.burst = rate / parts, max(1.0, burst / parts)
        for bucket in self._buckets.values():
            bucket.rate, bucket.burst = self.rate, self.burst
            bucket.tokens = min(bucket.tokens, self.burst)

    def allow(self, key: object, now: float | None = None) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._prune(now if now is not None else time.monotonic())
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst)
        return bucket.take(now)

    def _prune(self, now: float) -> None:
        full_after = self.burst / self.rate if self.rate > 0 else float("inf")
        for k in [k for k, b in self._buckets.items() if now - b.updated > full_after]:
            del self._buckets[k]


def peer_address(peer: str | None) -> str:
    """The IP of a gRPC peer string (``ipv4:127.0.0.1:5432``, ``ipv6:%5B::1%5D:5432``), without the port."""
    if not peer:
        return "unknown"
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":  # gRPC percent-encodes the brackets: ipv6:%5B::1%5D:5432
        return urllib.parse.unquote(rest).rsplit(":", 1)[0].strip("[]")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


def check_envelope_time(nonces: NonceStore, headers: SignedHeaders, now_ms: int) -> Reason | None:
    return nonces.check_time(headers.ts_ms, now_ms)


# --- the cost of a new identity -----------------------------------------------------------------------

UNPARSED = "unknown"  # the one budget shared by every peer whose address does not parse (fail closed)


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``address`` as an IP: IPv4-mapped IPv6 (``::ffff:1.2.3.4``) as the IPv4 it is, no IPv6 zone; None if garbage."""
    try:
        ip = ipaddress.ip_address(address.strip())
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        return ipaddress.IPv6Address(ip.packed)  # drops a zone id ("fe80::1%eth0"): same host either way
    return ip


def prefix_of(address: str, *, v4: int = 24, v6: int = 64, unparsed: str | None = UNPARSED) -> str:
    """The network ``address`` belongs to for the per-prefix budget: ``1.2.3.0/24``, ``2001:db8::/64``.

    IPv4-mapped IPv6 counts as its IPv4. Anything that is not an IP address (``unknown``, ``unix:...``)
    gets ``unparsed`` (default :data:`UNPARSED`: all such peers share one budget rather than escaping the
    limit; None: the address itself).
    """
    ip = _ip(address)
    if ip is None:
        return address if unparsed is None else unparsed
    return str(ipaddress.ip_network((ip, v4 if ip.version == 4 else v6), strict=False))


class _HourlyBudget:
    """Token buckets of ``per_hour`` refilling up to ``burst``, one per key; the ``max_keys`` most recent kept.

    A bucket is stored only when a token is taken, and the least recently used is forgotten first: it
    has been refilling the longest, so forgetting it (it comes back full) loses the least.
    """

    def __init__(self, per_hour: float, burst: float, max_keys: int):
        self.rate = per_hour / 3600.0
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def tokens(self, key: str, now: float) -> float:
        tokens, at = self._buckets.get(key, (self.burst, now))
        return min(self.burst, tokens + max(0.0, now - at) * self.rate)

    def take(self, key: str, tokens: float, now: float) -> None:
        self._buckets[key] = (tokens - 1.0, now)
        self._buckets.move_to_end(key)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)

    def __len__(self) -> int:
        return len(self._buckets)


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
        self.by_address = _HourlyBudget(per_hour_per_address, burst_per_address, max_tracked)
        self.by_prefix = _HourlyBudget(per_hour_per_prefix, burst_per_prefix, max_tracked)

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

    def levels(self, address: str) -> list[tuple[_HourlyBudget, str, str]]:
        """The budgets a new key from ``address`` takes from: (budget, key, what it is), the address's then
        the prefix's, leaving out levels switched off and every level of an exempt network."""
        ip = _ip(address)
        if ip is not None and any(ip in net for net in self.exempt):
            return []
        addr_key = UNPARSED if ip is None else str(ip)
        prefix_key = prefix_of(address, v4=self.prefix_v4, v6=self.prefix_v6)
        return [(budget, key, what) for budget, key, what in (
            (self.by_address, addr_key, f"address {addr_key}"), (self.by_prefix, prefix_key, f"network {prefix_key}"))
            if budget.rate > 0]

    def allow(self, address: str) -> tuple[Reason, str] | None:
        """None when a new key from ``address`` may register now (a token is taken); else the refusal and why."""
        levels = self.levels(address)
        now = self.clock()
        held = [budget.tokens(key, now) for budget, key, _ in levels]
        for (budget, _, what), tokens in zip(levels, held, strict=True):
            if tokens < 1.0:
                return over_new_key_limit(what, budget.rate, budget.burst, tokens)
        for (budget, key, _), tokens in zip(levels, held, strict=True):
            budget.take(key, tokens, now)
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
