"""The torch engine: batched KV-cached generation that the coordinator's prefill can replay."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import veriroll.toploc as toploc
from veriroll.node.engines import EngineUnavailable, GenerationRequest, create_engine
from veriroll.node.engines.torch import TorchEngine
from veriroll.toploc import sampling

VOCAB = 48
# Differences between a KV-cached decode and one batched prefill on fp32 CPU are ~1e-6; the bounds
# below are the contract the verifier's tolerances are built on.
HIDDEN_ATOL = 1e-4
LOGPROB_ATOL = 1e-4
HAS_COMMIT = hasattr(toploc, "commit") and hasattr(toploc, "verify")


def tiny_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def save_model(path, seed: int) -> None:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config())
    # Random init gives near-uniform logits; sharpen them so sampling is far from uniform.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_model(root / "v0", seed=0)
    save_model(root / "v1", seed=1)
    return root


@pytest.fixture(scope="module")
def engine(checkpoints):
    return TorchEngine(checkpoints / "v0", version=0)


def requests_mixed() -> list[GenerationRequest]:
    """Requests with different prompt lengths, group sizes and completion budgets."""
    return [
        GenerationRequest(
            [1, 2, 3], seeds=[11, 12, 13], temperature=1.0, max_new_tokens=40, stop_token_ids=[]
        ),
        GenerationRequest(
            list(range(5, 17)), seeds=[2**64 - 1, 7], temperature=0.7, max_new_tokens=33, stop_token_ids=[]
        ),
        GenerationRequest([9], seeds=[5], temperature=1.3, max_new_tokens=20, stop_token_ids=[]),
    ]


def teacher_forced(model, prompts: list[list[int]], completions: list[list[int]]):
    """What the verifier does: one right-padded forward of prompt + completion for several samples.

    Returns per sample the final-norm hidden states ``[T, H]`` and logits ``[T, V]`` at the positions
    ``[P - 1, P + T - 1)`` that produced the completion's tokens.
    """
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        base = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    # hidden_states[-1] is the post-norm state in this transformers version, the same as the base
    # model's last_hidden_state and the LM head's input the engine captures.
    assert torch.equal(out.hidden_states[-1], base)
    result = []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        span = slice(len(p) - 1, len(p) + len(c) - 1)
        result.append((out.hidden_states[-1][i, span], out.logits[i, span]))
    return result


def test_cached_generation_matches_the_verifiers_batched_prefill(engine):
    reqs = requests_mixed()
    results = engine.generate(reqs, keep_hidden=True)
    prompts, completions, samples, meta = [], [], [], []
    for req, group in zip(reqs, results, strict=True):
        assert len(group) == req.n
        for seed, s in zip(req.seeds, group, strict=True):
            prompts.append(req.prompt_ids)
            completions.append(s.token_ids)
            samples.append(s)
            meta.append((seed, req.temperature))
    trusted = teacher_forced(engine.model, prompts, completions)
    max_hidden = max_lp = 0.0
    for s, (seed, temp), (hidden, logits) in zip(samples, meta, trusted, strict=True):
        t = len(s.token_ids)
        assert s.hidden.shape == (t, 64) and len(s.logprobs) == t
        max_hidden = max(max_hidden, float((s.hidden - hidden).abs().max()))
        tokens = torch.tensor(s.token_ids)
        trusted_lp = sampling.token_logprobs(logits, tokens, temp)
        max_lp = max(max_lp, float((torch.tensor(s.logprobs) - trusted_lp).abs().max()))
        verdict = sampling.verify_samples(logits, tokens, temp, seed, torch.arange(t))
        assert verdict.ok, verdict.detail
        assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
        if HAS_COMMIT:
            proof_verdict = toploc.verify(s.proof, hidden)
            assert proof_verdict.ok, proof_verdict.detail
    assert max_hidden < HIDDEN_ATOL
    assert max_lp < LOGPROB_ATOL


def test_same_seed_gives_identical_tokens_alone_or_in_any_batch(engine):
    alone = GenerationRequest([4, 5, 6, 7], seeds=[99], temperature=1.0, max_new_tokens=30, stop_token_ids=[])
    [[solo]] = engine.generate([alone])
    batched = engine.generate(requests_mixed()[:2] + [alone] + requests_mixed()[2:])
    together = batched[2][0]
    assert together.token_ids == solo.token_ids
    assert max(abs(a - b) for a, b in zip(together.logprobs, solo.logprobs, strict=True)) < LOGPROB_ATOL
    again = engine.generate([alone])[0][0]
    assert again.token_ids == solo.token_ids and again.logprobs == solo.logprobs


def test_different_seeds_give_different_samples(engine):
    req = GenerationRequest(
        [3, 1, 4, 1, 5], seeds=list(range(6)), temperature=1.0, max_new_tokens=24, stop_token_ids=[]
    )
    group = engine.generate([req])[0]
    assert len({tuple(s.token_ids) for s in group}) == len(group)


def test_stop_token_ends_a_sample_and_is_kept(engine):
    stop = list(range(VOCAB // 2))  # half the vocabulary: every sample stops early
    req = GenerationRequest(
        [1, 2], seeds=[1, 2, 3, 4], temperature=1.0, max_new_tokens=64, stop_token_ids=stop
    )
    free = GenerationRequest(
        [1, 2], seeds=[1, 2, 3, 4], temperature=1.0, max_new_tokens=17, stop_token_ids=[]
    )
    stopped, unstopped = engine.generate([req, free], keep_hidden=True)
    for s, f in zip(stopped, unstopped, strict=True):
        assert s.finish_reason == "stop"
        assert s.token_ids[-1] in stop and not set(s.token_ids[:-1]) & set(stop)
        assert len(s.logprobs) == len(s.token_ids) == s.hidden.shape[0]
        # Same seed, same prompt: the stopped sample is a prefix of the free-running one.
        n = min(len(s.token_ids), len(f.token_ids))
        assert s.token_ids[:n] == f.token_ids[:n]
        assert f.finish_reason == "length" and len(f.token_ids) == 17


def test_batches_split_under_max_batch_tokens_give_the_same_samples(checkpoints, engine):
    small = TorchEngine(checkpoints / "v0", version=0, max_batch_tokens=100)
    reqs = requests_mixed()
    split = small.generate(reqs)
    assert small.last_stats.batches > 1
    whole = engine.generate(reqs)
    assert engine.last_stats.batches == 1
    for a, b in zip(split, whole, strict=True):
        assert [s.token_ids for s in a] == [s.token_ids for s in b]


def test_per_request_temperature_and_zero_budget(engine):
    reqs = [
        GenerationRequest([1, 2, 3], seeds=[8], temperature=0.5, max_new_tokens=12, stop_token_ids=[]),
        GenerationRequest([1, 2, 3], seeds=[8], temperature=2.0, max_new_tokens=12, stop_token_ids=[]),
        GenerationRequest([1, 2, 3], seeds=[8], temperature=1.0, max_new_tokens=0, stop_token_ids=[]),
    ]
    cold, hot, empty = (g[0] for g in engine.generate(reqs, keep_hidden=True))
    alone = engine.generate([reqs[1]])[0][0]
    assert hot.token_ids == alone.token_ids and cold.token_ids != hot.token_ids
    assert empty.token_ids == [] and empty.finish_reason == "length" and empty.hidden.shape[0] == 0


def test_load_swaps_weights_and_version_and_a_failed_load_keeps_the_old(checkpoints, tmp_path):
    eng = TorchEngine(checkpoints / "v0", version=0)
    req = GenerationRequest([1, 2, 3], seeds=[1, 2], temperature=1.0, max_new_tokens=16, stop_token_ids=[])
    before = eng.generate([req])[0]
    with pytest.raises(OSError):
        eng.load(tmp_path / "missing", 5)
    assert eng.version == 0
    eng.load(checkpoints / "v1", 1)
    assert eng.version == 1
    after = eng.generate([req])[0]
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    eng.close()
    assert eng.version is None
    with pytest.raises(RuntimeError, match="no weights loaded"):
        eng.generate([req])


def test_bfloat16_generation_replays_on_a_bfloat16_prefill(checkpoints):
    eng = create_engine("torch", checkpoint_dir=checkpoints / "v0", version=0, dtype="bfloat16")
    reqs = requests_mixed()
    results = eng.generate(reqs, keep_hidden=True)
    flat = [
        (r, seed, s) for r, g in zip(reqs, results, strict=True) for seed, s in zip(r.seeds, g, strict=True)
    ]
    trusted = teacher_forced(eng.model, [r.prompt_ids for r, _, _ in flat], [s.token_ids for _, _, s in flat])
    for (req, seed, s), (hidden, logits) in zip(flat, trusted, strict=True):
        assert s.hidden.dtype == torch.bfloat16
        assert all(math.isfinite(x) and x <= 0 for x in s.logprobs)
        tokens = torch.tensor(s.token_ids)
        verdict = sampling.verify_samples(logits, tokens, req.temperature, seed, torch.arange(len(tokens)))
        assert verdict.ok, verdict.detail
        # bf16 rounding of different kernel shapes: a few ulps of bf16, not 1e-4.
        assert float((s.hidden.float() - hidden.float()).abs().max()) < 0.1
        if HAS_COMMIT:
            proof_verdict = toploc.verify(s.proof, hidden)
            assert proof_verdict.ok, proof_verdict.detail


@pytest.mark.skipif(not HAS_COMMIT, reason="veriroll.toploc.commit is not available")
def test_every_sample_carries_a_commitment_over_its_hidden_states(engine):
    req = GenerationRequest([1, 2, 3], seeds=[1, 2], temperature=1.0, max_new_tokens=40, stop_token_ids=[])
    for s in engine.generate([req], keep_hidden=True)[0]:
        assert s.proof and s.proof == toploc.commit(s.hidden)


def test_requests_are_validated(engine):
    with pytest.raises(ValueError, match="temperature"):
        GenerationRequest([1], seeds=[1], temperature=0.0, max_new_tokens=4, stop_token_ids=[])
    with pytest.raises(ValueError, match="uint64"):
        GenerationRequest([1], seeds=[2**64], temperature=1.0, max_new_tokens=4, stop_token_ids=[])
    with pytest.raises(ValueError, match="seed"):
        GenerationRequest([1], seeds=[], temperature=1.0, max_new_tokens=4, stop_token_ids=[])
    with pytest.raises(ValueError, match="prompt"):
        GenerationRequest([], seeds=[1], temperature=1.0, max_new_tokens=4, stop_token_ids=[])
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.generate(
            [GenerationRequest([VOCAB], seeds=[1], temperature=1.0, max_new_tokens=4, stop_token_ids=[])]
        )


def test_create_engine_names_what_is_missing():
    with pytest.raises(EngineUnavailable, match="vllm"):
        create_engine("vllm")
    with pytest.raises(ValueError, match="unknown engine"):
        create_engine("tensorflow")


def test_an_engine_that_cannot_make_proofs_refuses_to_start(checkpoints, monkeypatch):
    """Fail closed: without ``veriroll.toploc.commit_many`` there is no engine (no empty-proof fallback)."""
    monkeypatch.delattr(toploc, "commit_many")  # `from veriroll.toploc import commit_many` raises ImportError
    with pytest.raises(ImportError):
        TorchEngine(checkpoints / "v0", version=0)


def test_generate_never_returns_samples_without_proofs(engine, monkeypatch):
    monkeypatch.setattr(engine, "_commit_many", lambda hiddens: [b""] * len(hiddens))
    with pytest.raises(RuntimeError, match="no proof"):
        engine.generate(requests_mixed())
