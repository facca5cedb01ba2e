"""The coordinator's edge over a real TLS socket: every kind of bad input gets its status code and
reason, is counted, and changes nothing in the store; honest traffic is accepted durably."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from support import channel_to, make_coordinator_dir, node_client, running_coordinator

from veriroll.coordinator import store as st
from veriroll.protos.envelope import sign_request
from veriroll.protos.identity import PrivateKey
from veriroll.protos.service import CallError, SignedStub, full_method
from veriroll.protos.v1 import coordinator_pb2 as pb


def shaped_group(lease: pb.Lease, *, n: int | None = None, token: int = 5, logprob: float = -1.0) -> pb.SubmitGroupRequest:
    """A group with the right shape for ``lease`` (content is not verified in these tests)."""
    n = lease.group_size if n is None else n
    samples = [pb.Sample(token_ids=[token + (i % 3)] * lease.max_new_tokens,
                         logprobs=np.full(lease.max_new_tokens, logprob, dtype="<f4").tobytes(),
                         proof=b"p" * 16, finish_reason="length") for i in range(n)]
    return pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=samples)


def summary(coord) -> dict:
    return coord.db.run_sync(st.status_summary)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture()
def base(tmp_path):
    return make_coordinator_dir(tmp_path)


async def expect_refusal(awaitable, code: grpc.StatusCode, reason: str):
    with pytest.raises(CallError) as info:
        await awaitable
    assert info.value.code == code, info.value
    assert info.value.reason == reason, info.value
    return info.value


def test_honest_group_is_accepted_and_durable(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            resp = await stub.lease_work(pb.LeaseRequest(max_leases=1, loaded_version=-1))
            assert len(resp.leases) == 1
            lease = resp.leases[0]
            assert lease.policy_version == 0  # a node with nothing loaded is told the current version
            assert len(lease.seeds) == lease.group_size == 4 and len(set(lease.seeds)) == 4
            ok = await stub.submit_group(shaped_group(lease))
            assert ok.accepted and len(ok.rewards) == 4 and ok.credited_tokens == 16
            return coord.base_dir

    run(scenario())
    db = st.Database(base / "state.db")  # a fresh connection after shutdown: it is on disk
    s = db.run_sync(st.status_summary)
    n_samples = db.run_sync(lambda c: c.execute("SELECT COUNT(*) FROM samples").fetchone()[0])
    db.close()
    assert s["accepted_groups"] == 1 and n_samples == 4 and s["open_leases"] == 0


def test_retry_of_an_accepted_group_is_answered_not_double_counted(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            group = shaped_group(lease)
            first = await stub.submit_group(group)
            again = await stub.submit_group(group)  # re-signed with a fresh nonce, same content
            assert again.group_id == first.group_id
            assert summary(coord)["accepted_groups"] == 1

    run(scenario())


def test_unsigned_request_is_refused_and_counted(base):
    async def scenario():
        async with running_coordinator(base) as coord:
            channel = channel_to(coord)
            stub = SignedStub(channel, PrivateKey.generate())
            await expect_refusal(stub.call_raw("GetPolicy", b"", metadata=()), grpc.StatusCode.UNAUTHENTICATED, "unsigned")
            await channel.close()
            assert summary(coord)["rejections_by_reason"] == {"unsigned": 1}

    run(scenario())


def test_wrongly_signed_request_is_refused(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            body = pb.PolicyRequest().SerializeToString()
            md = dict(sign_request(stub.key, full_method("GetPolicy"), body))
            md["x-veriroll-sig"] = PrivateKey.generate().sign(b"something else").hex()
            await expect_refusal(stub.call_raw("GetPolicy", body, metadata=tuple(md.items())),
                                 grpc.StatusCode.UNAUTHENTICATED, "bad_signature")
            # A signature for another method does not carry over either.
            md = sign_request(stub.key, full_method("Heartbeat"), body)
            await expect_refusal(stub.call_raw("GetPolicy", body, metadata=md), grpc.StatusCode.UNAUTHENTICATED, "bad_signature")
            assert summary(coord)["rejections_by_reason"] == {"bad_signature": 2}

    run(scenario())


def test_replayed_request_is_refused(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            body = pb.HeartbeatRequest(loaded_version=0).SerializeToString()
            md = sign_request(stub.key, full_method("Heartbeat"), body)
            await stub.call_raw("Heartbeat", body, metadata=md)
            await expect_refusal(stub.call_raw("Heartbeat", body, metadata=md), grpc.StatusCode.UNAUTHENTICATED,
                                 "replayed_nonce")
            assert summary(coord)["rejections_by_reason"] == {"replayed_nonce": 1}

    run(scenario())


def test_request_outside_the_time_window_is_refused_as_clock_skew_without_strike(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            body = pb.PolicyRequest().SerializeToString()
            for offset_s in (-120, 120):
                md = sign_request(stub.key, full_method("GetPolicy"), body, now_ms=int((time.time() + offset_s) * 1000))
                err = await expect_refusal(stub.call_raw("GetPolicy", body, metadata=md),
                                           grpc.StatusCode.UNAUTHENTICATED, "clock_skew")
                assert "clock" in err.details
            nodes = coord.db.run_sync(st.list_nodes)
            assert nodes[0]["strikes"] == 0 and nodes[0]["standing"] == "probation"

    run(scenario())


def test_unknown_key_is_refused(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord, register=False) as stub:
            await expect_refusal(stub.lease_work(pb.LeaseRequest()), grpc.StatusCode.UNAUTHENTICATED, "unknown_key")
            assert summary(coord)["open_leases"] == 0

    run(scenario())


def test_register_must_be_signed_by_the_registered_key(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord, register=False) as stub:
            other = PrivateKey.generate()
            await expect_refusal(stub.register(pb.RegisterRequest(public_key=other.public.raw)),
                                 grpc.StatusCode.UNAUTHENTICATED, "bad_signature")
            assert summary(coord)["nodes"] == 0

    run(scenario())


IDENTITY_KEY = bytes([1]) + bytes(31)  # the identity point: small order, no private key behind it
CONSTANT_SIGNATURE = IDENTITY_KEY + bytes(32)  # R = identity, S = 0: "valid" for every message under it


def forged_metadata(name: str, body: bytes, key_hex: str) -> tuple[tuple[str, str], ...]:
    """An envelope for ``body`` under ``key_hex`` with the constant signature, no private key needed."""
    md = dict(sign_request(PrivateKey.generate(), full_method(name), body))
    md["x-veriroll-key"] = key_hex
    md["x-veriroll-sig"] = CONSTANT_SIGNATURE.hex()
    return tuple(md.items())


def test_small_order_key_with_constant_signature_cannot_register_or_call(base):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    from veriroll.coordinator.service import Refusal
    from veriroll.protos.envelope import SignedHeaders
    from veriroll.protos.identity import PublicKey

    # The attack is real: OpenSSL alone accepts the constant signature under the identity key.
    body = pb.RegisterRequest(public_key=IDENTITY_KEY, software_version="forger").SerializeToString()
    Ed25519PublicKey.from_public_bytes(IDENTITY_KEY).verify(CONSTANT_SIGNATURE, b"any message at all")

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as honest:
            assert summary(coord)["nodes"] == 1
            stub = honest  # any channel will do: the forger needs no key of its own
            md = forged_metadata("Register", body, IDENTITY_KEY.hex())
            err = await expect_refusal(stub.call_raw("Register", body, metadata=md), grpc.StatusCode.UNAUTHENTICATED, "bad_key")
            assert "small-order" in err.details
            # A non-canonical encoding (y = p + 1, the identity again) and a call that needs no Register.
            non_canonical = "ee" + "ff" * 30 + "7f"
            pol = pb.PolicyRequest().SerializeToString()
            md = forged_metadata("GetPolicy", pol, non_canonical)
            err = await expect_refusal(stub.call_raw("GetPolicy", pol, metadata=md), grpc.StatusCode.UNAUTHENTICATED, "bad_key")
            assert "non-canonical" in err.details
            s = summary(coord)
            assert s["nodes"] == 1  # nothing stored
            assert s["rejections_by_reason"] == {"bad_key": 2}
            keys = coord.db.run_sync(lambda c: [bytes(r[0]) for r in c.execute("SELECT public_key FROM nodes")])
            assert keys == [honest.key.public.raw]
            # Past the envelope too: headers built around PublicKey's check are refused by admit.
            weak = object.__new__(PublicKey)
            object.__setattr__(weak, "raw", IDENTITY_KEY)
            headers = SignedHeaders(weak, int(time.time() * 1000), "a" * 32, CONSTANT_SIGNATURE)
            with pytest.raises(Refusal) as info:
                await coord.service.admit(full_method("Register"), "Register", body, headers, "127.0.0.1")
            assert info.value.reason.value == "bad_key"
            with pytest.raises(Refusal) as info:
                await coord.service.register(headers, pb.RegisterRequest.FromString(body))
            assert info.value.reason.value == "bad_key"
            assert summary(coord)["nodes"] == 1
            # The honest node is unaffected.
            assert (await honest.get_policy()).policy.version == 0

    run(scenario())


def test_call_without_deadline_is_refused(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            body = pb.PolicyRequest().SerializeToString()
            call = stub.channel.unary_unary(full_method("GetPolicy"), request_serializer=lambda b: b,
                                            response_deserializer=pb.PolicyResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(body, metadata=sign_request(stub.key, full_method("GetPolicy"), body))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("deadline_required")

    run(scenario())


def test_lease_rules_second_submit_other_node_and_expiry(base):
    async def scenario():
        async with running_coordinator(base, overrides=["leases.ttl_s=1"]) as coord, \
                node_client(coord) as alice, node_client(coord) as mallory:
            lease = (await alice.lease_work(pb.LeaseRequest())).leases[0]
            # Stolen lease id: another node submits it.
            await expect_refusal(mallory.submit_group(shaped_group(lease)), grpc.StatusCode.PERMISSION_DENIED,
                                 "lease_not_yours")
            await alice.submit_group(shaped_group(lease))
            # Submitted twice with different content.
            await expect_refusal(alice.submit_group(shaped_group(lease, token=7)), grpc.StatusCode.ALREADY_EXISTS,
                                 "lease_used")
            late = (await alice.lease_work(pb.LeaseRequest())).leases[0]
            await asyncio.sleep(1.3)
            await expect_refusal(alice.submit_group(shaped_group(late)), grpc.StatusCode.FAILED_PRECONDITION,
                                 "lease_expired")
            s = summary(coord)
            assert s["accepted_groups"] == 1
            assert s["rejections_by_reason"] == {"lease_not_yours": 1, "lease_used": 1, "lease_expired": 1}
            # The expired lease's prompt went back to the pool and is leased again first.
            prompt_of = lambda lid: coord.db.run_sync(  # noqa: E731 - a two-line query, local to this check
                lambda c: c.execute("SELECT prompt_id FROM leases WHERE lease_id = ?", (lid,)).fetchone()[0])
            again = (await alice.lease_work(pb.LeaseRequest())).leases[0]
            assert prompt_of(again.lease_id) == prompt_of(late.lease_id)

    run(scenario())


@pytest.mark.parametrize("mutate, code, reason", [
    (lambda g: g.samples.pop(), grpc.StatusCode.INVALID_ARGUMENT, "wrong_group_size"),
    (lambda g: g.samples[0].token_ids.__setitem__(0, 10_000), grpc.StatusCode.INVALID_ARGUMENT, "token_out_of_vocab"),
    (lambda g: setattr(g.samples[1], "logprobs", np.array([np.nan, -1, -1, -1], "<f4").tobytes()),
     grpc.StatusCode.INVALID_ARGUMENT, "bad_logprobs"),
    (lambda g: setattr(g.samples[1], "logprobs", np.array([0.5, -1, -1, -1], "<f4").tobytes()),
     grpc.StatusCode.INVALID_ARGUMENT, "bad_logprobs"),
    (lambda g: setattr(g, "policy_version", 3), grpc.StatusCode.INVALID_ARGUMENT, "version_mismatch"),
    (lambda g: setattr(g.samples[0], "proof", b"x" * 100_000), grpc.StatusCode.INVALID_ARGUMENT, "proof_too_large"),
])
def test_malformed_group_is_refused_counted_and_not_stored(base, mutate, code, reason):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            group = shaped_group(lease)
            mutate(group)
            await expect_refusal(stub.submit_group(group), code, reason)
            s = summary(coord)
            assert s["accepted_groups"] == 0 and s["rejections_by_reason"] == {reason: 1}
            nodes = coord.db.run_sync(st.list_nodes)
            assert nodes[0]["strikes"] == 1
            # The lease is spent and its prompt is back in the pool.
            state = coord.db.run_sync(lambda c: c.execute("SELECT state FROM leases").fetchone()[0])
            assert state == "rejected"

    run(scenario())


def test_oversized_message_and_garbage_bytes_are_refused(base):
    async def scenario():
        async with running_coordinator(base, overrides=["server.max_message_bytes=65536"]) as coord, \
                node_client(coord) as stub:
            big = pb.SubmitGroupRequest(lease_id="x", samples=[pb.Sample(proof=b"\0" * 100_000)]).SerializeToString()
            await expect_refusal(stub.call_raw("SubmitGroup", big), grpc.StatusCode.RESOURCE_EXHAUSTED, "message_too_large")
            await expect_refusal(stub.call_raw("SubmitGroup", b"\xff\xfe garbage \x00\x01"), grpc.StatusCode.INVALID_ARGUMENT,
                                 "malformed")
            s = summary(coord)
            assert s["rejections_by_reason"] == {"message_too_large": 1, "malformed": 1}
            assert s["accepted_groups"] == 0

    run(scenario())


def test_repeated_hard_failures_ban_the_key_and_banned_keys_are_refused_at_the_door(base):
    async def scenario():
        async with running_coordinator(base, overrides=["intake.max_strikes=2"]) as coord, node_client(coord) as stub:
            for _ in range(2):
                lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
                await expect_refusal(stub.submit_group(shaped_group(lease, n=1)), grpc.StatusCode.INVALID_ARGUMENT,
                                     "wrong_group_size")
            await expect_refusal(stub.lease_work(pb.LeaseRequest()), grpc.StatusCode.PERMISSION_DENIED, "banned")
            # Registering again does not lift a ban.
            await expect_refusal(stub.register(pb.RegisterRequest(public_key=stub.key.public.raw)),
                                 grpc.StatusCode.PERMISSION_DENIED, "banned")
            s = summary(coord)
            assert s["banned_nodes"] == 1 and s["rejections_by_reason"]["banned"] == 2

    run(scenario())


def test_rate_limit_per_key(base):
    async def scenario():
        async with running_coordinator(base, overrides=["server.key_rate_per_s=1", "server.key_burst=3"]) as coord, \
                node_client(coord) as stub:
            results = []
            for _ in range(6):
                try:
                    await stub.get_policy()
                    results.append("ok")
                except CallError as err:
                    results.append(err.reason)
            assert "rate_limited" in results and results[0] == "ok"
            assert summary(coord)["rejections_by_reason"]["rate_limited"] == results.count("rate_limited")

    run(scenario())


def test_backpressure_stops_leases_while_the_queue_is_full(base):
    async def scenario():
        async with running_coordinator(base, overrides=["leases.queue_maxsize=1"]) as coord, node_client(coord) as stub:
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            await stub.submit_group(shaped_group(lease))
            resp = await stub.lease_work(pb.LeaseRequest())
            assert not resp.leases and resp.wait_reason == "backpressure" and resp.retry_after_ms > 0

    run(scenario())


def test_health_service_reports_serving(base):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def scenario():
        async with running_coordinator(base) as coord:
            channel = channel_to(coord)
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            await channel.close()
            assert resp.status == health_pb2.HealthCheckResponse.SERVING

    run(scenario())


def test_register_with_oversized_self_description_is_refused_and_a_long_one_stored_bounded(base):
    """Issue 12: a 1 MiB ``hardware.cpu`` (under the message cap) used to be stored and echoed as is. Now a
    field past its bound in the contract (protos/bounds.py) is refused before anything reads it, and one
    within it is stored cut to the listing's bounds, without control characters."""
    import json

    import aiohttp

    huge = pb.RegisterRequest(hardware=pb.HardwareReport(cpu="x\x00\u202e" * (1024 * 1024 // 5)))
    assert 1024 * 1024 < huge.ByteSize() < 8 * 1024 * 1024
    gpus = [pb.Gpu(name="g" * 1000 + "\n", memory_bytes=80 << 30) for _ in range(64)]
    hardware = pb.HardwareReport(cpu="x\x00\u202e" * 340, cpu_count=-5, ram_bytes=64 << 30, gpus=gpus,
                                 os="Linux\r\n" + "o" * 1000, engine="torch" * 12, device="cuda\x1b[31m" * 6)
    request = pb.RegisterRequest(hardware=hardware, software_version="v" * 256, display_name=" eve\n" + "e" * 1000)

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord, register=False) as stub:
            huge.public_key = request.public_key = stub.key.public.raw
            err = await expect_refusal(stub.register(huge), grpc.StatusCode.INVALID_ARGUMENT, "malformed")
            nodes_after_refusal = summary(coord)["nodes"]
            answer = await stub.register(request)
            row = coord.db.run_sync(lambda c: dict(c.execute("SELECT * FROM nodes").fetchone()))
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{coord.http_port}/api/status") as r:
                status = (r.status, await r.read())
            return err, nodes_after_refusal, answer, row, status

    err, nodes_after_refusal, answer, row, (http_status, body) = run(scenario())
    assert "HardwareReport.cpu has" in err.details and "at most 1024" in err.details and nodes_after_refusal == 0
    assert answer.standing == "probation"
    hw = json.loads(row["hardware"])
    assert hw["cpu"] == "x" * 128 and hw["cpu_count"] == 0 and hw["ram_bytes"] == 64 << 30
    assert hw["os"] == "Linux" + "o" * 123 and len(hw["engine"]) == 60 and hw["device"].startswith("cuda[31m")
    assert len(hw["gpus"]) == 16 and all(g == {"name": "g" * 128, "memory_bytes": 80 << 30} for g in hw["gpus"])
    assert row["software_version"] == "v" * 64 and row["display_name"] == "eve" + "e" * 61
    assert len(row["hardware"]) < 4096
    assert http_status == 200 and len(body) < 16_384, len(body)
    node = json.loads(body)["nodes"][0]
    assert node["hardware"] == hw and node["display_name"] == row["display_name"]


def test_serving_freezes_the_objects_of_start_up_out_of_the_collectors_sight(tmp_path):
    """A full collection would otherwise scan the ~400k objects of the modules, model and tokenizer (~180 ms
    with the tiny model), a pause every request in flight waits out; after start they are frozen."""
    import gc

    from veriroll.coordinator.app import PORTS_NAME, serve_forever

    base = make_coordinator_dir(tmp_path)
    stop = asyncio.Event()

    async def scenario():
        serving = asyncio.create_task(serve_forever(base, stop=stop))
        while not (base / PORTS_NAME).exists() and not serving.done():
            await asyncio.sleep(0.05)
        for _ in range(100):  # serving: the freeze follows start-up within a loop turn or two (hang guard 5 s)
            if gc.get_freeze_count():
                break
            await asyncio.sleep(0.05)
        frozen = gc.get_freeze_count()
        stop.set()
        assert await serving == 0
        return frozen

    assert gc.get_freeze_count() == 0
    try:
        assert asyncio.run(scenario()) > 100_000
    finally:
        gc.unfreeze()  # the rest of this test session's objects stay collectable


def test_an_accepted_group_can_bring_the_next_lease_in_the_same_call(base):
    async def scenario():
        async with running_coordinator(base, overrides=["leases.max_open_per_node=2", "leases.probation_max_open=2"]) as coord, \
                node_client(coord) as stub:
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            group = shaped_group(lease)
            group.next_leases.CopyFrom(pb.LeaseRequest(max_leases=1, loaded_version=0))
            ok = await stub.submit_group(group)
            assert ok.accepted and ok.HasField("next_leases")
            (nxt,) = ok.next_leases.leases
            assert nxt.lease_id != lease.lease_id and nxt.group_size == lease.group_size
            # The lease is as real as LeaseWork's: it is open in the store and its group is accepted.
            plain = shaped_group(nxt)
            assert not plain.HasField("next_leases")
            again = await stub.submit_group(plain)
            assert again.accepted and not again.HasField("next_leases")
            s = summary(coord)
            assert s["accepted_groups"] == 2 and s["open_leases"] == 0
            # The lease rules hold for leases asked this way: two open at most, then a reason to wait.
            held = (await stub.lease_work(pb.LeaseRequest(max_leases=2))).leases
            group = shaped_group(held[0])
            group.next_leases.CopyFrom(pb.LeaseRequest(max_leases=5))
            ok = await stub.submit_group(group)
            assert len(ok.next_leases.leases) == 1  # one still open, one more allowed
            group = shaped_group(held[1])
            group.next_leases.CopyFrom(pb.LeaseRequest(max_leases=5))
            coord.cfg.leases.queue_maxsize = 1  # the queue is over full: the group is accepted, no lease
            ok = await stub.submit_group(group)
            assert ok.accepted and not ok.next_leases.leases
            assert ok.next_leases.wait_reason == "backpressure" and ok.next_leases.retry_after_ms > 0

    run(scenario())


def test_a_refused_group_brings_no_lease_and_a_failed_lease_never_refuses_an_accepted_group(base):
    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            bad = shaped_group(lease, n=1)
            bad.next_leases.CopyFrom(pb.LeaseRequest())
            await expect_refusal(stub.submit_group(bad), grpc.StatusCode.INVALID_ARGUMENT, "wrong_group_size")
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            assert summary(coord)["open_leases"] == 1  # the refusal issued none

            async def store_down(*args, **kwargs):
                raise st.StoreUnavailable("PostgreSQL is unreachable; reconnecting")

            desk = coord.service.leases
            plan, desk.plan = desk.plan, store_down  # fails before the group's transaction
            group = shaped_group(lease)
            group.next_leases.CopyFrom(pb.LeaseRequest())
            ok = await stub.submit_group(group)
            assert ok.accepted and ok.next_leases.wait_reason == "store_unavailable"
            assert ok.next_leases.retry_after_ms > 0 and not ok.next_leases.leases
            assert summary(coord)["accepted_groups"] == 1
            metrics = coord.service.metrics.requests
            assert metrics.get(method="SubmitGroup.next_leases", result="store_unavailable") == 1

            # Fails inside the transaction that accepts the group, after the lease's first writes: those are
            # undone alone, the group is committed.
            desk.plan = plan
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]

            insert_lease = st.insert_lease

            def broken(conn, record):
                insert_lease(conn, record)
                raise RuntimeError("a bug in the lease op")

            st.insert_lease = broken
            try:
                group = shaped_group(lease)
                group.next_leases.CopyFrom(pb.LeaseRequest())
                ok = await stub.submit_group(group)
            finally:
                st.insert_lease = insert_lease
            assert ok.accepted and ok.next_leases.wait_reason == "internal" and not ok.next_leases.leases
            assert summary(coord)["accepted_groups"] == 2 and summary(coord)["open_leases"] == 0
            assert metrics.get(method="SubmitGroup.next_leases", result="internal") == 1

    run(scenario())
