"""Fetching a version from relays over real sockets, with relays that lie, stall, truncate or vanish."""

from __future__ import annotations

import asyncio
import errno
import json
import signal
import subprocess
import sys
import time

import pytest
from shardcast_helpers import (
    REPO,
    SHARD,
    FakeRelay,
    SilentServer,
    can_mount_tmpfs,
    copy_store,
    free_port,
    resign,
    same_tree,
)

from veriroll.shardcast.errors import (
    DiskFullError,
    ManifestError,
    ManifestSignatureError,
    NoRelayReachableError,
    OutputDirError,
    ShardUnavailableError,
    VersionGoneError,
    WrongVersionError,
)
from veriroll.shardcast.fetch import JOURNAL_NAME, PARTIAL_SUFFIX, fetch_version, fetch_version_sync
from veriroll.shardcast.fetch import disk as fetch_disk  # the seams where bytes touch the disk
from veriroll.shardcast.manifest import verify_manifest
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.relay import RelayServer
from veriroll.shardcast.store import MANIFEST_NAME, READY_NAME, is_ready, version_dir

# Short timeouts keep the stalling tests quick; nothing asserts how long anything took.
FAST = {"connect_timeout": 2.0, "read_timeout": 1.0, "progress": False}
# Eight downloads at once, at most four per relay: with two relays, both are certainly used.
BOTH = {"concurrency": 8, "per_relay": 4}

pytestmark = pytest.mark.timeout(120)


def run(coro):
    return asyncio.run(coro)


def test_fetch_from_the_origin_gives_the_identical_checkpoint_marked_ready(
    store, checkpoint, coord_key, tmp_path
):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            return await fetch_version([origin.url], coord_key.public, tmp_path / "out", **FAST)

    result = run(go())
    out = tmp_path / "out"
    assert result.version == 1 and result.path == out and not result.already_present
    assert same_tree(checkpoint, out) and is_ready(out)
    assert result.bytes_downloaded == result.manifest.total_size and result.bad_relays == []
    assert not (tmp_path / f".out{PARTIAL_SUFFIX}").exists()


def test_tampered_shard_on_one_relay_is_refetched_elsewhere_and_the_relay_is_named(
    store, checkpoint, coord_key, tmp_path
):
    evil_store = copy_store(store, tmp_path / "evil-store")
    model = version_dir(evil_store, 1) / "model.safetensors"
    data = bytearray(model.read_bytes())
    for offset in range(100, len(data), SHARD):  # one flipped byte in every shard of the weights
        data[offset] ^= 0xFF
    model.write_bytes(bytes(data))  # same size: the relay itself does not notice

    async def go():
        async with (
            RelayServer(store, coord_key.public, port=0) as good,
            RelayServer(evil_store, coord_key.public, port=0) as evil,
        ):
            result = await fetch_version(
                [good.url, evil.url], coord_key.public, tmp_path / "out", **FAST, **BOTH
            )
            return result, evil.url

    result, evil_url = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert result.bad_relay_urls == {evil_url}
    assert {i.kind for i in result.bad_relays} == {"hash-mismatch"}
    assert all(i.shard is not None for i in result.bad_relays)
    assert result.relays[evil_url].bad >= 1


def test_tampered_shards_on_the_only_relay_fail_without_a_ready_checkpoint(store, coord_key, tmp_path):
    evil_store = copy_store(store, tmp_path / "evil-store")
    model = version_dir(evil_store, 1) / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[5] ^= 1
    model.write_bytes(bytes(data))

    async def go():
        async with RelayServer(evil_store, coord_key.public, port=0) as evil:
            await fetch_version([evil.url], coord_key.public, tmp_path / "out", **FAST, max_attempts=2)

    with pytest.raises(ShardUnavailableError, match="hash-mismatch"):
        run(go())
    assert not (tmp_path / "out").exists()


def test_truncated_shard_stream_is_retried_on_another_relay(store, checkpoint, coord_key, tmp_path):
    async def go():
        fake = FakeRelay(store, mode="truncate")
        await fake.start()
        try:
            async with RelayServer(store, coord_key.public, port=0) as good:
                result = await fetch_version(
                    [fake.url, good.url], coord_key.public, tmp_path / "out", **FAST, **BOTH
                )
                return result, fake.url
        finally:
            await fake.stop()

    result, fake_url = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert any(i.relay == fake_url and i.kind == "truncated" for i in result.failures)


def test_short_range_answer_is_reported_as_a_bad_relay(store, checkpoint, coord_key, tmp_path):
    async def go():
        fake = FakeRelay(store, mode="short")
        await fake.start()
        try:
            async with RelayServer(store, coord_key.public, port=0) as good:
                result = await fetch_version(
                    [fake.url, good.url], coord_key.public, tmp_path / "out", **FAST, **BOTH
                )
                return result, fake.url
        finally:
            await fake.stop()

    result, fake_url = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert result.bad_relay_urls == {fake_url}
    assert {i.kind for i in result.bad_relays} == {"wrong-length"}


