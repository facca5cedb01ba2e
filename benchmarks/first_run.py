"""The first hour of a volunteer and an operator, measured with the real commands.

    .venv/bin/python benchmarks/first_run.py [--quick]

* ``install_mb_cpu``: what the README's CPU install line downloads into an empty environment (a
  ``pip install --dry-run`` resolution; tests/test_install.py).
* ``seconds_to_first_accepted_group``: `veriroll coordinator init --preset tiny-arith`, `coordinator
  run`, `keygen`, then `node run`: seconds from starting the node to its first accepted group.
* ``mistakes_diagnosed`` of ``mistakes_tried``: the volunteer's mistakes of issue 15 (node/mistakes.py),
  each run as the real command against that coordinator; diagnosed = ended within 10 s, exit code 2,
  with the fix in its output.
* ``honest_rate_limited_per_10min``: the same honest node's `rate_limited` refusals, scaled to ten
  minutes from a run of 2 (``--quick``) or 10 minutes.

Human lines go to stderr; the last line on stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
VERIROLL = str(Path(sys.executable).parent / "veriroll")
MISTAKE_LIMIT_S = 10.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "VERIROLL_NODE_KEY": ""}


def accepted(coord_dir: Path) -> tuple[int, dict]:
    """(accepted groups, refusals by reason) in the coordinator's store, read-only."""
    from veriroll.coordinator import store as st

    db = st.Database(coord_dir / "state.db")
    try:
        summary = db.run_sync(st.status_summary)
    finally:
        db.close()
    return summary["accepted_groups"], summary["rejections_by_reason"]


def first_hour(work: Path, honest_s: float) -> dict:
    coord_dir, grpc_port, http_port = work / "coord", free_port(), free_port()
    out: dict = {}
    subprocess.run([VERIROLL, "coordinator", "init", "--dir", str(coord_dir), "--preset", "tiny-arith",
                    "--set", f"server.port={grpc_port}", "--set", f"server.http_port={http_port}",
                    "--set", "shardcast.origin_port=0"], check=True, capture_output=True, env=env(), timeout=300)
    coord_log = (work / "coordinator.log").open("wb")
    coord = subprocess.Popen([VERIROLL, "coordinator", "run", "--dir", str(coord_dir)], stdout=coord_log,
                             stderr=subprocess.STDOUT, env=env())
    node = None
    try:
        for _ in range(600):
            if (coord_dir / "ports.json").exists():
                break
            assert coord.poll() is None, (work / "coordinator.log").read_text()[-2000:]
            time.sleep(0.1)
        key = work / "keys" / "node.key"
        subprocess.run([VERIROLL, "keygen", "--out", str(key)], check=True, capture_output=True, env=env())
        ca = coord_dir / "tls" / "ca.crt"
        node_log = (work / "node.log").open("wb")
        started = time.monotonic()
        node = subprocess.Popen([VERIROLL, "node", "run", "--coordinator", f"127.0.0.1:{grpc_port}", "--ca", str(ca),
                                 "--key", str(key), "--cache-dir", str(work / "cache"), "--threads", "1", "--plain"],
                                stdout=node_log, stderr=subprocess.STDOUT, env=env())
        first = None
        while time.monotonic() - started < 300:
            if accepted(coord_dir)[0] >= 1:
                first = time.monotonic() - started
                break
            assert node.poll() is None, (work / "node.log").read_text()[-2000:]
            time.sleep(0.2)
        out["seconds_to_first_accepted_group"] = round(first, 2) if first is not None else None
        log(f"first accepted group {out['seconds_to_first_accepted_group']} s after `node run`")

        # The honest node keeps working; meanwhile the mistakes run against the same coordinator.
        out.update(mistakes(work, f"127.0.0.1:{grpc_port}", ca, http_port, key))
        remaining = honest_s - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)
        groups, refusals = accepted(coord_dir)
        ran_s = time.monotonic() - started
        limited = refusals.get("rate_limited", 0)
        out["honest_rate_limited_per_10min"] = round(limited * 600 / ran_s, 2)
        out["honest_run"] = {"seconds": round(ran_s, 1), "accepted_groups": groups, "refusals": refusals}
        log(f"honest node: {groups} groups accepted in {ran_s:.0f} s; refusals {refusals}")
    finally:
        for proc in (node, coord):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return out


def mistakes(work: Path, coordinator: str, ca: Path, http_port: int, key: Path) -> dict:
    from veriroll.coordinator.tls import create_tls
    from veriroll.node.mistakes import EXIT_CODE, MISTAKES, MistakeSetup

    other = work / "other-tls"
    create_tls(other)
    setup = MistakeSetup(work=work / "mistakes", coordinator=coordinator, ca=ca, not_grpc_port=http_port,
                         other_ca=other / "ca.crt", key=key)
    results = []
    for name, argv, fix in MISTAKES:
        t0 = time.monotonic()
        try:
            done = subprocess.run([VERIROLL, *argv(setup)], capture_output=True, text=True, env=env(), timeout=60)
            seconds, code, text = time.monotonic() - t0, done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            seconds, code, text = 60.0, None, ""
        ok = code == EXIT_CODE and fix in text and seconds <= MISTAKE_LIMIT_S
        results.append({"mistake": name, "diagnosed": ok, "seconds": round(seconds, 2), "exit_code": code})
        log(f"{'ok  ' if ok else 'MISS'} {name}: exit {code} in {seconds:.1f} s")
    return {"mistakes_diagnosed": sum(r["diagnosed"] for r in results), "mistakes_tried": len(results),
            "mistakes": results}


def install_mb() -> dict:
    try:
        from test_install import cpu_install_mb

        return {"install_mb_cpu": cpu_install_mb()}
    except LookupError as exc:
        return {"install_mb_cpu": None, "install_note": str(exc)}


def main() -> int:
    from procs import sigterm_as_interrupt  # a sibling script (not needed where this is imported)

    sigterm_as_interrupt()  # so the finally blocks below stop what this started
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 2-minute honest run instead of 10")
    ap.add_argument("--skip-install", action="store_true", help="leave out the install resolution (needs the registry)")
    args = ap.parse_args()
    out: dict = {}
    if not args.skip_install:
        out.update(install_mb())
        log(f"CPU install: {out.get('install_mb_cpu')} MB")
    with tempfile.TemporaryDirectory(prefix="veriroll-first-run-") as tmp:
        out.update(first_hour(Path(tmp), 120.0 if args.quick else 600.0))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
