"""The README documents every exported metric and keeps the two commands CI relies on."""

from __future__ import annotations

from pathlib import Path

from veriroll.coordinator.metrics import CoordinatorMetrics

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_metric_name_is_documented():
    names = CoordinatorMetrics().registry.metrics
    missing = [n for n in names if f"`{n}" not in README]
    assert not missing, f"document these metrics in README.md: {missing}"


def test_readme_keeps_the_two_commands_and_ci_runs_the_test_one():
    assert "bash scripts/testnet.sh" in README and "bash scripts/test.sh" in README
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "scripts/test.sh" in ci
