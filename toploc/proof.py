"""TOPLOC activation commitments: build a compact proof of hidden states, check it against trusted ones.

A node commits to the final-norm hidden states ``[T, H]`` of the positions it generated; the coordinator
recomputes those hidden states with one trusted prefill and checks the proof against them. Following
the TOPLOC paper (arXiv 2501.16007), for every chunk of ``chunk_size`` positions:

1. flatten the chunk to ``rows * H`` entries and take the ``k = min(topk, rows * H)`` largest by
   magnitude (ties go to the smaller flat index, so both sides pick the same set from equal values);
2. find the largest modulus ``m <= P`` under which those flat indices stay distinct;
3. interpolate the polynomial of degree ``< k`` over GF(P), ``P = 65497``, through the points
   ``(index mod m, 16-bit pattern of the value)`` and store its ``k`` coefficients.

The verifier takes its *own* top-k from the trusted hidden states, evaluates the prover's polynomial at
those indices (reduced mod ``m``; the public library forgot that reduction in its Python path and
rejected honest chunks), and compares the 16-bit patterns field by field: exponent, mantissa and --
unlike the public library -- sign, so negated activations fail. An index the prover did not pick
evaluates to an essentially random field element, so index disagreement and exponent drift land in
the same counter.

Values are committed as **bfloat16 bit patterns**: float32 and float16 inputs are rounded to bf16
(round to nearest even) for the commitment only; the top-k selection uses the input's own precision.
All bf16 patterns except negative NaNs are below P; a NaN is committed as the canonical ``0x7FC0``.

Wire format (big-endian), self-describing so that a proof can be checked without side information::

    header  16 B   magic b"TL" | version u8 = 1 | value dtype u8 (1 = bf16) | chunk_size u16 | topk u16
                   | positions T u32 | hidden size H u32
    chunk   2 + 2k B   modulus u16 | k coefficients u16 (ascending powers, each < P)

The number of chunks is ``ceil(T / chunk_size)`` and each chunk's ``k`` follows from the header, so the
layout is fully determined by it: 16 + 258 bytes per chunk of 32 tokens with top-128.

``verify`` turns any input into a :class:`Verdict`; it never raises. ``check_layout`` runs the part of it
that needs no hidden states (a parse of the bytes), and ``truncate`` cuts a proof after its first chunks,
which is a proof of those positions alone: a verifier can refuse a malformed proof before any forward
pass, and check the first chunk on a short prefill before the whole one. ``commit_many`` and ``verify_many``
do the same for a whole group with one vectorized pass over the field arithmetic of all its chunks.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from veriroll.toploc.verdict import ChunkStats, Verdict

P = 65497
"""The prime field of the paper: the largest prime below 0xFFD9, where bf16/fp16 NaN patterns start."""

FORMAT_VERSION = 1
DTYPE_BF16 = 1
MAGIC = b"TL"
_HEADER = struct.Struct(">2sBBHHII")
HEADER_SIZE = _HEADER.size  # 16

REASONS = (
    "malformed_proof",  # not a proof of this format: header, length, modulus or coefficients
    "parameter_mismatch",  # built with another chunk_size or topk than the verifier requires
    "shape_mismatch",  # hidden size differs, or the trusted states are not a 2-D float tensor
    "non_finite_hidden",  # the trusted states hold NaN or infinity: nothing to compare against
    "chunk_count_mismatch",  # the proof covers more or fewer chunks than the trusted positions
    "length_mismatch",  # same number of chunks, different number of positions
    "exponent_mismatch",  # values (or top-k indices) differ: another model, prompt, version, sample
    "sign_mismatch",  # same magnitudes, flipped signs: negated activations
    "mantissa_mismatch",  # same exponents, values off by more than numerical noise: rescaled, low precision
    "verification_error",  # an unforeseen failure inside the verifier, still a rejection
)
"""Every ``reason`` :func:`verify` can return."""

_NAN_BF16 = 0x7FC0
# Mantissa error reported for a chunk in which no exponent matched: above the largest possible
# 7-bit difference (127), and finite so that statistics serialize as plain JSON.
MANT_ERR_NO_MATCH = 128.0
# Each entry's contribution to the mantissa error mean is capped here (16 ulps, 6-12 % relative): a value
# that is that far off is wrong whatever its exact distance, and the cap keeps one random value at an
# index the prover did not pick (which matches the exponent 1 time in 256) from dominating the mean.
MANT_ERR_CLIP = 16


@dataclass(frozen=True)
class Thresholds:
    """Per-chunk limits of :func:`verify`; a chunk exceeding any of them rejects the proof.

    Counts are fractions of the chunk's ``k`` so that a short last chunk is judged like a full one.
    """

    max_exp_mismatch_frac: float
    """Share of the verifier's top-k whose exponent differs (or whose index the prover did not pick)."""
    max_sign_mismatch_frac: float
    """Share of the top-k whose exponent matches but whose sign differs (negated activations)."""
    max_mant_err_mean: float
    """Mean |mantissa difference| (bf16 ulps, 7-bit mantissa; each entry capped at ``MANT_ERR_CLIP``)
    over the exponent-matching entries."""
    max_mant_err_median: float
    """Median of the same, uncapped."""


