"""TESTING ONLY: dishonest nodes, one per attack the coordinator must catch.

``veriroll node run --adversary KIND`` makes a node cheat in the named way, for real: the wrong model
really generates, the fabricated tokens really carry honestly recomputed proofs, the replay really
resends the signed bytes. Nothing here asks the coordinator to reject anything; the attack either
gets through (a security bug) or is refused with a reason, and the adversary counts which.

The agent generates every lease honestly first; then, instead of submitting, it hands the lease,
the honest request and results to :meth:`Adversary.submit`. Attacks on the weights (another model, an
old version, lower precision) change the engine in :meth:`Adversary.prepare_engine`, which the agent
calls after every load, so the "honest" generation is already the dishonest one.

An adversary never submits a group that carries no attack: when a draw at half the temperature, an
old version or a cherry-pick happens to give exactly the honest group, it lets that lease lapse and
counts ``no_effect``. So every group an adversary submits that the coordinator accepts is a breach,
except the honest groups ``claimed-rewards`` and ``replay`` build their attacks on (and report as
``honest_base``). The counts live in ``agent.status.adversary``:

    kind       the attack
    tried      label -> attempts (``group``, ``replayed_bytes``, ``burst_request``, ``no_effect``, ...)
    answers    coordinator reason (or ``accepted``/``ok``/``same_group``) -> count, over all attempts
    by_label   label -> {answer -> count}
    breaches   answers that mean a defence failed (an attack accepted, a replay double-counted)

The weight attacks reach into :class:`~veriroll.node.engines.torch.TorchEngine`; they need it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections import Counter, defaultdict

import numpy as np
import torch

from veriroll.protos.envelope import sign_request
from veriroll.protos.service import SOFTWARE_VERSION, CallError, SignedStub, full_method
from veriroll.protos.v1 import coordinator_pb2 as pb

log = logging.getLogger("veriroll.deploy.adversary")

KINDS: dict[str, str] = {
    "wrong-model": "generate with a differently initialized model of the same architecture (caught by TOPLOC)",
    "stale-version": "keep generating with the first version loaded while claiming each lease's version (TOPLOC)",
    "low-precision": "generate in bfloat16 while the network verifies float32 (TOPLOC / log-probs)",
    "fabricated-tokens": "choose likely tokens other than the seeded draw; honest proofs and log-probs for them (sampling)",
    "cherry-pick": "draw 4 resamples per sample with other seeds; submit the most confident under the assigned seed (sampling)",
    "wrong-temperature": "sample at half the lease temperature; log-probs at the claimed one (sampling)",
    "forged-logprobs": "halve the log-probs (towards 0) to inflate importance weights (log-prob check)",
    "claimed-rewards": "append an unknown protobuf field claiming reward 1.0 to an honest group (ignored; rewards recomputed)",
    "replay": "resend an accepted submission's exact bytes and signature, then re-signed (nonce store; idempotent answer)",
    "stolen-lease": "lease with a second registered key and submit that lease with this one (lease binding)",
    "partial-group": "drop the least confident sample of each group (whole groups only)",
    "garbage": "random bytes as a SubmitGroup body, correctly signed (strict parsing)",
    "flood": "bursts of concurrent signed requests (per-key rate limit)",
}

# Field number no message of the contract uses: old parsers keep it as an unknown field.
CLAIMED_REWARD_FIELD = 15
CHERRY_PICK_RESAMPLES = 4
FLOOD_BURST = 150
LOGPROB_INFLATION = 0.5


class Adversary:
    """A dishonest node's behaviour: how it bends the engine, what it submits, what it was told."""

    kind = ""

    def __init__(self) -> None:
        self.tried: Counter = Counter()
        self.answers: Counter = Counter()
        self.by_label: dict[str, Counter] = defaultdict(Counter)
        self.breaches = 0

    # -- hooks the agent calls ------------------------------------------------------------------------

    def prepare_engine(self, engine) -> None:
        """Called (in a worker thread) after every weight load; weight attacks change the engine here."""

    async def submit(self, agent, lease: pb.Lease, req: pb.SubmitGroupRequest, results: list) -> None:
        """Instead of the honest submission of ``req`` (generated as ``results`` for ``lease``)."""
        raise NotImplementedError

    # -- bookkeeping ----------------------------------------------------------------------------------

    def note(self, agent, label: str, answer: str, *, breach: bool = False) -> None:
        """Count one attempt ``label`` and the coordinator's ``answer``; publish into ``agent.status``."""
        self.tried[label] += 1
        self.answers[answer] += 1
        self.by_label[label][answer] += 1
        if breach:
            self.breaches += 1
            log.error("SECURITY: %s attempt %r was answered %r: the defence did not hold", self.kind, label, answer)
        agent.status.adversary = self.report()
        agent._write_status()

    def report(self) -> dict:
        return {"kind": self.kind, "tried": dict(self.tried), "answers": dict(self.answers),
                "by_label": {k: dict(v) for k, v in self.by_label.items()}, "breaches": self.breaches}

    def skip(self, agent, lease: pb.Lease, why: str) -> None:
        log.info("%s: %s on lease %s; letting it lapse", self.kind, why, lease.lease_id)
        self.tried["no_effect"] += 1
        agent.status.adversary = self.report()

    async def send_group(self, agent, label: str, body: bytes, *, honest: bool = False,
                         metadata=None) -> pb.SubmitGroupResponse | None:
        """Submit a serialized group; an acceptance is a breach unless the group is ``honest``.

        Signed fresh through the agent's retrying call unless ``metadata`` (a fixed signature) is given:
        retrying a fixed signature would itself be a replay.
        """
        try:
            if metadata is None:
                resp = await agent._call(agent.stub.call_raw, "SubmitGroup", body)
            else:
                resp = await agent.stub.call_raw("SubmitGroup", body, metadata=metadata)
        except CallError as err:
            agent.status.rejected[err.reason] += 1
            agent.status.last_error = f"{label}: {err}"
            log.warning("%s: %s refused: %s", self.kind, label, err)
            self.note(agent, label, err.reason)
            return None
        agent.status.accepted_groups += 1
        agent.status.accepted_tokens += resp.credited_tokens
        self.note(agent, label, "accepted", breach=not honest)
        return resp


