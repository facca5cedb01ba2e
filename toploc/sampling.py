"""Seeded Gumbel-max sampling that anyone can replay, on any device.

The noise for row ``r`` (seed ``s``), position ``t`` and token ``v`` is a counter-based hash of
``(s, t, v)`` built from 32-bit integer operations on int64 tensors. Every intermediate value stays
below 2**49, so no signed overflow happens anywhere and CPU and GPU produce the same bits. The
24-bit uniform drawn from the hash is turned into Gumbel noise in float64; that last step may differ
by an ulp between devices, which is far below the near-tie tolerance of :func:`verify_samples`.

    token = argmax(logits / T + gumbel(seed, t, ·))

Because the coordinator assigns the seed, a node cannot choose which token it draws: for given logits
there is exactly one right answer, and the verifier recomputes it from its own trusted logits.

Cost at real vocabularies. Hashing every token of a 49k-152k vocabulary for every generated position
costs more than the model's own forward on a CPU (measured on SmolLM2-135M, vocab 49,152: the replay
of a 16 x 64 group took 9 s of a 9.5 s verification, the prefill 3.4 s). But the noise is bounded
above: the largest 24-bit uniform gives :data:`GUMBEL_MAX` (~17.3). A token whose scaled logit is more
than that below the best perturbed score found so far can never win, so only the few tokens near the
top are hashed (:func:`sample_sparse`, :func:`race`): the same argmax, bit for bit, as the dense draw
(:func:`sample_dense`, which a compiler or a GPU prefers), pinned by tests on random and adversarial
logits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from veriroll.toploc.verdict import Verdict

M32 = 0xFFFFFFFF
_SEED_SALT = 0x9E3779B9
_POS_MUL, _POS_ADD = 0x85EBCA77, 0x165667B1
_TOK_MUL, _TOK_ADD = 0xC2B2AE3D, 0x27D4EB2F
_FMIX_1, _FMIX_2 = 0x85EBCA6B, 0xC2B2AE35

# Margin (on the logit scale) under which a replay that picks another token is put down to numerical
# noise rather than cheating. Calibrated by benchmarks/toploc.py: honest fp32 margins between a
# KV-cached decode and a batched prefill stay below 1e-4 on the tiny models; bf16 ones below ~3e-2.
DEFAULT_MARGIN_TOLERANCE = 0.05


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 without ever leaving the int64 range."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & M32


def _mul32_wrapping(x: torch.Tensor, c: int) -> torch.Tensor:
    """:func:`_mul32` in one multiply: the int64 product wraps modulo 2**64 (two's complement, as every
    CPU torch runs on computes it) and its low 32 bits are exactly (x * c) mod 2**32. Used on CPU tensors
    only, where it is 3x cheaper; a test pins it to the overflow-free form and to a pure-Python hash."""
    return (x * c) & M32


def _fmix32(x: torch.Tensor, mul=_mul32) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection on [0, 2**32) with full avalanche."""
    x = x ^ (x >> 16)
    x = mul(x, _FMIX_1)
    x = x ^ (x >> 13)
    x = mul(x, _FMIX_2)
    return x ^ (x >> 16)


def _fmix32_fast(x: torch.Tensor) -> torch.Tensor:
    """:func:`_fmix32` with the wrapping multiply (CPU tensors)."""
    return _fmix32(x, _mul32_wrapping)


