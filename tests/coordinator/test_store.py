"""The store's writer and its O(1) queue depth; the intake's tokenizer shortcut."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
from pathlib import Path

import pytest

from veriroll.coordinator import store as st
from veriroll.coordinator.store import pg


def insert_group(conn, i: int) -> None:
    conn.execute("INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, arrival_ms, "
                 "content_hash, tokens, mean_reward, verified) VALUES(?, 'n', ?, 'e', 0, 1.0, 0, 'h', 1, 0.0, 0)",
                 (f"lease-{i}", i))


def counted(conn) -> int:
    return conn.execute("SELECT COUNT(*) FROM groups WHERE consumed_step IS NULL AND dropped IS NULL").fetchone()[0]


def test_queued_groups_follows_accepts_consumption_drops_and_deletes(store_target):
    conn = st.connect(store_target)
    for i in range(10):
        insert_group(conn, i)
    assert st.queued_groups(conn) == counted(conn) == 10
    conn.execute("UPDATE groups SET consumed_step = 1 WHERE group_id <= 3")
    conn.execute("UPDATE groups SET dropped = 'stale' WHERE group_id IN (3, 4, 5)")  # 3 was consumed already
    assert st.queued_groups(conn) == counted(conn) == 5
    conn.execute("UPDATE groups SET consumed_step = NULL WHERE group_id = 1")  # back in the queue
    conn.execute("UPDATE groups SET mean_reward = 1.0")  # other columns do not move the count
    conn.execute("DELETE FROM groups WHERE group_id IN (2, 6)")
    assert st.queued_groups(conn) == counted(conn) == 5
    conn.close()


def test_queued_groups_starts_from_the_rows_of_an_older_database(tmp_path):
    conn = st.connect(tmp_path / "state.db")
    conn.executescript("DROP TRIGGER groups_queued_insert; DROP TRIGGER groups_queued_update; "
                       "DROP TRIGGER groups_queued_delete; DROP TABLE counters;")
    for i in range(7):
        insert_group(conn, i)
    conn.execute("UPDATE groups SET consumed_step = 1 WHERE group_id = 1")
    conn.close()
    conn = st.connect(tmp_path / "state.db")
    assert st.queued_groups(conn) == 6
    insert_group(conn, 99)
    assert st.queued_groups(conn) == counted(conn) == 7
    conn.close()


def test_prompts_drawn_moves_from_kv_to_a_counter_with_its_value(store_target):
    """A database from before the counter kept the number of draws (the prompt stream's position) in kv."""
    conn = st.connect(store_target)
    conn.execute("DELETE FROM counters WHERE name = 'prompts_drawn'")
    st.kv_set(conn, "prompts_drawn", 41)
    if not isinstance(store_target, Path):  # PostgreSQL runs its schema again only for another fingerprint
        conn.execute("COMMENT ON TABLE nodes IS 'an older schema'")
    conn.close()
    conn = st.connect(store_target)
    moved, left = st.prompts_drawn(conn), st.kv_get(conn, "prompts_drawn")
    st.insert_leased_prompt(conn, "e", "1+1=", "2", {}, [1, 2])  # no write transaction: slot by backend pid
    assert (moved, left, st.prompts_drawn(conn)) == (41, None, 42)
    conn.close()


def test_an_async_caller_that_gave_up_is_skipped_and_the_writer_goes_on(store_target):
    db = st.Database(store_target)
    ran: list[str] = []
    started, gate = threading.Event(), threading.Event()

    async def scenario():
        # Hold the writer inside an op, so the next op waits in the queue until its caller gives up.
        blocker = db.submit(lambda c: (started.set(), gate.wait(10)))
        await asyncio.to_thread(started.wait, 10)
        abandoned = asyncio.create_task(db.run(lambda c: ran.append("abandoned")))
        await asyncio.sleep(0.05)
        abandoned.cancel()
        gate.set()
        blocker.result(timeout=10)
        assert await db.run(lambda c: ran.append("next") or 42) == 42
        with pytest.raises(asyncio.CancelledError):
            await abandoned

    asyncio.run(scenario())
    db.close()
    assert ran == ["next"]


def test_an_op_that_raises_rolls_back_alone_and_reaches_its_async_caller(store_target):
    db = st.Database(store_target)

    def bad(conn):
        st.kv_set(conn, "bad", 1)
        raise ValueError("boom")

    async def scenario():
        results = await asyncio.gather(db.run(bad), db.run(lambda c: st.kv_set(c, "good", 1)),
                                       db.run_read(lambda c: 7), return_exceptions=True)
        assert isinstance(results[0], ValueError) and results[1] is None and results[2] == 7
        return await db.run_read(lambda c: (st.kv_get(c, "bad"), st.kv_get(c, "good")))

    assert asyncio.run(scenario()) == (None, 1)
    db.close()


def test_a_failing_op_in_a_batch_leaves_the_others_committed_exactly_once(store_target):
    """The batch runs without savepoints first; one op raising rolls that attempt back and the batch runs
    again with a savepoint per op: the others' effects land once, the failing op's not at all."""
    db = st.Database(store_target)
    started, gate = threading.Event(), threading.Event()

    def bump(name):
        def op(conn):
            st.kv_set(conn, name, (st.kv_get(conn, name) or 0) + 1)
            return name
        return op

    def bad(conn):
        st.kv_set(conn, "bad", 1)
        raise ValueError("boom")

    blocker = db.submit(lambda c: (started.set(), gate.wait(10)))
    started.wait(10)
    # Queued behind the blocker, so the writer takes them as one batch.
    futures = [db.submit(bump("a")), db.submit(bad), db.submit(bump("b"))]
    gate.set()
    blocker.result(timeout=10)
    assert futures[0].result(timeout=10) == "a" and futures[2].result(timeout=10) == "b"
    with pytest.raises(ValueError, match="boom"):
        futures[1].result(timeout=10)
    assert db.run_sync(lambda c: (st.kv_get(c, "a"), st.kv_get(c, "b"), st.kv_get(c, "bad"))) == (1, 1, None)
    db.close()


def test_text_codec_gives_the_tokenizers_ids_and_text(tmp_path):
    from support import build_tiny_checkpoint
    from transformers import AutoTokenizer

    from veriroll.coordinator.environments import load_environment
    from veriroll.coordinator.service import TextCodec, encode_prompt

    tok = AutoTokenizer.from_pretrained(str(build_tiny_checkpoint(tmp_path / "v0")))
    env = load_environment("arithmetic")
    codec = TextCodec(tok, [p.text for p in env.sample_prompts(random.Random(1), 8)])
    assert codec._backend is not None  # the shortcut is taken for the project's own tokenizer
    rng = random.Random(2)
    for p in env.sample_prompts(rng, 50):
        assert codec.encode(p.text) == encode_prompt(tok, p.text)
    for _ in range(50):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        assert codec.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_node_self_description_is_bounded_by_one_rule():
    hw, version, name = st.bound_node_fields(
        {"cpu": "\u202eAMD\x00 EPYC" + "9" * 1000, "cpu_count": -1, "ram_bytes": 2**70, "disk_free_bytes": True,
         "os": 7, "engine": "torch\n", "device": " cuda ", "gpus": [{"name": "H100\t", "memory_bytes": 1}] * 40 + ["x"],
         "extra": "x" * 10_000},
        "0.1.0\x1b" + "v" * 100, "\n  alice\u200b " + "a" * 100)
    assert set(hw) == {"cpu", "cpu_count", "ram_bytes", "disk_free_bytes", "os", "engine", "device", "gpus"}
    assert hw["cpu"] == ("AMD EPYC" + "9" * 1000)[:st.HARDWARE_TEXT_CHARS]
    assert hw["cpu_count"] == hw["ram_bytes"] == hw["disk_free_bytes"] == 0 and hw["os"] == ""
    assert hw["engine"] == "torch" and hw["device"] == "cuda"
    assert hw["gpus"] == [{"name": "H100", "memory_bytes": 1}] * st.MAX_GPUS
    assert version == ("0.1.0" + "v" * 100)[:st.NAME_CHARS]
    assert name == ("alice " + "a" * 100)[:st.NAME_CHARS]  # zero-width space (Cf) dropped, then cut
    assert st.bound_node_fields({}, "", "") == ({"cpu": "", "cpu_count": 0, "ram_bytes": 0, "disk_free_bytes": 0,
                                                 "os": "", "engine": "", "device": "", "gpus": []}, "", "")
    assert st.bound_node_fields("not a dict", None, b"bytes")[1:] == ("", "")  # type: ignore[arg-type]


def test_bounded_text_reads_only_what_the_cut_needs():
    import time

    huge = "y" * (64 * 1024 * 1024)
    t0 = time.perf_counter()
    assert st.bounded_text(huge, 64) == "y" * 64
    assert time.perf_counter() - t0 < 0.5


def test_load_lease_is_one_statement_with_the_lease_its_prompt_and_its_group(store_target):
    """The intake's lease read, for every submitted group: one statement (one snapshot, one round trip)."""
    db = st.Database(store_target)

    def script(conn):
        prompt_id = st.insert_leased_prompt(conn, "e", "1+1=", "2", {"k": 1}, [1, 5, 6])
        for lease_id in ("L1", "L2"):
            st.insert_lease(conn, st.LeaseRecord(
                lease_id=lease_id, node_id="n", prompt_id=prompt_id, group_size=1, temperature=0.5,
                max_new_tokens=3, seeds=(7,), stop_token_ids=(2,), policy_version=4, issued_ms=1, deadline_ms=9,
                state=st.LeaseState.OPEN, probation=True))
        gid = st.accept_group(conn, st.AcceptedGroup(
            lease_id="L2", node_id="n", prompt_id=prompt_id, env="e", policy_version=4, temperature=0.5,
            arrival_ms=2, content_hash="c2", tokens=3, rewards=[1.0], verified=False, clean=True,
            samples=[(st.pack_i32([5, 6, 2]), st.pack_f32([-1, -1, -1]), None, "stop")]), probation_groups=9)
        return gid

    def statements(conn, fn) -> int:
        if isinstance(conn, pg.PgConnection):
            before = conn.statements
            fn(conn)
            return conn.statements - before
        seen = []
        conn.set_trace_callback(seen.append)
        try:
            fn(conn)
        finally:
            conn.set_trace_callback(None)
        return len(seen)

    def loads(conn):
        counts = {statements(conn, lambda c, lease_id=lease_id: st.load_lease(c, lease_id)) for lease_id in ("L1", "L2")}
        return (st.load_lease(conn, "L1"), st.load_lease(conn, "L2"), st.load_lease(conn, "nope")), counts

    try:
        gid = db.run_sync(script)
        ((lease, prompt, prior), (_, _, accepted), missing), counts = db.read(loads).result()
    finally:
        db.close()
    conn = st.connect(store_target)
    lease_columns = [d[0] for d in conn.execute("SELECT * FROM leases LIMIT 0").description]
    prompt_columns = [d[0] for d in conn.execute("SELECT * FROM prompts LIMIT 0").description]
    conn.close()
    assert list(lease) == lease_columns and list(prompt) == prompt_columns  # every column, by name
    record = st.LeaseRecord.from_row(lease)
    assert (record.lease_id, record.seeds, record.policy_version, record.state, record.probation) == (
        "L1", (7,), 4, st.LeaseState.OPEN, True)
    assert (prompt["env"], prompt["answer"], st.unpack_i32(prompt["prompt_ids"]).tolist()) == ("e", "2", [1, 5, 6])
    assert prior is None and accepted == {"group_id": gid, "content_hash": "c2"}
    assert missing == (None, None, None) and counts == {1}


def test_bucket_levels_reads_several_buckets_in_one_statement_as_bucket_level_reads_each(store_target):
    """The verifier budget's check on the serving path: one statement for every scope, one snapshot."""
    conn = st.connect(store_target)
    rate = st.BucketRate(per_s=2.0, burst=10.0)
    assert st.take_from_bucket(conn, "a", "x", rate, 4.0, 1_000)
    assert st.take_from_bucket(conn, "b", "x", rate, 12.0, 1_000, overdraw=True)
    buckets = [("a", "x", rate), ("b", "x", rate), ("a", "missing", st.BucketRate(per_s=1.0, burst=3.0))]
    levels = st.bucket_levels(conn, buckets, 1_500)
    each = [st.bucket_level(conn, kind, key, r, 1_500) for kind, key, r in buckets]
    none = st.bucket_levels(conn, [], 1_500)
    conn.close()
    assert levels == each and levels[0] == 7.0 and levels[1] < 0 and levels[2] == 3.0 and none == []


def test_standing_changes_are_noted_whoever_makes_them_and_only_then(store_target):
    from veriroll.coordinator.ledger import Ledger
    from veriroll.coordinator.metrics import CoordinatorMetrics
    from veriroll.protos.identity import PrivateKey

    db = st.Database(store_target)
    keys = [PrivateKey.generate().public for _ in range(3)]
    try:
        for k in keys:
            db.run_sync(lambda c, k=k: st.register_node(c, k.node_id, k.raw, 0, {}, "1", "n"))
        assert db.read(lambda c: st.standing_changes(c, 0, 10)).result() == []  # registering is no change
        db.run_sync(lambda c: st.touch_node(c, keys[0].node_id, 5, 1, st.Session("s", "a")))
        db.run_sync(lambda c: st.set_standing(c, keys[1].node_id, "banned", "operator: test"))
        db.run_sync(lambda c: st.set_standing(c, keys[1].node_id, "banned", "operator: test"))  # no change
        db.run_sync(lambda c: st.set_standing(c, keys[2].node_id, "probation", "again"))  # the reason changed
        changes = db.read(lambda c: st.standing_changes(c, 0, 10)).result()
        assert [node for _, node, _ in changes] == [keys[1].node_id, keys[2].node_id]
        assert changes[0][0] < changes[1][0] and changes[0][2] <= changes[1][2]
        assert db.read(lambda c: st.standing_changes(c, 0, 1)).result() == changes[:1]
        newest = db.read(st.newest_standing_change_ms).result()
        assert newest == changes[1][2]
        assert db.read(lambda c: st.standing_changes(c, newest + 1, 10)).result() == []
        assert db.run_sync(st.forget_standing_changes) == 0  # both are recent

        # A cache following the feed drops exactly the nodes that changed after it started following.
        ledger = Ledger(db, CoordinatorMetrics(), clock=lambda: 0, max_strikes=3, probation_groups=1,
                        session_ttl_s=60)
        asyncio.run(ledger.follow_standing_changes())  # the first read only finds its place
        for k in keys:
            assert asyncio.run(ledger.lookup(k.node_id)).node_id == k.node_id  # all three cached
        assert asyncio.run(ledger.follow_standing_changes()) == 0  # the changes before it are known
        db.run_sync(lambda c: st.set_standing(c, keys[0].node_id, "trusted"))
        assert asyncio.run(ledger.follow_standing_changes()) == 1
        assert asyncio.run(ledger.lookup(keys[0].node_id)).standing == st.Standing.TRUSTED
        assert asyncio.run(ledger.follow_standing_changes()) == 0  # applied once, though inside the slack
    finally:
        db.close()


def test_a_mass_change_drops_the_whole_node_cache_once_and_the_feed_goes_on(tmp_path, monkeypatch):
    from veriroll.coordinator import ledger as ledger_module
    from veriroll.coordinator.metrics import CoordinatorMetrics
    from veriroll.protos.identity import PrivateKey

    monkeypatch.setattr(ledger_module, "CHANGES_PAGE", 4)
    db = st.Database(tmp_path / "s.db")
    keys = [PrivateKey.generate().public for _ in range(6)]
    try:
        for k in keys:
            db.run_sync(lambda c, k=k: st.register_node(c, k.node_id, k.raw, 0, {}, "1", "n"))
        ledger = ledger_module.Ledger(db, CoordinatorMetrics(), clock=lambda: 0, max_strikes=3, probation_groups=1,
                                      session_ttl_s=60)
        asyncio.run(ledger.follow_standing_changes())
        for k in keys:
            asyncio.run(ledger.lookup(k.node_id))
        # One statement bans all six (one changed_ms on SQLite): more than a page of the feed.
        db.run_sync(lambda c: c.execute("UPDATE nodes SET standing = 'banned', ban_reason = 'operator: all'"))
        assert asyncio.run(ledger.follow_standing_changes()) == 6  # the whole cache, once
        assert all(asyncio.run(ledger.lookup(k.node_id)).standing == st.Standing.BANNED for k in keys)
        assert asyncio.run(ledger.follow_standing_changes()) == 0  # past them: not dropped again every second
        db.run_sync(lambda c: st.set_standing(c, keys[0].node_id, "probation"))
        # Noted in the mass change's own millisecond, as on a fast machine (made so here: it happened now and then).
        db.run_sync(lambda c: c.execute("UPDATE standing_changes SET changed_ms = (SELECT MIN(changed_ms) FROM "
                                        "standing_changes) WHERE seq = (SELECT MAX(seq) FROM standing_changes)"))
        assert asyncio.run(ledger.follow_standing_changes()) == 1  # and later changes still arrive
        assert asyncio.run(ledger.follow_standing_changes()) == 0
    finally:
        db.close()


def _lease(lease_id: str, node_id: str, *, deadline: int = 10_000) -> st.LeaseRecord:
    return st.LeaseRecord(lease_id=lease_id, node_id=node_id, prompt_id=0, group_size=2, temperature=0.5,
                          max_new_tokens=3, seeds=(7, 8), stop_token_ids=(2,), policy_version=4, issued_ms=1,
                          deadline_ms=deadline, state=st.LeaseState.OPEN)


def _rows(conn, sql: str) -> list[tuple]:
    return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in conn.execute(sql).fetchall()]


