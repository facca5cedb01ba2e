"""Seeded Gumbel-max sampling that anyone can replay, on any device.

The noise for row ``r`` (seed ``s``), position ``t`` and token ``v`` is a counter-based hash of
``(s, t, v)`` built from 32-bit integer operations on int64 tensors. Every intermediate value stays
below 2**49, so no signed overflow happens anywhere and CPU and GPU produce the same bits. The
24-bit uniform drawn from the hash is turned into Gumbel noise in float64; that last step may differ
by an ulp between devices, which is far below the near-tie tolerance of :func:`verify_samples`.

    token = argmax(logits / T + gumbel(seed, t, ·))

Because the coordinator assigns the seed, a node cannot choose which token it draws: for given logits
there is exactly one right answer, and the verifier recomputes it from its own trusted logits.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection on [0, 2**32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, _FMIX_1)
    x = x ^ (x >> 13)
    x = _mul32(x, _FMIX_2)
    return x ^ (x >> 16)


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
    pos = torch.as_tensor(positions, dtype=torch.int64, device=device).reshape(-1)
    device = pos.device
    s = _seed_tensor(seed, pos.numel(), device)
    lo, hi = s & M32, (s >> 32) & M32
    key = _fmix32(lo ^ _fmix32(hi ^ _SEED_SALT))
    row = _fmix32(key ^ _fmix32((_mul32(pos & M32, _POS_MUL) + _POS_ADD) & M32))
    tok = torch.arange(vocab_size, dtype=torch.int64, device=device)
    tok = (_mul32(tok, _TOK_MUL) + _TOK_ADD) & M32
    return _fmix32(row[:, None] ^ tok[None, :])


def gumbel_noise(seed, positions, vocab_size: int, *, device=None) -> torch.Tensor:
    """Standard Gumbel noise ``[N, vocab_size]`` (float32) for rows at ``positions`` with ``seed``.

    ``seed`` is one uint64 for all rows or one per row; ``positions`` the index of the generated token
    within its sample (0 for the first generated token).
    """
    bits = hash_bits(seed, positions, vocab_size, device=device)
    u = ((bits >> 8).to(torch.float64) + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)
    return (-torch.log(-torch.log(u))).to(torch.float32)


def perturbed_logits(logits: torch.Tensor, temperature: float, seed, positions) -> torch.Tensor:
    """``logits / T + gumbel``, in float32: the quantity whose argmax is the sampled token."""
    if temperature <= 0:
        raise ValueError("perturbed logits need a positive temperature")
    noise = gumbel_noise(seed, positions, logits.shape[-1], device=logits.device)
    return logits.float() / temperature + noise


def sample(logits: torch.Tensor, temperature: float, seed, positions) -> torch.Tensor:
    """Tokens ``[N]`` drawn from ``softmax(logits / T)`` by seeded Gumbel-max; greedy when ``T == 0``."""
    if temperature == 0:
        return logits.float().argmax(dim=-1)
    return perturbed_logits(logits, temperature, seed, positions).argmax(dim=-1)


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
        else:
            z = perturbed_logits(logits, temperature, seed, positions)
        replay = z.argmax(dim=-1)
        scale = temperature if temperature > 0 else 1.0
        margin = (z.gather(-1, replay[:, None]) - z.gather(-1, tokens[:, None])).squeeze(-1) * scale
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
