"""Proof of work on Register: a new identity costs CPU time, a known one costs nothing.

Keys are free to make, so the coordinator asks a key it has never seen for a nonce such that

    SHA-256(b"veriroll-pow-v1" || coordinator key || node key || ts_ms as int64 LE || nonce as uint64 LE)

starts with at least ``bits`` zero bits (about ``2**bits`` hashes to find, one to check). The solution
cannot be reused: the node key binds it to one identity, the coordinator key to one network, and
``ts_ms`` is the request envelope's signed timestamp, which the coordinator accepts only within its
window, so solutions cannot be stockpiled ahead of a flood either. The nonce and the bits it was solved
at travel in ``RegisterRequest.pow_nonce`` / ``pow_bits``, inside the signed body.

The node learns the difficulty from the refusal: ``pow_required`` (or ``pow_invalid``) carries a
:class:`Challenge` in its detail (``pow_bits=N coordinator_key=HEX``); the node solves it and sends
Register once more. Refusals for a missing or wrong proof are never strikes: the key is new.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

DOMAIN = b"veriroll-pow-v1"
KEY_BYTES = 32
MAX_BITS = 64  # the nonce is 64 bits: no more than 64 leading zero bits can be asked for
DEFAULT_BITS = 20  # ~1M hashes: about 0.5 s on one core of a 2 MH/s CPU (hashlib); see docs/registration.md
DEFAULT_MAX_BITS = 24  # the most a node solves unless its operator allows more: 16x the default, ~8 s
_CANCEL_EVERY = 1 << 14  # hashes between looks at ``cancelled`` while solving (~10 ms)

_TS = struct.Struct("<q")
_NONCE = struct.Struct("<Q")
_CHALLENGE = re.compile(r"pow_bits=(\d{1,3}) coordinator_key=([0-9a-f]{64})")


def _prefix(coordinator_key: bytes, node_key: bytes, ts_ms: int) -> bytes:
    return DOMAIN + bytes(coordinator_key) + bytes(node_key) + _TS.pack(ts_ms)


def pow_digest(coordinator_key: bytes, node_key: bytes, ts_ms: int, nonce: int) -> bytes:
    """The SHA-256 whose leading zero bits are the work done; raises ValueError on out-of-range input."""
    if len(coordinator_key) != KEY_BYTES or len(node_key) != KEY_BYTES:
        raise ValueError(f"keys must be {KEY_BYTES} bytes")
    try:
        return hashlib.sha256(_prefix(coordinator_key, node_key, ts_ms) + _NONCE.pack(nonce)).digest()
    except struct.error as exc:
        raise ValueError(f"ts_ms must fit int64 and nonce uint64: {exc}") from exc


def leading_zero_bits(digest: bytes) -> int:
    """How many of ``digest``'s first bits (big-endian, most significant first) are zero."""
    return len(digest) * 8 - int.from_bytes(digest, "big").bit_length()


def check(coordinator_key: bytes, node_key: bytes, ts_ms: int, nonce: int, bits: int) -> bool:
    """True when ``nonce`` is a proof of ``bits`` of work for this node, coordinator and timestamp.

    One SHA-256 of 95 bytes whatever the input: safe to run on every Register of an unknown key.
    Never raises; out-of-range values (from an attacker's request) are simply not a proof.
    """
    if bits <= 0:
        return True
    if bits > MAX_BITS:
        return False
    try:
        digest = pow_digest(coordinator_key, node_key, ts_ms, nonce)
    except ValueError:
        return False
    return leading_zero_bits(digest) >= bits


def solve(coordinator_key: bytes, node_key: bytes, ts_ms: int, bits: int, *,
          cancelled: Callable[[], bool] | None = None) -> int | None:
    """The smallest nonce that proves ``bits`` of work, or None once ``cancelled()`` turns true.

    CPU-bound (about ``2**bits`` hashes): run it in a worker thread and pass ``cancelled`` so that a node
    told to stop does not keep a core busy. ``cancelled`` is polled every few milliseconds.
    """
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in [0, {MAX_BITS}], got {bits}")
    prefix = _prefix(coordinator_key, node_key, ts_ms)
    pow_digest(coordinator_key, node_key, ts_ms, 0)  # validate the inputs once, before the hot loop
    # The first 8 bytes, read big-endian, are below 2**(64 - bits) exactly when ``bits`` leading bits are zero.
    target = 1 << (64 - bits)
    sha256, pack = hashlib.sha256, _NONCE.pack
    for start in range(0, 1 << 64, _CANCEL_EVERY):
        if cancelled is not None and cancelled():
            return None
        for nonce in range(start, start + _CANCEL_EVERY):
            if int.from_bytes(sha256(prefix + pack(nonce)).digest()[:8], "big") < target:
                return nonce
    return None  # no nonce works (only conceivable near MAX_BITS)


@dataclass(frozen=True)
class Challenge:
    """What a coordinator asks of a new key: ``bits`` of work bound to its ``coordinator_key``."""

    bits: int
    coordinator_key: bytes

    def accepts(self, node_key: bytes, ts_ms: int, nonce: int) -> bool:
        """True when ``nonce`` proves this challenge's bits for ``node_key`` at ``ts_ms`` (see :func:`check`)."""
        return check(self.coordinator_key, node_key, ts_ms, nonce, self.bits)

    def detail(self) -> str:
        """The refusal detail that carries this challenge to the node (parsed by :meth:`from_detail`)."""
        return (f"a new key must prove {self.bits} bits of work on Register "
                f"(pow_bits={self.bits} coordinator_key={self.coordinator_key.hex()})")

    @classmethod
    def from_detail(cls, text: str) -> Challenge | None:
        """The challenge in a refusal's detail, or None when it carries none (or an impossible one)."""
        match = _CHALLENGE.search(text or "")
        if match is None or int(match.group(1)) > MAX_BITS:
            return None
        return cls(int(match.group(1)), bytes.fromhex(match.group(2)))
