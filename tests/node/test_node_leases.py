"""A node asks for its next lease inside each submission (SubmitGroupRequest.next_leases): one LeaseWork
call for a run of groups, and none left dangling when it stops at max_groups. Real coordinator, real
torch engine, real socket."""

from __future__ import annotations

import asyncio
import shutil

from support import make_coordinator_dir, running_coordinator
from test_one_process_per_key import agent_for, until

from veriroll.coordinator import store as st
from veriroll.protos.identity import PrivateKey


def test_a_node_leases_through_its_submissions_and_stops_with_no_lease_open(tmp_path):
    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord:
            agent = agent_for(coord, PrivateKey.generate(), max_groups=4)
            assert await asyncio.wait_for(agent.run(), 120) == 0
            requests = coord.service.metrics.requests
            leases = coord.service.metrics.leases_issued
            summary = coord.db.run_sync(st.status_summary)
            return (requests.get(method="LeaseWork", result="ok"), requests.get(method="SubmitGroup", result="ok"),
                    leases.get(), summary, agent.status.accepted_groups)

    lease_calls, submits, issued, summary, accepted = asyncio.run(scenario())
    assert accepted == submits == summary["accepted_groups"] == 4
    assert lease_calls == 1  # the first lease; the other three came with the groups before them
    assert issued == 4 and summary["open_leases"] == 0  # the last group asked for none


def test_a_node_told_to_wait_makes_the_newest_version_it_holds_live(tmp_path):
    """With no work for it (the queue of groups full, no trainer), a node that holds a newer version swaps it
    in while it waits, instead of at its next lease: that lease then starts at once, and a node sitting idle
    is never left on an old version. Before, it ran the old one until a lease at the new one came."""
    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path, {"leases.queue_maxsize": 1})) as coord:
            agent = agent_for(coord, PrivateKey.generate())
            running = asyncio.create_task(agent.run())
            assert await until(lambda: agent.status.accepted_groups >= 1 and agent.engine is not None)
            assert agent.engine.version == 0
            versions = coord.base_dir / "checkpoints" / "versions"
            shutil.copytree(versions / "v000000", versions / "v000001")
            coord.service.policy.advance(1)
            swapped = await until(lambda: agent.engine.version == 1)
            accepted, in_flight = agent.status.accepted_groups, agent.status.leases_in_flight
            agent.request_stop()
            assert await asyncio.wait_for(running, 60) == 0
            await agent.stub.channel.close()
            return swapped, accepted, in_flight, agent.status.loaded_version

    swapped, accepted, in_flight, loaded = asyncio.run(scenario())
    assert swapped and loaded == 1
    assert accepted == 1 and in_flight == 0  # no lease since: the swap was made while waiting
