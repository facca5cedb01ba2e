"""The trainer-memory plan: its terms on a shape small enough to check by hand, and its command line."""

from __future__ import annotations

import json

import pytest

from veriroll.cli.main import main
from veriroll.coordinator.plan import (
    ModelShape,
    PlanError,
    TrainerSettings,
    model_shape_from_config,
    model_shape_from_params,
    peak_bytes,
    trainer_memory,
    trainer_memory_terms,
)

# hidden 64, 2 layers, 4 heads (no GQA), MLP 128, vocabulary 100, untied embeddings.
TINY = ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128, vocab_size=100)
PLAN_ARGS = ["plan", "--nodes", "10", "--tokens-per-sample", "64", "--group-size", "8"]


def test_tiny_shape_counts_its_parameters_by_hand():
    # Block: q,o 64*64 each + k,v 64*64 each + 3 * 64*128 (SwiGLU) + 2 norms of 64.
    assert TINY.block_params == 4 * 64 * 64 + 3 * 64 * 128 + 2 * 64 == 41088
    # Two blocks, embeddings and lm_head of 100 x 64, the final norm.
    assert TINY.params == 2 * 41088 + 2 * 100 * 64 + 64 == 95040


def test_memory_terms_of_a_known_config_in_float32():
    terms = trainer_memory_terms(TINY, TrainerSettings(micro_batch_tokens=10, autocast_bf16=False))
    # Per token per layer, a = 4: norms 2*(4+4)*64 = 1024, attention 4*(3*64 + 2*64) = 1280, MLP 4*4*128 = 2048.
    assert terms["activations"] == 2 * 10 * (1024 + 1280 + 2048) == 87040
    assert terms["logits"] == 10 * 100 * (4 + 12) == 16000
    assert terms["weights"] == terms["gradients"] == terms["optimizer_step"] == 4 * 95040
    assert terms["adam"] == 8 * 95040
    assert terms["lm_head_grad"] == 4 * 100 * 64
    assert terms["autocast_weights"] == terms["fsdp_gathered"] == 0
    # The optimizer step's temporary (4P) outweighs 10 tokens' activations here.
    assert peak_bytes(terms) == 16 * 95040 + 4 * 95040


def test_bf16_autocast_halves_activations_and_keeps_weight_casts():
    terms = trainer_memory_terms(TINY, TrainerSettings(micro_batch_tokens=10, autocast_bf16=True))
    assert terms["activations"] == 2 * 10 * (2 * 6 * 64 + 2 * 5 * 64 + 4 * 2 * 128)
    assert terms["logits"] == 10 * 100 * (2 + 12)
    assert terms["autocast_weights"] == 2 * 95040


def test_checkpointing_keeps_block_inputs_and_one_block():
    off = trainer_memory_terms(TINY, TrainerSettings(micro_batch_tokens=1000, autocast_bf16=False))
    on = trainer_memory_terms(TINY, TrainerSettings(micro_batch_tokens=1000, autocast_bf16=False,
                                                    gradient_checkpointing=True))
    assert on["activations"] == 2 * 1000 * 4 * 64 + 1000 * 4352
    assert on["activations"] < off["activations"]
    assert on["logits"] == off["logits"]  # the loss's vocabulary-wide tensors are not checkpointed
    assert peak_bytes(on) < peak_bytes(off)


def test_fsdp_divides_the_sharded_terms_and_not_the_activations():
    one = trainer_memory_terms(TINY, TrainerSettings(micro_batch_tokens=100, fsdp_world_size=1))
    four = trainer_memory_terms(TINY, TrainerSettings(micro_batch_tokens=100, fsdp_world_size=4))
    for name in ("weights", "gradients", "adam", "autocast_weights", "optimizer_step"):
        assert four[name] == pytest.approx(one[name] / 4)
    assert four["activations"] == one["activations"] and four["logits"] == one["logits"]
    assert four["fsdp_gathered"] == 2 * 4 * TINY.block_params


def test_gpus_needed_is_the_smallest_fsdp_world_that_fits():
    shape = model_shape_from_params(7e9)
    m = trainer_memory(shape, TrainerSettings(gpu_memory_gb=80))
    usable = 80e9 * 0.9
    n = m["gpus_needed"]
    assert n > 1
    assert peak_bytes(trainer_memory_terms(shape, TrainerSettings(), n)) <= usable
    assert peak_bytes(trainer_memory_terms(shape, TrainerSettings(), n - 1)) > usable


def test_activations_that_fit_no_gpu_need_no_fsdp_world():
    m = trainer_memory(model_shape_from_params(7e9), TrainerSettings(micro_batch_tokens=10**6, gpu_memory_gb=24))
    assert m["gpus_needed"] is None


def test_default_shape_comes_close_to_the_asked_parameters():
    for params in (1.35e8, 1e9, 7e9, 7e10):
        assert model_shape_from_params(params).params == pytest.approx(params, rel=0.35)


def test_shape_read_from_a_model_config(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=100, tie_word_embeddings=True).save_pretrained(tmp_path)
    shape = model_shape_from_config(tmp_path)
    assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads) == (64, 2, 4, 2)
    assert (shape.intermediate_size, shape.vocab_size, shape.tie_embeddings, shape.kv_size) == (128, 100, True, 32)


def test_unknown_model_path_is_refused(tmp_path):
    with pytest.raises(PlanError, match="no such model directory"):
        model_shape_from_config(tmp_path / "missing")
    with pytest.raises(PlanError, match="cannot read a model config"):
        model_shape_from_config(tmp_path)  # a directory without config.json


@pytest.mark.parametrize("tokens", [0, -5])
def test_micro_batch_tokens_must_be_positive(tokens):
    with pytest.raises(PlanError, match="--micro-batch-tokens must be"):
        trainer_memory(TINY, TrainerSettings(micro_batch_tokens=tokens))


def test_cli_json_carries_the_trainer_memory(tmp_path, capsys):
    assert main([*PLAN_ARGS, "--model-params", "1e9", "--fsdp", "2", "--gradient-checkpointing", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    m = out["trainer_memory"]
    for key in ("params", "shape", "micro_batch_tokens", "gradient_checkpointing", "activation_dtype",
                "fsdp_world_size", "terms_mb", "per_gpu_mb", "gpu_memory_gb", "gpus_needed"):
        assert key in m
    assert set(m["terms_mb"]) == {"weights", "gradients", "adam", "autocast_weights", "fsdp_gathered", "activations",
                                  "logits", "lm_head_grad", "optimizer_step"}
    assert m["fsdp_world_size"] == 2 and m["gradient_checkpointing"] is True


def test_cli_reads_the_shape_and_parameters_from_model(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                vocab_size=100, tie_word_embeddings=False).save_pretrained(tmp_path)
    assert main([*PLAN_ARGS, "--model", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "trainer memory:" in text and "0M params from config of" in text


@pytest.mark.parametrize("flags, message", [
    (["--model-params", "1e9", "--micro-batch-tokens", "-1"], "--micro-batch-tokens must be"),
    (["--model", "/no/such/model"], "no such model directory"),
    ([], "give --model PATH"),
])
def test_cli_refuses_bad_trainer_inputs(flags, message, capsys):
    with pytest.raises(SystemExit):
        main([*PLAN_ARGS, *flags])
    assert message in capsys.readouterr().err
