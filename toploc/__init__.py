"""Activation commitments (TOPLOC) and verifiable seeded sampling: pure tensor code."""

from veriroll.toploc.verdict import ChunkStats, Verdict

__all__ = ["ChunkStats", "Verdict"]
