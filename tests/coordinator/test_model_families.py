"""Model families beyond Llama: small random Qwen2 and Mistral models with a real tokenizer (SmolLM2's,
chat template included) go through the whole real-model path: `coordinator init --model`, chat-rendered
prompts, the node's engine, and the coordinator's verifier, which accepts the honest group and refuses a
forged one."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from veriroll.cli.main import main
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.environments import load_environment
from veriroll.coordinator.intake import LeaseRecord, Submission, SubmittedSample
from veriroll.coordinator.policy import PolicyStore
from veriroll.coordinator.prompts import PromptRenderer
from veriroll.coordinator.verifier import TrustedVerifier
from veriroll.node.engines.base import GenerationRequest
from veriroll.node.engines.torch import TorchEngine
from veriroll.protos.reasons import Reason

FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
}


def _tiny_model_dir(tmp_path, family: str, tokenizer_dir):
    import transformers
    from transformers import AutoTokenizer

    config_name, model_name, extra = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = getattr(transformers, config_name)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=True, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config)
    out = tmp_path / f"{family}-src"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_model_family_runs_the_real_model_path(tmp_path, smollm2_dir, family, capsys):
    src = _tiny_model_dir(tmp_path, family, smollm2_dir)
    assert main(["coordinator", "init", "--dir", str(tmp_path / "coord"), "--model", str(src), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["architecture"] == FAMILIES[family][1] and summary["chat_template"] is True
    store = PolicyStore(tmp_path / "coord" / "checkpoints")
    renderer = PromptRenderer(store.tokenizer)
    prompt = load_environment("math").sample_prompts(random.Random(0), 1)[0]
    ids = renderer.render(prompt)
    assert store.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")  # the assistant's turn is open
    engine = TorchEngine(store.version_dir(0), 0)
    seeds = [11, 12, 13, 14]
    req = GenerationRequest(prompt_ids=ids, seeds=seeds, temperature=1.0, max_new_tokens=40,
                            stop_token_ids=store.stop_token_ids)
    results = engine.generate([req])[0]
    lease = LeaseRecord("L", "n", 1, 4, 1.0, 40, tuple(seeds), tuple(store.stop_token_ids), 0, 0, 1 << 60, "open")
    sub = Submission("L", 0, [SubmittedSample(np.asarray(r.token_ids), np.asarray(r.logprobs, dtype=np.float32), r.proof,
                                              r.finish_reason) for r in results])
    verifier = TrustedVerifier(store, CoordinatorConfig())
    assert verifier.verify_group(lease, ids, sub).rejection is None
    forged = dataclasses.replace(sub, samples=[dataclasses.replace(s, logprobs=s.logprobs + 0.1) for s in sub.samples])
    assert verifier.verify_group(lease, ids, forged).rejection.reason == Reason.LOGPROB_MISMATCH
