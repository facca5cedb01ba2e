"""Who may use a key, over a real coordinator: one live node process per key (``key_in_use``), bans that
say why and leave the ledger readable, and the oldest node release the coordinator accepts (``node_too_old``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from pydantic import ValidationError
from support import make_coordinator_dir, node_client, running_coordinator

from veriroll.coordinator import store as st
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.protos.identity import PrivateKey
from veriroll.protos.service import SOFTWARE_VERSION, UPGRADE_COMMAND, CallError
from veriroll.protos.v1 import coordinator_pb2 as pb

VERIROLL = str(Path(sys.executable).parent / "veriroll")


def register_request(key: PrivateKey, session_id: str = "", version: str = SOFTWARE_VERSION) -> pb.RegisterRequest:
    return pb.RegisterRequest(public_key=key.public.raw, software_version=version, session_id=session_id)


async def refusal(awaitable) -> CallError:
    with pytest.raises(CallError) as info:
        await awaitable
    return info.value


def rejections(coord) -> dict[str, int]:
    return coord.db.run_sync(st.status_summary)["rejections_by_reason"]


def run(coro):
    return asyncio.run(coro)


# --- one live session per key --------------------------------------------------------------------------


def test_a_second_process_with_the_same_key_is_refused_key_in_use_and_the_first_keeps_working(tmp_path):
    key = PrivateKey.generate()

    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord, \
                node_client(coord, key, register=False) as first, node_client(coord, key, register=False) as second:
            await first.register(register_request(key, "session-one"))
            err = await refusal(second.register(register_request(key, "session-two")))
            assert err.reason == "key_in_use" and err.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "127.0.0.1" in err.details and "last heartbeat" in err.details and "keygen" in err.details
            beat = await refusal(second.heartbeat(pb.HeartbeatRequest(loaded_version=-1, session_id="session-two")))
            assert beat.reason == "key_in_use"
            # The first process is untouched: it heartbeats, leases and re-registers as before.
            await first.heartbeat(pb.HeartbeatRequest(loaded_version=-1, session_id="session-one"))
            assert (await first.lease_work(pb.LeaseRequest(max_leases=1))).leases
            await first.register(register_request(key, "session-one"))
            # A tool using the key (doctor, credits) claims no session and is not refused.
            await second.register(register_request(key))
            await second.heartbeat(pb.HeartbeatRequest(loaded_version=-1))
            await first.heartbeat(pb.HeartbeatRequest(loaded_version=-1, session_id="session-one"))
            by_node = coord.db.run_sync(st.rejections_by_node)
            return rejections(coord), by_node

    counted, by_node = run(scenario())
    assert counted["key_in_use"] == 2 and by_node[key.node_id]["key_in_use"] == 2
    assert "banned" not in counted  # key_in_use is no strike


def test_a_quiet_session_lapses_and_another_process_may_take_the_key_over(tmp_path):
    key = PrivateKey.generate()

    async def scenario():
        base = make_coordinator_dir(tmp_path, {"identity.session_ttl_s": 0.3})
        async with running_coordinator(base) as coord, node_client(coord, key, register=False) as first, \
                node_client(coord, key, register=False) as second:
            await first.register(register_request(key, "session-one"))
            assert (await refusal(second.register(register_request(key, "session-two")))).reason == "key_in_use"
            await asyncio.sleep(0.6)  # the first process stopped heartbeating
            await second.register(register_request(key, "session-two"))
            # Now the first is the other one: its next heartbeat is refused, and it says whose the key is.
            err = await refusal(first.heartbeat(pb.HeartbeatRequest(loaded_version=-1, session_id="session-one")))
            await second.heartbeat(pb.HeartbeatRequest(loaded_version=-1, session_id="session-two"))
            return err

    assert run(scenario()).reason == "key_in_use"


def test_a_process_that_says_it_stops_frees_its_key_at_once(tmp_path):
    key = PrivateKey.generate()

    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord, \
                node_client(coord, key, register=False) as first, node_client(coord, key, register=False) as second:
            await first.register(register_request(key, "session-one"))
            # A stopping heartbeat from a session that does not hold the key frees nothing.
            await second.heartbeat(pb.HeartbeatRequest(loaded_version=-1, session_id="", stopping=True))
            assert (await refusal(second.register(register_request(key, "session-two")))).reason == "key_in_use"
            await first.heartbeat(pb.HeartbeatRequest(loaded_version=-1, session_id="session-one", stopping=True))
            await second.register(register_request(key, "session-two"))  # within the TTL, yet accepted
            err = await refusal(first.register(register_request(key, "session-one")))
            return err

    err = run(scenario())
    assert err.reason == "key_in_use" and "lapses in" in err.details


def test_sessions_survive_in_a_database_from_before_sessions(tmp_path):
    path = tmp_path / "old.db"
    old = st.connect(path)
    for column in ("session_id", "session_address", "session_seen_ms"):  # as a database from before sessions
        old.execute(f"ALTER TABLE nodes DROP COLUMN {column}")
    old.execute("INSERT INTO nodes(node_id, public_key, registered_ms, last_seen_ms) VALUES('n1', x'00', 0, 0)")
    old.close()
    db = st.Database(path)
    try:
        session = st.Session("s1", "10.0.0.1")
        assert db.run_sync(lambda c: c.execute("SELECT session_id FROM nodes").fetchone()[0]) == ""
        assert db.run_sync(lambda c: st.other_live_session(c, "n1", st.Session("s0", "x"), 10, 1000)) is None
        db.run_sync(lambda c: st.touch_node(c, "n1", 10, 3, session))
        live = db.run_sync(lambda c: st.other_live_session(c, "n1", st.Session("s2", "10.0.0.2"), 500, 1000))
        assert live == st.LiveSession("10.0.0.1", 10)
        assert db.run_sync(lambda c: st.other_live_session(c, "n1", st.Session("s2", "x"), 2000, 1000)) is None
    finally:
        db.close()


# --- bans ------------------------------------------------------------------------------------------------


def test_an_operator_ban_reaches_the_node_with_its_text_and_the_banned_key_still_reads_its_ledger(tmp_path):
    key = PrivateKey.generate()
    base = make_coordinator_dir(tmp_path)

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord, key) as stub:
            ban = await asyncio.to_thread(subprocess.run, [VERIROLL, "coordinator", "ban", key.node_id, "--dir", str(base),
                                                           "--reason", "ran two nodes on one lease"],
                                          capture_output=True, text=True, timeout=120)
            assert ban.returncode == 0, ban.stderr
            # The edge had the node cached (its registration): the ban, made by another process, reaches the
            # cache through the store's feed of standing changes in housekeeping's next second, not after
            # the cache's minute.
            started = time.monotonic()
            while (await coord.service.ledger.lookup(key.node_id)).standing != st.Standing.BANNED:
                assert time.monotonic() - started < 20, "the ban never reached the edge's node cache"
                await asyncio.sleep(0.1)
            refused = await refusal(stub.lease_work(pb.LeaseRequest(max_leases=1)))
            again = await refusal(stub.register(register_request(key, "s")))
            ledger = await stub.get_ledger()
            return refused, again, ledger, coord.db.run_sync(st.rejections_by_node)

    refused, again, ledger, by_node = run(scenario())
    for err in (refused, again):
        assert err.reason == "banned" and err.code == grpc.StatusCode.PERMISSION_DENIED
        assert "operator: ran two nodes on one lease" in err.details and "repeated failed checks" not in err.details
        assert "veriroll node credits" in err.details
    assert ledger.standing == "banned" and ledger.ban_reason == "operator: ran two nodes on one lease"
    assert ledger.strikes == 0 and ledger.rejections_by_reason["banned"] == 2
    assert by_node[key.node_id]["banned"] == 2  # counted against the key, though refused at the door


def test_a_ban_for_strikes_names_the_strikes_and_the_last_reason(tmp_path):
    async def scenario():
        base = make_coordinator_dir(tmp_path, {"intake.max_strikes": 1})
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            lease = (await stub.lease_work(pb.LeaseRequest(max_leases=1))).leases[0]
            one = pb.Sample(token_ids=[5] * lease.max_new_tokens, finish_reason="length", proof=b"p" * 16,
                            logprobs=np.full(lease.max_new_tokens, -1.0, dtype="<f4").tobytes())
            group = pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=[one])
            assert (await refusal(stub.submit_group(group))).reason == "wrong_group_size"
            coord.service.ledger.forget(stub.key.node_id)
            refused = await refusal(stub.heartbeat(pb.HeartbeatRequest(loaded_version=-1)))
            return refused, await stub.get_ledger()

    refused, ledger = run(scenario())
    assert refused.reason == "banned" and "1 strikes, last: wrong_group_size" in refused.details
    assert ledger.ban_reason == "1 strikes, last: wrong_group_size" and ledger.strikes == 1


def test_an_unbanned_key_has_no_ban_reason(tmp_path):
    key = PrivateKey.generate()

    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord, node_client(coord, key) as stub:
            await coord.db.run(lambda c: st.set_standing(c, key.node_id, st.Standing.BANNED, "operator: test"))
            await coord.db.run(lambda c: st.set_standing(c, key.node_id, st.Standing.PROBATION))
            coord.service.ledger.forget(key.node_id)
            await stub.heartbeat(pb.HeartbeatRequest(loaded_version=-1))
            return await stub.get_ledger()

    ledger = run(scenario())
    assert ledger.standing == "probation" and ledger.ban_reason == ""


# --- the oldest node release accepted ------------------------------------------------------------------


def test_an_older_node_is_refused_with_the_minimum_and_the_upgrade_command_before_any_proof_of_work(tmp_path):
    async def scenario():
        base = make_coordinator_dir(tmp_path, {"server.min_node_version": "0.3.0", "identity.pow_bits": 12,
                                               "identity.exempt_networks": []})
        async with running_coordinator(base) as coord, node_client(coord, register=False) as stub:
            old = await refusal(stub.call("Register", register_request(stub.key, version="0.2.9")))
            garbled = await refusal(stub.call("Register", register_request(stub.key, version="test\n")))
            new = await stub.register(register_request(stub.key, version="0.3.0"))
            policy = (await stub.get_policy()).policy
            return old, garbled, new, policy, rejections(coord)

    old, garbled, new, policy, counted = run(scenario())
    assert old.reason == "node_too_old" and old.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "0.2.9" in old.details and "0.3.0" in old.details and UPGRADE_COMMAND in old.details
    assert garbled.reason == "node_too_old" and "test\n" not in garbled.details
    assert new.standing == "probation" and policy.min_node_version == "0.3.0" and new.policy.min_node_version == "0.3.0"
    # Refused before the proof of work was asked for: an old node is not made to work for nothing.
    assert counted["node_too_old"] == 2 and counted["pow_required"] == 1


def test_the_oldest_accepted_release_defaults_to_this_one_and_must_be_a_version():
    assert CoordinatorConfig().server.min_node_version == SOFTWARE_VERSION
    assert CoordinatorConfig.model_validate({"server": {"min_node_version": ""}}).server.min_node_version == ""
    with pytest.raises(ValidationError, match="min_node_version"):
        CoordinatorConfig.model_validate({"server": {"min_node_version": "latest"}})


def test_a_node_of_this_release_registers_with_the_default_minimum(tmp_path):
    async def scenario():
        base = make_coordinator_dir(tmp_path, {"server.min_node_version": SOFTWARE_VERSION})
        async with running_coordinator(base) as coord, node_client(coord, register=False) as stub:
            return await stub.register(register_request(stub.key, "s"))

    assert run(scenario()).policy.min_node_version == SOFTWARE_VERSION
