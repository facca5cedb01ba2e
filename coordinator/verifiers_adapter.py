"""Single-turn environments of the ``verifiers`` library (0.4, ``verifiers.v1``) as veriroll environments.

``load_environment("verifiers:TASKSET_ID", **kwargs)`` (or ``vf:TASKSET_ID``) loads an installed
verifiers *taskset* (a package exporting a ``vf.Taskset`` subclass, as ``prime env install`` leaves it)
and wraps it: its tasks become veriroll prompts, and its ``@vf.reward`` methods (plus rewards plugged
through its task config) score a completion. Install with ``pip install 'veriroll[verifiers]'``.

How verifiers 0.4 is mapped:

- prompt: a task's ``TaskData.prompt`` (a string or chat messages) after its ``system_prompt``; the
  plain ``text`` is the prompt's text (``TaskData.prompt_text``); ``answer`` is the task's ``answer``
  field where it has one (for display); the task data rides in ``meta`` so that a reward worker
  rebuilds exactly the task the prompt came from.
- reward: the completion becomes the one sampled assistant turn of a ``vf.Trace`` and the task scores
  it (``Task.score``); the reward is the library's ``trace.reward``, the weighted sum
  Σ weight · score over the task's rewards, so a taskset trains here on the numbers it would train on
  under prime-rl. A reward that fails in the library fails the sample (reward 0, counted by the
  reward runner).

veriroll's nodes generate one assistant turn from a prompt, with no tools, no sandbox and no other
model. A taskset that needs more is refused at load time, with what it needs: tools (``toolsets``),
a harness of its own (an agent program, possibly multi-turn), an ``Env`` of its own (multi-agent or
custom episodes), stop conditions (``@vf.stop``: multi-turn control), a container (``NEEDS_CONTAINER``),
a runtime in its rewards (they read the sandbox), LLM judges (they call a model), or a conversation the
user opens (no prompt).

``kwargs`` are the taskset's config fields (``vf.TasksetConfig`` or the taskset's own subclass), plus
``limit`` (use the first ``limit`` tasks; required for an infinite taskset) and ``max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from typing import Any

from veriroll.coordinator.environments import (
    Environment,
    EnvironmentLoadError,
    Prompt,
    RewardFunction,
    Rubric,
)

__all__ = ["SPEC_PREFIXES", "VerifiersEnvironment", "load_verifiers_environment"]

SPEC_PREFIXES = ("verifiers:", "vf:")
"""What ``load_environment`` routes here (environments.py names them too: it cannot import this module eagerly)."""
TASK_META_KEY = "verifiers_task"
"""Key of the task's data (JSON) in a prompt's meta."""


def _import_verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise EnvironmentLoadError(
            f"verifiers environments need the verifiers library (0.4): pip install 'veriroll[verifiers]' ({e})") from e
    return vf


def _needs_runtime(fn) -> bool:
    # The library's own rule (Task.score): a required ``runtime`` parameter means the sandbox is read.
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _refusals(taskset_id: str, taskset, task) -> list[str]:
    """What a taskset needs that single-turn generation without tools does not give; empty if nothing."""
    from verifiers.v1.envs.single_agent import SingleAgentEnv
    from verifiers.v1.utils.loaders import default_harness_id, environment_class

    out = []
    env_cls = environment_class(taskset_id)
    if env_cls is not SingleAgentEnv:
        out.append(f"its own Env ({env_cls.__name__}: multi-agent or custom episodes)")
    harness = default_harness_id(taskset_id)
    if harness != "bash":  # "bash" is the library's fallback when a taskset brings no harness
        out.append(f"its own harness ({harness!r}: an agent program, possibly multi-turn)")
    tools = [type(t).__name__ for t in type(taskset).toolsets(taskset.config)]
    tools += [type(t).__name__ for t in type(task).toolsets(task.config)]
    if tools:
        out.append(f"tools ({', '.join(tools)}): the model would call them between turns")
    if getattr(task, "NEEDS_CONTAINER", False):
        out.append("a container (NEEDS_CONTAINER)")
    stops = [fn.__name__ for fn in task.hooks("stop")]
    if stops:
        out.append(f"stop conditions ({', '.join(stops)}): they end multi-turn rollouts")
    needs_runtime = [fn.__name__ for fn in task.hooks("reward") + task.hooks("metric") if _needs_runtime(fn)]
    if needs_runtime:
        out.append(f"a sandbox runtime in its scoring ({', '.join(needs_runtime)})")
    if task.config.judges:
        out.append(f"LLM judges ({len(task.config.judges)}): scoring would call a model")
    if task.data.prompt is None:
        out.append("a conversation the user opens (no prompt): a simulated user, i.e. multiple turns")
    if not task.hooks("reward"):
        out.append("rewards: its tasks define no @vf.reward (nothing to train on)")
    return out


def _content_text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return content_text(content)


def _messages(data) -> list[dict[str, str]]:
    """The task's opening conversation as ``{"role", "content"}`` dicts, system prompt first."""
    out = []
    if data.system_prompt:
        out.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        for m in data.prompt or []:
            if getattr(m, "role", None) not in ("system", "user", "assistant"):
                raise EnvironmentLoadError(f"verifiers task {data.idx}: a {getattr(m, 'role', '?')!r} message in the "
                                           "prompt (tool results need a multi-turn rollout)")
            out.append({"role": m.role, "content": _content_text(m.content)})
    return out


