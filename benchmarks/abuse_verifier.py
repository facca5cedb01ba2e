"""What garbage from many fresh keys costs the trusted verifier, before and after the quick stage and the
verifier budget.

    .venv/bin/python benchmarks/abuse_verifier.py [--quick] [--keys N] [--groups G] [--seed S]

The attack of issue 12: ``N`` fresh keys (default 100) from one address each submit ``G`` groups (default
2) within one minute, whose tokens, log-probs and proofs are random but pass every check that needs no
model (proofs with the right header, length and field ranges: the attacker's best garbage). Each group
goes straight to the real :class:`TrustedVerifier` and :class:`VerifierBudget` (the lead wires them into
the service); arrivals are spread evenly over a simulated minute, which is the budget's clock, while
the verifier runs for real and its measured seconds are what the budget is charged.

* **before**: no quick stage (``intake.quick_check_samples = 0``), no budget: every group is prefilled whole.
* **after**: the defaults, a quick stage on one random sample's first TOPLOC chunk and the budget of
  ``IntakeConfig`` (seconds per minute per key, address and /24).

Also measured: proofs of random bytes (refused before any forward pass), a flood from one address
against a small budget (the cap holds: at most the allowance plus one minute's burst plus one group),
and an honest node at another address throughout, whose groups must all pass (zero false rejections)
and whose verification time shows what the quick stage adds to honest work.

Model: the tiny-arith demo preset (2 layers x 128, warm-started), leases of ``LeaseConfig``'s defaults.
Without ``--quick``, and when the cache holds it (``coordinator.models.cached_builtin_model``),
SmolLM2-135M-Instruct too, on chat-rendered prompts and groups of 8 x 64 tokens: its per-group costs are
measured on a few groups, honest ones checked with every sample's first chunk, and the attack minute
is replayed through the budget with those measured costs (200 full prefills of it would take minutes).

Human lines go to stderr; the last line on stdout is one JSON object.
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

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.intake import LeaseRecord, Submission, SubmittedSample
from veriroll.coordinator.policy import PolicyStore
from veriroll.coordinator.verifier import Stage, TrustedVerifier
from veriroll.coordinator.verify_budget import VerifierBudget
from veriroll.node.engines.base import GenerationRequest
from veriroll.node.engines.torch import TorchEngine
from veriroll.toploc.proof import _HEADER, DTYPE_BF16, FORMAT_VERSION, MAGIC, P

CHUNK, TOPK = 32, 128
ATTACKER, HONEST = "203.0.113.9", "198.51.100.20"  # the honest node sits in another /24


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class SimClock:
    """The budget's clock: the attack minute, advanced by arrivals rather than by the verifier's work."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ForwardCounter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1


def layout_valid_proof(rng: np.random.Generator, t: int, hidden: int) -> bytes:
    """Random polynomials under a correct header: passes ``toploc.check_layout``, says nothing true."""
    body = b"".join(np.array([rng.integers(TOPK, P + 1), *rng.integers(0, P, TOPK)], dtype=">u2").tobytes()
                    for _ in range(0, t, CHUNK))
    return _HEADER.pack(MAGIC, FORMAT_VERSION, DTYPE_BF16, CHUNK, TOPK, t, hidden) + body


def garbage_group(rng: np.random.Generator, lease: LeaseRecord, vocab: int, hidden: int, *,
                  random_bytes: bool = False) -> Submission:
    """Full-length samples without stop tokens (so ``length`` is the right finish), random everything."""
    t, stops = lease.max_new_tokens, np.asarray(lease.stop_token_ids, dtype=np.int64)
    samples = []
    for _ in range(lease.group_size):
        tokens = rng.integers(0, vocab, t)
        tokens[np.isin(tokens, stops)] = int(np.setdiff1d(np.arange(vocab), stops)[0])
        proof = rng.bytes(len(layout_valid_proof(rng, t, hidden))) if random_bytes else layout_valid_proof(rng, t, hidden)
        samples.append(SubmittedSample(tokens, -rng.random(t).astype(np.float32), proof, "length"))
    return Submission(lease.lease_id, lease.policy_version, samples)


def make_lease(rng: random.Random, lease_id: str, group_size: int, max_new_tokens: int, stop: list[int]) -> LeaseRecord:
    return LeaseRecord(lease_id, "n", 0, group_size, 1.0, max_new_tokens, tuple(rng.getrandbits(64) for _ in range(group_size)),
                       tuple(stop), 0, 0, 1 << 60, "open")


