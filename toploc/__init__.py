"""Activation commitments (TOPLOC) and verifiable seeded sampling: pure tensor code."""

from veriroll.toploc.proof import (
    DEFAULT_THRESHOLDS,
    MANT_ERR_NO_MATCH,
    REASONS,
    Thresholds,
    commit,
    commit_many,
    thresholds_for,
    verify,
    verify_many,
)
from veriroll.toploc.verdict import ChunkStats, Verdict

__all__ = [
    "DEFAULT_THRESHOLDS",
    "MANT_ERR_NO_MATCH",
    "REASONS",
    "ChunkStats",
    "Thresholds",
    "Verdict",
    "commit",
    "commit_many",
    "thresholds_for",
    "verify",
    "verify_many",
]