def test_manifest_signed_by_another_key_is_refused_and_an_honest_relay_used(
    store, checkpoint, coord_key, other_key, tmp_path
):
    forged = resign(store, 1, other_key, as_version=2)  # a "newer" version, signed by an impostor

    async def go():
        fake = FakeRelay(store, versions=[1, 2], manifests={2: forged})
        await fake.start()
        try:
            async with RelayServer(store, coord_key.public, port=0) as good:
                return await fetch_version(
                    [fake.url, good.url], coord_key.public, tmp_path / "out", **FAST
                ), fake.url
        finally:
            await fake.stop()

    result, fake_url = run(go())
    assert result.version == 1 and same_tree(checkpoint, tmp_path / "out")
    assert [(i.relay, i.kind) for i in result.bad_relays] == [(fake_url, "bad-signature")]


def test_manifest_signed_by_another_key_everywhere_is_a_signature_error(
    store, coord_key, other_key, tmp_path
):
    async def go():
        fake = FakeRelay(store, manifests={1: resign(store, 1, other_key)})
        await fake.start()
        try:
            await fetch_version([fake.url], coord_key.public, tmp_path / "out", **FAST)
        finally:
            await fake.stop()

    with pytest.raises(ManifestSignatureError, match="not valid for the coordinator key"):
        run(go())
    assert not (tmp_path / "out").exists()


def test_manifest_whose_shards_do_not_cover_a_file_is_refused(store, coord_key, tmp_path):
    def drop_last_weight_shard(body):
        idx = max(i for i, s in enumerate(body["shards"]) if s["file"] == "model.safetensors")
        body["shards"].pop(idx)

    async def go():
        fake = FakeRelay(store, manifests={1: resign(store, 1, coord_key, drop_last_weight_shard)})
        await fake.start()
        try:
            await fetch_version([fake.url], coord_key.public, tmp_path / "out", **FAST)
        finally:
            await fake.stop()

    with pytest.raises(ManifestError, match="must cover it exactly"):
        run(go())
    assert not (tmp_path / "out").exists()


def test_path_traversal_in_manifest_file_names_is_refused_and_nothing_is_written_outside(
    store, coord_key, tmp_path
):
    target = "../../escaped.json"

    def traverse(body):
        for f in body["files"]:
            if f["name"] == "config.json":
                f["name"] = target
        for s in body["shards"]:
            if s["file"] == "config.json":
                s["file"] = target

    async def go():
        fake = FakeRelay(store, manifests={1: resign(store, 1, coord_key, traverse)})
        await fake.start()
        try:
            await fetch_version([fake.url], coord_key.public, tmp_path / "deep" / "out", **FAST)
        finally:
            await fake.stop()

    with pytest.raises(ManifestError, match="path traversal"):
        run(go())
    assert not list(tmp_path.rglob("escaped.json"))
    assert not (tmp_path / "deep" / "out").exists()


def test_a_relay_that_accepts_and_says_nothing_does_not_stall_the_fetch(
    store, checkpoint, coord_key, tmp_path
):
    async def go():
        silent = SilentServer()
        await silent.start()
        try:
            async with RelayServer(store, coord_key.public, port=0) as good:
                return await fetch_version(
                    [silent.url, good.url], coord_key.public, tmp_path / "out", **FAST
                ), silent
        finally:
            await silent.stop()

    result, silent = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert result.relays[silent.url].reachable is False
    assert any(i.relay == silent.url and i.kind == "timeout" for i in result.failures)


def test_a_relay_that_goes_silent_mid_fetch_is_abandoned_for_another(store, checkpoint, coord_key, tmp_path):
    async def go():
        fake = FakeRelay(store, mode="silent-files")
        await fake.start()
        try:
            async with RelayServer(store, coord_key.public, port=0) as good:
                result = await fetch_version(
                    [fake.url, good.url], coord_key.public, tmp_path / "out", **FAST, **BOTH
                )
                return result, fake
        finally:
            await fake.stop()

    result, fake = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert fake.file_requests >= 1
    assert any(i.relay == fake.url and i.kind == "timeout" for i in result.failures)


