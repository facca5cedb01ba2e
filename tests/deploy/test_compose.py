"""The compose file and the process testnet launch one topology; every container runs a real command,
keeps its state on named volumes, restarts, and publishes nothing beyond loopback unless asked."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import make_coordinator_dir, running_coordinator

from veriroll.cli.main import build_parser
from veriroll.coordinator.app import load_coordinator_config
from veriroll.deploy import compose, keyslot, lock
from veriroll.deploy.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SPEC = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
SERVICES = SPEC["services"]
ONE_SHOT = {"coordinator-init", "coordinator-public"}
NODE_SERVICES = sorted(n for n, s in SERVICES.items() if s.get("command", [])[:3] == ["python", "-m", "veriroll.deploy.keyslot"])
SOURCE_FOLDERS = ("protos", "toploc", "shardcast", "node", "coordinator", "deploy", "cli")


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` substitution and ``$$`` escape, enough for this file."""
    value = re.sub(r"\$\{([A-Z0-9_]+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), value)
    return value.replace("$$", "$")


def env_example() -> dict[str, str]:
    lines = (DEPLOY / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def run_command(name: str) -> list[str]:
    """The veriroll command a service runs in the end (a node's, after its key slot is claimed)."""
    cmd = SERVICES[name]["command"]
    if name in NODE_SERVICES:
        args = keyslot.build_parser().parse_args(cmd[3:])
        inner = args.command[1:] if args.command[:1] == ["--"] else args.command
        return keyslot.slot_command(inner, args.dir, 1)
    return cmd


def test_compose_file_is_generated_from_the_current_topology():
    assert compose.main(["--check"]) == 0, "run `python -m veriroll.deploy.compose`"


def test_compose_services_match_the_testnet_topology():
    cfg = load_topology()
    assert SERVICES["node"]["deploy"]["replicas"] == cfg.honest_nodes
    adversaries = sorted(s for s in SERVICES if s.startswith("adversary-"))
    assert [s.split("-", 2)[2] for s in adversaries] == sorted(cfg.adversaries)
    for relay in cfg.relay_order():
        cmd = SERVICES[relay.name]["command"]
        upstream = cmd[cmd.index("--upstream") + 1]
        assert upstream == compose.relay_url(cfg, relay.upstream)
        fallbacks = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--fallback-upstream"]
        assert fallbacks == [compose.relay_url(cfg, f) for f in relay.fallback]
    # Nodes fetch from the leaves of the relay chain first, as in the process testnet.
    node_cmd = run_command("node")
    relays = [node_cmd[i + 1] for i, a in enumerate(node_cmd) if a == "--relay"]
    assert relays == [compose.relay_url(cfg, r.name) for r in reversed(cfg.relay_order())]


@pytest.mark.parametrize("name", [n for n in SERVICES if SERVICES[n].get("command", [""])[0] in ("veriroll", "python")])
def test_every_service_command_is_a_real_cli_command(name):
    command = run_command(name)
    assert command[0] == "veriroll"
    try:
        args = build_parser().parse_args(command[1:])
    except SystemExit as exc:  # argparse exits on unknown commands or flags
        pytest.fail(f"{name}: `{shlex.join(command)}` is not a valid veriroll command ({exc})")
    assert callable(args.func)


def test_nodes_and_relays_read_only_what_coordinator_public_copies_out():
    copy = SERVICES["coordinator-public"]["command"]
    assert copy[0] == "cp" and copy[-1] == f"{compose.PUBLIC_DIR}/"
    copied = {f"{compose.PUBLIC_DIR}/{Path(src).name}" for src in copy[1:-1]}
    for name in [*NODE_SERVICES, *(r.name for r in load_topology().relay_order())]:
        cmd = run_command(name)
        used = {cmd[i + 1] for i, a in enumerate(cmd) if a in ("--ca", "--coordinator-key")}
        assert used and used <= copied, name
        # The coordinator's directory holds its signing key and TLS key: only the coordinator's services mount it.
        assert not any(v.startswith("coordinator-data:") for v in SERVICES[name]["volumes"]), name


def run_init(command: list[str], coord_dir: Path) -> Path:
    """Run a compose file's coordinator-init command here, with ``coord_dir`` for the container's directory."""
    argv = [str(coord_dir) if a == compose.COORD_DIR else a for a in command]
    out = subprocess.run([str(Path(sys.executable).parent / "veriroll"), *argv[1:]], capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"), check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return coord_dir


def test_compose_init_and_run_settings_make_a_valid_coordinator(tmp_path):
    coord_dir = run_init(SERVICES["coordinator-init"]["command"], tmp_path / "coordinator")
    # What coordinator-public copies out exists where it looks.
    assert all((coord_dir / Path(src).relative_to(compose.COORD_DIR)).is_file()
               for src in SERVICES["coordinator-public"]["command"][1:-1])
    run = SERVICES["coordinator"]["command"]
    overrides = [interpolate(run[i + 1], {}) for i, a in enumerate(run) if a == "--set"]
    cfg = load_coordinator_config(coord_dir, overrides=overrides)
    assert (cfg.server.port, cfg.server.http_port, cfg.shardcast.origin_port) == (
        compose.GRPC_PORT, compose.HTTP_PORT, compose.ORIGIN_PORT)
    assert cfg.identity.exempt_networks == [env_example()["VERIROLL_NODE_RANGE"]]


def test_coordinator_healthcheck_passes_only_while_the_coordinator_serves(tmp_path):
    check = SERVICES["coordinator"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"]
    assert f"http://127.0.0.1:{compose.HTTP_PORT}/healthz" in check[3]
    base = make_coordinator_dir(tmp_path)

    async def probe(port: int) -> int:
        code = check[3].replace(f":{compose.HTTP_PORT}/", f":{port}/")
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stderr=asyncio.subprocess.DEVNULL)
        return await proc.wait()

    async def scenario():
        async with running_coordinator(base) as coord:
            port = coord.http_port
            serving = await probe(port)
        return serving, await probe(port)

    serving, stopped = asyncio.run(scenario())
    assert serving == 0
    assert stopped != 0


def test_long_running_services_restart_unless_stopped():
    for name, svc in SERVICES.items():
        if name in ONE_SHOT:
            assert "restart" not in svc, name
        else:
            assert svc["restart"] == "unless-stopped", name
    for name in SERVICES.keys() - ONE_SHOT - {"prometheus", "grafana"}:
        assert SERVICES[name].get("init") is True, f"{name}: tini passes SIGTERM on"


def test_keys_and_state_live_on_named_volumes():
    declared = set(SPEC["volumes"])
    assert {"coordinator-data", "node-keys"} <= declared
    for svc in SERVICES.values():
        for mount in svc.get("volumes", []):
            source = mount.split(":", 1)[0]
            assert source.startswith("./") or source in declared, mount
    assert "coordinator-data:/data/coordinator" in SERVICES["coordinator"]["volumes"]
    key_dirs = []
    for name in NODE_SERVICES:
        assert f"node-keys:{compose.KEYS_DIR}" in SERVICES[name]["volumes"], name
        key = run_command(name)[run_command(name).index("--key") + 1]
        assert key.startswith(f"{compose.KEYS_DIR}/") and "--create-key" in run_command(name)
        key_dirs.append(Path(key).parent.parent)
    # Each service has its own folder of slots on the shared volume: no two services' replicas share a key.
    assert len(set(key_dirs)) == len(NODE_SERVICES) >= 3


def test_published_ports_bind_loopback_unless_the_operator_opts_in():
    views = {compose.HTTP_PORT, 9090, 3000}
    published = {}
    for name, svc in SERVICES.items():
        for port in svc.get("ports", []):
            addr, host, container = port.rsplit(":", 2)
            assert host == container
            published[int(host)] = name
            assert interpolate(addr, {}) == "127.0.0.1", port
            var = "VERIROLL_DASHBOARD_ADDR" if int(host) in views else "VERIROLL_PUBLISH_ADDR"
            assert interpolate(addr, {var: "0.0.0.0"}) == "0.0.0.0", port
    assert published == {compose.GRPC_PORT: "coordinator", compose.ORIGIN_PORT: "coordinator",
                         compose.HTTP_PORT: "coordinator", 9090: "prometheus", 3000: "grafana"}


def test_grafana_has_no_default_login():
    grafana = SERVICES["grafana"]
    assert interpolate(grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"], {"GRAFANA_ADMIN_PASSWORD": "s3cret"}) == "s3cret"
    assert env_example()["GRAFANA_ADMIN_PASSWORD"] == ""
    # Its entrypoint refuses to start Grafana without a password (run here with /run.sh absent).
    shell, flag, script = grafana["entrypoint"]
    script = interpolate(script, {})
    env = {k: v for k, v in os.environ.items() if k != "GF_SECURITY_ADMIN_PASSWORD"}
    refused = subprocess.run([shell, flag, script], capture_output=True, text=True, env=env, check=False)
    assert refused.returncode == 1 and "GRAFANA_ADMIN_PASSWORD" in refused.stderr
    started = subprocess.run([shell, flag, script], capture_output=True, text=True, check=False,
                             env={**env, "GF_SECURITY_ADMIN_PASSWORD": "s3cret"})
    assert started.returncode == 127 and "/run.sh" in started.stderr  # it got as far as exec'ing Grafana


def test_env_example_names_every_variable_with_the_compose_defaults():
    text = (DEPLOY / "docker-compose.yml").read_text()
    defaults = dict(re.findall(r"\$\{([A-Z0-9_]+):-([^}]*)\}", text))
    example = env_example()
    assert example == defaults


def test_network_exempts_the_containers_range_but_not_the_gateway():
    (ipam,) = SPEC["networks"]["default"]["ipam"]["config"]
    subnet = ipaddress.ip_network(interpolate(ipam["subnet"], {}))
    containers = ipaddress.ip_network(interpolate(ipam["ip_range"], {}))
    assert containers.subnet_of(subnet) and containers != subnet
    gateway = next(subnet.hosts())  # Docker's default gateway: the first address
    assert gateway not in containers
    run = SERVICES["coordinator"]["command"]
    assert f'identity.exempt_networks=["{ipam["ip_range"]}"]' in run


def _instructions(dockerfile: str) -> list[str]:
    return [line for line in (DEPLOY / dockerfile).read_text().splitlines() if line and not line.startswith((" ", "#"))]


@pytest.mark.parametrize("dockerfile, requirements", [("Dockerfile", "requirements-cpu.txt"),
                                                      ("Dockerfile.gpu", "requirements-gpu.txt")])
def test_images_install_pinned_dependencies_before_the_source(dockerfile, requirements):
    steps = _instructions(dockerfile)
    copy_lock = steps.index(f"COPY deploy/{requirements} /tmp/requirements.txt")
    install_lock = steps.index("RUN pip install -r /tmp/requirements.txt")
    first_source = min(steps.index(f"COPY {folder} {folder}") for folder in SOURCE_FOLDERS)
    install_source = next(i for i, s in enumerate(steps) if s.startswith("RUN pip install --no-deps . && pip check"))
    assert copy_lock < install_lock < first_source < install_source
    assert steps.index("COPY pyproject.toml README.md ./") > install_lock
    # Runs as a non-root user, the same uid in both images: they share the key volume.
    assert "USER veriroll" in steps[install_source:]
    assert any("useradd --uid 10001" in s for s in steps)
    # Only what the image copies goes into the build context (not .venv or runs/).
    ignore = (DEPLOY / f"{dockerfile}.dockerignore").read_text().splitlines()
    assert "*" in ignore and {f"!{f}" for f in SOURCE_FOLDERS} <= set(ignore) and "deploy/.env" in ignore


def test_gpu_image_base_matches_the_cuda_of_its_torch():
    base = next(s for s in _instructions("Dockerfile.gpu") if s.startswith("FROM "))
    cuda = re.fullmatch(r"FROM nvidia/cuda:(\d+)\.(\d+)\.\d+-runtime-ubuntu24\.04", base)
    assert cuda, base
    gpu = lock.read_pins(lock.GPU_LOCK)
    assert gpu["nvidia-cuda-runtime"].split(".")[:2] == [cuda.group(1), cuda.group(2)]
    assert gpu["torch"] == lock.read_pins(lock.CPU_LOCK)["torch"].split("+")[0]
