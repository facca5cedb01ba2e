"""The node's side of registering a new key, its call deadlines and its heartbeat, against a real gRPC server.

``IdentityDoor`` answers over a real socket with real signatures and the coordinator's own checks
(``check_register_pow``, ``NewIdentityLimiter`` from coordinator/admission.py): the Register door as the
coordinator's edge runs it when ``[identity]`` is on, without the rest of the coordinator. Waits are bounded
only so that a hang fails the test; times are printed, not asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import pytest

from veriroll.coordinator.admission import NewIdentityLimiter, check_register_pow
from veriroll.node.agent import HEARTBEAT_LOG_EVERY_S, Backoff, HeartbeatFailures, NodeAgent, Stopped
from veriroll.node.config import NodeConfig
from veriroll.node.hardware import Hardware
from veriroll.node.weights import LocalVersions
from veriroll.protos.envelope import REASON_TRAILER, parse_headers, verify_signature
from veriroll.protos.identity import PrivateKey
from veriroll.protos.netaddr import peer_address
from veriroll.protos.pow import Challenge
from veriroll.protos.reasons import Reason
from veriroll.protos.service import CallError, full_method, secure_channel
from veriroll.protos.v1 import coordinator_pb2 as pb

WAIT_S = 60  # only so that a hang fails the test
COORDINATOR_KEY = PrivateKey.generate().public.raw


class IdentityDoor(grpc.GenericRpcHandler):
    """Register with proof of work and new-key limits; SubmitGroup and Heartbeat report the deadline they saw."""

    def __init__(self, *, pow_bits: int, limiter: NewIdentityLimiter | None = None, always_invalid: bool = False,
                 heartbeat_fails: bool = False):
        self.pow_bits, self.limiter = pow_bits, limiter
        self.always_invalid, self.heartbeat_fails = always_invalid, heartbeat_fails
        self.registers: list[tuple[pb.RegisterRequest, int]] = []  # (request, envelope timestamp)
        self.deadlines: dict[str, float] = {}
        self.heartbeats = 0
        self._methods = {full_method("Register"): self._register, full_method("SubmitGroup"): self._submit,
                         full_method("Heartbeat"): self._heartbeat}

    def service(self, details):
        fn = self._methods.get(details.method)
        if fn is None:
            return None
        return grpc.unary_unary_rpc_method_handler(fn, response_serializer=lambda m: m.SerializeToString())

    async def _refuse(self, context, reason: Reason, detail: str):
        context.set_trailing_metadata(((REASON_TRAILER, reason.value),))
        await context.abort(reason.code, f"{reason.value}: {detail}")

    async def _register(self, body: bytes, context):
        headers = parse_headers(context.invocation_metadata())
        assert verify_signature(headers, full_method("Register"), body)
        req = pb.RegisterRequest.FromString(body)
        self.registers.append((req, headers.ts_ms))
        refusal = check_register_pow(self.pow_bits, COORDINATOR_KEY, req, headers)
        if refusal is None and self.always_invalid:
            refusal = Reason.POW_INVALID, Challenge(self.pow_bits, COORDINATOR_KEY).detail()
        if refusal is None and self.limiter is not None:
            refusal = self.limiter.allow(peer_address(context.peer()))
        if refusal is not None:
            await self._refuse(context, *refusal)
        return pb.RegisterResponse(node_id=headers.public_key.node_id, standing="probation",
                                   server_time_ms=int(time.time() * 1000),
                                   policy=pb.PolicyInfo(version=0, coordinator_public_key=COORDINATOR_KEY))

    async def _submit(self, body: bytes, context):
        self.deadlines["SubmitGroup"] = context.time_remaining()
        return pb.SubmitGroupResponse(accepted=True)

    async def _heartbeat(self, body: bytes, context):
        self.deadlines["Heartbeat"] = context.time_remaining()
        self.heartbeats += 1
        if self.heartbeat_fails:
            await self._refuse(context, Reason.UNAVAILABLE, "busy")
        return pb.HeartbeatResponse(server_time_ms=int(time.time() * 1000), standing="probation")


@contextlib.asynccontextmanager
async def door_and_agents(tmp_path, door: IdentityDoor, *configs: NodeConfig):
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((door,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = []
    try:
        agents = []
        for i, cfg in enumerate(configs):
            channels.append(secure_channel(f"127.0.0.1:{port}", None))
            agents.append(NodeAgent(cfg, key=PrivateKey.generate(), channel=channels[-1], engine_factory=None,
                                    versions=LocalVersions(tmp_path / f"versions{i}"), engine_kind="torch",
                                    device="cpu", hardware=Hardware(cpu="test", cpu_count=1, ram_bytes=0,
                                                                    disk_free_bytes=0, os="test")))
        yield agents
    finally:
        for channel in channels:
            await channel.close()
        await server.stop(0)


async def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


# --- proof of work -----------------------------------------------------------------------------------------


def test_a_new_node_solves_the_challenge_in_the_refusal_and_registers(tmp_path):
    door = IdentityDoor(pow_bits=12)

    async def main():
        async with door_and_agents(tmp_path, door, NodeConfig()) as (agent,):
            t0 = time.perf_counter()
            await agent.register()
            print(f"registered with 12 bits of work in {time.perf_counter() - t0:.3f}s")
            return agent

    agent = asyncio.run(main())
    assert agent.status.standing == "probation"
    (first, _), (second, ts_ms) = door.registers
    assert first.pow_bits == 0  # the node did not know the challenge yet
    assert second.pow_bits == 12
    assert Challenge(12, COORDINATOR_KEY).accepts(agent.key.public.raw, ts_ms, second.pow_nonce)
    assert second.hardware.cpu == "test" and second.software_version  # the rest of the request is unchanged


def test_a_challenge_above_the_nodes_limit_is_refused_without_solving(tmp_path):
    door = IdentityDoor(pow_bits=30)

    async def main():
        async with door_and_agents(tmp_path, door, NodeConfig(pow_max_bits=20)) as (agent,):
            with pytest.raises(CallError) as err:
                await agent.register()
            return err.value

    err = asyncio.run(main())
    assert err.reason == "pow_required" and "pow_max_bits" in err.details and "30 bits" in err.details
    assert len(door.registers) == 1


def test_a_node_retries_a_refused_proof_once_only(tmp_path):
    door = IdentityDoor(pow_bits=8, always_invalid=True)

    async def main():
        async with door_and_agents(tmp_path, door, NodeConfig()) as (agent,):
            with pytest.raises(CallError) as err:
                await agent.register()
            return err.value

    assert asyncio.run(main()).reason == "pow_invalid"
    assert len(door.registers) == 2


def test_a_node_told_to_stop_while_solving_stops_and_its_solver_thread_ends(tmp_path):
    door = IdentityDoor(pow_bits=40)  # ~2**40 hashes: hours of work, never finished in this test

    async def main():
        async with door_and_agents(tmp_path, door, NodeConfig(pow_max_bits=40)) as (agent,):
            task = asyncio.create_task(agent.register())
            await wait_until(lambda: door.registers, "the first Register")
            await asyncio.sleep(0.3)  # solving
            assert not task.done()
            t0 = time.monotonic()
            agent.request_stop()
            with pytest.raises(Stopped):
                await asyncio.wait_for(task, WAIT_S)
            stopped = time.monotonic() - t0
            # The solver runs in the default executor: it must give its thread back, or the process would
            # hang at exit (asyncio.run joins that executor).
            await asyncio.wait_for(asyncio.get_running_loop().shutdown_default_executor(), WAIT_S)
            print(f"stopped {stopped:.3f}s after the request; solver thread done "
                  f"{time.monotonic() - t0:.3f}s after it")

    asyncio.run(main())
    assert len(door.registers) == 1


# --- new keys per address ------------------------------------------------------------------------------------


def test_a_node_over_its_networks_new_key_budget_backs_off_and_says_why(tmp_path, caplog):
    limiter = NewIdentityLimiter(per_hour_per_address=1, burst_per_address=1, per_hour_per_prefix=0,
                                 burst_per_prefix=1)  # loopback is not exempt here
    door = IdentityDoor(pow_bits=4, limiter=limiter)
    caplog.set_level(logging.WARNING, logger="veriroll.node")

    async def main():
        async with door_and_agents(tmp_path, door, NodeConfig(), NodeConfig()) as (first, second):
            await first.register()
            task = asyncio.create_task(second.register())
            await wait_until(lambda: "takes no more new keys" in caplog.text, "the limit logged")
            second.request_stop()
            with pytest.raises(Stopped):
                await asyncio.wait_for(task, WAIT_S)
            return second

    second = asyncio.run(main())
    assert "new_identity_limited" in second.status.last_error
    assert "retry in" in caplog.text


# --- deadlines -----------------------------------------------------------------------------------------------


def near(seen_s: float, sent_s: float) -> bool:
    """The deadline a server sees is what the client sent, less transit, give or take the clocks' rounding."""
    return sent_s - 10 < seen_s < sent_s + 1


