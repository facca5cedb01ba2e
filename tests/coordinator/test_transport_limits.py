"""Limits on the coordinator's sockets, tried with real sockets: idle and slow connections are closed, one
address cannot hold all of the HTTP port, bodies over the cap are refused before they are buffered, and
`veriroll coordinator run` stops on SIGTERM/SIGINT in every state with exit status 0.

Waits are bounded only so that a connection the server never closes fails the test instead of hanging
it; nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import platform
import signal
import ssl
import subprocess
import sys
import time
import tracemalloc
import weakref
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
from support import channel_to, make_coordinator_dir, node_client, running_coordinator

from veriroll.coordinator import store as st
from veriroll.coordinator.limits import DescriptorBudget, PeerGate, release_freed_memory
from veriroll.coordinator.server import TRANSPORT_MARGIN_BYTES
from veriroll.protos.service import CallError, full_method
from veriroll.protos.v1 import coordinator_pb2 as pb

VERIROLL = str(Path(sys.executable).parent / "veriroll")
HANG_GUARD_S = 60.0  # a connection still open after this was never going to be closed
FAST = {"server.idle_timeout_s": 1.0, "server.handshake_timeout_s": 1.0}
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
H2_SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


def run(coro):
    return asyncio.run(coro)


def metric(text: str, line_prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.split()[-1])
    return 0.0


async def metrics_text(coord) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{coord.http_port}/metrics") as r:
        return await r.text()


async def closed_by_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None = None) -> bool:
    """Read (acking the server's HTTP/2 SETTINGS once when ``writer`` is given) until the server closes."""
    deadline = time.monotonic() + HANG_GUARD_S
    try:
        while time.monotonic() < deadline:
            data = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            if not data:
                return True
            if writer is not None:
                writer.write(H2_SETTINGS_ACK)
                writer = None
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False
    return False


# --- addresses and the gate ------------------------------------------------------------------------------


def test_gate_refuses_over_the_limit_per_address_counts_and_forgets():
    gate = PeerGate(2)
    assert gate.acquire("192.0.2.1") and gate.acquire("192.0.2.1")
    assert not gate.acquire("192.0.2.1")
    assert gate.acquire("192.0.2.2")  # another address has its own allowance
    assert gate.refused == 1 and gate.held("192.0.2.1") == 2
    gate.release("192.0.2.1")
    assert gate.acquire("192.0.2.1")
    for _ in range(2):
        gate.release("192.0.2.1")
    gate.release("192.0.2.2")
    assert len(gate) == 0  # nothing held: nothing remembered
    with pytest.raises(RuntimeError, match="release without acquire"):
        gate.release("192.0.2.1")


def test_gate_counts_a_whole_ipv6_64_as_one_address():
    gate = PeerGate(3)
    assert all(gate.acquire(f"2001:db8:0:1::{i:x}") for i in range(3))
    assert not gate.acquire("2001:db8:0:1:ffff:ffff:ffff:ffff")
    assert gate.acquire("2001:db8:0:2::1")


def test_gate_hold_releases_when_the_block_raises_and_never_releases_a_refusal():
    gate = PeerGate(1)
    with pytest.raises(ValueError), gate.hold("192.0.2.1") as admitted:
        assert admitted
        with gate.hold("192.0.2.1") as second:
            assert not second
        raise ValueError("the request failed")
    assert gate.held("192.0.2.1") == 0 and gate.refused == 1


def test_gate_needs_a_positive_limit():
    with pytest.raises(ValueError):
        PeerGate(0)


def test_release_freed_memory_frees_a_dropped_reference_cycle():
    class Body:
        def __init__(self):
            self.data = bytearray(1 << 20)
            self.me = self  # a cycle, as an exception's traceback makes with the frame holding a body

    gc.collect()
    body = Body()
    alive = weakref.ref(body)
    del body
    assert alive() is not None  # only a cycle collection frees it
    handed_back = release_freed_memory()
    assert alive() is None
    assert handed_back or platform.libc_ver()[0] != "glibc"  # glibc can hand freed heap back; others may not


# --- idle and slow connections ------------------------------------------------------------------------


def test_idle_and_half_open_grpc_connections_are_closed(tmp_path):
    base = make_coordinator_dir(tmp_path, FAST)

    async def scenario():
        async with running_coordinator(base) as coord:
            ca = (base / coord.cfg.server.tls_ca).read_bytes()
            # A bare TCP connection that never starts TLS. (Every writer is kept: a dropped one closes its socket.)
            bare_reader, bare_writer = await asyncio.open_connection("127.0.0.1", coord.grpc_port)
            # TLS and the HTTP/2 preface done, then silence.
            ctx = ssl.create_default_context(cadata=ca.decode())
            ctx.set_alpn_protocols(["h2"])
            h2_reader, h2_writer = await asyncio.open_connection("127.0.0.1", coord.grpc_port, ssl=ctx,
                                                                 server_hostname="localhost")
            h2_writer.write(H2_PREFACE + H2_EMPTY_SETTINGS)
            # A real client that made one call and then has nothing to say.
            async with node_client(coord) as stub:
                await stub.get_policy()
                channel = stub.channel
                assert channel.get_state() == grpc.ChannelConnectivity.READY
                left_ready = asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY),
                                              HANG_GUARD_S)
                bare, h2, _ = await asyncio.gather(closed_by_server(bare_reader), closed_by_server(h2_reader, h2_writer),
                                                   left_ready)
                assert channel.get_state() != grpc.ChannelConnectivity.READY
                # The client reconnects by itself for its next call.
                assert (await stub.get_policy()).policy.version == 0
            bare_writer.close()
            h2_writer.close()
            return bare, h2

    assert run(scenario()) == (True, True)


