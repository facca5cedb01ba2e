"""An operator's first hour, with the real ``veriroll`` command: ``coordinator init`` ends with what to hand
volunteers, ports stay where they were, a second ``coordinator run`` on the same directory stops at once,
a taken port is named with its setting, and the tiny presets' rate limits fit an honest node."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography import x509
from support import make_coordinator_dir, running_coordinator

from veriroll.coordinator import store as st
from veriroll.coordinator.admission import RateLimiter
from veriroll.coordinator.app import CannotListen, DirectoryInUse, start_coordinator
from veriroll.coordinator.cli import preset_overrides
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.protos.config import load_config

VERIROLL = str(Path(sys.executable).parent / "veriroll")


def veriroll(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([VERIROLL, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_ports(base: Path, proc: subprocess.Popen) -> dict:
    """DIR/ports.json once the coordinator serves (a hang guard, not a speed check)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if (base / "ports.json").exists():
            return json.loads((base / "ports.json").read_text())
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    raise AssertionError("the coordinator did not start")


def test_init_ends_with_the_lines_to_hand_volunteers_and_names_only_paths_that_exist(tmp_path):
    base = tmp_path / "coord"
    out = veriroll("coordinator", "init", "--dir", str(base), "--hostname", "rl.example.org", "--hostname", "203.0.113.7")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "veriroll coordinator run --dir " + str(base) in text
    assert "the address  rl.example.org:50051" in text
    assert "veriroll node run --coordinator rl.example.org:50051 --ca ca.crt --coordinator-key coordinator.key.pub" in text
    assert "veriroll keygen" in text
    named = [word for line in text.splitlines() for word in line.split() if word.startswith(str(tmp_path))]
    assert named and all(Path(p).exists() for p in named), named
    assert ".tmp" not in text and "Writing model shards" not in out.stderr
    assert "127.0.0.1:50051: only this machine can reach it" in text  # it binds loopback until told otherwise
    # The certificate names what volunteers dial: a DNS name as a name, an IP address as an address.
    cert = x509.load_pem_x509_certificate((base / "tls" / "server.crt").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "rl.example.org" in san.get_values_for_type(x509.DNSName)
    assert "203.0.113.7" in {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    assert "203.0.113.7" not in san.get_values_for_type(x509.DNSName)
    cfg = load_config(CoordinatorConfig, base / "coordinator.toml")
    assert (cfg.server.port, cfg.server.http_port, cfg.shardcast.origin_port) == (50051, 8480, 8470)


def test_init_json_names_the_installed_checkpoint_and_the_node_command(tmp_path):
    out = veriroll("coordinator", "init", "--dir", str(tmp_path / "coord"), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert "path" not in summary and Path(summary["checkpoint"]).is_dir()
    assert summary["address"] == "127.0.0.1:50051" and summary["node_command"].startswith("veriroll node run ")


def test_ports_are_fixed_by_default_and_zero_still_picks_a_free_one():
    cfg = CoordinatorConfig()
    assert (cfg.server.port, cfg.server.http_port, cfg.shardcast.origin_port) == (50051, 8480, 8470)

    async def scenario(tmp):
        base = make_coordinator_dir(tmp, {"server.http_port": 0, "shardcast.origin_port": 0})
        async with running_coordinator(base) as coord:
            return coord.grpc_port, coord.http_port, json.loads((base / "ports.json").read_text())

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        grpc_port, http_port, ports = asyncio.run(scenario(Path(tmp)))
    assert grpc_port > 0 and http_port > 0 and ports["grpc"] == grpc_port and ports["http"] == http_port


def test_a_second_coordinator_run_on_the_same_directory_exits_2_at_once_and_a_dead_ones_lock_is_taken_over(tmp_path):
    base = make_coordinator_dir(tmp_path)
    first = subprocess.Popen([VERIROLL, "coordinator", "run", "--dir", str(base), "--log-level", "warning"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ports = wait_for_ports(base, first)
        second = veriroll("coordinator", "run", "--dir", str(base))
        assert second.returncode == 2, second.stderr
        assert f"another coordinator (pid {ports['pid']}) is already running on {base}" in second.stderr
        assert "Traceback" not in second.stderr and "bind" not in second.stderr.lower()
        assert first.poll() is None  # the first one serves on, untouched
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert (base / "coordinator.lock").read_text().strip() == str(ports["pid"])  # left behind by a stopped process

    async def restart():
        async with running_coordinator(base):
            with pytest.raises(DirectoryInUse, match="already running"):
                await start_coordinator(base)
        return (base / "coordinator.lock").read_text().strip()

    assert asyncio.run(restart()) == str(os.getpid())


def test_a_taken_port_is_named_with_the_setting_that_moves_it(tmp_path):
    base = make_coordinator_dir(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def scenario():
            with pytest.raises(CannotListen) as info:
                await start_coordinator(base, overrides=[f"server.http_port={port}"])
            async with running_coordinator(base):  # the failed start released the directory
                pass
            return str(info.value)

        message = asyncio.run(scenario())
    assert f"127.0.0.1:{port}" in message and "server.http_port" in message and "0: any free one" in message


# --- the tiny presets' rate limits ----------------------------------------------------------------------

MEASURED_GROUPS_PER_S = 9.5  # one tiny-arith node on one core of this machine (veriroll node run, 2.5 minutes)


def honest_call_times(groups_per_s: float, seconds: float, heartbeat_s: float = 10.0) -> list[float]:
    """When an honest node calls: a LeaseWork and a SubmitGroup per group, back to back, plus a Heartbeat
    and a GetPolicy (a new version every step) each heartbeat."""
    times = []
    t = 0.0
    while t < seconds:
        times += [t, t + 0.001]
        t += 1 / groups_per_s
    times += [b + d for b in range(0, int(seconds), int(heartbeat_s)) for d in (0.0, 0.002)]
    return sorted(times)


def refused(cfg: CoordinatorConfig, times: list[float]) -> int:
    limiter = RateLimiter(cfg.server.key_rate_per_s, cfg.server.key_burst)
    start = time.monotonic()  # a bucket is created full at the current monotonic time
    return sum(not limiter.allow("key", now=start + t) for t in times)


@pytest.mark.parametrize("preset", ["tiny-arith", "tiny-reverse"])
def test_the_tiny_presets_per_key_rate_fits_an_honest_node_twice_as_fast_as_measured(preset):
    times = honest_call_times(2 * MEASURED_GROUPS_PER_S, 600)
    tiny = load_config(CoordinatorConfig, overrides=preset_overrides(preset))
    assert refused(tiny, times) == 0
    assert refused(CoordinatorConfig(), times) > 0  # the default, sized for real models, would refuse it


@pytest.mark.slow
def test_one_honest_node_on_the_tiny_preset_is_never_rate_limited(tmp_path):
    base = tmp_path / "coord"
    init = veriroll("coordinator", "init", "--dir", str(base), "--preset", "tiny-arith", "--set", "server.port=0",
                    "--set", "server.http_port=0", "--set", "shardcast.origin_port=0", "--json")
    assert init.returncode == 0, init.stderr
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    coord = subprocess.Popen([VERIROLL, "coordinator", "run", "--dir", str(base), "--log-level", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ports = wait_for_ports(base, coord)
        node = subprocess.run([VERIROLL, "node", "run", "--coordinator", f"127.0.0.1:{ports['grpc']}", "--ca",
                               str(base / "tls" / "ca.crt"), "--key", str(tmp_path / "node.key"), "--create-key",
                               "--coordinator-key", str(base / "coordinator.key.pub"), "--cache-dir",
                               str(tmp_path / "cache"), "--threads", "1", "--max-groups", "400"],
                              capture_output=True, text=True, env=env, timeout=900)
        assert node.returncode == 0, node.stderr[-3000:]
    finally:
        coord.send_signal(signal.SIGTERM)
        coord.communicate(timeout=120)
    db = st.Database(base / "state.db")
    try:
        summary = db.run_sync(st.status_summary)
    finally:
        db.close()
    assert summary["accepted_groups"] >= 400
    assert "rate_limited" not in summary["rejections_by_reason"], summary
