"""Fetch one checkpoint version from untrusted relays and prove every byte against the coordinator's key.

``fetch_version`` (async) and ``fetch_version_sync`` resolve the version and its signed manifest, download
its shards in parallel (from peers of the swarm first, when there is one), check each as it arrives, and
move the finished checkpoint into place in one step. One module per job:

- ``version.py``: the steps in order, the state they share, and the public entry points;
- ``resolve.py``: which version, and its manifest, checked (signature, rules, version);
- ``relays.py``: each relay's state, and the weighted choice of a relay for a download;
- ``download.py``: ranged downloads from the relays, hashed as they stream, and their retries;
- ``rebuild.py``: shards rebuilt from a base the caller holds and a delta piece;
- ``peers.py``: the swarm's schedule: peers first, relays for what no peer holds;
- ``staging.py``: the staging directory, its journal of finished shards, and the atomic finish;
- ``disk.py``: writes and hashes on disk (the seams tests replace); ``failures.py``: how an answer fails;
  ``results.py``: what a fetch returns.
"""

from .relays import normalize_relay_url
from .resolve import SMALL_ANSWER_S, small_answer_timeout
from .results import FetchResult, RelayIncident, RelayStats
from .staging import JOURNAL_NAME, PARTIAL_SUFFIX
from .version import (
    DEFAULT_CONCURRENCY,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_PER_RELAY,
    DEFAULT_READ_TIMEOUT,
    fetch_version,
    fetch_version_sync,
)

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_PER_RELAY",
    "DEFAULT_READ_TIMEOUT",
    "JOURNAL_NAME",
    "PARTIAL_SUFFIX",
    "SMALL_ANSWER_S",
    "FetchResult",
    "RelayIncident",
    "RelayStats",
    "fetch_version",
    "fetch_version_sync",
    "normalize_relay_url",
    "small_answer_timeout",
]
