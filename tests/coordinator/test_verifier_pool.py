"""The verifier pool: edges queue audited groups in the store, trusted workers claim them (SKIP LOCKED on
PostgreSQL), verify and write the verdict; a claim past its deadline goes back to the queue.

The store's operations run on both backends; the pool in one process runs on SQLite (role 'all' with
``verifier.pool``); one edge and two verifier processes on PostgreSQL, one of them killed -9 mid-group,
run as real `veriroll coordinator run` processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading

import numpy as np
import pytest
from support import make_coordinator_dir, node_client, running_coordinator
from test_edges import HANG_GUARD_S, free_port, start, stop_all, wait_http

from veriroll.coordinator import store as st
from veriroll.coordinator.verifier_pool import MAX_CLAIMS, VerifierPool
from veriroll.node.engines.base import GenerationRequest
from veriroll.node.engines.torch import TorchEngine
from veriroll.protos.identity import PrivateKey
from veriroll.protos.service import CallError, SignedStub, secure_channel
from veriroll.protos.v1 import coordinator_pb2 as pb


def generate(engine: TorchEngine, lease: pb.Lease) -> pb.SubmitGroupRequest:
    """The honest group for ``lease``, as a node's engine generates it."""
    req = GenerationRequest(list(lease.prompt_ids), list(lease.seeds), lease.temperature, lease.max_new_tokens,
                            list(lease.stop_token_ids))
    results = engine.generate([req])[0]
    return pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=[
        pb.Sample(token_ids=r.token_ids, logprobs=np.asarray(r.logprobs, "<f4").tobytes(), proof=r.proof,
                  finish_reason=r.finish_reason) for r in results])


def forged(group: pb.SubmitGroupRequest) -> pb.SubmitGroupRequest:
    """The group with two samples' proofs swapped: shapes right, TOPLOC wrong."""
    bad = pb.SubmitGroupRequest.FromString(group.SerializeToString())
    bad.samples[0].proof, bad.samples[1].proof = group.samples[1].proof, group.samples[0].proof
    return bad


def jobs(conn) -> list[dict]:
    return [dict(r) for r in conn.execute("SELECT lease_id, state, claims, reason FROM verify_jobs ORDER BY job_id")]


# --- the store's operations, on both backends -----------------------------------------------------------


def test_jobs_are_queued_once_claimed_oldest_first_and_judged_once(store_target):
    db = st.Database(store_target)
    try:
        first = db.run_sync(lambda c: st.enqueue_verify_job(c, "L1", "h1", "n", "10.0.0.1", b"one", 1_000))
        again = db.run_sync(lambda c: st.enqueue_verify_job(c, "L1", "h1", "n", "10.0.0.1", b"one", 2_000))
        other = db.run_sync(lambda c: st.enqueue_verify_job(c, "L1", "h2", "n", "10.0.0.1", b"two", 3_000))
        assert again == first and other != first  # the same content finds its job; other content is another

        claimed = db.run_sync(lambda c: st.claim_verify_job(c, "w1", 10_000))
        assert (claimed.job_id, claimed.submission, claimed.peer, claimed.claims) == (first, b"one", "10.0.0.1", 1)
        assert db.run_sync(lambda c: st.claim_verify_job(c, "w2", 10_000)).job_id == other
        assert db.run_sync(lambda c: st.claim_verify_job(c, "w3", 10_000)) is None
        assert db.run_sync(st.verify_jobs_waiting) == 2

        passed = st.Verdict(None, "", st.pack_f32([-0.5, -1.5]), 0.25)
        assert db.run_sync(lambda c: st.finish_verify_job(c, first, passed, 5_000))
        # A second verdict (a worker that finished after its job was reclaimed) does not replace the first.
        assert not db.run_sync(lambda c: st.finish_verify_job(c, first, st.Verdict("toploc_failed", "x"), 6_000))
        refused = st.Verdict("sampling_failed", "sample 1: token 3", None, 0.5)
        assert db.run_sync(lambda c: st.finish_verify_job(c, other, refused, 7_000))
        verdicts = db.run_sync(lambda c: st.verify_verdicts(c, [first, other, 999]))
        assert verdicts == {first: passed, other: refused}
        assert db.run_sync(st.verify_jobs_waiting) == 0
        assert db.run_sync(lambda c: st.forget_verify_jobs(c, 6_000)) == 1  # verdicts finished before 6 s go
        assert set(db.run_sync(lambda c: st.verify_verdicts(c, [first, other]))) == {other}
    finally:
        db.close()


