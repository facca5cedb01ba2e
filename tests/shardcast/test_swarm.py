"""The peer swarm: real libp2p hosts on 127.0.0.1, a real HTTP origin, real signatures.

Skipped where libp2p is not installed (it is in the dev extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil

import pytest
from shardcast_helpers import same_tree

from veriroll.shardcast.fetch import fetch_version
from veriroll.shardcast.manifest import verify_manifest
from veriroll.shardcast.relay import RelayServer
from veriroll.shardcast.store import MANIFEST_NAME, is_ready, version_dir

pytest.importorskip("libp2p")
import trio

from veriroll.shardcast.swarm.errors import (
    PeerNotAnnouncedError,
    PeerUnavailableError,
    SwarmNotRunningError,
)
from veriroll.shardcast.swarm.hints import PeerHint, PeerHints, sign_peer_hints, verify_peer_hints
from veriroll.shardcast.swarm.host import MAX_TRACKED_PEERS, Swarm
from veriroll.shardcast.swarm.wire import Refusal, SwarmLimits

pytestmark = pytest.mark.timeout(120)
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
FAST = {"connect_timeout": 2.0, "read_timeout": 2.0, "progress": False, "fsync": False}


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def started(*swarms: Swarm):
    try:
        for s in swarms:
            await s.start()
        yield swarms
    finally:
        for s in swarms:
            await s.stop()


async def served_once_settled(swarm: Swarm, want: int) -> int:
    """``swarm.bytes_served`` once it reaches ``want`` (or 10 s passed): the serving side counts a chunk after
    its write returns, on the swarm's own thread, which can be just after the fetcher has the bytes."""
    for _ in range(1000):
        if swarm.bytes_served >= want:
            break
        await asyncio.sleep(0.01)
    return swarm.bytes_served


def announce(node: Swarm, *peers: Swarm, version: int = 1) -> None:
    node.announce(PeerHints(version, tuple(PeerHint(p.peer_id, tuple(p.addrs), (version,)) for p in peers)))


def manifest_of(store, coord_key, version: int = 1):
    return verify_manifest((version_dir(store, version) / MANIFEST_NAME).read_bytes(), coord_key.public)


def test_a_node_fetches_a_version_from_a_peer_with_no_relay(store, checkpoint, coord_key, tmp_path):
    async def go():
        seed, node = Swarm(listen=LOOPBACK), Swarm(listen=LOOPBACK)
        async with started(seed, node), RelayServer(store, coord_key.public, port=0) as origin:
            seed.serve(version_dir(store, 1), manifest_of(store, coord_key))
            announce(node, seed)
            result = await fetch_version([origin.url], coord_key.public, tmp_path / "out", swarm=node, **FAST)
            return result, origin.url, await served_once_settled(seed, result.manifest.total_size)

    result, origin_url, served = run(go())
    assert same_tree(checkpoint, tmp_path / "out") and is_ready(tmp_path / "out")
    assert result.shards_from_peers == len(result.manifest.shards)
    assert result.relays[origin_url].bytes == 0  # the origin gave the manifest only
    assert served == result.manifest.total_size and result.bad_peers == []


def test_a_busy_peer_is_waited_for_not_replaced_by_the_origin(store, checkpoint, coord_key, tmp_path):
    async def go():
        # The seed serves one stream per peer at once; the node asks up to three shards of it together, so
        # most are answered BUSY. Every shard must still come from the seed, none from the origin.
        seed = Swarm(listen=LOOPBACK, limits=SwarmLimits(max_streams_per_peer=1))
        node = Swarm(listen=LOOPBACK)
        async with started(seed, node), RelayServer(store, coord_key.public, port=0) as origin:
            seed.serve(version_dir(store, 1), manifest_of(store, coord_key))
            announce(node, seed)
            result = await fetch_version([origin.url], coord_key.public, tmp_path / "out", swarm=node, **FAST)
            return result, origin.url, seed.refusals[Refusal.BUSY]

    result, origin_url, busy = run(go())
    assert busy >= 1  # the seed did refuse streams
    assert same_tree(checkpoint, tmp_path / "out")
    assert result.shards_from_peers == len(result.manifest.shards)
    assert result.relays[origin_url].bytes == 0


