"""`coordinator init --model`: a real model as version 0, unchanged; every bad input refused with a clear
message and nothing written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support import build_tiny_checkpoint

from veriroll.cli.main import main
from veriroll.coordinator.models import (
    ModelLoadError,
    resolve_dtype_for_device,
    resolve_model,
    tokenizer_facts,
)
from veriroll.coordinator.policy import PolicyStore


def _init(tmp_path, *extra):
    return main(["coordinator", "init", "--dir", str(tmp_path / "coord"), "--json", *extra])


def test_a_real_model_becomes_version_0_unchanged_with_its_own_tokenizer_and_stop_tokens(tmp_path, smollm2_dir, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert _init(tmp_path, "--model", str(smollm2_dir), "--env", "arithmetic") == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["architecture"] == "LlamaForCausalLM" and summary["vocab_size"] == 49152
    assert summary["chat_template"] is True and summary["stop_token_ids"] == [2]  # <|im_end|>
    v0 = tmp_path / "coord" / "checkpoints" / "versions" / "v000000"
    assert (v0 / "chat_template.jinja").read_text() == (smollm2_dir / "chat_template.jinja").read_text()
    assert (v0 / "generation_config.json").exists() and (v0 / "tokenizer.json").exists()
    theirs = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(v0, dtype=torch.float32)
    for (name, a), (_, b) in zip(theirs.state_dict().items(), ours.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # no warm start: the operator's weights, bit for bit
    assert AutoTokenizer.from_pretrained(v0)("2+2").input_ids == AutoTokenizer.from_pretrained(smollm2_dir)("2+2").input_ids
    store = PolicyStore(tmp_path / "coord" / "checkpoints")
    assert store.stop_token_ids == [2] and store.vocab_size == 49152
    cfg = (tmp_path / "coord" / "coordinator.toml").read_text()
    assert 'model_source = "' + str(smollm2_dir) + '"' in cfg and "group_size = 8" in cfg


def test_bfloat16_version_0_is_stored_in_bfloat16(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VERIROLL_ASSUME_CPU_BF16", "1")
    src = build_tiny_checkpoint(tmp_path / "tiny")
    assert _init(tmp_path, "--model", str(src), "--env", "arithmetic", "--dtype", "bfloat16") == 0
    config = json.loads((tmp_path / "coord" / "checkpoints" / "versions" / "v000000" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert 'model_dtype = "bfloat16"' in (tmp_path / "coord" / "coordinator.toml").read_text()


def test_pinned_bfloat16_is_refused_where_unsupported_and_an_unpinned_one_falls_back(tmp_path, capsys, monkeypatch, caplog):
    monkeypatch.setenv("VERIROLL_ASSUME_CPU_BF16", "0")
    src = build_tiny_checkpoint(tmp_path / "tiny")
    assert _init(tmp_path, "--model", str(src), "--env", "arithmetic", "--dtype", "bfloat16") == 2
    assert "bfloat16 is not supported" in capsys.readouterr().err and not (tmp_path / "coord").exists()
    with pytest.raises(ModelLoadError, match="not supported"):
        resolve_dtype_for_device("bfloat16", pinned=True)
    assert resolve_dtype_for_device("bfloat16", pinned=False) == torch.float32
    assert "falling back to float32" in caplog.text
    assert _init(tmp_path, "--model", str(src), "--env", "arithmetic", "--set", "model_dtype=bfloat16") == 0
    assert 'model_dtype = "float32"' in (tmp_path / "coord" / "coordinator.toml").read_text()


@pytest.mark.parametrize("case", ["missing", "no_tokenizer", "not_causal", "unknown_type", "hub_offline", "not_gguf"])
def test_bad_models_are_refused_with_a_reason_and_nothing_is_written(tmp_path, capsys, monkeypatch, case):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = build_tiny_checkpoint(tmp_path / "tiny")
    if case == "missing":
        spec, expect = str(tmp_path / "nowhere" / "model"), "does not exist"
    elif case == "no_tokenizer":
        for f in src.glob("tokenizer*"):
            f.unlink()
        spec, expect = str(src), "tokenizer"
    elif case == "not_causal":
        config = json.loads((src / "config.json").read_text())
        config.update(model_type="t5", architectures=["T5Model"])
        (src / "config.json").write_text(json.dumps(config))
        spec, expect = str(src), "not a causal language model"
    elif case == "unknown_type":
        config = json.loads((src / "config.json").read_text())
        config["model_type"] = "no-such-architecture"
        (src / "config.json").write_text(json.dumps(config))
        spec, expect = str(src), "cannot read its config"
    elif case == "hub_offline":
        spec, expect = "some-org/some-model-that-is-not-here", "some-org/some-model-that-is-not-here"
    else:
        (tmp_path / "weights.bin").write_bytes(b"x")
        spec, expect = str(tmp_path / "weights.bin"), "not a .gguf"
    assert _init(tmp_path, "--model", spec, "--env", "arithmetic") == 2
    err = capsys.readouterr().err
    assert expect in err, err
    assert not (tmp_path / "coord").exists()


def test_an_existing_directory_keeps_its_files_when_init_is_refused(tmp_path, capsys):
    (tmp_path / "coord").mkdir()
    (tmp_path / "coord" / "notes.txt").write_text("mine")
    assert _init(tmp_path, "--model", str(tmp_path / "missing"), "--env", "arithmetic") == 2
    assert sorted(p.name for p in (tmp_path / "coord").iterdir()) == ["notes.txt"]


def test_model_and_tiny_preset_together_are_refused(tmp_path, capsys):
    assert _init(tmp_path, "--model", "x", "--preset", "tiny-arith") == 2
    assert "give one" in capsys.readouterr().err


def test_gguf_specs_resolve_to_the_file_and_builtin_names_are_checked(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    source = resolve_model(str(tmp_path / "m.gguf"))
    assert source.gguf_file == "m.gguf" and source.path == tmp_path
    with pytest.raises(ModelLoadError, match="unknown built-in model"):
        resolve_model("builtin:nope")


def test_stop_tokens_include_the_chat_templates_end_of_turn(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    config = json.loads((smollm2_dir / "config.json").read_text())
    # A model whose config says EOS is <|endoftext|> (id 0) still stops at the template's <|im_end|>.
    facts = tokenizer_facts(tok, {**config, "eos_token_id": 0}, {})
    assert 2 in facts.stop_token_ids and 0 in facts.stop_token_ids and facts.has_chat_template
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("case", ["wrong_columns", "empty", "missing_file"])
def test_bad_dataset_files_are_refused_before_anything_is_written(tmp_path, capsys, case):
    src = build_tiny_checkpoint(tmp_path / "tiny")
    data = tmp_path / "problems.jsonl"
    if case == "wrong_columns":
        data.write_text(json.dumps({"prompt": "1+1?", "solution": "2"}) + "\n")
    elif case == "empty":
        data.write_text("")
    assert _init(tmp_path, "--model", str(src), "--env", "math", "--env-arg", f"data={data}") == 2
    err = capsys.readouterr().err
    assert "environment 'math'" in err and {"wrong_columns": "question", "empty": "empty",
                                             "missing_file": "problems.jsonl"}[case] in err, err
    assert not (tmp_path / "coord").exists()


def test_a_dataset_file_with_renamed_columns_is_accepted(tmp_path, capsys):
    src = build_tiny_checkpoint(tmp_path / "tiny")
    data = tmp_path / "problems.csv"
    data.write_text("problem,solution\nWhat is 2+3?,5\nWhat is 4+4?,8\n")
    assert _init(tmp_path, "--model", str(src), "--env", "math", "--env-arg", f"data={data}",
                 "--env-arg", "question_column=problem", "--env-arg", "answer_column=solution") == 0
    cfg = (tmp_path / "coord" / "coordinator.toml").read_text()
    assert "question_column" in cfg and "problem" in cfg


def test_an_instruct_prompt_for_a_tokenizer_without_a_chat_template_is_refused(tmp_path, capsys):
    src = build_tiny_checkpoint(tmp_path / "tiny")  # the char-level tokenizer has no chat template
    assert _init(tmp_path, "--model", str(src), "--env", "math", "--set", "environment.chat_template=always") == 2
    assert "no chat template" in capsys.readouterr().err
    assert not (tmp_path / "coord").exists()
