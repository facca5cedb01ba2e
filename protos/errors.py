"""The common bases of veriroll's errors and refusals.

``VerirollError`` is the base of the exceptions veriroll raises about its own work (a bad config, a
model that does not load, a port in use), so a caller can tell them from a bug or a library's failure.
``Refusal`` is a request turned away for a :class:`~veriroll.protos.reasons.Reason` of the contract; the
coordinator's door raises its subclass (``coordinator.edge.Refusal``). ``RefusalReason`` is the base of
the reason enums of the transport layers whose refusals are not the coordinator's (a relay's, a swarm
peer's): they are spelled on their own wire and never reach ``Reason``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (not at run time: shardcast's enums subclass RefusalReason, and reasons imports grpc)
    from veriroll.protos.reasons import Reason


class VerirollError(Exception):
    """Base of the exceptions veriroll raises for a condition it knows (not a bug); the message says what to do."""


class Refusal(VerirollError):
    """A request refused for ``reason``; ``detail`` says why in words (the reason's own message if empty)."""

    def __init__(self, reason: Reason, detail: str = ""):
        detail = detail or reason.message
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class RefusalReason(enum.StrEnum):
    """Base of a transport layer's own refusal reasons (no members here: an enum with members cannot be
    extended). Members are their wire spelling: ``str(reason)`` is the value."""