def test_lease_one_issues_a_pooled_prompt_first_then_fresh_ones_within_the_limits(store_target):
    """LeaseWork's common case as one operation (one statement on PostgreSQL): the same rows, counts and
    refusals on both backends."""
    db = st.Database(store_target)
    drawn: list[st.FreshPrompt] = []
    spare: list[st.FreshPrompt] = []

    def fresh() -> st.FreshPrompt:  # as the lease desk does: a leftover goes first, so the stream skips none
        if spare:
            return spare.pop()
        drawn.append(st.FreshPrompt("e", f"{len(drawn)}+1=", str(len(drawn) + 1), {"k": len(drawn)}, [1, 5, len(drawn)]))
        return drawn[-1]

    def lease_one(conn, lease_id: str, node_id: str) -> st.LeasedOne:
        one = st.lease_one(conn, _lease(lease_id, node_id), fresh, queue_max=5, max_open=2)
        if one.leftover is not None:
            spare.append(one.leftover)
        return one

    def script(conn):
        out = {}
        pooled = st.insert_leased_prompt(conn, "pool", "9+9=", "18", {}, [1, 9, 9])
        st.insert_lease(conn, dataclasses.replace(_lease("old", "m"), prompt_id=pooled))
        st.spend_lease(conn, "old", pooled)  # its prompt is back in the pool
        out["first"] = lease_one(conn, "L1", "n")
        out["second"] = lease_one(conn, "L2", "n")
        out["full"] = lease_one(conn, "L3", "n")
        out["other"] = lease_one(conn, "L4", "o")
        for i in range(5):
            conn.execute("INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, "
                         "arrival_ms, content_hash, tokens, mean_reward, verified) "
                         "VALUES(?, 'x', 0, 'e', 0, 1.0, 0, 'h', 1, 0.0, 0)", (f"g{i}",))
        out["queue_full"] = lease_one(conn, "L5", "p")
        out["drawn"] = st.prompts_drawn(conn)
        out["leases"] = _rows(conn, "SELECT lease_id, node_id, prompt_id, group_size, temperature, max_new_tokens, "
                                    "seeds, stop_token_ids, policy_version, issued_ms, deadline_ms, state, probation "
                                    "FROM leases WHERE lease_id <> 'old' ORDER BY lease_id")
        out["prompts"] = _rows(conn, "SELECT prompt_id, env, text, answer, meta, prompt_ids, state, attempts "
                                     "FROM prompts ORDER BY prompt_id")
        return out

    try:
        out = db.run_sync(script)
    finally:
        db.close()
    first, second, full, other, queue_full = (out[k] for k in ("first", "second", "full", "other", "queue_full"))
    # The pooled prompt went first; the fresh prompt asked for is handed back (PostgreSQL draws it before the
    # statement) or was never drawn (SQLite): either way it is not stored and not counted.
    assert (first.queued, first.open_of_node, first.prompt_ids, first.env) == (0, 0, [1, 9, 9], "pool")
    assert first.leftover is None or first.leftover == drawn[0]
    stored = drawn[:2]  # the stream's first two prompts, in order, whatever was drawn ahead
    assert len(drawn) == (2 if isinstance(store_target, Path) else 3)  # (PostgreSQL: a third drawn for L5, kept)
    assert (second.open_of_node, second.prompt_ids, second.env, second.leftover) == (1, stored[0].prompt_ids, "e", None)
    assert (full.open_of_node, full.prompt_id) == (2, None)
    assert (other.open_of_node, other.prompt_ids, other.leftover) == (0, stored[1].prompt_ids, None)
    assert (queue_full.queued, queue_full.prompt_id) == (5, None)
    assert out["drawn"] == 3  # the pooled prompt, and the two fresh ones stored
    pool_id = out["prompts"][0][0]
    assert [r[:3] for r in out["leases"]] == [("L1", "n", pool_id), ("L2", "n", second.prompt_id),
                                              ("L4", "o", other.prompt_id)]
    assert {r[3:] for r in out["leases"]} == {(2, 0.5, 3, "[7, 8]", "[2]", 4, 1, 10_000, "open", 0)}
    assert [r[1:] for r in out["prompts"]] == [
        ("pool", "9+9=", "18", "{}", st.pack_i32([1, 9, 9]), "leased", 2),
        *[(d.env, d.text, d.answer, json.dumps(d.meta), st.pack_i32(d.prompt_ids), "leased", 1) for d in stored]]


