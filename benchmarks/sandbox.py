"""Sandbox for model-written code: what a trivial run costs on a warm sandbox and on a cold one, and whether
any escape attempt gets out.

A warm run takes a container started ahead (its interpreter already waiting for the job); a cold run
starts bubblewrap and the interpreter for the job (``SandboxPool(warm=False)``). Each figure is the
median wall time of ``await pool.run("print(1+1)")`` as the caller sees it, runs spaced so a warm
container is always ready. Then every program of tests/coordinator/sandbox_escapes.py is run once
against real targets on this host; an attempt counts as an escape if any check says so.

    .venv/bin/python benchmarks/sandbox.py [--quick] [--runs 200]

``--quick``: 30 runs per setting (a few seconds, plus ~20 s for the escape attempts). Prints a few human
lines, then one JSON line with ``sandbox_exec_p50_ms`` (warm), ``sandbox_cold_p50_ms``, ``sandbox_escapes``
(must be 0), ``sandbox_escape_attempts`` and the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "tests" / "coordinator"))
from sandbox_escapes import ATTEMPTS, attempt_escape, host_targets  # noqa: E402 - a sibling script

from veriroll.coordinator.sandbox import SandboxLimits, SandboxPool  # noqa: E402

TRIVIAL = "print(1+1)"
SPACING_S = 0.05  # between runs: time for the pool's replacement container to start
ESCAPE_LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_bytes=256 * 2**20)


def log(*parts: object) -> None:
    print(*parts, flush=True)


async def trivial_p50_ms(pool: SandboxPool, runs: int) -> tuple[float, float]:
    """Median and 90th percentile (ms) of a trivial run, as the caller of ``pool.run`` sees it."""
    times = []
    for _ in range(runs):
        await asyncio.sleep(SPACING_S)
        started = time.perf_counter()
        result = await pool.run(TRIVIAL)
        times.append((time.perf_counter() - started) * 1000)
        if result.stdout != "2\n":
            raise SystemExit(f"a trivial run went wrong: {result}")
    return statistics.median(times), statistics.quantiles(times, n=10)[-1]


async def escapes() -> tuple[int, int]:
    """(attempts that got out, attempts made), each against fresh targets."""
    escaped = 0
    with SandboxPool(1, ESCAPE_LIMITS) as pool, tempfile.TemporaryDirectory(prefix="veriroll-sandbox-bench-") as tmp:
        for attempt in ATTEMPTS:
            with host_targets(Path(tmp) / attempt.name) as host:
                result, found = await attempt_escape(pool, attempt, host, ESCAPE_LIMITS.wall_s)
            escaped += bool(found)
            log(f"  {attempt.name}: {'ESCAPED ' + '; '.join(found) if found else 'contained'} "
                f"(reason {result.killed_reason}, {result.wall_s:.2f} s)")
    return escaped, len(ATTEMPTS)


async def measure(runs: int) -> dict:
    with SandboxPool(2) as warm:
        await asyncio.sleep(0.5)  # both started containers reach their read
        warm_p50, warm_p90 = await trivial_p50_ms(warm, runs)
    log(f"warm sandbox: print(1+1) p50 {warm_p50:.1f} ms, p90 {warm_p90:.1f} ms over {runs} runs")
    with SandboxPool(2, warm=False) as cold:
        cold_p50, cold_p90 = await trivial_p50_ms(cold, runs)
    log(f"cold sandbox: print(1+1) p50 {cold_p50:.1f} ms, p90 {cold_p90:.1f} ms over {runs} runs")
    log("escape attempts:")
    escaped, attempts = await escapes()
    log(f"{escaped} of {attempts} escape attempts got out")
    return {"sandbox_exec_p50_ms": round(warm_p50, 2), "sandbox_exec_p90_ms": round(warm_p90, 2),
            "sandbox_cold_p50_ms": round(cold_p50, 2), "sandbox_cold_p90_ms": round(cold_p90, 2),
            "sandbox_escapes": escaped, "sandbox_escape_attempts": attempts, "runs": runs,
            "cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="30 runs per setting")
    ap.add_argument("--runs", type=int, default=200, help="trivial runs per setting (default 200)")
    args = ap.parse_args()
    result = asyncio.run(measure(30 if args.quick else args.runs))
    print(json.dumps(result))
    return 1 if result["sandbox_escapes"] else 0


if __name__ == "__main__":
    sys.exit(main())
