"""``veriroll node doctor`` against a real coordinator (TLS on loopback) and a real shardcast relay, and
against what goes wrong for volunteers: a stopped coordinator, the wrong CA, a skewed clock, a bad or
exposed key file, a relay of another network, a full disk."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from pathlib import Path

import pytest
from support import make_coordinator_dir, running_coordinator

from veriroll.cli.main import main as veriroll_main
from veriroll.node import doctor
from veriroll.node.config import NodeConfig
from veriroll.node.doctor import FAIL, OK, SKIP, WARN, check_disk, check_key, format_report, report
from veriroll.protos.identity import load_private_key, write_keypair


def run(coro):
    return asyncio.run(coro)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def relay_signed_by(tmp_path: Path, signer_key_path: Path):
    """A shardcast origin relay holding version 0 of a small checkpoint, signed by ``signer_key_path``."""
    from veriroll.shardcast.publish import publish_checkpoint
    from veriroll.shardcast.relay import RelayServer

    key = load_private_key(signer_key_path)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(os.urandom(2 * 1024 * 1024))
    store = tmp_path / f"store-{key.node_id[:8]}"
    publish_checkpoint(ckpt, store, key, 0, shard_size=256 * 1024)
    async with RelayServer(store, key.public, port=0) as relay:
        yield relay


@pytest.fixture()
def node_key(tmp_path) -> Path:
    path = tmp_path / "node" / "node.key"
    write_keypair(path)
    return path


def node_cfg(coord, key: Path, tmp_path: Path, **kw) -> NodeConfig:
    fields = {"coordinator": f"127.0.0.1:{coord.grpc_port}", "ca": str(coord.base_dir / "tls" / "ca.crt"),
              "key": str(key), "cache_dir": str(tmp_path / "cache"), **kw}
    return NodeConfig(**fields)


def statuses(checks) -> dict[str, str]:
    return {c.name: c.status for c in checks}


def by_name(checks):
    return {c.name: c for c in checks}


def test_everything_passes_against_a_healthy_coordinator_and_relay(tmp_path, node_key):
    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with relay_signed_by(tmp_path, base / "coordinator.key") as relay, \
                running_coordinator(base, overrides=[f"shardcast.relays=['{relay.url}']"]) as coord:
            checks = await doctor.run_doctor(node_cfg(coord, node_key, tmp_path), min_free_bytes=1024)
            # A second run finds the key registered and uses a plain Heartbeat.
            again = await doctor.run_doctor(node_cfg(coord, node_key, tmp_path), min_free_bytes=1024)
            nodes = await coord.db.run(lambda c: c.execute("SELECT node_id FROM nodes").fetchall())
            return relay.url, checks, again, [r[0] for r in nodes]

    url, checks, again, nodes = run(scenario())
    assert statuses(checks) == {"key": OK, "coordinator": OK, "tls": OK, "signed call": OK, "clock": OK,
                                f"relay {url}": OK, "disk": OK, "torch build": OK}, format_report(checks)
    c = by_name(checks)
    node_id = load_private_key(node_key).node_id
    assert c["key"].data["node_id"] == node_id and nodes == [node_id]
    assert c["signed call"].data["registered"] is True and c["signed call"].data["standing"] == "probation"
    assert by_name(again)["signed call"].data["registered"] is False
    assert abs(c["clock"].data["skew_s"]) < 2
    relay = c[f"relay {url}"].data
    assert relay["latest"] == 0 and relay["sample_bytes"] == relay["checkpoint_bytes"] - 2  # all of model.safetensors
    assert relay["bytes_per_s"] > 0
    assert report(checks)["ok"] is True
    assert "all checks passed" in format_report(checks)


def test_stopped_coordinator_is_named_and_later_checks_are_skipped(tmp_path, node_key):
    ca = make_coordinator_dir(tmp_path) / "tls" / "ca.crt"
    cfg = NodeConfig(coordinator=f"127.0.0.1:{free_port()}", ca=str(ca), key=str(node_key),
                     cache_dir=str(tmp_path / "cache"))
    checks = run(doctor.run_doctor(cfg, min_free_bytes=1024))
    c = by_name(checks)
    assert c["coordinator"].status == FAIL and "connection refused" in c["coordinator"].detail
    assert "running" in c["coordinator"].advice and c["coordinator"].transient  # `node run` waits for it
    assert c["tls"].status == c["signed call"].status == c["clock"].status == SKIP
    assert c["key"].status == OK and c["disk"].status == OK
    assert report(checks)["ok"] is False
    assert "1 problem to fix: coordinator" in format_report(checks)


def test_wrong_ca_is_reported_as_a_certificate_problem(tmp_path, node_key):
    from veriroll.coordinator.tls import create_tls

    other = create_tls(tmp_path / "other-tls")["ca_cert"]

    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with running_coordinator(base) as coord:
            return await doctor.run_doctor(node_cfg(coord, node_key, tmp_path, ca=str(other)), min_free_bytes=1024)

    c = by_name(run(scenario()))
    assert c["coordinator"].status == OK
    assert c["tls"].status == FAIL
    assert "not signed by the CA" in c["tls"].detail and "ca.crt" in c["tls"].advice
    assert c["signed call"].status == SKIP


def test_wrong_server_name_is_told_apart_from_a_wrong_ca(tmp_path, node_key):
    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with running_coordinator(base) as coord:
            return await doctor.run_doctor(node_cfg(coord, node_key, tmp_path, server_name="coordinator.example"),
                                    min_free_bytes=1024)

    c = by_name(run(scenario()))
    assert c["tls"].status == FAIL and "not valid for 'coordinator.example'" in c["tls"].detail
    assert "--server-name" in c["tls"].advice


def test_skewed_clock_is_measured_inside_the_window_and_refused_outside_it(tmp_path, node_key):
    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with running_coordinator(base) as coord:
            cfg = node_cfg(coord, node_key, tmp_path)
            return [await doctor.run_doctor(cfg, clock_offset_s=off, min_free_bytes=1024) for off in (12.0, 45.0, 600.0)]

    slight, inside, outside = (by_name(c) for c in run(scenario()))
    assert slight["clock"].status == WARN and slight["clock"].data["skew_s"] == pytest.approx(-12.0, abs=1.5)
    assert "ahead of" in slight["clock"].detail and "timedatectl" in slight["clock"].advice
    assert inside["clock"].status == FAIL and inside["clock"].data["skew_s"] == pytest.approx(-45.0, abs=1.5)
    assert "ahead of" in inside["clock"].detail
    assert outside["clock"].status == FAIL and outside["clock"].data == {"refused": True}
    assert "+600" in outside["clock"].detail  # the coordinator's own measurement
    assert outside["signed call"].status == OK


def test_clock_behind_the_coordinator_is_measured_too(tmp_path, node_key):
    from veriroll.coordinator.service import now_ms

    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with running_coordinator(base) as coord:
            cfg = node_cfg(coord, node_key, tmp_path)
            # Signed before the coordinator started: it refuses the timestamp (a clock that is behind).
            before_start = await doctor.run_doctor(cfg, clock_offset_s=-20.0, min_free_bytes=1024)
            coord.service.clock = lambda: now_ms() + 20_000  # the coordinator's clock runs 20 s ahead of ours
            behind = await doctor.run_doctor(cfg, min_free_bytes=1024)
            return by_name(before_start), by_name(behind)

    before_start, behind = run(scenario())
    assert before_start["clock"].status == WARN and "behind" in before_start["clock"].detail
    assert behind["clock"].status == WARN and behind["clock"].data["skew_s"] == pytest.approx(20.0, abs=1.5)
    assert "20.0s behind the coordinator" in behind["clock"].detail


def test_relay_of_another_network_and_a_dead_relay_fail(tmp_path, node_key):
    stranger = tmp_path / "stranger.key"
    write_keypair(stranger)
    dead = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with relay_signed_by(tmp_path, stranger) as relay, running_coordinator(base) as coord:
            cfg = node_cfg(coord, node_key, tmp_path, relays=[relay.url, dead])
            return relay.url, await doctor.run_doctor(cfg, min_free_bytes=1024)

    url, checks = run(scenario())
    c = by_name(checks)
    assert c[f"relay {url}"].status == FAIL and "not signed by the coordinator" in c[f"relay {url}"].detail
    assert c[f"relay {dead}"].status == FAIL and "/status" in c[f"relay {dead}"].detail
    assert c["signed call"].status == OK


def test_banned_key_fails_the_signed_call(tmp_path, node_key):
    from veriroll.coordinator import store as st

    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with running_coordinator(base) as coord:
            cfg = node_cfg(coord, node_key, tmp_path)
            await doctor.run_doctor(cfg, min_free_bytes=1024)  # registers the key
            nid = load_private_key(node_key).node_id
            await coord.db.run(lambda c: st.set_standing(c, nid, "banned", "operator: test"))
            coord.service.ledger.forget(nid)  # the ban shows at once, not after the cache's 2 s
            return await doctor.run_doctor(cfg, min_free_bytes=1024)

    c = by_name(run(scenario()))
    assert c["signed call"].status == FAIL and "banned" in c["signed call"].detail
    assert "veriroll node credits" in c["signed call"].advice


def test_key_file_problems_each_get_their_own_advice(tmp_path, node_key):
    missing = check_key(tmp_path / "nope.key")
    assert missing.status == FAIL and "veriroll keygen" in missing.advice and not missing.transient

    os.chmod(node_key, 0o644)
    exposed = check_key(node_key)
    assert exposed.status == FAIL and f"`chmod 600 {node_key}`" in exposed.advice and "0644" in exposed.detail

    garbage = tmp_path / "garbage.key"
    fd = os.open(garbage, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a key\n")
    os.close(fd)
    broken = check_key(garbage)
    assert broken.status == FAIL and "not a veriroll node key" in broken.advice

    os.chmod(node_key, 0o600)
    assert check_key(node_key).status == OK


def test_disk_shortfall_fails_and_tight_space_warns(tmp_path):
    free = __import__("shutil").disk_usage(tmp_path).free
    assert check_disk(tmp_path / "cache" / "deeper", free * 4).status == FAIL
    assert check_disk(tmp_path, int(free * 0.8)).status == WARN
    assert check_disk(tmp_path, 1024).status == OK


def test_cli_prints_json_and_exits_nonzero_on_failure(tmp_path, node_key, capsys):
    args = ["node", "doctor", "--coordinator", f"127.0.0.1:{free_port()}", "--key", str(node_key),
            "--cache-dir", str(tmp_path), "--timeout-s", "2", "--json"]
    assert veriroll_main(args) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert [c["name"] for c in out["checks"]][:5] == ["key", "coordinator", "tls", "signed call", "clock"]


def test_cli_exits_zero_when_all_checks_pass(tmp_path, node_key, capsys):
    async def scenario():
        base = make_coordinator_dir(tmp_path)
        async with running_coordinator(base) as coord:
            args = ["node", "doctor", "--coordinator", f"127.0.0.1:{coord.grpc_port}", "--ca",
                    str(base / "tls" / "ca.crt"), "--key", str(node_key), "--cache-dir", str(tmp_path),
                    "--set", "keep_versions=1"]
            # The CLI runs its own event loop; give it a thread so this one keeps serving.
            return await asyncio.to_thread(veriroll_main, args)

    code = run(scenario())
    out = capsys.readouterr().out
    assert code == 0, out
    assert "all checks passed" in out


def test_a_new_key_registers_through_the_doctor_paying_the_proof_of_work(tmp_path, node_key):
    async def scenario():
        base = make_coordinator_dir(tmp_path, {"identity.pow_bits": 12})
        async with running_coordinator(base) as coord:
            checks = by_name(await doctor.run_doctor(node_cfg(coord, node_key, tmp_path), clock_offset_s=12.0,
                                                     min_free_bytes=1024))
            return checks, coord.db.run_sync(st.status_summary)

    from veriroll.coordinator import store as st

    checks, summary = run(scenario())
    assert checks["signed call"].status == OK and checks["signed call"].data["registered"] is True
    # The skew is measured on the answered call, not across the time spent solving.
    assert checks["clock"].data["skew_s"] == pytest.approx(-12.0, abs=1.5)
    # (The Heartbeat that found the key unknown, then the Register that asked for the work.)
    assert summary["nodes"] == 1 and summary["rejections_by_reason"] == {"unknown_key": 1, "pow_required": 1}


def test_a_plaintext_coordinator_passes_with_a_warning_and_its_dashboard_port_is_not_grpc(tmp_path, node_key):
    async def scenario():
        base = make_coordinator_dir(tmp_path, tls=False)
        async with running_coordinator(base) as coord:
            cfg = node_cfg(coord, node_key, tmp_path, ca="")
            dashboard = node_cfg(coord, node_key, tmp_path, ca="", coordinator=f"127.0.0.1:{coord.http_port}")
            return by_name(await doctor.run_doctor(cfg, min_free_bytes=1024)), \
                await doctor.coordinator_checks(dashboard, 5.0)

    checks, (_, dashboard_tls) = run(scenario())
    assert checks["tls"].status == WARN and "plaintext" in checks["tls"].detail  # it answered the HTTP/2 greeting
    assert checks["signed call"].status == OK
    assert dashboard_tls.status == FAIL and "web server" in dashboard_tls.detail and not dashboard_tls.transient
    assert "gRPC port" in dashboard_tls.advice


def test_a_torch_build_that_does_not_fit_the_machine_is_a_warning_with_the_install_line(monkeypatch):
    import veriroll.node.install as install

    monkeypatch.setattr(install, "installed_cuda_mb", lambda: 2800.0)  # PyPI's CUDA build...
    monkeypatch.setattr(install, "nvidia_driver_present", lambda: False)  # ...on a machine without a GPU
    monkeypatch.setattr(install, "tested_torch_version", lambda: "2.13.0")
    check = doctor.check_torch_build()
    assert check.status == WARN and "CUDA build" in check.detail
    assert "+cpu" in check.advice and "download.pytorch.org/whl/cpu" in check.advice
