"""Asynchronous vs synchronous RL on one generator core and one trainer core, heavy-tailed completions.

The workload: single-digit addition where a fraction of the prompts (``--long-frac``, marked ``a+b#``
instead of ``a+b=``) ask for the sum followed by ``--dots`` dots, which version 0 learned in its warm
start: most completions are 2-3 tokens, a few are 10-20x longer (the lengths actually sampled are
measured and reported). The reward is exact match of the sum, dots stripped.

Two processes, one torch thread each, share a store (SQLite) and a policy-version directory exactly as
the coordinator's parts do:

- the **generator** runs the real node engine (``TorchEngine``: batched, KV-cached, seeded sampling,
  TOPLOC commitments) on the newest policy version, ``--chunk`` groups per call, and writes accepted
  groups (with rewards) into the store;
- the **trainer** is the coordinator's :class:`~veriroll.coordinator.trainer.Trainer` (selection,
  staleness, advantages, loss, AdamW, publishing a version every step), with
  ``min_groups = groups_per_step`` so that every mode trains on batches of the same size.

Each mode runs ``--repeats`` times (rounds over all modes) and its best round counts, as timeit takes
its minimum: other load on the machine can only slow a run down. Each run also reports the CPU cores
its two processes actually got (``cores_used``), and ``overlap_bound`` is the speedup perfect overlap
would give on two idle cores, from the sync run's CPU seconds.

Modes: ``sync`` (the generator makes one batch with version v, then waits for v+1: generation and
training alternate) and ``async`` with s_max in {1, 2, 4} (the generator never waits for a version;
it stops only while s_max + 1 batches are unconsumed, counting the one in training, and the trainer
drops anything staler than s_max). Throughput is trained tokens per second (completion tokens of the groups the N steps
consumed, over the wall time of those steps); ``speedup`` maps s_max to async/sync throughput, and
``reward_after_n`` maps each mode to the mean reward of the last 3 of its N steps.

    .venv/bin/python benchmarks/async_vs_sync.py            # N = 60 steps per mode
    .venv/bin/python benchmarks/async_vs_sync.py --quick    # N = 15, a few minutes

Last line: one JSON object with ``speedup``, ``reward_after_n`` and the details. Targets: speedup at
least 1.6 for some s_max <= 2, reward after N steps within noise of sync.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from veriroll.coordinator import store as st
from veriroll.coordinator.environments import Environment, Prompt, RewardFunction, Rubric

GROUP_SIZE = 16
GROUPS_PER_STEP = 16
LR = 3e-4
POLL_S = 0.01  # how often a waiting process looks again (each look is a store read)


def answer_is_right(prompt: Prompt, completion: str) -> float:
    return float(completion.rstrip(".") == prompt.meta["sum"])


class PaddedArithmetic(Environment):
    """Single-digit addition. Most prompts (``a+b=``) want just the sum; a fraction ``long_frac`` of them
    (``a+b#``) want the sum followed by ``dots`` dots, which version 0 learns in its warm start: the
    heavy tail of completion lengths. Only the sum is scored."""

    def __init__(self, long_frac: float = 0.12, dots: int = 32):
        self.long_frac, self.dots = long_frac, dots
        super().__init__("padded-arithmetic", Rubric([RewardFunction(answer_is_right, 1.0, "exact")]),
                         alphabet="0123456789+=#.", max_new_tokens=dots + 6)

    def sample_prompt(self, rng: random.Random) -> Prompt:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        long = rng.random() < self.long_frac
        return Prompt(f"{a}+{b}{'#' if long else '='}", str(a + b) + "." * (self.dots if long else 0), self.name,
                      {"sum": str(a + b)})


def make_version0(run: Path, env: PaddedArithmetic, *, warm_steps: int, seed: int) -> dict:
    from veriroll.coordinator.model_factory import (
        build_char_tokenizer,
        build_tiny_model,
        save_checkpoint,
        warm_start,
    )

    tokenizer = build_char_tokenizer(env.alphabet)
    model = build_tiny_model(tokenizer, layers=2, hidden=128, heads=4, seed=seed)
    summary = warm_start(model, tokenizer, env, steps=warm_steps, batch_size=16, lr=1e-3, seed=seed)
    save_checkpoint(model, tokenizer, run / "checkpoints" / "versions" / "v000000")
    return summary


def coordinator_config(s_max: int, overrides: dict | None = None):
    from veriroll.coordinator.config import CoordinatorConfig
    from veriroll.protos.config import load_config

    return load_config(CoordinatorConfig, overrides={
        "intake.s_max": s_max, "trainer.lr": LR, "trainer.groups_per_step": GROUPS_PER_STEP,
        "trainer.min_groups": GROUPS_PER_STEP, "trainer.publish_weights_every": 1, "trainer.checkpoint_every": 10_000,
        "trainer.correction": "mixed", "leases.group_size": GROUP_SIZE, **(overrides or {})})


def insert_group(conn, env_name: str, prompt: Prompt, prompt_ids: list[int], version: int, samples, rewards) -> None:
    """An accepted group, as the coordinator's intake writes one."""
    pid = conn.execute("INSERT INTO prompts(env, text, answer, meta, prompt_ids, state) VALUES(?, ?, ?, ?, ?, 'done')",
                       (env_name, prompt.text, prompt.answer, json.dumps(prompt.meta), st.pack_i32(prompt_ids))).lastrowid
    tokens = sum(len(s.token_ids) for s in samples)
    gid = conn.execute(
        "INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, arrival_ms, content_hash, "
        "tokens, mean_reward, verified) VALUES(?, 'bench', ?, ?, ?, 1.0, ?, '', ?, ?, 0)",
        (secrets.token_hex(12), pid, env_name, version, int(time.time() * 1000), tokens, float(np.mean(rewards)))).lastrowid
    conn.executemany("INSERT INTO samples(group_id, idx, token_ids, logprobs, reward, finish_reason) VALUES(?, ?, ?, ?, ?, ?)",
                     [(gid, i, st.pack_i32(s.token_ids), st.pack_f32(s.logprobs), r, s.finish_reason)
                      for i, (s, r) in enumerate(zip(samples, rewards, strict=True))])


# ---------------------------------------------------------------------------------------------------
# The two processes


def quiet() -> None:
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING)


