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
from collections.abc import Callable

from veriroll.coordinator import store as st
from veriroll.coordinator.intake import Rejection
from veriroll.protos.netaddr import host_key, prefix_key
from veriroll.protos.ratelimit import BucketMap
from veriroll.protos.reasons import Reason

MAX_KEYS = 65_536
"""Buckets kept per scope. The least recently used goes first: having waited longest, it is the most
likely to be full again, and a full bucket carries nothing a new one would not."""


def budget_scopes(per_identity: float, per_address: float, per_prefix: float) -> list[tuple[str, float, Callable]]:
    """(scope name, verifier seconds per minute, how a request's node key and address map to its key) for
    each scope that is limited (0: left out)."""
    for name, value in (("per_identity", per_identity), ("per_address", per_address), ("per_prefix", per_prefix)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    # The address is its host (an IPv4-mapped IPv6 address is its IPv4); the network its /24 or /64: one
    # subscriber or one cloud tenant usually holds a whole IPv6 /64 and often several addresses of one
    # IPv4 /24, so new addresses there are cheap for an attacker. An address that is not an IP counts as
    # netaddr.UNPARSED at both levels.
    scopes = (("node key", per_identity, lambda node_id, address: node_id),
              ("address", per_address, lambda node_id, address: host_key(address)),
              ("network", per_prefix, lambda node_id, address: prefix_key(address)))
    return [scope for scope in scopes if scope[1] > 0]


def out_of_time(scope: str, key: str, per_minute: float, left: float) -> Rejection:
    """The refusal of a scope whose bucket holds ``left`` <= 0 seconds: which, and when it has time again."""
    wait = max(1, math.ceil(-left / (per_minute / 60.0)))
    return Rejection(Reason.RATE_LIMITED, f"this {scope} ({key[:64]}) has used its {per_minute:g} s "
                                          f"of verifier time per minute; retry in {wait} s")


class VerifierBudget:
    """Verifier seconds per minute for each node key, IP address and /24 or /64 (0: that scope is not limited).

    Not thread-safe: call it from the service's event loop, not from the verifier's worker threads.
    """

    def __init__(self, per_identity: float, per_address: float, per_prefix: float, *, max_keys: int = MAX_KEYS,
                 clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        # One minute's allowance per bucket, refilled over a minute.
        self._scopes = [(name, BucketMap(limit / 60.0, limit, max_keys=max_keys), key_of) for name, limit, key_of
                        in budget_scopes(per_identity, per_address, per_prefix)]

    @classmethod
    def from_config(cls, intake, *, clock: Callable[[], float] = time.monotonic,
                    shared_db=None) -> VerifierBudget | SharedVerifierBudget:
        """The budget that ``intake`` (an :class:`~veriroll.coordinator.config.IntakeConfig`) sets; kept in
        ``shared_db`` when given (a store other edge processes share), else in this process."""
        if shared_db is not None:
            return SharedVerifierBudget.from_config(intake, shared_db)
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
                return out_of_time(name, key, buckets.burst, left)
        return None

    def charge(self, node_id: str, address: str, seconds: float) -> None:
        """Pay ``seconds`` of verifier time from every scope of this node key and address."""
        if not seconds > 0:  # nothing spent (or a NaN from a broken timer): nothing to pay
            return
        now = self.clock()
        for _, buckets, key_of in self._scopes:
            buckets.spend(key_of(node_id, address), seconds, now)

    async def check(self, node_id: str, address: str) -> Rejection | None:
        """:meth:`reserve`, with the signature of :meth:`SharedVerifierBudget.check`."""
        return self.reserve(node_id, address)

    async def spend(self, node_id: str, address: str, seconds: float) -> None:
        """:meth:`charge`, with the signature of :meth:`SharedVerifierBudget.spend`."""
        self.charge(node_id, address, seconds)

    def tracked(self) -> dict[str, int]:
        """Buckets held per scope (bounded by ``max_keys`` each)."""
        return {name: len(buckets) for name, buckets, _ in self._scopes}


class SharedVerifierBudget:
    """:class:`VerifierBudget` kept in the store, so that it holds across every edge process sharing it:
    N edges give a key, an address or a network one budget of verifier seconds, not N.

    The same buckets and arithmetic (one minute's allowance, refilling per minute, overdrawn by a
    verification that costs more than was left), as ``store.BucketRate`` rows of kind ``verify_<scope>``.
    A verification is a prefill on trusted weights, so a store trip each is cheap beside it: :meth:`check`
    is one read, :meth:`spend` one write, both coroutines (they raise ``store.StoreUnavailable`` when the
    store is down, and the caller refuses as ``store_unavailable``). Several edges checking the same
    scope at once may each be admitted on its last second: the overdraw is then one verification per
    edge in flight, the same bound as one process's verifier threads.
    """

    def __init__(self, per_identity: float, per_address: float, per_prefix: float, db, *,
                 clock_ms: Callable[[], float] = lambda: time.time() * 1000):
        self.db = db
        self.clock_ms = clock_ms
        self._scopes = [(name, "verify_" + name.replace(" ", "_"), per_minute, st.BucketRate(per_minute / 60.0, per_minute),
                         key_of) for name, per_minute, key_of in budget_scopes(per_identity, per_address, per_prefix)]

    @classmethod
    def from_config(cls, intake, db, *, clock_ms: Callable[[], float] = lambda: time.time() * 1000) -> SharedVerifierBudget:
        """The budget that ``intake`` (an :class:`~veriroll.coordinator.config.IntakeConfig`) sets, in ``db``."""
        return cls(intake.verify_seconds_per_minute_per_identity, intake.verify_seconds_per_minute_per_address,
                   intake.verify_seconds_per_minute_per_prefix, db, clock_ms=clock_ms)

    async def check(self, node_id: str, address: str) -> Rejection | None:
        """:meth:`VerifierBudget.reserve` against the shared buckets: None, or which scope is used up."""
        if not self._scopes:
            return None
        now = self.clock_ms()
        keys = [key_of(node_id, address) for _, _, _, _, key_of in self._scopes]
        buckets = [(kind, key, rate) for (_, kind, _, rate, _), key in zip(self._scopes, keys, strict=True)]
        levels = await self.db.run_read(lambda conn: st.bucket_levels(conn, buckets, now))
        for (name, _, per_minute, _, _), key, left in zip(self._scopes, keys, levels, strict=True):
            if left <= 0:
                return out_of_time(name, key, per_minute, left)
        return None

    async def spend(self, node_id: str, address: str, seconds: float) -> None:
        """:meth:`VerifierBudget.charge` against the shared buckets: every scope pays ``seconds``."""
        if not seconds > 0 or not self._scopes:  # nothing spent (or a NaN from a broken timer): nothing to pay
            return
        now = self.clock_ms()
        takes = [(kind, key_of(node_id, address), rate) for _, kind, _, rate, key_of in self._scopes]
        await self.db.run(lambda conn: [st.take_from_bucket(conn, kind, key, rate, seconds, now, overdraw=True)
                                        for kind, key, rate in takes])
