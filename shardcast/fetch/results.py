"""What a fetch returns: the checkpoint it left, and what each relay (or peer) did for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..manifest import Manifest


@dataclass(frozen=True)
class RelayIncident:
    """Something a relay (or a peer of the swarm: ``relay`` is then its peer id) did wrong. ``kind`` is a
    short tag: for bad relays ``hash-mismatch``,
    ``wrong-length``, ``bad-signature``, ``wrong-version``, ``invalid-manifest``; for failures
    ``timeout``, ``connection``, ``truncated``, ``http-<status>``, ``gone``."""

    relay: str
    kind: str
    shard: int | None
    detail: str


@dataclass
class RelayStats:
    """What one relay did for this fetch."""

    url: str
    reachable: bool = False
    versions: list[int] = field(default_factory=list)
    bytes: int = 0
    shards: int = 0
    failures: int = 0
    bad: int = 0
    throughput_bps: float | None = None


@dataclass
class FetchResult:
    """A complete, verified checkpoint at ``path`` (the ready marker is written)."""

    version: int
    path: Path
    manifest: Manifest
    already_present: bool
    bytes_downloaded: int  # bytes of shards accepted in this call
    bytes_reused: int  # bytes of shards kept from an interrupted earlier call
    shards_downloaded: int
    shards_reused: int
    seconds: float
    bad_relays: list[RelayIncident]
    failures: list[RelayIncident]
    relays: dict[str, RelayStats]
    delta_bytes: int = 0  # bytes of delta pieces accepted in this call
    shards_rebuilt: int = 0  # shards rebuilt from a base and a delta piece instead of downloaded
    delta_problems: list[str] = field(default_factory=list)  # why a delta, or a piece of it, was not used
    bytes_from_peers: int = 0  # of bytes_downloaded, those that came from peers of the swarm
    shards_from_peers: int = 0
    bad_peers: list[RelayIncident] = field(default_factory=list)  # peers that sent bad bytes (banned)

    @property
    def bad_relay_urls(self) -> set[str]:
        return {i.relay for i in self.bad_relays}

    @property
    def bytes_shipped(self) -> int:
        """Bytes that crossed the network for this call: whole shards plus delta pieces."""
        return self.bytes_downloaded + self.delta_bytes
