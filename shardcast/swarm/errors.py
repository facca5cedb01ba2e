"""What can go wrong with a peer of the swarm; each names the peer, so the caller can avoid and report it."""

from __future__ import annotations

from ..errors import ShardcastError
from .wire import Refusal


class SwarmError(ShardcastError):
    """Base class of the swarm's failures."""


class SwarmNotRunningError(SwarmError):
    """The swarm was used before ``start`` or after ``stop``."""


class PeerHintsError(SwarmError):
    """A peer-hint document that is malformed or not signed by the coordinator."""


class PeerError(SwarmError):
    """Peer ``peer_id`` did not give us what we asked for; ``reason`` says why."""

    def __init__(self, peer_id: str, reason: Refusal | str, detail: str):
        super().__init__(f"peer {peer_id}: {reason} ({detail})")
        self.peer_id, self.reason, self.detail = peer_id, reason, detail


class PeerNotAnnouncedError(PeerError):
    """A peer, or an address of one, that the coordinator's signed hints do not list: never dialled."""


class BadPeerError(PeerError):
    """The peer sent bytes that are not what the manifest names: it is banned and should be reported."""


class PeerUnavailableError(PeerError):
    """The peer stalled, refused, does not hold the shard, or could not be reached: ask someone else."""
