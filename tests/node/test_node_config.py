"""Node settings: TOML file < ``VERIROLL_NODE_*`` environment < command-line flags."""

from __future__ import annotations

import pytest

from veriroll.cli.main import build_parser
from veriroll.node.cli import load_node_config
from veriroll.protos.config import ConfigError


def parse(*argv: str):
    return build_parser().parse_args(["node", "run", *argv])


@pytest.fixture()
def toml(tmp_path):
    path = tmp_path / "node.toml"
    path.write_text('threads = 2\nmax_leases = 3\ndisplay_name = "from-toml"\ncoordinator = "toml.example:1"\n'
                    'relays = ["http://toml-relay:8470"]\nheartbeat_s = 7.5\n')
    return path


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("VERIROLL_NODE_"):
            monkeypatch.delenv(name)


def test_flags_beat_environment_beat_file(toml, monkeypatch):
    monkeypatch.setenv("VERIROLL_NODE_THREADS", "4")
    monkeypatch.setenv("VERIROLL_NODE_DISPLAY_NAME", "from-env")
    monkeypatch.setenv("VERIROLL_NODE_COORDINATOR", "env.example:2")
    cfg = load_node_config(parse("--config", str(toml), "--threads", "6", "--relay", "http://flag-relay:1",
                                 "--relay", "http://flag-relay:2"))
    assert cfg.threads == 6  # file 2 < env 4 < flag 6
    assert cfg.display_name == "from-env"  # file < env, no flag
    assert cfg.coordinator == "env.example:2"
    assert cfg.max_leases == 3 and cfg.heartbeat_s == 7.5  # file only
    assert cfg.relays == ["http://flag-relay:1", "http://flag-relay:2"]  # flags replace the file's list
    assert cfg.dtype == "float32"  # default: nobody set it


def test_environment_alone_overrides_the_file(toml, monkeypatch):
    monkeypatch.setenv("VERIROLL_NODE_MAX_LEASES", "5")
    monkeypatch.setenv("VERIROLL_NODE_RELAYS", '["http://env-relay:1"]')
    cfg = load_node_config(parse("--config", str(toml)))
    assert cfg.max_leases == 5 and cfg.relays == ["http://env-relay:1"] and cfg.threads == 2


def test_set_flag_reaches_fields_without_their_own_flag(toml, monkeypatch):
    monkeypatch.setenv("VERIROLL_NODE_KEEP_VERSIONS", "4")
    cfg = load_node_config(parse("--config", str(toml), "--set", "keep_versions=2"))
    assert cfg.keep_versions == 2


def test_unrelated_environment_is_ignored_and_bad_values_are_named(toml, monkeypatch):
    monkeypatch.setenv("VERIROLL_NODE_NOT_A_FIELD", "x")
    assert load_node_config(parse("--config", str(toml))).threads == 2
    monkeypatch.setenv("VERIROLL_NODE_THREADS", "zero")
    with pytest.raises(ConfigError, match="threads"):
        load_node_config(parse("--config", str(toml)))
