"""The planner against a measured run: predicted vs measured accepted groups/s on this machine.

Runs benchmarks/scale.py's simulated fleet (real clients, real TLS coordinator, SQLite, verification
off) at node counts below the coordinator's ceiling (the fleet's offered rate decides) and past it
(one edge process's CPU per group, or this machine's cores, decide). For each, the planner predicts
``predicted_groups_per_s`` from the same think time and group shape, the unit costs that run measured
(the coordinator's and the clients' CPU per group, a SQLite commit) and this machine's cores, shared by
the coordinator and the simulated nodes' clients (scale.py ``deployment_plan``).

    .venv/bin/python benchmarks/plan_check.py [--quick]

``--quick`` (under 5 minutes): 100, 400 and 800 nodes, 10 s windows. Staleness is not measured: the
simulated fleet runs with the trainer off, so no version is published. The last line is one JSON
object: ``points`` (nodes, predicted_groups_per_s, bottleneck, measured_groups_per_s, error), the worst point's
``predicted_groups_per_s`` / ``measured_groups_per_s``, and ``within_25pct``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from scale import cores_left, deployment_plan, fixed_costs, run_scale  # noqa: E402  (benchmarks/ is not a package: imported by path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100, 400 and 800 nodes, 10 s windows (under 5 minutes)")
    ap.add_argument("--scales", default="100,400,800", help="comma-separated node counts")
    ap.add_argument("--measure-s", type=float, default=20.0)
    ap.add_argument("--think-s", type=float, default=1.5, help="median think (generation) time per lease")
    ap.add_argument("--think-sigma", type=float, default=0.5)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    # The fields run_scale reads, at scale.py's defaults.
    args.ramp_s, args.ramp_rate, args.settle_s, args.heartbeat_s = 3.0, 50.0, 3.0, 5.0
    args.client_procs, args.call_timeout_s = 2, 30.0
    if args.quick:
        args.measure_s, args.settle_s = 10.0, 2.0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(HERE.parents[1] / "tests"))
    root = Path(tempfile.mkdtemp(prefix="veriroll-bench-plan-"))
    points = []
    try:
        commit_ms = fixed_costs(root)["sqlite_commit_ms"]
        for n in [int(x) for x in args.scales.split(",") if x.strip()]:
            s = run_scale(n, args, root)
            measured = s["submissions_per_s"]
            planned = deployment_plan(s, args, 1, commit_ms, cores=cores_left(s)) if measured else None
            predicted = planned["predicted_groups_per_s"] if planned else 0.0
            error = (predicted - measured) / measured if measured else None
            points.append({"nodes": n, "predicted_groups_per_s": round(predicted, 1),
                           "bottleneck": planned and planned["bottleneck"], "other_cores": s["other_cores"],
                           "steal_cores": s["steal_cores"],
                           "measured_groups_per_s": measured, "error": round(error, 3) if error is not None else None,
                           "coordinator_cores": s["coordinator"]["cpu_cores"],
                           "cpu_ms_per_group": s["coordinator"]["cpu_ms_per_group"], "load_avg": s["load_avg"]})
            print(f"{n:5d} nodes: predicted {predicted:6.1f} groups/s ({planned and planned['bottleneck']}), "
                  f"measured {measured:6.1f} ({'n/a' if error is None else f'{error:+.0%}'}), coordinator {s['coordinator']['cpu_cores']:.2f} "
                  f"cores, {s['coordinator']['cpu_ms_per_group']} ms CPU per group, load {s['load_avg']}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    worst = max(points, key=lambda p: abs(p["error"]) if p["error"] is not None else math.inf)
    print(json.dumps({
        "points": points, "predicted_groups_per_s": worst["predicted_groups_per_s"],
        "measured_groups_per_s": worst["measured_groups_per_s"],
        "within_25pct": all(p["error"] is not None and abs(p["error"]) <= 0.25 for p in points),
        "staleness": "not measured (trainer off in the simulated fleet)",
        "config": {"think_median_s": args.think_s, "think_sigma": args.think_sigma,
                   "group": f"{args.group_size}x{args.tokens} tokens", "measure_s": args.measure_s,
                   "cpus": os.cpu_count()},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
