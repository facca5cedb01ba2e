"""How much trusted verifier time one identity, one address and one network prefix may use.

Keys cost nothing to make, and every group that passes the cheap intake stages costs the coordinator
a prefill on its trusted weights: without a bound, a few machines with many fresh keys keep the
verifier busy with garbage while honest groups wait. Each of three scopes (the node key, the IP
address, and the address's IPv4 /24 or IPv6 /64) has a token bucket measured in verifier seconds:
it holds at most one minute's allowance and refills at that allowance per minute.

The service asks :meth:`VerifierBudget.reserve` before the verifier runs, and refuses the group as
``rate_limited`` when any of the three buckets is empty; after the verifier ran it pays the measured
seconds with :meth:`VerifierBudget.charge`. A bucket may go below zero (one verification can cost
more than what was left, and a few may be in flight at once, at most one per verifier thread): that
debt is repaid by refill before the next group of that scope is verified. Over ``m`` minutes a scope
uses at most ``m + 1`` minutes' allowance (the full bucket it starts with) plus the overdraw of the
verifications admitted while it still had time left.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from veriroll.coordinator.admission import prefix_of
from veriroll.coordinator.intake import Rejection
from veriroll.protos.reasons import Reason

MAX_KEYS = 65_536
"""Buckets kept per scope. The least recently used goes first: having waited longest, it is the most
likely to be full again, and a full bucket carries nothing a new one would not."""


def network_prefix(address: str) -> str:
    """The /24 of an IPv4 address, the /64 of an IPv6 one (an IPv4-mapped IPv6 address counts as its
    IPv4); anything that is not an IP address (``unknown``, a Unix socket) is its own prefix.

    One subscriber or one cloud tenant usually holds a whole IPv6 /64 and often several addresses of
    one IPv4 /24, so new addresses there are cheap for an attacker; the prefix bounds them together.
    """
    return prefix_of(address, unparsed=None)


class _Buckets:
    """Token buckets of one scope, in verifier seconds, keyed by a string; at most ``max_keys`` kept."""

    def __init__(self, per_minute: float, max_keys: int):
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.max_keys = max_keys
        self._levels: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (seconds left, as of)

    def level(self, key: str, now: float) -> float:
        """Seconds left in ``key``'s bucket at ``now`` (negative: in debt); a key never seen has a full one."""
        left, since = self._levels.get(key, (self.capacity, now))
        return min(self.capacity, left + max(0.0, now - since) * self.rate)

    def take(self, key: str, seconds: float, now: float) -> None:
        self._levels[key] = (self.level(key, now) - seconds, now)
        self._levels.move_to_end(key)
        while len(self._levels) > self.max_keys:
            self._levels.popitem(last=False)

    def __len__(self) -> int:
        return len(self._levels)


class VerifierBudget:
    """Verifier seconds per minute for each node key, IP address and /24 or /64 (0: that scope is not limited).

    Not thread-safe: call it from the service's event loop, not from the verifier's worker threads.
    """

    def __init__(self, per_identity: float, per_address: float, per_prefix: float, *, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic):
        for name, value in (("per_identity", per_identity), ("per_address", per_address), ("per_prefix", per_prefix)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self.clock = clock
        # (scope name, its buckets, how a request maps to its key); scopes set to 0 are left out.
        scopes = (("node key", per_identity, lambda node_id, address: node_id),
                  ("address", per_address, lambda node_id, address: address),
                  ("network", per_prefix, lambda node_id, address: network_prefix(address)))
        self._scopes = [(name, _Buckets(limit, max_keys), key_of) for name, limit, key_of in scopes if limit > 0]

    @classmethod
    def from_config(cls, intake, *, clock: Callable[[], float] = time.monotonic) -> VerifierBudget:
        """The budget that ``intake`` (an :class:`~veriroll.coordinator.config.IntakeConfig`) sets."""
        return cls(intake.verify_seconds_per_minute_per_identity, intake.verify_seconds_per_minute_per_address,
                   intake.verify_seconds_per_minute_per_prefix, clock=clock)

    def reserve(self, node_id: str, address: str) -> Rejection | None:
        """``None`` if the verifier may run for this node key from this address now, else a
        ``rate_limited`` rejection that says which scope is used up and when it has time again.

        It takes nothing: what the verification costs is paid with :meth:`charge` once it is known.
        Asking also before a lease is handed out spares an honest node work that would be refused.
        """
        now = self.clock()
        for name, buckets, key_of in self._scopes:
            key = key_of(node_id, address)
            left = buckets.level(key, now)
            if left <= 0:
                wait = max(1, math.ceil(-left / buckets.rate))
                return Rejection(Reason.RATE_LIMITED, f"this {name} ({key[:64]}) has used its {buckets.capacity:g} s "
                                                      f"of verifier time per minute; retry in {wait} s")
        return None

    def charge(self, node_id: str, address: str, seconds: float) -> None:
        """Pay ``seconds`` of verifier time from every scope of this node key and address."""
        if not seconds > 0:  # nothing spent (or a NaN from a broken timer): nothing to pay
            return
        now = self.clock()
        for _, buckets, key_of in self._scopes:
            buckets.take(key_of(node_id, address), seconds, now)

    def tracked(self) -> dict[str, int]:
        """Buckets held per scope (bounded by ``max_keys`` each)."""
        return {name: len(buckets) for name, buckets, _ in self._scopes}
