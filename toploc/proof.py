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

``verify`` turns any input into a :class:`Verdict`; it never raises.
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
    """Mean |mantissa difference| (in bf16 ulps, 7-bit mantissa) over exponent-matching entries."""
    max_mant_err_median: float
    """Median of the same."""


# Defaults calibrated by benchmarks/toploc_calibration.py (figures per chunk of 32 tokens, top-128):
# FILLED IN AFTER CALIBRATION
THRESHOLDS_FP32 = Thresholds(
    max_exp_mismatch_frac=0.25,
    max_sign_mismatch_frac=0.05,
    max_mant_err_mean=2.0,
    max_mant_err_median=1.0,
)
THRESHOLDS_BF16 = Thresholds(
    max_exp_mismatch_frac=0.25,
    max_sign_mismatch_frac=0.05,
    max_mant_err_mean=2.0,
    max_mant_err_median=1.0,
)
THRESHOLDS_FP16 = THRESHOLDS_BF16
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
    inv = _inverse_table()
    c, k = x.shape
    dd = y.astype(np.int64) % P
    for j in range(1, k):
        num = (dd[:, j:] - dd[:, j - 1 : k - 1]) % P
        den = (x[:, j:] - x[:, : k - j]) % P
        dd[:, j:] = num * inv[den] % P
    coef = np.zeros((c, k), dtype=np.int64)
    coef[:, 0] = dd[:, k - 1]
    for j in range(k - 2, -1, -1):
        d = k - 1 - j  # degree after multiplying by (t - x_j)
        low = coef[:, :d].copy()
        coef[:, 1 : d + 1] = low
        coef[:, 0] = 0
        coef[:, :d] -= x[:, j : j + 1] * low % P
        coef[:, 0] += dd[:, j]
        coef[:, : d + 1] %= P
    return coef


def _evaluate(coef: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Horner evaluation mod P of each row's polynomial ``coef[c]`` at the points ``x[c, :]``."""
    k = coef.shape[1]
    acc = np.broadcast_to(coef[:, k - 1 : k], x.shape).copy()
    for j in range(k - 2, -1, -1):
        acc = (acc * x + coef[:, j : j + 1]) % P
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


def _chunk_bounds(t: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_size, t)) for s in range(0, t, chunk_size)]


