"""Throughput of the torch engine: batched KV-cached generation vs a naive per-sample loop.

Both sides run the same engine on the same randomly initialised Llama-architecture model (built here,
nothing downloaded) with the same prompts and seeds, so they produce the same tokens; the naive side
just calls ``generate`` once per sample. Also reports how much of the batched generation time goes
into building the TOPLOC commitments.

    .venv/bin/python benchmarks/engine.py [--quick] [--device cuda] [--dtype bfloat16]

Prints a few human lines, then one JSON line with: ``batched_tokens_per_s``, ``naive_tokens_per_s``,
``ratio`` (batched / naive), ``commit_fraction`` (commit time / prefill + decode time, batched run),
``tokens``, and the setup.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from veriroll.node.engines import GenerationRequest
from veriroll.node.engines.torch import TorchEngine


def build_checkpoint(path: Path, *, layers: int, hidden: int, vocab: int) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=1024,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def make_requests(n_requests: int, group: int, new_tokens: int, vocab: int) -> list[GenerationRequest]:
    rng = random.Random(0)
    return [
        GenerationRequest(
            prompt_ids=[rng.randrange(vocab) for _ in range(rng.randint(8, 48))],
            seeds=[rng.getrandbits(64) for _ in range(group)],
            temperature=1.0,
            max_new_tokens=new_tokens,
            stop_token_ids=[],
        )
        for _ in range(n_requests)
    ]


def one_per_sample(request: GenerationRequest) -> list[GenerationRequest]:
    """The request split into single-sample requests with the same seeds (what a naive loop runs)."""
    return [
        GenerationRequest(request.prompt_ids, [seed], request.temperature, request.max_new_tokens, [])
        for seed in request.seeds
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run (well under a minute on 2 cores)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=8, help="prompts (leases) generated together")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.group, args.new_tokens = 4, 4, 48

    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp), layers=args.layers, hidden=args.hidden, vocab=args.vocab)
        engine = TorchEngine(Path(tmp), version=0, device=args.device, dtype=args.dtype, threads=args.threads)
    requests = make_requests(args.requests, args.group, args.new_tokens, args.vocab)
    engine.generate(make_requests(2, 2, 4, args.vocab))  # warm-up: kernels, allocator

    t0 = time.perf_counter()
    batched = engine.generate(requests)
    batched_s = time.perf_counter() - t0
    stats = engine.last_stats

    t0 = time.perf_counter()
    naive = [[engine.generate([alone])[0][0] for alone in one_per_sample(r)] for r in requests]
    naive_s = time.perf_counter() - t0

    tokens = sum(len(s.token_ids) for group in batched for s in group)
    same = sum(
        a.token_ids == b.token_ids
        for ga, gb in zip(batched, naive, strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    generation_s = stats.prefill_s + stats.decode_s
    result = {
        "batched_tokens_per_s": round(tokens / batched_s, 1),
        "naive_tokens_per_s": round(tokens / naive_s, 1),
        "ratio": round(naive_s / batched_s, 2),
        "commit_fraction": round(stats.commit_s / generation_s, 4),
        "commit_s": round(stats.commit_s, 4),
        "generation_s": round(generation_s, 3),
        "tokens": tokens,
        "samples": args.requests * args.group,
        "identical_samples": same,
        "model": f"llama {args.layers}x{args.hidden} vocab {args.vocab}",
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "quick": args.quick,
    }
    print(
        f"batched: {tokens} tokens in {batched_s:.2f} s ({result['batched_tokens_per_s']} tok/s, "
        f"prefill {stats.prefill_s:.2f} s, decode {stats.decode_s:.2f} s, commit {stats.commit_s:.3f} s)"
    )
    print(f"naive:   {tokens} tokens in {naive_s:.2f} s ({result['naive_tokens_per_s']} tok/s)")
    print(f"batched / naive throughput: {result['ratio']}x; identical samples {same}/{result['samples']}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
