"""Reward functions run in killable worker processes: a raise, a hang, a crash or a bad value scores that
sample 0 and is counted; the group is still scored, and the next group is scored normally."""

from __future__ import annotations

import asyncio
import textwrap

import numpy as np
import pytest
from support import make_coordinator_dir, node_client, running_coordinator

from veriroll.coordinator.environments import Prompt
from veriroll.coordinator.rewards import RewardRunner
from veriroll.protos.v1 import coordinator_pb2 as pb

# The environment lives in a module written to tmp_path and put on sys.path: reward workers are fresh
# processes, which import it by name (they inherit the parent's sys.path).
FLAKY_MODULE = textwrap.dedent(
    """
    import os
    import time
    from veriroll.coordinator.environments import Environment, Prompt, RewardFunction, Rubric

    def _prompt(rng):
        return Prompt(text="1+1=", answer="2", env="flaky", meta={})

    def _reward(prompt, completion):
        # What the completion starts with says how this reward function misbehaves.
        head = completion.strip()[:1]
        if head == "3":
            raise RuntimeError("reward function bug")
        if head == "4":
            time.sleep(3600)  # hangs: only killing the process ends it
        if head == "5":
            return float("nan")
        if head == "6":
            os._exit(7)  # takes the worker down
        return 1.0 if head == "1" else 0.5

    def make():
        return Environment("flaky", Rubric([RewardFunction(_reward)]), alphabet="0123456789+=",
                           max_new_tokens=4, prompt_fn=_prompt)

    def make_bounded():  # declared bounded (scored on the coordinator): only ever given completions that return
        return Environment("flaky", Rubric([RewardFunction(_reward, bounded=True)]), alphabet="0123456789+=",
                           max_new_tokens=4, prompt_fn=_prompt)
    """
)


@pytest.fixture
def flaky_spec(tmp_path, monkeypatch):
    (tmp_path / "veriroll_test_flaky_env.py").write_text(FLAKY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "veriroll_test_flaky_env:make"


PROMPT = Prompt(text="1+1=", answer="2", env="flaky")


def scored(runner: RewardRunner, api: str, prompt: Prompt, completions: list[str]):
    """The runner's blocking API (threads) or its event-loop one: both must behave the same."""
    if api == "blocking":
        return runner.score_group(prompt, completions)
    return asyncio.run(runner.score(prompt, completions))


@pytest.mark.parametrize("api", ["blocking", "async"])
def test_raise_and_hang_score_zero_are_counted_and_the_next_group_is_normal(flaky_spec, api):
    runner = RewardRunner(flaky_spec, timeout_s=0.5)
    try:
        out = scored(runner, api, PROMPT, ["1", "3", "4", "2", "1"])
        assert out.rewards == [1.0, 0.0, 0.0, 0.5, 1.0]
        assert out.errors == [None, "exception", "timeout", None, None]
        assert "RuntimeError: reward function bug" in out.details[0] and "worker killed" in out.details[1]
        assert runner.errors == {"exception": 1, "timeout": 1}
        assert runner.restarts == 1  # the hung worker was killed and replaced
        again = scored(runner, api, PROMPT, ["1", "2", "1"])
        assert again.rewards == [1.0, 0.5, 1.0] and again.errors == [None, None, None]
        assert runner.restarts == 1
    finally:
        runner.close()


@pytest.mark.parametrize("api", ["blocking", "async"])
def test_bad_values_and_crashes_are_counted_by_kind(flaky_spec, api):
    runner = RewardRunner(flaky_spec, timeout_s=30)
    try:
        out = scored(runner, api, PROMPT, ["5", "6", "1"])
        assert out.rewards == [0.0, 0.0, 1.0]
        assert out.errors == ["invalid", "crash", None]
        assert "code 7" in out.details[1]
        assert runner.errors == {"invalid": 1, "crash": 1} and runner.restarts == 1
    finally:
        runner.close()


def test_a_cancelled_group_does_not_leave_its_answer_for_the_next(flaky_spec):
    runner = RewardRunner(flaky_spec, timeout_s=600)

    async def scenario():
        task = asyncio.create_task(runner.score(PROMPT, ["1", "4"]))  # "4" hangs, far below the limit
        while runner.restarts == 0 and not task.done():
            await asyncio.sleep(0.05)
            if not runner._live:
                continue
            worker = next(iter(runner._live))
            if int(worker.progress[0]) == 1:  # the worker is on the hanging sample: the node hangs up
                task.cancel()
                break
        with pytest.raises(asyncio.CancelledError):
            await task
        assert runner.restarts == 1  # the busy worker was killed, not handed to the next group
        return await runner.score(PROMPT, ["2", "1"])

    try:
        out = asyncio.run(scenario())
        assert out.rewards == [0.5, 1.0] and out.errors == [None, None]
    finally:
        runner.close()


def test_builtin_environments_score_in_workers_as_in_process():
    runner = RewardRunner("reverse-text", timeout_s=30)
    try:
        p = Prompt(text="abcd|", answer="dcba", env="reverse-text")
        assert runner.score_group(p, ["dcba", "dcbx", ""]).rewards == pytest.approx([1.0, 0.75, 0.0])
        assert runner.score_group(p, []).rewards == []
    finally:
        runner.close()


def test_a_spec_that_does_not_load_in_the_worker_scores_zero_with_the_reason():
    runner = RewardRunner("no_such_module_veriroll_rewards:env", timeout_s=30)
    try:
        out = runner.score_group(PROMPT, ["1", "1"])
        assert out.rewards == [0.0, 0.0] and out.errors == ["exception", "exception"]
        assert "cannot load environment" in out.details[0] and "no_such_module_veriroll_rewards" in out.details[0]
    finally:
        runner.close()


def _group(lease: pb.Lease, heads: list[int]) -> pb.SubmitGroupRequest:
    """One sample per head token, each ``max_new_tokens`` long (shape checks only: intake.verify is off)."""
    samples = [pb.Sample(token_ids=[head] * lease.max_new_tokens,
                         logprobs=np.full(lease.max_new_tokens, -1.0, dtype="<f4").tobytes(),
                         proof=b"p" * 16, finish_reason="length") for head in heads]
    return pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=samples)


