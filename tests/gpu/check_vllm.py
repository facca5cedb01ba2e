"""The vLLM engine against the coordinator's verifier, on a GPU (or on vLLM's CPU build).

    python tests/gpu/check_vllm.py [--device cuda] [--size 0.5b] [--dtype bfloat16] [--quick]

Builds a random-weight model of a real architecture locally (``--size 0.5b``: a Qwen2-0.5B-shaped
config, 494 M parameters; ``tiny``: a 2-layer Llama for vLLM's CPU build), generates groups with
:class:`~veriroll.node.engines.vllm.VLLMEngine`, and runs on every group exactly what the coordinator
runs (:func:`veriroll.coordinator.verifier.prefill_group` with the trusted model in PyTorch, then
:func:`~veriroll.coordinator.verifier.judge_group`: TOPLOC, seeded sampling, log-prob tolerance).
Asserts no honest group is rejected, that the attacks are (another model, a different temperature,
fabricated tokens with honestly recomputed states and log-probs, forged log-probs), and that an
in-place weight reload serves the new weights. Prints a few lines, then one JSON line.

Without CUDA (and ``--device cuda``) it prints ``{"skipped": "no GPU"}`` and exits 0. pytest collects
it (tests/gpu/conftest.py) as one ``gpu``-marked test that runs the script in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

try:  # the script runs by hand on GPU machines that may not have pytest
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HONEST = "accepted"


def worst(verdicts) -> str:
    """An attack's outcome over several groups: ``accepted`` if any got through, else the first rejection."""
    verdicts = list(verdicts)
    return next((v for v in verdicts if v == HONEST), verdicts[0] if verdicts else "n/a")


def parameter_count(path: Path) -> int:
    """Parameters stored in a checkpoint directory, read from the safetensors headers."""
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 - not a dict
    return total


def build_checkpoint(path: Path, *, size: str, seed: int, device: str) -> None:
    """A random-weight checkpoint of a real architecture, written to ``path``.

    Random init gives near-uniform logits over a big vocabulary; the final norm's weight is scaled so
    that the next-token distributions are peaked like a trained model's (logit std ~4), which is what
    makes near-ties rare and the sampling check meaningful.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    if size == "0.5b":  # Qwen2-0.5B's shape
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                             tie_word_embeddings=True, rope_theta=1000000.0)
        dtype, norm_scale = torch.bfloat16, 7.0
    else:
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
        dtype, norm_scale = torch.float32, 6.0
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        model.get_decoder().norm.weight.mul_(norm_scale)
    model.save_pretrained(path)
    del model


def make_requests(rng: random.Random, *, groups: int, group_size: int, new_tokens: int, vocab: int,
                  temperatures=(1.0, 0.7)):
    from veriroll.node.engines import GenerationRequest

    requests = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, 96))]
        # Budgets that are and are not multiples of the 32-token TOPLOC chunk; a few stop tokens.
        budget = new_tokens if g % 2 == 0 else max(1, new_tokens - 1 - rng.randrange(31))
        stop = [rng.randrange(vocab) for _ in range(3)] if g % 3 == 2 else []
        requests.append(GenerationRequest(prompt, [rng.getrandbits(64) for _ in range(group_size)],
                                          temperatures[g % len(temperatures)], budget, stop))
    return requests


def lease_and_submission(request, samples, *, temperature: float | None = None, version: int = 0):
    """The coordinator's view of one group: its lease record and the node's submission."""
    import numpy as np

    from veriroll.coordinator.intake import LeaseRecord, Submission, SubmittedSample

    lease = LeaseRecord(lease_id="L", node_id="n", prompt_id=0, group_size=request.n,
                        temperature=request.temperature if temperature is None else temperature,
                        max_new_tokens=request.max_new_tokens, seeds=tuple(request.seeds),
                        stop_token_ids=tuple(request.stop_token_ids), policy_version=version,
                        issued_ms=0, deadline_ms=1, state="issued")
    sub = Submission("L", version, [
        SubmittedSample(np.asarray(s.token_ids, dtype=np.int64), np.asarray(s.logprobs, dtype=np.float32),
                        s.proof, s.finish_reason) for s in samples])
    return lease, sub


class Verifier:
    """The coordinator's checks with the trusted model of one version in PyTorch."""

    def __init__(self, checkpoint: Path, dtype: torch.dtype, device: str) -> None:
        from transformers import AutoModelForCausalLM

        from veriroll.coordinator.verifier import tolerances_for

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
        self.tolerances = tolerances_for(dtype, 0.05)  # intake.logprob_tolerance's default
        self.seconds = 0.0
        self.max_logprob_diff = 0.0

    def judge(self, request, samples, *, temperature: float | None = None, honest: bool = False) -> str:
        """The coordinator's verdict on one group; ``honest`` groups also feed ``max_logprob_diff``."""
        from veriroll.coordinator.verifier import judge_group, prefill_group
        from veriroll.toploc.sampling import token_logprobs

        t0 = time.perf_counter()
        lease, sub = lease_and_submission(request, samples, temperature=temperature)
        trusted = prefill_group(self.model, request.prompt_ids, [list(s.token_ids) for s in samples])
        rejection, _ = judge_group(lease, sub, trusted, self.tolerances)
        self.seconds += time.perf_counter() - t0
        if honest:
            for s, logits in zip(samples, trusted.logits, strict=True):
                lp = token_logprobs(logits, torch.as_tensor(s.token_ids), request.temperature)
                self.max_logprob_diff = max(self.max_logprob_diff,
                                            float((torch.as_tensor(s.logprobs) - lp).abs().max()))
        return HONEST if rejection is None else f"{rejection.reason.name.lower()}: {rejection.detail}"

    def honest_states(self, request, completions):
        """What a cheating node that recomputes everything honestly for tokens it chose would send."""
        from veriroll.coordinator.verifier import prefill_group
        from veriroll.node.engines import SampleResult
        from veriroll.toploc import commit_many
        from veriroll.toploc.sampling import token_logprobs

        trusted = prefill_group(self.model, request.prompt_ids, completions)
        proofs = commit_many(trusted.hidden)
        return [SampleResult(c, token_logprobs(lg, torch.as_tensor(c), request.temperature).tolist(), p, "length")
                for c, lg, p in zip(completions, trusted.logits, proofs, strict=True)]


