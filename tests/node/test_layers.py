"""The node imports only the layers below it (DESIGN.md, "Layout"): never the CLI, the coordinator or the
test network's side (where the adversaries live), which reach it through the hooks it offers."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from veriroll.deploy.adversary import make_adversary
from veriroll.node.cli import build_agent
from veriroll.node.config import NodeConfig
from veriroll.node.hardware import Hardware
from veriroll.protos.config import ConfigError
from veriroll.protos.identity import write_keypair
from veriroll.protos.service import secure_channel

NODE = Path(__file__).resolve().parents[2] / "node"
ABOVE = ("veriroll.cli", "veriroll.coordinator", "veriroll.deploy")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_no_node_module_imports_a_layer_above_it():
    reaching_up = {f"{path.relative_to(NODE)}: {name}" for path in NODE.rglob("*.py")
                   for name in imported_modules(path) if name.startswith(ABOVE)}
    assert not reaching_up


def test_node_run_gets_the_test_networks_adversaries_from_the_veriroll_command():
    from veriroll.cli.main import build_parser

    args = build_parser().parse_args(["node", "run", "--adversary", "partial-group"])
    assert args.make_adversary("partial-group").kind == "partial-group"


def test_an_adversary_node_is_built_only_with_the_adversary_it_is_handed(tmp_path):
    hw = Hardware(cpu="test", cpu_count=1, ram_bytes=0, disk_free_bytes=0, os="test")
    write_keypair(tmp_path / "node.key")
    cfg = NodeConfig(key=str(tmp_path / "node.key"), cache_dir=str(tmp_path / "cache"), engine="torch", device="cpu",
                     adversary="partial-group")

    async def build(make):
        channel = secure_channel("127.0.0.1:1", None)
        try:
            return build_agent(cfg, channel, hw, make)
        finally:
            await channel.close()

    assert asyncio.run(build(make_adversary)).adversary.kind == "partial-group"
    with pytest.raises(ConfigError, match="without the test network's adversaries"):
        asyncio.run(build(None))
