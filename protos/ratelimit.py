"""Token buckets: how much of something may happen, and how fast, kept in this process's memory.

A bucket holds ``burst`` tokens at first and refills at ``rate`` tokens per second, never above
``burst``. :meth:`TokenBucket.take` takes a cost only when the bucket holds it (a refused request takes
nothing); :meth:`TokenBucket.spend` takes it whatever is left, so the bucket may go into debt (a cost
known only afterwards, a pace to sleep off), repaid by refill before anything else is taken.

:class:`BucketMap` keeps one bucket per key (a node key, an address, a peer id) with a bound on how
many: past ``max_keys`` the least recently used is forgotten, in O(1) whatever the number of keys ever
seen. It has been refilling the longest, so forgetting it (it comes back full) forgives the least.

Every in-memory limit uses these. Limits that several coordinator edge processes share are kept in the
store instead (``store.take_from_bucket``: the same bucket, one SQL statement per take).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable


def refilled(tokens: float, updated: float, now: float, rate: float, burst: float) -> float:
    """What a bucket that held ``tokens`` at ``updated`` holds at ``now`` (a clock that went back refills nothing)."""
    return min(burst, tokens + max(0.0, now - updated) * rate)


class TokenBucket:
    """``burst`` tokens at first, refilled at ``rate`` per second up to ``burst``. Times are seconds of one
    clock (``time.monotonic`` when not given); not thread-safe."""

    __slots__ = ("rate", "burst", "tokens", "updated")

    def __init__(self, rate: float, burst: float, *, now: float | None = None):
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = self.burst
        self.updated = time.monotonic() if now is None else now

    def level(self, now: float | None = None) -> float:
        """Tokens held at ``now`` (negative: in debt); takes nothing."""
        return refilled(self.tokens, self.updated, time.monotonic() if now is None else now, self.rate, self.burst)

    def take(self, cost: float = 1.0, now: float | None = None) -> bool:
        """Take ``cost`` if the bucket holds it now; False (and nothing taken) if not."""
        now = time.monotonic() if now is None else now
        self.tokens, self.updated = self.level(now), now
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def spend(self, cost: float, now: float | None = None) -> float:
        """Take ``cost`` whatever the bucket holds; the tokens left (negative: the debt)."""
        now = time.monotonic() if now is None else now
        self.tokens, self.updated = self.level(now) - cost, now
        return self.tokens

    def seconds_until(self, tokens: float = 1.0, now: float | None = None) -> float:
        """Seconds until the bucket holds ``tokens`` (0 if it does; infinite if it never will)."""
        missing = tokens - self.level(now)
        if missing <= 0:
            return 0.0
        if self.rate <= 0 or tokens > self.burst:
            return float("inf")
        return missing / self.rate


class BucketMap:
    """One :class:`TokenBucket` per key, all of one ``rate`` and ``burst``; at most ``max_keys`` kept, the
    least recently used forgotten first. A key never seen (or forgotten) has a full bucket."""

    def __init__(self, rate: float, burst: float, *, max_keys: int):
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, not {max_keys}")
        self.rate, self.burst, self.max_keys = float(rate), float(burst), max_keys
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def bucket(self, key: Hashable, now: float | None = None) -> TokenBucket:
        """``key``'s bucket, kept from now on (a new one full at ``now``) and made the most recently used."""
        bucket = self._buckets.get(key)
        if bucket is not None:
            self._buckets.move_to_end(key)
            return bucket
        bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, now=now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return bucket

    def level(self, key: Hashable, now: float | None = None) -> float:
        """Tokens ``key`` holds at ``now``; keeps nothing and takes nothing."""
        bucket = self._buckets.get(key)
        return self.burst if bucket is None else bucket.level(now)

    def take(self, key: Hashable, cost: float = 1.0, now: float | None = None) -> bool:
        """:meth:`TokenBucket.take` from ``key``'s bucket."""
        return self.bucket(key, now).take(cost, now)

    def spend(self, key: Hashable, cost: float, now: float | None = None) -> float:
        """:meth:`TokenBucket.spend` from ``key``'s bucket: the tokens left (negative: the debt)."""
        return self.bucket(key, now).spend(cost, now)

    def set_rate(self, rate: float, burst: float) -> None:
        """Every bucket, kept and new, refills at ``rate`` up to ``burst`` from now on (a bucket over the
        new burst holds the burst)."""
        self.rate, self.burst = float(rate), float(burst)
        for bucket in self._buckets.values():
            bucket.rate, bucket.burst = self.rate, self.burst
            bucket.tokens = min(bucket.tokens, self.burst)

    def __len__(self) -> int:
        """Buckets kept (at most ``max_keys``)."""
        return len(self._buckets)