def generator_main(run: str, mode: str, s_max: int, chunk: int, env_args: dict, seed: int, ready, go, stop, out) -> None:
    quiet()
    from veriroll.coordinator.policy import PolicyStore
    from veriroll.node.engines.base import GenerationRequest
    from veriroll.node.engines.torch import TorchEngine

    run = Path(run)
    env = PaddedArithmetic(**env_args)
    db = st.Database(run / "state.db")
    store = PolicyStore(run / "checkpoints")
    tokenizer = store.tokenizer
    engine = TorchEngine(store.version_dir(0), 0, threads=1)
    rng = random.Random(seed)
    made_at: dict[int, int] = {}
    lengths: list[int] = []
    busy = 0.0
    parent = os.getppid()
    ready.set()
    go.wait()
    cpu0 = time.process_time()
    while not stop.is_set() and os.getppid() == parent:
        version = db.read(lambda c: int(st.kv_get(c, "policy_version", 0))).result()
        if engine.version != version:
            engine.load(store.version_dir(version), version)
        if mode == "sync":
            todo = GROUPS_PER_STEP - made_at.get(version, 0)  # one batch per version, then wait for the next
        else:
            queued = db.read(lambda c: c.execute(
                "SELECT COUNT(*) FROM groups WHERE consumed_step IS NULL AND dropped IS NULL").fetchone()[0]).result()
            # Backpressure: the batch in training counts as queued until its step commits, so s_max + 1
            # batches unconsumed means the newest is consumed at most s_max versions after its own.
            todo = (s_max + 1) * GROUPS_PER_STEP - queued
        if todo <= 0:
            time.sleep(POLL_S)
            continue
        t0 = time.perf_counter()
        prompts = env.sample_prompts(rng, min(chunk, todo))
        ids = [list(tokenizer(p.text).input_ids) for p in prompts]
        requests = [GenerationRequest(i, [rng.getrandbits(64) for _ in range(GROUP_SIZE)], 1.0, env.max_new_tokens,
                                      [tokenizer.eos_token_id]) for i in ids]
        results = engine.generate(requests)
        rows = []
        for p, i, samples in zip(prompts, ids, results, strict=True):
            rewards = [env.reward(p, tokenizer.decode(s.token_ids, skip_special_tokens=True)) for s in samples]
            lengths.extend(len(s.token_ids) for s in samples)
            rows.append((p, i, samples, rewards))
        db.run_sync(lambda c, rows=rows, v=version: [insert_group(c, env.name, p, i, v, s, r) for p, i, s, r in rows])
        made_at[version] = made_at.get(version, 0) + len(rows)
        busy += time.perf_counter() - t0
    out.put(("generator", {"lengths": lengths, "busy_s": busy, "cpu_s": time.process_time() - cpu0}))
    db.close()


