"""Bad deltas beyond those of test_delta.py: each is a clear DeltaError, costs at most one shard of output,
and ends with the shard fetched whole; nothing is ever half-installed.

(test_delta.py already covers a delta against another base, one that declares or yields the wrong
size, a zip bomb, a corrupt frame, a base corrupted on disk, and a relay that alters pieces.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zstandard
from shardcast_helpers import SHARD, same_tree
from test_delta import (  # noqa: F401 - versions is a fixture
    FAST,
    fetch_base_then,
    make_version,
    rewrite_delta,
    run,
    serving,
    stepped,
    versions,
    weight_pieces,
    weights,
)

from veriroll.shardcast.delta import MAX_WINDOW_SIZE, rebuild_shard
from veriroll.shardcast.errors import DeltaError
from veriroll.shardcast.fetch import fetch_version
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.store import is_ready, version_dir

pytestmark = pytest.mark.timeout(120)


def huge_window_frame(data: bytes) -> bytes:
    """A valid frame of ``data`` whose header asks the decoder for a 1 GiB window (streamed: no size in it)."""
    params = zstandard.ZstdCompressionParameters(window_log=30, write_content_size=False)
    compressor = zstandard.ZstdCompressor(compression_params=params).compressobj()
    return compressor.compress(data) + compressor.flush()


def rebuild(tmp_path: Path, piece: bytes, base: bytes, size: int = SHARD) -> str:
    (tmp_path / "base").write_bytes(base)
    base_fd = os.open(tmp_path / "base", os.O_RDONLY)
    out_fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        return rebuild_shard(piece, base_fd, out_fd, 0, size)
    finally:
        os.close(out_fd)
        os.close(base_fd)


def test_a_piece_asking_for_a_window_over_the_limit_is_refused_before_any_output(tmp_path):
    piece = huge_window_frame(b"\0" * SHARD)
    assert zstandard.get_frame_parameters(piece).window_size > MAX_WINDOW_SIZE
    with pytest.raises(DeltaError, match="MiB window"):
        rebuild(tmp_path, piece, b"\0" * SHARD)
    assert os.path.getsize(tmp_path / "out") == 0


@pytest.mark.parametrize(
    ("tail", "message"),
    [(zstandard.ZstdCompressor().compress(b"\1" * 10), "past the shard"), (b"not a frame", "corrupt")],
    ids=["second-frame", "trailing-garbage"],
)
def test_bytes_after_the_frame_are_read_and_refused_not_skipped(tmp_path, tail, message):
    piece = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * SHARD) + tail
    with pytest.raises(DeltaError, match=message):
        rebuild(tmp_path, piece, b"\0" * SHARD)


def test_a_base_shorter_than_the_shard_is_not_the_base_the_delta_names(tmp_path):
    piece = zstandard.ZstdCompressor().compress(b"\0" * SHARD)
    with pytest.raises(DeltaError, match="base file ends"):
        rebuild(tmp_path, piece, b"\0" * (SHARD // 2))


def test_a_signed_piece_with_a_huge_window_falls_back_to_the_whole_shard(versions, coord_key, tmp_path):  # noqa: F811
    store, _, c2 = versions
    target = weight_pieces(store, 2, coord_key)[0]
    rewrite_delta(store, 2, coord_key,
                  lambda i, good, shard: huge_window_frame(b"\0" * shard.size) if i == target else None)
    result = fetch_base_then(store, coord_key.public, tmp_path)
    assert same_tree(c2, tmp_path / "out") and is_ready(tmp_path / "out")
    assert result.shards_rebuilt == len(result.manifest.delta.pieces) - 1
    assert len(result.delta_problems) == 1 and "MiB window" in result.delta_problems[0]
    assert result.bad_relays == []  # the coordinator signed it: no relay is to blame


def test_a_base_truncated_on_disk_costs_its_shards_whole_and_is_left_as_it_was(versions, coord_key, tmp_path):  # noqa: F811
    store, _, c2 = versions

    async def go():
        async def fetch_both(relay):
            await fetch_version([relay.url], coord_key.public, tmp_path / "base", 1, **FAST)
            model = tmp_path / "base" / "model.safetensors"
            os.truncate(model, model.stat().st_size - 2 * SHARD)
            return await fetch_version([relay.url], coord_key.public, tmp_path / "out", 2,
                                       bases=[tmp_path / "base"], **FAST)

        return await serving(store, coord_key.public, fetch_both)

    result = run(go())
    assert same_tree(c2, tmp_path / "out")
    assert result.delta_problems and all("base file ends" in p for p in result.delta_problems)
    assert result.shards_rebuilt == len(result.manifest.delta.pieces) - len(result.delta_problems)
    assert result.bad_relays == []


def test_publishing_makes_no_piece_against_base_bytes_its_manifest_does_not_vouch_for(tmp_path, coord_key):
    v1 = weights()
    store = tmp_path / "store"
    publish_checkpoint(make_version(tmp_path / "c1", v1), store, coord_key, 1, shard_size=SHARD)
    model = version_dir(store, 1) / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[2 * SHARD + 3] ^= 0xFF  # the base on the publisher's disk rotted in shard 2 of the weights
    model.write_bytes(bytes(data))
    result = publish_checkpoint(make_version(tmp_path / "c2", stepped(v1)), store, coord_key, 2, shard_size=SHARD,
                                delta_from=1)
    manifest = result.manifest
    covered = {manifest.shards[p.shard].offset for p in manifest.delta.pieces
               if manifest.shards[p.shard].file == "model.safetensors"}
    weight_offsets = {s.offset for s in manifest.shards_of("model.safetensors")}
    assert covered == weight_offsets - {2 * SHARD}
