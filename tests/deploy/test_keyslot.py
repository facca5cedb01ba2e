"""Replicas of one compose node service each get their own key, and get the same keys back after a restart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from veriroll.deploy import keyslot

# Stands in for `veriroll node run`: prints the arguments the slot added, then runs until stopped.
NODE = [sys.executable, "-c", "import sys, time; print(' '.join(sys.argv[1:]), flush=True); time.sleep(3600)"]


def test_two_claims_get_different_slots_and_a_released_slot_is_taken_again(tmp_path):
    first, fd1 = keyslot.claim_slot(tmp_path / "node")
    second, fd2 = keyslot.claim_slot(tmp_path / "node")
    assert (first, second) == (1, 2)
    os.close(fd1)  # the first node exits
    again, fd3 = keyslot.claim_slot(tmp_path / "node")
    assert again == 1
    os.close(fd2)
    os.close(fd3)


def test_all_slots_held_is_an_error_not_a_shared_key(tmp_path):
    _, fd = keyslot.claim_slot(tmp_path / "node", max_slots=1)
    with pytest.raises(keyslot.SlotError, match="held by running nodes"):
        keyslot.claim_slot(tmp_path / "node", max_slots=1)
    os.close(fd)


def test_slot_command_adds_the_slot_key_and_a_display_name():
    cmd = keyslot.slot_command(["veriroll", "node", "run"], Path("/keys/node"), 3)
    assert cmd == ["veriroll", "node", "run", "--key", "/keys/node/3/node.key", "--create-key",
                   "--display-name", "node-3"]
    with pytest.raises(keyslot.SlotError, match="leave --key out"):
        keyslot.slot_command(["veriroll", "node", "run", "--key", "k"], Path("/keys/node"), 1)


def _start(root: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "veriroll.deploy.keyslot", "--dir", str(root), "--", *NODE],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    args = proc.stdout.readline().split()
    return proc, args[args.index("--key") + 1]


def test_the_node_process_keeps_its_slot_until_it_exits(tmp_path):
    root = tmp_path / "node"
    procs = []
    try:
        a, key_a = _start(root)
        procs.append(a)
        b, key_b = _start(root)
        procs.append(b)
        # The lock went across exec into the node itself: while it runs, nobody else gets its key.
        assert key_a == str(root / "1" / "node.key") and key_b == str(root / "2" / "node.key")
        a.terminate()
        a.wait()
        c, key_c = _start(root)  # a replica recreated after `docker compose down`/`up`
        procs.append(c)
        assert key_c == key_a
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()


def test_a_node_command_with_its_own_key_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "veriroll.deploy.keyslot", "--dir", str(tmp_path / "node"), "--",
                          "veriroll", "node", "run", "--key", "x.key"], capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "leave --key out" in out.stderr