# Defaults calibrated by benchmarks/toploc_calibration.py (seed 0: 1,672 honest samples, 0 rejected).
# Figures per chunk of 32 tokens, top-128: exponent-mismatch share / sign share / mantissa mean / median.
#   honest, worst chunk:
#     fp32, tiny Llamas (2L x 64, 4L x 256), KV-cached decode vs one prefill, batched or alone + padding:
#       0 / 0 / <= 0.008 / 0;  synthetic fp32 noise 1e-6..1e-4 relative: <= 0.008 / 0 / <= 0.047 / 0;
#       bf16 <-> fp32 casts of the same states: <= 0.023 / 0 / <= 0.125 / 0
#     bf16 both sides (tiny Llamas): <= 0.031 / 0 / <= 0.43 / 0;  synthetic 1e-2 drift: <= 0.078 / 0.008
#       / <= 1.79 / <= 2  (a stand-in for deep bf16 models across GPUs and kernels, not measured here)
#     fp16 both sides (tiny Llamas): <= 0.016 / 0 / <= 0.10 / 0;  synthetic 1e-3 drift: <= 0.031 / 0 /
#       <= 0.24 / 0
#   attacks, the statistic that rejects (per-chunk minimum; a sample fails on its worst chunk):
#     negated: sign share 1.0;  x0.5: exponent share 1.0;  another init, another sample's proof: exponent
#     share median >= 0.45;  x1.05: mantissa mean >= 7.27, median >= 7;  changed prompt: exponent share
#     median >= 0.17;  bf16 generation claimed as fp32: mantissa mean >= 0.32 (both Llamas; 100 %);
#     one Adam step away: 100 % from lr 1e-4 (2L x 64) and 1e-5 (4L x 256).
#   Below TOPLOC's bf16 resolution, not caught: fp16 generation claimed as fp32 (mean <= 0.18, the level
#   of fp32 with 1e-3 noise), and an optimizer step at lr <= 1e-5 (2L: 20 %) or 1e-6 (4L: 32 %).
# So float32 verification allows about 5x its honest worst case and stays under the bf16 attack's best
# case; half-precision verification allows 2-4x a 1e-2 (bf16) or 1e-3 (fp16) drift. Signs never flip
# honestly among the top-k: 0.03 (rejects from 4 of 128) absorbs random values at unpicked indices.
THRESHOLDS_FP32 = Thresholds(
    max_exp_mismatch_frac=0.10,
    max_sign_mismatch_frac=0.03,
    max_mant_err_mean=0.25,
    max_mant_err_median=0.5,
)
# bf16 on a real model (SmolLM2-135M, 30 layers; benchmarks/real_model.py, 1,344 honest samples): worst
# chunk exponent share 0.086, mantissa mean 3.35, median 3 (bf16 node against a bf16 or fp32 prefill),
# so the mantissa limits are 6 (were 4, calibrated on 2-4 layer models: 0.84 of the limit was used).
THRESHOLDS_BF16 = Thresholds(
    max_exp_mismatch_frac=0.20,
    max_sign_mismatch_frac=0.03,
    max_mant_err_mean=6.0,
    max_mant_err_median=6.0,
)
THRESHOLDS_FP16 = Thresholds(
    max_exp_mismatch_frac=0.10,
    max_sign_mismatch_frac=0.03,
    max_mant_err_mean=1.0,
    max_mant_err_median=1.0,
)
DEFAULT_THRESHOLDS = THRESHOLDS_FP32


