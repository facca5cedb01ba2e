"""What the store's columns hold beyond plain numbers and text: the states of nodes, leases and prompts, and
token ids and log-probs packed as little-endian blobs."""

from __future__ import annotations

from enum import StrEnum

import numpy as np


class Standing(StrEnum):
    """A node's standing: new keys start on probation, clean verified groups make them trusted, strikes or
    an operator ban them."""

    PROBATION = "probation"
    TRUSTED = "trusted"
    BANNED = "banned"


class LeaseState(StrEnum):
    """open → submitted (group accepted) | rejected (content failed; prompt back to the pool) | expired."""

    OPEN = "open"
    SUBMITTED = "submitted"
    REJECTED = "rejected"
    EXPIRED = "expired"


class PromptState(StrEnum):
    """pending (in the pool) → leased → done (a group was accepted for it), or back to pending."""

    PENDING = "pending"
    LEASED = "leased"
    DONE = "done"


STANDINGS = tuple(s.value for s in Standing)


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def unpack_i32(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<i4")


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_f32(blob: bytes | None) -> np.ndarray | None:
    return None if blob is None else np.frombuffer(blob, dtype="<f4")
