"""What a new identity costs on a real coordinator over TLS: proof of work on Register, bound to the key,
this coordinator and the signed time; a budget of new keys per address and per /24; a known key
re-registers for free. Every refusal is counted."""

from __future__ import annotations

import asyncio
import time

import grpc
from support import make_coordinator_dir, node_client, running_coordinator
from test_server import expect_refusal

from veriroll.coordinator import store as st
from veriroll.protos.identity import PrivateKey
from veriroll.protos.pow import Challenge, check, solve
from veriroll.protos.v1 import coordinator_pb2 as pb

BITS = 12  # cheap for the test; the default's cost is measured in benchmarks/abuse.py


def register_request(key: PrivateKey, **fields) -> pb.RegisterRequest:
    return pb.RegisterRequest(public_key=key.public.raw, software_version="test", **fields)


def test_a_new_key_pays_proof_of_work_once_and_a_known_key_registers_free(tmp_path):
    base = make_coordinator_dir(tmp_path, {"identity.pow_bits": BITS})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord, register=False) as stub:
            plain = stub.call("Register", register_request(stub.key))
            err = await expect_refusal(plain, grpc.StatusCode.FAILED_PRECONDITION, "pow_required")
            assert Challenge.from_detail(err.details).bits == BITS
            ok = await stub.register(register_request(stub.key))  # solves the challenge and retries
            again = await stub.call("Register", register_request(stub.key))  # known now: no work asked
            return ok, again, coord.db.run_sync(st.status_summary)

    ok, again, summary = asyncio.run(scenario())
    assert ok.standing == again.standing == "probation"
    # The plain attempt and the stub's own first try: two counted pow_required refusals, nothing else.
    assert summary["rejections_by_reason"] == {"pow_required": 2} and summary["nodes"] == 1


def test_proof_of_work_cannot_be_forged_or_reused_for_another_time_or_key(tmp_path):
    base = make_coordinator_dir(tmp_path, {"identity.pow_bits": BITS})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord, register=False) as stub:
            coordinator_key = coord.service.coordinator_key.raw
            ts = int(time.time() * 1000)
            nonce = solve(coordinator_key, stub.key.public.raw, ts, BITS)
            # A nonce that does not hash to the claimed bits.
            wrong = next(n for n in range(nonce + 1, nonce + 100) if not check(coordinator_key, stub.key.public.raw, ts,
                                                                               n, BITS))
            bad = register_request(stub.key, pow_nonce=wrong, pow_bits=BITS)
            invalid = await expect_refusal(stub.call("Register", bad, now_ms=ts), grpc.StatusCode.INVALID_ARGUMENT,
                                           "pow_invalid")
            # The right nonce, signed at another time: the proof is bound to the signed timestamp.
            good = register_request(stub.key, pow_nonce=nonce, pow_bits=BITS)
            await expect_refusal(stub.call("Register", good, now_ms=ts + 1), grpc.StatusCode.INVALID_ARGUMENT,
                                 "pow_invalid")
            # Another key with this key's proof.
            async with node_client(coord, register=False) as other:
                stolen = register_request(other.key, pow_nonce=nonce, pow_bits=BITS)
                await expect_refusal(other.call("Register", stolen, now_ms=ts), grpc.StatusCode.INVALID_ARGUMENT,
                                     "pow_invalid")
            accepted = await stub.call("Register", good, now_ms=ts)
            return invalid, accepted, coord.db.run_sync(st.status_summary)

    invalid, accepted, summary = asyncio.run(scenario())
    assert Challenge.from_detail(invalid.details).bits == BITS
    assert accepted.node_id and summary["nodes"] == 1
    assert summary["rejections_by_reason"] == {"pow_invalid": 3}


def test_new_keys_per_address_are_limited_and_known_keys_are_not(tmp_path):
    base = make_coordinator_dir(tmp_path, {"identity.exempt_networks": [], "identity.new_burst_per_address": 3,
                                           "identity.new_per_hour_per_address": 0.001})

    async def scenario():
        async with running_coordinator(base) as coord:
            keys = [PrivateKey.generate() for _ in range(4)]
            outcomes = []
            for key in keys:
                async with node_client(coord, key, register=False) as stub:
                    try:
                        await stub.register(register_request(key))
                        outcomes.append("ok")
                    except Exception as exc:  # noqa: BLE001 - the refusal is what this test records
                        outcomes.append(getattr(exc, "reason", repr(exc)))
            async with node_client(coord, keys[0], register=False) as known:
                await known.register(register_request(keys[0]))  # a known key: no budget needed
                await known.heartbeat(pb.HeartbeatRequest())
            return outcomes, coord.db.run_sync(st.status_summary)

    outcomes, summary = asyncio.run(scenario())
    assert outcomes == ["ok", "ok", "ok", "new_identity_limited"]
    assert summary["nodes"] == 3 and summary["rejections_by_reason"] == {"new_identity_limited": 1}