def honest_group(engine: TorchEngine, lease: LeaseRecord, prompt: list[int]) -> Submission:
    req = GenerationRequest(prompt, list(lease.seeds), lease.temperature, lease.max_new_tokens, list(lease.stop_token_ids))
    results = engine.generate([req])[0]
    return Submission(lease.lease_id, lease.policy_version, [
        SubmittedSample(np.asarray(r.token_ids, dtype=np.int64), np.asarray(r.logprobs, dtype=np.float32), r.proof,
                        r.finish_reason) for r in results])


def verifier_for(store: PolicyStore, *, quick_samples: int, seed: int) -> TrustedVerifier:
    cfg = CoordinatorConfig()
    cfg.intake.s_max = 0
    cfg.intake.quick_check_samples = quick_samples
    verifier = TrustedVerifier(store, cfg, rng=random.Random(seed))
    verifier.model_for(0)  # weights loaded up front: the timing is verification only
    return verifier


def attack_minute(verifier: TrustedVerifier, budget: VerifierBudget | None, clock: SimClock, arrivals: list[tuple]) -> dict:
    """Run ``arrivals`` (``(node_id, address, lease, prompt, submission, honest)``, in order, evenly over
    one simulated minute) through the budget and the verifier; what the attacker's groups cost (verifier
    seconds, forward passes of the trusted model) and how the honest node fared."""
    counter = ForwardCounter(verifier.model_for(0))
    out = {"verifier_s": 0.0, "full_prefills": 0, "quick_prefills": 0, "refused_by_budget": 0, "refused_before_prefill": 0,
           "accepted": 0, "forward_passes": 0, "honest": 0, "honest_accepted": 0, "honest_s": 0.0}
    for j, (node_id, address, lease, prompt, sub, honest) in enumerate(arrivals):
        clock.now = 60.0 * j / len(arrivals)
        refused = budget.reserve(node_id, address) if budget is not None else None
        calls = counter.calls
        if refused is None:
            result = verifier.verify_group(lease, prompt, sub)
            if budget is not None:
                budget.charge(node_id, address, result.seconds)
        if honest:
            out["honest"] += 1
            if refused is None and result.rejection is None:
                out["honest_accepted"] += 1
                out["honest_s"] += result.seconds
            else:
                log(f"  honest group refused: {refused or result.rejection}")
            continue
        if refused is not None:
            out["refused_by_budget"] += 1
            continue
        out["forward_passes"] += counter.calls - calls
        out["verifier_s"] += result.seconds
        out["accepted"] += result.rejection is None
        out["full_prefills"] += result.stage is Stage.FULL
        out["quick_prefills"] += result.quick_seconds > 0
        out["refused_before_prefill"] += result.stage is Stage.CHECKS
    return out


def tiny_demo(root: Path, keys: int, groups: int, seed: int) -> dict:
    from veriroll.coordinator.environments import load_environment
    from veriroll.coordinator.model_factory import PRESETS, build_char_tokenizer, create_preset_checkpoint

    store = PolicyStore(root / "tiny")
    t0 = time.perf_counter()
    create_preset_checkpoint("tiny-arith", store.version_dir(0), seed=seed)
    preset = PRESETS["tiny-arith"]
    env = load_environment(preset.env, **preset.env_kwargs)
    tok = build_char_tokenizer(env.alphabet)
    log(f"tiny-arith built in {time.perf_counter() - t0:.1f}s")
    leases_cfg = CoordinatorConfig().leases
    n, t, stop = leases_cfg.group_size, leases_cfg.max_new_tokens, [tok.eos_token_id]
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    engine = TorchEngine(store.version_dir(0), 0)
    vocab, hidden = (int(x) for x in engine.model.get_output_embeddings().weight.shape)

    def prompt() -> list[int]:
        return tok(env.sample_prompts(rng, 1)[0].text).input_ids

    # The attack, interleaved with an honest node at another address (one honest group per 20 arrivals).
    arrivals = []
    for g in range(groups):
        for k in range(keys):
            lease = make_lease(rng, f"a{k}-{g}", n, t, stop)
            arrivals.append((f"attacker-{k}", ATTACKER, lease, prompt(), garbage_group(nrng, lease, vocab, hidden), False))
            if len(arrivals) % 20 == 0:
                lease = make_lease(rng, f"h{len(arrivals)}", n, t, stop)
                p = prompt()
                arrivals.append(("honest", HONEST, lease, p, honest_group(engine, lease, p), True))
    before = attack_minute(verifier_for(store, quick_samples=0, seed=seed), None, SimClock(), arrivals)
    clock = SimClock()
    after = attack_minute(verifier_for(store, quick_samples=1, seed=seed),
                          VerifierBudget.from_config(CoordinatorConfig().intake, clock=clock), clock, arrivals)

    # Proofs of random bytes: refused by check_layout, no forward pass.
    noise = []
    for k in range(20):
        lease = make_lease(rng, f"r{k}", n, t, stop)
        noise.append((f"noise-{k}", ATTACKER, lease, prompt(), garbage_group(nrng, lease, vocab, hidden, random_bytes=True),
                      False))
    bytes_run = attack_minute(verifier_for(store, quick_samples=1, seed=seed), None, SimClock(), noise)

    # A flood against a small per-address allowance: the cap holds with real verifications.
    allowance = 0.5
    flood = []
    for k in range(1500):
        lease = make_lease(rng, f"f{k}", n, t, stop)
        flood.append((f"flood-{k}", ATTACKER, lease, prompt(), garbage_group(nrng, lease, vocab, hidden), False))
    clock = SimClock()
    flood_run = attack_minute(verifier_for(store, quick_samples=1, seed=seed),
                              VerifierBudget(0.0, allowance, 0.0, clock=clock), clock, flood)
    return {
        "model": "tiny-arith", "group": f"{n}x{t}", "before": before, "after": after,
        "random_bytes": {"groups": len(noise), "forward_passes": bytes_run["forward_passes"],
                         "refused_before_prefill": bytes_run["refused_before_prefill"]},
        "flood": {"allowance_s_per_min": allowance, "groups": len(flood), "verifier_s": round(flood_run["verifier_s"], 4),
                  "verified": len(flood) - flood_run["refused_by_budget"], "refused_by_budget": flood_run["refused_by_budget"]},
    }