def test_idle_and_slowloris_http_connections_are_closed_and_counted(tmp_path):
    base = make_coordinator_dir(tmp_path, FAST)

    async def scenario():
        async with running_coordinator(base) as coord:
            port = coord.http_port
            idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)  # kept: dropped, it closes
            # Slowloris: a request head one byte at a time, never finished in time.
            slow_reader, slow_writer = await asyncio.open_connection("127.0.0.1", port)

            async def dribble():
                for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200:
                    slow_writer.write(bytes([byte]))
                    await asyncio.sleep(0.05)

            dripping = asyncio.create_task(dribble())
            # A client that was served keeps its connection for a further request, then loses it when idle.
            kept_reader, kept_writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(2):
                kept_writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                head = await asyncio.wait_for(kept_reader.readuntil(b"\r\n\r\n"), HANG_GUARD_S)
                assert head.startswith(b"HTTP/1.1 200")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await kept_reader.readexactly(length)
            closed = await asyncio.gather(closed_by_server(idle_reader), closed_by_server(slow_reader),
                                          closed_by_server(kept_reader))
            dripping.cancel()
            await asyncio.gather(dripping, return_exceptions=True)
            for writer in (idle_writer, slow_writer, kept_writer):
                writer.close()
            return closed, await metrics_text(coord)

    closed, text = run(scenario())
    assert closed == [True, True, True]
    # The idle and the slow connection never sent a whole request; the served one was ordinary keep-alive.
    assert metric(text, 'veriroll_http_refused_total{reason="request_head_timeout"}') == 2


@pytest.mark.parametrize("limits, reason", [
    ({"server.http_connections_per_address": 3}, "connections_per_address"),  # one address cannot hold them all
    ({"server.http_max_connections": 3, "server.http_connections_per_address": 16}, "connections"),  # nor everyone
])
def test_the_http_port_closes_connections_over_its_limits_and_serves_again_once_one_closes(tmp_path, limits, reason):
    base = make_coordinator_dir(tmp_path, limits)

    async def scenario():
        async with running_coordinator(base) as coord:
            port = coord.http_port
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            over_reader, over_writer = await asyncio.open_connection("127.0.0.1", port)
            refused = await closed_by_server(over_reader)
            over_writer.close()
            held[0][1].close()
            await held[0][1].wait_closed()
            async with aiohttp.ClientSession() as s:
                for _ in range(50):  # the server notices the close on its next loop turn
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                            status = r.status
                        break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.1)
            for _, writer in held[1:]:
                writer.close()
            return refused, status, coord.service.metrics.registry.metrics["veriroll_http_refused_total"]

    refused, status, counter = run(scenario())
    assert refused and status == 200
    other = {"connections", "connections_per_address"} - {reason}
    assert counter.get(reason=reason) >= 1 and counter.get(reason=other.pop()) == 0


# --- descriptors: every port's connections from one limit ------------------------------------------------