def test_a_claim_past_its_deadline_is_reclaimed_and_a_released_one_is_pending_at_once(store_target):
    db = st.Database(store_target)
    try:
        job = db.run_sync(lambda c: st.enqueue_verify_job(c, "L1", "h", "n", "", b"s", 0))
        db.run_sync(lambda c: st.claim_verify_job(c, "killed", 5_000))
        assert db.run_sync(lambda c: st.reclaim_verify_jobs(c, 4_999)) == 0  # still within its claim
        assert db.run_sync(lambda c: st.claim_verify_job(c, "other", 9_000)) is None
        assert db.run_sync(lambda c: st.reclaim_verify_jobs(c, 5_001)) == 1
        again = db.run_sync(lambda c: st.claim_verify_job(c, "other", 9_000))
        assert (again.job_id, again.claims) == (job, 2)

        assert not db.run_sync(lambda c: st.release_verify_job(c, job, "killed"))  # not its claim any more
        assert db.run_sync(lambda c: st.release_verify_job(c, job, "other"))
        assert db.run_sync(lambda c: st.claim_verify_job(c, "third", 9_000)).claims == 2  # the release is uncounted
    finally:
        db.close()


def test_two_workers_never_claim_the_same_job(store_target):
    """Two connections (two processes' writers) claiming side by side: every job is claimed exactly once."""
    setup = st.Database(store_target)
    n_jobs = 60
    for i in range(n_jobs):
        setup.run_sync(lambda c, i=i: st.enqueue_verify_job(c, f"L{i}", "h", "n", "", b"s", i))
    workers = [st.Database(store_target) for _ in range(2)]
    claimed: list[list[int]] = [[], []]
    go = threading.Barrier(2)

    def drain(k: int) -> None:
        go.wait()
        while (job := workers[k].run_sync(lambda c: st.claim_verify_job(c, f"w{k}", 1 << 50))) is not None:
            claimed[k].append(job.job_id)

    threads = [threading.Thread(target=drain, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for db in (setup, *workers):
        db.close()
    both = claimed[0] + claimed[1]
    assert not set(claimed[0]) & set(claimed[1]) and len(set(both)) == len(both) == n_jobs


# --- the pool in one process (SQLite) ---------------------------------------------------------------------


def test_in_process_pool_accepts_an_honest_group_with_trusted_logprobs_and_refuses_a_forged_one(tmp_path):
    base = make_coordinator_dir(tmp_path, {"intake.verify": True, "verifier.pool": True, "verifier.workers": 1,
                                           "leases.probation_max_open": 2})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            engine = TorchEngine(coord.policy_store.version_dir(0), 0)
            first, second = (await stub.lease_work(pb.LeaseRequest(max_leases=2))).leases
            honest = await asyncio.to_thread(generate, engine, first)
            ok = await stub.submit_group(honest)
            attacked = forged(await asyncio.to_thread(generate, engine, second))
            with pytest.raises(CallError) as info:
                await stub.submit_group(attacked)

            def read(conn):
                trusted = [r[0] for r in conn.execute("SELECT s.trusted_logprobs FROM samples s JOIN groups g "
                                                      "USING(group_id) WHERE g.lease_id = ? ORDER BY s.idx",
                                                      (first.lease_id,))]
                return trusted, jobs(conn), st.rejections_by_reason(conn)

            return ok, info.value, honest, await coord.db.run_read(read), coord.verifier_pool.judged

    ok, refusal, honest, (trusted, queued, rejections), judged = asyncio.run(scenario())
    assert ok.accepted and refusal.reason == "toploc_failed"
    for blob, sample in zip(trusted, honest.samples, strict=True):
        node_lp = np.frombuffer(sample.logprobs, "<f4")
        assert blob is not None and np.abs(np.frombuffer(blob, "<f4") - node_lp).max() < 1e-5
    assert [(j["state"], j["claims"], j["reason"]) for j in queued] == [("done", 1, None), ("done", 1, "toploc_failed")]
    assert rejections == {"toploc_failed": 1} and judged == 2


def test_no_verdict_in_time_is_a_retryable_refusal_and_the_retry_finds_the_verdict(tmp_path):
    """With no worker running the edge gives up after wait_s (unavailable, the lease kept); once a worker
    judged the queued group, the node's retry of the same content is accepted without queueing it again."""
    base = make_coordinator_dir(tmp_path, {"intake.verify": True, "verifier.pool": True, "verifier.workers": 0,
                                           "verifier.wait_s": 0.5})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            engine = TorchEngine(coord.policy_store.version_dir(0), 0)
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            group = await asyncio.to_thread(generate, engine, lease)
            with pytest.raises(CallError) as info:
                await stub.submit_group(group)
            before = await coord.db.run_read(jobs)
            pool = VerifierPool(coord.db, coord.service.verifier, workers=1, claim_timeout_s=30, keep_verdicts_s=60)
            tasks = pool.start()
            try:
                for _ in range(HANG_GUARD_S * 10):
                    if pool.judged:
                        break
                    await asyncio.sleep(0.1)
                ok = await stub.submit_group(group)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                pool.close()
            return info.value, before, ok, await coord.db.run_read(jobs), await coord.db.run_read(st.status_summary)

    refusal, before, ok, after, summary = asyncio.run(scenario())
    assert refusal.reason == "unavailable" and refusal.code.name == "UNAVAILABLE"
    assert [(j["state"], j["claims"]) for j in before] == [("pending", 0)]
    assert ok.accepted and summary["accepted_groups"] == 1
    assert [(j["state"], j["claims"], j["reason"]) for j in after] == [("done", 1, None)]  # judged once


def test_a_worker_stopped_mid_group_hands_its_job_back_and_a_group_that_stops_workers_is_refused(tmp_path):
    base = make_coordinator_dir(tmp_path, {"intake.verify": True, "verifier.pool": True, "verifier.workers": 0})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            engine = TorchEngine(coord.policy_store.version_dir(0), 0)
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            group = await asyncio.to_thread(generate, engine, lease)
            await coord.db.run(lambda c: st.enqueue_verify_job(c, lease.lease_id, "h", "n", "", group.SerializeToString(),
                                                               0))
            pool = VerifierPool(coord.db, coord.service.verifier, workers=1, claim_timeout_s=30, keep_verdicts_s=60)
            # The pool's one verifier thread is busy: the worker claims the job and waits mid-group.
            busy = threading.Event()
            pool._threads.submit(busy.wait, 60)
            worker = asyncio.create_task(pool.work("stopping"))
            for _ in range(HANG_GUARD_S * 100):
                held = await coord.db.run_read(jobs)
                if held[0]["state"] == "claimed":
                    break
                await asyncio.sleep(0.01)
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
            busy.set()
            released = await coord.db.run_read(jobs)
            # Claimed again and again without a verdict (its workers killed): refused, not handed on for ever.
            for _ in range(MAX_CLAIMS):
                await coord.db.run(lambda c: st.claim_verify_job(c, "killed", 0))
                await coord.db.run(lambda c: st.reclaim_verify_jobs(c, 1))
            verdict = await pool.judge(*await pool.claim("last"))
            pool.close()
            return held, released, verdict

    held, released, verdict = asyncio.run(scenario())
    assert [(j["state"], j["claims"]) for j in held] == [("claimed", 1)]
    assert [(j["state"], j["claims"]) for j in released] == [("pending", 0)]  # back at once, not at its deadline
    assert verdict.reason == "internal" and "3 verifier workers stopped" in verdict.detail


def test_a_verifier_process_needs_a_shared_store_and_verification_on(tmp_path, pg_url):
    from veriroll.coordinator.app import start_coordinator
    from veriroll.protos.config import ConfigError

    on_sqlite = make_coordinator_dir(tmp_path / "a", {"intake.verify": True})
    with pytest.raises(ConfigError, match="postgresql://"):
        asyncio.run(start_coordinator(on_sqlite, overrides=["role=verifier"]))
    unverified = make_coordinator_dir(tmp_path / "b", {"database": pg_url, "intake.verify": False})
    with pytest.raises(ConfigError, match="intake.verify = false"):
        asyncio.run(start_coordinator(unverified, overrides=["role=verifier"]))


# --- real processes on PostgreSQL: an edge and two verifiers, one killed mid-group --------------------------


def _claimed_by_someone(pg_url: str, lease_id: str) -> bool:
    db = st.Database(pg_url)
    try:
        return any(j["lease_id"] == lease_id and j["state"] == "claimed" for j in db.run_sync(jobs))
    finally:
        db.close()


@pytest.mark.slow  # three processes import torch: ~60 s on 2 shared cores
def test_an_edge_and_two_verifier_processes_on_postgres_survive_a_verifier_killed_mid_group(pg_url, tmp_path):
    base = make_coordinator_dir(tmp_path, {"database": pg_url, "intake.verify": True, "verifier.pool": True,
                                           "verifier.claim_timeout_s": 3, "verifier.wait_s": 60,
                                           "leases.probation_max_open": 2})
    grpc_port = free_port()
    http = {"edge": free_port(), "verifier-a": free_port(), "verifier-b": free_port()}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["edge"] = start(base, tmp_path / "edge.log", "--role=edge", f"server.port={grpc_port}",
                              f"server.http_port={http['edge']}")
        for name in ("verifier-a", "verifier-b"):
            procs[name] = start(base, tmp_path / f"{name}.log", "--role=verifier", f"server.http_port={http[name]}")
        for name, proc in procs.items():
            wait_http(http[name], proc, tmp_path / f"{name}.log")
        # b is frozen so that a claims the first group; a is killed -9 while it holds it.
        procs["verifier-b"].send_signal(signal.SIGSTOP)
        ca = (base / "tls" / "ca.crt").read_bytes()

        async def node():
            stub = SignedStub(secure_channel(f"127.0.0.1:{grpc_port}", ca, server_name="localhost"),
                              PrivateKey.generate(), timeout=120)
            await stub.register(pb.RegisterRequest(public_key=stub.key.public.raw, software_version="test"))
            engine = TorchEngine(base / "checkpoints" / "versions" / "v000000", 0)
            first, second = (await stub.lease_work(pb.LeaseRequest(max_leases=2))).leases
            honest = await asyncio.to_thread(generate, engine, first)
            submitted = asyncio.create_task(stub.submit_group(honest))
            killed_holding = False
            for _ in range(HANG_GUARD_S * 200):
                if await asyncio.to_thread(_claimed_by_someone, pg_url, first.lease_id):
                    procs["verifier-a"].send_signal(signal.SIGKILL)
                    killed_holding = True
                    break
                await asyncio.sleep(0.005)
            procs["verifier-b"].send_signal(signal.SIGCONT)
            ok = await submitted
            with pytest.raises(CallError) as info:
                await stub.submit_group(forged(await asyncio.to_thread(generate, engine, second)))
            await stub.channel.close()
            return killed_holding, ok, info.value, first.lease_id

        killed_holding, ok, refusal, lease_id = asyncio.run(node())
        db = st.Database(pg_url)
        queued, summary = db.run_sync(jobs), db.run_sync(st.status_summary)
        db.close()
    finally:
        if "verifier-b" in procs:
            procs["verifier-b"].send_signal(signal.SIGCONT)
        stop_all(procs)

    assert killed_holding and procs["verifier-a"].returncode == -signal.SIGKILL
    assert ok.accepted and refusal.reason == "toploc_failed"
    # The killed worker's job went to the other after its claim deadline: claimed twice, judged once.
    assert [(j["lease_id"], j["state"], j["claims"], j["reason"]) for j in queued] == [
        (lease_id, "done", 2, None), (queued[1]["lease_id"], "done", 1, "toploc_failed")]
    assert summary["accepted_groups"] == 1  # no group lost, none accepted twice
    assert procs["verifier-b"].returncode == 0 and procs["edge"].returncode == 0