def test_accept_group_stores_the_same_rows_on_both_backends_and_only_for_an_open_lease(store_target):
    """accept_group (one statement on PostgreSQL): the group, its samples (trusted log-probs or NULL), the
    prompt done, the node credited and made trusted; nothing at all for a lease that is no longer open."""
    db = st.Database(store_target)
    node = "n" * 64

    def script(conn):
        st.register_node(conn, node, b"k" * 32, 0, {}, "1", "")
        prompt = st.insert_leased_prompt(conn, "e", "1+1=", "2", {}, [1, 5, 6])
        st.insert_lease(conn, dataclasses.replace(_lease("L1", node), prompt_id=prompt))
        group = st.AcceptedGroup(
            lease_id="L1", node_id=node, prompt_id=prompt, env="e", policy_version=4, temperature=0.5, arrival_ms=77,
            content_hash="c1", tokens=5, rewards=[1.0, 0.25], verified=True, clean=True,
            samples=[(st.pack_i32([5, 6, 2]), st.pack_f32([-1, -2, -3]), st.pack_f32([-1.5, -2, -3]), "stop"),
                     (st.pack_i32([7, 2]), st.pack_f32([-0.5, -0.25]), None, "stop")])
        gid = st.accept_group(conn, group, probation_groups=1)
        again = st.accept_group(conn, dataclasses.replace(group, content_hash="c2"), probation_groups=1)
        return {
            "gid": gid, "again": again,
            "groups": _rows(conn, "SELECT group_id, lease_id, node_id, prompt_id, env, policy_version, temperature, "
                                  "arrival_ms, content_hash, tokens, mean_reward, verified FROM groups"),
            "samples": _rows(conn, "SELECT group_id, idx, token_ids, logprobs, trusted_logprobs, reward, finish_reason "
                                   "FROM samples ORDER BY idx"),
            "state": _rows(conn, "SELECT p.state, l.state FROM prompts p JOIN leases l ON l.prompt_id = p.prompt_id"),
            "node": _rows(conn, "SELECT standing, clean_groups, accepted_groups, accepted_tokens, last_seen_ms "
                                "FROM nodes"),
            "queued": st.queued_groups(conn),
        }

    try:
        out = db.run_sync(script)
    finally:
        db.close()
    gid = out["gid"]
    assert gid is not None and out["again"] is None and out["queued"] == 1
    assert out["groups"] == [(gid, "L1", node, out["groups"][0][3], "e", 4, 0.5, 77, "c1", 5, 0.625, 1)]
    assert out["samples"] == [
        (gid, 0, st.pack_i32([5, 6, 2]), st.pack_f32([-1, -2, -3]), st.pack_f32([-1.5, -2, -3]), 1.0, "stop"),
        (gid, 1, st.pack_i32([7, 2]), st.pack_f32([-0.5, -0.25]), None, 0.25, "stop")]
    assert out["state"] == [("done", "submitted")]
    assert out["node"] == [("trusted", 1, 1, 5, 77)]


