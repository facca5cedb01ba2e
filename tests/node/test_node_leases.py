"""A node asks for its next lease inside each submission (SubmitGroupRequest.next_leases): one LeaseWork
call for a run of groups, and none left dangling when it stops at max_groups. Real coordinator, real
torch engine, real socket."""

from __future__ import annotations

import asyncio

from support import make_coordinator_dir, running_coordinator
from test_one_process_per_key import agent_for

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
