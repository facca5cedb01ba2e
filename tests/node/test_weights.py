"""Where a node gets policy versions: a real origin relay over a real shardcast store.

A version the coordinator has named but not published yet, or one pruned after the policy moved on,
is normal and must not read as a failure; a newest version that stays missing, or a relay that cannot
be reached, is a problem and is said as one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from veriroll.node.weights import PUBLISH_GRACE_S, RelayVersions
from veriroll.protos.identity import PrivateKey
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.relay import RelayServer


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def publish(tmp_path, store, key: PrivateKey, version: int, *, keep: int = 4) -> None:
    src = tmp_path / f"src{version}"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "version": version}))
    (src / "model.safetensors").write_bytes(bytes([version]) * 50_000)
    publish_checkpoint(src, store, key, version, shard_size=16_384, keep=keep)


@contextlib.asynccontextmanager
async def origin(store, key: PrivateKey):
    relay = RelayServer(store, key.public, port=0)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.stop()


async def settle(versions: RelayVersions, version: int, relays: list[str]) -> None:
    """Ask for ``version`` and wait until that fetch has ended, however it ended."""
    await versions.ensure(version, relays)
    task = versions._tasks.get(version)
    if task is not None:
        await asyncio.wait({task})
    await asyncio.sleep(0)  # the done callback


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "veriroll.node.weights" and r.levelno >= logging.WARNING]


def test_a_version_named_but_not_published_yet_is_waited_for_quietly(tmp_path, caplog):
    key = PrivateKey.generate()
    store = tmp_path / "store"
    publish(tmp_path, store, key, 0)
    clock = FakeClock()
    versions = RelayVersions(tmp_path / "cache", key.public, clock=clock)

    async def scenario():
        async with origin(store, key) as relay:
            await settle(versions, 0, [relay.url])
            assert versions.path_for(0) is not None
            await settle(versions, 1, [relay.url])  # announced by the coordinator, still being published
            assert versions.progress() == {1: "waiting"} and not versions.gone(1)
            # Asked again at once (the lease loop polls): no new fetch before the retry delay.
            first = versions._tasks[1]
            await versions.ensure(1, [relay.url])
            assert versions._tasks[1] is first
            clock.now += 5
            publish(tmp_path, store, key, 1)
            relay.refresh(force=True)
            await settle(versions, 1, [relay.url])
            return versions.path_for(1)

    with caplog.at_level(logging.DEBUG, logger="veriroll.node.weights"):
        assert asyncio.run(scenario()) is not None
    assert warnings_of(caplog) == [] and versions.last_error == ""
    assert versions.progress() == {}


def test_a_newest_version_that_stays_off_the_relays_is_a_warning_that_says_so(tmp_path, caplog):
    key = PrivateKey.generate()
    store = tmp_path / "store"
    publish(tmp_path, store, key, 0)
    clock = FakeClock()
    versions = RelayVersions(tmp_path / "cache", key.public, clock=clock)

    async def scenario():
        async with origin(store, key) as relay:
            await settle(versions, 3, [relay.url])
            assert warnings_of(caplog) == []
            clock.now += PUBLISH_GRACE_S + 1
            await settle(versions, 3, [relay.url])

    with caplog.at_level(logging.INFO, logger="veriroll.node.weights"):
        asyncio.run(scenario())
    [warning] = warnings_of(caplog)
    assert "version 3 is still on no relay 121 s after the coordinator named it" in warning
    assert "publisher or relays may be stuck" in warning
    assert versions.progress() == {3: "failed"} and "version 3" in versions.last_error


def test_a_version_pruned_after_the_policy_moved_on_is_gone_without_a_warning(tmp_path, caplog):
    key = PrivateKey.generate()
    store = tmp_path / "store"
    for v in range(4):
        publish(tmp_path, store, key, v, keep=2)  # the store keeps versions 2 and 3
    versions = RelayVersions(tmp_path / "cache", key.public, clock=FakeClock())

    async def scenario():
        async with origin(store, key) as relay:
            await settle(versions, 3, [relay.url])  # the newest, as a heartbeat asks for it
            await settle(versions, 1, [relay.url])  # an old lease's version, pruned everywhere since

    with caplog.at_level(logging.INFO, logger="veriroll.node.weights"):
        asyncio.run(scenario())
    assert warnings_of(caplog) == [] and versions.last_error == ""
    assert versions.gone(1) and not versions.gone(3) and versions.path_for(3) is not None
    assert any("version 1 left the relays" in r.getMessage() for r in caplog.records)
    assert versions.progress() == {}  # nothing to show: the node has the newest


def test_only_the_newest_missing_version_is_shown_as_waiting(tmp_path):
    key = PrivateKey.generate()
    store = tmp_path / "store"
    publish(tmp_path, store, key, 0)
    versions = RelayVersions(tmp_path / "cache", key.public, clock=FakeClock())

    async def scenario():
        async with origin(store, key) as relay:
            await settle(versions, 5, [relay.url])
            assert versions.progress() == {5: "waiting"}
            await settle(versions, 6, [relay.url])  # the policy moved on before 5 was published

    asyncio.run(scenario())
    assert versions.progress() == {6: "waiting"}


def test_an_unreachable_relay_is_a_warning_once_not_on_every_retry(tmp_path, caplog):
    key = PrivateKey.generate()
    clock = FakeClock()
    versions = RelayVersions(tmp_path / "cache", key.public, clock=clock)
    dead = "http://127.0.0.1:9"  # discard port: nothing listens

    async def scenario():
        for _ in range(3):
            await settle(versions, 0, [dead])
            clock.now += 5
        # Three failures in a row: the next try waits 8 s, so 5 s on it is not due yet.
        third = versions._tasks[0]
        await versions.ensure(0, [dead])
        assert versions._tasks[0] is third

    with caplog.at_level(logging.INFO, logger="veriroll.node.weights"):
        asyncio.run(scenario())
    [warning] = warnings_of(caplog)
    assert "fetching version 0 failed" in warning and "none of the 1 relays answered" in warning
    assert versions.progress() == {0: "failed"}