def test_run_chain_runs_two_ops_in_one_transaction_and_answers_them_apart(store_target):
    """The accept and the next lease of a submission: ``then`` gets ``first``'s result, both commit together;
    an error of ``then`` is undone alone and returned; an error of ``first`` is raised and ``then`` never runs."""
    db = st.Database(store_target)
    commits: list[str] = []
    if isinstance(store_target, Path):
        db.run_sync(lambda conn: conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None))

    def put(key: str, value):
        return lambda conn, *_: st.kv_set(conn, key, value) or value

    def then_fails(conn, value):
        st.kv_set(conn, "then", value)
        raise ValueError("then failed")

    def first_fails(conn):
        st.kv_set(conn, "first2", 1)
        raise KeyError("first failed")

    async def scenario():
        before = len(commits)
        out = {"chained": await db.run_chain(put("first", 1), lambda conn, v: put("then", v + 1)(conn))}
        out["commits"] = len(commits) - before
        out["then_fails"] = await db.run_chain(put("first1", 7), then_fails)
        with pytest.raises(KeyError):
            await db.run_chain(first_fails, put("then2", 2))
        return out

    try:
        out = asyncio.run(scenario())
        values = db.read(lambda conn: {k: st.kv_get(conn, k) for k in ("first", "then", "first1", "first2", "then2")}).result()
    finally:
        db.close()
    assert out["chained"] == (1, 2, None)
    value, result, error = out["then_fails"]
    assert (value, result, type(error)) == (7, None, ValueError)
    assert values == {"first": 1, "then": 2, "first1": 7, "first2": None, "then2": None}
    if isinstance(store_target, Path):
        assert out["commits"] == 1  # one transaction for both