def compare_fused_draw(device: str, vocab: int, rows: int = 256, steps: int = 8) -> float:
    """Share of draws on which the compiled seeded draw picks the eager draw's token, on this device."""
    from veriroll.node.engines.vllm_sampling import fused_draw
    from veriroll.toploc import sampling

    draw, gen = fused_draw(), torch.Generator(device=device).manual_seed(0)
    same = total = 0
    for step in range(steps):
        n = rows - 7 * step  # several row counts: the compiled kernel is shape-generic
        logits = torch.randn(n, vocab, generator=gen, device=device) * 5
        seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen, device=device)
        positions = torch.randint(0, 4096, (n,), generator=gen, device=device)
        for temperature in (1.0, 0.7):
            a = draw(logits, temperature, seeds, positions)
            b = sampling.sample(logits, temperature, seeds, positions)
            same, total = same + int((a == b).sum()), total + n
    return same / total


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default=None, choices=["0.5b", "tiny"], help="default: 0.5b on cuda, tiny on cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer groups and tokens")
    parser.add_argument("--fused-draw", action="store_true", help="run the engine with the compiled seeded draw")
    parser.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_vllm: no CUDA GPU here; nothing to check", file=sys.stderr)
        return {"skipped": "no GPU"}
    torch.set_num_threads(1 if args.device == "cpu" else torch.get_num_threads())
    size = args.size or ("0.5b" if args.device == "cuda" else "tiny")
    dtype_name = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype_name]
    groups = args.groups or (4 if args.quick else 16)
    new_tokens = args.new_tokens or (48 if args.quick else 256)

    from veriroll.node.engines.vllm import VLLMEngine

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="check_vllm_"))
    ckpt = {v: work / f"v{v}" for v in (0, 1)}
    t0 = time.perf_counter()
    for v, path in ckpt.items():
        if not (path / "config.json").exists():
            build_checkpoint(path, size=size, seed=v, device=args.device)
    build_s = time.perf_counter() - t0
    vocab = json.loads((ckpt[0] / "config.json").read_text())["vocab_size"]
    engine_kwargs = dict(device=args.device, dtype=dtype_name, max_model_len=512 if size == "tiny" else 2048,
                         fused_draw=args.fused_draw)
    if args.device == "cpu":
        engine_kwargs.update(enforce_eager=True, max_num_seqs=32)
    else:
        engine_kwargs.update(gpu_memory_utilization=0.6)  # leaves room for the trusted model on the same GPU

    rng = random.Random(0)
    requests = make_requests(rng, groups=groups, group_size=args.group_size, new_tokens=new_tokens, vocab=vocab)
    t0 = time.perf_counter()
    engine = VLLMEngine(ckpt[0], 0, **engine_kwargs)
    start_s = time.perf_counter() - t0
    results = engine.generate(requests)
    gen = engine.last_stats
    verifier = Verifier(ckpt[0], dtype, args.device)
    verdicts = [verifier.judge(r, g, honest=True) for r, g in zip(requests, results, strict=True)]
    false_rejections = [v for v in verdicts if v != HONEST]
    honest_verify_s = verifier.seconds
    print(f"{len(requests)} groups, {gen.tokens} tokens in {gen.generate_s:.2f} s "
          f"({gen.tokens / max(gen.generate_s, 1e-9):.0f} tok/s); verified in {honest_verify_s:.2f} s; "
          f"false rejections: {len(false_rejections)}")
    for v in false_rejections[:5]:
        print("  honest group rejected:", v)

    # Attacks on a few groups, each must be rejected.
    attacks: dict[str, str] = {}
    victims = requests[: min(3, len(requests))]
    # (1) a different temperature than the lease's (the node samples at 0.7 what was leased at 1.0)
    hot = [r for r in requests if r.temperature == 1.0][:2]
    cold = engine.generate([type(r)(r.prompt_ids, r.seeds, 0.5, r.max_new_tokens, r.stop_token_ids) for r in hot])
    attacks["wrong_temperature"] = worst(verifier.judge(r, g, temperature=1.0) for r, g in zip(hot, cold, strict=True))
    # (2) fabricated tokens, with hidden states, proofs and log-probs honestly recomputed for them
    fab_rng = random.Random(1)
    fabricated = []
    for r, g in zip(victims, results[: len(victims)], strict=True):
        completions = [[fab_rng.randrange(vocab) for _ in s.token_ids] for s in g]
        fabricated.append(verifier.judge(r, verifier.honest_states(r, completions)))
    attacks["fabricated_tokens"] = worst(fabricated)
    # (3) cherry-picking: each sample's tokens are the honest draw of another seed (another sample's)
    swapped = []
    for r, g in zip(victims, results[: len(victims)], strict=True):
        rotated = [g[(i + 1) % len(g)] for i in range(len(g))]
        if len(g) > 1:
            swapped.append(verifier.judge(r, rotated))
    attacks["other_seed"] = worst(swapped)
    # (4) forged behaviour log-probs
    from veriroll.node.engines import SampleResult

    forged = [[SampleResult(s.token_ids, [x + 0.5 for x in s.logprobs], s.proof, s.finish_reason) for s in g]
              for g in results[: len(victims)]]
    attacks["forged_logprobs"] = worst(verifier.judge(r, g) for r, g in zip(victims, forged, strict=True))
    # (5) another model: weights of v1 loaded in place, judged against v0's trusted model
    t0 = time.perf_counter()
    engine.load(ckpt[1], 1)
    reload_s = time.perf_counter() - t0
    other = engine.generate(victims)
    attacks["other_model"] = worst(verifier.judge(r, g) for r, g in zip(victims, other, strict=True))
    # ... and v1's own trusted model accepts them: the reload really served v1.
    max_lp = verifier.max_logprob_diff
    del verifier
    if args.device == "cuda":
        torch.cuda.empty_cache()
    verifier1 = Verifier(ckpt[1], dtype, args.device)
    reload_honest = [verifier1.judge(r, g) for r, g in zip(victims, other, strict=True)]
    del verifier1
    # Back to v0: the same requests draw the same tokens as before the two reloads.
    engine.load(ckpt[0], 2)
    again = engine.generate(victims)
    same = [a.token_ids == b.token_ids for ga, gb in zip(again, results[: len(victims)], strict=True) for a, b in zip(ga, gb, strict=True)]
    engine.close()
    fused_agreement = compare_fused_draw(args.device, vocab) if args.device == "cuda" else None
    for name, verdict in attacks.items():
        print(f"  attack {name}: {verdict[:160]}")

    import vllm

    figures = {
        "ok": not false_rejections and all(v != HONEST for v in attacks.values())
        and all(v == HONEST for v in reload_honest),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "vllm": vllm.__version__,
        "model": "qwen2-0.5b-shape, random weights" if size == "0.5b" else "llama-tiny, random weights",
        "params": parameter_count(ckpt[0]),
        "dtype": dtype_name,
        "groups": len(requests),
        "samples": gen.samples,
        "tokens": gen.tokens,
        "false_rejections": len(false_rejections),
        "max_logprob_diff": round(max_lp, 7),
        "attacks": {k: v.split(":")[0] for k, v in attacks.items()},
        "reload_serves_new_weights": all(v == HONEST for v in reload_honest),
        "reload_s": round(reload_s, 3),
        "same_tokens_after_reload_back": sum(same) / max(1, len(same)),
        "generate_s": round(gen.generate_s, 3),
        "tokens_per_s": round(gen.tokens / max(gen.generate_s, 1e-9), 1),
        "verify_s": round(honest_verify_s, 3),
        "verify_fraction": round(honest_verify_s / max(gen.generate_s, 1e-9), 4),
        "commit_wait_s": round(gen.commit_wait_s, 4),
        "superseded_rows": gen.superseded_rows,
        "fused_draw": args.fused_draw,
        "fused_vs_eager_same_tokens": fused_agreement,
        "engine_start_s": round(start_s, 2),
        "build_checkpoints_s": round(build_s, 2),
    }
    return figures


if pytest is not None:

    @pytest.mark.gpu
    def test_vllm_engine_output_passes_the_coordinators_checks_on_gpu(tmp_path):
        """Runs this script (quick) in its own process: vLLM wants its process to itself."""
        pytest.importorskip("vllm", reason="vLLM is not installed: pip install 'veriroll[vllm]'")
        proc = subprocess.run([sys.executable, __file__, "--quick", "--workdir", str(tmp_path)],
                              capture_output=True, text=True, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
        figures = json.loads(lines[-1])
        if figures.get("skipped"):
            pytest.skip(figures["skipped"])
        assert figures["ok"], figures
        assert figures["false_rejections"] == 0 and not math.isnan(figures["max_logprob_diff"])


if __name__ == "__main__":
    result = main()
    print(json.dumps(result))
    sys.exit(0 if result.get("ok", True) else 1)
