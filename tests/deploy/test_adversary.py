"""Every adversarial node kind, run for real against a real coordinator over TLS: each attack is refused
with its specific reason, counted, and nothing of it is stored (claimed-rewards and replay build on an
honest group, which is accepted once, with the coordinator's own rewards)."""

from __future__ import annotations

import asyncio

import pytest
from support import channel_to, make_coordinator_dir, running_coordinator

from veriroll.coordinator import store as st
from veriroll.deploy.adversary import KINDS, claimed_rewards_field, make_adversary
from veriroll.node.agent import NodeAgent
from veriroll.node.config import NodeConfig
from veriroll.node.engines.torch import TorchEngine
from veriroll.node.hardware import Hardware
from veriroll.node.weights import LocalVersions
from veriroll.protos.identity import PrivateKey
from veriroll.protos.v1 import coordinator_pb2 as pb

# The attacks take a lease after one they left open: room for that, on probation too.
VERIFY = {"intake.verify": True, "leases.max_open_per_node": 8, "leases.probation_max_open": 8}


def verifier_present() -> bool:
    try:
        import veriroll.coordinator.verifier  # noqa: F401 - imported only to probe the install
    except ImportError:
        return False
    return True


needs_verifier = pytest.mark.skipif(not verifier_present(), reason="coordinator/verifier.py is not in this build yet")


def make_agent(coord, kind: str) -> NodeAgent:
    def engine_factory(path, version):
        return TorchEngine(path, version, threads=1)

    hw = Hardware(cpu="test", cpu_count=1, ram_bytes=0, disk_free_bytes=0, os="test")
    return NodeAgent(NodeConfig(call_timeout_s=30, heartbeat_s=0.5), key=PrivateKey.generate(), channel=channel_to(coord),
                     engine_factory=engine_factory, versions=LocalVersions(coord.base_dir / "checkpoints" / "versions"),
                     hardware=hw, engine_kind="torch", device="cpu", adversary=make_adversary(kind))


async def serve_one(agent: NodeAgent, **lease_request) -> pb.Lease:
    lease = (await agent.stub.lease_work(pb.LeaseRequest(max_leases=1, **lease_request))).leases[0]
    await agent._serve(lease)
    return lease


async def attack(tmp_path, kind: str, overrides: dict | None = None, *, leases: int = 1, until_tried: str = "",
                 prepare=None):
    """Run ``kind`` against a fresh coordinator for ``leases`` leases (or until it tried ``until_tried``)."""
    base = make_coordinator_dir(tmp_path, overrides)
    if prepare is not None:
        prepare(base)
    async with running_coordinator(base) as coord:
        agent = make_agent(coord, kind)
        try:
            await agent.register()
            for _ in range(leases):
                await serve_one(agent)
            for _ in range(8):
                if not until_tried or agent.status.adversary.get("tried", {}).get(until_tried):
                    break
                await serve_one(agent)
            summary = coord.db.run_sync(st.status_summary)
            nodes = {n["node_id"]: n for n in coord.db.run_sync(st.list_nodes)}
            samples = coord.db.run_sync(lambda c: c.execute("SELECT COUNT(*) FROM samples").fetchone()[0])
            return agent, summary, nodes, samples, coord
        finally:
            if agent.engine is not None:
                agent.engine.close()
            await agent.stub.channel.close()


def assert_refused(agent, summary, samples, reason: str, label: str = "group"):
    report = agent.status.adversary
    assert report["kind"] in KINDS
    assert report["by_label"][label] == {reason: 1}, report
    assert report["breaches"] == 0
    assert agent.status.rejected[reason] == 1 and agent.status.accepted_groups == 0
    assert summary["accepted_groups"] == 0 and samples == 0
    assert summary["rejections_by_reason"].get(reason) == 1, summary


def test_every_kind_is_known_and_unknown_kinds_are_refused():
    assert len(KINDS) == 13
    for kind in KINDS:
        assert make_adversary(kind).kind == kind
    with pytest.raises(ValueError, match="unknown adversary"):
        make_adversary("polite")


def test_claimed_rewards_field_is_an_unknown_field_to_the_contract():
    req = pb.SubmitGroupRequest(lease_id="x", samples=[pb.Sample(token_ids=[1])])
    parsed = pb.SubmitGroupRequest.FromString(req.SerializeToString() + claimed_rewards_field(40))
    assert parsed.lease_id == "x" and len(parsed.samples) == 1  # parses; the claim is simply not read


