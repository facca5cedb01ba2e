"""Peer hints: which nodes serve which versions, signed by the coordinator in the policy announcement.

Pure functions over plain data. A node dials only peers (and only at addresses) that the coordinator
announced, so a relay, a peer or a man in the middle cannot steer it towards hosts of its choosing (a
dial is a connection to an address the attacker picked: a port scan by proxy, or a way to learn the
node's address). The document travels as JSON::

    {"hints": {"version": 7, "peers": [{"peer_id": "12D3...", "addrs": ["/ip4/.../tcp/4001"],
                                         "versions": [6, 7]}]},
     "signature": "<128 hex>"}

signed with Ed25519 over ``SIGNING_CONTEXT + canonical JSON`` (sorted keys, no whitespace), like the
manifest.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from veriroll.protos.identity import PrivateKey, PublicKey

from .errors import PeerHintsError

SIGNING_CONTEXT = b"veriroll-swarm-peer-hints-v1\x00"
MAX_HINTS_BYTES = 1024 * 1024
MAX_PEERS = 1000
MAX_ADDRS = 8
MAX_VERSIONS = 64
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58btc
_ADDR = re.compile(r"/[A-Za-z0-9/._:-]{1,255}")


@dataclass(frozen=True)
class PeerHint:
    peer_id: str
    addrs: tuple[str, ...]
    versions: tuple[int, ...]


@dataclass(frozen=True)
class PeerHints:
    """The peers announced with policy ``version``."""

    version: int
    peers: tuple[PeerHint, ...]

    def to_dict(self) -> dict:
        return {"version": self.version,
                "peers": [{"peer_id": p.peer_id, "addrs": list(p.addrs), "versions": list(p.versions)}
                          for p in self.peers]}  # fmt: skip


def _canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_peer_hints(key: PrivateKey, hints: PeerHints) -> bytes:
    """The wire document of ``hints``, signed with the coordinator's ``key``."""
    body = hints.to_dict()
    signature = key.sign(SIGNING_CONTEXT + _canonical(body))
    return _canonical({"hints": body, "signature": signature.hex()})


def _int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**53:
        raise PeerHintsError(f"{what} must be a non-negative integer")
    return value


def verify_peer_hints(data: bytes, key: PublicKey) -> PeerHints:
    """The hints in ``data``, once its signature by ``key`` and its shape are checked."""
    if len(data) > MAX_HINTS_BYTES:
        raise PeerHintsError(f"peer hints of {len(data)} bytes, more than {MAX_HINTS_BYTES}")
    try:
        doc = json.loads(data)
        body, signature = doc["hints"], bytes.fromhex(doc["signature"])
    except (ValueError, TypeError, KeyError) as exc:
        raise PeerHintsError(f"peer hints do not parse: {exc}") from exc
    if not isinstance(body, dict) or not key.verify(signature, SIGNING_CONTEXT + _canonical(body)):
        raise PeerHintsError("peer hints are not signed by the coordinator key")
    peers_raw = body.get("peers")
    if not isinstance(peers_raw, list) or len(peers_raw) > MAX_PEERS:
        raise PeerHintsError(f"peer hints must list at most {MAX_PEERS} peers")
    peers = []
    for p in peers_raw:
        if not isinstance(p, dict) or not isinstance(p.get("peer_id"), str) or not _PEER_ID.fullmatch(p["peer_id"]):
            raise PeerHintsError(f"bad peer id in peer hints: {p!r:.80}")
        addrs, versions = p.get("addrs"), p.get("versions")
        if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS or not all(
            isinstance(a, str) and _ADDR.fullmatch(a) for a in addrs
        ):
            raise PeerHintsError(f"peer {p['peer_id']}: addrs must be at most {MAX_ADDRS} multiaddrs")
        if not isinstance(versions, list) or len(versions) > MAX_VERSIONS:
            raise PeerHintsError(f"peer {p['peer_id']}: versions must be a list of at most {MAX_VERSIONS}")
        peers.append(PeerHint(p["peer_id"], tuple(addrs), tuple(_int(v, "a version") for v in versions)))
    return PeerHints(_int(body.get("version"), "the hints' version"), tuple(peers))