def thresholds_for(dtype: torch.dtype) -> Thresholds:
    """The calibrated thresholds for a verifier whose trusted hidden states are of ``dtype``.

    The trusted prefill runs in the precision the node claims, so its dtype says which honest variation
    to allow: half-precision engines differ from each other by whole bf16 ulps, float32 ones almost
    never, which is what lets float32 verification catch half-precision generation.
    """
    if dtype == torch.bfloat16:
        return THRESHOLDS_BF16
    if dtype == torch.float16:
        return THRESHOLDS_FP16
    return THRESHOLDS_FP32


# --------------------------------------------------------------------------------------------------
# Field arithmetic over GF(P), vectorized with numpy int64 (every product of two residues is < 2**32).

_INV: np.ndarray | None = None


def _inverse_table() -> np.ndarray:
    """``inv[a] = a**(P-2) mod P`` for every residue (``inv[0] = 0``), built once by square-and-multiply."""
    global _INV
    if _INV is None:
        base = np.arange(P, dtype=np.int64)
        result = np.ones(P, dtype=np.int64)
        e = P - 2
        while e:
            if e & 1:
                result = result * base % P
            base = base * base % P
            e >>= 1
        result[0] = 0
        _INV = result
    return _INV


def _interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients ``[C, k]`` (ascending powers) of the polynomials through ``(x[c, i], y[c, i])``.

    Newton divided differences, then the Newton form expanded to monomials; rows are independent
    chunks, processed together. ``x`` must be distinct within each row.
    """
    inv = _inverse_table()  # indexed by a signed difference: inv[-a] is inv[P - a], the inverse of -a
    c, k = x.shape
    dd = y.astype(np.int64) % P
    for j in range(1, k):
        num = dd[:, j:] - dd[:, j - 1 : k - 1]
        num *= inv[x[:, j:] - x[:, : k - j]]
        np.remainder(num, P, out=dd[:, j:])
    # Horner on the Newton form: coef <- coef * (t - x_j) + dd_j, from the innermost term outwards
    coef = np.zeros((c, k), dtype=np.int64)
    coef[:, 0] = dd[:, k - 1]
    for j in range(k - 2, -1, -1):
        d = k - 1 - j  # degree after multiplying by (t - x_j); coef[:, d] is still 0
        scaled = coef[:, : d + 1] * x[:, j : j + 1]
        coef[:, 1 : d + 1] = coef[:, :d] - scaled[:, 1:]
        coef[:, 0] = dd[:, j] - scaled[:, 0]
        np.remainder(coef[:, : d + 1], P, out=coef[:, : d + 1])
    return coef


def _evaluate(coef: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Horner evaluation mod P of each row's polynomial ``coef[c]`` at the points ``x[c, :]``.

    Two Horner steps per reduction: from ``acc < P`` two steps stay below ``P**3 + P**2 + P < 2**49``,
    far inside int64, and the reduction is the costly operation.
    """
    k = coef.shape[1]
    acc = np.broadcast_to(coef[:, k - 1 : k], x.shape).copy()
    for j in range(k - 2, -1, -1):
        acc *= x
        acc += coef[:, j : j + 1]
        if (k - 2 - j) % 2 or j == 0:
            np.remainder(acc, P, out=acc)
    return acc