def _differs(req: pb.SubmitGroupRequest, results: list) -> bool:
    """Whether a group's tokens are not exactly those of the honest ``results``."""
    if len(req.samples) != len(results):
        return True
    return any(list(s.token_ids) != list(r.token_ids) for s, r in zip(req.samples, results, strict=True))


def _sample_proto(token_ids, logprobs, proof: bytes, finish_reason: str) -> pb.Sample:
    return pb.Sample(token_ids=[int(t) for t in token_ids], logprobs=np.asarray(logprobs, dtype="<f4").tobytes(),
                     proof=proof, finish_reason=finish_reason)


def _group(lease: pb.Lease, samples: list[pb.Sample]) -> pb.SubmitGroupRequest:
    return pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=samples)


def _request(lease: pb.Lease, *, seeds=None, temperature: float | None = None):
    from veriroll.node.engines.base import GenerationRequest

    return GenerationRequest(prompt_ids=list(lease.prompt_ids), seeds=list(seeds if seeds is not None else lease.seeds),
                             temperature=float(lease.temperature if temperature is None else temperature),
                             max_new_tokens=int(lease.max_new_tokens), stop_token_ids=list(lease.stop_token_ids))


def _seed_bits(seed: int) -> int:
    return seed - (1 << 64) if seed >= (1 << 63) else seed