def trainer_main(run: str, s_max: int, steps: int, ready, go, out) -> None:
    quiet()
    from veriroll.coordinator.policy import PolicyStore
    from veriroll.coordinator.trainer import Trainer

    run = Path(run)
    db = st.Database(run / "state.db")
    trainer = Trainer(coordinator_config(s_max), db, PolicyStore(run / "checkpoints"))
    trainer.resume()
    busy = 0.0
    parent = os.getppid()
    ready.set()
    go.wait()
    started, cpu0 = time.perf_counter(), time.process_time()
    while trainer.step_no < steps and os.getppid() == parent:
        t0 = time.perf_counter()
        outcome = trainer.step()
        if outcome.kind == "waiting":
            time.sleep(POLL_S)
        else:
            busy += time.perf_counter() - t0
    elapsed = time.perf_counter() - started
    out.put(("trainer", {"elapsed_s": elapsed, "busy_s": busy, "cpu_s": time.process_time() - cpu0,
                         "history": trainer.history}))
    db.close()


def run_mode(root: Path, version0: Path, mode: str, s_max: int, *, steps: int, chunk: int, env_args: dict,
             seed: int, repeat: int = 0) -> dict:
    run = root / f"{mode if mode == 'sync' else f'async-s{s_max}'}-{repeat}"
    (run / "checkpoints" / "versions").mkdir(parents=True)
    shutil.copytree(version0, run / "checkpoints" / "versions" / "v000000")
    db = st.Database(run / "state.db")
    db.run_sync(lambda c: st.kv_set(c, "policy_version", 0))
    db.close()
    ctx = mp.get_context("spawn")
    ready_g, ready_t, go, stop = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Event()
    out = ctx.Queue()
    gen = ctx.Process(target=generator_main, args=(str(run), mode, s_max, chunk, env_args, seed, ready_g, go, stop, out),
                      daemon=True)
    trn = ctx.Process(target=trainer_main, args=(str(run), s_max, steps, ready_t, go, out), daemon=True)
    gen.start()
    trn.start()
    ready_g.wait()
    ready_t.wait()
    go.set()
    results = {}
    while "trainer" not in results:
        role, value = out.get()
        results[role] = value
    stop.set()
    while "generator" not in results:
        role, value = out.get()
        results[role] = value
    gen.join()
    trn.join()
    hist = results["trainer"]["history"]
    tokens = sum(h["tokens"] for h in hist)
    elapsed = results["trainer"]["elapsed_s"]
    rewards = [h["reward"] for h in hist]
    lengths = np.array(results["generator"]["lengths"])
    stale = sum(h["dropped_stale_groups"] for h in hist)
    summary = {
        "mode": mode, "s_max": s_max, "repeat": repeat, "steps": len(hist), "seconds": round(elapsed, 2),
        "trained_tokens": tokens, "tokens_per_s": round(tokens / elapsed, 1),
        "reward_curve": [round(r, 4) for r in rewards],
        "reward_after_n": round(float(np.mean(rewards[-3:])), 4),
        "trainer_busy_frac": round(results["trainer"]["busy_s"] / elapsed, 3),
        "generator_busy_frac": round(results["generator"]["busy_s"] / elapsed, 3),
        "trainer_cpu_s": round(results["trainer"]["cpu_s"], 2),
        "generator_cpu_s": round(results["generator"]["cpu_s"], 2),
        # CPU cores the two processes actually got: 1 is all sync can use, 2 all async can.
        "cores_used": round((results["trainer"]["cpu_s"] + results["generator"]["cpu_s"]) / elapsed, 3),
        "mean_staleness": round(float(np.mean([int(s) for h in hist for s, n in h["staleness_hist"].items()
                                               for _ in range(n)])), 3),
        "dropped_stale_groups": stale,
        "completion_len": {"mean": round(float(lengths.mean()), 2), "p50": float(np.median(lengths)),
                           "p99": float(np.percentile(lengths, 99)), "max": int(lengths.max()),
                           "frac_over_10x_median": round(float((lengths > 10 * np.median(lengths)).mean()), 4)},
    }
    print(f"{mode:>5} s_max {s_max}: {summary['tokens_per_s']:.0f} trained tok/s, {elapsed:.1f} s for {len(hist)} steps, "
          f"reward after N {summary['reward_after_n']:.3f}, busy trainer {summary['trainer_busy_frac']:.2f} "
          f"generator {summary['generator_busy_frac']:.2f}, cores used {summary['cores_used']:.2f}, "
          f"staleness {summary['mean_staleness']:.2f}, "
          f"dropped stale {stale}", file=sys.stderr)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="15 steps per mode (a few minutes)")
    parser.add_argument("--steps", type=int, default=None, help="steps per mode (default 60, quick 15)")
    parser.add_argument("--s-max", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--chunk", type=int, default=GROUPS_PER_STEP, help="groups per generate call")
    parser.add_argument("--long-frac", type=float, default=0.12, help="fraction of prompts that want a long completion")
    parser.add_argument("--dots", type=int, default=32, help="dots after the sum in a long completion")
    parser.add_argument("--warm-steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds over all modes; each mode's best round counts (other load only slows a run down)")
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one, removed)")
    args = parser.parse_args()
    steps = args.steps or (15 if args.quick else 60)
    quiet()
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="veriroll-async-vs-sync-"))
    root.mkdir(parents=True, exist_ok=True)
    env_args = {"long_frac": args.long_frac, "dots": args.dots}
    try:
        t0 = time.perf_counter()
        warm = make_version0(root, PaddedArithmetic(**env_args), warm_steps=args.warm_steps, seed=args.seed)
        print(f"version 0 warm-started in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        version0 = root / "checkpoints" / "versions" / "v000000"
        modes = [("sync", 0)] + [("async", s) for s in args.s_max]
        all_runs = [run_mode(root, version0, mode, s, steps=steps, chunk=args.chunk, env_args=env_args, seed=args.seed,
                             repeat=r) for r in range(args.repeats) for mode, s in modes]
        # Like timeit's minimum: load from other processes on the machine can only slow a run down.
        runs = [max((x for x in all_runs if (x["mode"], x["s_max"]) == m), key=lambda x: x["tokens_per_s"]) for m in modes]
        sync = runs[0]
        speedup = {str(r["s_max"]): round(r["tokens_per_s"] / sync["tokens_per_s"], 3) for r in runs[1:]}
        reward_after_n = {("sync" if r["mode"] == "sync" else f"async_s{r['s_max']}"): r["reward_after_n"] for r in runs}
        # The binomial standard error of a mean over 3 steps of GROUPS_PER_STEP x GROUP_SIZE samples.
        p = sync["reward_after_n"]
        se = float(np.sqrt(max(p * (1 - p), 1e-9) / (3 * GROUPS_PER_STEP * GROUP_SIZE)))
        best = max((v for k, v in speedup.items() if int(k) <= 2), default=0.0)
        result = {
            "benchmark": "async_vs_sync", "steps": steps, "groups_per_step": GROUPS_PER_STEP, "group_size": GROUP_SIZE,
            "chunk": args.chunk, "warm_start_loss": round(warm["final_loss"], 4), "speedup": speedup,
            "reward_after_n": reward_after_n, "reward_se": round(se, 4),
            "speedup_target_met": best >= 1.6,
            # What perfect overlap would give on two otherwise idle cores: sync's CPU seconds, summed, over
            # the larger of the two (the wall-clock figures above are what this machine actually did).
            "overlap_bound": round((sync["trainer_cpu_s"] + sync["generator_cpu_s"])
                                   / max(sync["trainer_cpu_s"], sync["generator_cpu_s"]), 3),
            "reward_within_noise": all(abs(v - p) <= 3 * se * np.sqrt(2) for v in reward_after_n.values()),
            "runs": runs, "repeats": args.repeats,
            "all_tokens_per_s": {f"{m}_s{s}": [x["tokens_per_s"] for x in all_runs if (x["mode"], x["s_max"]) == (m, s)]
                                 for m, s in modes},
            "cpu_count": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(result))
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
