"""Lossless weight deltas: publishing them, rebuilding from them bit for bit, and every way they can be wrong.

Checkpoints hold a real safetensors file of float32 weights; version 2 is version 1 after a small
multiplicative step, as an optimizer step at a small learning rate leaves them. Bad deltas are made the
way a buggy publisher would: validly signed, so that only the checks on the bytes stand in the way.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import zstandard
from shardcast_helpers import SHARD, FakeRelay, copy_store, same_tree

from veriroll.shardcast.delta import compress_piece, rebuild_shard
from veriroll.shardcast.errors import DeltaError, ManifestError, ShardUnavailableError
from veriroll.shardcast.fetch import fetch_version
from veriroll.shardcast.manifest import (
    Delta,
    DeltaPiece,
    manifest_from_dict,
    signing_message,
    verify_manifest,
)
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.relay import RelayServer
from veriroll.shardcast.store import DELTA_NAME, MANIFEST_NAME, is_ready, version_dir

FAST = {"connect_timeout": 2.0, "read_timeout": 2.0, "progress": False}
N_WEIGHTS = 3 * SHARD // 4 * 4 + 1000  # a bit over 12 shards of float32, the last one short

pytestmark = pytest.mark.timeout(120)


def run(coro):
    return asyncio.run(coro)


def write_safetensors(path: Path, values: np.ndarray) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(values)], "data_offsets": [0, values.nbytes]}})
    header = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + values.astype("<f4").tobytes())


def weights(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N_WEIGHTS).astype(np.float32) * 0.02


def stepped(values: np.ndarray, size: float = 1e-5, seed: int = 1) -> np.ndarray:
    """``values`` after a small step: every weight moves by a relative ``size``, as after one optimizer step."""
    noise = np.random.default_rng(seed).standard_normal(len(values)).astype(np.float32)
    return (values * (1 + size * noise)).astype(np.float32)


def make_version(path: Path, values: np.ndarray, *, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    (path / "tokenizer.json").write_bytes(b"tokens " * 5000)
    write_safetensors(path / "model.safetensors", values)
    return path


@pytest.fixture
def versions(tmp_path, coord_key):
    """An origin store holding version 1 and version 2 (one small step later, with a delta against 1)."""
    store = tmp_path / "origin"
    v1 = weights()
    c1 = make_version(tmp_path / "ckpt1", v1)
    c2 = make_version(tmp_path / "ckpt2", stepped(v1), config={"model_type": "llama", "step": 1})
    publish_checkpoint(c1, store, coord_key, 1, shard_size=SHARD)
    publish_checkpoint(c2, store, coord_key, 2, shard_size=SHARD, delta_from=1)
    return store, c1, c2


def fetch(relays, key, out, version, **kw):
    return run(fetch_version(relays, key, out, version, **{**FAST, **kw}))


async def serving(store, key, coro_fn):
    async with RelayServer(store, key, port=0) as relay:
        return await coro_fn(relay)


def fetch_base_then(store, key, tmp_path, version=2, base_store=None):
    """Fetch version 1 (from ``base_store``, default ``store``) into ``tmp_path/base``, then ``version``
    from ``store`` with it as a base."""

    async def go():
        async with RelayServer(base_store or store, key, port=0) as r1:
            await fetch_version([r1.url], key, tmp_path / "base", 1, **FAST)
        async with RelayServer(store, key, port=0) as relay:
            return await fetch_version(
                [relay.url], key, tmp_path / "out", version, bases=[tmp_path / "base"], **FAST
            )

    return run(go())


def rewrite_delta(store: Path, version: int, key, make_piece) -> None:
    """Replace each delta piece of ``version`` in ``store`` by ``make_piece(i, good, shard)`` and re-sign.

    ``make_piece`` gets the piece's index, its good bytes and its shard entry; it returns new bytes, or
    None to keep the good ones.
    """
    vdir = version_dir(store, version)
    manifest = verify_manifest((vdir / MANIFEST_NAME).read_bytes(), key.public)
    blob = (vdir / DELTA_NAME).read_bytes()
    pieces, out, offset = [], bytearray(), 0
    for i, p in enumerate(manifest.delta.pieces):
        good = blob[p.offset : p.end]
        data = make_piece(i, good, manifest.shards[p.shard])
        data = good if data is None else data
        pieces.append(DeltaPiece(p.shard, offset, len(data), hashlib.sha256(data).hexdigest()))
        out += data
        offset += len(data)
    body = manifest.to_dict()
    body["delta"] = Delta(manifest.delta.base_version, manifest.delta.base_manifest_sha256, tuple(pieces)).to_dict()
    doc = {"manifest": body, "signature": key.sign(signing_message(body)).hex()}
    (vdir / MANIFEST_NAME).write_bytes(json.dumps(doc).encode())
    (vdir / DELTA_NAME).write_bytes(bytes(out))


def weight_pieces(store: Path, version: int, key) -> list[int]:
    """Indices of the delta pieces that rebuild shards of the weights file."""
    manifest = verify_manifest((version_dir(store, version) / MANIFEST_NAME).read_bytes(), key.public)
    return [i for i, p in enumerate(manifest.delta.pieces) if manifest.shards[p.shard].file == "model.safetensors"]


# -- the pure part -----------------------------------------------------------------------------------


def test_a_piece_rebuilds_the_shard_bit_for_bit(tmp_path):
    old = weights().tobytes()[:SHARD]
    new = stepped(weights()).tobytes()[:SHARD]
    piece = compress_piece(new, old)
    assert len(piece) < len(new) / 2  # most bytes of a small step XOR to zero
    (tmp_path / "base").write_bytes(b"x" * 100 + old)
    out_fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    base_fd = os.open(tmp_path / "base", os.O_RDONLY)
    try:
        os.ftruncate(out_fd, 100 + SHARD)
        digest = rebuild_shard(piece, base_fd, out_fd, 100, SHARD)
    finally:
        os.close(out_fd)
        os.close(base_fd)
    assert digest == hashlib.sha256(new).hexdigest()
    assert (tmp_path / "out").read_bytes()[100:] == new


@pytest.mark.parametrize(
    ("piece", "message"),
    [
        (zstandard.ZstdCompressor().compress(b"\0" * (SHARD - 1)), "declares"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (SHARD - 1)), "decompresses to"),
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (64 << 20)), "past the shard"),
        (b"not zstd at all", "not a zstd frame"),
    ],
    ids=["declares-wrong-size", "decompresses-short", "zip-bomb", "garbage"],
)
def test_a_bad_piece_is_a_clear_delta_error(tmp_path, piece, message):
    (tmp_path / "base").write_bytes(b"\0" * SHARD)
    base_fd = os.open(tmp_path / "base", os.O_RDONLY)
    out_fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(DeltaError, match=message):
            rebuild_shard(piece, base_fd, out_fd, 0, SHARD)
    finally:
        os.close(out_fd)
        os.close(base_fd)
    assert os.path.getsize(tmp_path / "out") <= SHARD  # the bomb stopped at the shard's size


def test_the_manifest_refuses_a_malformed_delta_section(versions, coord_key):
    store, _, _ = versions
    body = json.loads((version_dir(store, 2) / MANIFEST_NAME).read_bytes())["manifest"]
    assert manifest_from_dict(body).delta is not None
    breakages = {
        "against an older version": lambda d: d.update(base_version=2),
        "shard order": lambda d: d["pieces"][1].update(shard=d["pieces"][0]["shard"]),
        "end to end": lambda d: d["pieces"][1].update(offset=d["pieces"][1]["offset"] + 1),
        "size of delta piece": lambda d: d["pieces"][0].update(size=SHARD * 4),
        "unknown keys": lambda d: d.update(extra=1),
    }
    for what, breakage in breakages.items():
        broken = json.loads(json.dumps(body))
        breakage(broken["delta"])
        with pytest.raises(ManifestError, match=what):
            manifest_from_dict(broken)


# -- publishing --------------------------------------------------------------------------------------


def test_publish_makes_pieces_only_where_the_file_layout_is_the_same(versions, coord_key):
    store, _, _ = versions
    vdir = version_dir(store, 2)
    manifest = verify_manifest((vdir / MANIFEST_NAME).read_bytes(), coord_key.public, expect_version=2)
    delta = manifest.delta
    assert delta.base_version == 1
    files = {manifest.shards[p.shard].file for p in delta.pieces}
    # config.json changed size: no piece. The tokenizer is the same: a piece of a few bytes.
    assert files == {"model.safetensors", "tokenizer.json"}
    assert len(weight_pieces(store, 2, coord_key)) == len(manifest.shards_of("model.safetensors"))
    assert (vdir / DELTA_NAME).stat().st_size == delta.size < manifest.total_size / 2
    assert all(p.size < manifest.shards[p.shard].size for p in delta.pieces)


def test_publish_without_the_base_publishes_whole(tmp_path, coord_key):
    ckpt = make_version(tmp_path / "c", weights())
    result = publish_checkpoint(ckpt, tmp_path / "s", coord_key, 5, shard_size=SHARD, delta_from=4)
    assert result.manifest.delta is None and result.delta_bytes == 0
    assert not (result.path / DELTA_NAME).exists()


def test_a_file_with_another_safetensors_header_ships_whole(tmp_path, coord_key):
    v1 = weights()
    publish_checkpoint(make_version(tmp_path / "c1", v1), tmp_path / "s", coord_key, 1, shard_size=SHARD)
    c2 = make_version(tmp_path / "c2", stepped(v1))
    data = bytearray((c2 / "model.safetensors").read_bytes())
    data[10:13] = b'{ "'  # same size, another header: tensors would not line up
    (c2 / "model.safetensors").write_bytes(bytes(data))
    result = publish_checkpoint(c2, tmp_path / "s", coord_key, 2, shard_size=SHARD, delta_from=1)
    shards = result.manifest.shards
    assert {shards[p.shard].file for p in result.manifest.delta.pieces} == {"config.json", "tokenizer.json"}


# -- fetching ----------------------------------------------------------------------------------------


def test_a_node_holding_the_base_rebuilds_the_new_version_bit_for_bit(versions, coord_key, tmp_path):
    store, c1, c2 = versions
    result = fetch_base_then(store, coord_key.public, tmp_path)
    assert same_tree(c2, tmp_path / "out") and is_ready(tmp_path / "out")
    delta = result.manifest.delta
    assert result.shards_rebuilt == len(delta.pieces) and result.delta_problems == []
    assert result.delta_bytes == delta.size
    # Only config.json (changed size) came whole; everything else was rebuilt.
    assert result.bytes_downloaded == result.manifest.file("config.json").size
    assert result.bytes_shipped < result.manifest.total_size / 2
    assert same_tree(c1, tmp_path / "base")  # the base is read, never written


def test_without_the_base_the_version_comes_whole(versions, coord_key, tmp_path):
    store, _, c2 = versions

    async def go(relay):
        return await fetch_version([relay.url], coord_key.public, tmp_path / "out", 2, **FAST)

    result = run(serving(store, coord_key.public, go))
    assert same_tree(c2, tmp_path / "out")
    assert result.shards_rebuilt == 0 and result.delta_bytes == 0
    assert result.bytes_downloaded == result.manifest.total_size


def test_a_delta_against_another_base_falls_back_to_whole_shards(versions, coord_key, tmp_path):
    store, _, c2 = versions
    # Version 1 of another publish (other weights, same key): right number, wrong bytes.
    other = tmp_path / "other-origin"
    publish_checkpoint(make_version(tmp_path / "other", weights(seed=7)), other, coord_key, 1, shard_size=SHARD)
    result = fetch_base_then(store, coord_key.public, tmp_path, base_store=other)
    assert same_tree(c2, tmp_path / "out")
    assert result.shards_rebuilt == 0 and result.bytes_downloaded == result.manifest.total_size
    assert any("not the one the delta was made against" in p for p in result.delta_problems)
    assert result.bad_relays == []


def test_a_base_corrupted_on_disk_rebuilds_wrong_bytes_and_those_shards_come_whole(versions, coord_key, tmp_path):
    store, _, c2 = versions

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as relay:
            await fetch_version([relay.url], coord_key.public, tmp_path / "base", 1, **FAST)
            model = tmp_path / "base" / "model.safetensors"
            data = bytearray(model.read_bytes())
            data[SHARD + 5] ^= 0xFF  # one byte of shard 1 of the weights
            model.write_bytes(bytes(data))
            return await fetch_version(
                [relay.url], coord_key.public, tmp_path / "out", 2, bases=[tmp_path / "base"], **FAST
            )

    result = run(go())
    assert same_tree(c2, tmp_path / "out")
    assert len(result.delta_problems) == 1 and "the rebuilt bytes hash" in result.delta_problems[0]
    assert result.shards_rebuilt == len(result.manifest.delta.pieces) - 1
    assert result.bad_relays == []  # the relay served what the coordinator signed: not its fault


@pytest.mark.parametrize(
    ("make_piece", "problem"),
    [
        (lambda i, good, shard: zstandard.ZstdCompressor().compress(b"\0" * (shard.size - 8)), "declares"),
        (
            lambda i, good, shard: zstandard.ZstdCompressor(write_content_size=False).compress(
                b"\0" * (shard.size - 8)
            ),
            "decompresses to",
        ),
        (
            lambda i, good, shard: zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (256 << 20)),
            "past the shard",
        ),
        (lambda i, good, shard: good[:16] + bytes(b ^ 0x5A for b in good[16:]), "delta piece is corrupt|rebuilt"),
    ],
    ids=["wrong-declared-size", "decompresses-short", "zip-bomb", "corrupt"],
)
def test_a_signed_but_bad_delta_falls_back_to_whole_shards(versions, coord_key, tmp_path, make_piece, problem):
    store, _, c2 = versions
    target = weight_pieces(store, 2, coord_key)[1]
    rewrite_delta(store, 2, coord_key, lambda i, good, shard: make_piece(i, good, shard) if i == target else None)
    result = fetch_base_then(store, coord_key.public, tmp_path)
    assert same_tree(c2, tmp_path / "out")
    assert result.shards_rebuilt == len(result.manifest.delta.pieces) - 1
    assert len(result.delta_problems) == 1
    assert any(word in result.delta_problems[0] for word in problem.split("|")), result.delta_problems
    assert result.bad_relays == []


def test_a_relay_that_alters_delta_pieces_is_reported_and_the_honest_one_used(versions, coord_key, tmp_path):
    store, _, c2 = versions

    def flip(version, name, start, data):
        return bytes([data[0] ^ 1]) + data[1:] if name == DELTA_NAME else data

    async def go():
        liar = FakeRelay(store, on_file=flip)
        await liar.start()
        try:
            async with RelayServer(store, coord_key.public, port=0) as honest:
                await fetch_version([honest.url], coord_key.public, tmp_path / "base", 1, **FAST)
                return await fetch_version(
                    [liar.url, honest.url], coord_key.public, tmp_path / "out", 2, bases=[tmp_path / "base"],
                    **FAST,
                )  # fmt: skip
        finally:
            await liar.stop()

    result = run(go())
    assert same_tree(c2, tmp_path / "out")
    assert result.shards_rebuilt == len(result.manifest.delta.pieces)
    assert result.bad_relays and {i.kind for i in result.bad_relays} == {"hash-mismatch"}
    assert result.bad_relay_urls == {result.bad_relays[0].relay} and "delta piece" in result.bad_relays[0].detail


async def version_2_from_a_liar(store, coord_key, tmp_path, on_file):
    """Version 1 fetched whole from an honest relay into ``base``; then version 2, with ``base`` as its base,
    from a relay that alters what ``on_file`` alters."""
    async with RelayServer(store, coord_key.public, port=0) as honest:
        await fetch_version([honest.url], coord_key.public, tmp_path / "base", 1, **FAST)
    liar = FakeRelay(store, on_file=on_file)
    await liar.start()
    try:
        return await fetch_version([liar.url], coord_key.public, tmp_path / "out", 2, bases=[tmp_path / "base"], **FAST)
    finally:
        await liar.stop()


def test_when_only_a_lying_relay_has_the_delta_the_shards_come_whole(versions, coord_key, tmp_path):
    store, _, c2 = versions

    def flip(version, name, start, data):
        return bytes([data[0] ^ 1]) + data[1:] if name == DELTA_NAME else data

    async def go():
        return await version_2_from_a_liar(store, coord_key, tmp_path, flip)

    result = run(go())
    assert same_tree(c2, tmp_path / "out")
    assert result.shards_rebuilt == 0 and result.delta_bytes == 0
    assert all("no relay served it intact" in p for p in result.delta_problems)


def test_nothing_is_installed_when_neither_the_delta_nor_the_shards_can_be_had(versions, coord_key, tmp_path):
    store, _, _ = versions

    def flip_weights(version, name, start, data):
        return bytes([data[0] ^ 1]) + data[1:] if name in (DELTA_NAME, "model.safetensors") else data

    async def go():
        return await version_2_from_a_liar(store, coord_key, tmp_path, flip_weights)

    with pytest.raises(ShardUnavailableError):
        run(go())
    assert not (tmp_path / "out").exists()
    assert is_ready(tmp_path / "base") and verify_manifest(
        (tmp_path / "base" / MANIFEST_NAME).read_bytes(), coord_key.public, expect_version=1
    )


# -- relays ------------------------------------------------------------------------------------------


def test_the_delta_route_serves_ranges_and_404s_where_there_is_no_delta(versions, coord_key, tmp_path):
    store, _, _ = versions

    async def go(relay):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{relay.url}/versions/2/delta", headers={"Range": "bytes=0-9"}) as r:
                ranged = (r.status, await r.read())
            async with s.get(f"{relay.url}/versions/1/delta") as r:
                none = r.status
        return ranged, none

    (status, body), none = run(serving(store, coord_key.public, go))
    assert status == 206 and body == (version_dir(store, 2) / DELTA_NAME).read_bytes()[:10]
    assert none == 404


def test_a_mirror_rebuilds_from_the_version_it_holds_and_serves_the_delta_on(versions, coord_key, tmp_path):
    store, c1, c2 = versions
    staged = copy_store(store, tmp_path / "staged")
    shutil.rmtree(version_dir(store, 2))  # the origin has only version 1 at first
    mirror_opts = {"poll_interval": 0.1, "fetch_options": {"connect_timeout": 1.0, "read_timeout": 2.0}}

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            m = RelayServer(tmp_path / "m", coord_key.public, port=0, upstreams=[origin.url], **mirror_opts)
            async with m:
                await until(lambda: m.versions() == [1])
                before = origin.bytes_served_total
                os.rename(version_dir(staged, 2), version_dir(store, 2))
                await until(lambda: m.versions() == [1, 2])
                origin_bytes_for_v2 = origin.bytes_served_total - before
                await fetch_version([m.url], coord_key.public, tmp_path / "base", 1, **FAST)
                result = await fetch_version(
                    [m.url], coord_key.public, tmp_path / "out", 2, bases=[tmp_path / "base"], **FAST
                )
                return origin_bytes_for_v2, result, m.held[2]

    origin_bytes_for_v2, result, held = run(go())
    assert same_tree(c2, tmp_path / "out") and result.shards_rebuilt == len(result.manifest.delta.pieces)
    assert held.has_delta
    # The mirror took version 2 from the delta too: the delta, config.json and the manifest, no shard.
    assert origin_bytes_for_v2 < result.manifest.total_size / 2


async def until(predicate, tries: int = 1200, pause: float = 0.05):
    """Poll ``predicate()`` until it is truthy (a guard against hanging, not a time limit)."""
    for _ in range(tries):
        if predicate():
            return
        await asyncio.sleep(pause)
    raise AssertionError("never happened")
