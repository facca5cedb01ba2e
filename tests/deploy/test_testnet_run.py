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
    proc = subprocess.Popen([veriroll, "testnet", "--steps", "50", "--json", "--no-live", "--dir", str(run),
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
    summary = json.loads(out.strip().splitlines()[-1])
    assert json.loads((run / "summary.json").read_text())["steps"] == summary["steps"] < 50