def _injective_modulus(idx: np.ndarray) -> int:
    """Largest ``m <= P`` under which the flat indices ``idx`` stay pairwise distinct."""
    k = idx.size
    if k <= 1 or np.unique(idx % P).size == k:
        return P
    batch = 256
    for top in range(P - 1, k - 1, -batch):
        ms = np.arange(top, max(top - batch, k - 1), -1, dtype=np.int64)
        r = np.sort(idx[None, :] % ms[:, None], axis=1)
        ok = ~(r[:, 1:] == r[:, :-1]).any(axis=1)
        if ok.any():
            return int(ms[int(np.argmax(ok))])
    raise RuntimeError(f"no modulus in [{k}, {P}] keeps these {k} indices distinct")  # pragma: no cover


# --------------------------------------------------------------------------------------------------
# Tensor side: top-k selection and bf16 bit patterns.


def _topk(
    hidden: torch.Tensor, start: int, n_chunks: int, rows: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices ``[C, k]`` of the top-k magnitudes and their bf16 patterns, for ``C`` chunks at once.

    The chunks are ``rows`` consecutive positions each from ``start``; the last may be cut short by the
    end of ``hidden``, its missing entries padded with a key below every real one (callers only batch
    it with full chunks when it still has at least ``k`` real entries). Ranking by an int64 key
    ``(|x| bits, -index)`` makes the choice among equal magnitudes deterministic on every device.
    """
    block = hidden[start : start + n_chunks * rows].reshape(-1)
    missing = n_chunks * rows * hidden.shape[1] - block.numel()
    mag = block.float().abs().view(torch.int32).to(torch.int64)
    if missing:
        block = torch.cat([block, block.new_zeros(missing)])
        mag = torch.cat([mag, mag.new_full((missing,), -1)])
    block, mag = block.reshape(n_chunks, -1), mag.reshape(n_chunks, -1)
    flat = torch.arange(block.shape[1], dtype=torch.int64, device=block.device)
    key = torch.where(mag < 0, -1, (mag << 32) | (0xFFFFFFFF - flat))
    idx = torch.topk(key, k, dim=1, sorted=False).indices
    picked = torch.gather(block, 1, idx)
    vals = picked.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    vals = torch.where(torch.isnan(picked), torch.full_like(vals, _NAN_BF16), vals)
    return idx.cpu().numpy(), vals.cpu().numpy()


def _chunk_groups(t: int, h: int, chunk_size: int, topk: int) -> list[tuple[int, int, int, int]]:
    """``(start, n_chunks, rows, k)`` for the chunks of ``t`` positions, in order, in as few batches as
    possible: the last partial chunk joins the full ones when it has the same ``k``."""
    full, rest = divmod(t, chunk_size)
    k_full, k_rest = min(topk, chunk_size * h), min(topk, rest * h)
    if rest and (k_rest == k_full or not full):
        return [(0, full + 1, chunk_size, k_rest)] if k_rest == k_full else [(0, 1, rest, k_rest)]
    groups = [(0, full, chunk_size, k_full)] if full else []
    if rest:
        groups.append((full * chunk_size, 1, rest, k_rest))
    return groups


def _check_params(chunk_size: int, topk: int) -> None:
    if not 1 <= chunk_size <= 0xFFFF:
        raise ValueError(f"chunk_size must be in [1, 65535], got {chunk_size}")
    if not 1 <= topk < P:
        raise ValueError(f"topk must be in [1, {P - 1}], got {topk}")


def _check_hidden(hidden) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError("hidden must be a 2-D floating-point tensor [T, H]")
    t, h = hidden.shape
    if h < 1 or t > 0xFFFFFFFF or h > 0xFFFFFFFF:
        raise ValueError(f"unsupported hidden shape {tuple(hidden.shape)}")


def commit(hidden: torch.Tensor, *, chunk_size: int = 32, topk: int = 128) -> bytes:
    """Proof bytes for the hidden states ``[T, H]`` (float32, float16 or bfloat16) of generated positions.

    One chunk per ``chunk_size`` positions (the last may be shorter), each ``2 + 2 * min(topk, rows * H)``
    bytes, after a 16-byte header. Raises ``ValueError`` on a tensor that is not 2-D floating point.
    """
    return commit_many([hidden], chunk_size=chunk_size, topk=topk)[0]


def commit_many(hiddens, *, chunk_size: int = 32, topk: int = 128) -> list[bytes]:
    """``[commit(h) for h in hiddens]``, with the field arithmetic of all chunks done together.

    The interpolation costs a fixed number of vectorized steps per call whatever the number of chunks,
    so a node committing a whole group at once pays it once.
    """
    _check_params(chunk_size, topk)
    hiddens = list(hiddens)
    for hidden in hiddens:
        _check_hidden(hidden)
    # chunks with the same k, from every sample: (sample, group, moduli, x = idx mod m, values)
    pieces: list[list[bytes]] = [[] for _ in hiddens]
    by_k: dict[int, list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]] = {}
    for s, hidden in enumerate(hiddens):
        t, h = hidden.shape
        pieces[s].append(_HEADER.pack(MAGIC, FORMAT_VERSION, DTYPE_BF16, chunk_size, topk, t, h))
        for g, (start, n, rows, k) in enumerate(_chunk_groups(t, h, chunk_size, topk)):
            idx, vals = _topk(hidden.detach(), start, n, rows, k)
            moduli = np.array([_injective_modulus(row) for row in idx], dtype=np.int64)
            by_k.setdefault(k, []).append((s, g, moduli, idx % moduli[:, None], vals))
            pieces[s].append(b"")  # filled below, keeps chunk order
    for entries in by_k.values():
        coef = _interpolate(np.concatenate([e[3] for e in entries]), np.concatenate([e[4] for e in entries]))
        row = 0
        for s, g, moduli, _, _ in entries:
            n = moduli.shape[0]
            body = np.concatenate([moduli[:, None], coef[row : row + n]], axis=1).astype(">u2")
            pieces[s][1 + g] = body.tobytes()
            row += n
    return [b"".join(p) for p in pieces]


# --------------------------------------------------------------------------------------------------
# Verification.


def _reject(reason: str, detail: str, chunks: tuple[ChunkStats, ...] = ()) -> Verdict:
    return Verdict(False, reason, detail, chunks=chunks)


@dataclass
class _Parsed:
    """A proof whose layout matches the trusted states, with the verifier's own top-k, awaiting evaluation."""

    thresholds: Thresholds
    groups: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]  # (k, coef [n, k], x [n, k], own [n, k])


