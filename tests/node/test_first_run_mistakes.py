"""A volunteer's first-hour mistakes end at once with the fix: real ``veriroll node`` commands against a real
TLS coordinator process (issue 15).

Each mistake of :data:`veriroll.node.mistakes.MISTAKES` must exit 2 with its fix in the output, without a
traceback and without retrying. The subprocess timeout only keeps a hung command from hanging the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import make_coordinator_dir

from veriroll.node.mistakes import EXIT_CODE, MISTAKES, MistakeSetup
from veriroll.protos.identity import write_keypair

VERIROLL = str(Path(sys.executable).parent / "veriroll")
HANG_GUARD_S = 120


def veriroll(*argv: str, env: dict | None = None, timeout: float = HANG_GUARD_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([VERIROLL, *argv], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A coordinator process (TLS, on loopback) and the files the mistakes are made from."""
    from veriroll.coordinator.tls import create_tls

    root = tmp_path_factory.mktemp("first-run")
    base = make_coordinator_dir(root)
    with open(root / "coordinator.log", "ab") as log:  # the child keeps its own copy of the descriptor
        coord = subprocess.Popen([VERIROLL, "coordinator", "run", "--dir", str(base), "--log-level", "warning"],
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not (base / "ports.json").exists():
            assert coord.poll() is None and time.monotonic() < deadline, (root / "coordinator.log").read_text()
            time.sleep(0.1)
        ports = json.loads((base / "ports.json").read_text())
        key = root / "node" / "node.key"
        write_keypair(key)
        yield MistakeSetup(work=root / "work", coordinator=f"127.0.0.1:{ports['grpc']}", ca=base / "tls" / "ca.crt",
                           not_grpc_port=ports["http"], other_ca=create_tls(root / "other-tls")["ca_cert"], key=key)
    finally:
        os.killpg(coord.pid, signal.SIGTERM)
        coord.wait(timeout=60)


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_each_first_run_mistake_ends_with_its_fix(setup, mistake, tmp_path):
    t0 = time.monotonic()
    # No key at the default path either: the advice is the one a new volunteer gets.
    done = veriroll(*mistake.argv(setup), env={"VERIROLL_NODE_KEY": str(tmp_path / "default" / "node.key")})
    print(f"{mistake.name}: exit {done.returncode} after {time.monotonic() - t0:.1f}s\n{done.stderr}")
    out = done.stdout + done.stderr
    assert done.returncode == EXIT_CODE, out
    assert mistake.fix in out, out
    assert "Traceback" not in out, out
    assert "retrying" not in out and "Trying again" not in out, out


def test_a_key_in_the_default_place_is_named_instead_of_making_a_second_one(setup, tmp_path):
    default = tmp_path / "config" / "node.key"
    write_keypair(default)
    done = veriroll("node", "credits", "--coordinator", setup.coordinator, "--ca", str(setup.ca),
                    "--key", str(tmp_path / "elsewhere.key"), env={"VERIROLL_NODE_KEY": str(default)})
    assert done.returncode == 2, done.stderr
    assert f"your key from `veriroll keygen` is {default}: leave out --key" in done.stderr
    assert "--out" not in done.stderr  # no command that would make another identity


def test_without_any_key_node_run_says_to_run_keygen(setup, tmp_path):
    default = tmp_path / "config" / "node.key"
    done = veriroll("node", "run", "--coordinator", setup.coordinator, "--ca", str(setup.ca),
                    env={"VERIROLL_NODE_KEY": str(default)})
    assert done.returncode == 2, done.stderr
    assert f"no key file at {default}" in done.stderr
    assert f"create it with `veriroll keygen` (it writes {default})" in done.stderr


def test_keygen_doctor_and_credits_share_the_default_key(setup, tmp_path):
    env = {"VERIROLL_NODE_KEY": str(tmp_path / "config" / "node.key")}
    keygen = veriroll("keygen", env=env)
    assert keygen.returncode == 0, keygen.stderr
    assert "every `veriroll node` command uses it when --key is left out" in keygen.stderr
    node_id = keygen.stdout.strip()
    where = ["--coordinator", setup.coordinator, "--ca", str(setup.ca)]
    doctor = veriroll("node", "doctor", *where, "--cache-dir", str(tmp_path / "cache"), "--json", env=env)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["key"]["data"]["node_id"] == node_id and checks["signed call"]["data"]["registered"], doctor.stdout
    credits = veriroll("node", "credits", *where, "--json", env=env)
    assert credits.returncode == 0, credits.stderr
    assert json.loads(credits.stdout)["node_id"] == node_id


def test_a_clock_outside_the_coordinators_window_ends_with_the_ntp_fix(tmp_path):
    """The one startup check that needs a signed call: the coordinator refuses the timestamp of Register."""
    import asyncio

    from support import running_coordinator

    from veriroll.coordinator.service import now_ms

    key = tmp_path / "node.key"
    write_keypair(key)

    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with running_coordinator(base) as coord:
            coord.service.clock = lambda: now_ms() + 600_000  # the coordinator's clock is 10 minutes ahead
            return await asyncio.to_thread(
                veriroll, "node", "run", "--coordinator", f"127.0.0.1:{coord.grpc_port}", "--ca",
                str(base / "tls" / "ca.crt"), "--key", str(key), "--cache-dir", str(tmp_path / "cache"),
                "--engine", "torch", "--threads", "1", "--checkpoint-dir", str(base / "checkpoints" / "versions"))

    done = asyncio.run(scenario())
    assert done.returncode == 2, done.stderr
    assert "clock_skew" in done.stderr and "timedatectl set-ntp true" in done.stderr
    assert "Traceback" not in done.stderr