def _seed_tensor(seed: int | Sequence[int] | torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
    """Seeds as int64 bit patterns, one per row. Python ints may be any uint64 value."""
    if isinstance(seed, torch.Tensor):
        s = seed.to(device=device, dtype=torch.int64).reshape(-1)
    else:
        values = [seed] * n if isinstance(seed, int) else list(seed)
        # Reinterpret uint64 as int64: the hash only ever looks at the two 32-bit halves.
        s = torch.tensor([v - (1 << 64) if v >= (1 << 63) else v for v in values], dtype=torch.int64, device=device)
    if s.numel() == 1 and n != 1:
        s = s.expand(n)
    if s.numel() != n:
        raise ValueError(f"got {s.numel()} seeds for {n} rows")
    return s


def hash_bits(seed, positions, vocab_size: int, *, device=None) -> torch.Tensor:
    """The raw 32-bit hash for every (row, token): int64 tensor ``[N, vocab_size]`` with values < 2**32."""
    rows = _row_keys(seed, positions, device=device)
    return _fmix32(rows[:, None] ^ _token_keys(vocab_size, rows.device)[None, :])


def gumbel_noise(seed, positions, vocab_size: int, *, device=None) -> torch.Tensor:
    """Standard Gumbel noise ``[N, vocab_size]`` (float32) for rows at ``positions`` with ``seed``.

    ``seed`` is one uint64 for all rows or one per row; ``positions`` the index of the generated token
    within its sample (0 for the first generated token).
    """
    return _noise_bits_to_gumbel(hash_bits(seed, positions, vocab_size, device=device))


def _noise_bits_to_gumbel(bits: torch.Tensor) -> torch.Tensor:
    u = ((bits >> 8).to(torch.float64) + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)
    return (-torch.log(-torch.log(u))).to(torch.float32)


GUMBEL_MAX = float(_noise_bits_to_gumbel(torch.tensor([M32], dtype=torch.int64))[0])
"""The largest noise any (seed, position, token) can get, as the float32 the draw adds (~17.33)."""


def _row_keys(seed, positions, device=None) -> torch.Tensor:
    """The per-row half of the hash (seed and position mixed), int64 ``[N]`` with values < 2**32."""
    pos = torch.as_tensor(positions, dtype=torch.int64, device=device).reshape(-1)
    s = _seed_tensor(seed, pos.numel(), pos.device)
    lo, hi = s & M32, (s >> 32) & M32
    key = _fmix32(lo ^ _fmix32(hi ^ _SEED_SALT))
    return _fmix32(key ^ _fmix32((_mul32(pos & M32, _POS_MUL) + _POS_ADD) & M32))


def noise_at(row_keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel noise (float32) of each (row key, token id) pair: the entries of :func:`gumbel_noise` at
    those tokens, computed without touching the rest of the vocabulary."""
    if tokens.device.type == "cpu":
        tok = (_mul32_wrapping(tokens.to(torch.int64), _TOK_MUL) + _TOK_ADD) & M32
        return _noise_bits_to_gumbel(_fmix32_fast(row_keys ^ tok))
    tok = (_mul32(tokens.to(torch.int64), _TOK_MUL) + _TOK_ADD) & M32
    return _noise_bits_to_gumbel(_fmix32(row_keys ^ tok))


@dataclass
class Race:
    """The seeded draw on a set of rows: the winning token per row and its perturbed score, plus how
    many (row, token) pairs had to be hashed to be sure (``hashed``; the dense draw hashes N x V)."""

    winner: torch.Tensor
    best: torch.Tensor
    hashed: int


def race(logits: torch.Tensor, temperature: float, row_keys: torch.Tensor, *, include: torch.Tensor | None = None,
         topk: int = 4, chunk_pairs: int = 1 << 22) -> Race:
    """``argmax_v(logits[r, v] / T + noise(r, v))`` (scores in float32, as :func:`perturbed_logits`) for
    every row of ``logits [N, V]``, hashing only tokens that can still win.

    Exactness: every perturbed score is ``fl(fl(l / T) + g)`` with ``g <= GUMBEL_MAX``. ``b`` starts as the
    best score among the top ``topk`` logits of the row (and ``include``, one more token per row, e.g. the
    claimed one); every token with ``l / T >= b - GUMBEL_MAX`` (less a slack far above float32 rounding)
    is hashed, and no other token can reach ``b``. Ties go to the lowest token id, as ``torch.argmax``
    does. Rows go in chunks of at most ``chunk_pairs`` logits, which bounds the memory held.
    """
    if not temperature > 0:
        raise ValueError("perturbed logits need a positive temperature")
    n, v = logits.shape
    device = logits.device
    winners = torch.empty(n, dtype=torch.int64, device=device)
    best = torch.empty(n, dtype=torch.float32, device=device)
    hashed = 0
    step = max(1, chunk_pairs // max(v, 1))
    k = min(topk, v)
    for start in range(0, n, step):
        stop = min(n, start + step)
        chunk, keys = logits[start:stop].float(), row_keys[start:stop]
        top = torch.topk(chunk, k, dim=-1)
        lower = (top.values / temperature + noise_at(keys[:, None], top.indices)).amax(dim=-1)
        if include is not None:
            inc = include[start:stop].to(torch.int64).reshape(-1, 1)
            got = (chunk.gather(1, inc) / temperature + noise_at(keys[:, None], inc)).squeeze(1)
            lower = torch.maximum(lower, got)
        # In float64, then widened by a relative 1e-4: more candidates than strictly needed, never fewer.
        floor = lower.double() - GUMBEL_MAX
        floor = (floor - 1e-4 * (floor.abs() + 1.0)) * temperature
        rows, cols = (chunk >= floor.float()[:, None]).nonzero(as_tuple=True)
        hashed += int(rows.numel())
        z = chunk[rows, cols] / temperature + noise_at(keys[rows], cols)
        m = stop - start
        row_best = torch.full((m,), -math.inf, dtype=torch.float32, device=device)
        row_best.scatter_reduce_(0, rows, z, reduce="amax")
        # Lowest token id among those reaching the row's best (torch.argmax's tie rule).
        first = torch.full((m,), v, dtype=torch.int64, device=device)
        at_best = z == row_best[rows]
        first.scatter_reduce_(0, rows[at_best], cols[at_best], reduce="amin")
        odd = first >= v
        if bool(odd.any()):
            # Rows whose scores are all NaN or -inf: answer exactly what the dense argmax answers.
            idx = torch.nonzero(odd).flatten()
            dense = chunk[idx] / temperature + _noise_bits_to_gumbel(
                _fmix32(keys[idx][:, None] ^ _token_keys(v, device)[None, :]))
            first[idx] = dense.argmax(dim=-1)
            row_best[idx] = dense.gather(1, first[idx][:, None]).squeeze(1)
            hashed += int(idx.numel()) * v
        winners[start:stop], best[start:stop] = first, row_best
    return Race(winners, best, hashed)


def _token_keys(vocab_size: int, device) -> torch.Tensor:
    tok = torch.arange(vocab_size, dtype=torch.int64, device=device)
    return (_mul32(tok, _TOK_MUL) + _TOK_ADD) & M32


def perturbed_logits(logits: torch.Tensor, temperature: float, seed, positions) -> torch.Tensor:
    """``logits / T + gumbel``, in float32: the quantity whose argmax is the sampled token."""
    if temperature <= 0:
        raise ValueError("perturbed logits need a positive temperature")
    noise = gumbel_noise(seed, positions, logits.shape[-1], device=logits.device)
    return logits.float() / temperature + noise


def sample_dense(logits: torch.Tensor, temperature: float, seed, positions) -> torch.Tensor:
    """:func:`sample` by hashing the whole vocabulary: fixed shapes, what ``torch.compile`` and GPUs like."""
    if temperature == 0:
        return logits.float().argmax(dim=-1)
    return perturbed_logits(logits, temperature, seed, positions).argmax(dim=-1)


def sample_sparse(logits: torch.Tensor, temperature: float, seed, positions) -> torch.Tensor:
    """:func:`sample` hashing only the tokens that can win (:func:`race`): the same tokens, far cheaper
    on a CPU at real vocabulary sizes."""
    if temperature == 0:
        return logits.float().argmax(dim=-1)
    return race(logits, temperature, _row_keys(seed, positions, device=logits.device)).winner


def sample(logits: torch.Tensor, temperature: float, seed, positions) -> torch.Tensor:
    """Tokens ``[N]`` drawn from ``softmax(logits / T)`` by seeded Gumbel-max; greedy when ``T == 0``.

    On a CPU only the tokens that can still win are hashed (:func:`sample_sparse`); elsewhere the whole
    vocabulary is (:func:`sample_dense`). Both give the same tokens.
    """
    if logits.device.type == "cpu":
        return sample_sparse(logits, temperature, seed, positions)
    return sample_dense(logits, temperature, seed, positions)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities ``[N]`` of ``tokens`` under ``softmax(logits / T)`` (float32)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.long().reshape(-1, 1)).squeeze(-1)


def verify_samples(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    seed,
    positions,
    *,
    margin_tolerance: float = DEFAULT_MARGIN_TOLERANCE,
) -> Verdict:
    """Replay the seeded draw on trusted ``logits [N, V]`` and compare with the claimed ``tokens [N]``.

    A position where the replay picks another token is excused only if, on the trusted logits, the
    claimed token's perturbed score is within ``margin_tolerance`` (logit units) of the winner's: a
    near-tie that numerical noise between two engines can flip. Anything else is a mismatch.
    """
    try:
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=logits.device).reshape(-1)
        if logits.dim() != 2 or logits.shape[0] != tokens.numel():
            return Verdict(False, "shape_mismatch", f"{tokens.numel()} tokens for logits {tuple(logits.shape)}")
        if tokens.numel() == 0:
            return Verdict(True)
        if bool(((tokens < 0) | (tokens >= logits.shape[1])).any()):
            return Verdict(False, "token_out_of_range", "a claimed token id is outside the vocabulary")
        if temperature == 0:
            z = logits.float()
            replay = z.argmax(dim=-1)
            margin = (z.gather(-1, replay[:, None]) - z.gather(-1, tokens[:, None])).squeeze(-1)
        else:
            # The replay hashes only tokens that could beat the claimed one (see race): the winner and
            # its score are exactly the dense draw's, at a fraction of the cost.
            keys = _row_keys(seed, positions, device=logits.device)
            won = race(logits, temperature, keys, include=tokens)
            replay = won.winner
            claimed = logits.gather(-1, tokens[:, None]).squeeze(-1).float() / temperature + noise_at(keys, tokens)
            margin = (won.best - claimed) * temperature
    except (ValueError, RuntimeError, TypeError) as exc:
        return Verdict(False, "malformed_input", str(exc))
    bad = margin > margin_tolerance
    max_margin = float(margin.max()) if margin.numel() else 0.0
    if bool(bad.any()):
        where = tuple(int(i) for i in torch.nonzero(bad).flatten().tolist())
        return Verdict(
            False,
            "sampling_mismatch",
            f"{len(where)} of {tokens.numel()} tokens are not the seeded draw (max margin {max_margin:.4g})",
            mismatched_positions=where,
            max_margin=max_margin,
        )
    return Verdict(True, max_margin=max_margin)
