"""Publishing into a store: layout, atomicity, retention, failures."""

from __future__ import annotations

import errno
import hashlib
import threading

import pytest
from shardcast_helpers import SHARD, make_checkpoint, same_tree

from veriroll.shardcast import publish as publish_mod
from veriroll.shardcast.errors import DiskFullError, PublishError
from veriroll.shardcast.manifest import verify_manifest
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.store import MANIFEST_NAME, READY_NAME, list_versions, version_dir


def test_publish_writes_a_signed_version_whose_shards_hash_right(checkpoint, coord_key, tmp_path):
    result = publish_checkpoint(checkpoint, tmp_path / "s", coord_key, 7, shard_size=SHARD)
    vdir = version_dir(tmp_path / "s", 7)
    assert result.path == vdir and list_versions(tmp_path / "s") == [7]
    assert same_tree(checkpoint, vdir)
    assert (vdir / READY_NAME).is_file()
    manifest = verify_manifest((vdir / MANIFEST_NAME).read_bytes(), coord_key.public, expect_version=7)
    assert {f.name for f in manifest.files} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "added_tokens.json",
        "extra/generation_config.json",
    }  # hidden .cache/ is not published
    for s in manifest.shards:
        data = (vdir / s.file).read_bytes()[s.offset : s.end]
        assert hashlib.sha256(data).hexdigest() == s.sha256 and s.size <= SHARD
    for f in manifest.files:
        assert hashlib.sha256((vdir / f.name).read_bytes()).hexdigest() == f.sha256


def test_store_keeps_only_the_newest_k_versions(checkpoint, coord_key, tmp_path):
    s = tmp_path / "s"
    removed = []
    for v in range(1, 6):
        removed.append(
            publish_checkpoint(checkpoint, s, coord_key, v, shard_size=SHARD, keep=2).removed_versions
        )
    assert list_versions(s) == [4, 5]
    assert removed == [[], [], [1], [2], [3]]
    assert not [p for p in s.iterdir() if p.name.startswith(".")]  # no temp or trash left behind


def test_republishing_an_existing_version_is_refused(store, checkpoint, coord_key):
    with pytest.raises(PublishError, match="already"):
        publish_checkpoint(checkpoint, store, coord_key, 1, shard_size=SHARD)


def test_publishing_a_version_older_than_all_kept_is_refused(checkpoint, coord_key, tmp_path):
    s = tmp_path / "s"
    for v in (5, 6):
        publish_checkpoint(checkpoint, s, coord_key, v, shard_size=SHARD, keep=2)
    with pytest.raises(PublishError, match="pruned"):
        publish_checkpoint(checkpoint, s, coord_key, 4, shard_size=SHARD, keep=2)


def test_failed_publish_leaves_nothing_listed_and_no_temp_dir(checkpoint, coord_key, tmp_path, monkeypatch):
    s = tmp_path / "s"
    publish_checkpoint(checkpoint, s, coord_key, 1, shard_size=SHARD)
    calls = {"n": 0}
    real = publish_mod._write_chunk

    def fail_midway(fd, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.EIO, "I/O error")
        real(fd, data)

    monkeypatch.setattr(publish_mod, "_write_chunk", fail_midway)
    with pytest.raises(PublishError, match="I/O error"):
        publish_checkpoint(checkpoint, s, coord_key, 2, shard_size=SHARD)
    assert list_versions(s) == [1]
    assert sorted(p.name for p in s.iterdir()) == ["v1"]


def test_disk_full_while_publishing_is_a_disk_full_error_and_lists_nothing(
    checkpoint, coord_key, tmp_path, monkeypatch
):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(publish_mod, "_write_chunk", full)
    with pytest.raises(DiskFullError, match="no space left"):
        publish_checkpoint(checkpoint, tmp_path / "s", coord_key, 1, shard_size=SHARD)
    assert list_versions(tmp_path / "s") == []
    assert list((tmp_path / "s").iterdir()) == []


def test_a_concurrent_reader_never_sees_a_half_written_version(coord_key, tmp_path):
    ckpt = make_checkpoint(tmp_path / "big", model_bytes=6 * 1024 * 1024)
    s = tmp_path / "s"
    seen_incomplete = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            for v in list_versions(s):
                vdir = version_dir(s, v)
                try:
                    m = verify_manifest((vdir / MANIFEST_NAME).read_bytes(), coord_key.public)
                    if any((vdir / f.name).stat().st_size != f.size for f in m.files):
                        seen_incomplete.append(v)
                except FileNotFoundError:
                    pass  # pruned between listing and reading: fine, it was whole when listed

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for v in range(1, 4):
            publish_checkpoint(ckpt, s, coord_key, v, shard_size=SHARD, keep=2)
    finally:
        stop.set()
        watcher.join()
    assert seen_incomplete == []
    assert list_versions(s) == [2, 3]


def test_link_mode_publishes_the_same_bytes(checkpoint, coord_key, tmp_path):
    publish_checkpoint(checkpoint, tmp_path / "s", coord_key, 1, shard_size=SHARD, link=True)
    assert same_tree(checkpoint, version_dir(tmp_path / "s", 1))


def test_a_file_name_that_cannot_be_published_is_named_in_the_error(checkpoint, coord_key, tmp_path):
    (checkpoint / "bad name.json").write_text("{}")
    with pytest.raises(PublishError, match="bad name.json"):
        publish_checkpoint(checkpoint, tmp_path / "s", coord_key, 1)
