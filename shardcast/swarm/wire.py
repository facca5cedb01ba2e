"""The shard protocol between nodes, ``/veriroll/shard/1.0.0``: one request and one answer per stream.

Pure framing, no network. A request is one opcode byte and a 32-byte SHA-256:

- ``GET`` + a shard's hash (from the coordinator-signed manifest): the answer is a status byte, then for
  ``OK`` an 8-byte big-endian length and that many bytes;
- ``HAVE`` + a manifest's hash (``manifest_sha256``): the answer is a status byte, then for ``OK`` a
  4-byte length and a bitfield of the manifest's shards the peer holds (bit ``i`` of byte ``i // 8``,
  most significant first), so a node asks each peer once per round instead of once per shard.

Content is addressed by hash only, so a peer can serve nothing the manifest does not name, and whatever
it sends is hashed on arrival. Every length is bounded before anything is read: a shard by the size the
manifest gives it, a bitfield by the manifest's shard count.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from veriroll.protos.errors import RefusalReason

PROTOCOL = "/veriroll/shard/1.0.0"
REQUEST_SIZE = 33
SHARD_LENGTH_SIZE = 8
BITFIELD_LENGTH_SIZE = 4


class Op(enum.IntEnum):
    GET = 1
    HAVE = 2


class Status(enum.IntEnum):
    """The first byte of an answer; everything but ``OK`` ends the stream."""

    OK = 0
    NOT_HELD = 1
    BUSY = 2  # too many streams from this peer at once
    RATE_LIMITED = 3  # too many streams opened by this peer lately
    BAD_REQUEST = 4
    BANNED = 5


class Refusal(RefusalReason):
    """Why a node's swarm refused a peer's stream or a peer's answer; counted by reason on both sides."""

    BUSY = "peer-busy"
    RATE_LIMITED = "peer-stream-rate"
    BAD_REQUEST = "peer-bad-request"
    BANNED = "peer-banned"
    NOT_ANNOUNCED = "peer-not-announced"
    HASH_MISMATCH = "peer-hash-mismatch"
    WRONG_LENGTH = "peer-wrong-length"
    STALLED = "peer-stalled"


@dataclass(frozen=True)
class SwarmLimits:
    """Bounds on what one peer may cost us, as server and as client."""

    max_streams_per_peer: int = 4
    """Streams one peer may hold open on us at once; more are answered BUSY."""
    stream_rate_per_peer: float = 20.0
    """Streams one peer may open per second, sustained (token bucket) ..."""
    stream_burst_per_peer: int = 40
    """... and in a burst; more are answered RATE_LIMITED."""
    stream_timeout_s: float = 10.0
    """Longest silence within a stream (the request, the answer's header, any chunk of it): past it the
    stream is dropped and, as a client, the peer is backed off (dropped for the fetch after a few in a row)."""
    open_timeout_s: float = 5.0
    """Dialling a peer and opening a stream to it."""


def encode_request(op: Op, digest: bytes) -> bytes:
    if len(digest) != 32:
        raise ValueError("a request names a 32-byte SHA-256")
    return bytes([op]) + digest


def decode_request(data: bytes) -> tuple[Op, bytes] | None:
    """The opcode and hash of a request, or None when it is not one."""
    if len(data) != REQUEST_SIZE or data[0] not in (Op.GET, Op.HAVE):
        return None
    return Op(data[0]), bytes(data[1:])


def encode_bitfield(held: set[int], count: int) -> bytes:
    bits = bytearray((count + 7) // 8)
    for i in held:
        if 0 <= i < count:
            bits[i // 8] |= 0x80 >> (i % 8)
    return bytes(bits)


def decode_bitfield(bits: bytes, count: int) -> set[int]:
    """The shard indices set in ``bits``; bits past ``count`` are ignored."""
    return {i for i in range(min(count, len(bits) * 8)) if bits[i // 8] & (0x80 >> (i % 8))}