@torch.no_grad()
def teacher_forced(engine, prompt: list[int], completion: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's own logits ``[T, V]`` (float32) and LM-head inputs ``[T, H]`` at the positions that
    produced ``completion`` after ``prompt``: what an honest engine would have seen generating it."""
    model = engine.model
    captured: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.long, device=engine.device)
        out = model(input_ids=ids, use_cache=False)
    finally:
        hook.remove()
        engine._captured.clear()  # the engine's own capture hook saw this forward too
    p, t = len(prompt), len(completion)
    return out.logits[0, p - 1: p + t - 1].float().cpu(), captured[-1][0, p - 1: p + t - 1].cpu()


def _commit(hiddens: list[torch.Tensor]) -> list[bytes]:
    from veriroll.toploc import commit_many

    return commit_many(hiddens)


# -- attacks on the weights ---------------------------------------------------------------------------


class _ContentAdversary(Adversary):
    """Submits what the (bent) engine generated; the attack happened in :meth:`prepare_engine`."""

    def has_effect(self, lease: pb.Lease) -> bool:
        return True

    async def submit(self, agent, lease, req, results) -> None:
        if not self.has_effect(lease):
            self.skip(agent, lease, "the engine is honest for this lease")
            return
        await self.send_group(agent, "group", req.SerializeToString())


class WrongModel(_ContentAdversary):
    """Every load is replaced by a fresh, differently seeded model of the same config."""

    kind = "wrong-model"
    seed = 0x5EED

    def prepare_engine(self, engine) -> None:
        import transformers

        config = engine.model.config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + int(engine.version or 0))
            model = transformers.AutoModelForCausalLM.from_config(config)
        engine._install(model, engine.version)


class StaleVersion(_ContentAdversary):
    """Keeps the first weights it ever loaded and puts them back after every later load."""

    kind = "stale-version"

    def __init__(self) -> None:
        super().__init__()
        self.first_model = None
        self.first_version: int | None = None

    def prepare_engine(self, engine) -> None:
        if self.first_model is None:
            self.first_model, self.first_version = engine.model, engine.version
        elif engine.model is not self.first_model:
            engine._install(self.first_model, engine.version)  # the old weights, the new version's name

    def has_effect(self, lease) -> bool:
        return int(lease.policy_version) != self.first_version


class LowPrecision(_ContentAdversary):
    """Casts the engine to bfloat16: later loads read bfloat16 directly."""

    kind = "low-precision"

    def prepare_engine(self, engine) -> None:
        if engine.dtype != torch.bfloat16:
            engine.dtype = torch.bfloat16
            engine._install(engine.model, engine.version)

    async def submit(self, agent, lease, req, results) -> None:
        # The lie: the group is declared float32 (what the node was configured with), so the verifier
        # holds it to float32's tolerances. Declared honestly as bfloat16 it would be a legitimate group.
        req.compute_dtype = "float32"
        await super().submit(agent, lease, req, results)


# -- attacks on the tokens ----------------------------------------------------------------------------


class FabricatedTokens(Adversary):
    """Picks, at every position, the most likely token that is *not* the seeded draw (and no stop
    token), then proves it honestly: hidden states, proof and log-probs from a teacher-forced forward
    of its own model over the chosen tokens."""

    kind = "fabricated-tokens"

    def fabricate(self, engine, lease: pb.Lease) -> pb.SubmitGroupRequest:
        from veriroll.toploc import sampling

        prompt, temp = list(lease.prompt_ids), float(lease.temperature)
        stops = list(lease.stop_token_ids)
        chosen, hiddens, logprobs = [], [], []
        for seed in lease.seeds:
            tokens: list[int] = []
            for t in range(int(lease.max_new_tokens)):
                logits, _ = teacher_forced(engine, prompt, tokens + [0])  # the last row predicts position t
                row = logits[-1:]
                draw = int(sampling.sample(row, temp, torch.tensor([_seed_bits(int(seed))]), torch.tensor([t]))[0])
                scores = row[0].clone()
                scores[[draw, *stops]] = float("-inf")
                tokens.append(int(scores.argmax()))
            logits, hidden = teacher_forced(engine, prompt, tokens)
            chosen.append(tokens)
            hiddens.append(hidden)
            logprobs.append(sampling.token_logprobs(logits, torch.tensor(tokens), temp).numpy())
        proofs = _commit(hiddens)
        return _group(lease, [_sample_proto(t, lp, p, "length") for t, lp, p in zip(chosen, logprobs, proofs, strict=True)])

    async def submit(self, agent, lease, req, results) -> None:
        fake = await asyncio.to_thread(self.fabricate, agent.engine, lease)
        await self.send_group(agent, "group", fake.SerializeToString())


class CherryPick(Adversary):
    """For each sample, draws ``CHERRY_PICK_RESAMPLES`` completions with seeds of its own choosing and
    submits the most confident (highest mean log-prob) in the assigned seed's slot. Each candidate's
    proof and log-probs are honest for its tokens: only the seed is a lie."""

    kind = "cherry-pick"

    def __init__(self, k: int = CHERRY_PICK_RESAMPLES) -> None:
        super().__init__()
        self.k = k
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little"))

    async def submit(self, agent, lease, req, results) -> None:
        n = len(lease.seeds)
        seeds = [self.rng.getrandbits(64) for _ in range(n * self.k)]
        drawn = (await asyncio.to_thread(agent.engine.generate, [_request(lease, seeds=seeds)]))[0]
        samples = []
        for j in range(n):
            best = max(drawn[j * self.k:(j + 1) * self.k], key=lambda r: float(np.mean(r.logprobs)))
            samples.append(_sample_proto(best.token_ids, best.logprobs, best.proof, best.finish_reason))
        picked = _group(lease, samples)
        if not _differs(picked, results):
            self.skip(agent, lease, "the picks equal the honest draws")
            return
        await self.send_group(agent, "group", picked.SerializeToString())


class WrongTemperature(Adversary):
    """Samples at half the lease temperature (sharper, higher-reward drafts) and reports log-probs at the
    lease temperature, recomputed by a teacher-forced forward, so only the draw itself is wrong."""

    kind = "wrong-temperature"

    def relabel(self, engine, lease: pb.Lease, drawn: list) -> pb.SubmitGroupRequest:
        from veriroll.toploc import sampling

        samples = []
        for r in drawn:
            logits, _ = teacher_forced(engine, list(lease.prompt_ids), r.token_ids)
            lp = sampling.token_logprobs(logits, torch.tensor(r.token_ids), float(lease.temperature)).numpy()
            samples.append(_sample_proto(r.token_ids, lp, r.proof, r.finish_reason))
        return _group(lease, samples)

    async def submit(self, agent, lease, req, results) -> None:
        engine = agent.engine
        drawn = (await asyncio.to_thread(engine.generate, [_request(lease, temperature=lease.temperature / 2)]))[0]
        group = await asyncio.to_thread(self.relabel, engine, lease, drawn)
        if not _differs(group, results):
            self.skip(agent, lease, "half the temperature drew the honest tokens")
            return
        await self.send_group(agent, "group", group.SerializeToString())


# -- attacks on the claims ----------------------------------------------------------------------------


class ForgedLogprobs(Adversary):
    """Honest tokens and proofs; log-probs moved towards 0 so the trainer's ratios favour this node."""

    kind = "forged-logprobs"

    async def submit(self, agent, lease, req, results) -> None:
        forged = pb.SubmitGroupRequest()
        forged.CopyFrom(req)
        for s, r in zip(forged.samples, results, strict=True):
            s.logprobs = (np.asarray(r.logprobs, dtype="<f4") * LOGPROB_INFLATION).astype("<f4").tobytes()
        await self.send_group(agent, "group", forged.SerializeToString())


def claimed_rewards_field(n: int, reward: float = 1.0) -> bytes:
    """Wire bytes of a packed ``repeated float`` at :data:`CLAIMED_REWARD_FIELD`, one ``reward`` per sample."""
    payload = np.full(n, reward, dtype="<f4").tobytes()
    tag = (CLAIMED_REWARD_FIELD << 3) | 2  # length-delimited
    return bytes([tag]) + _varint(len(payload)) + payload


def _varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        out.append(b | (0x80 if x else 0))
        if not x:
            return bytes(out)


class ClaimedRewards(Adversary):
    """An honest group plus an extra field claiming reward 1.0 for every sample. The coordinator must
    ignore it (and it accepts the honest group): the stored rewards are its own."""

    kind = "claimed-rewards"

    async def submit(self, agent, lease, req, results) -> None:
        body = req.SerializeToString() + claimed_rewards_field(len(req.samples))
        resp = await self.send_group(agent, "group_with_claimed_rewards", body, honest=True)
        if resp is not None:
            self.note(agent, "rewards_returned", "all_claimed" if all(r == 1.0 for r in resp.rewards) else "recomputed")


class Replay(Adversary):
    """Submits an honest group with a signature it keeps, sends those exact bytes and headers again
    (a replay), then the same content freshly signed (a retry): the first must be refused as a
    replayed nonce, the second answered with the same group and not counted twice."""

    kind = "replay"

    async def submit(self, agent, lease, req, results) -> None:
        body = req.SerializeToString()
        metadata = sign_request(agent.key, full_method("SubmitGroup"), body)
        first = await self.send_group(agent, "original", body, honest=True, metadata=metadata)
        if first is None:
            return
        try:
            await agent.stub.call_raw("SubmitGroup", body, metadata=metadata)
            self.note(agent, "replayed_bytes", "accepted", breach=True)
        except CallError as err:
            self.note(agent, "replayed_bytes", err.reason, breach=False)
        try:
            again = await agent.stub.call_raw("SubmitGroup", body)
        except CallError as err:
            self.note(agent, "re_signed", err.reason)
            return
        same = again.group_id == first.group_id
        self.note(agent, "re_signed", "same_group" if same else "double_counted", breach=not same)


class StolenLease(Adversary):
    """Holds a second registered key. For each lease of its own it leases one more with the second
    key, generates it honestly and submits it signed by the first: a lease issued to another node.
    Its own lease lapses."""

    kind = "stolen-lease"

    def __init__(self) -> None:
        super().__init__()
        from veriroll.protos.identity import PrivateKey

        self.accomplice = PrivateKey.generate()
        self._stub: SignedStub | None = None

    async def _accomplice(self, agent) -> SignedStub:
        if self._stub is None:
            stub = SignedStub(agent.stub.channel, self.accomplice, timeout=agent.stub.timeout)
            await stub.register(pb.RegisterRequest(public_key=self.accomplice.public.raw, software_version=SOFTWARE_VERSION,
                                                   display_name="accomplice"))
            self._stub = stub
        return self._stub

    async def submit(self, agent, lease, req, results) -> None:
        try:
            stub = await self._accomplice(agent)
            leases = (await stub.lease_work(pb.LeaseRequest(
                max_leases=1, loaded_version=int(lease.policy_version), available_versions=[int(lease.policy_version)]))).leases
        except CallError as err:
            self.note(agent, "accomplice_lease", err.reason)
            return
        if not leases:
            self.tried["no_lease_to_steal"] += 1
            return
        other = leases[0]
        engine = await agent._engine_for(other.policy_version, other.deadline_ms)
        if engine is None:
            return
        drawn = (await asyncio.to_thread(engine.generate, [_request(other)]))[0]
        group = _group(other, [_sample_proto(r.token_ids, r.logprobs, r.proof, r.finish_reason) for r in drawn])
        await self.send_group(agent, "others_lease", group.SerializeToString())


class PartialGroup(Adversary):
    """Drops the least confident sample: a node that keeps only the samples it likes."""

    kind = "partial-group"

    async def submit(self, agent, lease, req, results) -> None:
        worst = min(range(len(results)), key=lambda i: float(np.mean(results[i].logprobs)) if results[i].logprobs else 0.0)
        partial = pb.SubmitGroupRequest()
        partial.CopyFrom(req)
        del partial.samples[worst]
        await self.send_group(agent, "group", partial.SerializeToString())


# -- attacks on the door ------------------------------------------------------------------------------


class Garbage(Adversary):
    """Random bytes (that do not parse as a SubmitGroupRequest) as a correctly signed SubmitGroup."""

    kind = "garbage"

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little"))

    def garbage(self) -> bytes:
        from google.protobuf.message import DecodeError

        while True:
            body = self.rng.randbytes(self.rng.randint(16, 512))
            try:
                pb.SubmitGroupRequest.FromString(body)
            except DecodeError:
                return body

    async def submit(self, agent, lease, req, results) -> None:
        try:
            await agent.stub.call_raw("SubmitGroup", self.garbage())
            self.note(agent, "garbage", "accepted", breach=True)
        except CallError as err:
            agent.status.rejected[err.reason] += 1
            self.note(agent, "garbage", err.reason)


class Flood(Adversary):
    """Bursts of ``burst`` concurrent signed GetPolicy calls per lease; its own lease lapses.

    ``abandon_fraction`` of each burst goes out with deadlines of 20-500 ms, so the coordinator sees
    calls cancelled while it is still serving (and counting) them.
    """

    kind = "flood"

    def __init__(self, burst: int = FLOOD_BURST, abandon_fraction: float = 0.0) -> None:
        super().__init__()
        self.burst = burst
        self.abandon_fraction = abandon_fraction
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little"))

    async def submit(self, agent, lease, req, results) -> None:
        abandon = int(self.burst * self.abandon_fraction)
        timeouts = [self.rng.uniform(0.02, 0.5) if i < abandon else None for i in range(self.burst)]
        outcomes = await asyncio.gather(*(agent.stub.call("GetPolicy", pb.PolicyRequest(), timeout=t) for t in timeouts),
                                        return_exceptions=True)
        for out in outcomes:
            if isinstance(out, CallError):
                agent.status.rejected[out.reason] += 1
                self.note(agent, "burst_request", out.reason)
            elif isinstance(out, BaseException):
                self.note(agent, "burst_request", type(out).__name__)
            else:
                self.note(agent, "burst_request", "ok")


_CLASSES: dict[str, type[Adversary]] = {cls.kind: cls for cls in (
    WrongModel, StaleVersion, LowPrecision, FabricatedTokens, CherryPick, WrongTemperature, ForgedLogprobs,
    ClaimedRewards, Replay, StolenLease, PartialGroup, Garbage, Flood)}
assert set(_CLASSES) == set(KINDS)


def make_adversary(kind: str) -> Adversary:
    """The adversary called ``kind`` (one of :data:`KINDS`)."""
    try:
        return _CLASSES[kind]()
    except KeyError:
        raise ValueError(f"unknown adversary {kind!r}; choose one of: {', '.join(sorted(KINDS))}") from None