async def _submit_heads(coord, stub, heads: str, loaded_version: int) -> pb.SubmitGroupResponse:
    """Lease one group and submit it with one sample per character of ``heads`` (its first token)."""
    ids = dict(zip(heads, coord.service.tokenizer.convert_tokens_to_ids(list(heads)), strict=True))
    lease = (await stub.lease_work(pb.LeaseRequest(max_leases=1, loaded_version=loaded_version))).leases[0]
    return await stub.submit_group(_group(lease, [ids[c] for c in heads]))


def test_coordinator_accepts_a_group_whose_rewards_raise_or_hang_and_counts_them(tmp_path, flaky_spec):
    base = make_coordinator_dir(tmp_path, {"environment.name": flaky_spec, "environment.kwargs": {},
                                           "environment.reward_timeout_s": 0.5})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            ok = await _submit_heads(coord, stub, "1342", loaded_version=-1)
            assert ok.accepted and list(ok.rewards) == [1.0, 0.0, 0.0, 0.5]
            m = coord.service.metrics
            assert m.reward_errors.get(kind="exception") == 1 and m.reward_errors.get(kind="timeout") == 1
            ok = await _submit_heads(coord, stub, "1211", loaded_version=0)
            assert ok.accepted and list(ok.rewards) == [1.0, 0.5, 1.0, 1.0]
            assert m.reward_errors.get(kind="timeout") == 1
            stored = coord.db.run_sync(lambda c: [r[0] for r in c.execute("SELECT reward FROM samples ORDER BY rowid")])
            assert stored == [1.0, 0.0, 0.0, 0.5, 1.0, 0.5, 1.0, 1.0]
            metrics_text = m.registry.render()
            assert 'veriroll_reward_errors_total{kind="exception"} 1' in metrics_text

    asyncio.run(scenario())


def test_groups_larger_than_a_request_go_in_chunks(flaky_spec, monkeypatch):
    import veriroll.coordinator.rewards as rewards

    monkeypatch.setattr(rewards, "CAPACITY", 2)  # shared result arrays of two samples
    runner = RewardRunner(flaky_spec, timeout_s=0.5)
    try:
        out = runner.score_group(PROMPT, ["1", "2", "3", "4", "1"])
        assert out.rewards == [1.0, 0.5, 0.0, 0.0, 1.0]
        assert out.errors == [None, None, "exception", "timeout", None]
    finally:
        runner.close()


