"""Peak memory and step time of the trainer on a real model (SmolLM2-135M-Instruct by default) on CPU.

Loads the model the way the trainer does (float32 master weights, ``trainer.load_training_model``), builds a
batch of chat prompts with random completions that end in EOS, takes their behaviour log-probs from the
model itself (so the PPO ratio starts at 1 and every token carries gradient, as on-policy rollouts
would), then times ``train_step`` (AdamW, micro-batches, gradient checkpointing, autocast as configured).
Peak RSS is the process's ``ru_maxrss``: run it in a fresh process, as below, for a clean figure.

    .venv/bin/python benchmarks/trainer_memory.py                  # --quick: the smoke settings
    .venv/bin/python benchmarks/trainer_memory.py --no-gradient-checkpointing
    .venv/bin/python benchmarks/trainer_memory.py --autocast bfloat16
    .venv/bin/python benchmarks/trainer_memory.py --publish float32,bfloat16

``--quick`` (the default): 2 groups x 4 samples, 48 generated tokens after a ~30-token chat prompt,
``micro_batch_tokens`` 1024, gradient checkpointing on, 2 steps. ``--full``: 4 groups x 8 samples x 128
tokens, 3 steps. ``--publish DTYPES`` then writes and shardcast-publishes the trained weights once per
dtype (``trainer.measure_publish``) and reports the times and bytes.

The last line printed is one JSON object: ``{"trainer_peak_rss_mb", "step_s", "first_step_s",
"gradient_checkpointing", "micro_batch_tokens", "autocast", "samples", "tokens", "micro_batches",
"load_rss_mb", "weights_changed", "publish": [{"dtype", "publish_s", "save_s", "shard_s", "bytes",
"files", "peak_rss_mb"}, ...]}``; ``trainer_peak_rss_mb`` is measured before any publish.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from veriroll.coordinator.config import TrainerConfig
from veriroll.coordinator.trainer import (
    GroupRecord,
    SampleRecord,
    build_batch,
    build_optimizer,
    completion_logprobs,
    load_training_model,
    measure_publish,
    train_step,
)

QUICK = {"groups": 2, "group_size": 4, "completion_tokens": 48, "steps": 2}
FULL = {"groups": 4, "group_size": 8, "completion_tokens": 128, "steps": 3}


def peak_rss_mb() -> float:
    """The process's peak resident set size so far, in MB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def synthetic_groups(tokenizer, groups: int, group_size: int, completion_tokens: int, *, seed: int = 0):
    """Groups of random completions (EOS last) after chat prompts; rewards alternate inside each group
    so every sample has a non-zero advantage. Log-probs are placeholders until :func:`on_policy`."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = np.array(chat_prompt_ids(tokenizer, f"What is {g + 17} times {g + 3}?"), dtype=np.int32)
        samples = []
        for i in range(group_size):
            n = completion_tokens
            tokens = np.array([*rng.integers(100, tokenizer.vocab_size, size=n - 1), tokenizer.eos_token_id],
                              dtype=np.int32)
            samples.append(SampleRecord(tokens, np.zeros(n, dtype=np.float32), None, float(i % 2)))
        out.append(GroupRecord(g, "math", 0, 1.0, int(group_size * completion_tokens), prompt, samples))
    return out


def on_policy(model, batch, rows_at_once: int = 4) -> None:
    """Fill the batch's behaviour and trusted log-probs with the model's own (no gradient): the ratio
    starts at 1, as for fresh rollouts, instead of clipping every random token away."""
    with torch.no_grad():
        for start in range(0, batch.size, rows_at_once):
            rows = slice(start, start + rows_at_once)
            part = batch.select(rows)
            logp, _ = completion_logprobs(model, part)
            batch.logp_behavior[rows] = torch.where(part.response_mask, logp, 0.0)
    batch.logp_trusted.copy_(batch.logp_behavior)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the smoke settings (default)")
    size.add_argument("--full", action="store_true", help="a larger batch: 4 x 8 samples x 128 tokens")
    parser.add_argument("--model", default=None, help="HF model directory (default: the cached built-in SmolLM2)")
    parser.add_argument("--groups", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--completion-tokens", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--autocast", choices=["auto", "bfloat16", "off"], default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--publish", default="", help="comma-separated dtypes to publish the trained weights in")
    args = parser.parse_args()
    preset = FULL if args.full else QUICK
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model is None:
        from veriroll.coordinator.models import cached_builtin_model

        args.model = str(cached_builtin_model())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    cfg = TrainerConfig(micro_batch_tokens=args.micro_batch_tokens, gradient_checkpointing=args.gradient_checkpointing,
                        autocast=args.autocast, lr=1e-5)
    model = load_training_model(args.model)
    load_rss = peak_rss_mb()
    optimizer = build_optimizer(model, cfg)
    groups = synthetic_groups(tokenizer, args.groups, args.group_size, args.completion_tokens)
    batch, _ = build_batch(groups, [0] * len(groups), pad_id=int(tokenizer.pad_token_id or 0))
    on_policy(model, batch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    times, metrics = [], {}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        metrics = train_step(model, optimizer, batch, cfg, s_max=2)
        times.append(time.perf_counter() - t0)
        print(f"step {len(times)}: {times[-1]:.2f} s, loss {metrics['loss']:.4f}, grad norm {metrics['grad_norm']:.3f}, "
              f"peak RSS {peak_rss_mb():.0f} MB", file=sys.stderr)
    trainer_peak = peak_rss_mb()
    changed = sum(not torch.equal(before[n], p) for n, p in model.named_parameters())
    del before

    publish = []
    if args.publish:
        from veriroll.protos.identity import PrivateKey

        key = PrivateKey.generate()
        for dtype in [d.strip() for d in args.publish.split(",") if d.strip()]:
            with tempfile.TemporaryDirectory(prefix="veriroll-publish-") as root:
                result = measure_publish(model, Path(args.model), root, dtype, key)
            result["peak_rss_mb"] = round(peak_rss_mb(), 1)
            publish.append(result)
            print(f"publish {dtype}: {result}", file=sys.stderr)

    result = {
        "trainer_peak_rss_mb": round(trainer_peak, 1),
        "step_s": round(float(np.median(times[1:] if len(times) > 1 else times)), 3),
        "first_step_s": round(times[0], 3),
        "gradient_checkpointing": args.gradient_checkpointing,
        "micro_batch_tokens": args.micro_batch_tokens,
        "autocast": args.autocast,
        "samples": batch.size,
        "tokens": int(batch.attention_mask.sum()),
        "micro_batches": int(metrics.get("micro_batches", 0)),
        "load_rss_mb": round(load_rss, 1),
        "weights_changed": changed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "publish": publish,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
