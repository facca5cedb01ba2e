"""The swarm's peer directory shared by edge processes through the store (shardcast/swarm/hints.py
PeerDirectory with ``exchange``, coordinator/store.py ``exchange_swarm_directory``): a node heartbeating to one
edge is announced by every edge, bad-peer reports through different edges add up, and the tables stay
bounded."""

from __future__ import annotations

import asyncio

import pytest
from pg_cluster import throwaway_cluster

from veriroll.coordinator import store as st
from veriroll.protos.identity import PrivateKey
from veriroll.shardcast.swarm.hints import PeerDirectory, PeerHint, verify_peer_hints

PEER = "12D3KooWQrU8SK48Zi67oCxsmbZneBLv9xyULZ646RbLJ8tSCmMh"
OTHER = "12D3KooWH7VTvCdg1xEcw2YGTDp9Meaeb3bFvzk2UziMmBZoieJV"
REPORTERS = ["12D3KooWReporterA1111111111111111111111111111111", "12D3KooWReporterB1111111111111111111111111111111"]


class FakeClock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def edges_over(db: st.Database, key: PrivateKey, clock: FakeClock, **kw) -> list[PeerDirectory]:
    """Two edges' directories sharing ``db``, as coordinator/app.py builds them."""
    def exchange(*args, **kwargs):
        return db.run(lambda c: st.exchange_swarm_directory(c, *args, **kwargs))

    return [PeerDirectory(key, resign_s=0, clock=clock, exchange=exchange, **kw) for _ in range(2)]


def announced(directory: PeerDirectory, key: PrivateKey) -> dict[str, PeerHint]:
    return {p.peer_id: p for p in verify_peer_hints(directory.signed(5), key.public).peers}


async def share(*directories: PeerDirectory) -> None:
    for directory in directories:
        await directory.share()


def test_a_node_heartbeating_to_one_edge_is_announced_by_the_other_until_it_goes_silent_or_leaves(pg_url):
    key, clock, db = PrivateKey.generate(), FakeClock(), st.Database(pg_url)
    a, b = edges_over(db, key, clock, ttl_s=60)

    async def scenario():
        a.record("node-1", PEER, ["/ip4/203.0.113.7/tcp/4001"], [4, 5], "203.0.113.7")
        seen = [announced(b, key)]
        await share(a, b)
        seen.append(announced(b, key))
        # Behind NAT, heartbeating to b: a circuit through node-1, which only a listed (on a) at that address.
        through_1 = f"/ip4/203.0.113.7/tcp/4001/p2p/{PEER}/p2p-circuit"
        b.record("node-2", OTHER, [through_1, "/ip4/10.0.0.2/tcp/4001"], [5], "198.51.100.9")
        await share(b, a)
        seen.append(announced(a, key))
        clock.now += 30
        b.record("node-2", OTHER, [through_1], [5], "198.51.100.9")  # node-2 keeps beating, node-1 does not
        await share(b, a)
        clock.now += 31
        await share(a, b)
        seen.append(announced(a, key))
        b.record("node-2", "", [], [], "198.51.100.9")  # its swarm stopped: off every edge at once
        await share(b, a)
        seen.append(announced(a, key))
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        db.close()
    assert seen[0] == {}  # not yet exchanged
    assert seen[1] == {PEER: PeerHint(PEER, ("/ip4/203.0.113.7/tcp/4001",), (4, 5))}
    assert seen[2][OTHER] == PeerHint(OTHER, (f"/ip4/203.0.113.7/tcp/4001/p2p/{PEER}/p2p-circuit",), (5,))
    assert set(seen[3]) == {OTHER}  # node-1 silent for 61 s: forgotten by both
    assert seen[4] == {}


def test_reports_from_two_networks_through_two_edges_withhold_the_peer_until_they_expire(pg_url):
    key, clock, db = PrivateKey.generate(), FakeClock(), st.Database(pg_url)
    a, b = edges_over(db, key, clock, report_ttl_s=600)

    async def scenario():
        a.record("accused", PEER, ["/ip4/203.0.113.7/tcp/4001"], [5], "203.0.113.7")
        a.record("r1", REPORTERS[0], ["/ip4/198.51.100.1/tcp/1"], [5], "198.51.100.1", [PEER])
        b.record("r2", REPORTERS[1], ["/ip4/192.0.2.3/tcp/1"], [5], "192.0.2.3", [PEER])
        alone = (a.withheld(PEER), b.withheld(PEER))  # each edge heard one network only
        await share(a, b, a)
        together = (a.withheld(PEER), b.withheld(PEER), PEER in announced(a, key), PEER in announced(b, key))
        clock.now += 600  # the reports are as old as report_ttl_s; the accused node is still beating
        a.record("accused", PEER, ["/ip4/203.0.113.7/tcp/4001"], [5], "203.0.113.7")
        await share(a, b)
        stored = db.run_sync(lambda c: st.swarm_directory(c, int(clock.now * 1000), 60_000, 10)[1])
        return alone, together, (a.withheld(PEER), b.withheld(PEER), PEER in announced(b, key)), stored

    try:
        alone, together, expired, stored = asyncio.run(scenario())
    finally:
        db.close()
    assert alone == (False, False)
    assert together == (True, True, False, False)
    assert expired == (False, False, True) and stored == []


