"""The coordinator's verification stages on honest traffic: real engine groups pass, in float32 and
bfloat16, whatever the batch and padding on either side; the trusted log-probs come back; the weight
cache follows the staleness window; bad input is a rejection, never an exception. One test runs the
whole path over gRPC."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading

import numpy as np
import pytest
import torch
from support import build_tiny_checkpoint, make_coordinator_dir, node_client, running_coordinator

from veriroll.coordinator import store as st
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.intake import LeaseRecord, Submission, SubmittedSample
from veriroll.coordinator.policy import PolicyStore
from veriroll.coordinator.verifier import TOLERANCES_FP32, Stage, TrustedVerifier, prefill_group
from veriroll.node.engines.base import GenerationRequest
from veriroll.node.engines.torch import TorchEngine
from veriroll.protos.reasons import Reason
from veriroll.protos.service import CallError
from veriroll.protos.v1 import coordinator_pb2 as pb

EOS = 2  # the char tokenizer's <eos>
VOCAB = 16  # 4 specials + "0123456789+="


def lease_for(req: GenerationRequest, version: int = 0, lease_id: str = "L") -> LeaseRecord:
    return LeaseRecord(lease_id=lease_id, node_id="n", prompt_id=1, group_size=req.n, temperature=req.temperature,
                       max_new_tokens=req.max_new_tokens, seeds=tuple(req.seeds), stop_token_ids=tuple(req.stop_token_ids),
                       policy_version=version, issued_ms=0, deadline_ms=1 << 60, state="open")


def submission(results, version: int = 0, lease_id: str = "L") -> Submission:
    return Submission(lease_id, version, [
        SubmittedSample(np.asarray(r.token_ids, dtype=np.int64), np.asarray(r.logprobs, dtype=np.float32), r.proof,
                        r.finish_reason) for r in results])


def config(**kw) -> CoordinatorConfig:
    cfg = CoordinatorConfig()
    cfg.intake.s_max = kw.pop("s_max", 1)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> PolicyStore:
    """Versions 0..3 of a tiny random-init Llama (other seeds stand in for later versions)."""
    root = tmp_path_factory.mktemp("policy")
    ps = PolicyStore(root)
    for v in range(4):
        build_tiny_checkpoint(ps.version_dir(v), seed=v)
    return ps


def request(prompt_len: int, seed0: int, *, n: int = 4, max_new: int = 40, stop=(EOS,), temperature: float = 1.0):
    prompt = [1] + [4 + (seed0 * 7 + i * 5) % 12 for i in range(prompt_len - 1)]
    return GenerationRequest(prompt, seeds=[seed0 * 1000 + 2**63 * (i % 2) + i for i in range(n)],
                             temperature=temperature, max_new_tokens=max_new, stop_token_ids=list(stop))


def honest_groups(engine: TorchEngine):
    """Groups of different prompt lengths generated in one engine batch (left padding on the node),
    each verified on its own (right padding at the verifier for samples that stopped early)."""
    reqs = [request(3, 1), request(9, 2, temperature=0.7), request(5, 3, n=6, temperature=1.3),
            request(12, 4, max_new=33, stop=())]
    return list(zip(reqs, engine.generate(reqs), strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_honest_engine_groups_pass_with_other_batches_and_padding(store, dtype):
    verifier = TrustedVerifier(store, config(model_dtype=dtype))
    engine = TorchEngine(store.version_dir(0), 0, dtype=dtype)
    groups = honest_groups(engine)
    # the same work, batched another way on the node: alone, with another max_batch_tokens
    small = TorchEngine(store.version_dir(0), 0, dtype=dtype, max_batch_tokens=80)
    groups += [(req, small.generate([req])[0]) for req, _ in groups[:2]]
    lengths = set()
    for req, results in groups:
        lengths |= {len(r.token_ids) for r in results}
        out = verifier.verify_group(lease_for(req), req.prompt_ids, submission(results))
        assert out.rejection is None, out.rejection
        assert out.seconds > 0 and len(out.trusted_logprobs) == req.n
        for r, lp in zip(results, out.trusted_logprobs, strict=True):
            assert lp.dtype == np.float32 and lp.shape == (len(r.token_ids),)
            gap = np.abs(lp - np.asarray(r.logprobs)).max()
            assert gap < (1e-5 if dtype == "float32" else 0.05)
    assert len(lengths) > 2  # samples of several lengths: the verifier's padding was exercised


def test_trusted_prefill_matches_the_engines_hidden_states(store):
    engine = TorchEngine(store.version_dir(0), 0)
    req = request(6, 9, max_new=20)
    results = engine.generate([req], keep_hidden=True)[0]
    trusted = prefill_group(engine.model, req.prompt_ids, [r.token_ids for r in results])
    for r, hidden, logits in zip(results, trusted.hidden, trusted.logits, strict=True):
        assert hidden.shape == r.hidden.shape and logits.shape == (len(r.token_ids), VOCAB)
        assert float((hidden - r.hidden).abs().max()) < 1e-4


def test_weights_are_loaded_lazily_and_dropped_outside_the_window(store):
    verifier = TrustedVerifier(store, config(s_max=1))
    assert verifier.loaded_versions() == []
    engines = {v: TorchEngine(store.version_dir(v), v) for v in (0, 1, 2, 3)}
    req = request(4, 5, max_new=12)

    def check(version: int):
        results = engines[version].generate([req])[0]
        return verifier.verify_group(lease_for(req, version), req.prompt_ids, submission(results, version))

    assert check(0).rejection is None and verifier.loaded_versions() == [0]
    assert check(1).rejection is None and verifier.loaded_versions() == [0, 1]
    # a lease of version 2 moves the window (s_max 1) to 1..2: version 0's weights go
    assert check(2).rejection is None and verifier.loaded_versions() == [1, 2]
    old = check(0).rejection
    assert old is not None and old.reason is Reason.STALE_VERSION and not old.reason.strike
    assert check(3).rejection is None and verifier.loaded_versions() == [2, 3]
    # a version whose directory is gone (pruned) is stale, not the node's fault
    gone = verifier.verify_group(lease_for(req, 9), req.prompt_ids, submission(engines[3].generate([req])[0], 9))
    assert gone.rejection.reason is Reason.STALE_VERSION and not gone.rejection.reason.strike


def test_concurrent_verification_from_two_threads(store):
    verifier = TrustedVerifier(store, config(s_max=3))
    engine = TorchEngine(store.version_dir(3), 3)
    work = [(req, engine.generate([req])[0]) for req in (request(5, 11, max_new=24), request(8, 12, max_new=24))]
    outcomes: list = []

    def run(req, results):
        for _ in range(2):
            outcomes.append(verifier.verify_group(lease_for(req, 3), req.prompt_ids, submission(results, 3)))

    threads = [threading.Thread(target=run, args=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outcomes) == 4 and all(o.rejection is None for o in outcomes)
    assert verifier.loaded_versions() == [3]


def test_bad_input_is_a_rejection_never_an_exception(store):
    verifier = TrustedVerifier(store, config(s_max=3))
    engine = TorchEngine(store.version_dir(3), 3)
    req = request(5, 13, max_new=10, stop=())
    results = engine.generate([req])[0]
    lease = lease_for(req, 3)

    def verdict(sub, *, lease=lease, prompt=req.prompt_ids):
        out = verifier.verify_group(lease, prompt, sub)
        assert out.rejection is not None and out.trusted_logprobs is None
        return out.rejection.reason

    def tampered(**change):
        sub = submission(results, 3)
        for k, v in change.items():
            setattr(sub.samples[0], k, v)
        return sub

    assert verdict(Submission("L", 3, submission(results, 3).samples[:3])) is Reason.WRONG_GROUP_SIZE
    assert verdict(submission(results, 2)) is Reason.VERSION_MISMATCH
    assert verdict(tampered(token_ids=np.array([], dtype=np.int64), logprobs=np.array([], np.float32))) is Reason.TOO_LONG
    assert verdict(tampered(token_ids=np.full(10, VOCAB))) is Reason.TOKEN_OUT_OF_VOCAB
    assert verdict(tampered(token_ids=np.full(10, -1))) is Reason.TOKEN_OUT_OF_VOCAB
    assert verdict(tampered(logprobs=np.zeros(3, np.float32))) is Reason.BAD_LOGPROBS
    assert verdict(tampered(logprobs=np.full(10, np.nan, np.float32))) is Reason.BAD_LOGPROBS
    for junk in (b"", b"TL", b"\x00" * 300, results[0].proof[:-2], results[0].proof + b"xx", None):
        assert verdict(tampered(proof=junk)) is Reason.TOPLOC_FAILED
    assert verdict(submission(results, 3), prompt=[]) is Reason.INTERNAL
    assert verdict(submission(results, 3), prompt=[VOCAB + 5]) is Reason.INTERNAL
    assert verdict(submission(results, 3), lease=dataclasses.replace(lease, seeds=(1,))) is Reason.WRONG_GROUP_SIZE
    assert verdict(submission(results, 3), lease=None) is Reason.INTERNAL
    # and an honest submission still passes afterwards
    assert verifier.verify_group(lease, req.prompt_ids, submission(results, 3)).rejection is None


def test_float32_is_tighter_than_the_configured_logprob_tolerance_and_half_precision_looser(store):
    configured = CoordinatorConfig().intake.logprob_tolerance
    verifier = TrustedVerifier(store, config(s_max=3))
    assert verifier.tolerances.logprob == TOLERANCES_FP32.logprob < configured
    bf16 = TrustedVerifier(store, config(s_max=3, model_dtype="bfloat16")).tolerances
    logits = torch.tensor([[4.0, -1.0, 0.5], [0.5, 0.25, -0.5]])
    # the configured allowance plus bf16's resolution at the row's largest logit (8 ulps), over T
    assert torch.allclose(torch.as_tensor(bf16.logprob_for(logits, 0.5)), configured + torch.tensor([4.0, 0.5]) / 16 / 0.5)
    assert torch.allclose(torch.as_tensor(bf16.margin_for(logits)), bf16.margin_abs + torch.tensor([4.0, 0.5]) / 16)


def test_over_grpc_honest_group_is_stored_with_trusted_logprobs_and_a_forged_one_refused(tmp_path):
    base = make_coordinator_dir(tmp_path, {"intake.verify": True, "leases.probation_max_open": 2})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            engine = TorchEngine(coord.policy_store.version_dir(0), 0)

            async def generate(lease: pb.Lease):
                req = GenerationRequest(list(lease.prompt_ids), list(lease.seeds), lease.temperature,
                                        lease.max_new_tokens, list(lease.stop_token_ids))
                results = (await asyncio.to_thread(engine.generate, [req]))[0]
                return results, pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=[
                    pb.Sample(token_ids=r.token_ids, logprobs=np.asarray(r.logprobs, "<f4").tobytes(), proof=r.proof,
                              finish_reason=r.finish_reason) for r in results])

            first, second = (await stub.lease_work(pb.LeaseRequest(max_leases=2))).leases
            results, honest = await generate(first)
            ok = await stub.submit_group(honest)
            assert ok.accepted and ok.credited_tokens == sum(len(r.token_ids) for r in results)

            _, attacked = await generate(second)
            attacked.samples[0].proof, attacked.samples[1].proof = attacked.samples[1].proof, attacked.samples[0].proof
            with pytest.raises(CallError) as info:
                await stub.submit_group(attacked)
            # the quick stage checks one of the four at random: either swapped sample is named
            assert info.value.reason == "toploc_failed" and ("sample 0:" in str(info.value) or "sample 1:" in str(info.value))

            def read(conn):
                rows = conn.execute("SELECT s.logprobs, s.trusted_logprobs FROM samples s JOIN groups g USING(group_id) "
                                    "WHERE g.lease_id = ? ORDER BY s.idx", (first.lease_id,)).fetchall()
                node = conn.execute("SELECT strikes, standing FROM nodes").fetchone()
                return rows, dict(node), st.rejections_by_reason(conn), st.status_summary(conn)

            return await coord.db.run_read(read)

    rows, node, rejections, summary = asyncio.run(scenario())
    assert len(rows) == 4 and all(r["trusted_logprobs"] is not None for r in rows)
    for r in rows:
        node_lp, trusted = np.frombuffer(r["logprobs"], "<f4"), np.frombuffer(r["trusted_logprobs"], "<f4")
        assert trusted.shape == node_lp.shape and np.abs(trusted - node_lp).max() < 1e-5
    assert rejections == {"toploc_failed": 1}
    assert node == {"strikes": 1, "standing": "probation"}
    assert summary["accepted_groups"] == 1


def test_hidden_states_are_read_at_the_lm_head_input(store):
    """The verifier's capture equals the base model's final-norm output (what the engine commits)."""
    engine = TorchEngine(store.version_dir(0), 0)
    prompt, completion = [1, 5, 6, 7], [8, 9, 10, 2]
    trusted = prefill_group(engine.model, prompt, [completion])
    with torch.no_grad():
        base = engine.model.get_decoder()(input_ids=torch.tensor([prompt + completion])).last_hidden_state[0]
    assert torch.allclose(trusted.hidden[0], base[len(prompt) - 1 : -1], atol=1e-6)


def test_a_bf16_node_is_judged_with_bf16_slack_under_a_float32_verifier_and_caught_when_it_claims_float32(store):
    """The node declares its precision: a bfloat16 engine's groups pass an fp32 verifier when declared as
    bfloat16 (the coarser precision's tolerances), and the same groups claimed as float32 are refused."""
    verifier = TrustedVerifier(store, config(model_dtype="float32"))
    engine = TorchEngine(store.version_dir(0), 0, dtype="bfloat16")
    caught = 0
    for req, results in honest_groups(engine):
        sub = submission(results)
        declared = dataclasses.replace(sub, compute_dtype="bfloat16")
        assert verifier.verify_group(lease_for(req), req.prompt_ids, declared).rejection is None
        claimed = verifier.verify_group(lease_for(req), req.prompt_ids, dataclasses.replace(sub, compute_dtype="float32"))
        caught += claimed.rejection is not None
    assert caught == 4


def test_intake_accepts_only_the_configured_precisions():
    from veriroll.coordinator.intake import check_dtype

    sub = Submission("L", 0, [], "bfloat16")
    assert check_dtype(sub, ["float32", "bfloat16"]) is None
    refused = check_dtype(sub, ["float32"])
    assert refused.reason == Reason.DTYPE_NOT_ACCEPTED and "bfloat16" in refused.detail
    odd = check_dtype(dataclasses.replace(sub, compute_dtype="int4" * 100), ["float32"])
    assert odd.reason == Reason.DTYPE_NOT_ACCEPTED and len(odd.detail) < 120  # a hostile string is cut
    assert Submission.from_proto(pb.SubmitGroupRequest(lease_id="L")).compute_dtype == "float32"  # old nodes


# --------------------------------------------------------------------------------------------------
# Cheap before expensive: checks without a forward pass, then the quick stage, then the full prefill.

HIDDEN = 64  # build_tiny_checkpoint's hidden size


def garbage_proof(rng: np.random.Generator, t: int, hidden: int = HIDDEN) -> bytes:
    """A proof whose layout is right for ``t`` positions (header, length, moduli and coefficients in
    range) and whose polynomials are random: what an attacker sends without running any model."""
    from veriroll.toploc.proof import _HEADER, DTYPE_BF16, FORMAT_VERSION, MAGIC, P

    chunks = [min(32, t - start) for start in range(0, t, 32)]
    body = b"".join(np.array([rng.integers(128, P + 1), *rng.integers(0, P, 128)], dtype=">u2").tobytes()
                    for _ in chunks)
    return _HEADER.pack(MAGIC, FORMAT_VERSION, DTYPE_BF16, 32, 128, t, hidden) + body


def garbage_group(req: GenerationRequest, seed: int = 0) -> Submission:
    """A whole group that passes every check without a forward pass: tokens, log-probs and proofs random."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(req.n):
        t = req.max_new_tokens
        samples.append(SubmittedSample(rng.integers(4, VOCAB, t), -rng.random(t).astype(np.float32),
                                       garbage_proof(rng, t), "length"))
    return Submission("L", 3, samples)


class ForwardCounter:
    """Counts the forward passes of a model (a pre-hook on the whole model)."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.calls += 1


@pytest.fixture
def v3(store):
    """A verifier of version 3 whose forward passes are counted, an engine of it, and a long request."""
    verifier = TrustedVerifier(store, config(s_max=3), rng=random.Random(0))
    counter = ForwardCounter(verifier.model_for(3))
    return verifier, counter, TorchEngine(store.version_dir(3), 3), request(6, 21, max_new=70, stop=())


def test_garbage_is_refused_by_the_quick_stage_after_one_short_prefill(v3):
    verifier, counter, _, req = v3
    out = verifier.verify_group(lease_for(req, 3), req.prompt_ids, garbage_group(req))
    assert out.rejection.reason is Reason.TOPLOC_FAILED and out.rejection.reason.strike
    assert out.stage is Stage.QUICK and "quick check of the first 32 tokens" in out.rejection.detail
    assert counter.calls == 2  # the prompt, then 31 tokens of one sample: never the group's 4 x 70
    assert 0 < out.quick_seconds <= out.seconds and out.trusted_logprobs is None


def test_malformed_proofs_and_bad_finish_are_refused_without_any_forward_pass(v3):
    verifier, counter, engine, req = v3
    results = engine.generate([req])[0]
    lease = lease_for(req, 3)
    cases = {
        Reason.TOPLOC_FAILED: [("proof", results[0].proof[:-2]),  # short by one coefficient
                               ("proof", garbage_proof(np.random.default_rng(0), 70, hidden=32)),  # another model
                               ("proof", garbage_proof(np.random.default_rng(0), 64))],  # another length
        Reason.BAD_FINISH: [("finish_reason", "stop")],  # it does not end on a stop token
        Reason.BAD_LOGPROBS: [("logprobs", np.full(70, 0.5, np.float32))],  # a probability above 1
    }
    for reason, changes in cases.items():
        for field, value in changes:
            sub = submission(results, 3)
            setattr(sub.samples[2], field, value)
            out = verifier.verify_group(lease, req.prompt_ids, sub)
            assert out.rejection.reason is reason and out.stage is Stage.CHECKS, (field, out.rejection)
            assert "sample 2" in out.rejection.detail
    assert counter.calls == 0
    assert verifier.verify_group(lease, req.prompt_ids, submission(results, 3)).rejection is None


def test_a_proof_honest_in_its_first_chunk_and_forged_later_passes_the_quick_stage_and_is_caught_in_full(v3):
    from veriroll.toploc import commit_many

    verifier, _, engine, req = v3
    results = engine.generate([req])[0]
    lease = lease_for(req, 3)
    # chunk 1 (tokens 32..63) of every sample replaced by the same chunk of another sample's proof
    record = 2 + 2 * 128
    forged = submission(results, 3)
    for i, s in enumerate(forged.samples):
        other = results[(i + 1) % req.n].proof
        s.proof = s.proof[: 16 + record] + other[16 + record : 16 + 2 * record] + s.proof[16 + 2 * record :]
    out = verifier.verify_group(lease, req.prompt_ids, forged)
    assert out.rejection.reason is Reason.TOPLOC_FAILED and "chunk 1" in out.rejection.detail
    assert out.stage is Stage.FULL and out.quick_seconds > 0
    # tokens from 32 on chosen by the node, hidden states recomputed honestly for them: sampling catches it
    fabricated = submission(results, 3)
    trusted = prefill_group(verifier.model_for(3), req.prompt_ids,
                            [np.concatenate([r.token_ids[:32], np.full(38, 7)]).tolist() for r in results])
    proofs = commit_many(trusted.hidden)
    for s, proof in zip(fabricated.samples, proofs, strict=True):
        s.token_ids, s.proof = np.concatenate([s.token_ids[:32], np.full(38, 7)]), proof
    out = verifier.verify_group(lease, req.prompt_ids, fabricated)
    assert out.rejection.reason is Reason.SAMPLING_FAILED and out.stage is Stage.FULL


def test_one_garbage_sample_is_refused_by_the_quick_stage_when_drawn_and_by_the_full_one_otherwise(store):
    engine = TorchEngine(store.version_dir(3), 3)
    req = request(6, 22, max_new=40, stop=())
    results = engine.generate([req])[0]
    sub = submission(results, 3)
    sub.samples[2] = garbage_group(req).samples[2]
    stages = set()
    for seed in range(8):
        verifier = TrustedVerifier(store, config(s_max=3), rng=random.Random(seed))
        out = verifier.verify_group(lease_for(req, 3), req.prompt_ids, sub)
        assert out.rejection.reason is Reason.TOPLOC_FAILED and out.rejection.detail.count("sample 2") == 1
        stages.add(out.stage)
    assert stages == {Stage.QUICK, Stage.FULL}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_honest_groups_pass_the_quick_stage_on_every_sample_with_the_same_trusted_logprobs(store, dtype):
    """Zero false rejections with every sample's first chunk quick-checked, and the full stage's
    numbers are bit for bit those without a quick stage (they share the prompt's forward)."""
    quick = TrustedVerifier(store, config(model_dtype=dtype), rng=random.Random(1))
    quick.cfg.intake.quick_check_samples = 16
    plain = TrustedVerifier(store, config(model_dtype=dtype))
    plain.cfg.intake.quick_check_samples = 0
    engine = TorchEngine(store.version_dir(0), 0, dtype=dtype)
    groups = honest_groups(engine) + [(r, engine.generate([r])[0]) for r in (request(7, 23, max_new=70, stop=()),)]
    ran_quick = 0
    for req, results in groups:
        with_quick = quick.verify_group(lease_for(req), req.prompt_ids, submission(results))
        without = plain.verify_group(lease_for(req), req.prompt_ids, submission(results))
        assert with_quick.rejection is None and without.rejection is None, with_quick.rejection
        assert with_quick.stage is Stage.FULL and without.quick_seconds == 0
        ran_quick += with_quick.quick_seconds > 0
        for a, b in zip(with_quick.trusted_logprobs, without.trusted_logprobs, strict=True):
            assert np.array_equal(a, b)
    assert ran_quick == 1  # the 70-token group; on shorter ones every first chunk is most of the group


def test_the_quick_stage_is_skipped_where_it_would_cover_most_of_the_group(store):
    verifier = TrustedVerifier(store, config(s_max=3), rng=random.Random(0))
    counter = ForwardCounter(verifier.model_for(3))
    req = request(5, 24, n=1, max_new=60, stop=())  # one sample: its first chunk (31 positions) is over half of it
    out = verifier.verify_group(lease_for(req, 3), req.prompt_ids, garbage_group(req))
    assert out.rejection.reason is Reason.TOPLOC_FAILED and out.stage is Stage.FULL and out.quick_seconds == 0
    assert counter.calls == 2  # the prompt, then the whole sample


def test_the_first_chunks_of_a_proof_are_the_proof_of_those_positions():
    """What makes the quick stage's TOPLOC check the full one's on its first chunk."""
    from veriroll.toploc import check_layout, commit, truncate

    hidden = torch.randn(70, HIDDEN)
    proof = commit(hidden)
    assert truncate(proof, 32) == commit(hidden[:32]) and truncate(proof, 64) == commit(hidden[:64])
    assert truncate(proof, 70) == proof
    for bad in (0, 33, 71):
        with pytest.raises(ValueError):
            truncate(proof, bad)
    assert check_layout(proof, 70, HIDDEN).ok
    assert check_layout(proof, 69, HIDDEN).reason == "length_mismatch"
    assert check_layout(proof, 70, 32).reason == "shape_mismatch"
    assert check_layout(proof + b"\x00", 70, HIDDEN).reason == "malformed_proof"
    assert check_layout(None, 70, HIDDEN).reason == "malformed_proof"