def test_a_relay_serving_an_old_version_as_new_is_caught_and_named(checkpoint, coord_key, tmp_path):
    s = tmp_path / "s"
    for v in (1, 2):
        publish_checkpoint(checkpoint, s, coord_key, v, shard_size=SHARD)
    old_as_new = (version_dir(s, 2) / MANIFEST_NAME).read_bytes()  # validly signed, but version 2

    async def go():
        fake = FakeRelay(s, versions=[3], manifests={3: old_as_new})
        await fake.start()
        try:
            async with RelayServer(s, coord_key.public, port=0) as good:
                result = await fetch_version([fake.url, good.url], coord_key.public, tmp_path / "out", **FAST)
                with pytest.raises(WrongVersionError, match="asked for version 3"):
                    await fetch_version([fake.url], coord_key.public, tmp_path / "out3", 3, **FAST)
                return result, fake.url
        finally:
            await fake.stop()

    result, fake_url = run(go())
    assert result.version == 2
    assert [(i.relay, i.kind) for i in result.bad_relays] == [(fake_url, "wrong-version")]
    assert not (tmp_path / "out3").exists()


def test_min_version_refuses_a_stale_latest(store, coord_key, tmp_path):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as stale:
            await fetch_version([stale.url], coord_key.public, tmp_path / "out", min_version=2, **FAST)

    with pytest.raises(VersionGoneError, match="at least version 2"):
        run(go())


