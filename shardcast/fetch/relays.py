"""The relays of one fetch: what each holds, how well it has served, and which one gets the next download.

A download's relay is chosen at random among those that hold the version and have a free slot (at most
``per_relay`` downloads each), weighted by measured throughput (an EWMA; a relay not measured yet is
assumed as fast as the fastest one, so each gets tried), success rate, load, and, heavily, the bad data it
served: a relay that lied is a last resort.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from .results import RelayStats

PRIOR_BPS = 100e6  # throughput assumed for a relay not yet measured: optimistic, so each gets tried
BAD_PENALTY = 0.02  # weight factor per bad shard served: a relay that lied is a last resort
EWMA_ALPHA = 0.3


def normalize_relay_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not re.match(r"https?://", url):
        url = "http://" + url
    return url


class _Relay:
    def __init__(self, url: str):
        self.url = url
        self.stats = RelayStats(url)
        self.holds: set[int] = set()
        self.gone: set[int] = set()  # versions it answered 404 for during this fetch
        self.no_delta: set[int] = set()  # versions whose delta it answered 404 for
        self.successes = 0
        self.failures = 0
        self.bad_events = 0
        self.consecutive_conn_failures = 0
        self.inflight = 0
        self.ewma_bps: float | None = None

    @property
    def reachable(self) -> bool:
        return self.stats.reachable

    def has(self, version: int) -> bool:
        return self.reachable and version in self.holds and version not in self.gone

    def serves(self, version: int, *, piece: bool) -> bool:
        """Whether it can serve ``version``'s shards (``piece``: its delta's pieces) now."""
        return self.has(version) and (not piece or version not in self.no_delta)

    def weight(self, prior_bps: float) -> float:
        score = (self.successes + 1) / (self.successes + self.failures + 2)
        bps = self.ewma_bps if self.ewma_bps is not None else prior_bps
        return score * bps * (BAD_PENALTY**self.bad_events) / (1 + self.inflight)

    def record_success(self, nbytes: int, seconds: float) -> None:
        self.successes += 1
        self.consecutive_conn_failures = 0
        bps = nbytes / max(seconds, 1e-6)
        self.ewma_bps = bps if self.ewma_bps is None else (1 - EWMA_ALPHA) * self.ewma_bps + EWMA_ALPHA * bps
        self.stats.bytes += nbytes
        self.stats.shards += 1
        self.stats.throughput_bps = self.ewma_bps

    def record_bad(self) -> None:
        self.bad_events += 1
        self.stats.bad += 1

    def record_failure(self) -> None:
        self.failures += 1
        self.stats.failures += 1


def choose_relay(
    relays: Sequence[_Relay], version: int, *, piece: bool, tried: set[str], bad_for: set[str], per_relay: int
) -> _Relay | None | bool:
    """A relay for one download; None when all candidates are busy; False when none is left untried."""
    candidates = [
        r for r in relays if r.serves(version, piece=piece) and r.url not in tried and r.url not in bad_for
    ]
    if not candidates:
        return False
    free = [r for r in candidates if r.inflight < per_relay]
    if not free:
        return None
    known = [r.ewma_bps for r in relays if r.ewma_bps is not None]
    prior = max(known) if known else PRIOR_BPS
    weights = [r.weight(prior) for r in free]
    return random.choices(free, weights=weights)[0]
