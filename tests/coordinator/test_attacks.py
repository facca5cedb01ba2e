"""Every attack of the trust model, at the level of the verifier, on real tiny Llamas: each cheating
group is refused, with the reason of the stage that is meant to catch it.

The policy is a tiny Llama warm-started on single-digit addition (sharp, realistic distributions);
version 1 is version 0 after one GRPO step at lr 3e-4 on its own sampled arithmetic groups, so
"the previous policy claimed as current" is one real optimizer step away. Completions run 16 tokens
without stop tokens so that every sample spans several decode steps.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from veriroll.coordinator.advantages import group_advantages
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.environments import load_environment
from veriroll.coordinator.intake import LeaseRecord, Submission, SubmittedSample
from veriroll.coordinator.loss import async_ppo_loss
from veriroll.coordinator.model_factory import (
    build_char_tokenizer,
    build_tiny_model,
    save_checkpoint,
    warm_start,
)
from veriroll.coordinator.policy import PolicyStore
from veriroll.coordinator.verifier import TrustedVerifier, prefill_group
from veriroll.node.engines.base import GenerationRequest
from veriroll.node.engines.torch import TorchEngine
from veriroll.protos.reasons import Reason
from veriroll.toploc import commit_many
from veriroll.toploc.sampling import token_logprobs

GROUPS = 3  # attacked groups per attack (each must be refused)
N, LENGTH, TEMPERATURE = 4, 16, 1.0
RL_LR = 3e-4  # the RL learning rate of the tiny-arith preset


@dataclass
class Sample:
    """What a node submits for one sample (an engine's SampleResult, or the attacker's own)."""

    token_ids: list[int]
    logprobs: list[float]
    proof: bytes
    finish_reason: str = "length"


def grpo_step(model, tok, env, lr: float, seed: int = 0):
    """One on-policy GRPO step (this package's loss, AdamW, clip 1.0) on groups the model sampled itself."""
    rng = random.Random(seed)
    engine = TorchEngine.from_model(copy.deepcopy(model), 0)
    prompts = env.sample_prompts(rng, 8)
    reqs = [GenerationRequest(tok(p.text).input_ids, [rng.getrandbits(64) for _ in range(8)], 1.0, 4,
                              [tok.eos_token_id]) for p in prompts]
    groups = engine.generate(reqs)
    rewards = torch.tensor([[env.reward(p, tok.decode(s.token_ids, skip_special_tokens=True)) for s in g]
                            for p, g in zip(prompts, groups, strict=True)])
    adv, _ = group_advantages(rewards)
    rows = [(r.prompt_ids, s.token_ids, s.logprobs, float(a)) for r, g, ad in zip(reqs, groups, adv, strict=True)
            for s, a in zip(g, ad, strict=True)]
    stepped = copy.deepcopy(model).train()
    width, t_max = max(len(p) + len(c) for p, c, _, _ in rows), max(len(c) for _, c, _, _ in rows)
    ids, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
    logp_behavior, response = torch.zeros(len(rows), t_max), torch.zeros(len(rows), t_max)
    for i, (p, c, lp, _) in enumerate(rows):
        ids[i, : len(p) + len(c)], mask[i, : len(p) + len(c)] = torch.tensor(p + c), 1
        logp_behavior[i, : len(c)], response[i, : len(c)] = torch.tensor(lp), 1
    logp = torch.log_softmax(stepped(input_ids=ids, attention_mask=mask).logits.float(), -1)
    logp_train = torch.nn.utils.rnn.pad_sequence(
        [logp[i, len(p) - 1 : len(p) - 1 + len(c)].gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
         for i, (p, c, _, _) in enumerate(rows)], batch_first=True)
    loss, _ = async_ppo_loss(logp_train, logp_behavior, torch.tensor([r[3] for r in rows]), response,
                             torch.zeros(len(rows)))
    opt = torch.optim.AdamW(stepped.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(stepped.parameters(), 1.0)
    opt.step()
    return stepped.eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Versions 0 and 1 in a policy store, plus the tokenizer, the environment and another model."""
    env = load_environment("arithmetic", min_digits=1, max_digits=1)
    tok = build_char_tokenizer(env.alphabet)
    v0 = build_tiny_model(tok, layers=2, hidden=64, heads=4, seed=0)
    warm_start(v0, tok, env, steps=60, batch_size=16, lr=1e-3, seed=0)
    v1 = grpo_step(v0, tok, env, RL_LR)
    store = PolicyStore(tmp_path_factory.mktemp("policy"))
    save_checkpoint(v0, tok, store.version_dir(0))
    save_checkpoint(v1, tok, store.version_dir(1))
    other = tmp_path_factory.mktemp("other") / "m"
    save_checkpoint(build_tiny_model(tok, layers=2, hidden=64, heads=4, seed=1), tok, other)
    return {"store": store, "tok": tok, "env": env, "other": other}


def lease_and_prompt(world, i: int, *, version: int = 1) -> tuple[LeaseRecord, list[int]]:
    rng = random.Random(1000 + i)
    prompt = world["tok"](world["env"].sample_prompts(rng, 1)[0].text).input_ids
    lease = LeaseRecord(f"L{i}", "n", i, N, TEMPERATURE, LENGTH, tuple(rng.getrandbits(64) for _ in range(N)), (),
                        version, 0, 1 << 60, "open")
    return lease, prompt


def request(lease: LeaseRecord, prompt: list[int], *, temperature: float | None = None, seeds=None) -> GenerationRequest:
    return GenerationRequest(prompt, list(seeds or lease.seeds), temperature or lease.temperature, lease.max_new_tokens,
                             list(lease.stop_token_ids))


def submission(lease: LeaseRecord, samples, version: int | None = None) -> Submission:
    return Submission(lease.lease_id, lease.policy_version if version is None else version, [
        SubmittedSample(np.asarray(s.token_ids, dtype=np.int64), np.asarray(s.logprobs, dtype=np.float32), s.proof,
                        s.finish_reason) for s in samples])


def reproved(model, prompt: list[int], token_lists: list[list[int]], temperature: float) -> list[Sample]:
    """Samples for tokens the attacker chose, with honest evidence recomputed for them: one teacher-forced
    forward on the model, TOPLOC proofs of its hidden states and its log-probs (what an engine that had
    drawn those tokens would have sent)."""
    trusted = prefill_group(model, prompt, token_lists)
    proofs = commit_many(trusted.hidden)
    return [Sample(list(t), token_logprobs(lg, torch.tensor(t), temperature).tolist(), p)
            for t, lg, p in zip(token_lists, trusted.logits, proofs, strict=True)]


class Attacks:
    """Each attack: (lease, prompt) → the samples a cheating node submits for that lease."""

    def __init__(self, world, dtype: str = "float32"):
        store = world["store"]
        self.world, self.dtype = world, dtype
        self.honest = TorchEngine(store.version_dir(1), 1, dtype=dtype)
        self.previous = TorchEngine(store.version_dir(0), 0, dtype=dtype)
        self.other = TorchEngine(world["other"], 1, dtype=dtype)

    def honest_group(self, lease, prompt):
        return self.honest.generate([request(lease, prompt)], keep_hidden=True)[0]

    def other_model(self, lease, prompt):
        return self.other.generate([request(lease, prompt)])[0]

    def previous_version(self, lease, prompt):
        return self.previous.generate([request(lease, prompt)])[0]

    def previous_version_reproved(self, lease, prompt):
        """Tokens from the previous version; proofs and log-probs recomputed on the current one."""
        tokens = [s.token_ids for s in self.previous_version(lease, prompt)]
        return reproved(self.honest.model, prompt, tokens, lease.temperature)

    def lower_precision(self, dtype):
        engine = TorchEngine(self.world["store"].version_dir(1), 1, dtype=dtype)
        return lambda lease, prompt: engine.generate([request(lease, prompt)])[0]

    def changed_prompt(self, lease, prompt):
        changed = list(prompt)
        changed[1] = 4 + (changed[1] - 4 + 1) % 10  # the first operand's digit, plus one
        return self.honest.generate([request(lease, changed)])[0]

    def fabricated(self, lease, prompt):
        """Tokens the node made up (any it likes), with honest evidence recomputed for them."""
        rng = random.Random(lease.lease_id)
        tokens = [[rng.randrange(4, 16) for _ in range(lease.max_new_tokens)] for _ in range(lease.group_size)]
        return reproved(self.honest.model, prompt, tokens, lease.temperature)

    def cherry_picked(self, lease, prompt, k: int = 4):
        """Best of k resamples (highest total log-prob) per sample, submitted under the assigned seed;
        each resample is an engine output, with its own honest proof and log-probs."""
        rng = random.Random(lease.lease_id)
        assigned = self.honest_group(lease, prompt)
        out = []
        for s in assigned:
            tries = self.honest.generate([request(lease, prompt, seeds=[rng.getrandbits(64) for _ in range(k)])])[0]
            tries = [t for t in tries if t.token_ids != s.token_ids] or tries
            out.append(max(tries, key=lambda t: sum(t.logprobs)))
        return out

    def other_temperature(self, lease, prompt):
        """Sampled at T = 0.6 with the assigned seeds; log-probs reported at the lease's temperature."""
        samples = self.honest.generate([request(lease, prompt, temperature=0.6)], keep_hidden=True)[0]
        tokens = [s.token_ids for s in samples]
        fixed = reproved(self.honest.model, prompt, tokens, lease.temperature)
        return [Sample(s.token_ids, f.logprobs, s.proof) for s, f in zip(samples, fixed, strict=True)]

    def _transformed(self, lease, prompt, fn):
        samples = self.honest_group(lease, prompt)
        proofs = commit_many([fn(s.hidden) for s in samples])
        return [Sample(s.token_ids, s.logprobs, p) for s, p in zip(samples, proofs, strict=True)]

    def negated(self, lease, prompt):
        return self._transformed(lease, prompt, lambda h: -h)

    def rescaled(self, lease, prompt):
        return self._transformed(lease, prompt, lambda h: h * 1.05)

    def halved(self, lease, prompt):
        return self._transformed(lease, prompt, lambda h: h * 0.5)

    def copied_proof(self, lease, prompt):
        samples = self.honest_group(lease, prompt)
        return [Sample(s.token_ids, s.logprobs, samples[(i + 1) % len(samples)].proof) for i, s in enumerate(samples)]

    def forged_logprobs(self, lease, prompt):
        """Behaviour log-probs lowered on one token of each sample: inflated importance weights."""
        samples = self.honest_group(lease, prompt)
        forged = []
        for s in samples:
            lp = list(s.logprobs)
            lp[len(lp) // 2] -= 0.5
            forged.append(Sample(s.token_ids, lp, s.proof))
        return forged

    def slightly_forged_logprobs(self, lease, prompt):
        samples = self.honest_group(lease, prompt)
        return [Sample(s.token_ids, [x - 2e-3 for x in s.logprobs], s.proof) for s in samples]


def verdicts(world, attack, *, dtype: str = "float32", version: int = 1):
    cfg = CoordinatorConfig()
    cfg.model_dtype = dtype
    verifier = TrustedVerifier(world["store"], cfg)
    out = []
    for i in range(GROUPS):
        lease, prompt = lease_and_prompt(world, i, version=version)
        out.append(verifier.verify_group(lease, prompt, submission(lease, attack(lease, prompt))).rejection)
    return out


FP32_ATTACKS = [
    ("other_model", Reason.TOPLOC_FAILED, "exponent_mismatch"),
    ("previous_version", Reason.TOPLOC_FAILED, ""),
    ("changed_prompt", Reason.TOPLOC_FAILED, ""),
    ("fabricated", Reason.SAMPLING_FAILED, "sampling_mismatch"),
    ("cherry_picked", Reason.SAMPLING_FAILED, "sampling_mismatch"),
    ("other_temperature", Reason.SAMPLING_FAILED, "sampling_mismatch"),
    ("negated", Reason.TOPLOC_FAILED, "sign_mismatch"),
    ("rescaled", Reason.TOPLOC_FAILED, "mantissa_mismatch"),
    ("halved", Reason.TOPLOC_FAILED, "exponent_mismatch"),
    ("copied_proof", Reason.TOPLOC_FAILED, "exponent_mismatch"),
    ("forged_logprobs", Reason.LOGPROB_MISMATCH, "|diff| -0.5 "),
    ("slightly_forged_logprobs", Reason.LOGPROB_MISMATCH, "|diff| -0.002 "),
]


@pytest.fixture(scope="module")
def attacks(world):
    return Attacks(world)


def test_honest_groups_of_the_current_version_pass(world, attacks):
    got = verdicts(world, attacks.honest_group)
    assert got == [None] * GROUPS


@pytest.mark.parametrize(("name", "reason", "detail"), FP32_ATTACKS, ids=[a[0] for a in FP32_ATTACKS])
def test_attack_is_refused_with_its_reason(world, attacks, name, reason, detail):
    for rejection in verdicts(world, getattr(attacks, name)):
        assert rejection is not None, f"{name} was accepted"
        assert rejection.reason is reason and detail in rejection.detail, rejection


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_lower_precision_claimed_as_float32_is_refused(world, attacks, dtype):
    # bf16 is coarse enough for TOPLOC; fp16 is not (below its bf16 resolution), but its ~1e-3 log-prob
    # error is 100x what float32 engines differ by, and the float32 log-prob tolerance sees it.
    expected = Reason.TOPLOC_FAILED if dtype == "bfloat16" else Reason.LOGPROB_MISMATCH
    for rejection in verdicts(world, attacks.lower_precision(dtype)):
        assert rejection is not None and rejection.reason is expected, rejection


def test_previous_version_reproved_on_the_current_weights_fails_the_sampling_check(world, attacks):
    """TOPLOC and the log-probs cannot see it (they were recomputed on the current weights): every group
    whose tokens differ from what the current version draws is caught by the replay."""
    cfg = CoordinatorConfig()
    verifier = TrustedVerifier(world["store"], cfg)
    differing = 0
    for i in range(6):
        lease, prompt = lease_and_prompt(world, 100 + i)
        samples = attacks.previous_version_reproved(lease, prompt)
        if [s.token_ids for s in samples] == [s.token_ids for s in attacks.honest_group(lease, prompt)]:
            continue  # the same tokens the current version draws: nothing was gained, nothing to catch
        differing += 1
        rejection = verifier.verify_group(lease, prompt, submission(lease, samples)).rejection
        assert rejection is not None and rejection.reason is Reason.SAMPLING_FAILED, rejection
    assert differing >= 3


@pytest.mark.parametrize(("name", "reason"), [
    ("other_model", Reason.TOPLOC_FAILED),
    ("fabricated", Reason.SAMPLING_FAILED),
    ("other_temperature", Reason.SAMPLING_FAILED),
    ("copied_proof", Reason.TOPLOC_FAILED),
    ("forged_logprobs", Reason.LOGPROB_MISMATCH),
])
def test_attacks_on_a_bfloat16_verifier(world, name, reason):
    bf16 = Attacks(world, "bfloat16")
    assert verdicts(world, bf16.honest_group, dtype="bfloat16") == [None] * GROUPS
    for rejection in verdicts(world, getattr(bf16, name), dtype="bfloat16"):
        assert rejection is not None and rejection.reason is reason, rejection