def _compare(own: np.ndarray, claimed: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-row statistics between the verifier's bf16 patterns and the polynomial's values.

    Returns exponent mismatches, mantissa error mean and median (over exponent-matching entries) and
    sign mismatches (among exponent-matching entries, so that random values at indices the prover did
    not pick, already counted as exponent mismatches, barely touch it). The mean clips each entry at
    ``MANT_ERR_CLIP``: one such random value that happens to share the exponent must not outweigh a
    hundred honest entries.
    """
    exp_match = ((own >> 7) & 0xFF) == ((claimed >> 7) & 0xFF)
    n_match = exp_match.sum(axis=1)
    sign_mis = (((own >> 15) != (claimed >> 15)) & exp_match).sum(axis=1)
    err = np.abs((own & 0x7F) - (claimed & 0x7F))
    some = n_match > 0
    mean = np.where(exp_match, np.minimum(err, MANT_ERR_CLIP), 0).sum(axis=1) / np.maximum(n_match, 1)
    ordered = np.sort(np.where(exp_match, err, 1 << 20), axis=1)
    rows = np.arange(own.shape[0])
    lo = ordered[rows, np.maximum(n_match - 1, 0) // 2]
    hi = ordered[rows, np.maximum(n_match, 1) // 2 - (n_match == 0)]
    median = (lo + hi) / 2.0
    no_match = float(MANT_ERR_NO_MATCH)
    return own.shape[1] - n_match, np.where(some, mean, no_match), np.where(some, median, no_match), sign_mis


def _judge(stats: list[ChunkStats], ks: list[int], th: Thresholds) -> Verdict:
    chunks = tuple(stats)
    for i, (s, k) in enumerate(zip(stats, ks, strict=True)):
        if s.exp_mismatches > th.max_exp_mismatch_frac * k:
            return _reject("exponent_mismatch", f"chunk {i}: {s.exp_mismatches}/{k} exponents differ", chunks)
        if s.sign_mismatches > th.max_sign_mismatch_frac * k:
            return _reject("sign_mismatch", f"chunk {i}: {s.sign_mismatches}/{k} signs differ", chunks)
        if s.mant_err_mean > th.max_mant_err_mean or s.mant_err_median > th.max_mant_err_median:
            return _reject(
                "mantissa_mismatch",
                f"chunk {i}: mantissa error mean {s.mant_err_mean:.3g}, median {s.mant_err_median:.3g}",
                chunks,
            )
    return Verdict(True, chunks=chunks)


def verify(
    proof: bytes,
    hidden: torch.Tensor,
    *,
    chunk_size: int = 32,
    topk: int = 128,
    thresholds: Thresholds | None = None,
) -> Verdict:
    """Check ``proof`` against the trusted hidden states ``[T, H]`` of the same positions.

    ``chunk_size`` and ``topk`` are what the verifier requires; a proof built with other parameters is
    rejected. ``thresholds`` defaults to :func:`thresholds_for` the dtype of ``hidden``: pass the
    trusted states in the precision they were computed in, not upcast. Any input gives a
    :class:`Verdict`, with per-chunk statistics once the proof has parsed; a failure carries one of
    :data:`REASONS`.
    """
    return verify_many([proof], [hidden], chunk_size=chunk_size, topk=topk, thresholds=thresholds)[0]


def verify_many(
    proofs,
    hiddens,
    *,
    chunk_size: int = 32,
    topk: int = 128,
    thresholds: Thresholds | None = None,
) -> list[Verdict]:
    """``[verify(p, h) for p, h in zip(proofs, hiddens)]``, with the polynomials of all samples
    evaluated together: a group costs one vectorized pass, not one per sample."""
    try:
        proofs, hiddens = list(proofs), list(hiddens)
    except Exception as exc:  # noqa: BLE001 - a verdict, never a crash
        return [_reject("verification_error", f"{type(exc).__name__}: {exc}")]
    if len(proofs) != len(hiddens):
        detail = f"{len(proofs)} proofs for {len(hiddens)} trusted tensors"
        return [_reject("shape_mismatch", detail) for _ in proofs]
    verdicts: list[Verdict | None] = [None] * len(proofs)
    parsed: dict[int, _Parsed] = {}
    for i, (proof, hidden) in enumerate(zip(proofs, hiddens, strict=True)):
        try:
            result = _parse(proof, hidden, chunk_size, topk, thresholds)
        except Exception as exc:  # noqa: BLE001 - a verdict, never a crash
            result = _reject("verification_error", f"{type(exc).__name__}: {exc}")
        if isinstance(result, Verdict):
            verdicts[i] = result
        else:
            parsed[i] = result
    try:
        verdicts_of = _evaluate_parsed(parsed)
    except Exception:  # noqa: BLE001 - isolate the sample that broke the batch (retried one by one below)
        verdicts_of = {}
        for i, p in parsed.items():
            try:
                verdicts_of.update(_evaluate_parsed({i: p}))
            except Exception as exc:  # noqa: BLE001 - a verdict, never a crash: that sample is rejected
                verdicts_of[i] = _reject("verification_error", f"{type(exc).__name__}: {exc}")
    for i, v in verdicts_of.items():
        verdicts[i] = v
    return verdicts  # type: ignore[return-value]


def _evaluate_parsed(parsed: dict[int, _Parsed]) -> dict[int, Verdict]:
    """Evaluate every parsed proof's polynomials, one batch per distinct ``k``, and judge each sample."""
    by_k: dict[int, list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]] = {}
    for i, p in parsed.items():
        for g, (k, coef, x, own) in enumerate(p.groups):
            by_k.setdefault(k, []).append((i, g, coef, x, own))
    stats: dict[tuple[int, int], list[ChunkStats]] = {}
    for entries in by_k.values():
        claimed = _evaluate(np.concatenate([e[2] for e in entries]), np.concatenate([e[3] for e in entries]))
        columns = _compare(np.concatenate([e[4] for e in entries]), claimed)
        exp_mis, mean, median, sign_mis = (c.tolist() for c in columns)
        row = 0
        for i, g, coef, _, _ in entries:
            stats[(i, g)] = [
                ChunkStats(int(exp_mis[r]), float(mean[r]), float(median[r]), int(sign_mis[r]))
                for r in range(row, row + coef.shape[0])
            ]
            row += coef.shape[0]
    out = {}
    for i, p in parsed.items():
        chunk_stats: list[ChunkStats] = []
        ks: list[int] = []
        for g, (k, coef, _, _) in enumerate(p.groups):
            chunk_stats.extend(stats[(i, g)])
            ks.extend([k] * coef.shape[0])
        out[i] = _judge(chunk_stats, ks, p.thresholds)
    return out


