"""The seeded sampler: the tensor hash equals a pure-Python reference bit for bit, and replays verify."""

from __future__ import annotations

import math

import torch

from veriroll.toploc import sampling

M32 = 0xFFFFFFFF


def _fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def reference_hash(seed: int, t: int, v: int) -> int:
    """The same counter-based hash with Python's unbounded integers (no tensors, no overflow tricks)."""
    lo, hi = seed & M32, (seed >> 32) & M32
    key = _fmix32(lo ^ _fmix32(hi ^ 0x9E3779B9))
    row = _fmix32(key ^ _fmix32(((t * 0x85EBCA77) + 0x165667B1) & M32))
    return _fmix32(row ^ (((v * 0xC2B2AE3D) + 0x27D4EB2F) & M32))


def test_tensor_hash_matches_pure_python_reference():
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 0xDEADBEEFCAFEBABE]
    positions = [0, 1, 31, 4095, 2**31 - 1, 7]
    bits = sampling.hash_bits(seeds, positions, 50)
    for r, (s, t) in enumerate(zip(seeds, positions, strict=True)):
        assert [reference_hash(s, t, v) for v in range(50)] == bits[r].tolist()


def test_gumbel_noise_matches_reference_transform_and_looks_gumbel():
    noise = sampling.gumbel_noise(123, torch.arange(64), 256)
    h = reference_hash(123, 5, 17)
    u = ((h >> 8) + 0.5) / (1 << 24)
    assert abs(float(noise[5, 17]) - (-math.log(-math.log(u)))) < 1e-6
    # Gumbel(0, 1): mean ~ 0.5772, variance ~ pi^2 / 6.
    assert abs(float(noise.mean()) - 0.5772) < 0.05
    assert abs(float(noise.var()) - math.pi**2 / 6) < 0.1


def test_sampling_follows_the_softmax_distribution():
    logits = torch.tensor([[0.0, math.log(3.0)]]).expand(4000, 2)
    tokens = sampling.sample(logits, 1.0, list(range(4000)), torch.zeros(4000, dtype=torch.long))
    assert abs(float(tokens.float().mean()) - 0.75) < 0.03


def test_replay_accepts_honest_and_rejects_other_tokens():
    torch.manual_seed(0)
    logits = torch.randn(32, 40) * 3
    seeds, pos = [7] * 32, torch.arange(32)
    tokens = sampling.sample(logits, 0.8, seeds, pos)
    assert sampling.verify_samples(logits, tokens, 0.8, seeds, pos).ok
    forged = tokens.clone()
    forged[3] = (forged[3] + 1) % 40
    verdict = sampling.verify_samples(logits, forged, 0.8, seeds, pos)
    assert not verdict.ok and verdict.reason == "sampling_mismatch" and 3 in verdict.mismatched_positions
    other_temperature = sampling.sample(logits, 2.0, seeds, pos)
    if not torch.equal(other_temperature, tokens):
        assert not sampling.verify_samples(logits, other_temperature, 0.8, seeds, pos).ok


def test_replay_tolerates_numerical_noise_on_near_ties_only():
    logits = torch.zeros(1, 2)
    noise = sampling.gumbel_noise([5], [0], 2)
    # Make the two candidates tie exactly on the perturbed scale, then nudge by 1e-5 in the node's favour.
    logits[0, 1] = float(noise[0, 0] - noise[0, 1])
    claimed = torch.tensor([1])
    logits_node = logits.clone()
    logits_node[0, 1] += 1e-5
    assert int(sampling.sample(logits_node, 1.0, [5], [0])) == 1
    trusted = logits.clone()
    trusted[0, 1] -= 1e-5
    assert sampling.verify_samples(trusted, claimed, 1.0, [5], [0]).ok


def test_malformed_inputs_give_a_verdict_not_an_exception():
    logits = torch.randn(4, 10)
    assert sampling.verify_samples(logits, [1, 2], 1.0, 0, [0, 1]).reason == "shape_mismatch"
    assert sampling.verify_samples(logits, [1, 2, 3, 99], 1.0, 0, [0, 1, 2, 3]).reason == "token_out_of_range"


# --- the sparse draw: same tokens as hashing the whole vocabulary, bit for bit ----------------------


def _dense_winner_and_margin(logits, tokens, temperature, seeds, positions):
    z = sampling.perturbed_logits(logits, temperature, seeds, positions)
    replay = z.argmax(dim=-1)
    margin = (z.gather(-1, replay[:, None]) - z.gather(-1, tokens[:, None])).squeeze(-1) * temperature
    return replay, margin


