"""A node's key and cache: the .pub file and an exposed key are named with their fix, the coordinator's own
key loads with a warning only, each key caches in its own folder, and the node's address needs a port."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import pytest

from veriroll.node.config import NodeConfig
from veriroll.node.doctor import split_address
from veriroll.protos.identity import KeyFileError, load_private_key, write_keypair


def test_a_public_key_given_as_the_private_key_is_named_with_the_right_path(tmp_path):
    path = tmp_path / "node.key"
    write_keypair(path)
    with pytest.raises(KeyFileError, match="is a public key") as err:
        load_private_key(tmp_path / "node.key.pub")
    assert err.value.fix == f"pass the private key: {path}"


def test_a_key_other_users_can_read_is_refused_for_a_node_and_only_warned_about_otherwise(tmp_path, caplog):
    path = tmp_path / "node.key"
    key = write_keypair(path)
    os.chmod(path, 0o640)
    with pytest.raises(KeyFileError, match=r"mode 0640") as err:
        load_private_key(path, owner_only=True)
    assert err.value.fix.startswith(f"make it private: `chmod 600 {path}`")
    with caplog.at_level(logging.WARNING, logger="veriroll.identity"):
        assert load_private_key(path).node_id == key.node_id  # the coordinator's key: it still starts
    assert f"chmod 600 {path}" in caplog.text
    os.chmod(path, 0o600)
    assert load_private_key(path, owner_only=True).node_id == key.node_id


@pytest.mark.parametrize("address", ["127.0.0.1", "coordinator.example", "::1", "[::1]", ""])
def test_an_address_without_a_port_is_refused_not_guessed(address):
    with pytest.raises(ValueError, match="has no port"):
        split_address(address)


def test_addresses_with_a_port_split():
    assert split_address("coordinator.example:50051") == ("coordinator.example", 50051)
    assert split_address("[::1]:7000") == ("::1", 7000)
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address("host:99999")


def test_each_key_caches_its_checkpoints_in_its_own_folder_and_a_vanished_version_is_named(tmp_path):
    from veriroll.node.cli import CheckpointMissing, build_agent
    from veriroll.node.hardware import Hardware
    from veriroll.protos.service import secure_channel

    hw = Hardware(cpu="test", cpu_count=1, ram_bytes=0, disk_free_bytes=0, os="test")

    async def agents():
        built = []
        for name in ("a", "b"):
            key = tmp_path / name / "node.key"
            write_keypair(key)
            cfg = NodeConfig(key=str(key), cache_dir=str(tmp_path / "cache"), engine="torch", device="cpu")
            channel = secure_channel("127.0.0.1:1", None)
            built.append(build_agent(cfg, channel, hw))
            await channel.close()
        return built

    first, second = asyncio.run(agents())
    assert first.versions.root == tmp_path / "cache" / first.key.node_id
    assert second.versions.root == tmp_path / "cache" / second.key.node_id
    assert first.versions.root != second.versions.root
    with pytest.raises(CheckpointMissing, match="policy version 3 is gone"):
        first.engine_factory(first.versions.root / "v000003", 3)


def test_grpc_core_log_lines_stay_off_the_terminal():
    """C-core reads its verbosity once, when grpc is imported: the node must set it first, and building the
    command line must not import grpc."""
    probe = ("from veriroll.cli.main import build_parser; build_parser()\n"
             "from veriroll.node.cli import quiet_grpc_logs; quiet_grpc_logs()\n"
             "import asyncio, grpc\n"
             "async def main():\n"
             "    creds = grpc.ssl_channel_credentials(root_certificates=b'not a certificate')\n"
             "    channel = grpc.aio.secure_channel('127.0.0.1:1', creds)\n"
             "    try:\n"
             "        await asyncio.wait_for(channel.channel_ready(), 1)\n"
             "    except TimeoutError:\n"
             "        pass\n"
             "asyncio.run(main())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    quiet = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    loud = subprocess.run([sys.executable, "-c", probe.replace("quiet_grpc_logs()", "pass")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "root certificate" in loud.stderr  # the probe does make C-core complain
    assert "root certificate" not in quiet.stderr, quiet.stderr