def check_layout(proof, positions: int, hidden_size: int, *, chunk_size: int = 32, topk: int = 128) -> Verdict:
    """Every check of :func:`verify` that needs no hidden states, for a proof of ``positions`` generated
    positions of hidden size ``hidden_size``: header, parameters, length, moduli, coefficients.

    It costs a parse of the bytes, so the verifier runs it on every sample before any forward pass: a
    proof refused here is refused by :func:`verify` with the same reason, whatever the hidden states.
    """
    try:
        result = _layout(proof, positions, hidden_size, chunk_size, topk)
    except Exception as exc:  # noqa: BLE001 - a verdict, never a crash
        result = _reject("verification_error", f"{type(exc).__name__}: {exc}")
    return result if isinstance(result, Verdict) else Verdict(True)


def truncate(proof: bytes, positions: int) -> bytes:
    """The proof of the first ``positions`` positions, cut out of a proof of more.

    Every chunk is committed on its own (its own top-k, modulus and polynomial), so the first chunks of
    a proof are exactly what :func:`commit` gives for those positions alone: ``positions`` must end on
    a chunk boundary or be the proof's own length. Raises ``ValueError`` on a proof whose layout is
    not well formed (check it with :func:`check_layout` first) or on such a cut.
    """
    if len(proof) < HEADER_SIZE:
        raise ValueError(f"{len(proof)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, dtype, chunk_size, topk, t, h = _HEADER.unpack_from(proof)
    if not 0 < positions <= t or (positions != t and positions % chunk_size):
        raise ValueError(f"cannot cut a proof of {t} positions (chunks of {chunk_size}) after {positions}")
    if positions == t:
        return bytes(proof)
    body = (positions // chunk_size) * (2 + 2 * min(topk, chunk_size * h))
    if len(proof) < HEADER_SIZE + body:
        raise ValueError(f"proof is {len(proof)} bytes, too short for {positions} positions")
    header = _HEADER.pack(magic, version, dtype, chunk_size, topk, positions, h)
    return header + bytes(proof[HEADER_SIZE : HEADER_SIZE + body])


def _layout(proof, t: int, h: int, chunk_size: int, topk: int) -> Verdict | list[tuple]:
    """The proof's chunks as ``(start, n, rows, k, moduli [n, 1], coef [n, k])`` batches, or a Verdict
    naming the first thing about its bytes that does not fit ``t`` positions of hidden size ``h``."""
    if not isinstance(proof, (bytes, bytearray, memoryview)):
        return _reject("malformed_proof", f"proof must be bytes, got {type(proof).__name__}")
    proof = bytes(proof)
    if len(proof) < HEADER_SIZE:
        return _reject("malformed_proof", f"{len(proof)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, dtype, p_chunk, p_topk, p_t, p_h = _HEADER.unpack_from(proof)
    if magic != MAGIC or version != FORMAT_VERSION or dtype != DTYPE_BF16:
        return _reject(
            "malformed_proof", f"unknown header (magic {magic!r}, version {version}, dtype {dtype})"
        )
    if p_chunk != chunk_size or p_topk != topk:
        return _reject(
            "parameter_mismatch",
            f"proof built with chunk_size {p_chunk}, topk {p_topk}; required {chunk_size}, {topk}",
        )
    if p_h != h or h < 1:
        return _reject("shape_mismatch", f"proof commits to hidden size {p_h}, trusted states have {h}")
    if p_t != t:
        n_claimed, n_own = math.ceil(p_t / chunk_size), math.ceil(t / chunk_size)
        reason = "chunk_count_mismatch" if n_claimed != n_own else "length_mismatch"
        return _reject(
            reason, f"proof covers {p_t} positions ({n_claimed} chunks), trusted states {t} ({n_own})"
        )
    layout = _chunk_groups(t, h, chunk_size, topk)
    expected = HEADER_SIZE + sum(n * (2 + 2 * k) for _, n, _, k in layout)
    if len(proof) != expected:
        full_record = 2 + 2 * min(topk, chunk_size * h)
        extra = len(proof) - expected
        if extra % full_record == 0:
            return _reject(
                "chunk_count_mismatch", f"proof body holds {extra // full_record:+d} chunks too many"
            )
        return _reject("malformed_proof", f"proof is {len(proof)} bytes, its header implies {expected}")
    batches = []
    offset, first = HEADER_SIZE, 0
    for start, n, rows, k in layout:
        body = np.frombuffer(proof, dtype=">u2", count=n * (k + 1), offset=offset).astype(np.int64)
        body = body.reshape(n, k + 1)
        offset += 2 * n * (k + 1)
        moduli, coef = body[:, :1], body[:, 1:]
        bad_m = np.nonzero((moduli[:, 0] < max(k, 1)) | (moduli[:, 0] > P))[0]
        if bad_m.size:
            i = int(bad_m[0])
            return _reject(
                "malformed_proof", f"chunk {first + i}: modulus {int(moduli[i, 0])} outside [{k}, {P}]"
            )
        if bool((coef >= P).any()):
            return _reject(
                "malformed_proof", f"a coefficient in chunks {first}..{first + n - 1} is not below {P}"
            )
        batches.append((start, n, rows, k, moduli, coef))
        first += n
    return batches


def _parse(proof, hidden, chunk_size: int, topk: int, thresholds: Thresholds | None) -> Verdict | _Parsed:
    """Every check that needs no polynomial, then the verifier's own top-k; a Verdict if one fails."""
    if not isinstance(proof, (bytes, bytearray, memoryview)):
        return _reject("malformed_proof", f"proof must be bytes, got {type(proof).__name__}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        return _reject("shape_mismatch", f"trusted hidden states must be a 2-D float tensor, got {shape}")
    t, h = hidden.shape
    batches = _layout(proof, t, h, chunk_size, topk)
    if isinstance(batches, Verdict):
        return batches
    if not bool(torch.isfinite(hidden).all()):
        return _reject("non_finite_hidden", "trusted hidden states contain NaN or infinity")
    hidden = hidden.detach()
    groups = []
    for start, n, rows, k, moduli, coef in batches:
        idx, own = _topk(hidden, start, n, rows, k)
        groups.append((k, coef, idx % moduli, own))  # the reduction the public Python verifier forgot
    th = thresholds if thresholds is not None else thresholds_for(hidden.dtype)
    return _Parsed(th, groups)
