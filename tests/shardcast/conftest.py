"""Fixtures for shardcast tests: keys, a small checkpoint, a published store (helpers: shardcast_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardcast_helpers import SHARD, make_checkpoint

from veriroll.protos.identity import PrivateKey, write_keypair
from veriroll.shardcast.publish import publish_checkpoint


@pytest.fixture
def coord_key(tmp_path) -> PrivateKey:
    return write_keypair(tmp_path / "keys" / "coordinator.key")


@pytest.fixture
def other_key(tmp_path) -> PrivateKey:
    return write_keypair(tmp_path / "keys" / "impostor.key")


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    return make_checkpoint(tmp_path / "ckpt")


@pytest.fixture
def store(tmp_path, checkpoint, coord_key) -> Path:
    """An origin store holding version 1 of ``checkpoint``, in 256 KiB shards."""
    s = tmp_path / "origin-store"
    publish_checkpoint(checkpoint, s, coord_key, 1, shard_size=SHARD)
    return s
