"""The ``veriroll shardcast`` and ``veriroll relay`` commands, run as separate processes."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time

import pytest
from shardcast_helpers import REPO, SHARD, cli, free_port

from veriroll.shardcast.cli import register
from veriroll.shardcast.store import list_versions

pytestmark = pytest.mark.timeout(180)


def test_register_adds_the_shardcast_and_relay_commands_to_a_parser():
    parser = argparse.ArgumentParser(prog="veriroll")
    register(parser.add_subparsers(dest="command", required=True))
    publish = parser.parse_args(["shardcast", "publish", "ck", "--store", "s", "--key", "k", "--version", "3",
                                 "--shard-size", "1M", "--keep", "2"])  # fmt: skip
    assert (publish.version, publish.shard_size, publish.keep) == (3, 1 << 20, 2) and callable(publish.func)
    fetch = parser.parse_args(["shardcast", "fetch", "--relay", "a", "--relay", "b", "--coordinator-key", "k.pub",
                               "--out", "o"])  # fmt: skip
    assert fetch.relay == ["a", "b"] and fetch.version == "latest" and callable(fetch.func)
    relay = parser.parse_args(["relay", "run", "--store", "s", "--port", "0", "--coordinator-key", "k.pub",
                               "--upstream", "u"])  # fmt: skip
    assert relay.upstream == ["u"] and relay.host == "127.0.0.1" and callable(relay.func)
    assert publish.func is not fetch.func is not relay.func


def test_cli_publish_writes_versions_and_keeps_k(checkpoint, coord_key, tmp_path):
    key = str(tmp_path / "keys/coordinator.key")
    for v in (1, 2, 3):
        done = cli("shardcast", "publish", str(checkpoint), "--store", str(tmp_path / "s"), "--key", key,
                   "--version", str(v), "--shard-size", str(SHARD), "--keep", "2")  # fmt: skip
        assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["removed_versions"] == [1]
    assert list_versions(tmp_path / "s") == [2, 3]
    again = cli(
        "shardcast",
        "publish",
        str(checkpoint),
        "--store",
        str(tmp_path / "s"),
        "--key",
        key,
        "--version",
        "3",
    )
    assert again.returncode == 9 and "already" in again.stderr
    missing = cli("shardcast", "publish", str(tmp_path / "nope"), "--store", str(tmp_path / "s"), "--key", key,
                  "--version", "4")  # fmt: skip
    assert missing.returncode == 9 and "does not exist" in missing.stderr


def test_cli_fetch_exit_statuses_name_the_failure(store, coord_key, other_key, tmp_path):
    pub = str(tmp_path / "keys/coordinator.key.pub")
    wrong = str(tmp_path / "keys/impostor.key.pub")
    unreachable = cli("shardcast", "fetch", "--relay", f"http://127.0.0.1:{free_port()}", "--coordinator-key", pub,
                      "--out", str(tmp_path / "o1"), "--timeout", "1")  # fmt: skip
    assert unreachable.returncode == 3, unreachable.stderr
    assert "none of the 1 relays answered" in unreachable.stderr

    port = free_port()
    relay = subprocess.Popen(
        [sys.executable, "-m", "veriroll.shardcast.cli", "relay", "run", "--store", str(store), "--port", str(port),
         "--coordinator-key", pub], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            ok = cli(
                "shardcast", "fetch", "--relay", url, "--coordinator-key", pub, "--out", str(tmp_path / "o2")
            )
            if ok.returncode != 3:
                break
            time.sleep(0.1)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout.strip().splitlines()[-1])["version"] == 1
        gone = cli("shardcast", "fetch", "--relay", url, "--coordinator-key", pub, "--out", str(tmp_path / "o3"),
                   "--version", "5")  # fmt: skip
        assert gone.returncode == 5, gone.stderr
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
    # A relay started with another key serves nothing of ours; a fake relay with forged manifests is
    # covered above. Here: the client configured with the wrong key refuses the real manifest.
    relay = subprocess.Popen(
        [sys.executable, "-m", "veriroll.shardcast.cli", "relay", "run", "--store", str(store), "--port", str(port),
         "--coordinator-key", pub], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(200):
            bad = cli("shardcast", "fetch", "--relay", f"http://127.0.0.1:{port}", "--coordinator-key", wrong,
                      "--out", str(tmp_path / "o4"))  # fmt: skip
            if bad.returncode != 3:
                break
            time.sleep(0.1)
        assert bad.returncode == 4, bad.stderr
        assert not (tmp_path / "o4").exists()
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
