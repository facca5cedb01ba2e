"""The compose file and the process testnet launch one topology; every container runs a real CLI command."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from veriroll.cli.main import build_parser
from veriroll.deploy import compose
from veriroll.deploy.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_is_generated_from_the_current_topology():
    assert compose.main(["--check"]) == 0, "run `python -m veriroll.deploy.compose`"


def test_compose_services_match_the_testnet_topology():
    cfg = load_topology()
    spec = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    services = spec["services"]
    assert services["node"]["deploy"]["replicas"] == cfg.honest_nodes
    adversaries = sorted(s for s in services if s.startswith("adversary-"))
    assert [s.split("-", 2)[2] for s in adversaries] == sorted(cfg.adversaries)
    for relay in cfg.relay_order():
        cmd = services[relay.name]["command"]
        upstream = cmd[cmd.index("--upstream") + 1]
        assert upstream == compose.relay_url(cfg, relay.upstream)
    # Nodes fetch from the leaves of the relay chain first, as in the process testnet.
    node_cmd = services["node"]["command"]
    relays = [node_cmd[i + 1] for i, a in enumerate(node_cmd) if a == "--relay"]
    assert relays == [compose.relay_url(cfg, r.name) for r in reversed(cfg.relay_order())]
    assert services["coordinator"]["healthcheck"]["test"][0] == "CMD"
    assert "coordinator-data" in spec["volumes"]


def _commands(spec: dict):
    for name, svc in spec["services"].items():
        if "command" in svc and svc["command"][0] == "veriroll":
            yield name, svc["command"]
        hc = svc.get("healthcheck", {}).get("test")
        if hc and hc[0] == "CMD" and hc[1] == "veriroll":
            yield f"{name} healthcheck", hc[1:]


@pytest.mark.parametrize("name, command", list(_commands(yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text()))))
def test_every_service_command_is_a_real_cli_command(name, command):
    try:
        args = build_parser().parse_args(command[1:])
    except SystemExit as exc:  # argparse exits on unknown commands or flags
        pytest.fail(f"{name}: `{shlex.join(command)}` is not a valid veriroll command ({exc})")
    assert callable(args.func)


def test_dockerfiles_install_the_package_and_pin_cpu_torch():
    cpu = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'torch==2.13.0' in cpu and "pip install ." in cpu
    for folder in ("protos", "toploc", "shardcast", "node", "coordinator", "deploy", "cli"):
        assert f"COPY {folder} {folder}" in cpu
    assert '".[vllm]"' in (ROOT / "deploy" / "Dockerfile.gpu").read_text()