@pytest.mark.parametrize("call_timeout_s, submit_s", [
    (30.0, 120.0),  # SubmitGroup keeps its own 120 s over the node's shorter timeout
    (300.0, 300.0),  # a longer node timeout applies to SubmitGroup too
])
def test_submit_group_gets_the_longer_of_its_own_deadline_and_the_nodes(tmp_path, call_timeout_s, submit_s):
    door = IdentityDoor(pow_bits=0)

    async def main():
        async with door_and_agents(tmp_path, door, NodeConfig(call_timeout_s=call_timeout_s)) as (agent,):
            await agent.stub.submit_group(pb.SubmitGroupRequest())
            await agent.stub.heartbeat(pb.HeartbeatRequest())

    asyncio.run(main())
    assert near(door.deadlines["SubmitGroup"], submit_s), door.deadlines
    assert near(door.deadlines["Heartbeat"], call_timeout_s), door.deadlines


def test_the_submit_deadline_is_a_node_setting(tmp_path):
    door = IdentityDoor(pow_bits=0)

    async def main():
        async with door_and_agents(tmp_path, door, NodeConfig(submit_timeout_s=400)) as (agent,):
            await agent.stub.submit_group(pb.SubmitGroupRequest())

    asyncio.run(main())
    assert near(door.deadlines["SubmitGroup"], 400), door.deadlines