def test_the_writer_accounts_its_transactions_ops_time_and_round_trips(store_target):
    """What /metrics reads from the writer: each batch once, its ops, its wall and CPU time (CPU no more than
    wall), and on PostgreSQL every wait on the server, a pipeline of statements as one."""
    db = st.Database(store_target)
    running, release = threading.Event(), threading.Event()
    seen = []

    def held(conn):  # keeps the writer in one transaction until the other two are queued behind it
        running.set()
        release.wait(10)
        st.kv_set(conn, "held", 1)

    def two_statements(conn):  # runs first in the next batch: the held one's is accounted by now
        seen.append((db.writer_busy_s, db.writer_cpu_s, db.writer_batches, db.writer_ops, db.round_trips))
        st.kv_set(conn, "a", 1)
        st.kv_set(conn, "b", 2)

    def together(conn):
        st.execute_together(conn, [("UPDATE kv SET value = ? WHERE key = ?", ("3", "a")),
                                   ("UPDATE kv SET value = ? WHERE key = ?", ("4", "b")),
                                   ("SELECT value FROM kv WHERE key = ?", ("a",))])

    try:
        first = db.submit(held)
        assert running.wait(10)
        trips0 = db.round_trips
        rest = [db.submit(two_statements), db.submit(together)]
        release.set()
        for fut in [first, *rest]:
            fut.result(timeout=30)
        (busy0, cpu0, batches0, ops0, trips1), = seen
        busy, cpu = db.writer_busy_s - busy0, db.writer_cpu_s - cpu0
        batches, ops, trips2 = db.writer_batches - batches0, db.writer_ops - ops0, db.round_trips
    finally:
        db.close()
    assert (batches, ops) == (1, 2)  # the two queued behind the held one shared a transaction
    assert busy0 > 0.0 and 0 < cpu <= busy * 1.05 + 0.002
    if isinstance(store_target, Path):
        assert trips0 is trips1 is trips2 is None
    else:
        # The held op's kv_set (its BEGIN went with it) and COMMIT; the next batch's BEGIN waits for its first statement.
        assert trips1 - trips0 == 2
        assert trips2 - trips1 == 4  # two statements, one pipeline of three, COMMIT


