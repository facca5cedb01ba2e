"""One live node process per key, seen from the nodes: a second process with a key that is running
elsewhere stops with `key_in_use` and the fix while the first keeps working; a node that stops says
goodbye, so its key is free at once; a banned key stops its node with the reason."""

from __future__ import annotations

import asyncio

from support import channel_to, make_coordinator_dir, running_coordinator

from veriroll.coordinator import store as st
from veriroll.node.agent import NodeAgent
from veriroll.node.config import NodeConfig
from veriroll.node.engines.torch import TorchEngine
from veriroll.node.hardware import Hardware
from veriroll.node.weights import LocalVersions
from veriroll.protos.identity import PrivateKey
from veriroll.protos.service import CallError


def agent_for(coord, key: PrivateKey, **cfg) -> NodeAgent:
    hw = Hardware(cpu="test", cpu_count=1, ram_bytes=0, disk_free_bytes=0, os="test")
    return NodeAgent(NodeConfig(call_timeout_s=20, heartbeat_s=0.2, **cfg), key=key, channel=channel_to(coord),
                     engine_factory=lambda path, version: TorchEngine(path, version, threads=1),
                     versions=LocalVersions(coord.base_dir / "checkpoints" / "versions"), hardware=hw,
                     engine_kind="torch", device="cpu")


async def until(predicate, tries: int = 600):
    for _ in range(tries):
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return False


def test_a_second_process_with_a_running_key_is_refused_and_the_first_goes_on(tmp_path):
    key = PrivateKey.generate()

    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord:
            first = agent_for(coord, key)
            running = asyncio.create_task(first.run())
            assert await until(lambda: first.status.accepted_groups >= 1)
            second = agent_for(coord, key)
            try:
                await second.run()
                refused = None
            except CallError as err:
                refused = err
            before = first.status.accepted_groups
            assert await until(lambda: first.status.accepted_groups > before)  # the first is untouched
            first.request_stop()
            assert await running == 0
            # Its goodbye gave back the lease it left: no deadline to wait out for the key's next process.
            assert coord.db.run_sync(lambda c: st.open_leases_of(c, key.node_id)) == 0
            # It said goodbye: the key is free at once for a new process, no session to wait out.
            third = agent_for(coord, key, max_groups=1)
            rc = await asyncio.wait_for(third.run(), 60)
            for a in (first, second, third):
                await a.stub.channel.close()
            return refused, rc, coord.db.run_sync(st.status_summary)

    refused, rc, summary = asyncio.run(scenario())
    assert refused is not None and refused.reason == "key_in_use"
    assert rc == 0 and summary["rejections_by_reason"].get("key_in_use") == 1


def test_a_running_node_whose_key_is_banned_stops_with_the_reason(tmp_path, caplog):
    key = PrivateKey.generate()

    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord:
            agent = agent_for(coord, key)
            running = asyncio.create_task(agent.run())
            assert await until(lambda: agent.status.accepted_groups >= 1)
            coord.db.run_sync(lambda c: st.set_standing(c, key.node_id, "banned", "operator: test of bans"))
            coord.service.ledger.forget(key.node_id)
            rc = await asyncio.wait_for(running, 60)
            await agent.stub.channel.close()
            return rc

    assert asyncio.run(scenario()) == 3
    assert any("operator: test of bans" in r.getMessage() for r in caplog.records)