def test_the_shared_tables_stay_bounded_and_an_older_listing_does_not_overwrite_a_newer(store_target):
    db = st.Database(store_target)
    now = 10_000_000
    bounds = {"seen_ms": 0, "now_ms": now, "listing_ttl_ms": 60_000, "report_ttl_ms": 600_000, "max_listings": 3,
              "reports_per_peer": 2}

    def exchange(listed=(), dropped=(), reported=(), seen=(), **kw):
        return db.run_sync(lambda c: st.exchange_swarm_directory(c, list(listed), list(seen), list(dropped), list(reported),
                                                                 **{**bounds, **kw}))

    try:
        listings, _ = exchange([(f"n{i}", PEER, ("/ip4/203.0.113.7/tcp/1",), (i,), now) for i in range(5)])
        first = sorted(x[0] for x in listings)
        listings, _ = exchange([("n0", OTHER, ("/ip4/203.0.113.9/tcp/2",), (7,), now - 1)])  # older: ignored
        stale_write = {x[0]: x[1:] for x in listings}["n0"]
        listings, _ = exchange([("n4", PEER, ("/ip4/203.0.113.7/tcp/1",), (4,), now)], [("n1", now)])
        after_drop = sorted(x[0] for x in listings)
        listings, _ = exchange(now_ms=now + 60_001)
        expired = listings
        reports = [(REPORTERS[i % 2] if i < 8 else f"12D3KooWPeer{i:040d}", f"198.51.{i}.0/24", now + i)
                   for i in range(12)]
        _, stored = exchange(reported=reports)
        _, later = exchange(now_ms=now + 600_020)
    finally:
        db.close()
    assert first == ["n0", "n1", "n2"]  # full at 3: the nodes already listed stay
    assert stale_write == (PEER, ("/ip4/203.0.113.7/tcp/1",), (0,), now)
    assert after_drop == ["n0", "n2", "n4"]
    assert expired == []
    by_peer: dict[str, list[str]] = {}
    for peer, network, _ in stored:
        by_peer.setdefault(peer, []).append(network)
    # At most 3 peers reported, each with its 2 newest networks.
    assert sorted(by_peer) == sorted([*REPORTERS, "12D3KooWPeer" + "8".zfill(40)])
    assert sorted(by_peer[REPORTERS[0]]) == ["198.51.4.0/24", "198.51.6.0/24"]
    assert later == []


@pytest.fixture()
def own_pg():
    """A cluster of this test's own, which it stops and starts again."""
    yield from throwaway_cluster()


def test_what_an_edge_heard_while_the_store_was_down_is_written_once_it_is_back(own_pg):
    key, clock, db = PrivateKey.generate(), FakeClock(), st.Database(own_pg.new_database())
    a, b = edges_over(db, key, clock)

    async def scenario():
        a.record("node-1", PEER, ["/ip4/203.0.113.7/tcp/4001"], [5], "203.0.113.7")
        a.record("r1", REPORTERS[0], ["/ip4/198.51.100.1/tcp/1"], [5], "198.51.100.1", [OTHER])
        own_pg.stop_server()
        with pytest.raises(st.StoreUnavailable):
            await a.share()
        clock.now += 1
        a.record("node-1", PEER, ["/ip4/203.0.113.7/tcp/4001"], [5], "203.0.113.7")  # beats again, unwritten
        own_pg.start_server()
        for _ in range(100):  # the connection reopens by itself, at most every RECONNECT_EVERY_S
            try:
                await a.share()
                break
            except st.StoreUnavailable:
                await asyncio.sleep(0.1)
        await b.share()
        return announced(b, key), b._reports, b._listings["node-1"].seen

    try:
        hints, reports, seen = asyncio.run(scenario())
    finally:
        db.close()
    assert set(hints) == {PEER, REPORTERS[0]} and seen == clock.now  # its latest beat
    assert reports == {OTHER: {"198.51.100.0/24": clock.now - 1}}
