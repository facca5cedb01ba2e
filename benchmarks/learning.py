"""Does the policy learn, end to end? tiny-arith from version 0 to a mean reward of 0.9.

Everything is the real thing, on this one machine: ``veriroll coordinator init --preset tiny-arith``
makes version 0 (the warm-started 0.53M-parameter Llama); ``veriroll coordinator run`` serves it with
the trainer on (and the verification stages, ``TrustedVerifier``, where this build has them); ``--nodes``
``veriroll node run`` processes (the torch engine: batched, KV-cached, seeded generation with TOPLOC
commitments) lease prompts, generate, sign and submit over gRPC, reading new versions from the
coordinator's version directory as they appear. The coordinator stops training once the mean reward
of the last ``target_window`` (3) steps reaches the target.

    .venv/bin/python benchmarks/learning.py            # up to 15 minutes
    .venv/bin/python benchmarks/learning.py --quick    # up to 4 minutes

Measured from the first accepted group: ``steps_to_target`` and ``seconds_to_target`` (null when the
time ran out first), ``final_reward`` (mean of the last 3 steps). The reward curve is saved as
``reward.png`` (and ``history.json``) in the run directory. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from procs import sigterm_as_interrupt, stop_processes

from veriroll.coordinator import store as st

VENV_BIN = Path(sys.executable).parent
TARGET_WINDOW = 3


def veriroll(*args: str) -> list[str]:
    exe = VENV_BIN / "veriroll"
    return [str(exe), *args] if exe.exists() else [sys.executable, "-m", "veriroll.cli.main", *args]


def verifier_available() -> bool:
    try:
        from veriroll.coordinator.verifier import TrustedVerifier  # noqa: F401 - probes the install
    except ImportError:
        return False
    return True


def read_state(db_path: Path) -> dict:
    db = st.Database(db_path)
    try:
        return db.read(lambda c: {
            "history": st.kv_get(c, "trainer_history", []),
            "done": bool(st.kv_get(c, "trainer_done", False)),
            "first_arrival_ms": c.execute("SELECT MIN(arrival_ms) FROM groups").fetchone()[0],
            "rejections": st.rejections_by_reason(c),
            "verified_groups": c.execute("SELECT COUNT(*) FROM groups WHERE verified = 1").fetchone()[0],
            "groups": c.execute("SELECT COUNT(*) FROM groups").fetchone()[0],
        }).result()
    finally:
        db.close()


def plot(history: list[dict], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [h["reward"] for h in history], lw=1, alpha=0.5, label="reward per step")
    window = [sum(r["reward"] for r in history[max(0, i - TARGET_WINDOW + 1): i + 1]) / min(i + 1, TARGET_WINDOW)
              for i in range(len(history))]
    ax.plot(steps, window, lw=2, label=f"mean of last {TARGET_WINDOW} steps")
    ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target}")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward (sampled, T=1)")
    ax.set_ylim(0, 1.02)
    ax.set_title("tiny-arith: coordinator + node + verifier on one machine")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    sigterm_as_interrupt()  # so the finally blocks below stop what this started (procs.py)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="give up after 4 minutes instead of 15")
    parser.add_argument("--max-seconds", type=float, default=None, help="time limit of the RL run")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--nodes", type=int, default=1, help="node processes")
    parser.add_argument("--seed", type=int, default=0, help="seed of version 0")
    parser.add_argument("--out", default=None, help="run directory (default: a new temporary one, kept)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra coordinator setting")
    args = parser.parse_args()
    limit = args.max_seconds or (240.0 if args.quick else 900.0)
    run = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="veriroll-learning-"))
    run.mkdir(parents=True, exist_ok=True)
    coord_dir = run / "coord"
    settings = ["server.tls=false", "server.port=0", "server.http_port=0", "shardcast.origin_port=-1", f"trainer.target_reward={args.target}",
                f"trainer.target_window={TARGET_WINDOW}", "trainer.checkpoint_every=25", "leases.queue_maxsize=32",
                *args.set]
    sets = [x for s in settings for x in ("--set", s)]
    t0 = time.perf_counter()
    init = subprocess.run(veriroll("coordinator", "init", "--dir", str(coord_dir), "--preset", "tiny-arith", "--seed",
                                   str(args.seed), "--json", *sets), capture_output=True, text=True, check=True)
    init_info = json.loads(init.stdout.strip().splitlines()[-1])
    init_s = time.perf_counter() - t0
    print(f"version 0 ready in {init_s:.1f} s; run directory {run}", file=sys.stderr)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        log = open(run / "coordinator.log", "w")  # noqa: SIM115 - closed in finally
        logs.append(log)
        procs.append(subprocess.Popen(veriroll("coordinator", "run", "--dir", str(coord_dir)), stdout=log,
                                      stderr=subprocess.STDOUT, env=env))
        ports = coord_dir / "ports.json"
        deadline = time.monotonic() + 120
        while not ports.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the coordinator did not start; see {run / 'coordinator.log'}")
            time.sleep(0.2)
        port = json.loads(ports.read_text())["grpc"]
        for i in range(args.nodes):
            log = open(run / f"node{i}.log", "w")  # noqa: SIM115 - closed in finally
            logs.append(log)
            procs.append(subprocess.Popen(veriroll(
                "node", "run", "--coordinator", f"127.0.0.1:{port}", "--key", str(run / f"node{i}.key"),
                "--create-key", "--threads", "1", "--checkpoint-dir", str(coord_dir / "checkpoints" / "versions"),
                "--display-name", f"bench-{i}", "--log-level", "warning"), stdout=log, stderr=subprocess.STDOUT, env=env))
        started = time.time()
        state = read_state(coord_dir / "state.db")
        last_print = 0.0
        while time.time() - started < limit and not state["done"]:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a process exited early; see the logs in {run}")
            time.sleep(1.0)
            state = read_state(coord_dir / "state.db")
            if state["history"] and time.time() - last_print > 15:
                h = state["history"][-1]
                print(f"  {time.time() - started:5.0f} s  step {h['step']:4d}  reward {h['reward']:.3f}", file=sys.stderr)
                last_print = time.time()
    finally:
        stop_processes(procs, 30)
        for log in logs:
            log.close()

    state = read_state(coord_dir / "state.db")
    history = state["history"]
    (run / "history.json").write_text(json.dumps(history))
    rewards = [h["reward"] for h in history]
    first = (state["first_arrival_ms"] or 0) / 1000
    hit = None
    for i in range(TARGET_WINDOW - 1, len(history)):
        if sum(rewards[i - TARGET_WINDOW + 1: i + 1]) / TARGET_WINDOW >= args.target:
            hit = history[i]
            break
    if history:
        plot(history, args.target, run / "reward.png")
    result = {
        "benchmark": "learning",
        "preset": "tiny-arith",
        "steps_to_target": hit["step"] if hit else None,
        "seconds_to_target": round(hit["time"] - first, 1) if hit else None,
        "final_reward": round(sum(rewards[-TARGET_WINDOW:]) / len(rewards[-TARGET_WINDOW:]), 4) if rewards else None,
        "target": args.target,
        "target_met": hit is not None,
        "initial_reward": round(sum(rewards[:TARGET_WINDOW]) / len(rewards[:TARGET_WINDOW]), 4) if rewards else None,
        "steps": len(history),
        "seconds": round(history[-1]["time"] - first, 1) if history else 0.0,
        "time_limit_s": limit,
        "verifier": verifier_available(),
        "verified_groups": state["verified_groups"],
        "groups": state["groups"],
        "rejections": state["rejections"],
        "nodes": args.nodes,
        "init_seconds": round(init_s, 1),
        "parameters": init_info.get("parameters"),
        "mean_staleness": round(sum(int(s) * n for h in history for s, n in h["staleness_hist"].items())
                                / max(1, sum(n for h in history for n in h["staleness_hist"].values())), 3),
        "reward_curve": [round(r, 4) for r in rewards],
        "plot": str(run / "reward.png"),
        "run_dir": str(run),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
