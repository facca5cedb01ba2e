"""Sequence packing in the trainer: several samples in one row, position ids restarting per sample,
attention confined to each sample, and per-sample log-probs, loss and gradients the same as the padded
path's; ``trainer.packing = false`` is the padded path; an attention that cannot confine is refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from veriroll.coordinator.config import CoordinatorConfig, TrainerConfig
from veriroll.coordinator.trainer import (
    GroupRecord,
    SampleRecord,
    build_batch,
    completion_logprobs,
    micro_batches,
    pack_rows,
    train_step,
)
from veriroll.coordinator.trainer.step import accumulate
from veriroll.protos.config import ConfigError, load_config

# An attention function transformers accepts (registered under a new name) but whose mask it does not build:
# it attends over the whole row, as a custom kernel would. It stands for any implementation packing refuses.
LEAKY = "veriroll_test_unconfined"


def tiny_llama(attn: str = "sdpa", seed: int = 0):
    """A random 2-layer Llama in float32, small enough for a test, big enough to mix positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, attn_implementation=attn)
    return LlamaForCausalLM(cfg).float().eval()


def ragged_batch(seed: int = 0):
    """Three groups of three with very different lengths (prompts 3-40, completions 1-90 tokens)."""
    rng = np.random.default_rng(seed)
    groups = []
    for g, (p, lengths) in enumerate([(3, (1, 90, 7)), (40, (25, 2, 60)), (12, (5, 33, 1))]):
        prompt = rng.integers(3, 96, size=p).astype(np.int32)
        samples = [SampleRecord(rng.integers(3, 96, size=n).astype(np.int32),
                                (-rng.uniform(2.0, 6.0, size=n)).astype(np.float32), None, float(i % 2))
                   for i, n in enumerate(lengths)]
        groups.append(GroupRecord(g, "arithmetic", 0, 0.8 + 0.1 * g, 0, prompt, samples))
    batch, keep = build_batch(groups, [0, 1, 0], pad_id=0)
    assert bool(keep.all())
    return batch


def real_lengths(batch) -> list[int]:
    return batch.attention_mask.sum(1).tolist()


def test_positions_restart_at_every_sample_and_the_index_reads_each_samples_own_logits():
    batch = ragged_batch()
    row = pack_rows(batch)
    lengths = real_lengths(batch)
    assert row.input_ids.shape == row.position_ids.shape == (1, sum(lengths))
    assert row.position_ids[0].tolist() == [i for n in lengths for i in range(n)]
    start = 0
    for b, n in enumerate(lengths):
        assert row.input_ids[0, start:start + n].tolist() == batch.input_ids[b, :n].tolist()
        t = int(batch.response_mask[b].sum())
        # The logits at index[b, t] predict the next token of the row: sample b's completion token t.
        assert row.input_ids[0, row.index[b, :t] + 1].tolist() == batch.completion_ids[b, :t].tolist()
        assert bool((row.index[b, :t] < start + n).all() and (row.index[b, :t] >= start).all())
        start += n


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_the_padded_ones_per_sample(attn):
    torch.set_num_threads(1)
    model, batch = tiny_llama(attn), ragged_batch()
    with torch.no_grad():
        padded, padded_entropy = completion_logprobs(model, batch)
        packed, packed_entropy = completion_logprobs(model, batch, packed=True)
    m = batch.response_mask
    assert packed.shape == padded.shape
    torch.testing.assert_close(packed[m], padded[m], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_entropy[m], padded_entropy[m], rtol=0, atol=1e-5)


