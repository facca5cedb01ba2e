"""End-to-end verification figures: real engine groups through the coordinator's verifier, honest and attacked.

    .venv/bin/python benchmarks/toploc.py [--quick] [--seed S]

Nodes are :class:`TorchEngine` instances (KV-cached, batched, seeded sampling, TOPLOC proofs built with
``commit_many``); the coordinator side is :class:`TrustedVerifier` (one padded prefill per group, then
TOPLOC → sampling → log-probs). Three Llama-architecture models with the project's character tokenizer:

* ``arith2x128``: the tiny-arith preset (2 layers x 128), warm-started on single-digit addition, so its
  distributions are as sharp as a real policy's; the previous version is one GRPO step back (this
  package's loss, AdamW, clip 1.0) on groups it sampled itself;
* ``llama2x64``: the test suite's random-init tiny model; ``llama4x256``: 4 layers x 256, random init;
  for these two the previous version is one AdamW step back on a supervised arithmetic batch.

Honest variation (none may be rejected): float32 and bfloat16 on both sides; a group generated alone,
inside a batch with other requests (left padding, other temperatures), or split over several batches
(small ``max_batch_tokens``); samples that stop early (right padding at the verifier); and the node in
another process running torch with 2 threads (the verifier always uses 1).

Attacks (each must be refused; ``detection`` is the refused share of attacked groups; ``caught_by``
says which stage refused them, ``caught_alone`` what each stage would have caught on its own):
another model; the previous version claimed as current (at two learning rates), plainly and with
proofs and log-probs recomputed on the current weights; bf16 and fp16 generation claimed as float32;
a changed prompt; fabricated tokens with honest evidence recomputed for them; cherry-picking the best
of 4 resamples; another temperature; negated, rescaled or halved activations; another sample's proof;
forged log-probs. The same attacks with a bfloat16 verifier are prefixed ``bf16:``.

Timing: ``commit_fraction`` is commit time over generation time in the engine, ``verify_fraction`` the
verifier's time (prefill and all checks, weights already loaded) over generation time, both summed over
the same in-process honest groups. Human lines go to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
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

from veriroll.coordinator.advantages import group_advantages
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.environments import load_environment
from veriroll.coordinator.intake import LeaseRecord, Submission, SubmittedSample
from veriroll.coordinator.loss import async_ppo_loss
from veriroll.coordinator.model_factory import (
    PRESETS,
    build_char_tokenizer,
    build_tiny_model,
    save_checkpoint,
    warm_start,
)
from veriroll.coordinator.policy import PolicyStore
from veriroll.coordinator.verifier import TrustedVerifier, prefill_group, resolve_dtype, tolerances_for
from veriroll.node.engines.base import GenerationRequest
from veriroll.node.engines.torch import TorchEngine
from veriroll.toploc import commit_many, verify_many
from veriroll.toploc.proof import HEADER_SIZE
from veriroll.toploc.sampling import perturbed_logits, token_logprobs, verify_samples

CHUNK = 32
ENV = load_environment("arithmetic", min_digits=1, max_digits=1)
TOK = build_char_tokenizer(ENV.alphabet)
V = len(TOK)
EOS = TOK.eos_token_id


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------
# Models and versions


def sft_step(model, lr: float, seed: int):
    """One AdamW step on a supervised batch of arithmetic text (``<bos> a+b=c <eos>``)."""
    from veriroll.coordinator.model_factory import _format_batch

    stepped = copy.deepcopy(model).train()
    ids, attention, labels = _format_batch(TOK, ENV.sample_prompts(random.Random(seed), 16))
    opt = torch.optim.AdamW(stepped.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    stepped(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
    torch.nn.utils.clip_grad_norm_(stepped.parameters(), 1.0)
    opt.step()
    return stepped.eval()


def grpo_step(model, lr: float, seed: int):
    """One on-policy GRPO step (async PPO loss, AdamW, clip 1.0) on 8 groups of 8 the model sampled."""
    rng = random.Random(seed)
    engine = TorchEngine.from_model(copy.deepcopy(model), 0)
    prompts = ENV.sample_prompts(rng, 8)
    reqs = [GenerationRequest(TOK(p.text).input_ids, [rng.getrandbits(64) for _ in range(8)], 1.0, 4, [EOS])
            for p in prompts]
    groups = engine.generate(reqs)
    rewards = torch.tensor([[ENV.reward(p, TOK.decode(s.token_ids, skip_special_tokens=True)) for s in g]
                            for p, g in zip(prompts, groups, strict=True)])
    adv, _ = group_advantages(rewards)
    rows = [(r.prompt_ids, s.token_ids, s.logprobs, float(a))
            for r, g, ad in zip(reqs, groups, adv, strict=True) for s, a in zip(g, ad, strict=True)]
    stepped = copy.deepcopy(model).train()
    width, t_max = max(len(p) + len(c) for p, c, _, _ in rows), max(len(c) for _, c, _, _ in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    behavior, response = torch.zeros(len(rows), t_max), torch.zeros(len(rows), t_max)
    for i, (p, c, lp, _) in enumerate(rows):
        ids[i, : len(p) + len(c)], mask[i, : len(p) + len(c)] = torch.tensor(p + c), 1
        behavior[i, : len(c)], response[i, : len(c)] = torch.tensor(lp), 1
    logp = torch.log_softmax(stepped(input_ids=ids, attention_mask=mask).logits.float(), -1)
    train = torch.nn.utils.rnn.pad_sequence(
        [logp[i, len(p) - 1 : len(p) - 1 + len(c)].gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
         for i, (p, c, _, _) in enumerate(rows)], batch_first=True)
    loss, _ = async_ppo_loss(train, behavior, torch.tensor([r[3] for r in rows]), response, torch.zeros(len(rows)))
    opt = torch.optim.AdamW(stepped.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(stepped.parameters(), 1.0)
    opt.step()
    return stepped.eval()


class Model:
    """One model family: current version 1 (``store``), previous versions one step back per learning
    rate (each in its own store as version 0, with version 1 = it + the step), and another init."""

    def __init__(self, root: Path, name: str, *, layers: int, hidden: int, warm: int, seed: int, lrs):
        self.name = name
        base = build_tiny_model(TOK, layers=layers, hidden=hidden, heads=4, seed=seed)
        if warm:
            preset = PRESETS["tiny-arith"]
            warm_start(base, TOK, ENV, steps=warm, batch_size=preset.warm_start_batch_size,
                       lr=preset.warm_start_lr, seed=seed)
        self.arith = bool(warm)
        self.stores: dict[float, PolicyStore] = {}
        for lr in lrs:
            store = PolicyStore(root / f"{name}-lr{lr:g}")
            step = grpo_step if warm else sft_step
            save_checkpoint(base, TOK, store.version_dir(0))
            save_checkpoint(step(base, lr, seed), TOK, store.version_dir(1))
            self.stores[lr] = store
        self.lr = max(lrs)
        self.store = self.stores[self.lr]  # the main store: honest traffic and most attacks use its v1
        self.other = root / f"{name}-other"
        save_checkpoint(build_tiny_model(TOK, layers=layers, hidden=hidden, heads=4, seed=seed + 1000), TOK, self.other)

    @property
    def current(self) -> Path:
        return self.store.version_dir(1)

    def prompt(self, rng: random.Random) -> list[int]:
        if self.arith:
            return TOK(ENV.sample_prompts(rng, 1)[0].text).input_ids
        return [TOK.bos_token_id] + [rng.randrange(4, V) for _ in range(rng.randint(6, 24))]


def lease(rng: random.Random, n: int, length: int, *, temperature: float = 1.0, stop=(), lease_id: str = "L"):
    return LeaseRecord(lease_id, "node", 0, n, temperature, length, tuple(rng.getrandbits(64) for _ in range(n)),
                       tuple(stop), 1, 0, 1 << 60, "open")


def request(le: LeaseRecord, prompt: list[int], **over) -> GenerationRequest:
    return GenerationRequest(prompt, list(over.get("seeds", le.seeds)), over.get("temperature", le.temperature),
                             le.max_new_tokens, list(le.stop_token_ids))


def to_submission(le: LeaseRecord, samples) -> Submission:
    return Submission(le.lease_id, 1, [
        SubmittedSample(np.asarray(s["token_ids"], dtype=np.int64), np.asarray(s["logprobs"], dtype=np.float32),
                        s["proof"], s["finish_reason"]) for s in samples])


def as_dicts(results) -> list[dict]:
    return [{"token_ids": list(r.token_ids), "logprobs": list(r.logprobs), "proof": r.proof,
             "finish_reason": r.finish_reason} for r in results]


# ------------------------------------------------------------------------------------------------
# The node in another process (torch with 2 threads)


def node_worker(spec_path: str, out_path: str) -> int:
    """Generate every request of the spec with ``torch.set_num_threads(2)``; save the samples."""
    spec = torch.load(spec_path, weights_only=False)
    out = []
    for job in spec:
        engine = TorchEngine(job["checkpoint"], 1, dtype=job["dtype"], threads=2)
        reqs = [GenerationRequest(**r) for r in job["requests"]]
        out.append([as_dicts(g) for g in engine.generate(reqs)])
    torch.save({"threads": torch.get_num_threads(), "groups": out}, out_path)
    return 0


def run_node_subprocess(jobs: list[dict]) -> tuple[list, int]:
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.pt", Path(tmp) / "out.pt"
        torch.save(jobs, spec)
        env = dict(os.environ, OMP_NUM_THREADS="2", MKL_NUM_THREADS="2")
        subprocess.run([sys.executable, __file__, "--node-worker", str(spec), str(out)], check=True, env=env)
        result = torch.load(out, weights_only=False)
    return result["groups"], result["threads"]


# ------------------------------------------------------------------------------------------------
# Statistics


class Tally:
    """Honest outcomes and the worst figures seen per trusted dtype (what the tolerances rest on)."""

    def __init__(self):
        self.samples = self.groups = self.false_rejections = 0
        self.rejections: list[str] = []
        self.gen_s = self.commit_s = self.verify_s = 0.0
        self.proof_bytes = self.proof_chunks = 0
        self.full_proofs: list[tuple[int, int]] = []
        self.worst: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.by_variant: Counter = Counter()

    def honest(self, verifier: TrustedVerifier, le: LeaseRecord, prompt, samples, variant: str) -> None:
        out = verifier.verify_group(le, prompt, to_submission(le, samples))
        self.groups += 1
        self.samples += len(samples)
        self.by_variant[variant] += len(samples)
        self.verify_s += out.seconds
        if out.rejection is not None:
            self.false_rejections += 1
            self.rejections.append(f"{variant}: {out.rejection}")
            log(f"FALSE REJECTION {variant}: {out.rejection}")
        for s in samples:
            t = len(s["token_ids"])
            if t % CHUNK == 0:
                self.full_proofs.append((len(s["proof"]), t))
        self._worst(verifier, le, prompt, samples, variant.rsplit("/", 1)[0])

    def _worst(self, verifier, le, prompt, samples, key: str) -> None:
        model = verifier.model_for(le.policy_version)
        trusted = prefill_group(model, prompt, [s["token_ids"] for s in samples])
        w = self.worst[key]
        verdicts = verify_many([s["proof"] for s in samples], trusted.hidden)
        for v, h in zip(verdicts, trusted.hidden, strict=True):
            for i, c in enumerate(v.chunks):
                k = min(128, min(CHUNK, h.shape[0] - i * CHUNK) * h.shape[1])
                w["toploc_exp_mismatch_frac"] = max(w["toploc_exp_mismatch_frac"], c.exp_mismatches / k)
                w["toploc_mant_err_mean"] = max(w["toploc_mant_err_mean"], c.mant_err_mean)
                w["toploc_sign_mismatch_frac"] = max(w["toploc_sign_mismatch_frac"], c.sign_mismatches / k)
        tol = verifier.tolerances
        for s, seed, logits in zip(samples, le.seeds, trusted.logits, strict=True):
            tokens = torch.tensor(s["token_ids"])
            pos = torch.arange(len(tokens))
            z = perturbed_logits(logits, le.temperature, seed_bits(seed), pos)
            flipped = z.argmax(-1) != tokens
            if bool(flipped.any()):
                margin = (z.max(-1).values - z.gather(-1, tokens[:, None]).squeeze(-1)) * le.temperature
                slack = torch.as_tensor(tol.margin_for(logits)).expand(len(tokens))
                w["replay_flips"] += int(flipped.sum())
                w["max_flip_margin"] = max(w["max_flip_margin"], float(margin[flipped].max()))
                w["max_flip_margin_over_slack"] = max(w["max_flip_margin_over_slack"],
                                                      float((margin / slack)[flipped].max()))
            w["max_abs_logit"] = max(w["max_abs_logit"], float(logits.float().abs().max()))
            diff = (torch.tensor(s["logprobs"]) - token_logprobs(logits, tokens, le.temperature)).abs()
            allowed = torch.as_tensor(tol.logprob_for(logits, le.temperature)).expand(len(tokens))
            w["max_logprob_diff"] = max(w["max_logprob_diff"], float(diff.max()))
            w["max_logprob_diff_over_tolerance"] = max(w["max_logprob_diff_over_tolerance"], float((diff / allowed).max()))
            w["tokens"] += len(tokens)


def seed_bits(seed: int) -> int:
    return seed - (1 << 64) if seed >= (1 << 63) else seed


def stages_alone(verifier: TrustedVerifier, le: LeaseRecord, prompt, samples) -> dict[str, bool]:
    """Whether each stage, run on its own, would refuse the group."""
    model = verifier.model_for(le.policy_version)
    trusted = prefill_group(model, prompt, [s["token_ids"] for s in samples])
    tol = verifier.tolerances
    toploc = not all(v.ok for v in verify_many([s["proof"] for s in samples], trusted.hidden))
    logits = torch.cat(trusted.logits)
    tokens = torch.tensor([t for s in samples for t in s["token_ids"]])
    seeds = torch.tensor([seed_bits(seed) for s, seed in zip(samples, le.seeds, strict=True) for _ in s["token_ids"]])
    pos = torch.tensor([i for s in samples for i in range(len(s["token_ids"]))])
    sampling = not verify_samples(logits, tokens, le.temperature, seeds, pos, margin_tolerance=tol.margin_for(logits)).ok
    claimed = torch.tensor([x for s in samples for x in s["logprobs"]])
    excess = (claimed - token_logprobs(logits, tokens, le.temperature)).abs() - tol.logprob_for(logits, le.temperature)
    return {"toploc": toploc, "sampling": sampling, "logprob": not float(excess.max()) <= 0}


# ------------------------------------------------------------------------------------------------
# Attacks: (lease, prompt) -> the samples a cheating node submits


def reproved(model, prompt, token_lists, temperature) -> list[dict]:
    """Honest-looking evidence for tokens the attacker chose: a teacher-forced forward on the model."""
    trusted = prefill_group(model, prompt, token_lists)
    proofs = commit_many(trusted.hidden)
    return [{"token_ids": list(t), "logprobs": token_logprobs(lg, torch.tensor(t), temperature).tolist(),
             "proof": p, "finish_reason": "length"} for t, lg, p in zip(token_lists, trusted.logits, proofs, strict=True)]


class Attacker:
    def __init__(self, m: Model, dtype: str):
        self.m, self.dtype = m, dtype
        self.honest = TorchEngine(m.current, 1, dtype=dtype)
        self.previous = {lr: TorchEngine(s.version_dir(0), 0, dtype=dtype) for lr, s in m.stores.items()}
        self.other = TorchEngine(m.other, 1, dtype=dtype)
        self.low = {d: TorchEngine(m.current, 1, dtype=d) for d in ("bfloat16", "float16")} if dtype == "float32" else {}

    def attacks(self) -> dict:
        out = {"other_model": lambda le, p: as_dicts(self.other.generate([request(le, p)])[0])}
        for lr in self.previous:
            out[f"previous_version_lr{lr:g}"] = lambda le, p, lr=lr: as_dicts(self.previous[lr].generate([request(le, p)])[0])
        out["previous_version_reproved"] = self.previous_reproved
        for d, eng in self.low.items():
            out[f"{'bf16' if d == 'bfloat16' else 'fp16'}_claimed_fp32"] = \
                lambda le, p, eng=eng: as_dicts(eng.generate([request(le, p)])[0])
        out.update(changed_prompt=self.changed_prompt, fabricated=self.fabricated, cherry_picked=self.cherry_picked,
                   other_temperature=self.other_temperature, negated=self.transform(lambda h: -h),
                   rescaled_1_05=self.transform(lambda h: h * 1.05), rescaled_0_5=self.transform(lambda h: h * 0.5),
                   copied_proof=self.copied_proof, forged_logprobs=self.forged_logprobs)
        return out

    def honest_group(self, le, p, keep_hidden=False):
        return self.honest.generate([request(le, p)], keep_hidden=keep_hidden)[0]

    def previous_reproved(self, le, p):
        tokens = [s.token_ids for s in self.previous[self.m.lr].generate([request(le, p)])[0]]
        if tokens == [s.token_ids for s in self.honest_group(le, p)]:
            return None  # the same tokens the current version draws: no attack to catch
        return reproved(self.honest.model, p, tokens, le.temperature)

    def changed_prompt(self, le, p):
        changed = list(p)
        i = 1 if self.m.arith else len(p) // 2  # arithmetic: the first operand's digit
        changed[i] = 4 + (changed[i] - 4 + 1) % (V - 4)
        return as_dicts(self.honest.generate([request(le, changed)])[0])

    def fabricated(self, le, p):
        rng = random.Random(le.seeds[0])
        tokens = [[rng.randrange(4, V) for _ in range(le.max_new_tokens)] for _ in range(le.group_size)]
        return reproved(self.honest.model, p, tokens, le.temperature)

    def cherry_picked(self, le, p, k: int = 4):
        """Per sample, the best (highest total log-prob) of k resamples with seeds of the node's own
        choosing that differs from the assigned draw, submitted under the assigned seed."""
        rng = random.Random(le.seeds[0])
        assigned = self.honest_group(le, p)
        tries = self.honest.generate([request(le, p, seeds=[rng.getrandbits(64) for _ in range(k * le.group_size)])])[0]
        out = []
        for i, s in enumerate(assigned):
            mine = [t for t in tries[i * k : (i + 1) * k] if t.token_ids != s.token_ids] or [s]
            out.append(max(mine, key=lambda t: sum(t.logprobs)))
        if [s.token_ids for s in out] == [s.token_ids for s in assigned]:
            return None  # every resample equalled the assigned draw: nothing was picked
        return as_dicts(out)

    def other_temperature(self, le, p):
        """Sampled at 0.6 x the lease temperature; log-probs reported at the lease's (consistent forgery)."""
        samples = self.honest.generate([request(le, p, temperature=le.temperature * 0.6)])[0]
        fixed = reproved(self.honest.model, p, [s.token_ids for s in samples], le.temperature)
        return [dict(f, proof=s.proof) for s, f in zip(samples, fixed, strict=True)]

    def transform(self, fn):
        def attack(le, p):
            samples = self.honest_group(le, p, keep_hidden=True)
            proofs = commit_many([fn(s.hidden) for s in samples])
            return [dict(d, proof=q) for d, q in zip(as_dicts(samples), proofs, strict=True)]

        return attack

    def copied_proof(self, le, p):
        samples = as_dicts(self.honest_group(le, p))
        return [dict(s, proof=samples[(i + 1) % len(samples)]["proof"]) for i, s in enumerate(samples)]

    def forged_logprobs(self, le, p):
        """Behaviour log-probs lowered by 0.5 on one token per sample (inflated importance weights)."""
        samples = as_dicts(self.honest_group(le, p))
        for s in samples:
            s["logprobs"][len(s["logprobs"]) // 2] -= 0.5
        return samples


# ------------------------------------------------------------------------------------------------


SETTINGS = {
    # models (name, layers, hidden, warm-start steps), honest groups per variant, samples, tokens,
    # attacked groups per attack and model, learning rates of the previous version, 2-thread node jobs
    "quick": dict(models=[("llama2x64", 2, 64, 0), ("llama4x256", 4, 256, 0)],
                  per_variant=1, n=8, length=32, attack_models=("llama2x64",), attack_groups=1, lrs=(3e-4,),
                  node_jobs=(("llama2x64", "float32"),)),
    "full": dict(models=[("arith2x128", 2, 128, PRESETS["tiny-arith"].warm_start_steps), ("llama2x64", 2, 64, 0),
                         ("llama4x256", 4, 256, 0)],
                 per_variant=3, n=16, length=64, attack_models=("arith2x128", "llama2x64", "llama4x256"),
                 attack_groups=3, lrs=(1e-5, 1e-4, 3e-4),
                 node_jobs=tuple((m, d) for m in ("arith2x128", "llama2x64", "llama4x256") for d in ("float32", "bfloat16"))),
}
TARGET_LR = 1e-4  # "one step at a realistic RL learning rate": lower ones are reported as informational


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a reduced run (under a minute)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--node-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.node_worker:
        return node_worker(*args.node_worker)
    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg_run = SETTINGS["quick" if args.quick else "full"]
    n, length = cfg_run["n"], cfg_run["length"]
    rng = random.Random(args.seed)
    tmp = tempfile.TemporaryDirectory(prefix="veriroll-toploc-bench-")
    root = Path(tmp.name)

    t0 = time.perf_counter()
    models = [Model(root, name, layers=layers, hidden=hidden, warm=warm, seed=args.seed, lrs=cfg_run["lrs"])
              for name, layers, hidden, warm in cfg_run["models"]]
    log(f"models and versions built in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()

    def verifier_for(store: PolicyStore, dtype: str) -> TrustedVerifier:
        cfg = CoordinatorConfig()
        cfg.model_dtype = dtype
        return TrustedVerifier(store, cfg)

    tally = Tally()
    timing: dict[str, Counter] = defaultdict(Counter)
    sub_jobs, sub_meta = [], []
    for m in models:
        for dtype in ("float32", "bfloat16"):
            verifier = verifier_for(m.store, dtype)
            verifier.model_for(1)  # weights loaded up front: the timing is the verification itself
            engine = TorchEngine(m.current, 1, dtype=dtype)
            split = TorchEngine(m.current, 1, dtype=dtype, max_batch_tokens=n * (length + 24) // 3)

            def group(m=m):
                stop = (EOS,) if rng.random() < 0.5 else ()  # stopped samples: right padding at the verifier
                return lease(rng, n, length, temperature=rng.choice((0.7, 1.0, 1.3)), stop=stop), m.prompt(rng)

            for _ in range(cfg_run["per_variant"]):
                for variant, eng, extra in (("alone", engine, 0), ("mixed_batch", engine, 2), ("split_batches", split, 0)):
                    groups = [group() for _ in range(1 + extra)]
                    results = eng.generate([request(le, p) for le, p in groups])
                    st = eng.last_stats
                    key = f"{m.name}/{dtype}"
                    before = tally.verify_s
                    for (le, p), res in zip(groups, results, strict=True):
                        tally.honest(verifier, le, p, as_dicts(res), f"{key}/{variant}")
                    tally.gen_s += st.total_s
                    tally.commit_s += st.commit_s
                    timing[key].update(gen_s=st.total_s, commit_s=st.commit_s, verify_s=tally.verify_s - before,
                                       tokens=st.tokens)
            if (m.name, dtype) in cfg_run["node_jobs"]:
                groups = [group() for _ in range(2)]
                sub_jobs.append({"checkpoint": str(m.current), "dtype": dtype,
                                 "requests": [vars(request(le, p)) for le, p in groups]})
                sub_meta.append((m, dtype, groups))
            log(f"honest {m.name} {dtype}: {tally.samples} samples so far, {tally.false_rejections} rejected")

    log(f"honest in-process groups: {time.perf_counter() - t0:.1f}s")
    # the node side with 2 threads, in its own process; the verifier keeps 1
    t0 = time.perf_counter()
    sub_groups, sub_threads = run_node_subprocess(sub_jobs)
    log(f"2-thread node process: {len(sub_jobs)} jobs in {time.perf_counter() - t0:.1f}s (torch threads {sub_threads})")
    for (m, dtype, groups), results in zip(sub_meta, sub_groups, strict=True):
        verifier = verifier_for(m.store, dtype)
        for (le, p), res in zip(groups, results, strict=True):
            tally.honest(verifier, le, p, res, f"{m.name}/{dtype}/node_2_threads")

    # attacks
    t0 = time.perf_counter()
    detection: dict[str, list[bool]] = defaultdict(list)
    caught_by: dict[str, Counter] = defaultdict(Counter)
    alone: dict[str, Counter] = defaultdict(Counter)
    examples: dict[str, str] = {}
    for m in models:
        if m.name not in cfg_run["attack_models"]:
            continue
        for dtype in ("float32", "bfloat16"):
            verifiers = {lr: verifier_for(s, dtype) for lr, s in m.stores.items()}
            attacker = Attacker(m, dtype)
            prefix = "" if dtype == "float32" else "bf16:"
            for name, attack in attacker.attacks().items():
                lr = float(name.rsplit("lr", 1)[1]) if name.startswith("previous_version_lr") else m.lr
                verifier = verifiers[lr]
                for _ in range(cfg_run["attack_groups"]):
                    le, p = lease(rng, n, length, stop=()), m.prompt(rng)
                    samples = attack(le, p)
                    if samples is None:
                        continue
                    rejection = verifier.verify_group(le, p, to_submission(le, samples)).rejection
                    key = prefix + name
                    detection[key].append(rejection is not None)
                    caught_by[key][rejection.reason.value if rejection else "accepted"] += 1
                    if rejection is not None and key not in examples:
                        examples[key] = str(rejection)[:160]
                    for stage, hit in stages_alone(verifier, le, p, samples).items():
                        alone[key][stage] += int(hit)
                    alone[key]["groups"] += 1
            log(f"attacks on {m.name} with a {dtype} verifier done")

    log(f"attacks: {time.perf_counter() - t0:.1f}s")

    def rate(v):
        return round(sum(v) / len(v), 4)

    below = {k for k in detection if "_lr" in k and float(k.rsplit("lr", 1)[1]) < TARGET_LR}
    full = tally.full_proofs
    per_chunk = sum((b - HEADER_SIZE) / (t // CHUNK) for b, t in full) / max(len(full), 1)
    with_header = sum(b / (t // CHUNK) for b, t in full) / max(len(full), 1)
    result = {
        "proof_bytes_per_32_tokens": round(per_chunk, 2),
        "commit_fraction": round(tally.commit_s / tally.gen_s, 4),
        "verify_fraction": round(tally.verify_s / tally.gen_s, 4),
        "honest_samples": tally.samples,
        "false_rejections": tally.false_rejections,
        "detection": {k: rate(v) for k, v in detection.items() if k not in below},
        # supporting figures
        "detection_below_target_lr": {k: rate(detection[k]) for k in sorted(below)},
        "proof_bytes_per_32_tokens_with_header": round(with_header, 2),
        "verify_fraction_by_dtype": {dt: round(sum(c["verify_s"] for k, c in timing.items() if k.endswith(dt))
                                               / sum(c["gen_s"] for k, c in timing.items() if k.endswith(dt)), 4)
                                     for dt in ("float32", "bfloat16")},
        "commit_fraction_by_dtype": {dt: round(sum(c["commit_s"] for k, c in timing.items() if k.endswith(dt))
                                               / sum(c["gen_s"] for k, c in timing.items() if k.endswith(dt)), 4)
                                     for dt in ("float32", "bfloat16")},
        "fractions_by_model": {k: {"commit": round(c["commit_s"] / c["gen_s"], 4),
                                   "verify": round(c["verify_s"] / c["gen_s"], 4),
                                   "tokens_per_s": round(c["tokens"] / c["gen_s"], 1)} for k, c in timing.items()},
        "honest_groups": tally.groups,
        "honest_samples_by_variant": dict(tally.by_variant),
        "false_rejection_details": tally.rejections[:10],
        "honest_worst": {k: {s: round(v, 6) for s, v in w.items()} for k, w in tally.worst.items()},
        "tolerances": {dt: {k: (v if math.isfinite(v) else None)
                            for k, v in vars(tolerances_for(resolve_dtype(dt),
                                                             CoordinatorConfig().intake.logprob_tolerance)).items()}
                       for dt in ("float32", "bfloat16")},
        "attack_groups": {k: len(v) for k, v in detection.items()},
        "caught_by": {k: dict(v) for k, v in caught_by.items()},
        "caught_alone": {k: {s: round(c / v["groups"], 3) for s, c in v.items() if s != "groups"}
                         for k, v in alone.items()},
        "examples": examples,
        "node_subprocess_threads": sub_threads,
        "generation_s": round(tally.gen_s, 2),
        "commit_s": round(tally.commit_s, 3),
        "verify_s": round(tally.verify_s, 2),
        "quick": bool(args.quick),
        "seconds": round(time.perf_counter() - started, 1),
    }
    for k in ("fractions_by_model", "honest_worst", "caught_by", "caught_alone", "detection_below_target_lr"):
        log(k, json.dumps(result[k]))
    tmp.cleanup()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
