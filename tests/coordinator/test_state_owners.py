"""One owner for every piece of state: refusals counted once whoever refuses, probation held short by
the lease desk, nodes looked up one by one, and a trainer step that counts only once it is committed."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import grpc
import pytest
import torch
from support import make_coordinator_dir, node_client, running_coordinator
from test_server import expect_refusal, shaped_group
from test_trainer import SIGNAL, add_groups, group_rows, kv

from veriroll.coordinator import store as st
from veriroll.coordinator.app import load_coordinator_config
from veriroll.coordinator.policy import PolicyState, PolicyStore
from veriroll.coordinator.trainer import Trainer
from veriroll.protos.identity import PrivateKey
from veriroll.protos.v1 import coordinator_pb2 as pb


def run(coro):
    return asyncio.run(coro)


def counted(coord) -> tuple[dict, dict]:
    """(store's refusals by reason, the metric's) for comparison."""
    stored = coord.db.run_sync(st.status_summary)["rejections_by_reason"]
    metric = {reason: int(coord.service.metrics.rejections.get(reason=reason)) for reason in stored}
    return stored, metric


def test_every_refusal_is_counted_once_in_the_store_and_the_metric_internal_errors_too(tmp_path):
    base = make_coordinator_dir(tmp_path)

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            bad = shaped_group(lease)
            bad.samples.pop()
            await expect_refusal(stub.submit_group(bad), grpc.StatusCode.INVALID_ARGUMENT, "wrong_group_size")

            async def broken(node, req):
                raise RuntimeError("a bug in the lease desk")

            coord.service._handlers["LeaseWork"] = broken
            await expect_refusal(stub.lease_work(pb.LeaseRequest()), grpc.StatusCode.INTERNAL, "internal")
            async with node_client(coord, register=False) as stranger:
                await expect_refusal(stranger.heartbeat(pb.HeartbeatRequest()), grpc.StatusCode.UNAUTHENTICATED,
                                     "unknown_key")
            return counted(coord)

    stored, metric = run(scenario())
    assert stored == {"wrong_group_size": 1, "internal": 1, "unknown_key": 1}
    assert metric == stored


def test_a_probation_node_holds_one_lease_and_a_trusted_one_holds_more(tmp_path):
    base = make_coordinator_dir(tmp_path, {"leases.max_open_per_node": 3})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as new, node_client(coord) as known:
            coord.db.run_sync(lambda c: st.set_standing(c, known.key.node_id, "trusted"))
            coord.service.ledger.forget(known.key.node_id)
            first = await new.lease_work(pb.LeaseRequest(max_leases=3))
            second = await new.lease_work(pb.LeaseRequest(max_leases=3))
            trusted = await known.lease_work(pb.LeaseRequest(max_leases=3))
            totals = coord.db.run_sync(st.open_lease_totals)
            return first, second, trusted, totals

    first, second, trusted, totals = run(scenario())
    assert len(first.leases) == 1
    assert not second.leases and second.wait_reason == "too_many_open_leases" and second.retry_after_ms > 0
    assert len(trusted.leases) == 3
    assert totals == (4, 1)  # the trigger-kept counters: 4 open, 1 of them held by a probation node


def test_probation_nodes_together_hold_at_most_their_share_of_open_leases(tmp_path):
    base = make_coordinator_dir(tmp_path, {"leases.probation_floor": 2, "leases.probation_share": 0.5,
                                           "leases.max_open_per_node": 4})

    async def scenario():
        async with running_coordinator(base) as coord:
            got = []
            async with node_client(coord) as a, node_client(coord) as b, node_client(coord) as c, \
                    node_client(coord) as trusted:
                for stub in (a, b, c):  # the floor: two probation leases, whatever the share
                    got.append(len((await stub.lease_work(pb.LeaseRequest())).leases))
                refused = await c.lease_work(pb.LeaseRequest())
                coord.db.run_sync(lambda conn: st.set_standing(conn, trusted.key.node_id, "trusted"))
                coord.service.ledger.forget(trusted.key.node_id)
                # Trusted work raises the total: 2 probation of 6 open is a third, so c gets one now.
                assert len((await trusted.lease_work(pb.LeaseRequest(max_leases=4))).leases) == 4
                got.append(len((await c.lease_work(pb.LeaseRequest())).leases))
            return got, refused

    got, refused = run(scenario())
    assert got == [1, 1, 0, 1]
    assert refused.wait_reason == "probation_share"


def test_a_probation_node_spends_its_lease_budget_and_waiting_costs_nothing(tmp_path):
    base = make_coordinator_dir(tmp_path, {"leases.probation_lease_burst": 2, "leases.probation_leases_per_hour": 1,
                                           "leases.queue_maxsize": 1})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            first = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            await stub.submit_group(shaped_group(first))  # the queue (max 1) is now full
            waits = [(await stub.lease_work(pb.LeaseRequest())).wait_reason for _ in range(5)]
            coord.db.run_sync(lambda c: c.execute("UPDATE groups SET dropped = 'test'"))  # the trainer took it
            second = await stub.lease_work(pb.LeaseRequest())
            await stub.submit_group(shaped_group(second.leases[0]))
            coord.db.run_sync(lambda c: c.execute("UPDATE groups SET dropped = 'test'"))
            third = await stub.lease_work(pb.LeaseRequest())
            return waits, second, third

    waits, second, third = run(scenario())
    assert waits == ["backpressure"] * 5
    assert len(second.leases) == 1  # five refusals under backpressure did not use the budget
    assert not third.leases and third.wait_reason == "probation_budget" and third.retry_after_ms >= 1000


def test_an_unknown_key_costs_one_row_read_not_a_reload_of_every_node(tmp_path):
    base = make_coordinator_dir(tmp_path)

    async def scenario():
        async with running_coordinator(base) as coord:
            coord.db.run_sync(lambda c: c.executemany(
                "INSERT INTO nodes(node_id, public_key, registered_ms, last_seen_ms) VALUES(?, ?, 0, 0)",
                [(f"{i:032x}", bytes(32)) for i in range(2000)]))
            statements = []
            # Reads run on the reader thread's connection, short ones inline on the loop thread's own.
            readers = [coord.db.read(lambda c: c).result(), await coord.db.run_read(lambda c: c, inline=True)]
            for reader in readers:
                reader.set_trace_callback(statements.append)
            async with node_client(coord, register=False) as stranger:
                await expect_refusal(stranger.heartbeat(pb.HeartbeatRequest()), grpc.StatusCode.UNAUTHENTICATED,
                                     "unknown_key")
            for reader in readers:
                reader.set_trace_callback(None)
            return statements

    statements = run(scenario())
    # (The once-a-second gauges count nodes by standing on the same reader; they are not per request.)
    node_reads = [s for s in statements if "FROM nodes" in s and "COUNT(" not in s]
    assert len(node_reads) == 1 and "WHERE node_id = " in node_reads[0]


def test_an_operator_ban_from_another_process_reaches_the_node_cache_by_the_feed_or_by_its_time(tmp_path):
    from veriroll.coordinator.ledger import CACHE_TTL_MS

    base = make_coordinator_dir(tmp_path)

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub, \
                node_client(coord) as other_node:
            for client in (stub, other_node):
                await client.heartbeat(pb.HeartbeatRequest())  # both cached now
            other = st.Database(base / "state.db")  # the CLI's own connection
            other.run_sync(lambda c: st.set_standing(c, stub.key.node_id, "banned", "operator: test"))
            # What housekeeping does every second: the feed of standing changes drops the banned node only.
            assert await coord.service.ledger.follow_standing_changes() == 1
            await expect_refusal(stub.heartbeat(pb.HeartbeatRequest()), grpc.StatusCode.PERMISSION_DENIED, "banned")
            # Without the feed (not followed since), a cached standing is trusted CACHE_TTL_MS at most.
            other.run_sync(lambda c: st.set_standing(c, other_node.key.node_id, "banned", "operator: test"))
            other.close()
            await other_node.heartbeat(pb.HeartbeatRequest())  # still cached as it was
            now = coord.service.ledger.clock()
            coord.service.ledger.clock = lambda: now + CACHE_TTL_MS + 500  # the cache's clock only (no skew)
            await expect_refusal(other_node.heartbeat(pb.HeartbeatRequest()), grpc.StatusCode.PERMISSION_DENIED,
                                 "banned")

    run(scenario())


@pytest.fixture()
def trainer_and_db(tmp_path):
    base = make_coordinator_dir(tmp_path, {"trainer.lr": 1e-3, "trainer.groups_per_step": 2, "trainer.min_groups": 2,
                                           "trainer.checkpoint_every": 1, "trainer.publish_weights_every": 1,
                                           "intake.s_max": 4})
    cfg = load_coordinator_config(base)
    db = st.Database(base / cfg.database)
    policy = PolicyState()
    trainer = Trainer(cfg, db, PolicyStore(base / cfg.checkpoints), policy=policy)
    yield trainer, db, policy
    db.close()


def test_a_failed_commit_leaves_weights_counters_and_version_as_they_were(trainer_and_db, monkeypatch):
    trainer, db, policy = trainer_and_db
    trainer.resume()
    add_groups(db, [SIGNAL, SIGNAL])
    assert trainer.step().kind == "trained" and policy.version == 1
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    history = list(trainer.history)
    second = add_groups(db, [SIGNAL, SIGNAL])

    def failing_commit(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(st, "commit_step", failing_commit)
    with pytest.raises(OSError):
        trainer.step()
    # Nothing moved: the weights are step 1's again, the counters, history and version too.
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())
    assert (trainer.step_no, trainer.history, policy.version) == (1, history, 1)
    assert (kv(db, "trainer_step"), kv(db, "policy_version")) == (1, 1)
    assert all(group_rows(db)[g]["consumed_step"] is None for g in second)

    monkeypatch.undo()
    assert trainer.step().kind == "trained"
    rows = group_rows(db)
    assert [rows[g]["consumed_step"] for g in second] == [2, 2]  # trained once, by step 2
    # Version 2 was written by the failed step but never made current: it is skipped, never reused.
    assert policy.version == 3 and kv(db, "policy_version") == 3


def test_the_policy_version_only_moves_forward():
    policy = PolicyState(3)
    seen = []
    policy = PolicyState(3, on_advance=seen.append)
    policy.advance(4)
    with pytest.raises(ValueError):
        policy.advance(2)
    with pytest.raises(AttributeError):
        policy.version = 9  # read-only: the trainer advances it, everyone else reads it
    assert policy.version == 4 and seen == [4]


def test_store_states_are_enums_that_read_as_their_sql_values():
    conn = st.connect(":memory:")
    key = PrivateKey.generate().public
    row = st.register_node(conn, key.node_id, key.raw, 0, {}, "", "")
    assert row.standing is st.Standing.PROBATION and row.standing == "probation"
    assert {s.value for s in st.LeaseState} == {"open", "submitted", "rejected", "expired"}
    assert {s.value for s in st.PromptState} == {"pending", "leased", "done"}


def test_a_new_version_becomes_current_only_once_shardcast_holds_it(tmp_path):
    """Nodes are told a version (GetPolicy, leases) only after its signed manifest is on the origin relay."""
    import asyncio as aio

    from test_trainer import add_groups as seed

    base = make_coordinator_dir(tmp_path, {"trainer.enabled": True, "trainer.min_groups": 2, "trainer.groups_per_step": 2,
                                           "trainer.lr": 1e-3, "shardcast.origin_port": 0})

    async def scenario():
        async with running_coordinator(base) as coord:
            seen = []
            publish = coord.publish_version

            async def watched(version):
                seen.append(("before publish", version, coord.service.policy.version))
                await publish(version)
                seen.append(("after publish", version, coord.service.policy.version))

            coord.publish_version = watched
            seed(coord.db, [SIGNAL, SIGNAL])
            for _ in range(3600):  # a hang guard (0.05 s each), not a time limit
                if coord.service.policy.version == 1:
                    break
                await aio.sleep(0.05)
            return seen, coord.service.policy.version, coord.service.policy.manifest_path

    seen, version, manifest = run(scenario())
    assert seen == [("before publish", 1, 0), ("after publish", 1, 0)]
    assert version == 1 and manifest == "/versions/1/manifest"


def test_the_trainer_keeps_no_copy_of_the_policy_version(trainer_and_db):
    """Staleness and new version numbers count from the one PolicyState: whatever moves it, the trainer sees."""
    trainer, db, policy = trainer_and_db
    trainer.resume()
    add_groups(db, [SIGNAL, SIGNAL])
    assert trainer.step().published == 1
    assert trainer.version == policy.version == kv(db, "policy_version") == 1
    policy.advance(4)  # (as an edge's follower would): the trainer reads it, it holds no number of its own
    assert trainer.version == trainer.weights_version == 4


def test_the_policy_version_gauge_and_the_store_agree_after_a_publish_and_after_a_restart(tmp_path):
    """The gauge is set by the PolicyState alone, as it advances: after a version is published, and after a
    restart restored it from the store, the store's kv, the policy, the trainer and the gauge say the same."""
    import asyncio as aio

    from test_trainer import add_groups as seed

    base = make_coordinator_dir(tmp_path, {"trainer.enabled": True, "trainer.min_groups": 2, "trainer.groups_per_step": 2,
                                           "trainer.lr": 1e-3, "shardcast.origin_port": 0})

    def views(coord):
        stored = coord.db.run_sync(lambda c: st.kv_get(c, "policy_version", None))
        return (stored, coord.service.policy.version, coord.trainer.version,
                int(coord.service.metrics.policy_version.get()))

    async def publish():
        async with running_coordinator(base) as coord:
            assert views(coord) == (0, 0, 0, 0)
            seed(coord.db, [SIGNAL, SIGNAL])
            for _ in range(3600):  # a hang guard (0.05 s each), not a time limit
                if coord.service.policy.version == 1:
                    break
                await aio.sleep(0.05)
            return views(coord)

    async def restart():
        async with running_coordinator(base) as coord:
            return views(coord)

    assert run(publish()) == (1, 1, 1, 1)
    assert run(restart()) == (1, 1, 1, 1)