def test_a_corrupting_peer_is_named_and_banned_and_no_bad_version_is_installed(
    store, checkpoint, coord_key, tmp_path
):
    manifest = manifest_of(store, coord_key)
    liar_dir = tmp_path / "liar"
    shutil.copytree(version_dir(store, 1), liar_dir)
    weights = manifest.shards_of("model.safetensors")
    with open(liar_dir / "model.safetensors", "r+b") as f:  # one flipped byte in each weight shard
        for shard in weights:
            f.seek(shard.offset + 7)
            byte = f.read(1)
            f.seek(shard.offset + 7)
            f.write(bytes([byte[0] ^ 0xFF]))

    async def go():
        liar, node = Swarm(listen=LOOPBACK), Swarm(listen=LOOPBACK)
        async with started(liar, node), RelayServer(store, coord_key.public, port=0) as origin:
            liar.serve(liar_dir, manifest)
            announce(node, liar)
            result = await fetch_version([origin.url], coord_key.public, tmp_path / "out", swarm=node, **FAST)
            return result, liar.peer_id, list(node.bad_peers), node.peers_for(1)

    result, liar_id, bad, still_announced = run(go())
    assert same_tree(checkpoint, tmp_path / "out")  # every shard the liar altered came from the origin instead
    # shards asked of it at once each count: every one is named, and the liar is banned after the first
    assert {i.relay for i in result.bad_peers} == {liar_id}
    assert {i.kind for i in result.bad_peers} == {Refusal.HASH_MISMATCH}
    assert {b.peer_id for b in bad} == {liar_id} and still_announced == []


