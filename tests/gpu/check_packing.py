"""Sequence packing on CUDA with flash-attention's variable-length kernel (``attn_implementation=
"flash_attention_2"``), against the padded path, on a GPU.

    python tests/gpu/check_packing.py

A random 4-layer Llama in bf16 on CUDA, a batch of very different lengths: the packed forward (one row,
position ids restarting per sample, no mask: transformers derives cu_seqlens from them) gives each sample
the padded forward's log-probs within bf16 noise, and changing one sample's tokens leaves the others in
its row unchanged (attention confined to each sample). Prints one JSON line. Without CUDA it prints
``{"skipped": "no GPU"}``, without the flash-attn package ``{"skipped": "flash-attn is not installed"}``,
and exits 0. pytest collects it (tests/gpu/conftest.py) as one ``gpu``-marked test.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import torch

try:  # the script runs by hand on GPU machines that may not have pytest
    import pytest
except ImportError:  # pragma: no cover
    pytest = None


def main() -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no GPU"}
    if importlib.util.find_spec("flash_attn") is None:
        return {"skipped": "flash-attn is not installed"}
    from transformers import LlamaConfig, LlamaForCausalLM

    from veriroll.coordinator.trainer import (
        GroupRecord,
        SampleRecord,
        attention_for,
        build_batch,
        completion_logprobs,
    )

    assert attention_for("auto", "cuda") == "flash_attention_2"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                      attn_implementation="flash_attention_2")
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    rng = np.random.default_rng(0)
    groups = []
    for g, (p, lengths) in enumerate([(5, (1, 700, 9)), (90, (40, 3, 300)), (20, (17, 120, 2))]):
        prompt = rng.integers(3, 512, size=p).astype(np.int32)
        samples = [SampleRecord(rng.integers(3, 512, size=n).astype(np.int32), np.zeros(n, dtype=np.float32), None,
                                float(i % 2)) for i, n in enumerate(lengths)]
        groups.append(GroupRecord(g, "arithmetic", 0, 1.0, 0, prompt, samples))
    batch, _ = build_batch(groups, [0, 0, 0])
    for name in ("input_ids", "attention_mask", "positions", "completion_ids", "response_mask", "temperature"):
        setattr(batch, name, getattr(batch, name).cuda())
    m = batch.response_mask
    with torch.no_grad():
        padded, _ = completion_logprobs(model, batch)
        packed, _ = completion_logprobs(model, batch, packed=True)
        diff = (packed[m] - padded[m]).abs()
        changed = batch.select(slice(None))
        changed.input_ids = batch.input_ids.clone()
        n = int(batch.attention_mask[4].sum())
        changed.input_ids[4, :n] = (changed.input_ids[4, :n] + 7) % 512
        after, _ = completion_logprobs(model, changed, packed=True)
    others = torch.arange(batch.size, device="cuda") != 4
    leak = float((after[others][m[others]] - packed[others][m[others]]).abs().max())
    moved = float((after[4][m[4]] - packed[4][m[4]]).abs().max())
    figures = {"max_logprob_diff": float(diff.max()), "mean_logprob_diff": float(diff.mean()),
               "other_samples_moved": leak, "changed_sample_moved": moved,
               "attn_implementation": model.config._attn_implementation}
    # bf16: ~3 significant digits per op; the padded path's own flash-attention (unpadded by its mask) runs
    # the same varlen kernel, so the two should agree to bf16 rounding. A leak between samples would move
    # the others by as much as the changed one moves.
    figures["ok"] = figures["mean_logprob_diff"] < 0.02 and leak < 1e-3 and moved > 1e-2
    return figures


if pytest is not None:

    @pytest.mark.gpu
    def test_packed_flash_attention_matches_the_padded_path_and_confines_each_sample():
        figures = main()
        if figures.get("skipped"):
            pytest.skip(figures["skipped"])
        assert figures["ok"], figures


if __name__ == "__main__":
    result = main()
    print(json.dumps(result))
    sys.exit(0 if result.get("ok", True) else 1)
