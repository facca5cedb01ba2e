"""The `veriroll` command's operator and volunteer entry points, run in-process."""

from __future__ import annotations

import json
import os
import stat

import pytest
from support import make_coordinator_dir

from veriroll.cli.main import main
from veriroll.coordinator import store as st
from veriroll.protos.identity import PrivateKey, load_private_key


def test_keygen_prints_the_node_id_refuses_to_overwrite_and_shows_it_again(tmp_path, capsys):
    key = tmp_path / "node.key"
    assert main(["keygen", "--out", str(key)]) == 0
    node_id = capsys.readouterr().out.strip()
    assert node_id == load_private_key(key).node_id
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600 and (tmp_path / "node.key.pub").exists()
    assert main(["keygen", "--out", str(key)]) == 1
    assert "--force" in capsys.readouterr().err
    assert main(["keygen", "--out", str(key), "--show"]) == 0
    assert capsys.readouterr().out.strip() == node_id


def test_keygen_writes_the_one_default_key_that_every_node_command_reads(tmp_path, capsys, monkeypatch):
    from veriroll.cli.main import build_parser
    from veriroll.node.cli import load_node_config

    default = tmp_path / "config" / "veriroll" / "node.key"
    monkeypatch.setenv("VERIROLL_NODE_KEY", str(default))
    assert main(["keygen"]) == 0
    node_id = capsys.readouterr().out.strip()
    assert load_private_key(default).node_id == node_id
    for command in ("run", "doctor", "credits"):
        assert load_node_config(build_parser().parse_args(["node", command])).key == str(default)
    monkeypatch.delenv("VERIROLL_NODE_KEY")
    assert load_node_config(build_parser().parse_args(["node", "run"])).key == "~/.config/veriroll/node.key"


def test_keygen_show_names_an_exposed_key_with_its_chmod(tmp_path, capsys):
    key = tmp_path / "node.key"
    assert main(["keygen", "--out", str(key)]) == 0
    os.chmod(key, 0o644)
    capsys.readouterr()
    assert main(["keygen", "--out", str(key), "--show"]) == 1
    assert f"chmod 600 {key}" in capsys.readouterr().err


def test_coordinator_status_json_and_ban_unban(tmp_path, capsys):
    base = make_coordinator_dir(tmp_path)
    node = PrivateKey.generate()
    db = st.Database(base / "state.db")
    db.run_sync(lambda c: c.execute("INSERT INTO nodes(node_id, public_key, registered_ms, last_seen_ms) VALUES(?, ?, 0, 0)",
                                    (node.node_id, node.public.raw)))
    db.run_sync(lambda c: st.count_rejection(c, node.node_id, "bad_logprobs", now_ms=1))
    db.close()
    assert main(["coordinator", "status", "--dir", str(base), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert {"policy_version", "nodes", "open_leases", "accepted_groups", "rejections_by_reason", "banned_nodes"} <= set(status)
    assert status["nodes"] == 1 and status["rejections_by_reason"] == {"bad_logprobs": 1} and status["banned_nodes"] == 0
    assert status["verification"] == "off"  # the test directories run with intake.verify = false
    assert main(["coordinator", "ban", node.node_id[:10], "--dir", str(base), "--reason", "test"]) == 0
    capsys.readouterr()
    assert main(["coordinator", "status", "--dir", str(base), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["banned_nodes"] == 1
    assert main(["coordinator", "unban", node.node_id, "--dir", str(base)]) == 0
    assert main(["coordinator", "nodes", "--dir", str(base), "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert nodes[0]["standing"] == "probation" and nodes[0]["rejections"] == {"bad_logprobs": 1}
    assert main(["coordinator", "status", "--dir", str(tmp_path / "nowhere")]) == 2


def test_coordinator_status_says_verification_is_on_by_default(tmp_path, capsys):
    base = make_coordinator_dir(tmp_path, {"intake.verify": True})
    assert main(["coordinator", "status", "--dir", str(base), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verification"] == "on"
    assert main(["coordinator", "status", "--dir", str(base)]) == 0
    assert "verification: on" in capsys.readouterr().out


def test_every_first_party_subcommand_is_registered(capsys):
    """No subcommand may silently vanish on a broken install: all are imported unconditionally."""
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("keygen", "coordinator", "node", "shardcast", "relay", "testnet"):
        assert command in out