class StallingSwarm(Swarm):
    """Sends the first chunk of each shard, then nothing, holding the stream open."""

    stalling = False

    async def _send(self, stream, data: bytes, peer: str) -> None:
        await stream.write(data[: len(data) // 2])
        self.stalling = True
        await trio.sleep(3600)


def test_a_peer_that_stalls_mid_stream_is_dropped_and_the_shard_fetched_elsewhere(
    store, checkpoint, coord_key, tmp_path
):
    async def go():
        staller = StallingSwarm(listen=LOOPBACK)
        node = Swarm(listen=LOOPBACK, limits=SwarmLimits(stream_timeout_s=0.5))
        async with started(staller, node), RelayServer(store, coord_key.public, port=0) as origin:
            staller.serve(version_dir(store, 1), manifest_of(store, coord_key))
            announce(node, staller)
            result = await fetch_version([origin.url], coord_key.public, tmp_path / "out", swarm=node, **FAST)
            return result, staller.peer_id, node.refusals[Refusal.STALLED]

    result, staller_id, stalls = run(go())
    assert same_tree(checkpoint, tmp_path / "out")
    assert result.shards_from_peers == 0 and result.bad_peers == [] and stalls >= 1
    assert any(i.relay == staller_id and i.kind == Refusal.STALLED for i in result.failures)


def test_stream_budgets_of_many_peer_ids_stay_bounded_and_a_flooder_stays_refused():
    swarm = Swarm(listen=LOOPBACK, limits=SwarmLimits(stream_rate_per_peer=0.001, stream_burst_per_peer=2))

    async def go():
        admitted = [swarm._admit("flooder") is None for _ in range(3)]
        for i in range(3 * MAX_TRACKED_PEERS):  # peer ids are free: many, each opening one stream
            assert swarm._admit(f"peer-{i}") is None
            if i % 100 == 0:  # the flooder keeps at it, so its empty bucket is never the one forgotten
                assert swarm._admit("flooder") is not None
        return admitted

    assert trio.run(go) == [True, True, False]
    assert len(swarm._buckets) == MAX_TRACKED_PEERS
    assert swarm.refusals[Refusal.RATE_LIMITED] == 1 + 3 * MAX_TRACKED_PEERS // 100 + 1


def test_a_flood_of_stream_openings_from_one_peer_is_refused_and_counted(store, coord_key):
    manifest = manifest_of(store, coord_key)
    shard = manifest.shards[0]

    async def go():
        server = Swarm(listen=LOOPBACK, limits=SwarmLimits(stream_rate_per_peer=1.0, stream_burst_per_peer=5,
                                                           max_streams_per_peer=100))
        flooder = Swarm(listen=LOOPBACK, limits=SwarmLimits(max_streams_per_peer=100))
        async with started(server, flooder):
            server.serve(version_dir(store, 1), manifest)
            announce(flooder, server)
            outcomes = await asyncio.gather(
                *(flooder.fetch_shard(server.peer_id, shard.sha256, shard.size) for _ in range(30)),
                return_exceptions=True,
            )
            return outcomes, server.refusals[Refusal.RATE_LIMITED]

    outcomes, rate_limited = run(go())
    refused = [o for o in outcomes if isinstance(o, PeerUnavailableError)]
    served = [o for o in outcomes if isinstance(o, bytes)]
    assert len(refused) + len(served) == 30
    assert 5 <= len(served) < 30 and rate_limited == len(refused)
    assert all(o.reason == "refused" and "RATE_LIMITED" in o.detail for o in refused)


def test_a_peer_hint_outside_the_announced_set_is_refused(store, coord_key, other_key):
    manifest = manifest_of(store, coord_key)
    shard = manifest.shards[0]

    async def go():
        announced, stranger, node = (Swarm(listen=LOOPBACK) for _ in range(3))
        async with started(announced, stranger, node):
            stranger.serve(version_dir(store, 1), manifest)
            wire = sign_peer_hints(coord_key, PeerHints(1, (PeerHint(announced.peer_id, tuple(announced.addrs), (1,)),)))
            node.announce(verify_peer_hints(wire, coord_key.public))
            with pytest.raises(PeerNotAnnouncedError):  # a peer the coordinator did not name
                await node.fetch_shard(stranger.peer_id, shard.sha256, shard.size)
            with pytest.raises(PeerNotAnnouncedError):  # an announced peer, at an address it was not announced at
                await node.dial(announced.peer_id, stranger.addrs[0])
            await node.dial(announced.peer_id, announced.addrs[0])
            return node.refusals[Refusal.NOT_ANNOUNCED], node.peers_for(1)

    refused, peers = run(go())
    assert refused == 2 and len(peers) == 1


def test_stop_ends_the_host_thread_and_calls_in_flight_or_later_say_so(store, coord_key):
    manifest = manifest_of(store, coord_key)
    shard = manifest.shards[0]

    async def go():
        swarm, staller = Swarm(listen=LOOPBACK), StallingSwarm(listen=LOOPBACK)
        async with started(staller):
            staller.serve(version_dir(store, 1), manifest)
            await swarm.start()
            thread = swarm._thread
            announce(swarm, staller)
            in_flight = asyncio.create_task(swarm.fetch_shard(staller.peer_id, shard.sha256, shard.size))
            while not staller.stalling and not in_flight.done():  # until the staller is mid-answer
                await asyncio.sleep(0.05)
            await swarm.stop()
            with pytest.raises(SwarmNotRunningError):
                await in_flight
            with pytest.raises(SwarmNotRunningError):
                await swarm.fetch_shard(staller.peer_id, shard.sha256, shard.size)
        return thread.is_alive()

    assert run(go()) is False


class LyingSwarm(Swarm):
    """Says it holds every shard of every version it is asked about, and holds none."""

    def __init__(self, manifest, **kwargs):
        super().__init__(**kwargs)
        self.fake = manifest

    async def _answer(self, stream, peer: str) -> None:
        request = await stream.read(33)
        if request[0] == 2:  # HAVE: a full bitfield
            bits = b"\xff" * ((len(self.fake.shards) + 7) // 8)
            await stream.write(b"\x00" + len(bits).to_bytes(4, "big") + bits)
        else:
            await stream.write(b"\x01")  # GET: NOT_HELD


def test_a_peer_lying_about_what_it_holds_costs_only_a_fall_back_to_the_origin(
    store, checkpoint, coord_key, tmp_path
):
    async def go():
        liar, node = LyingSwarm(manifest_of(store, coord_key), listen=LOOPBACK), Swarm(listen=LOOPBACK)
        async with started(liar, node), RelayServer(store, coord_key.public, port=0) as origin:
            announce(node, liar)
            return await fetch_version([origin.url], coord_key.public, tmp_path / "out", swarm=node, **FAST)

    result = run(go())
    assert same_tree(checkpoint, tmp_path / "out") and result.shards_from_peers == 0
    assert any(i.kind == "not-held" for i in result.failures) and result.bad_peers == []


def test_nodes_fetching_at_once_trade_shards_and_the_origin_serves_fewer_copies(store, checkpoint, coord_key, tmp_path):
    from veriroll.shardcast.swarm.loopback import broadcast_over_swarm

    async def go():
        async with RelayServer(store, coord_key.public, port=0) as origin:
            return await broadcast_over_swarm([origin.url], coord_key.public, 1, 3, tmp_path / "nodes", fsync=False)

    run_ = run(go())
    assert all(same_tree(checkpoint, tmp_path / "nodes" / f"node-{i}") for i in range(3))
    assert run_.peer_bytes > 0 and run_.origin_copies < 3 and run_.bad_peers == 0
    assert len(run_.completion_s) == 3 and run_.time_to_fraction_s(0.95) == max(run_.completion_s)


def test_peers_can_be_announced_behind_proxies_for_the_wan_benchmark(store, checkpoint, coord_key, tmp_path):
    from veriroll.shardcast.swarm.loopback import broadcast_over_swarm

    forwarded = [0]
    servers = []

    async def pipe(reader, writer):
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                forwarded[0] += len(data)
                writer.write(data)
                await writer.drain()
        writer.close()

    async def proxy(i: int, addr: str) -> str:
        """A plain TCP forwarder in front of ``addr`` (/ip4/127.0.0.1/tcp/PORT); its own address."""
        port = int(addr.rsplit("/", 1)[1])

        async def forward(reader, writer):
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        server = await asyncio.start_server(forward, "127.0.0.1", 0)
        servers.append(server)
        return f"/ip4/127.0.0.1/tcp/{server.sockets[0].getsockname()[1]}"

    async def go():
        try:
            async with RelayServer(store, coord_key.public, port=0) as origin:
                return await broadcast_over_swarm([origin.url], coord_key.public, 1, 2, tmp_path / "nodes",
                                                  peer_addr=proxy, fsync=False)
        finally:
            for server in servers:
                server.close()

    result = run(go())
    assert all(same_tree(checkpoint, tmp_path / "nodes" / f"node-{i}") for i in range(2))
    assert result.peer_bytes > 0 and forwarded[0] >= result.peer_bytes  # every peer byte went through a proxy


def test_a_node_learns_its_peers_from_signed_hints_and_serves_what_it_fetched(store, coord_key, other_key, tmp_path):
    from veriroll.node.weights import RelayVersions

    async def go():
        first_swarm, second_swarm = Swarm(listen=LOOPBACK), Swarm(listen=LOOPBACK)
        async with started(first_swarm, second_swarm), RelayServer(store, coord_key.public, port=0) as origin:
            first = RelayVersions(tmp_path / "first", coord_key.public, swarm=first_swarm)
            second = RelayVersions(tmp_path / "second", coord_key.public, swarm=second_swarm)
            await first._fetch(1, [origin.url])
            listing = first.swarm_listing()
            hint = PeerHint(listing["swarm_peer_id"], tuple(listing["swarm_addrs"]), tuple(listing["swarm_versions"]))
            second.take_peer_hints(sign_peer_hints(other_key, PeerHints(1, (hint,))))  # forged: ignored
            forged_peers = second_swarm.peers_for(1)
            second.take_peer_hints(sign_peer_hints(coord_key, PeerHints(1, (hint,))))
            await second._fetch(1, [origin.url])
            served = await served_once_settled(first_swarm, manifest_of(store, coord_key).total_size)
            return forged_peers, listing, served, second.path_for(1), second.bad_peers

    forged_peers, listing, served, path, bad = run(go())
    assert forged_peers == [] and listing["swarm_versions"] == [1]
    assert served == manifest_of(store, coord_key).total_size and path is not None and bad == set()


def test_a_node_with_no_inbound_port_serves_peers_through_a_circuit_relay(store, coord_key):
    manifest = manifest_of(store, coord_key)

    async def go():
        relay, natted, node = Swarm(listen=LOOPBACK, relay=True), Swarm(listen=LOOPBACK), Swarm(listen=LOOPBACK)
        async with started(relay, natted, node):
            natted.serve(version_dir(store, 1), manifest)
            circuit = await natted.reserve(relay.peer_id, relay.addrs[0])
            # Announced at its circuit address only, as a node behind NAT is: the node reaches it via the relay.
            node.announce(PeerHints(1, (PeerHint(natted.peer_id, (circuit,), (1,)),)))
            shards = [await node.fetch_shard(natted.peer_id, s.sha256, s.size) for s in manifest.shards[:3]]
            return circuit, relay.peer_id, shards, await served_once_settled(natted, sum(len(x) for x in shards))

    circuit, relay_id, shards, served = run(go())
    assert circuit.endswith(f"/p2p/{relay_id}/p2p-circuit")
    assert shards and served == sum(len(s) for s in shards) == sum(s.size for s in manifest.shards[:3])


def test_a_node_behind_nat_reserves_a_circuit_on_a_relay_process_and_serves_through_it(store, coord_key, tmp_path):
    """`veriroll relay run --swarm-listen` carries circuits; a node's `swarm_relays` entry (the address that
    relay prints) is parsed and reserved as the node agent does at start; a third node fetches through it."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from veriroll.node.agent import NodeAgent

    manifest = manifest_of(store, coord_key)
    pub = tmp_path / "keys" / "coordinator.key.pub"
    veriroll = str(Path(sys.executable).parent / "veriroll")
    proc = subprocess.Popen([veriroll, "relay", "run", "--store", str(tmp_path / "relay-store"), "--port", "0",
                             "--coordinator-key", str(pub), "--swarm-listen", LOOPBACK],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("circuit relay at /ip4/127.0.0.1/tcp/") and "/p2p/" in line, line
        relay_addr = line.removeprefix("circuit relay at ")

        async def go():
            natted, node = Swarm(listen=LOOPBACK), Swarm(listen=LOOPBACK)
            async with started(natted, node):
                natted.serve(version_dir(store, 1), manifest)
                agent = SimpleNamespace(cfg=SimpleNamespace(swarm_relays=["not-a-multiaddr", relay_addr]))
                await NodeAgent._reserve_circuits(agent, natted)
                circuits = [a for a in natted.addrs if a.endswith("/p2p-circuit")]
                node.announce(PeerHints(1, (PeerHint(natted.peer_id, tuple(circuits), (1,)),)))
                shard = manifest.shards[0]
                return circuits, await node.fetch_shard(natted.peer_id, shard.sha256, shard.size), natted.bytes_served

        circuits, data, served = run(go())
        assert len(circuits) == 1 and circuits[0].startswith(relay_addr)  # the bad entry was skipped, not fatal
        assert len(data) == manifest.shards[0].size == served
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0