def test_no_reachable_relay_is_its_own_error(coord_key, tmp_path):
    with pytest.raises(NoRelayReachableError, match="none of the 2 relays answered"):
        run(fetch_version([f"127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], coord_key.public,
                          tmp_path / "out", **FAST))  # fmt: skip


def test_a_version_held_nowhere_is_version_gone(store, coord_key, tmp_path):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            await fetch_version([origin.url], coord_key.public, tmp_path / "out", 9, **FAST)

    with pytest.raises(VersionGoneError, match="no reachable relay holds 9"):
        run(go())


def test_disk_full_during_fetch_is_an_error_and_a_rerun_resumes(
    store, checkpoint, coord_key, tmp_path, monkeypatch
):
    real = fetch_disk._write_at
    writes = {"n": 0}

    def fills_up(fd, data, offset):
        writes["n"] += 1
        if writes["n"] > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            monkeypatch.setattr(fetch_disk, "_write_at", fills_up)
            with pytest.raises(DiskFullError, match="free some space"):
                await fetch_version([origin.url], coord_key.public, tmp_path / "out", **FAST, concurrency=1)
            assert not (tmp_path / "out").exists()
            monkeypatch.setattr(fetch_disk, "_write_at", real)  # space freed
            return await fetch_version([origin.url], coord_key.public, tmp_path / "out", **FAST)

    result = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert result.shards_reused >= 1 and result.bytes_reused > 0
    assert result.bytes_downloaded + result.bytes_reused == result.manifest.total_size


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare -m and mount -t tmpfs")
def test_fetch_into_a_full_tmpfs_exits_with_the_disk_full_status(store, coord_key, tmp_path):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            mnt = tmp_path / "tiny"
            mnt.mkdir()
            script = (
                f"mount -t tmpfs -o size=512k tmpfs {mnt} && exec {sys.executable} -m veriroll.shardcast.cli "
                f"shardcast fetch --relay {origin.url} --coordinator-key {tmp_path / 'keys/coordinator.key.pub'} "
                f"--out {mnt / 'out'} --timeout 5"
            )
            proc = await asyncio.create_subprocess_exec(
                "unshare", "-m", "sh", "-c", script, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            out, err = await proc.communicate()
            return proc.returncode, err.decode()

    code, err = run(go())
    assert code == 6, err
    assert "no space left" in err


def test_resume_after_a_killed_fetch_skips_the_shards_it_already_has(store, checkpoint, coord_key, tmp_path):
    out = tmp_path / "out"
    journal = tmp_path / f".out{PARTIAL_SUFFIX}" / JOURNAL_NAME

    async def go():
        slow = FakeRelay(store, delay=0.15)  # slow enough to kill the fetch half way
        await slow.start()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "veriroll.shardcast.cli", "shardcast", "fetch", "--relay", slow.url,
                "--coordinator-key", str(tmp_path / "keys/coordinator.key.pub"), "--out", str(out),
                "--concurrency", "1", "--quiet", cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            while not (journal.exists() and len(journal.read_text().split()) >= 3):
                assert proc.returncode is None, "the fetch finished before it could be interrupted"
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            assert not out.exists()
            async with RelayServer(store, coord_key.public, port=0) as origin:
                return await fetch_version([origin.url], coord_key.public, out, **FAST)
        finally:
            await slow.stop()

    result = run(go())
    assert same_tree(checkpoint, out)
    assert result.shards_reused >= 3
    assert result.bytes_downloaded + result.bytes_reused == result.manifest.total_size


def test_a_journal_that_lies_costs_a_refetch_not_a_bad_checkpoint(
    store, checkpoint, coord_key, tmp_path, monkeypatch
):
    real = fetch_disk._write_at
    writes = {"n": 0}

    def fills_up(fd, data, offset):
        writes["n"] += 1
        if writes["n"] > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    staging = tmp_path / f".out{PARTIAL_SUFFIX}"

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            monkeypatch.setattr(fetch_disk, "_write_at", fills_up)
            with pytest.raises(DiskFullError):
                await fetch_version([origin.url], coord_key.public, tmp_path / "out", **FAST, concurrency=1)
            monkeypatch.setattr(fetch_disk, "_write_at", real)
            # Corrupt the bytes of a shard the journal records as done.
            manifest = verify_manifest((staging / MANIFEST_NAME).read_bytes(), coord_key.public)
            done = int((staging / JOURNAL_NAME).read_text().split()[0])
            shard = manifest.shards[done]
            with open(staging / shard.file, "r+b") as fh:
                fh.seek(shard.offset)
                fh.write(b"\x00" * min(16, shard.size))
            return await fetch_version([origin.url], coord_key.public, tmp_path / "out", **FAST)

    result = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert result.bytes_downloaded + result.bytes_reused == result.manifest.total_size


def test_a_newer_version_replaces_the_old_checkpoint_in_one_step(store, checkpoint, coord_key, tmp_path):
    newer = tmp_path / "ckpt2"
    from shardcast_helpers import make_checkpoint

    make_checkpoint(newer, seed=2, model_bytes=1_000_000)

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            first = await fetch_version([origin.url], coord_key.public, tmp_path / "out", **FAST)
            publish_checkpoint(newer, store, coord_key, 2, shard_size=SHARD)
            second = await fetch_version([origin.url], coord_key.public, tmp_path / "out", **FAST)
            return first, second

    first, second = run(go())
    assert (first.version, second.version) == (1, 2)
    assert same_tree(newer, tmp_path / "out")
    ready = json.loads((tmp_path / "out" / READY_NAME).read_text())
    assert ready["version"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_fetch_refuses_to_replace_a_directory_that_is_not_a_checkpoint(store, coord_key, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            await fetch_version([origin.url], coord_key.public, out, **FAST)

    with pytest.raises(OutputDirError, match="refusing to replace"):
        run(go())
    assert (out / "notes.txt").read_text() == "mine"


def test_an_already_fetched_version_is_not_downloaded_again(store, coord_key, tmp_path):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            await fetch_version([origin.url], coord_key.public, tmp_path / "out", **FAST)
            return await fetch_version([origin.url], coord_key.public, tmp_path / "out", 1, **FAST)

    result = run(go())
    assert result.already_present and result.bytes_downloaded == 0


def test_sync_wrapper_fetches_from_a_relay_in_another_process(store, checkpoint, coord_key, tmp_path):
    port = free_port()
    relay = subprocess.Popen(
        [sys.executable, "-m", "veriroll.shardcast.cli", "relay", "run", "--store", str(store), "--port", str(port),
         "--coordinator-key", str(tmp_path / "keys/coordinator.key.pub")],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        result = None
        for _ in range(200):
            try:
                result = fetch_version_sync(
                    [f"http://127.0.0.1:{port}"],
                    tmp_path / "keys/coordinator.key.pub",
                    tmp_path / "out",
                    **FAST,
                )
                break
            except NoRelayReachableError:
                time.sleep(0.1)  # the relay process is still starting
        assert result is not None and result.version == 1
        assert same_tree(checkpoint, tmp_path / "out")
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=30)
    assert relay.returncode == 0


def test_verify_files_rereads_the_disk_and_refetches_what_it_changed(
    store, checkpoint, coord_key, tmp_path, monkeypatch
):
    flipped = {"done": False}

    def disk_flips_a_byte(hasher, fd, pieces, offset):
        for p in pieces:
            hasher.update(p)
        if not flipped["done"] and offset == 0 and len(pieces[0]) > 10:
            flipped["done"] = True
            pieces = [b"\x00" + bytes(pieces[0][1:]), *pieces[1:]]  # what lands on disk differs
        fetch_disk._write_at(fd, pieces, offset)

    monkeypatch.setattr(fetch_disk, "_hash_and_write", disk_flips_a_byte)

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            return await fetch_version(
                [origin.url], coord_key.public, tmp_path / "out", verify_files=True, **FAST
            )

    result = run(go())
    assert flipped["done"]
    assert same_tree(checkpoint, tmp_path / "out")
    assert result.shards_downloaded > len(result.manifest.shards)  # the damaged shard was fetched again


def test_progress_reports_reach_the_checkpoint_size_and_the_bar_runs_off_a_terminal(
    store, coord_key, tmp_path, capsys
):
    seen = []

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            return await fetch_version(
                [origin.url], coord_key.public, tmp_path / "out", connect_timeout=2.0, read_timeout=1.0,
                progress=True, on_progress=lambda done, total: seen.append((done, total)),
            )  # fmt: skip

    result = run(go())
    assert seen[-1] == (result.manifest.total_size, result.manifest.total_size)
    assert "version 1" in capsys.readouterr().err
