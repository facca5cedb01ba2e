"""Signed peer hints: the coordinator's directory of nodes' swarms, and its announcement (no libp2p needed)."""

from __future__ import annotations

import asyncio

import pytest
from support import make_coordinator_dir, node_client, running_coordinator

from veriroll.coordinator import store as st
from veriroll.protos.identity import PrivateKey
from veriroll.protos.service import CallError
from veriroll.protos.v1 import coordinator_pb2 as pb
from veriroll.shardcast.swarm.errors import PeerHintsError
from veriroll.shardcast.swarm.hints import (
    PeerDirectory,
    PeerHint,
    PeerHints,
    sign_peer_hints,
    verify_peer_hints,
)

PEER = "12D3KooWQrU8SK48Zi67oCxsmbZneBLv9xyULZ646RbLJ8tSCmMh"
OTHER = "12D3KooWH7VTvCdg1xEcw2YGTDp9Meaeb3bFvzk2UziMmBZoieJV"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_peer_hints_not_signed_by_the_coordinator_are_refused():
    key, impostor = PrivateKey.generate(), PrivateKey.generate()
    hints = PeerHints(3, (PeerHint(PEER, ("/ip4/10.0.0.1/tcp/4001",), (3,)),))
    assert verify_peer_hints(sign_peer_hints(key, hints), key.public) == hints
    with pytest.raises(PeerHintsError, match="not signed"):
        verify_peer_hints(sign_peer_hints(impostor, hints), key.public)
    with pytest.raises(PeerHintsError, match="parse"):
        verify_peer_hints(b"{not json", key.public)


def test_the_directory_announces_only_addresses_at_the_ip_a_heartbeat_came_from_and_forgets_the_silent():
    key, clock = PrivateKey.generate(), FakeClock()
    directory = PeerDirectory(key, ttl_s=60, resign_s=0, clock=clock)
    directory.record("node-a", PEER, ["/ip4/203.0.113.7/tcp/4001", "/ip4/10.9.9.9/tcp/4001", "/dns/evil/tcp/1"],
                     [4, 5], "203.0.113.7")
    directory.record("node-b", OTHER, ["/ip4/198.51.100.1/tcp/4001"], [5], "203.0.113.8")  # not its address
    hints = verify_peer_hints(directory.signed(5), key.public)
    assert hints == PeerHints(5, (PeerHint(PEER, ("/ip4/203.0.113.7/tcp/4001",), (4, 5)),))
    with pytest.raises(PeerHintsError):
        directory.record("node-c", "not a peer id!", ["/ip4/203.0.113.9/tcp/1"], [5], "203.0.113.9")
    # Behind NAT: reachable through node-a, which is listed at that address; not through an unknown relay.
    through_a = f"/ip4/203.0.113.7/tcp/4001/p2p/{PEER}/p2p-circuit"
    through_stranger = f"/ip4/192.0.2.1/tcp/4001/p2p/{OTHER}/p2p-circuit"
    directory.record("node-b", OTHER, [through_a, through_stranger, "/ip4/10.0.0.2/tcp/4001"], [5], "203.0.113.8")
    peers = {p.peer_id: p for p in verify_peer_hints(directory.signed(5), key.public).peers}
    assert peers[OTHER] == PeerHint(OTHER, (through_a,), (5,))
    clock.now += 61
    assert verify_peer_hints(directory.signed(6), key.public).peers == ()


def test_a_peer_reported_bad_from_two_networks_is_no_longer_announced_and_one_networks_word_is_not_enough():
    key, clock = PrivateKey.generate(), FakeClock()
    directory = PeerDirectory(key, resign_s=0, clock=clock)
    reporters = ["12D3KooWReporterA1111111111111111111111111111111", "12D3KooWReporterB1111111111111111111111111111111",
                 "12D3KooWReporterC1111111111111111111111111111111"]

    def announced() -> set[str]:
        return {p.peer_id for p in verify_peer_hints(directory.signed(5), key.public).peers}

    directory.record("accused", PEER, ["/ip4/203.0.113.7/tcp/4001"], [5], "203.0.113.7")
    directory.record("r1", reporters[0], ["/ip4/198.51.100.1/tcp/1"], [5], "198.51.100.1", [PEER])
    directory.record("r2", reporters[1], ["/ip4/198.51.100.2/tcp/1"], [5], "198.51.100.2", [PEER])  # same /24
    directory.record("accused", PEER, ["/ip4/203.0.113.7/tcp/4001"], [5], "203.0.113.7", [PEER])  # itself
    assert PEER in announced() and not directory.withheld(PEER)
    directory.record("r3", reporters[2], ["/ip4/192.0.2.3/tcp/1"], [5], "192.0.2.3", [PEER])
    assert PEER not in announced() and directory.withheld(PEER)
    clock.now += directory.report_ttl_s
    directory.record("accused", PEER, ["/ip4/203.0.113.7/tcp/4001"], [5], "203.0.113.7")
    assert PEER in announced()


def test_a_heartbeat_with_a_swarm_is_announced_signed_and_a_malformed_one_refused(tmp_path):
    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord, node_client(coord) as node:
            await node.heartbeat(pb.HeartbeatRequest(loaded_version=0, swarm_peer_id=PEER,
                                                     swarm_addrs=["/ip4/127.0.0.1/tcp/4001"], swarm_versions=[0]))
            policy = (await node.get_policy()).policy
            with pytest.raises(CallError) as refused:
                await node.heartbeat(pb.HeartbeatRequest(loaded_version=0, swarm_peer_id="0OIl not base58"))
            key = coord.service.coordinator_key
            rejected = coord.db.run_sync(st.status_summary)["rejections_by_reason"]
            return verify_peer_hints(policy.peer_hints, key), refused.value, rejected

    hints, refused, rejected = asyncio.run(scenario())
    assert hints.peers == (PeerHint(PEER, ("/ip4/127.0.0.1/tcp/4001",), (0,)),)
    assert refused.reason == "malformed" and rejected.get("malformed") == 1