def test_a_hanging_reward_does_not_stall_other_nodes_intake(tmp_path, flaky_spec):
    """One node's group hangs in its reward function (far below the limit); meanwhile another node leases,
    submits and is scored; when the first node hangs up, its busy reward worker is killed."""
    base = make_coordinator_dir(tmp_path, {"environment.name": flaky_spec, "environment.kwargs": {},
                                           "environment.reward_timeout_s": 3600, "environment.reward_workers": 2})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as alice, node_client(coord) as bob:
            ids = dict(zip("14", coord.service.tokenizer.convert_tokens_to_ids(list("14")), strict=True))
            runner = coord.service.rewards
            lease = (await alice.lease_work(pb.LeaseRequest(max_leases=1, loaded_version=-1))).leases[0]
            hanging = asyncio.create_task(alice.submit_group(_group(lease, [ids["1"], ids["4"], ids["1"], ids["1"]])))
            for _ in range(2000):  # until a worker is inside the hanging sample (index 1)
                await asyncio.sleep(0.01)
                if any(int(w.progress[0]) == 1 for w in list(runner._live)):
                    break
            else:
                pytest.fail("the reward worker never reached the hanging sample")
            lease = (await bob.lease_work(pb.LeaseRequest(max_leases=1, loaded_version=-1))).leases[0]
            ok = await bob.submit_group(_group(lease, [ids["1"]] * 4))
            assert ok.accepted and list(ok.rewards) == [1.0] * 4
            assert not hanging.done()
            hanging.cancel()  # alice hangs up
            for _ in range(2000):
                await asyncio.sleep(0.01)
                if runner.restarts == 1:
                    break
            assert runner.restarts == 1  # the worker stuck in alice's group was killed, not reused
            lease = (await bob.lease_work(pb.LeaseRequest(max_leases=1, loaded_version=0))).leases[0]
            ok = await bob.submit_group(_group(lease, [ids["1"]] * 4))
            assert ok.accepted and list(ok.rewards) == [1.0] * 4

    asyncio.run(scenario())


def test_many_groups_waiting_for_a_hung_worker_do_not_block_its_replacement(flaky_spec):
    """More groups wait for the one worker than the loop's default executor has threads, while the worker
    hangs: its replacement still starts, and every group is scored (waiting in executor threads, the
    waiters held every thread the kill and the restart needed)."""
    runner = RewardRunner(flaky_spec, timeout_s=0.5)

    async def scenario():
        hung = asyncio.create_task(runner.score(PROMPT, ["4", "1"]))
        while not runner._live:  # the worker has started on the hanging group
            await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(runner.score(PROMPT, ["2"])) for _ in range(40)]
        done, _ = await asyncio.wait([hung, *waiting], timeout=120)
        assert len(done) == 41, "groups still waiting for a reward worker"
        return hung.result(), [task.result() for task in waiting]

    try:
        hung, rest = asyncio.run(scenario())
        assert hung.rewards == [0.0, 1.0] and hung.errors == ["timeout", None]
        assert all(out.rewards == [0.5] for out in rest) and runner.restarts == 1
    finally:
        runner.close()


# --- bounded rubrics scored in the coordinator's own process -------------------------------------------


def _bounded_env(reward):
    from veriroll.coordinator.environments import Environment, RewardFunction, Rubric

    return Environment("bounded", Rubric([RewardFunction(reward, bounded=True)]), alphabet="0123456789+=",
                       max_new_tokens=4, prompt_fn=lambda rng: PROMPT)


@pytest.mark.parametrize("api", ["blocking", "async"])
def test_a_bounded_rubric_scores_inline_without_a_worker_and_counts_its_errors(api):
    def reward(prompt, completion):
        if completion == "3":
            raise RuntimeError("reward function bug")
        if completion == "5":
            return float("nan")
        return float(completion == prompt.answer)

    runner = RewardRunner("bounded-not-importable:make", inline=_bounded_env(reward))
    try:
        out = scored(runner, api, PROMPT, ["2", "3", "5", "1"])
        assert out.rewards == [1.0, 0.0, 0.0, 0.0]
        assert out.errors == [None, "exception", "invalid", None]
        assert runner.errors == {"exception": 1, "invalid": 1}
        assert not runner._live  # no worker process was started (the spec could not even load in one)
    finally:
        runner.close()