def test_a_packed_sample_never_attends_to_another():
    """Changing one sample's tokens leaves every other sample of the row exactly where it was (and the
    same row under an attention that does not confine moves them: the check can fail)."""
    torch.set_num_threads(1)
    batch = ragged_batch()
    changed = ragged_batch()
    n = int(changed.attention_mask[4].sum())
    changed.input_ids[4, :n] = (changed.input_ids[4, :n] + 7) % 96  # sample 4 sits mid-row
    others = torch.arange(batch.size) != 4
    m = batch.response_mask[others]
    with torch.no_grad():
        model = tiny_llama("sdpa")
        before, _ = completion_logprobs(model, batch, packed=True)
        after, _ = completion_logprobs(model, changed, packed=True)
        assert not torch.allclose(before[4], after[4])
        torch.testing.assert_close(after[others][m], before[others][m], rtol=0, atol=1e-6)

        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        AttentionInterface.register(LEAKY, sdpa_attention_forward)
        leaky = tiny_llama("sdpa")
        leaky.config._attn_implementation = LEAKY
        row_before, row_after = pack_rows(batch), pack_rows(changed)
        a = leaky(input_ids=row_before.input_ids, position_ids=row_before.position_ids, use_cache=False).logits
        b = leaky(input_ids=row_after.input_ids, position_ids=row_after.position_ids, use_cache=False).logits
        last = int(batch.attention_mask[:5].sum())  # the first token after sample 4
        assert (a[0, last:] - b[0, last:]).abs().max() > 1e-3
        with pytest.raises(ValueError, match="confines attention"):
            completion_logprobs(leaky, batch, packed=True)


