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