def smollm2(root: Path, keys: int, groups: int, seed: int) -> dict:
    """Per-group costs on a real model, honest groups with every sample's first chunk checked, and the
    attack minute replayed through the budget with those costs."""
    from transformers import AutoTokenizer

    from veriroll.coordinator.models import cached_builtin_model, stop_token_ids

    path = cached_builtin_model()
    store = PolicyStore(root / "smol")
    store.versions_dir.mkdir(parents=True)
    store.version_dir(0).symlink_to(path, target_is_directory=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    stop = stop_token_ids(path)
    n, t = 8, 64
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    questions = ["What is 17 times 23? Explain briefly.", "A train travels 60 km in 45 minutes. What is its speed in km/h?",
                 "If 3x + 5 = 20, what is x?", "What is the sum of the first ten odd numbers?"]

    def prompt(i: int) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False)

    engine = TorchEngine(store.version_dir(0), 0)
    vocab, hidden = (int(x) for x in engine.model.get_output_embeddings().weight.shape)
    plain, quick = verifier_for(store, quick_samples=0, seed=seed), verifier_for(store, quick_samples=1, seed=seed)
    every = verifier_for(store, quick_samples=n, seed=seed)
    full_s, quick_s = [], []
    for i in range(6):
        lease = make_lease(rng, f"g{i}", n, t, stop)
        sub = garbage_group(nrng, lease, vocab, hidden)
        if i < 2:
            r = plain.verify_group(lease, prompt(i), sub)
            assert r.rejection is not None and r.stage is Stage.FULL
            full_s.append(r.seconds)
        r = quick.verify_group(lease, prompt(i), sub)
        assert r.rejection is not None and r.stage is Stage.QUICK, r
        quick_s.append(r.seconds)
    honest = []
    for i in range(2):
        lease = make_lease(rng, f"h{i}", n, t, stop)
        sub = honest_group(engine, lease, prompt(i))
        with_quick, without = every.verify_group(lease, prompt(i), sub), plain.verify_group(lease, prompt(i), sub)
        default = quick.verify_group(lease, prompt(i), sub)
        ok = with_quick.rejection is None and without.rejection is None and default.rejection is None
        honest.append((ok, with_quick.seconds, without.seconds, with_quick.quick_seconds, len(sub.samples), default.seconds))
        if not ok:
            log(f"  SmolLM2 honest group refused: {with_quick.rejection or without.rejection or default.rejection}")
    full_mean, quick_mean = float(np.mean(full_s)), float(np.mean(quick_s))
    clock = SimClock()
    budget = VerifierBudget.from_config(CoordinatorConfig().intake, clock=clock)
    attacks, after = keys * groups, 0.0
    for j in range(attacks):
        clock.now = 60.0 * j / attacks
        if budget.reserve(f"attacker-{j % keys}", ATTACKER) is None:
            budget.charge(f"attacker-{j % keys}", ATTACKER, quick_mean)
            after += quick_mean
    return {
        "model": "SmolLM2-135M-Instruct", "group": f"{n}x{t}", "prompt_tokens": len(prompt(0)),
        "garbage_full_s": round(full_mean, 4), "garbage_quick_s": round(quick_mean, 4),
        "burned_per_attacker_minute_before": round(attacks * full_mean, 2),
        "burned_per_attacker_minute_after": round(after, 2),
        "honest_groups": len(honest), "honest_accepted": sum(ok for ok, *_ in honest),
        "honest_verify_s_every_first_chunk_checked": round(float(np.mean([h[1] for h in honest])), 4),
        "honest_verify_s_without_quick": round(float(np.mean([h[2] for h in honest])), 4),
        "honest_verify_s_default_quick": round(float(np.mean([h[5] for h in honest])), 4),
        "honest_quick_s_every_first_chunk": round(float(np.mean([h[3] for h in honest])), 4),
        "honest_samples_first_chunk_quick_checked": sum(h[4] for h in honest if h[3] > 0),
    }