def test_a_rubric_with_an_unbounded_function_is_refused_inline():
    from veriroll.coordinator.environments import Environment, RewardFunction, Rubric, exact_match

    env = Environment("mixed", Rubric([RewardFunction(exact_match, bounded=True), RewardFunction(lambda p, c: 1.0)]),
                      alphabet="0123456789", max_new_tokens=4, prompt_fn=lambda rng: PROMPT)
    assert not env.rubric.bounded
    with pytest.raises(ValueError, match="not declared bounded"):
        RewardRunner("mixed", inline=env)


@pytest.mark.parametrize("inline", [True, False])
def test_the_coordinator_scores_arithmetic_inline_unless_configured_not_to(tmp_path, inline):
    base = make_coordinator_dir(tmp_path, {"environment.inline_bounded_rewards": inline})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            svc = coord.service
            assert (svc.rewards.inline is not None) == inline
            lease = (await stub.lease_work(pb.LeaseRequest(max_leases=1, loaded_version=-1))).leases[0]
            prompt = svc.tokenizer.decode(list(lease.prompt_ids), skip_special_tokens=True)
            a, b = prompt.rstrip("=").split("+")
            right = svc.tokenizer.convert_tokens_to_ids(list(str(int(a) + int(b))))
            wrong = svc.tokenizer.convert_tokens_to_ids(list(str(int(a) + int(b) + 1)))
            stop = list(lease.stop_token_ids)[:1]
            samples = [pb.Sample(token_ids=ids, logprobs=np.full(len(ids), -1.0, dtype="<f4").tobytes(), proof=b"p" * 16,
                                 finish_reason="stop") for ids in [right + stop, wrong + stop] * (lease.group_size // 2)]
            ok = await stub.submit_group(pb.SubmitGroupRequest(lease_id=lease.lease_id,
                                                               policy_version=lease.policy_version, samples=samples))
            assert ok.accepted and list(ok.rewards) == [1.0, 0.0] * (lease.group_size // 2)
            assert bool(svc.rewards._live) != inline  # a worker process scored it only when not inline

    asyncio.run(scenario())


def test_completions_drop_the_final_stop_token_and_any_other_a_stored_group_holds(tmp_path):
    from veriroll.coordinator.intake import Submission, SubmittedSample

    base = make_coordinator_dir(tmp_path)

    async def scenario():
        async with running_coordinator(base) as coord:
            svc = coord.service
            digits = svc.tokenizer.convert_tokens_to_ids(list("12"))
            # A stop token that decodes to text ("9"): the tokenizer's own EOS would vanish as a special token.
            stop = svc.tokenizer.convert_tokens_to_ids("9")
            svc.intake._stop_ids = frozenset({stop})

            def sample(ids):
                return SubmittedSample(np.asarray(ids), np.zeros(len(ids), "<f4"), b"", "stop")

            sub = Submission("x", 0, [sample(digits + [stop]), sample([digits[0], stop, digits[1]]), sample(digits)])
            assert svc.intake.completions(sub) == ["12", "12", "12"]

    asyncio.run(scenario())


def test_a_coordinator_scoring_inline_counts_a_reward_that_raises_or_is_not_finite(tmp_path, flaky_spec):
    """Over a real socket: the bounded rubric's failures are the sample's 0 and counted, the group accepted."""
    base = make_coordinator_dir(tmp_path, {"environment.name": flaky_spec.replace(":make", ":make_bounded"),
                                           "environment.kwargs": {}})

    async def scenario():
        async with running_coordinator(base) as coord, node_client(coord) as stub:
            assert coord.service.rewards.inline is not None
            ok = await _submit_heads(coord, stub, "1352", loaded_version=-1)
            assert ok.accepted and list(ok.rewards) == [1.0, 0.0, 0.0, 0.5]
            m = coord.service.metrics
            assert m.reward_errors.get(kind="exception") == 1 and m.reward_errors.get(kind="invalid") == 1
            assert not coord.service.rewards._live  # no worker process

    asyncio.run(scenario())
