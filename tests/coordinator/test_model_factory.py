"""Character tokenizer, tiny model, warm start, atomic checkpoints and the version-0 presets."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from veriroll.coordinator.environments import load_environment
from veriroll.coordinator.model_factory import (
    PRESETS,
    build_char_tokenizer,
    build_tiny_model,
    create_preset_checkpoint,
    sample_completion_ids,
    sample_completions,
    save_checkpoint,
    warm_start,
)

ALPHABET = "0123456789+="


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


def test_char_tokenizer_maps_one_character_to_one_token(tokenizer):
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id] == [0, 1, 2, 3]
    assert len(tokenizer) == 4 + len(ALPHABET)
    ids = tokenizer("23+58=").input_ids
    assert ids == [1, 4 + 2, 4 + 3, 4 + 10, 4 + 5, 4 + 8, 4 + 11]  # <bos> then one id per character
    assert tokenizer("81", add_special_tokens=False).input_ids == [12, 5]
    assert tokenizer.decode(ids + [2], skip_special_tokens=True) == "23+58="
    assert tokenizer("2x", add_special_tokens=False).input_ids == [6, 3]  # unknown character → <unk>


def test_char_tokenizer_reloads_offline_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["23+58=", "9+0=9", ""]:
        assert reloaded(text).input_ids == tokenizer(text).input_ids
    assert reloaded.eos_token_id == 2 and reloaded.pad_token_id == 0 and reloaded.bos_token_id == 1


def test_tiny_model_defaults_and_seeded_init(tokenizer):
    model = build_tiny_model(tokenizer)
    n = sum(p.numel() for p in model.parameters())
    assert 400_000 < n < 600_000
    assert model.config.vocab_size == len(tokenizer) and model.config.num_hidden_layers == 2
    assert model.config.eos_token_id == tokenizer.eos_token_id
    same = build_tiny_model(tokenizer)
    other = build_tiny_model(tokenizer, seed=1)
    x = torch.tensor([tokenizer("1+2=").input_ids])
    assert torch.equal(model(x).logits, same(x).logits)
    assert not torch.equal(model(x).logits, other(x).logits)
    small = build_tiny_model(tokenizer, layers=1, hidden=32, heads=2, intermediate=64)
    assert small.config.intermediate_size == 64 and small.config.num_attention_heads == 2


def test_warm_start_lowers_the_loss_and_leaves_global_rng_alone(tokenizer):
    env = load_environment("arithmetic")
    model = build_tiny_model(tokenizer, layers=1, hidden=32, heads=2)
    torch.manual_seed(123)
    before = torch.rand(1).item()
    torch.manual_seed(123)
    summary = warm_start(model, tokenizer, env, steps=30, batch_size=16, lr=3e-3)
    assert torch.rand(1).item() == before
    assert summary["steps"] == 30 and summary["final_loss"] < summary["initial_loss"]
    assert not model.training


def test_sampled_completions_stop_at_eos_or_the_budget(tokenizer):
    model = build_tiny_model(tokenizer, layers=1, hidden=32, heads=2)
    prompts = ["1+2=", "12+34=", "5+5="]  # different lengths: left padding must not matter
    rows = sample_completion_ids(model, tokenizer, prompts, max_new_tokens=5, generator=torch.Generator().manual_seed(0))
    for row in rows:
        assert 1 <= len(row) <= 5
        assert tokenizer.eos_token_id not in row[:-1]
        assert len(row) == 5 or row[-1] == tokenizer.eos_token_id
    again = sample_completion_ids(model, tokenizer, prompts, max_new_tokens=5, generator=torch.Generator().manual_seed(0))
    assert rows == again
    # Greedy decoding of a prompt alone equals its greedy decoding inside a padded batch.
    batch = sample_completions(model, tokenizer, prompts, max_new_tokens=5, temperature=0)
    alone = [sample_completions(model, tokenizer, [p], max_new_tokens=5, temperature=0)[0] for p in prompts]
    assert batch == alone


def test_save_checkpoint_is_atomic_hf_format(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, layers=1, hidden=32, heads=2)
    out = save_checkpoint(model, tokenizer, tmp_path / "v0")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    assert [p.name for p in tmp_path.iterdir()] == ["v0"]  # no temporary directory left behind
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    x = torch.tensor([tokenizer("3+4=").input_ids])
    assert torch.allclose(reloaded(x).logits, model(x).logits)
    assert AutoTokenizer.from_pretrained(out)("3+4=").input_ids == x[0].tolist()
    with pytest.raises(FileExistsError):
        save_checkpoint(model, tokenizer, out)


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="tiny-arith"):
        create_preset_checkpoint("huge-arith", tmp_path / "v0")


def test_tiny_arith_version_zero_has_small_but_nonzero_reward(tmp_path):
    """The point of the warm start: RL must see rewards, and have something left to learn."""
    info = create_preset_checkpoint("tiny-arith", tmp_path / "v0", seed=0)
    assert info["warm_start"]["seconds"] < 30
    assert info["parameters"] == sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tmp_path / "v0").parameters())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "v0")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "v0")
    recipe = PRESETS["tiny-arith"]
    env = load_environment(recipe.env, **recipe.env_kwargs)
    prompts = env.sample_prompts(random.Random(99), 256)
    completions = sample_completions(
        model, tokenizer, [p.text for p in prompts], max_new_tokens=env.max_new_tokens,
        generator=torch.Generator().manual_seed(0),
    )
    reward = sum(env.reward(p, c) for p, c in zip(prompts, completions, strict=True)) / len(prompts)
    assert 0.1 <= reward <= 0.7
