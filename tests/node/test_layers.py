"""The node imports only the layers below it (DESIGN.md, "Layout"): never the CLI, the coordinator or the
test network's side (where the adversaries live), which reach it through the hooks it offers."""

from __future__ import annotations

import ast
from pathlib import Path

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