def test_packed_step_gives_the_padded_loss_and_gradients():
    torch.set_num_threads(1)
    batch = ragged_batch()
    batch.logp_trusted = batch.logp_behavior + 0.05
    batch.has_trusted[:] = True
    results = {}
    for packing in (False, True):
        model = tiny_llama("sdpa")
        cfg = TrainerConfig(packing=packing, micro_batch_tokens=160, autocast="off", correction="decoupled")
        model.train()
        sums = accumulate(model, micro_batches(batch, cfg.micro_batch_tokens, packing=packing), cfg, 4, None)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[packing] = (sums, grads)
    (padded, g_padded), (packed, g_packed) = results[False], results[True]
    assert packed["micro_batches"] < padded["micro_batches"]
    assert packed["tokens_used"] == padded["tokens_used"]
    assert abs(packed["loss"] / packed["tokens_used"] - padded["loss"] / padded["tokens_used"]) <= 1e-6
    for name, g in g_padded.items():
        torch.testing.assert_close(g_packed[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_micro_batches_fill_the_token_budget_and_a_longer_sample_goes_alone():
    batch = ragged_batch()
    lengths = real_lengths(batch)
    budget = 64
    parts = micro_batches(batch, budget, packing=True)
    seen = sorted(x for p in parts for x in real_lengths(p))
    assert seen == sorted(lengths)  # every sample exactly once
    for p in parts:
        total = sum(real_lengths(p))
        assert total <= budget or p.size == 1
    assert any(p.size == 1 and real_lengths(p)[0] > budget for p in parts)
    assert len(parts) < len(micro_batches(batch, budget, packing=False))


def test_packing_false_is_the_padded_path():
    """With packing off the model sees today's padded rows with their attention mask, and no position ids;
    on, one row per micro-batch with position ids and no mask."""
    torch.set_num_threads(1)
    batch = ragged_batch()
    for packing in (False, True):
        model = tiny_llama("sdpa")
        calls = []
        model.register_forward_pre_hook(lambda _m, _a, kw, calls=calls: calls.append(kw), with_kwargs=True)
        cfg = TrainerConfig(packing=packing, micro_batch_tokens=10_000, autocast="off")
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, cfg, s_max=4)
        assert len(calls) == 1
        if packing:
            assert calls[0]["input_ids"].shape == (1, sum(real_lengths(batch)))
            assert calls[0].get("attention_mask") is None and calls[0]["position_ids"] is not None
        else:
            assert calls[0]["input_ids"].shape == batch.input_ids.shape  # rows sorted by length, as today
            assert sorted(calls[0]["attention_mask"].sum(1).tolist()) == sorted(real_lengths(batch))
            assert calls[0].get("position_ids") is None


def test_config_refuses_packing_on_an_attention_that_cannot_confine_it():
    assert TrainerConfig().packing is True
    with pytest.raises(ConfigError, match="trainer.packing = true needs an attention implementation"):
        load_config(CoordinatorConfig, overrides={"trainer.attn_implementation": LEAKY})
    cfg = load_config(CoordinatorConfig, overrides={"trainer.attn_implementation": LEAKY, "trainer.packing": "false"})
    assert cfg.trainer.attn_implementation == LEAKY and not cfg.trainer.packing


def test_coordinator_init_refuses_it_before_writing_anything(tmp_path, capsys):
    from veriroll.cli.main import main

    target = tmp_path / "coord"
    rc = main(["coordinator", "init", "--dir", str(target), "--set", f"trainer.attn_implementation={LEAKY}"])
    assert rc == 2 and not target.exists()
    assert "trainer.packing = false" in capsys.readouterr().err


def test_loading_a_model_whose_attention_cannot_confine_is_refused_with_packing(tmp_path):
    """The load checks the implementation the model actually got: a real save and load of a tiny Llama."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from veriroll.coordinator.trainer import load_training_model

    AttentionInterface.register(LEAKY, sdpa_attention_forward)
    tiny_llama().save_pretrained(tmp_path / "v0")
    assert load_training_model(tmp_path / "v0", packing=True).config._attn_implementation == "sdpa"
    assert load_training_model(tmp_path / "v0", attn_implementation="eager", packing=True).config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="trainer.packing = false"):
        load_training_model(tmp_path / "v0", attn_implementation=LEAKY, packing=True)
    assert load_training_model(tmp_path / "v0", attn_implementation=LEAKY).config._attn_implementation == LEAKY


def test_smollm2_packed_logprobs_and_loss_equal_the_padded_ones(smollm2_dir):
    """SmolLM2-135M in float32 on real text of very different lengths: the packed forward gives each
    sample the padded forward's log-probs and the step the padded loss."""
    from transformers import AutoTokenizer

    from veriroll.coordinator.trainer import load_training_model

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = load_training_model(smollm2_dir, packing=True)
    text = tok(TEXT)["input_ids"]
    groups, start = [], 0
    for g, (p, lengths) in enumerate([(6, (90, 3, 20)), (30, (1, 45, 12))]):
        prompt = np.array(text[start:start + p], dtype=np.int32)
        samples = []
        for i, n in enumerate(lengths):
            ids = np.array(text[start + p:start + p + n], dtype=np.int32)
            samples.append(SampleRecord(ids, np.full(n, -1.0, dtype=np.float32), None, float(i % 2)))
            start += 7
        groups.append(GroupRecord(g, "math", 0, 1.0, 0, prompt, samples))
    batch, _ = build_batch(groups, [0, 0], pad_id=tok.pad_token_id)
    m = batch.response_mask
    with torch.no_grad():
        padded, _ = completion_logprobs(model, batch)
        packed, _ = completion_logprobs(model, batch, packed=True)
        batch.logp_behavior = torch.where(m, padded, torch.zeros(()))  # on-policy: ratios near 1
    assert (packed[m] - padded[m]).abs().max() <= 1e-5
    losses = {}
    for packing in (False, True):
        cfg = TrainerConfig(packing=packing, micro_batch_tokens=4096, autocast="off")
        sums = accumulate(model, micro_batches(batch, cfg.micro_batch_tokens, packing=packing), cfg, 2, None)
        losses[packing] = sums["loss"] / sums["tokens_used"]
    assert abs(losses[True] - losses[False]) <= 1e-6


TEXT = (
    "The trainer takes whatever fresh groups are waiting, computes group-relative advantages, and runs the "
    "off-policy loss. Every few steps it writes a checkpoint and publishes it to the nodes, which fetch the new "
    "weights from relays and keep generating. A volunteer's machine may be slow, or gone tomorrow, so nothing "
    "waits for any one of them: the coordinator hands out leases, checks what comes back, and trains on what "
    "passes. Sequence packing puts several samples into one row, so a short answer no longer pays for the "
    "padding of the longest one in its micro-batch. Position ids restart at every sample and attention stays "
    "inside each sample, which is why the log-probabilities are the same as in the padded path."
)