def test_gumbel_max_bounds_every_noise_value():
    noise = sampling.gumbel_noise(list(range(64)), torch.arange(64), 4096)
    assert float(noise.max()) <= sampling.GUMBEL_MAX
    assert 17.0 < sampling.GUMBEL_MAX < 17.5  # -log(-log(1 - 2**-25))


def test_sparse_draw_equals_dense_draw_on_many_shapes_of_logits():
    gen = torch.Generator().manual_seed(0)
    cases = {
        "peaked": torch.randn(64, 5000, generator=gen) * 4,
        "flat": torch.randn(64, 5000, generator=gen) * 0.01,  # every token is a candidate
        "uniform": torch.zeros(16, 3000),  # all tokens tie before noise
        "one_hot": torch.full((16, 3000), -30.0).index_fill_(1, torch.tensor([7]), 30.0),
        "masked": torch.randn(16, 3000, generator=gen).masked_fill(torch.rand(16, 3000, generator=gen) < 0.9, -math.inf),
        "bf16": (torch.randn(32, 4000, generator=gen) * 8).bfloat16(),
    }
    for name, logits in cases.items():
        for temperature in (0.3, 1.0, 1.7):
            seeds = torch.randint(0, 2**62, (logits.shape[0],), generator=gen)
            positions = torch.randint(0, 4096, (logits.shape[0],), generator=gen)
            dense = sampling.sample_dense(logits, temperature, seeds, positions)
            sparse = sampling.sample_sparse(logits, temperature, seeds, positions)
            assert torch.equal(dense, sparse), (name, temperature)


def test_sparse_draw_hashes_a_small_part_of_a_peaked_vocabulary():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 50_000, generator=gen) * 8  # LM-like spread: the top sits ~34 above the median
    keys = sampling._row_keys(list(range(32)), torch.zeros(32, dtype=torch.long))
    won = sampling.race(logits, 1.0, keys)
    assert torch.equal(won.winner, sampling.sample_dense(logits, 1.0, list(range(32)), torch.zeros(32, dtype=torch.long)))
    assert won.hashed < 0.1 * logits.numel()


def test_sparse_draw_is_exact_under_a_tiny_chunk_budget():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 2000, generator=gen)
    keys = sampling._row_keys(list(range(40)), torch.arange(40))
    chunked = sampling.race(logits, 1.0, keys, chunk_pairs=100)
    assert torch.equal(chunked.winner, sampling.race(logits, 1.0, keys).winner)
    assert torch.equal(chunked.winner, sampling.perturbed_logits(logits, 1.0, list(range(40)), torch.arange(40)).argmax(-1))


def test_replay_margins_equal_the_dense_computation():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 3000, generator=gen) * 3
    seeds, pos = torch.randint(0, 2**62, (50,), generator=gen), torch.arange(50)
    honest = sampling.sample_dense(logits, 0.9, seeds, pos)
    forged = honest.clone()
    forged[::3] = torch.randint(0, 3000, (17,), generator=gen)  # some far-off tokens, some near ties
    for tokens in (honest, forged):
        _, margin = _dense_winner_and_margin(logits, tokens, 0.9, seeds, pos)
        verdict = sampling.verify_samples(logits, tokens, 0.9, seeds, pos, margin_tolerance=1e-3)
        assert abs(verdict.max_margin - float(margin.max())) <= 1e-4 * max(1.0, float(margin.max()))
        bad = tuple(int(i) for i in torch.nonzero(margin > 1e-3).flatten())
        assert verdict.mismatched_positions == bad if bad else verdict.ok


def test_the_wrapping_multiply_equals_the_overflow_free_one_and_the_reference():
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 2**32, (20_000,), generator=gen, dtype=torch.int64)
    x[:4] = torch.tensor([0, 1, 2**32 - 1, 2**31])
    for c in (0x85EBCA6B, 0xC2B2AE35, 0xC2B2AE3D, 0xFFFFFFFF):
        assert torch.equal(sampling._mul32_wrapping(x, c), sampling._mul32(x, c))
    assert torch.equal(sampling._fmix32_fast(x), sampling._fmix32(x))
    keys = sampling._row_keys([0, 2**64 - 1, 123], torch.tensor([0, 7, 4095]))
    tokens = torch.tensor([0, 49151, 17])
    for r, (s, t) in enumerate(zip([0, 2**64 - 1, 123], [0, 7, 4095], strict=True)):
        h = reference_hash(s, t, int(tokens[r]))
        u = ((h >> 8) + 0.5) / (1 << 24)
        assert abs(float(sampling.noise_at(keys[r:r + 1], tokens[r:r + 1])[0]) - (-math.log(-math.log(u)))) < 1e-5