def test_run_together_runs_a_transactions_calls_of_one_kind_as_one_and_answers_each_as_alone(store_target):
    """Nonces of the requests that share a transaction go in with one statement: each caller gets what its
    nonce alone would have got (a replay in the same transaction is refused, as one in a later one); with an
    op of the batch failing, the batch runs again op by op and the answers are the same."""
    db = st.Database(store_target)
    calls: list[int] = []

    def nonces(conn, entries):
        calls.append(len(entries))
        return st.use_nonces(conn, entries)

    def fails(conn):
        st.kv_set(conn, "undone", 1)
        raise ValueError("this op fails alone")

    async def batch(entries, *, with_failure: bool):
        running, release = threading.Event(), threading.Event()

        def held(conn):  # the writer is busy in this one until everything below is queued behind it
            running.set()
            release.wait(10)

        first = db.submit(held)
        assert await asyncio.to_thread(running.wait, 10)
        tasks = [asyncio.ensure_future(db.run_together(nonces, e)) for e in entries]
        if with_failure:
            tasks.insert(1, asyncio.ensure_future(db.run(fails)))
        await asyncio.sleep(0.05)  # every task has queued its op
        release.set()
        await asyncio.wrap_future(first)
        return await asyncio.gather(*tasks, return_exceptions=True)

    async def scenario():
        out = {"first": await batch([(b"k1", "a", 9), (b"k2", "a", 9), (b"k1", "a", 9), (b"k1", "b", 9)],
                                    with_failure=False)}
        out["first_calls"] = list(calls)
        calls.clear()
        out["second"] = await batch([(b"k1", "b", 9), (b"k3", "a", 9), (b"k3", "a", 9)], with_failure=True)
        out["second_calls"] = list(calls)
        return out

    try:
        out = asyncio.run(scenario())
        undone = db.read(lambda conn: st.kv_get(conn, "undone")).result()
        stored = db.read(lambda conn: sorted((bytes(r[0]), r[1]) for r in conn.execute(
            "SELECT public_key, nonce FROM nonces"))).result()
    finally:
        db.close()
    assert out["first"] == [True, True, False, True] and out["first_calls"] == [4]
    assert out["second"][0] is False and isinstance(out["second"][1], ValueError) and out["second"][2:] == [True, False]
    # Together first (the failure rolled it back), then one by one with savepoints.
    assert out["second_calls"] == [3, 1, 1, 1]
    assert undone is None
    assert stored == [(b"k1", "a"), (b"k1", "b"), (b"k2", "a"), (b"k3", "a")]


def test_the_postgres_schema_text_moves_only_on_purpose():
    """Both databases' schema comes from one declaration (store/schema.py). PostgreSQL connections skip the DDL
    while they find its fingerprint, so any change to the text (a comment, a space in a shared table) makes
    every existing PostgreSQL database run it again at its next start. Change this value with the schema."""
    assert pg.SCHEMA_MARK == "veriroll schema dd633108c2e1ce95"
    assert st.schema.for_postgres("id INTEGER PRIMARY KEY AUTOINCREMENT, b BLOB, r REAL, n INTEGER") == \
        "id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, b BYTEA, r DOUBLE PRECISION, n BIGINT"
