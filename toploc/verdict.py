"""The result of every check in ``veriroll.toploc``: a value, never an exception."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChunkStats:
    """How one chunk of a TOPLOC proof compared with the verifier's own hidden states."""

    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float
    sign_mismatches: int


@dataclass(frozen=True)
class Verdict:
    """Outcome of a verification.

    ``ok`` is the decision, ``reason`` a short machine-readable code (empty when ok) and ``detail`` a
    sentence for humans. ``chunks`` carries per-chunk statistics of a commitment check;
    ``mismatched_positions`` the positions whose sampled token could not be replayed.
    """

    ok: bool
    reason: str = ""
    detail: str = ""
    chunks: tuple[ChunkStats, ...] = field(default_factory=tuple)
    mismatched_positions: tuple[int, ...] = field(default_factory=tuple)
    max_margin: float = 0.0

    def __bool__(self) -> bool:
        return self.ok