def _topk(
    hidden: torch.Tensor, start: int, stop: int, n_chunks: int, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices ``[C, k]`` of the top-k magnitudes and their bf16 patterns, for equal-sized chunks.

    Chunks are ``hidden[start:stop]`` split into ``n_chunks`` blocks of equal rows. Ranking by an int64
    key ``(|x| bits, -index)`` makes the choice among equal magnitudes deterministic on every device.
    """
    block = hidden[start:stop].reshape(n_chunks, -1)
    mag = block.float().abs().view(torch.int32).to(torch.int64)
    flat = torch.arange(block.shape[1], dtype=torch.int64, device=block.device)
    key = (mag << 32) | (0xFFFFFFFF - flat)
    idx = torch.topk(key, k, dim=1, sorted=False).indices
    picked = torch.gather(block, 1, idx)
    vals = picked.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    vals = torch.where(torch.isnan(picked), torch.full_like(vals, _NAN_BF16), vals)
    return idx.cpu().numpy(), vals.cpu().numpy()


def _chunk_groups(t: int, h: int, chunk_size: int, topk: int) -> list[tuple[int, int, int, int]]:
    """``(start, stop, n_chunks, k)`` for the full chunks (batched) and the last partial one."""
    groups = []
    full = t // chunk_size
    if full:
        groups.append((0, full * chunk_size, full, min(topk, chunk_size * h)))
    if t % chunk_size:
        groups.append((full * chunk_size, t, 1, min(topk, (t % chunk_size) * h)))
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
        for g, (start, stop, n, k) in enumerate(_chunk_groups(t, h, chunk_size, topk)):
            idx, vals = _topk(hidden.detach(), start, stop, n, k)
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


def _compare(own: np.ndarray, claimed: np.ndarray) -> list[ChunkStats]:
    """Per-row statistics between the verifier's bf16 patterns and the polynomial's values."""
    exp_own, exp_claimed = (own >> 7) & 0xFF, (claimed >> 7) & 0xFF
    exp_match = exp_own == exp_claimed
    sign_diff = ((own >> 15) != (claimed >> 15)) & exp_match
    mant_err = np.abs((own & 0x7F) - (claimed & 0x7F)).astype(np.float64)
    stats = []
    for r in range(own.shape[0]):
        errs = mant_err[r][exp_match[r]]
        mean = float(errs.mean()) if errs.size else MANT_ERR_NO_MATCH
        median = float(np.median(errs)) if errs.size else MANT_ERR_NO_MATCH
        stats.append(ChunkStats(int((~exp_match[r]).sum()), mean, median, int(sign_diff[r].sum())))
    return stats


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
    trusted states in the precision they were computed in, not upcast. Any input gives a :class:`Verdict` with per-chunk statistics when the proof parsed, and
    one of the reasons ``malformed_proof``, ``parameter_mismatch``, ``shape_mismatch``,
    ``non_finite_hidden``, ``chunk_count_mismatch``, ``length_mismatch``, ``exponent_mismatch``,
    ``sign_mismatch``, ``mantissa_mismatch`` when it fails.
    """
    try:
        return _verify(proof, hidden, chunk_size, topk, thresholds)
    except Exception as exc:  # a verdict, never a crash: anything unforeseen is a rejection
        return _reject("verification_error", f"{type(exc).__name__}: {exc}")


def _verify(proof, hidden, chunk_size: int, topk: int, thresholds: Thresholds | None) -> Verdict:
    if not isinstance(proof, (bytes, bytearray, memoryview)):
        return _reject("malformed_proof", f"proof must be bytes, got {type(proof).__name__}")
    proof = bytes(proof)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        return _reject("shape_mismatch", f"trusted hidden states must be a 2-D float tensor, got {shape}")
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
    t, h = hidden.shape
    if p_h != h or h < 1:
        return _reject("shape_mismatch", f"proof commits to hidden size {p_h}, trusted states have {h}")
    if p_t != t:
        n_claimed, n_own = math.ceil(p_t / chunk_size), math.ceil(t / chunk_size)
        reason = "chunk_count_mismatch" if n_claimed != n_own else "length_mismatch"
        return _reject(
            reason, f"proof covers {p_t} positions ({n_claimed} chunks), trusted states {t} ({n_own})"
        )
    groups = _chunk_groups(t, h, chunk_size, topk)
    expected = HEADER_SIZE + sum(n * (2 + 2 * k) for _, _, n, k in groups)
    if len(proof) != expected:
        full_record = 2 + 2 * min(topk, chunk_size * h)
        extra = len(proof) - expected
        if extra % full_record == 0:
            return _reject(
                "chunk_count_mismatch", f"proof body holds {extra // full_record:+d} chunks too many"
            )
        return _reject("malformed_proof", f"proof is {len(proof)} bytes, its header implies {expected}")
    if not bool(torch.isfinite(hidden).all()):
        return _reject("non_finite_hidden", "trusted hidden states contain NaN or infinity")

    hidden = hidden.detach()
    th = thresholds if thresholds is not None else thresholds_for(hidden.dtype)
    stats: list[ChunkStats] = []
    ks: list[int] = []
    offset = HEADER_SIZE
    for start, stop, n, k in groups:
        body = np.frombuffer(proof, dtype=">u2", count=n * (k + 1), offset=offset).astype(np.int64)
        offset += 2 * n * (k + 1)
        body = body.reshape(n, k + 1)
        moduli, coef = body[:, :1], body[:, 1:]
        first = len(stats)
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
        idx, own = _topk(hidden, start, stop, n, k)
        claimed = _evaluate(coef, idx % moduli)
        stats.extend(_compare(own, claimed))
        ks.extend([k] * n)
    return _judge(stats, ks, th)
