"""The default testnet, measured: wall time to mean reward >= 0.9, accepted groups per second, the
verification share of the coordinator's CPU, and the adversarial summary.

Runs ``deploy/testnet.toml`` (3 honest nodes, the adversaries listed there, two relays in a chain) as
real processes on loopback, exactly as ``veriroll testnet`` does, and watches the coordinator's
database and ``/metrics`` until the trainer stops (target reward reached, or ``--steps``).

Figures (one JSON line, printed last):

- ``wall_s_to_target``: from the coordinator serving (its ``ports.json``) to the trainer step that met
  the stop condition. Node start-up is inside it; the one-off warm start of version 0 is not
  (``startup_s``: launch to the coordinator serving, reported apart).
- ``groups_per_s_accepted``: accepted groups per second between the first and the last one.
- ``verification_share_of_coordinator_cpu``: CPU seconds of the coordinator's verification thread over
  those of the whole coordinator process while serving (user + system, psutil; start-up excluded).
  The verification thread is found without any hook in the coordinator: it is started by the first
  group to be verified, so it is the busiest of the threads that did not exist when the coordinator
  began serving (the others born later only score rewards or publish). ``veriroll_verification_seconds_sum`` from ``/metrics`` is reported
  beside it (``verification_wall_s``): it is wall time, which on an oversubscribed machine includes
  waiting for a core and can exceed the CPU time.
- ``adversarial_accepted`` and ``honest_rejected`` (targets: 0 and 0), as in ``veriroll testnet --json``.

``--quick`` is ``--steps 5``.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from veriroll.deploy.testnet import Testnet
from veriroll.deploy.topology import load_topology

VERIFY_SUM = re.compile(r"^veriroll_verification_seconds_sum (\S+)$", re.M)
VERIFY_COUNT = re.compile(r"^veriroll_verification_seconds_count (\S+)$", re.M)


def scrape(http_port: int) -> dict:
    """Verification time and count from the coordinator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    s, n = VERIFY_SUM.search(text), VERIFY_COUNT.search(text)
    return {"verification_s": float(s.group(1)) if s else 0.0, "verified_groups": int(float(n.group(1))) if n else 0}


def cpu_seconds(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def arrivals(db: Path) -> tuple[int, float, float]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        n, first, last = conn.execute("SELECT COUNT(*), MIN(arrival_ms), MAX(arrival_ms) FROM groups").fetchone()
    finally:
        conn.close()
    return int(n), (first or 0) / 1000, (last or 0) / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="stop after 5 trainer steps (same as --steps 5)")
    ap.add_argument("--steps", type=int, help="stop after this many trainer steps instead of at the target reward")
    ap.add_argument("--config", help="topology TOML (default: deploy/testnet.toml)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    ap.add_argument("--dir", help="run directory (default: a temporary one)")
    args = ap.parse_args()
    steps = 5 if args.quick else args.steps
    overrides = {"timeout_s": args.timeout, **({"steps": steps} if steps else {})}
    cfg = load_topology(args.config, overrides)
    run_dir = Path(args.dir or tempfile.mkdtemp(prefix="veriroll-bench-testnet-")).resolve()
    net = Testnet(cfg, run_dir)
    t0 = time.time()
    snap: dict = {}
    scraped = {"verification_s": 0.0, "verified_groups": 0}
    cpu = 0.0
    verify_cpu: float | None = None
    ok = False
    serving: float | None = None
    try:
        info = net.start()
        coord = net.procs[0].popen
        serving = (net.coord_dir / "ports.json").stat().st_mtime
        # Nodes take many seconds to start: nothing has been verified yet, so the verification thread
        # is not among these.
        born_before: set[int] | None = set(thread_cpu_seconds(coord.pid))
        cpu_at_serving = cpu_seconds(coord.pid)  # imports, model loads, version 0's publish: not the run's
        if scrape(info["ports"]["http"])["verified_groups"]:
            born_before = None
        while time.time() - t0 < cfg.timeout_s:
            time.sleep(2.0)
            if coord.poll() is not None:
                print(f"the coordinator exited with {coord.returncode}; see {net.procs[0].log}", file=sys.stderr)
                break
            snap = net.snapshot() or snap
            try:
                scraped = scrape(info["ports"]["http"])
                cpu = cpu_seconds(coord.pid) - cpu_at_serving
                if born_before is not None:
                    verify_cpu = max((c for t, c in thread_cpu_seconds(coord.pid).items() if t not in born_before),
                                     default=0.0)
            except (OSError, psutil.Error):
                pass
            if net.done(snap):
                ok = True
                break
        else:
            print(f"timed out after {cfg.timeout_s:.0f}s", file=sys.stderr)
    finally:
        net.stop()
    history = snap.get("history", [])
    summary = net.summary(snap, time.time() - t0)
    n, first, last = arrivals(net.coord_dir / "state.db")
    done_at = history[-1]["time"] if ok and history else None
    result = {
        "target": f"{steps} steps" if steps else f"mean reward >= {cfg.target_reward}",
        "reached": ok,
        "wall_s_to_target": round(done_at - serving, 1) if done_at and serving else None,
        "groups_per_s_accepted": round((n - 1) / (last - first), 3) if n > 1 and last > first else 0.0,
        "verification_share_of_coordinator_cpu": round(verify_cpu / cpu, 3) if cpu and verify_cpu is not None else None,
        "adversarial_accepted": summary["adversarial_accepted"],
        "honest_rejected": summary["honest_rejected"],
        "steps": summary["steps"],
        "final_reward": summary["final_reward"],
        "accepted_groups": n,
        "rejections_by_reason": summary["rejections_by_reason"],
        "verification_cpu_s": round(verify_cpu, 1) if verify_cpu is not None else None,
        "verification_wall_s": round(scraped["verification_s"], 1),
        "verified_groups": scraped["verified_groups"],
        "coordinator_cpu_s": round(cpu, 1),
        "trainer_step_s": round(sum(h.get("step_seconds", 0.0) for h in history), 1),
        "startup_s": round(serving - t0, 1) if serving else None,
        "honest_nodes": cfg.honest_nodes,
        "adversaries": cfg.adversaries,
        "run_dir": str(run_dir),
    }
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