# -- verification: TOPLOC, sampling, log-probs --------------------------------------------------------


@needs_verifier
def test_wrong_model_is_refused_by_toploc(tmp_path):
    agent, summary, _, samples, _ = asyncio.run(attack(tmp_path, "wrong-model", VERIFY))
    assert_refused(agent, summary, samples, "toploc_failed")


def _add_version_one_step_later(base):
    """Version 1: version 0 after one AdamW step at the trainer's default rate (1e-4); policy at 1."""
    import torch
    import transformers

    from veriroll.coordinator.model_factory import save_checkpoint

    v0 = base / "checkpoints" / "versions" / "v000000"
    model = transformers.AutoModelForCausalLM.from_pretrained(v0)
    tok = transformers.AutoTokenizer.from_pretrained(v0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    save_checkpoint(model, tok, base / "checkpoints" / "versions" / "v000001")
    db = st.Database(base / "state.db")
    db.run_sync(lambda c: st.kv_set(c, "policy_version", 1))
    db.close()


@needs_verifier
def test_stale_version_claimed_as_current_is_refused_by_toploc(tmp_path):
    async def scenario():
        base = make_coordinator_dir(tmp_path, VERIFY)
        _add_version_one_step_later(base)
        async with running_coordinator(base) as coord:
            agent = make_agent(coord, "stale-version")
            try:
                await agent.register()
                first = await serve_one(agent, loaded_version=0, available_versions=[0])
                assert first.policy_version == 0 and agent.status.adversary["tried"] == {"no_effect": 1}
                second = await serve_one(agent, loaded_version=0, available_versions=[0, 1])
                assert second.policy_version == 1 and agent.engine.version == 1
                summary = coord.db.run_sync(st.status_summary)
                samples = coord.db.run_sync(lambda c: c.execute("SELECT COUNT(*) FROM samples").fetchone()[0])
                return agent, summary, samples
            finally:
                agent.engine.close()
                await agent.stub.channel.close()

    agent, summary, samples = asyncio.run(scenario())
    assert_refused(agent, summary, samples, "toploc_failed")


@needs_verifier
def test_low_precision_claimed_as_float32_is_refused(tmp_path):
    agent, summary, _, samples, _ = asyncio.run(attack(tmp_path, "low-precision", VERIFY))
    assert_refused(agent, summary, samples, "toploc_failed")


@needs_verifier
def test_fabricated_tokens_with_honest_proofs_are_refused_by_the_sampling_check(tmp_path):
    agent, summary, _, samples, _ = asyncio.run(attack(tmp_path, "fabricated-tokens", VERIFY))
    assert_refused(agent, summary, samples, "sampling_failed")


@needs_verifier
def test_cherry_picked_resamples_are_refused_by_the_sampling_check(tmp_path):
    agent, summary, _, samples, _ = asyncio.run(attack(tmp_path, "cherry-pick", VERIFY, leases=0, until_tried="group"))
    assert_refused(agent, summary, samples, "sampling_failed")


@needs_verifier
def test_half_temperature_draws_are_refused_by_the_sampling_check(tmp_path):
    # At half the temperature a near-uniform tiny model sometimes draws the honest tokens: those leases
    # lapse (no_effect) and the next lease is tried.
    agent, summary, _, samples, _ = asyncio.run(
        attack(tmp_path, "wrong-temperature", VERIFY, leases=0, until_tried="group"))
    assert_refused(agent, summary, samples, "sampling_failed")


@needs_verifier
def test_forged_logprobs_are_refused_by_the_logprob_check(tmp_path):
    agent, summary, _, samples, _ = asyncio.run(attack(tmp_path, "forged-logprobs", VERIFY))
    assert_refused(agent, summary, samples, "logprob_mismatch")


# -- claims the coordinator never reads ---------------------------------------------------------------


def test_claimed_rewards_are_ignored_and_recomputed(tmp_path):
    from veriroll.coordinator.intake import Submission, SubmittedSample

    overrides = VERIFY if verifier_present() else None
    agent, summary, _, samples, coord = asyncio.run(attack(tmp_path, "claimed-rewards", overrides))
    report = agent.status.adversary
    assert report["by_label"]["group_with_claimed_rewards"] == {"accepted": 1} and report["breaches"] == 0
    assert summary["accepted_groups"] == 1 and samples == 4

    db = st.Database(coord.base_dir / "state.db")
    try:
        prompt = db.run_sync(lambda c: dict(c.execute("SELECT * FROM prompts JOIN groups USING(prompt_id)").fetchone()))
        rows = db.run_sync(lambda c: c.execute("SELECT token_ids, reward FROM samples ORDER BY idx").fetchall())
    finally:
        db.close()
    sub = Submission("", 0, [SubmittedSample(st.unpack_i32(r["token_ids"]), None, b"", "") for r in rows])
    recomputed = coord.service._score(prompt, sub)
    stored = [r["reward"] for r in rows]
    assert stored == pytest.approx(recomputed)
    assert recomputed != [1.0] * 4  # (a random-init model does not solve 4 of 4): the claim was not taken


def test_replayed_submission_is_refused_and_a_resigned_one_answered_once(tmp_path):
    agent, summary, nodes, samples, _ = asyncio.run(attack(tmp_path, "replay"))
    report = agent.status.adversary
    assert report["by_label"] == {"original": {"accepted": 1}, "replayed_bytes": {"replayed_nonce": 1},
                                  "re_signed": {"same_group": 1}}
    assert report["breaches"] == 0
    assert summary["accepted_groups"] == 1 and samples == 4
    assert summary["rejections_by_reason"] == {"replayed_nonce": 1}
    assert nodes[agent.key.node_id]["accepted_groups"] == 1


def test_stolen_lease_is_refused(tmp_path):
    agent, summary, nodes, samples, _ = asyncio.run(attack(tmp_path, "stolen-lease"))
    assert_refused(agent, summary, samples, "lease_not_yours", label="others_lease")
    assert len(nodes) == 2 and nodes[agent.key.node_id]["strikes"] == 1


def test_partial_group_is_refused(tmp_path):
    agent, summary, _, samples, _ = asyncio.run(attack(tmp_path, "partial-group"))
    assert_refused(agent, summary, samples, "wrong_group_size")


def test_garbage_body_is_refused_as_malformed(tmp_path):
    agent, summary, _, samples, _ = asyncio.run(attack(tmp_path, "garbage"))
    assert_refused(agent, summary, samples, "malformed", label="garbage")


def test_flood_is_rate_limited(tmp_path):
    agent, summary, _, samples, _ = asyncio.run(attack(tmp_path, "flood", {"server.key_burst": 20.0}))
    answers = agent.status.adversary["by_label"]["burst_request"]
    assert set(answers) == {"ok", "rate_limited"} and sum(answers.values()) == 150
    assert answers["ok"] <= 40  # the burst allowance, plus what refills while the burst is served
    assert summary["rejections_by_reason"]["rate_limited"] == answers["rate_limited"]
    assert summary["accepted_groups"] == 0 and samples == 0


def test_adversary_node_run_loop_is_banned_after_repeated_strikes(tmp_path):
    async def scenario():
        base = make_coordinator_dir(tmp_path, {"intake.max_strikes": 2})
        async with running_coordinator(base) as coord:
            agent = make_agent(coord, "partial-group")
            try:
                code = await asyncio.wait_for(agent.run(), timeout=120)
            finally:
                await agent.stub.channel.close()
            return code, agent, coord.db.run_sync(st.status_summary)

    code, agent, summary = asyncio.run(scenario())
    assert code == 3 and agent.status.adversary["by_label"]["group"] == {"wrong_group_size": 2}
    assert agent.status.as_dict()["adversary"]["breaches"] == 0
    assert summary["banned_nodes"] == 1 and summary["accepted_groups"] == 0

def test_flood_of_abandoned_calls_leaves_the_coordinator_writing(tmp_path):
    async def scenario():
        base = make_coordinator_dir(tmp_path, {"server.key_burst": 5.0})
        async with running_coordinator(base) as coord:
            agent = make_agent(coord, "flood")
            agent.adversary.abandon_fraction = 1.0
            try:
                await agent.register()
                lease = (await agent.stub.lease_work(pb.LeaseRequest(max_leases=1))).leases[0]
                for _ in range(3):
                    await agent.adversary.submit(agent, lease, None, [])
                # The store's writer must still answer (it hangs forever once its thread died).
                return await asyncio.wait_for(coord.db.run(lambda c: c.execute("SELECT 1").fetchone()[0]), 5)
            finally:
                await agent.stub.channel.close()

    assert asyncio.run(scenario()) == 1
