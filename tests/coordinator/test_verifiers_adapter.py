"""Single-turn tasksets of the real ``verifiers`` library (0.4, the optional extra) as veriroll environments;
multi-turn and tool-use ones are refused with what they need."""

from __future__ import annotations

import random
import textwrap

import pytest

from veriroll.coordinator.environments import EnvironmentLoadError, load_environment
from veriroll.coordinator.rewards import RewardRunner

pytest.importorskip("verifiers.v1", reason="the verifiers extra is not installed (pip install 'veriroll[verifiers]')")

# Tasksets are packages the library imports by id; each is written to tmp_path and put on sys.path
# (reward workers inherit it).
SINGLE_TURN = textwrap.dedent(
    """
    import verifiers.v1 as vf

    class AddData(vf.TaskData):
        answer: str = ""

    class AddTask(vf.Task[AddData]):
        @vf.reward
        async def correct(self, task, trace) -> float:
            return float(trace.last_reply.strip() == task.answer)

        @vf.reward(weight=0.5)
        async def brief(self, trace) -> float:
            return float(len(trace.last_reply) <= 3)

        @vf.reward(weight=0.0)
        async def fails_on_boom(self, trace) -> float:
            if trace.last_reply == "boom":
                raise ValueError("boom")
            return 0.0

    class AddTaskset(vf.Taskset[AddTask]):
        def load(self):
            for a in range(5):
                yield AddTask(AddData(prompt=f"What is {a}+1?", answer=str(a + 1), system_prompt="Be brief."),
                              self.config.task)

    __all__ = ["AddTaskset"]
    """
)

WITH_TOOLS = textwrap.dedent(
    """
    import verifiers.v1 as vf

    class Calculator(vf.Toolset):
        @vf.tool
        async def add(self, a: int, b: int) -> int:
            return a + b

    class ToolTask(vf.Task[vf.TaskData]):
        @classmethod
        def toolsets(cls, config):
            return [Calculator(vf.ToolsetConfig())]

        @vf.reward
        async def used(self, trace) -> float:
            return float(bool(trace.tool_messages))

        @vf.stop
        async def enough(self, trace) -> bool:
            return len(trace.assistant_messages) > 3

    class ToolTaskset(vf.Taskset[ToolTask]):
        def load(self):
            yield ToolTask(vf.TaskData(prompt="Add 2 and 3 with the tool."), self.config.task)

    __all__ = ["ToolTaskset"]
    """
)

SANDBOX_REWARD = textwrap.dedent(
    """
    import verifiers.v1 as vf

    class FileTask(vf.Task[vf.TaskData]):
        @vf.reward
        async def file_written(self, trace, runtime) -> float:
            return 1.0

    class FileTaskset(vf.Taskset[FileTask]):
        def load(self):
            yield FileTask(vf.TaskData(prompt="Write a file."), self.config.task)

    __all__ = ["FileTaskset"]
    """
)


OWN_ENV_AND_USER_OPENS = textwrap.dedent(
    """
    import verifiers.v1 as vf

    class ChatTask(vf.Task[vf.TaskData]):
        @vf.reward
        async def polite(self, trace) -> float:
            return 1.0

    class ChatTaskset(vf.Taskset[ChatTask]):
        def load(self):
            yield ChatTask(vf.TaskData(prompt=None), self.config.task)  # the (simulated) user speaks first

    class DuetEnv(vf.SingleAgentEnv):
        pass

    __all__ = ["ChatTaskset", "DuetEnv"]
    """
)


@pytest.fixture
def tasksets(tmp_path, monkeypatch):
    for name, source in (("vr_test_add", SINGLE_TURN), ("vr_test_tools", WITH_TOOLS), ("vr_test_sandbox", SANDBOX_REWARD),
                         ("vr_test_duet", OWN_ENV_AND_USER_OPENS)):
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_single_turn_taskset_gives_prompts_and_library_rewards(tasksets):
    env = load_environment("vf:vr_test_add", max_new_tokens=16)
    assert env.name == "vf:vr_test_add" and env.max_new_tokens == 16 and len(env.tasks) == 5
    prompts = env.sample_prompts(random.Random(0), 20)
    assert prompts == env.sample_prompts(random.Random(0), 20)
    p = next(p for p in prompts if p.text == "What is 2+1?")
    assert p.answer == "3"
    assert p.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+1?"}]
    # Σ weight · score over the task's rewards, as the library computes it.
    assert env.reward(p, "3") == 1.5
    assert env.reward(p, " 3 ") == 1.5  # the library strips the reply
    assert env.reward(p, "4") == 0.5
    assert env.reward(p, "it is 3") == 0.0
    with pytest.raises(Exception, match="boom"):
        env.reward(p, "boom")


def test_spec_prefixes_and_limit(tasksets):
    assert len(load_environment("verifiers:vr_test_add", limit=2).tasks) == 2
    with pytest.raises(EnvironmentLoadError, match="limit must be >= 1"):
        load_environment("vf:vr_test_add", limit=0)
    with pytest.raises(EnvironmentLoadError, match="not found"):
        load_environment("vf:vr_no_such_taskset")
    with pytest.raises(EnvironmentLoadError, match="name a taskset"):
        load_environment("vf:")


def test_tool_use_and_multi_turn_tasksets_are_refused_naming_what_they_need(tasksets):
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment("vf:vr_test_tools")
    message = str(info.value)
    assert "not single-turn" in message and "tools (Calculator)" in message and "stop conditions (enough)" in message
    with pytest.raises(EnvironmentLoadError, match=r"a sandbox runtime in its scoring \(file_written\)"):
        load_environment("vf:vr_test_sandbox")
    with pytest.raises(EnvironmentLoadError) as info:
        load_environment("vf:vr_test_duet")
    assert "its own Env (DuetEnv" in str(info.value) and "a conversation the user opens" in str(info.value)


def test_rewards_run_in_reward_workers_and_failures_are_counted(tasksets):
    env = load_environment("vf:vr_test_add")
    p = next(p for p in env.sample_prompts(random.Random(0), 20) if p.answer == "3")
    runner = RewardRunner("vf:vr_test_add", timeout_s=60)
    try:
        out = runner.score_group(p, ["3", "4", "boom", "it is 3"])
        assert out.rewards == [1.5, 0.5, 0.0, 0.0]
        assert out.errors == [None, None, "exception", None]
    finally:
        runner.close()