# --- heartbeat failures --------------------------------------------------------------------------------------


def test_a_failing_heartbeat_is_logged_once_not_every_beat(tmp_path, caplog):
    door = IdentityDoor(pow_bits=0, heartbeat_fails=True)
    caplog.set_level(logging.INFO, logger="veriroll.node")

    async def main():
        async with door_and_agents(tmp_path, door, NodeConfig(heartbeat_s=0.05)) as (agent,):
            beats = asyncio.create_task(agent._heartbeats())
            await wait_until(lambda: door.heartbeats >= 4, "four failed heartbeats")
            agent.request_stop()
            await asyncio.wait_for(beats, WAIT_S)
            return agent

    agent = asyncio.run(main())
    failures = [r for r in caplog.records if "heartbeat failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert "unavailable: busy" in failures[0].getMessage()
    assert agent.status.last_error == "heartbeat: unavailable"


def test_heartbeat_failures_back_off_and_are_reported_at_a_bounded_rate(caplog):
    caplog.set_level(logging.INFO, logger="veriroll.node")
    now = [0.0]
    failing = HeartbeatFailures(Backoff(base=1.0, cap=60.0), clock=lambda: now[0])

    def logged() -> list[str]:
        messages = [r.getMessage() for r in caplog.records]
        caplog.clear()
        return messages

    assert failing.next_delay(10.0) == 10.0  # healthy: the configured period
    delays = []
    for i in range(8):
        failing.failed("unavailable", f"busy (attempt {i})")  # same kind, another detail: still one line
        delays.append(failing.next_delay(10.0))
        now[0] += 5
    assert all(0.5 * min(60.0, 2**i) <= d <= min(60.0, 2**i) for i, d in enumerate(delays)), delays
    assert len(logged()) == 1  # 8 failures in 40 s: one line
    now[0] += HEARTBEAT_LOG_EVERY_S
    failing.failed("unavailable", "busy")
    assert logged() == ["heartbeat failed 9 time(s) in a row: unavailable: busy (7 more failures since the last "
                        "report); backing off"]
    failing.failed("RuntimeError", "boom", exc_info=RuntimeError("boom"))  # a new error is reported at once
    (record,) = caplog.records
    assert "boom" in record.getMessage() and record.exc_info is not None
    caplog.clear()
    failing.succeeded()
    assert logged() == ["heartbeat back after 10 failure(s)"]
    assert failing.next_delay(10.0) == 10.0
