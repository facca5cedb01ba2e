"""TOPLOC commitments: honest hidden states pass, every tampering fails with its own reason."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from veriroll.toploc import (
    REASONS,
    Thresholds,
    Verdict,
    commit,
    commit_many,
    thresholds_for,
    verify,
    verify_many,
)
from veriroll.toploc import proof as toploc_proof

HEADER = toploc_proof.HEADER_SIZE


def hidden_states(t: int = 96, h: int = 64, seed: int = 0, outliers: bool = True) -> torch.Tensor:
    """Final-norm-like hidden states: unit Gaussian with a few large channels, as real LLMs have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    if outliers:
        x[:, torch.randperm(h, generator=g)[:3]] *= 15.0
    return x


def noisy(x: torch.Tensor, rel: float, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return x * (1 + rel * torch.randn(x.shape, generator=g))


# ------------------------------------------------------------------------------------------------
# Honest hidden states pass


def test_same_tensor_passes_with_zero_error():
    x = hidden_states()
    v = verify(commit(x), x)
    assert v.ok and v.reason == ""
    assert len(v.chunks) == 3
    assert all(c.exp_mismatches == 0 and c.sign_mismatches == 0 and c.mant_err_mean == 0 for c in v.chunks)


@pytest.mark.parametrize("rel", [1e-6, 1e-5, 1e-4])
def test_float32_relative_noise_like_kv_cache_vs_prefill_passes(rel):
    x = hidden_states(h=256)
    assert verify(commit(x), noisy(x, rel)).ok


def test_bf16_roundtrip_passes_both_ways():
    x = hidden_states()
    assert verify(commit(x.bfloat16()), x).ok  # a bf16 node, float32 trusted states of the same values
    assert verify(commit(x), x.bfloat16()).ok  # and the other way round
    assert verify(commit(x.bfloat16()), x.bfloat16()).ok


def test_fp16_input_is_committed_as_bf16():
    x = hidden_states()
    assert commit(x.half()) == commit(x.half().float())
    assert verify(commit(x.half()), x.half()).ok


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=48,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval().to(dtype)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, length: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy KV-cached decode; the final-norm hidden state of each position that produced a token."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    h = model.model(input_ids=prompt, cache=cache, use_cache=True).last_hidden_state[:, -1]
    tokens, states = [], []
    for _ in range(length):
        tok = model.lm_head(h).argmax(-1)
        tokens.append(tok)
        states.append(h)
        h = model.model(input_ids=tok[:, None], cache=cache, use_cache=True).last_hidden_state[:, -1]
    return torch.stack(tokens, 1), torch.stack(states, 1)


@torch.no_grad()
def prefill(model, prompt: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The verifier's single forward of prompt + completion, at the positions that produced the tokens."""
    p = prompt.shape[1]
    return model.model(input_ids=torch.cat([prompt, tokens], 1)).last_hidden_state[
        :, p - 1 : p - 1 + tokens.shape[1]
    ]


PROMPT = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(5))


def test_kv_cached_generation_matches_full_forward_of_tiny_llama():
    model = tiny_llama()
    tokens, states = generate(model, PROMPT)
    trusted = prefill(model, PROMPT, tokens)
    proofs = commit_many(list(states))
    assert all(v.ok for v in verify_many(proofs, list(trusted)))
    # and the proof of one sample does not pass for the other
    assert verify(proofs[0], trusted[1]).reason == "exponent_mismatch"


def test_bf16_generation_verified_by_a_bf16_prefill_passes():
    model = tiny_llama(dtype=torch.bfloat16)
    tokens, states = generate(model, PROMPT)
    trusted = prefill(model, PROMPT, tokens)
    assert trusted.dtype == torch.bfloat16
    assert all(v.ok for v in verify_many(commit_many(list(states)), list(trusted)))


def test_bf16_generation_claimed_as_fp32_fails_on_mantissa():
    tokens, states = generate(tiny_llama(dtype=torch.bfloat16), PROMPT)
    trusted = prefill(tiny_llama(), PROMPT, tokens)  # the precision the node claimed
    verdicts = verify_many(commit_many(list(states)), list(trusted))
    assert [v.reason for v in verdicts] == ["mantissa_mismatch"] * 2


def test_another_random_init_fails_on_exponent():
    tokens, states = generate(tiny_llama(seed=1), PROMPT)
    trusted = prefill(tiny_llama(seed=0), PROMPT, tokens)
    verdicts = verify_many(commit_many(list(states)), list(trusted))
    assert [v.reason for v in verdicts] == ["exponent_mismatch"] * 2


def test_equal_magnitudes_are_ranked_the_same_on_both_sides():
    # many exact ties at the top-k boundary: both sides must pick the same indices
    x = torch.ones(64, 64)
    x[::3] *= -1
    x[5, 7] = 3.0
    assert verify(commit(x), x.clone()).ok
    assert verify(commit(x.bfloat16()), x).ok


def test_empty_hidden_states_give_a_header_only_proof_that_passes():
    x = torch.zeros(0, 64)
    proof = commit(x)
    assert len(proof) == HEADER
    assert verify(proof, x).ok


# ------------------------------------------------------------------------------------------------
# Attacks fail, each with its reason


def test_negated_activations_fail_on_sign():
    x = hidden_states()
    v = verify(commit(-x), x)
    assert not v.ok and v.reason == "sign_mismatch"
    assert v.chunks[0].sign_mismatches == 128 and v.chunks[0].exp_mismatches == 0


def test_partly_negated_activations_fail_on_sign():
    x = hidden_states(outliers=False)
    y = x.clone()
    y[:, : y.shape[1] // 4] *= -1  # a quarter of the channels
    assert verify(commit(y), x).reason == "sign_mismatch"


def test_rescaled_by_five_percent_fails_on_mantissa():
    x = hidden_states()
    v = verify(commit(x * 1.05), x)
    assert not v.ok and v.reason == "mantissa_mismatch"


def test_rescaled_by_half_fails_on_exponent():
    x = hidden_states()
    v = verify(commit(x * 0.5), x)
    assert not v.ok and v.reason == "exponent_mismatch"
    assert all(c.exp_mismatches == 128 for c in v.chunks)


def test_unrelated_tensor_fails_on_exponent():
    v = verify(commit(hidden_states(seed=1)), hidden_states(seed=2))
    assert not v.ok and v.reason == "exponent_mismatch"


def test_proof_copied_from_another_sample_fails():
    a, b = hidden_states(seed=3), hidden_states(seed=4)
    assert verify(commit(a), a).ok
    assert verify(commit(a), b).reason == "exponent_mismatch"


def test_one_tampered_chunk_rejects_the_whole_proof():
    x = hidden_states()
    y = x.clone()
    y[40:50] = hidden_states(t=10, seed=9)
    v = verify(commit(y), x)
    assert v.reason == "exponent_mismatch"
    assert v.chunks[0].exp_mismatches == 0 and v.chunks[2].exp_mismatches == 0
    assert "chunk 1" in v.detail


def test_fewer_chunks_than_positions_fail_on_chunk_count():
    x = hidden_states(t=96)
    assert verify(commit(x[:64]), x).reason == "chunk_count_mismatch"
    assert verify(commit(x), x[:64]).reason == "chunk_count_mismatch"


def test_extra_chunk_appended_to_the_body_fails_on_chunk_count():
    x = hidden_states(t=64)
    proof = commit(x)
    assert verify(proof + proof[HEADER : HEADER + 258], x).reason == "chunk_count_mismatch"
    assert verify(proof[:-258], x).reason == "chunk_count_mismatch"


def test_same_chunk_count_but_other_length_fails_on_length():
    x = hidden_states(t=90)
    assert verify(commit(x[:70]), x).reason == "length_mismatch"


def test_other_chunk_size_or_topk_fails_on_parameters():
    x = hidden_states()
    assert verify(commit(x, topk=64), x).reason == "parameter_mismatch"
    assert verify(commit(x, chunk_size=16), x).reason == "parameter_mismatch"
    assert verify(commit(x, topk=64), x, topk=64).ok


def test_other_hidden_size_fails_on_shape():
    assert verify(commit(hidden_states(h=64)), hidden_states(h=32)).reason == "shape_mismatch"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_trusted_states_are_rejected(bad):
    x = hidden_states()
    proof = commit(x)
    x[3, 4] = bad
    assert verify(proof, x).reason == "non_finite_hidden"


def test_nan_from_the_node_is_committed_and_then_rejected():
    x = hidden_states()
    y = x.clone()
    y[0, :] = float("nan")
    assert not verify(commit(y), x).ok


def test_zero_modulus_is_a_malformed_proof():
    x = hidden_states(t=32)
    proof = bytearray(commit(x))
    proof[HEADER : HEADER + 2] = b"\x00\x00"
    assert verify(bytes(proof), x).reason == "malformed_proof"


def test_coefficient_outside_the_field_is_a_malformed_proof():
    x = hidden_states(t=32)
    proof = bytearray(commit(x))
    proof[HEADER + 2 : HEADER + 4] = struct.pack(">H", 0xFFFF)
    assert verify(bytes(proof), x).reason == "malformed_proof"


@pytest.mark.parametrize("mangle", ["empty", "short", "magic", "version", "dtype", "truncated", "odd"])
def test_malformed_bytes_are_a_verdict(mangle):
    x = hidden_states()
    p = commit(x)
    bad = {
        "empty": b"",
        "short": p[:5],
        "magic": b"XX" + p[2:],
        "version": p[:2] + b"\x09" + p[3:],
        "dtype": p[:3] + b"\x07" + p[4:],
        "truncated": p[:-1],
        "odd": p + b"\x00",
    }[mangle]
    v = verify(bad, x)
    assert isinstance(v, Verdict) and not v.ok and v.reason == "malformed_proof"


def test_huge_lengths_in_the_header_are_rejected_without_allocating():
    x = hidden_states(t=32)
    header = struct.pack(">2sBBHHII", b"TL", 1, 1, 32, 128, 0xFFFFFFFF, 64)
    assert verify(header + commit(x)[HEADER:], x).reason == "chunk_count_mismatch"
    header = struct.pack(">2sBBHHII", b"TL", 1, 1, 32, 128, 32, 0xFFFFFFFF)
    assert verify(header + commit(x)[HEADER:], x).reason == "shape_mismatch"


@pytest.mark.parametrize(
    "hidden", [torch.zeros(4), torch.zeros(2, 3, 4), torch.zeros(32, 64, dtype=torch.int64), "tensor", None]
)
def test_wrongly_shaped_trusted_states_are_a_verdict(hidden):
    v = verify(commit(hidden_states(t=32)), hidden)
    assert not v.ok and v.reason == "shape_mismatch"


def test_a_proof_that_is_not_bytes_is_a_verdict():
    assert verify("not bytes", hidden_states()).reason == "malformed_proof"
    assert verify(None, hidden_states()).reason == "malformed_proof"


def test_every_reason_is_listed():
    assert set(REASONS) >= {
        "malformed_proof",
        "chunk_count_mismatch",
        "exponent_mismatch",
        "mantissa_mismatch",
        "sign_mismatch",
    }


# ------------------------------------------------------------------------------------------------
# Layout and sizes


def test_proof_is_at_most_258_bytes_per_32_token_chunk_plus_header():
    x = hidden_states(t=32 * 5, h=512)
    proof = commit(x)
    assert len(proof) == HEADER + 5 * 258
    assert HEADER == 16


def test_last_partial_chunk_is_committed_and_checked():
    x = hidden_states(t=70)  # 32 + 32 + 6
    proof = commit(x)
    assert len(proof) == HEADER + 3 * 258  # 6 rows x 64 = 384 entries >= 128
    v = verify(proof, x)
    assert v.ok and len(v.chunks) == 3
    y = x.clone()
    y[64:] *= 0.5
    v = verify(commit(y), x)
    assert v.reason == "exponent_mismatch" and "chunk 2" in v.detail


def test_single_position():
    x = hidden_states(t=1, h=256)
    proof = commit(x)
    assert len(proof) == HEADER + 258
    assert verify(proof, x).ok
    assert verify(commit(-x), x).reason == "sign_mismatch"


def test_topk_larger_than_the_chunk_takes_every_entry():
    x = hidden_states(t=3, h=8, outliers=False)  # 24 entries < 128
    proof = commit(x)
    assert len(proof) == HEADER + 2 + 2 * 24
    assert verify(proof, x).ok
    assert verify(commit(x * 1.05), x).reason == "mantissa_mismatch"
    x = hidden_states(t=40, h=2, outliers=False)  # full chunk 64 entries, last chunk 16
    assert len(commit(x)) == HEADER + (2 + 2 * 64) + (2 + 2 * 16)
    assert verify(commit(x), x).ok


def test_commit_many_equals_commit_one_by_one():
    xs = [hidden_states(t=t, seed=t) for t in (1, 32, 45, 96)]
    assert commit_many(xs) == [commit(x) for x in xs]


def test_commit_is_deterministic():
    x = hidden_states()
    assert commit(x) == commit(x.clone())


def test_indices_beyond_the_field_use_an_injective_modulus():
    # 32 x 4096 = 131072 slots: flat indices exceed P and can collide mod P
    idx = np.array([5, 5 + toploc_proof.P, 77])
    m = toploc_proof._injective_modulus(idx)
    assert m < toploc_proof.P and len(set((idx % m).tolist())) == 3
    x = torch.zeros(32, 4096)
    x[0, 5] = 4.0
    x[15, 5 + toploc_proof.P - 15 * 4096] = -3.0  # flat index 5 + P
    x[31, 100] = 2.0
    proof = commit(x, topk=3)
    assert struct.unpack(">H", proof[HEADER : HEADER + 2])[0] == m
    assert verify(proof, x, topk=3).ok


def test_bad_commit_input_raises_value_error():
    with pytest.raises(ValueError):
        commit(torch.zeros(4))
    with pytest.raises(ValueError):
        commit(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError):
        commit(torch.zeros(4, 4), topk=0)


def test_verify_many_equals_verify_one_by_one():
    xs = [hidden_states(t=t, seed=t) for t in (1, 32, 45, 96)]
    proofs = commit_many(xs)
    proofs[2] = commit(-xs[2])
    proofs[3] = proofs[3][:-3]
    many = verify_many(proofs, xs)
    assert many == [verify(p, x) for p, x in zip(proofs, xs, strict=True)]
    assert [v.reason for v in many] == ["", "", "sign_mismatch", "malformed_proof"]


def test_verify_many_with_unequal_lists_rejects_every_proof():
    x = hidden_states()
    assert [v.reason for v in verify_many([commit(x)] * 2, [x])] == ["shape_mismatch"] * 2


# ------------------------------------------------------------------------------------------------
# Thresholds


def test_thresholds_follow_the_dtype_of_the_trusted_states():
    assert thresholds_for(torch.float32) == toploc_proof.THRESHOLDS_FP32
    assert thresholds_for(torch.bfloat16) == toploc_proof.THRESHOLDS_BF16
    assert thresholds_for(torch.float16) == toploc_proof.THRESHOLDS_FP16
    # float32 verification is the strict one: it is what catches half-precision generation
    fp32, bf16 = toploc_proof.THRESHOLDS_FP32, toploc_proof.THRESHOLDS_BF16
    assert fp32.max_mant_err_mean < bf16.max_mant_err_mean


def test_explicit_thresholds_override_the_defaults():
    x = hidden_states()
    lax = Thresholds(
        max_exp_mismatch_frac=1.0, max_sign_mismatch_frac=1.0, max_mant_err_mean=200, max_mant_err_median=200
    )
    assert verify(commit(x * 0.5), x, thresholds=lax).ok


def test_statistics_are_reported_for_every_chunk_of_a_rejected_proof():
    x = hidden_states()
    v = verify(commit(-x), x)
    assert len(v.chunks) == 3 and all(c.sign_mismatches == 128 for c in v.chunks)