class VerifiersEnvironment(Environment):
    """A verifiers 0.4 single-turn taskset as a veriroll environment (see the module docstring)."""

    def __init__(self, taskset_id: str, *, limit: int | None = None, max_new_tokens: int = 512, **taskset_kwargs):
        vf = _import_verifiers()
        from verifiers.v1.utils.loaders import taskset_class

        try:
            cls = taskset_class(taskset_id)
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            raise EnvironmentLoadError(f"verifiers taskset {taskset_id!r}: {e}") from e
        config_cls = self._config_type(cls, vf)
        try:
            config = config_cls.model_validate({**taskset_kwargs, "id": taskset_id})
        except Exception as e:  # pydantic's ValidationError says which field
            raise EnvironmentLoadError(f"verifiers taskset {taskset_id!r}: bad arguments: {e}") from e
        taskset = cls(config)
        if limit is not None:
            if limit < 1:
                raise EnvironmentLoadError(f"verifiers taskset {taskset_id!r}: limit must be >= 1, got {limit}")
            taskset = taskset.take(limit)
        elif not taskset.bounded:
            raise EnvironmentLoadError(f"verifiers taskset {taskset_id!r} is infinite: set limit (the tasks to use)")
        self.tasks = list(taskset)
        if not self.tasks:
            raise EnvironmentLoadError(f"verifiers taskset {taskset_id!r} has no tasks")
        refused = _refusals(taskset_id, taskset, self.tasks[0])
        if refused:
            raise EnvironmentLoadError(
                f"verifiers taskset {taskset_id!r} is not single-turn: it needs {'; '.join(refused)}. veriroll's nodes "
                "generate one assistant turn per prompt, without tools, sandbox or judge models; use a single-turn "
                "taskset (prompt in, one reply, rewards over that reply)")
        self.taskset_id = taskset_id
        self._task_type = type(self.tasks[0])
        self._task_config = self.tasks[0].config
        self._prompts = [self._prompt(task) for task in self.tasks]
        super().__init__(
            f"vf:{taskset_id}",
            Rubric([RewardFunction(self._reward, 1.0, "verifiers")]),
            alphabet="",  # real tokenizers only: the char-level demo tokenizer cannot write these tasks
            max_new_tokens=max_new_tokens,
        )

    @staticmethod
    def _config_type(cls, vf):
        from verifiers.v1.utils.generic import concrete_type

        return concrete_type(cls, vf.TasksetConfig) or vf.TasksetConfig

    def _prompt(self, task) -> Prompt:
        data = task.data
        return Prompt(text=data.prompt_text, answer=str(getattr(data, "answer", "") or ""), env=f"vf:{self.taskset_id}",
                      meta={TASK_META_KEY: data.model_dump(mode="json")}, messages=_messages(data))

    def sample_prompt(self, rng: random.Random) -> Prompt:
        p = self._prompts[rng.randrange(len(self._prompts))]
        return Prompt(p.text, p.answer, p.env, dict(p.meta), [dict(m) for m in p.messages])

    def _task(self, prompt: Prompt):
        """The task a prompt came from, rebuilt from the data in its meta (a reward worker has its own taskset)."""
        data = self._task_type.data_type().model_validate(prompt.meta[TASK_META_KEY])
        return self._task_type(data, self._task_config)

    def _reward(self, prompt: Prompt, completion: str) -> float:
        from verifiers.v1.configs.agent import AgentConfig
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

        task = self._task(prompt)
        kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
        nodes = [MessageNode(parent=i - 1 if i else None, message=kinds[m["role"]](content=m["content"]))
                 for i, m in enumerate(_messages(task.data))]
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=AssistantMessage(content=completion),
                                 sampled=True))
        trace = Trace(task=TraceTask(type=type(task).__name__, data=task.data), agent=AgentInfo(config=AgentConfig()),
                      nodes=nodes, is_completed=True, ok=True)
        # Rewards are coroutines in verifiers 0.4; this runs in a reward worker's main thread, which
        # has no event loop of its own.
        asyncio.run(task.score(trace))
        missing = [name for name, r in trace.rewards.items() if r is None]
        if missing:
            raise RuntimeError(f"verifiers rewards did not score: {', '.join(missing)}")
        return float(trace.reward)

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The library's reward for ``completion``: Σ weight · score over the task's rewards (not clamped)."""
        return self._reward(prompt, completion)


def load_verifiers_environment(spec: str, **kwargs) -> VerifiersEnvironment:
    """The environment for ``verifiers:TASKSET_ID`` / ``vf:TASKSET_ID`` (see the module docstring for ``kwargs``)."""
    taskset_id = spec.split(":", 1)[1]
    if not taskset_id:
        raise EnvironmentLoadError(f"environment {spec!r}: name a taskset after the prefix, e.g. 'vf:my-taskset'")
    return VerifiersEnvironment(taskset_id, **kwargs)
