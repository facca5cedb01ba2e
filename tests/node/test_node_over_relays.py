"""A real node process fetches version 0 from the coordinator's origin relay (signed shards) and its
groups are accepted over TLS: the whole backbone, end to end, as separate processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from support import make_coordinator_dir

from veriroll.coordinator import store as st
from veriroll.protos.identity import write_keypair

VERIROLL = str(Path(sys.executable).parent / "veriroll")


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> dict:
    for _ in range(int(seconds * 10)):
        if path.exists():
            return json.loads(path.read_text())
        assert proc.poll() is None, f"process exited early with {proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"{path} did not appear")


def test_two_node_processes_fetch_weights_from_the_origin_relay_and_get_groups_accepted(tmp_path):
    base = make_coordinator_dir(tmp_path, {"shardcast.origin_port": 0, "shardcast.shard_bytes": 65536})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    coord = subprocess.Popen([VERIROLL, "coordinator", "run", "--dir", str(base), "--log-level", "warning"], env=env)
    nodes, node_ids = [], []
    try:
        ports = wait_for(base / "ports.json", coord)
        assert ports.get("origin", "").startswith("http://127.0.0.1:")
        for i in range(2):
            key = tmp_path / f"node{i}.key"
            node_ids.append(write_keypair(key).node_id)
            nodes.append(subprocess.Popen([
                VERIROLL, "node", "run", "--coordinator", f"127.0.0.1:{ports['grpc']}", "--ca", str(base / "tls" / "ca.crt"),
                "--key", str(key), "--coordinator-key", str(base / "coordinator.key.pub"),
                "--cache-dir", str(tmp_path / f"cache{i}"), "--max-groups", "2", "--threads", "1",
                "--log-level", "warning"], env=env))
        for p in nodes:
            assert p.wait(timeout=300) == 0
        for i in range(2):
            fetched = tmp_path / f"cache{i}" / node_ids[i] / "v000000"  # one folder per key
            assert (fetched / "model.safetensors").read_bytes() == \
                (base / "checkpoints" / "versions" / "v000000" / "model.safetensors").read_bytes()
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        coord.terminate()
        coord.wait(timeout=60)
    db = st.Database(base / "state.db")
    summary = db.run_sync(st.status_summary)
    per_node = db.run_sync(lambda c: [r[0] for r in c.execute("SELECT accepted_groups FROM nodes")])
    db.close()
    assert summary["accepted_groups"] == 4 and sorted(per_node) == [2, 2]
    assert summary["rejections_by_reason"] == {}