def test_only_the_trainer_and_the_follower_move_the_policy_version_and_only_the_policy_sets_its_gauge():
    """One writer: in a process with the trainer, Trainer.make_current; in one without, app._follow_policy.
    A second call of PolicyState.advance, or a second setter of the gauge, fails here."""
    import veriroll.coordinator as pkg

    root = Path(pkg.__path__[0])
    advances, gauges = {}, []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if n := len(re.findall(r"\.advance\(", text)):
            advances[path.relative_to(root).as_posix()] = n
        if "policy_version.set(" in text:
            gauges.append(path.relative_to(root).as_posix())
    assert advances == {"app.py": 1, "trainer/loop.py": 1}
    assert gauges == []


def test_a_known_node_refused_at_the_door_finds_the_refusal_in_its_own_ledger(tmp_path):
    base = make_coordinator_dir(tmp_path, {"server.key_rate_per_s": 0.01, "server.key_burst": 3})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:  # Register: 1 of 3
            await stub.heartbeat(pb.HeartbeatRequest())
            await stub.heartbeat(pb.HeartbeatRequest())
            await expect_refusal(stub.heartbeat(pb.HeartbeatRequest()), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 "rate_limited")
            return coord.db.run_sync(lambda c: st.rejections_by_reason(c, stub.key.node_id))

    assert run(scenario()) == {"rate_limited": 1}
