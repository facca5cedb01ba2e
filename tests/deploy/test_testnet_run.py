"""``veriroll testnet``, the README's main command, end to end on CPU with its embedded defaults: a coordinator,
two relays, three honest nodes and a forging adversary as separate processes on loopback. Everything else in
the default suite tests its parts; this is the one run of the whole (the WAN and 135M-model runs are slow
tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_the_local_testnet_trains_refuses_the_forger_and_every_honest_node_holds_the_final_version(tmp_path):
    veriroll = str(Path(sys.executable).parent / "veriroll")
    out = subprocess.run([veriroll, "testnet", "--steps", "2", "--json", "--no-live", "--dir", str(tmp_path / "run"),
                          "--timeout", "600"], capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] >= 2 and summary["accepted_groups"] > 0
    assert summary["honest_rejected"] == 0, summary["rejections_by_node"]
    # The forger's groups are refused by the verifier (its log-probs do not match the trusted replay).
    assert summary["adversarial_accepted"] == 0 and summary["adversaries_unjudged"] == []
    assert summary["rejections_by_node"].get("node-4-forged-logprobs", {}).get("logprob_mismatch", 0) >= 1
    # Every published version is signed and relayed; the last reached every honest node before the run ended.
    final = summary["final_version"]
    assert final == summary["policy_version"] >= 2 and summary["nodes_behind"] == []
    assert summary["broadcast"][str(final)]["nodes"] == 3 and summary["broadcast"][str(final)]["to_100pct_s"] is not None
    assert sum(summary["staleness_hist"].values()) > 0
    assert (tmp_path / "run" / "summary.json").exists() and (tmp_path / "run" / "logs" / "coordinator.log").exists()


def test_sigterm_stops_every_process_of_the_testnet_and_the_summary_is_still_written(tmp_path):
    """Its processes run in sessions of their own: before, SIGTERM (or SIGHUP, the terminal closed) ended the
    runner alone and left the coordinator, the relays and the nodes running, with nobody to stop them."""
    import signal
    import time

    import psutil

    veriroll = str(Path(sys.executable).parent / "veriroll")
    run = tmp_path / "run"
    # Without --json: the default output, a person's summary, must come out of an interrupted run too.
    proc = subprocess.Popen([veriroll, "testnet", "--steps", "50", "--no-live", "--dir", str(run),
                             "--timeout", "600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # until a node is running (it writes its status file); hang guard 300 s
            if list(run.glob("node-*/status.json")) or proc.poll() is not None:
                break
            time.sleep(0.5)
        network = [p for p in psutil.Process(proc.pid).children(recursive=True)]
        named = [" ".join(p.cmdline()[1:4]) for p in network]
        assert any("coordinator run" in n for n in named) and any("relay run" in n for n in named) and \
            sum("node run" in n for n in named) >= 3, named
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "interrupted (SIGTERM); stopping the testnet" in err, err[-2000:]
    assert [p.pid for p in network if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] < 50
    assert out.splitlines()[0] == f"veriroll testnet: {summary['steps']} steps in {summary['wall_s']:.0f} s, " \
                                  f"policy version {summary['policy_version']}", out
    assert f"full summary   {run / 'summary.json'} (--json prints it)" in out and len(out.splitlines()) <= 14


def test_the_human_summary_says_what_happened_in_a_dozen_lines(tmp_path):
    from veriroll.deploy.testnet import human_summary

    summary = {"steps": 202, "wall_s": 301.6, "policy_version": 202, "first_reward": 0.371, "final_reward": 0.9,
               "accepted_groups": 3120, "groups_per_s": 10.345, "honest_rejected": 0, "adversarial_accepted": 0,
               "rejections_by_reason": {"stale_version": 30, "logprob_mismatch": 3, "banned": 9},
               "rejections_by_node": {"node-4-forged-logprobs": {"logprob_mismatch": 3, "banned": 9},
                                      "node-1": {"stale_version": 30}},
               "adversaries_unjudged": [], "staleness_hist": {"0": 3000, "1": 120},
               "broadcast": {str(v): {"nodes": 3, "to_50pct_s": 1.0, "to_95pct_s": float(v), "to_100pct_s": 9.0}
                             for v in range(1, 21)},
               "reward_curve": str(tmp_path / "reward_curve.png")}
    lines = human_summary(summary, ["node-4-forged-logprobs"], tmp_path).splitlines()
    assert len(lines) <= 12
    assert lines[0] == "veriroll testnet: 202 steps in 302 s, policy version 202"
    assert "0.37 at the first step, 0.90 at the last" in lines[1]
    assert "3,120 accepted (10.35/s)" in lines[2]
    assert lines[3].endswith("stale_version 30, banned 9, logprob_mismatch 3")  # most frequent first
    assert "1 of 1 judged, 0 of their groups accepted; node-4-forged-logprobs: banned 9, logprob_mismatch 3" in lines[5]
    assert "p95 19.0 s, p50 10.0 s after publishing (20 versions)" in lines[6]  # over the versions' 95% times
    assert str(tmp_path / "reward_curve.png") in "\n".join(lines)
