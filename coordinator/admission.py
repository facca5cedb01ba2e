"""The door: replay protection and rate limits, applied before any request touches state.

The nonce store remembers every accepted nonce until its timestamp leaves the window, so a replay is
refused whether it arrives inside the window (seen nonce) or after it (timestamp too old). After a
restart the store is empty, so requests signed before the process started are refused as well
(``not_before``): a node's retry simply signs again with a fresh timestamp.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from veriroll.protos.envelope import SignedHeaders
from veriroll.protos.reasons import Reason


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
        self._buckets: dict[object, TokenBucket] = {}

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
    """The IP of a gRPC peer string (``ipv4:127.0.0.1:5432``, ``ipv6:[::1]:5432``), without the port."""
    if not peer:
        return "unknown"
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


def check_envelope_time(nonces: NonceStore, headers: SignedHeaders, now_ms: int) -> Reason | None:
    return nonces.check_time(headers.ts_ms, now_ms)