def verifier_burn(quick: bool = True, *, keys: int = 100, groups: int = 2, seed: int = 0) -> dict:
    """Verifier seconds burned by ``keys`` fresh keys sending ``groups`` garbage groups each within a
    minute, before and after the quick stage and the budget, plus the side figures (see the module)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="veriroll-abuse-verifier-") as tmp:
        tiny = tiny_demo(Path(tmp), keys, groups, seed)
        real = None if quick else smollm2(Path(tmp), keys, groups, seed)
    before, after = tiny["before"]["verifier_s"], tiny["after"]["verifier_s"]
    honest_before = tiny["before"]["honest_s"] / max(tiny["before"]["honest_accepted"], 1)
    honest_after = tiny["after"]["honest_s"] / max(tiny["after"]["honest_accepted"], 1)
    return {
        "verifier_seconds_burned_per_attacker_minute": round(after, 4),
        "verifier_seconds_burned_per_attacker_minute_before": round(before, 4),
        "ratio": round(after / before, 4) if before else None,
        "attack": {"keys": keys, "groups_per_key": groups, "addresses": 1, "model": tiny["model"], "group": tiny["group"]},
        "full_prefills_before": tiny["before"]["full_prefills"], "full_prefills_after": tiny["after"]["full_prefills"],
        "quick_prefills_after": tiny["after"]["quick_prefills"],
        "refused_by_budget_after": tiny["after"]["refused_by_budget"],
        "forward_passes_before": tiny["before"]["forward_passes"], "forward_passes_after": tiny["after"]["forward_passes"],
        "honest_groups": tiny["after"]["honest"], "honest_accepted_before": tiny["before"]["honest_accepted"],
        "honest_accepted_after": tiny["after"]["honest_accepted"],
        "honest_verify_ms_before": round(1000 * honest_before, 3), "honest_verify_ms_after": round(1000 * honest_after, 3),
        "random_bytes": tiny["random_bytes"], "flood": tiny["flood"],
        "smollm2": real if real is not None else "skipped (--quick)",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the tiny demo model only (about a minute)")
    ap.add_argument("--keys", type=int, default=100, help="fresh attacker keys")
    ap.add_argument("--groups", type=int, default=2, help="garbage groups per key")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    figures = verifier_burn(args.quick, keys=args.keys, groups=args.groups, seed=args.seed)
    log(f"attack: {args.keys} keys x {args.groups} garbage groups from one address, {figures['attack']['group']} "
        f"on {figures['attack']['model']}")
    log(f"  before: {figures['verifier_seconds_burned_per_attacker_minute_before']:.3f} verifier s, "
        f"{figures['full_prefills_before']} full prefills")
    log(f"  after:  {figures['verifier_seconds_burned_per_attacker_minute']:.3f} verifier s, "
        f"{figures['full_prefills_after']} full prefills, {figures['quick_prefills_after']} quick ones, "
        f"{figures['refused_by_budget_after']} refused by the budget (ratio {figures['ratio']})")
    log(f"  honest node: {figures['honest_accepted_after']}/{figures['honest_groups']} accepted "
        f"({figures['honest_verify_ms_before']:.2f} ms -> {figures['honest_verify_ms_after']:.2f} ms per group)")
    log(f"  random-byte proofs: {figures['random_bytes']}; flood: {figures['flood']}")
    log(f"  SmolLM2: {figures['smollm2']}")
    log(f"done in {time.perf_counter() - started:.0f}s")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
