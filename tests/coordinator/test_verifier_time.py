"""Verifier time is budgeted per node key, address and network, end to end over TLS: a group runs the
trusted model only when its key has time left; a refused group keeps its lease (it was not judged),
and a probation node whose time is used up is given no new work until it refills."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
from support import make_coordinator_dir, node_client, running_coordinator
from test_server import expect_refusal

from veriroll.coordinator import store as st
from veriroll.node.engines.base import GenerationRequest
from veriroll.node.engines.torch import TorchEngine
from veriroll.protos.v1 import coordinator_pb2 as pb


def test_a_key_out_of_verifier_time_is_refused_before_the_model_runs_and_keeps_its_lease(tmp_path):
    # A budget far below one verification: the first group overdraws it, the next waits for the refill.
    base = make_coordinator_dir(tmp_path, {"intake.verify": True, "leases.probation_max_open": 2,
                                           "intake.verify_seconds_per_minute_per_identity": 1e-6})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            engine = TorchEngine(coord.policy_store.version_dir(0), 0, threads=1)

            async def honest(lease: pb.Lease) -> pb.SubmitGroupRequest:
                req = GenerationRequest(list(lease.prompt_ids), list(lease.seeds), lease.temperature,
                                        lease.max_new_tokens, list(lease.stop_token_ids))
                results = (await asyncio.to_thread(engine.generate, [req]))[0]
                return pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=[
                    pb.Sample(token_ids=r.token_ids, logprobs=np.asarray(r.logprobs, "<f4").tobytes(), proof=r.proof,
                              finish_reason=r.finish_reason) for r in results])

            first, second = (await stub.lease_work(pb.LeaseRequest(max_leases=2))).leases
            assert (await stub.submit_group(await honest(first))).accepted
            calls_before = sum(c[-1] for c in coord.service.metrics.verify_latency.counts.values())
            await expect_refusal(stub.submit_group(await honest(second)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 "rate_limited")
            verified_after = sum(c[-1] for c in coord.service.metrics.verify_latency.counts.values())
            more = await stub.lease_work(pb.LeaseRequest())
            lease_state = coord.db.run_sync(lambda c: c.execute(
                "SELECT state FROM leases WHERE lease_id = ?", (second.lease_id,)).fetchone()[0])
            return calls_before, verified_after, more, lease_state, coord.db.run_sync(st.status_summary)

    calls_before, verified_after, more, lease_state, summary = asyncio.run(scenario())
    assert verified_after == calls_before  # refused before the trusted model ran
    assert lease_state == "open"  # not judged: the node may submit it again once it has time
    assert not more.leases and more.wait_reason == "verify_budget"
    assert summary["rejections_by_reason"] == {"rate_limited": 1} and summary["accepted_groups"] == 1
