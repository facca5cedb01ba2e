"""Activation commitments (TOPLOC) and verifiable seeded sampling: pure tensor code."""

from veriroll.toploc.proof import (
    DEFAULT_THRESHOLDS,
    MANT_ERR_NO_MATCH,
    REASONS,
    Thresholds,
    check_layout,
    commit,
    commit_many,
    thresholds_for,
    truncate,
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
    "check_layout",
    "commit",
    "commit_many",
    "thresholds_for",
    "truncate",
    "verify",
    "verify_many",
]
