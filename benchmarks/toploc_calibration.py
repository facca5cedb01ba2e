"""Calibrate the TOPLOC thresholds: per-chunk statistics of honest variation and of attacks.

    .venv/bin/python benchmarks/toploc_calibration.py [--quick] [--groups G] [--group-size N]

Two sources of hidden states, both committed with ``veriroll.toploc.commit`` (32-token chunks, top-128)
and checked with ``verify``:

* synthetic ``[T, H]`` tensors (Gaussian, and Gaussian with a few large "outlier" channels as in real
  LLMs), perturbed the way honest engines differ (float32 relative noise 1e-6..1e-4, bf16 vs fp32
  casts) and the way cheaters would (negate, rescale, unrelated tensor, proof of another sample);
* tiny random-init Llama models (2 layers x 64 hidden, 4 layers x 256 hidden): the prover generates
  with a KV cache, seeded Gumbel sampling, keeping the final-norm hidden state of each position that
  produced a token; the verifier runs one full forward of prompt + completion (``model.model``) and
  takes ``last_hidden_state`` at the same positions. Honest variants: float32 both sides, a different
  batch shape with padding at the verifier, bfloat16 both sides. Attacks: another random init, the
  model one optimizer step away (several learning rates), bf16 or fp16 generation claimed as fp32,
  a changed prompt, negated / rescaled activations, the proof of another sample.

For each scenario it prints the worst statistic (honest: the largest, attacks: how many chunks and
samples the default thresholds reject, and why). The last line is one JSON object with everything.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections import Counter

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from veriroll.toploc import Thresholds, commit, commit_many, verify, verify_many
from veriroll.toploc.proof import thresholds_for
from veriroll.toploc.sampling import sample

CHUNK, TOPK = 32, 128
# Statistics only: nothing is ever rejected by the statistics pass.
LOOSE = Thresholds(
    max_exp_mismatch_frac=1.0, max_sign_mismatch_frac=1.0, max_mant_err_mean=1e9, max_mant_err_median=1e9
)


class Scenario:
    """Per-chunk statistics and per-sample verdicts (under the default thresholds) of one scenario."""

    def __init__(self, name: str, honest: bool):
        self.name, self.honest = name, honest
        self.exp, self.sign, self.mean, self.median = [], [], [], []
        self.samples = self.rejected = 0
        self.reasons: Counter[str] = Counter()

    def add(self, proof: bytes, trusted: torch.Tensor, thresholds: Thresholds | None = None) -> None:
        stats = verify(proof, trusted, chunk_size=CHUNK, topk=TOPK, thresholds=LOOSE)
        if not stats.ok:
            raise RuntimeError(f"{self.name}: {stats.reason} {stats.detail}")
        t, h = trusted.shape
        for i, c in enumerate(stats.chunks):
            k = min(TOPK, (min(CHUNK, t - i * CHUNK)) * h)
            self.exp.append(c.exp_mismatches / k)
            self.sign.append(c.sign_mismatches / k)
            self.mean.append(c.mant_err_mean)
            self.median.append(c.mant_err_median)
        verdict = verify(proof, trusted, chunk_size=CHUNK, topk=TOPK, thresholds=thresholds)
        self.samples += 1
        if not verdict.ok:
            self.rejected += 1
            self.reasons[verdict.reason] += 1

    def summary(self) -> dict:
        def q(xs, f):
            return round(float(f(xs)), 4) if xs else None

        out = {
            "samples": self.samples,
            "chunks": len(self.exp),
            "exp_frac_max": q(self.exp, max),
            "exp_frac_median": q(self.exp, statistics.median),
            "sign_frac_max": q(self.sign, max),
            "mant_mean_max": q(self.mean, max),
            "mant_median_max": q(self.median, max),
        }
        if self.honest:
            out["false_rejections"] = self.rejected
        else:
            out.update(
                {
                    "exp_frac_min": q(self.exp, min),
                    "sign_frac_min": q(self.sign, min),
                    "mant_mean_min": q(self.mean, min),
                    "mant_median_min": q(self.median, min),
                    "detection": round(self.rejected / max(self.samples, 1), 4),
                    "reasons": dict(self.reasons),
                }
            )
        return out


# ------------------------------------------------------------------------------------------------
# Synthetic tensors


def synthetic(kind: str, t: int, h: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(t, h, generator=g)
    if kind == "outliers":  # a few channels an order of magnitude larger, as after a real final norm
        cols = torch.randperm(h, generator=g)[:4]
        x[:, cols] *= 20.0
    return x


def run_synthetic(n: int, seed: int) -> dict[str, Scenario]:
    g = torch.Generator().manual_seed(seed)
    sc: dict[str, Scenario] = {}

    def get(name, honest):
        return sc.setdefault(name, Scenario(name, honest))

    for kind, h in (("gauss", 64), ("gauss", 256), ("outliers", 512)):
        for _ in range(n):
            x = synthetic(kind, 80, h, g)
            other = synthetic(kind, 80, h, g)
            proof = commit(x)
            for eps in (1e-6, 1e-5, 1e-4):
                get(f"syn_noise_{eps:g}", True).add(proof, x * (1 + eps * torch.randn(x.shape, generator=g)))
            # drift of half-precision engines: honest under their own thresholds, where fp32 ones break
            for eps, dt in ((1e-3, torch.float16), (1e-2, torch.bfloat16)):
                y = x * (1 + eps * torch.randn(x.shape, generator=g))
                name = str(dt).removeprefix("torch.")
                get(f"syn_noise_{eps:g}_{name}_thresholds", True).add(proof, y, thresholds_for(dt))
                get(f"info_syn_noise_{eps:g}_fp32_thresholds", True).add(proof, y)
            get("syn_bf16_prover_fp32_verifier", True).add(commit(x.bfloat16()), x)
            get("syn_fp32_prover_bf16_verifier", True).add(proof, x.bfloat16())
            # states rounded to fp16 after an fp32 computation: neither honest fp32 nor fp16 generation
            get("info_syn_fp16_cast_fp32_verifier", True).add(commit(x.half()), x)
            get("syn_attack_negated", False).add(proof, -x)
            get("syn_attack_scaled_1.05", False).add(commit(x * 1.05), x)
            get("syn_attack_scaled_0.5", False).add(commit(x * 0.5), x)
            get("syn_attack_scaled_1.01", False).add(commit(x * 1.01), x)
            get("syn_attack_unrelated", False).add(commit(other), x)
            get("syn_attack_half_unrelated", False).add(commit(torch.cat([x[:40], other[40:]])), x)
    return sc


# ------------------------------------------------------------------------------------------------
# Tiny Llama models


def tiny_llama(layers: int, hidden: int, seed: int, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=48,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval().to(dtype)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, n: int, length: int, seeds: list[int], temperature: float = 1.0):
    """KV-cached batched decode of ``n`` samples of ``prompt``; returns tokens [n, L], hidden [n, L, H].

    ``hidden[:, i]`` is the final-norm hidden state of the position that produced token ``i``.
    """
    from transformers import DynamicCache

    ids = prompt[None, :].repeat(n, 1)
    cache = DynamicCache(config=model.config)
    out = model.model(input_ids=ids, cache=cache, use_cache=True)
    h = out.last_hidden_state[:, -1]
    tokens, states = [], []
    for i in range(length):
        logits = model.lm_head(h)
        tok = sample(logits.float(), temperature, seeds, [i] * n)
        tokens.append(tok)
        states.append(h)
        out = model.model(input_ids=tok[:, None], cache=cache, use_cache=True)
        h = out.last_hidden_state[:, -1]
    return torch.stack(tokens, 1), torch.stack(states, 1)


@torch.no_grad()
def prefill(model, prompt: torch.Tensor, tokens: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """One full forward of prompt + completion (batched), hidden states [n, L, H] at the producing positions.

    ``pad`` extra tokens are appended (masked) to change the batch shape as a padded batch would.
    """
    n, length = tokens.shape
    ids = torch.cat([prompt[None, :].repeat(n, 1), tokens], 1)
    mask = torch.ones_like(ids)
    if pad:
        ids = torch.cat([ids, torch.zeros(n, pad, dtype=ids.dtype)], 1)
        mask = torch.cat([mask, torch.zeros(n, pad, dtype=mask.dtype)], 1)
    hs = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    p = prompt.numel()
    return hs[:, p - 1 : p - 1 + length]


def one_step(model, lr: float, seed: int):
    """The model after one Adam step on a next-token loss: the previous (or next) policy version."""
    stepped = copy.deepcopy(model).train()
    opt = torch.optim.Adam(stepped.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, stepped.config.vocab_size, (4, 48), generator=g)
    stepped(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return stepped.eval()


def run_model(layers: int, hidden: int, groups: int, n: int, length: int, seed: int, timings: dict):
    sc: dict[str, Scenario] = {}
    tag = f"llama{layers}x{hidden}"

    def get(name, honest):
        return sc.setdefault(f"{tag}_{name}", Scenario(f"{tag}_{name}", honest))

    trusted = tiny_llama(layers, hidden, seed)
    trusted_bf16 = tiny_llama(layers, hidden, seed, torch.bfloat16)
    low = {"bf16": trusted_bf16, "fp16": tiny_llama(layers, hidden, seed, torch.float16)}
    other = tiny_llama(layers, hidden, seed + 1000)
    stepped = {lr: one_step(trusted, lr, seed) for lr in (1e-3, 1e-4, 1e-5, 1e-6)}
    g = torch.Generator().manual_seed(seed)
    t_gen = t_commit = t_prefill = t_verify = 0.0
    n_chunks = 0
    for grp in range(groups):
        prompt = torch.randint(0, 48, (16,), generator=g)
        seeds = [seed * 100_000 + grp * 1000 + s for s in range(n)]
        t0 = time.perf_counter()
        tokens, states = generate(trusted, prompt, n, length, seeds)
        t1 = time.perf_counter()
        proofs = commit_many(list(states))
        t2 = time.perf_counter()
        ref = prefill(trusted, prompt, tokens)
        t3 = time.perf_counter()
        verdicts = verify_many(proofs, list(ref), chunk_size=CHUNK, topk=TOPK)
        t4 = time.perf_counter()
        assert len(verdicts) == n
        for s in range(n):
            get("honest_fp32_kvcache_vs_prefill", True).add(proofs[s], ref[s])
        t_gen, t_commit, t_prefill, t_verify = (
            t_gen + t1 - t0,
            t_commit + t2 - t1,
            t_prefill + t3 - t2,
            t_verify + t4 - t3,
        )
        n_chunks += n * -(-length // CHUNK)
        # the verifier prefilling one sample at a time, padded: other shapes, other kernels
        for s in range(min(n, 4)):
            alone = prefill(trusted, prompt, tokens[s : s + 1], pad=7)[0]
            get("honest_fp32_batch1_padded", True).add(proofs[s], alone)
        for s in range(n):  # attacks on the committed tensor itself
            get("attack_negated", False).add(commit(-states[s]), ref[s])
            get("attack_scaled_1.05", False).add(commit(states[s] * 1.05), ref[s])
            get("attack_scaled_0.5", False).add(commit(states[s] * 0.5), ref[s])
            get("attack_proof_of_other_sample", False).add(proofs[(s + 1) % n], ref[s])

        # bf16 on both sides
        tok_b, st_b = generate(trusted_bf16, prompt, n, length, seeds)
        ref_b = prefill(trusted_bf16, prompt, tok_b)
        for s in range(n):
            get("honest_bf16_kvcache_vs_prefill", True).add(commit(st_b[s]), ref_b[s])
        tok_h, st_h = generate(low["fp16"], prompt, n, length, seeds)
        ref_h = prefill(low["fp16"], prompt, tok_h)
        for s in range(n):
            get("honest_fp16_kvcache_vs_prefill", True).add(commit(st_h[s]), ref_h[s])
        # lower precision claimed as fp32: generated in bf16 / fp16, verified in fp32
        for name in low:
            tok_l, st_l = (tok_b, st_b) if name == "bf16" else (tok_h, st_h)
            ref_l = prefill(trusted, prompt, tok_l)
            for s in range(n):
                get(f"attack_{name}_claimed_fp32", False).add(commit(st_l[s]), ref_l[s])
        # another model, another version, another prompt: the verifier's prefill of the claimed tokens
        tok_o, st_o = generate(other, prompt, n, length, seeds)
        ref_o = prefill(trusted, prompt, tok_o)
        for s in range(n):
            get("attack_other_init", False).add(commit(st_o[s]), ref_o[s])
        for lr, m in stepped.items():
            tok_s, st_s = generate(m, prompt, n, length, seeds)
            ref_s = prefill(trusted, prompt, tok_s)
            for s in range(n):
                get(f"attack_one_step_lr{lr:g}", False).add(commit(st_s[s]), ref_s[s])
        changed = prompt.clone()
        changed[3] = (changed[3] + 1) % 48
        tok_c, st_c = generate(trusted, changed, n, length, seeds)
        ref_c = prefill(trusted, prompt, tok_c)
        for s in range(n):
            get("attack_changed_prompt", False).add(commit(st_c[s]), ref_c[s])
    # commit and verify cost per chunk, next to the generation and the trusted prefill they accompany
    timings[tag] = {
        "generate_ms_per_chunk": round(1e3 * t_gen / n_chunks, 3),
        "commit_ms_per_chunk": round(1e3 * t_commit / n_chunks, 3),
        "prefill_ms_per_chunk": round(1e3 * t_prefill / n_chunks, 3),
        "verify_ms_per_chunk": round(1e3 * t_verify / n_chunks, 3),
        "commit_over_generate": round(t_commit / t_gen, 4),
        "verify_over_prefill": round(t_verify / t_prefill, 4),
    }
    return sc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a reduced run (well under a minute)")
    ap.add_argument("--groups", type=int, default=None, help="prompts per model config")
    ap.add_argument("--group-size", type=int, default=None, help="samples per prompt")
    ap.add_argument("--length", type=int, default=80, help="generated tokens per sample (80 = 2.5 chunks)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    groups = args.groups or (1 if args.quick else 8)
    n = args.group_size or (4 if args.quick else 16)
    synth_n = 3 if args.quick else 40

    t0 = time.perf_counter()
    timings: dict = {}
    scenarios = run_synthetic(synth_n, args.seed)
    for layers, hidden in ((2, 64), (4, 256)):
        scenarios.update(run_model(layers, hidden, groups, n, args.length, args.seed, timings))
    result = {
        "thresholds": {
            str(dt).removeprefix("torch."): vars(thresholds_for(dt))
            for dt in (torch.float32, torch.bfloat16, torch.float16)
        },
        "honest": {},
        "info": {},
        "attacks": {},
    }
    for name, s in scenarios.items():
        section = "info" if name.startswith("info_") else "honest" if s.honest else "attacks"
        result[section][name] = s.summary()
        print(f"{section:7s} {name:45s} {json.dumps(s.summary())}", file=sys.stderr)
    honest = [s for name, s in scenarios.items() if s.honest and not name.startswith("info_")]
    result["honest_samples"] = sum(s.samples for s in honest)
    result["false_rejections"] = sum(s.rejected for s in honest)
    result["detection"] = {k: v["detection"] for k, v in result["attacks"].items()}
    result["timings"] = timings
    result["proof_bytes_per_32_tokens"] = (
        len(commit(torch.randn(320, 64))) - len(commit(torch.zeros(0, 64)))
    ) / 10
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