@pytest.mark.parametrize("limit", [300, 1024, 4096, 20_000, 1 << 20])
def test_the_descriptor_budget_never_gives_out_more_than_the_limit_less_the_reserve(limit):
    budget = DescriptorBudget.plan(limit, http=256, origin=(2048, 512))
    ports = budget.grpc_connections + budget.http_connections + budget.origin_connections + budget.origin_transfers
    assert ports + budget.reserve <= limit and budget.reserve >= min(256, limit // 4)
    assert budget.grpc_connections >= 16 and budget.http_connections >= 8 and budget.origin_transfers >= 1
    if limit >= 20_000:  # room enough: every port gets what it was configured, and gRPC the rest
        assert (budget.http_connections, budget.origin_connections, budget.origin_transfers) == (256, 2048, 512)
        assert budget.grpc_connections == limit - budget.reserve - 256 - 2048 - 512
    automatic = DescriptorBudget.plan(limit, http=256).grpc_connections
    assert DescriptorBudget.plan(limit, grpc=500, http=256).grpc_connections == min(500, automatic)  # as configured where it fits


def test_a_flood_of_connections_takes_the_grpc_ports_share_and_not_the_processs_descriptors(tmp_path):
    """A coordinator process whose descriptor limit is 320 (hard, so it cannot raise it): 300 TLS connections
    from one client. gRPC's connection quota closes those past the port's share at accept, so the process
    never runs out of descriptors: the HTTP port answers, the store keeps opening its files (before, with no
    quota, housekeeping failed with "unable to open database file" every second and honest nodes could not
    connect until the flood ended), and once the flood is gone a node is served."""
    import resource

    from veriroll.protos.identity import PrivateKey
    from veriroll.protos.service import SignedStub, secure_channel

    limit = 320
    base = make_coordinator_dir(tmp_path)
    log = tmp_path / "coordinator.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    with open(log, "wb") as fh:
        proc = subprocess.Popen([VERIROLL, "coordinator", "run", "--dir", str(base)], stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
    try:
        ports = wait_for(lambda: (base / "ports.json").exists() and json.loads((base / "ports.json").read_text()),
                         proc, log, "serving")
        ca = (base / "tls" / "ca.crt").read_bytes()
        address = f"127.0.0.1:{ports['grpc']}"

        async def scenario():
            flood = [secure_channel(address, ca, server_name="localhost") for _ in range(300)]

            async def ready(channel) -> bool:
                try:
                    await asyncio.wait_for(channel.channel_ready(), 3)
                    return True
                except TimeoutError:
                    return False

            held = sum(await asyncio.gather(*(ready(c) for c in flood)))
            descriptors = len(os.listdir(f"/proc/{proc.pid}/fd"))
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{ports['http']}/healthz") as r:
                health = r.status
            await asyncio.sleep(1.5)  # a housekeeping round or two under the flood
            for channel in flood:
                await channel.close()
            key = PrivateKey.generate()
            channel = secure_channel(address, ca, server_name="localhost")
            stub = SignedStub(channel, key, timeout=10)
            for _ in range(100):  # the server sees the flood's connections close on its next poll
                try:
                    await stub.register(pb.RegisterRequest(public_key=key.public.raw, software_version="test"))
                    break
                except CallError as err:
                    assert err.code == grpc.StatusCode.UNAVAILABLE, err
                    await asyncio.sleep(0.2)
            served = len((await stub.lease_work(pb.LeaseRequest())).leases)
            await channel.close()
            return held, descriptors, health, served

        held, descriptors, health, served = run(scenario())
        os.killpg(proc.pid, signal.SIGTERM)
        assert stopped(proc, log) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    budget = DescriptorBudget.plan(limit, http=256)
    assert f"descriptor limit {limit}: gRPC {budget.grpc_connections} connections" in text, text
    assert 0 < held <= budget.grpc_connections < 300
    assert descriptors < limit - 32, descriptors  # room left for the process's own files
    assert health == 200 and served == 1
    assert "Traceback" not in text and "unable to open" not in text, text


# --- bodies over the cap --------------------------------------------------------------------------------


def test_bodies_over_the_cap_are_refused_counted_or_by_grpc_before_buffering(tmp_path):
    cap = 64 * 1024
    base = make_coordinator_dir(tmp_path, {"server.max_message_bytes": cap})

    async def scenario():
        async with running_coordinator(base) as coord:
            channel = channel_to(coord)
            call = channel.unary_unary(full_method("SubmitGroup"))
            before = await metrics_text(coord)
            codes = []
            for size in (cap + 1, cap + TRANSPORT_MARGIN_BYTES + 1, 4 * cap):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(b"\0" * size, timeout=20)
                codes.append((info.value.code(), dict(info.value.trailing_metadata() or ()).get("x-veriroll-reason")))
            await channel.close()
            return codes, before, await metrics_text(coord)

    codes, before, after = run(scenario())
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    # Within the margin the edge reads the size, refuses and counts it; past it gRPC refuses from the length
    # prefix, with no veriroll reason, and only its own failed-call count sees it.
    assert codes == [(exhausted, "message_too_large"), (exhausted, None), (exhausted, None)]
    assert metric(after, 'veriroll_rejections_total{reason="message_too_large"}') == 1
    failed = 'veriroll_grpc_calls{result="failed"}'
    assert metric(after, failed) - metric(before, failed) == 3


def test_calls_whose_body_never_comes_are_cut_and_cannot_hold_an_address_s_slots(tmp_path):
    """Headers, then nothing: such a call used to hold one of gRPC's call slots until the connection aged out.
    Now it holds one of its address's slots for at most server.body_timeout_s, and is counted."""
    base = make_coordinator_dir(tmp_path, {"server.max_inflight_per_address": 2, "server.body_timeout_s": 1.0})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            channel = channel_to(coord)
            never = asyncio.Event()

            async def no_body():
                await never.wait()
                yield b""  # never reached

            async def stall():
                return await channel.stream_unary(full_method("Heartbeat"))(no_body(), timeout=60)

            stalled = [asyncio.create_task(stall()) for _ in range(2)]
            await asyncio.sleep(0.3)  # both are in the coordinator's hands, waiting for their bodies
            with pytest.raises(CallError) as crowded:
                await stub.heartbeat(pb.HeartbeatRequest())
            outcomes = []
            for task in stalled:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await task
                outcomes.append((info.value.code(), dict(info.value.trailing_metadata() or ()).get("x-veriroll-reason")))
            after = await stub.heartbeat(pb.HeartbeatRequest())  # the address's slots are free again
            await channel.close()
            return crowded.value, outcomes, after, coord.db.run_sync(st.status_summary)

    crowded, outcomes, after, summary = run(scenario())
    assert crowded.reason == "rate_limited" and "in flight" in crowded.details
    assert outcomes == [(grpc.StatusCode.INVALID_ARGUMENT, "malformed")] * 2
    assert after.server_time_ms > 0
    assert summary["rejections_by_reason"] == {"rate_limited": 1, "malformed": 2}


def test_a_refused_body_is_freed_when_its_call_ends_without_the_cycle_collector(tmp_path):
    """A refusal used to leave its body in a reference cycle (the abort chained the refusal, whose traceback
    holds the frames that read the body, and gRPC keeps the abort in the call's state): freed only by a
    collection of the oldest generation, which a process holding a model runs rarely. With the collector
    off, refused bodies must not pile up."""
    base = make_coordinator_dir(tmp_path)
    size, calls = 256 * 1024, 24

    async def scenario():
        async with running_coordinator(base) as coord:
            channel = channel_to(coord)
            call = channel.unary_unary(full_method("Heartbeat"))

            async def refused(fill: int) -> str | None:
                try:
                    await call(bytes([fill]) * size, timeout=20)
                except grpc.aio.AioRpcError as exc:
                    return dict(exc.trailing_metadata() or ()).get("x-veriroll-reason")
                return "accepted"

            await refused(0)  # warm-up: the connection and the first call's allocations
            gc.collect()
            gc.disable()
            tracemalloc.start()
            try:
                reasons = [await refused(1 + i) for i in range(calls)]
                await asyncio.sleep(0.2)  # anything the loop still had queued for these calls has run
                held = tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
                gc.enable()
            await channel.close()
            return reasons, held

    reasons, held = run(scenario())
    assert reasons == ["unsigned"] * calls
    assert held < size * calls / 4, f"{held / 2**20:.1f} MiB still held after {calls} refused bodies of {size >> 10} KiB"


# --- stopping -------------------------------------------------------------------------------------------


def test_a_part_still_busy_at_stop_is_left_behind_and_the_store_still_closes(tmp_path):
    base = make_coordinator_dir(tmp_path)

    async def scenario():
        async with running_coordinator(base) as coord:
            never = asyncio.Event()

            async def stuck_close():
                await never.wait()

            coord.closers.append(stuck_close)
            async with node_client(coord) as stub:
                lease = (await stub.lease_work(pb.LeaseRequest(max_leases=1))).leases[0]
            all_closed = await coord.stop(grace=0.5, wait_s=0.2)
            return all_closed, lease.lease_id, coord.db

    all_closed, lease_id, db = run(scenario())
    assert all_closed is False
    with pytest.raises(RuntimeError, match="closed"):
        db.submit(lambda c: None)
    reopened = st.Database(db.path)
    try:
        assert reopened.run_sync(lambda c: c.execute("SELECT COUNT(*) FROM leases WHERE lease_id = ?",
                                                     (lease_id,)).fetchone()[0]) == 1
    finally:
        reopened.close()


def spawn_coordinator(base: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    with open(log, "wb") as fh:
        return subprocess.Popen([VERIROLL, "coordinator", "run", "--dir", str(base)], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_for(predicate, proc: subprocess.Popen, log: Path, what: str):
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the coordinator exited ({proc.returncode}) before {what}:\n{log.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}:\n{log.read_text()}")


def stopped(proc: subprocess.Popen, log: Path) -> int:
    try:
        return proc.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the coordinator did not stop:\n{log.read_text()}") from None


@pytest.mark.parametrize("event_loop", ["auto", "asyncio"])
def test_a_stop_signal_during_start_up_ends_the_coordinator_with_status_0(tmp_path, event_loop):
    base = make_coordinator_dir(tmp_path, {"server.event_loop": event_loop})
    log = tmp_path / "coordinator.log"
    proc = spawn_coordinator(base, log)
    try:
        # Logged while the parts are being built, before the ports are.
        wait_for(lambda: "verification is OFF" in log.read_text(), proc, log, "start-up")
        os.killpg(proc.pid, signal.SIGINT)
        status = stopped(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert status == 0, text
    assert "Traceback" not in text
    assert f"event loop: {'uvloop' if event_loop == 'auto' else 'asyncio'}" in text


def shaped_group(lease: pb.Lease) -> pb.SubmitGroupRequest:
    samples = [pb.Sample(token_ids=[5 + (i % 3)] * lease.max_new_tokens,
                         logprobs=np.full(lease.max_new_tokens, -1.0, dtype="<f4").tobytes(),
                         proof=b"p" * 16, finish_reason="length") for i in range(lease.group_size)]
    return pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=samples)


async def submit_until_refused(address: str, ca: bytes, accepted: list[str], results: list[str]) -> None:
    """A node that leases and submits until the coordinator goes away; records what it was told."""
    from veriroll.protos.identity import PrivateKey
    from veriroll.protos.service import SignedStub, secure_channel

    key = PrivateKey.generate()
    channel = secure_channel(address, ca, server_name="localhost")
    stub = SignedStub(channel, key, timeout=20)
    try:
        await stub.register(pb.RegisterRequest(public_key=key.public.raw, software_version="test"))
        while True:
            leases = (await stub.lease_work(pb.LeaseRequest(max_leases=1))).leases
            if not leases:
                await asyncio.sleep(0.05)
                continue
            response = await stub.submit_group(shaped_group(leases[0]))
            accepted.append(response.group_id)
    except CallError as err:
        results.append(err.code.name)
    finally:
        await channel.close()


def test_sigterm_while_serving_and_training_exits_0_and_keeps_every_acknowledged_group(tmp_path):
    base = make_coordinator_dir(tmp_path, {"trainer.enabled": True, "trainer.groups_per_step": 2,
                                           "trainer.min_groups": 1, "leases.queue_maxsize": 100_000,
                                           "leases.max_open_per_node": 4})
    log = tmp_path / "coordinator.log"
    proc = spawn_coordinator(base, log)
    try:
        ports = wait_for(lambda: (base / "ports.json").exists() and json.loads((base / "ports.json").read_text()),
                         proc, log, "serving")
        ca = (base / "tls" / "ca.crt").read_bytes()
        accepted: list[str] = []
        results: list[str] = []

        def trainer_step() -> int:
            db = st.Database(base / "state.db")
            try:
                return int(db.run_sync(lambda c: st.kv_get(c, "trainer_step", 0)) or 0)
            finally:
                db.close()

        async def scenario():
            nodes = [asyncio.create_task(submit_until_refused(f"127.0.0.1:{ports['grpc']}", ca, accepted, results))
                     for _ in range(4)]
            while len(accepted) < 12 or trainer_step() < 1:
                assert not all(n.done() for n in nodes), f"every node stopped: {results}\n{log.read_text()}"
                await asyncio.sleep(0.1)
            os.killpg(proc.pid, signal.SIGTERM)  # with submissions in flight and the trainer stepping
            await asyncio.to_thread(stopped, proc, log)
            await asyncio.wait_for(asyncio.gather(*nodes), HANG_GUARD_S)

        run(scenario())
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "Traceback" not in text and "stopped" in text
    assert "event loop: uvloop" in text  # server.event_loop = 'auto', and uvloop is a dependency here
    db = st.Database(base / "state.db")
    try:
        stored = {r[0] for r in db.run_sync(lambda c: c.execute("SELECT group_id FROM groups").fetchall())}
    finally:
        db.close()
    assert accepted and set(accepted) <= {str(g) for g in stored}, "a group the coordinator acknowledged was lost"
