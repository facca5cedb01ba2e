"""The relay server over real sockets: URL scheme, ranges, slow and silent clients, mirroring and chains."""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import subprocess
import sys

import aiohttp
import pytest
import yarl
from shardcast_helpers import (
    REPO,
    SHARD,
    FakeRelay,
    can_mount_tmpfs,
    copy_store,
    make_checkpoint,
    same_tree,
    until,
)

from veriroll.shardcast.fetch import disk as fetch_disk  # the seams where bytes touch the disk
from veriroll.shardcast.fetch import fetch_version
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.relay import RelayServer
from veriroll.shardcast.store import MANIFEST_NAME, list_versions, version_dir

FAST = {"connect_timeout": 2.0, "read_timeout": 1.0, "progress": False}
MIRROR = {"poll_interval": 0.1, "fetch_options": {"connect_timeout": 1.0, "read_timeout": 1.0}}

pytestmark = pytest.mark.timeout(120)


def run(coro):
    return asyncio.run(coro)


async def get_json(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        assert r.status == 200
        return await r.json()


def test_status_lists_versions_and_load(store, coord_key):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as relay:
            status = await get_json(f"{relay.url}/status")
            versions = await get_json(f"{relay.url}/versions")
            return status, versions

    status, versions = run(go())
    assert status["role"] == "origin" and status["versions"] == [1] and status["latest"] == 1
    assert {
        "active_transfers",
        "open_connections",
        "requests_total",
        "bytes_served_total",
        "uptime_s",
    } <= set(status["load"])
    assert versions == {"versions": [1], "latest": 1}


def test_manifest_and_range_requests_serve_exact_bytes(store, coord_key):
    model = (version_dir(store, 1) / "model.safetensors").read_bytes()
    manifest_bytes = (version_dir(store, 1) / MANIFEST_NAME).read_bytes()

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as relay, aiohttp.ClientSession() as s:
            base = f"{relay.url}/versions/1"
            async with s.get(f"{relay.url}/versions/latest/manifest") as r:
                assert r.headers["X-Shardcast-Version"] == "1" and await r.read() == manifest_bytes
            async with s.get(f"{base}/files/model.safetensors", headers={"Range": "bytes=1000-1999"}) as r:
                assert r.status == 206 and r.headers["Content-Range"] == f"bytes 1000-1999/{len(model)}"
                assert await r.read() == model[1000:2000]
                assert "immutable" in r.headers["Cache-Control"]
            async with s.get(f"{base}/files/model.safetensors") as r:
                assert r.status == 200 and await r.read() == model
            async with s.get(f"{base}/files/extra/generation_config.json") as r:
                assert r.status == 200 and json.loads(await r.read()) == {"temperature": 1}
            async with s.head(f"{base}/files/model.safetensors") as r:
                assert r.status == 200 and r.content_length == len(model)

    run(go())


@pytest.mark.parametrize(
    "path",
    [
        "/versions/2/manifest",
        "/versions/1/files/nope.bin",
        "/versions/latest/files/config.json",
        "/versions/1/files/%2e%2e/%2e%2e/keys/coordinator.key",
        "/versions/1/files/..%2f..%2fkeys%2fcoordinator.key",
        "/versions/1/files/.shardcast-manifest.json",
        "/versions/abc/manifest",
        "/",
    ],
)
def test_unknown_versions_files_and_traversal_attempts_are_404(store, coord_key, path):
    async def go():
        async with (
            RelayServer(store, coord_key.public, port=0) as relay,
            aiohttp.ClientSession() as s,
            s.get(yarl.URL(relay.url + path, encoded=True)) as r,
        ):
            return r.status, await r.read()

    status, body = run(go())
    assert status == 404
    assert b"PRIVATE KEY" not in body


def test_idle_and_half_sent_connections_are_closed_and_never_stall_other_clients(
    store, checkpoint, coord_key, tmp_path
):
    async def go():
        async with RelayServer(store, coord_key.public, port=0, idle_timeout=0.5) as relay:
            silent = [await asyncio.open_connection("127.0.0.1", relay.port) for _ in range(20)]
            r, w = await asyncio.open_connection("127.0.0.1", relay.port)
            w.write(b"GET /status HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            await w.drain()
            silent.append((r, w))
            result = await fetch_version([relay.url], coord_key.public, tmp_path / "out", **FAST)
            closed = 0
            for reader, writer in silent:
                data = await asyncio.wait_for(reader.read(), 30)  # guard only: returns at EOF
                closed += data == b""
                writer.close()
            return result, closed

    result, closed = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert closed == 21


def test_a_client_that_stops_reading_is_cut_off_while_others_are_served(coord_key, tmp_path):
    big = make_checkpoint(tmp_path / "big", model_bytes=8 * 1024 * 1024)
    s = tmp_path / "s"
    publish_checkpoint(big, s, coord_key, 1, shard_size=1024 * 1024)

    async def go():
        async with RelayServer(s, coord_key.public, port=0, send_grace=0.2, min_send_rate=50e6) as relay:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a tiny window: the relay must wait
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", relay.port))
            sock.send(b"GET /versions/1/files/model.safetensors HTTP/1.1\r\nHost: x\r\n\r\n")
            result = await fetch_version([relay.url], coord_key.public, tmp_path / "out", **FAST)

            async def cut():
                return (await get_json(f"{relay.url}/status"))["load"]["send_timeouts_total"]

            await until(cut, "the stalled reader is cut off")
            sock.close()
            return result

    run(go())
    assert same_tree(big, tmp_path / "out")


def test_a_relay_at_its_transfer_limit_answers_503_with_retry_after(store, coord_key):
    async def go():
        async with (
            RelayServer(store, coord_key.public, port=0, max_transfers=0) as relay,
            aiohttp.ClientSession() as s,
            s.get(f"{relay.url}/versions/1/files/config.json") as r,
        ):
            return r.status, r.headers.get("Retry-After")

    assert run(go()) == (503, "1")


def test_many_clients_at_once_all_get_the_checkpoint(store, checkpoint, coord_key, tmp_path):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as relay:
            return await asyncio.gather(
                *(
                    fetch_version([relay.url], coord_key.public, tmp_path / f"out{i}", **FAST)
                    for i in range(6)
                )
            )

    results = run(go())
    assert all(r.version == 1 for r in results)
    assert all(same_tree(checkpoint, tmp_path / f"out{i}") for i in range(6))


def test_chain_origin_relay_relay_client_delivers_a_verified_checkpoint(
    store, checkpoint, coord_key, tmp_path
):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            r1 = RelayServer(tmp_path / "r1", coord_key.public, port=0, upstreams=[origin.url], **MIRROR)
            async with r1:
                r2 = RelayServer(tmp_path / "r2", coord_key.public, port=0, upstreams=[r1.url], **MIRROR)
                async with r2:

                    async def r2_holds():
                        return (await get_json(f"{r2.url}/status"))["versions"] == [1]

                    await until(r2_holds, "the second relay mirrors version 1")
                    result = await fetch_version([r2.url], coord_key.public, tmp_path / "out", **FAST)
                    origin_status = await get_json(f"{origin.url}/status")
                    return result, origin_status

    result, origin_status = run(go())
    assert result.version == 1 and same_tree(checkpoint, tmp_path / "out")
    # Only the first relay read from the origin: one copy of the checkpoint (plus manifests).
    total = result.manifest.total_size
    assert total <= origin_status["load"]["bytes_served_total"] < 1.5 * total


def test_a_mirror_never_lists_a_version_before_it_holds_it_whole(store, checkpoint, coord_key, tmp_path):
    async def go():
        slow = FakeRelay(store, delay=0.02)
        await slow.start()
        seen = []
        try:
            async with RelayServer(
                tmp_path / "m", coord_key.public, port=0, upstreams=[slow.url], **MIRROR
            ) as m:

                async def done():
                    status = await get_json(f"{m.url}/status")
                    # Checked at the moment of listing: every file there, every byte right.
                    whole = (
                        same_tree(checkpoint, version_dir(tmp_path / "m", 1)) if status["versions"] else None
                    )
                    seen.append((status["mirror"]["fetching"], status["versions"], whole))
                    return status["versions"]

                await until(done, "the mirror lists version 1", pause=0.01)
        finally:
            await slow.stop()
        return seen

    seen = run(go())
    assert (1, [], None) in seen  # observed while the mirror was fetching: not listed yet
    assert all(whole for _, versions, whole in seen if versions)


def test_a_mirror_refuses_a_tampered_upstream_and_keeps_serving(store, coord_key, tmp_path):
    evil_store = copy_store(store, tmp_path / "evil")
    model = version_dir(evil_store, 1) / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[SHARD + 7] ^= 0x01
    model.write_bytes(bytes(data))

    async def go():
        async with RelayServer(evil_store, coord_key.public, port=0) as evil:
            opts = {**MIRROR, "fetch_options": {**MIRROR["fetch_options"], "max_attempts": 2}}
            async with RelayServer(
                tmp_path / "m", coord_key.public, port=0, upstreams=[evil.url], **opts
            ) as m:

                async def failed():
                    status = await get_json(f"{m.url}/status")
                    return status if status["mirror"]["last_error"] else None

                return await until(failed, "the mirror gives up on the tampered version")

    status = run(go())
    assert status["versions"] == []
    assert "ShardUnavailableError" in status["mirror"]["last_error"]
    assert "hash-mismatch" in status["mirror"]["last_error"]
    assert list_versions(tmp_path / "m") == []


def test_a_mirror_keeps_only_the_newest_k_versions(checkpoint, coord_key, tmp_path):
    s = tmp_path / "s"
    for v in range(1, 5):
        publish_checkpoint(checkpoint, s, coord_key, v, shard_size=SHARD, keep=10)

    async def go():
        async with RelayServer(s, coord_key.public, port=0) as origin:
            m = RelayServer(
                tmp_path / "m", coord_key.public, port=0, upstreams=[origin.url], keep=2, **MIRROR
            )
            async with m:

                def holds(expected):
                    async def check():
                        return (await get_json(f"{m.url}/status"))["versions"] == expected

                    return check

                await until(holds([3, 4]), "the mirror holds the newest two")
                publish_checkpoint(checkpoint, s, coord_key, 5, shard_size=SHARD, keep=10)
                await until(holds([4, 5]), "the mirror moves on to version 5")

    run(go())
    assert list_versions(tmp_path / "m") == [4, 5]


def test_a_mirror_with_a_full_disk_lists_nothing_and_says_why(store, coord_key, tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fetch_disk, "_write_at", full)

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            m = RelayServer(tmp_path / "m", coord_key.public, port=0, upstreams=[origin.url], **MIRROR)
            async with m:

                async def failed():
                    status = await get_json(f"{m.url}/status")
                    return status if status["mirror"]["last_error"] else None

                return await until(failed, "the mirror reports the full disk")

    status = run(go())
    assert status["versions"] == [] and "DiskFullError" in status["mirror"]["last_error"]


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare -m and mount -t tmpfs")
def test_a_mirror_process_on_a_tiny_tmpfs_reports_disk_full_and_stays_up(store, coord_key, tmp_path):
    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            mnt = tmp_path / "tiny"
            mnt.mkdir()
            port_file = tmp_path / "port"
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            port_file.write_text(str(port))
            script = (
                f"mount -t tmpfs -o size=512k tmpfs {mnt} && exec {sys.executable} -m veriroll.shardcast.cli "
                f"relay run --store {mnt / 'store'} --port {port} --upstream {origin.url} "
                f"--coordinator-key {tmp_path / 'keys/coordinator.key.pub'} --poll-interval 0.2"
            )
            proc = await asyncio.create_subprocess_exec(
                "unshare",
                "-m",
                "sh",
                "-c",
                script,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:

                async def failed():
                    try:
                        status = await get_json(f"http://127.0.0.1:{port}/status")
                    except aiohttp.ClientError:
                        return None
                    return status if status["mirror"]["last_error"] else None

                return await until(failed, "the mirror on the tiny tmpfs reports its full disk", tries=1200)
            finally:
                proc.terminate()
                await proc.wait()

    status = run(go())
    assert status["versions"] == []
    assert "DiskFullError" in status["mirror"]["last_error"]


def test_an_origin_does_not_serve_versions_it_cannot_vouch_for(
    store, checkpoint, coord_key, other_key, tmp_path
):
    s = copy_store(store, tmp_path / "s")
    publish_checkpoint(checkpoint, tmp_path / "foreign", other_key, 2, shard_size=SHARD)
    (version_dir(tmp_path / "foreign", 2)).rename(version_dir(s, 2))  # signed by someone else
    publish_checkpoint(checkpoint, s, coord_key, 3, shard_size=SHARD)
    with open(version_dir(s, 3) / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)  # damaged on disk

    async def go():
        async with RelayServer(s, coord_key.public, port=0) as relay:
            return await get_json(f"{relay.url}/status")

    assert run(go())["versions"] == [1]


class GatedRelay(FakeRelay):
    """A relay that serves the start of each file at once and holds every other range until ``gate`` opens."""

    def __init__(self, store, gate: asyncio.Event):
        super().__init__(store)
        self.gate = gate

    async def _file(self, request):
        if request.http_range.start:
            await self.gate.wait()
        return await super()._file(request)


def test_a_streaming_mirror_serves_each_shard_once_verified_before_it_holds_the_version(
    store, checkpoint, coord_key, tmp_path
):
    model = "model.safetensors"

    async def go():
        gate = asyncio.Event()
        upstream = GatedRelay(store, gate)
        await upstream.start()
        try:
            m = RelayServer(tmp_path / "m", coord_key.public, port=0, upstreams=[upstream.url], stream_wait=0.3,
                            **MIRROR)  # fmt: skip
            async with m, aiohttp.ClientSession() as s:

                async def shard0_verified():
                    return 1 in m.streaming and m.streaming[1].covers(model, 0, SHARD)

                await until(shard0_verified, "the mirror verifies the first shard")
                status = await get_json(f"{m.url}/status")
                url = f"{m.url}/versions/1/files/{model}"
                async with s.get(url, headers={"Range": f"bytes=0-{SHARD - 1}"}) as r:
                    first = (r.status, await r.read())
                async with s.get(url, headers={"Range": f"bytes={SHARD}-{2 * SHARD - 1}"}) as r:
                    second = (r.status, r.headers.get("X-Shardcast-Refusal"), r.headers.get("Retry-After"))
                # A node that asks now gets the rest as it arrives, from the mirror alone.
                node = asyncio.create_task(fetch_version([m.url], coord_key.public, tmp_path / "out", 1, **FAST))
                await asyncio.sleep(0.5)
                gate.set()
                result = await node
                after = await get_json(f"{m.url}/status")
                return status, first, second, result, after
        finally:
            await upstream.stop()

    status, first, second, result, after = run(go())
    assert status["versions"] == [] and status["streaming"] == [1]
    data = (checkpoint / model).read_bytes()
    assert first == (206, data[:SHARD])
    assert second == (503, "not-yet", "1")
    assert result.version == 1 and same_tree(checkpoint, tmp_path / "out")
    assert after["load"]["rejections"]["not-yet"] >= 1
    assert after["versions"] == [1] and after["streaming"] == []


def test_a_streaming_version_whose_fetch_fails_is_no_longer_served(store, coord_key, tmp_path):
    async def go():
        gate = asyncio.Event()
        upstream = GatedRelay(store, gate)
        await upstream.start()
        m = RelayServer(tmp_path / "m", coord_key.public, port=0, upstreams=[upstream.url], stream_wait=0.3,
                        poll_interval=30.0, fetch_options={"connect_timeout": 0.5, "read_timeout": 0.3,
                                                           "max_attempts": 2})  # fmt: skip
        async with m:

            async def streaming():
                return (await get_json(f"{m.url}/status"))["streaming"] == [1]

            async def gave_up():
                return m.mirror_fetching is None

            await until(streaming, "the mirror streams version 1")
            await until(gave_up, "the mirror gives up on the silent upstream")
            await upstream.stop()
            async with aiohttp.ClientSession() as s, s.get(f"{m.url}/versions/1/manifest") as r:
                return r.status, await get_json(f"{m.url}/status")

    status, after = run(go())
    assert status == 404
    assert after["streaming"] == [] and after["versions"] == [] and "version 1" in after["mirror"]["last_error"]


def test_coverage_merges_ranges_and_covers_only_what_was_added():
    from veriroll.shardcast.relay import _Coverage

    c = _Coverage()
    c.add(10, 20)
    c.add(30, 40)
    assert c.covers(10, 20) and c.covers(12, 18) and not c.covers(10, 21) and not c.covers(0, 5)
    c.add(20, 30)  # touching both: one range
    assert (c.starts, c.ends) == ([10], [40]) and c.covers(10, 40)
    c.add(0, 5)
    c.add(50, 60)
    assert (c.starts, c.ends) == ([0, 10, 50], [5, 40, 60]) and not c.covers(4, 11)


def test_a_mirror_stops_even_when_its_round_fails_on_the_way_out(store, coord_key, tmp_path, monkeypatch):
    """Stopping cancels the mirror's round; a round that then raises something else (the fetch thread's
    loop closed meanwhile: RuntimeError) must not turn the stop into a logged failure and another round."""
    entered = asyncio.Event()
    failed_once = []

    async def round_that_fails_when_cancelled(self):
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if failed_once:  # (only the first time: so that a regression fails this test rather than hangs it)
                raise
            failed_once.append(True)
            raise RuntimeError("Event loop is closed") from None

    monkeypatch.setattr(RelayServer, "mirror_once", round_that_fails_when_cancelled)

    async def go():
        server = RelayServer(tmp_path / "m", coord_key.public, port=0, upstreams=["http://127.0.0.1:9"], **MIRROR)
        await server.start()
        await asyncio.wait_for(entered.wait(), 30)
        # Hang guard: before the fix the mirror task logged the error, slept and went round again, forever.
        await asyncio.wait_for(server.stop(), 30)
        return server

    server = run(go())
    assert server.mirror_last_error is None  # the stop was not recorded as a failed round
