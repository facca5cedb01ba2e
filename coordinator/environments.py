"""Environments: where prompts come from, and how a completion is scored.

An :class:`Environment` is a prompt source plus a :class:`Rubric`, a weighted set of reward functions
over ``(prompt, completion text)``. The reward of a completion is the weighted mean of its reward
functions, clamped to [0, 1]:

    reward = clamp(Σ_i w_i · f_i(prompt, completion) / Σ_i w_i, 0, 1)

Built in: ``arithmetic`` (the demo task: addition, answer checked exactly), ``reverse-text`` (reverse a
short string, partial credit by edit distance) and ``math`` (dataset files or generated word problems,
scored by math-verify; coordinator/math_environment.py) and ``code`` (programs with stdin/stdout tests run
in the sandbox; coordinator/code_environment.py). Anything else loads from a ``module:attribute``
path, so an operator can bring their own task without touching veriroll, or from a single-turn taskset
of the ``verifiers`` library (``vf:TASKSET``, coordinator/verifiers_adapter.py).

Completions are scored as decoded text, without special tokens: the engine stops at end-of-sequence
and the scorer never sees it.
"""

from __future__ import annotations

import importlib
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from veriroll.protos.errors import VerirollError

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ArithmeticEnvironment",
    "Environment",
    "EnvironmentLoadError",
    "Prompt",
    "ReverseTextEnvironment",
    "SANDBOXED_ENVIRONMENTS",
    "RewardFunction",
    "Rubric",
    "levenshtein",
    "environment_kwargs",
    "load_environment",
    "sandbox_state",
]


@dataclass
class Prompt:
    """One task instance: what the policy is asked, and what a right answer looks like.

    ``text`` is the prompt as plain text (what a base model continues, and what displays show);
    ``messages`` the same task as chat turns (``{"role", "content"}`` dicts) for a model with a chat
    template. Empty ``messages`` means one user turn with ``text``.
    """

    text: str
    answer: str
    env: str
    meta: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class RewardFunction:
    """One scored criterion of a rubric: ``fn(prompt, completion) -> float`` in [0, 1], with a weight.

    ``bounded``: ``fn`` costs time linear in the completion's length and cannot block or hang (no I/O, no
    regex that can backtrack, no solver): only then may the coordinator run it on its own event loop
    instead of in a reward worker process (coordinator/rewards.py), which saves a process round trip per
    group. Leave it False for anything else; a bounded function that raises still scores its sample 0.
    """

    fn: Callable[[Prompt, str], float]
    weight: float = 1.0
    name: str = ""
    bounded: bool = False

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError(f"reward function {self.label!r} has a negative weight {self.weight}")

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", "reward")


class Rubric:
    """A weighted mean of reward functions."""

    def __init__(self, functions: list[RewardFunction]):
        if not functions:
            raise ValueError("a rubric needs at least one reward function")
        if sum(f.weight for f in functions) <= 0:
            raise ValueError("a rubric needs a positive total weight")
        self.functions = list(functions)

    @property
    def bounded(self) -> bool:
        """True when every function is :attr:`RewardFunction.bounded`: the rubric may run in the coordinator."""
        return all(f.bounded for f in self.functions)

    def scores(self, prompt: Prompt, completion: str) -> dict[str, float]:
        """Each reward function's raw score, by label (for per-criterion diagnostics)."""
        return {f.label: float(f.fn(prompt, completion)) for f in self.functions}

    def score(self, prompt: Prompt, completion: str) -> float:
        total = sum(f.weight for f in self.functions)
        value = sum(f.weight * float(f.fn(prompt, completion)) for f in self.functions) / total
        return min(max(value, 0.0), 1.0)


class Environment:
    """A prompt source plus a rubric.

    Subclass and override :meth:`sample_prompt`, or pass ``prompt_fn``. ``alphabet`` lists every
    character prompts and good completions use (a character-level tokenizer is built from it);
    ``max_new_tokens`` is the completion budget the environment suggests to the engine.
    """

    def __init__(
        self,
        name: str,
        rubric: Rubric,
        *,
        alphabet: str,
        max_new_tokens: int,
        prompt_fn: Callable[[random.Random], Prompt] | None = None,
    ):
        self.name = name
        self.rubric = rubric
        # Deduplicated, order kept: the tokenizer's ids follow this order.
        self.alphabet = "".join(dict.fromkeys(alphabet))
        self.max_new_tokens = max_new_tokens
        self._prompt_fn = prompt_fn

    def sample_prompt(self, rng: random.Random) -> Prompt:
        if self._prompt_fn is None:
            raise NotImplementedError(f"environment {self.name!r} has no prompt_fn and does not override sample_prompt")
        return self._prompt_fn(rng)

    def sample_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """``n`` prompts drawn with ``rng`` (the caller's RNG, so a seed reproduces the stream)."""
        return [self.sample_prompt(rng) for _ in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The rubric's score of ``completion`` for ``prompt``, in [0, 1]."""
        return self.rubric.score(prompt, completion)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, max_new_tokens={self.max_new_tokens})"


# ---------------------------------------------------------------------------------------------------
# Built-in environments


def exact_match(prompt: Prompt, completion: str) -> float:
    """1 when the completion, stripped of surrounding whitespace, is exactly the answer."""
    return float(completion.strip() == prompt.answer)


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def edit_similarity(prompt: Prompt, completion: str) -> float:
    """1 − levenshtein(completion, answer) / max(len(completion), len(answer)): partial credit."""
    got = completion.strip()
    longest = max(len(got), len(prompt.answer))
    if longest == 0:
        return 1.0
    return 1.0 - levenshtein(got, prompt.answer) / longest


class ArithmeticEnvironment(Environment):
    """Addition of two non-negative integers: prompt ``"23+58="``, answer ``"81"``, exact match.

    Each operand has between ``min_digits`` and ``max_digits`` digits (a number of digits is drawn
    uniformly, then the number uniformly among those with that many digits; one digit includes 0).
    """

    def __init__(self, *, min_digits: int = 1, max_digits: int = 1, name: str = "arithmetic"):
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.min_digits, self.max_digits = min_digits, max_digits
        # The sum has at most max_digits + 1 digits; leave a few tokens for the model to stop.
        super().__init__(
            name,
            Rubric([RewardFunction(exact_match, 1.0, "exact_match", bounded=True)]),
            alphabet="0123456789+=",
            max_new_tokens=max_digits + 3,
        )

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)

    def sample_prompt(self, rng: random.Random) -> Prompt:
        a, b = self._operand(rng), self._operand(rng)
        return Prompt(text=f"{a}+{b}=", answer=str(a + b), env=self.name, meta={"a": a, "b": b})


class ReverseTextEnvironment(Environment):
    """Reverse a short string: prompt ``"abcd|"``, answer ``"dcba"``, credit by edit similarity."""

    def __init__(
        self,
        *,
        min_length: int = 3,
        max_length: int = 6,
        letters: str = string.ascii_lowercase[:8],
        name: str = "reverse-text",
    ):
        if not 1 <= min_length <= max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
        if not letters or "|" in letters:
            raise ValueError("letters must be non-empty and must not contain the separator '|'")
        self.min_length, self.max_length, self.letters = min_length, max_length, letters
        super().__init__(
            name,
            Rubric([RewardFunction(edit_similarity, 1.0, "edit_similarity")]),
            alphabet=letters + "|",
            max_new_tokens=max_length + 2,
        )

    def sample_prompt(self, rng: random.Random) -> Prompt:
        n = rng.randint(self.min_length, self.max_length)
        text = "".join(rng.choice(self.letters) for _ in range(n))
        return Prompt(text=f"{text}|", answer=text[::-1], env=self.name, meta={"text": text})


def math_environment(**kwargs) -> Environment:
    """The built-in ``math`` environment (coordinator/math_environment.py), imported only when used:
    it pulls in ``datasets`` and ``math-verify``, which the demo environments do not need."""
    from veriroll.coordinator.math_environment import MathEnvironment

    return MathEnvironment(**kwargs)


def code_environment(**kwargs) -> Environment:
    """The built-in ``code`` environment (coordinator/code_environment.py): programs with stdin/stdout tests,
    run in the sandbox (coordinator/sandbox.py); imported only when used."""
    from veriroll.coordinator.code_environment import CodeEnvironment

    return CodeEnvironment(**kwargs)


BUILTIN_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    "arithmetic": ArithmeticEnvironment,
    "code": code_environment,
    "math": math_environment,
    "reverse-text": ReverseTextEnvironment,
}


SANDBOXED_ENVIRONMENTS = frozenset({"code"})
"""Built-in environments that run model-written code: they take the coordinator's ``[sandbox]`` section as
their ``sandbox`` argument, and refuse to start where it cannot isolate (unless its weaker mode is named)."""


def environment_kwargs(cfg) -> dict:
    """The arguments the coordinator loads ``cfg.environment`` with: its ``kwargs``, plus ``sandbox`` (the
    ``[sandbox]`` section) and ``time_budget_s`` (a share of the reward's time limit) for an environment
    that runs model-written code. The one place every loader
    (init, run, the reward workers) gets them from, so all load the same environment."""
    kwargs = dict(cfg.environment.kwargs)
    if cfg.environment.name in SANDBOXED_ENVIRONMENTS:
        from veriroll.coordinator.code_environment import REWARD_BUDGET_SHARE

        kwargs["sandbox"] = cfg.sandbox.model_dump()
        kwargs.setdefault("time_budget_s", REWARD_BUDGET_SHARE * cfg.environment.reward_timeout_s)
    return kwargs


def sandbox_state(cfg) -> dict | None:
    """``{"mode", "isolated"}`` of the sandbox model-written code runs in, as ``/api/status`` and
    ``coordinator status`` show it; None for an environment that runs no such code. A coordinator
    running with this config has proven at start that the mode works (it refuses to start otherwise)."""
    if cfg.environment.name not in SANDBOXED_ENVIRONMENTS:
        return None
    return {"mode": cfg.sandbox.mode, "isolated": cfg.sandbox.mode == "bwrap"}


class EnvironmentLoadError(VerirollError, ValueError):
    """An environment spec names nothing loadable; the message says what was expected."""


def load_environment(spec: str, **kwargs) -> Environment:
    """The environment named by ``spec``: a built-in name, a ``module:attribute`` path, or
    ``verifiers:TASKSET`` / ``vf:TASKSET`` (coordinator/verifiers_adapter.py).

    The attribute may be an :class:`Environment` instance (then ``kwargs`` must be empty), an
    Environment subclass, or a factory; classes and factories are called with ``kwargs``.
    """
    if spec in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[spec](**kwargs)
    if spec.startswith(("verifiers:", "vf:")):
        from veriroll.coordinator.verifiers_adapter import load_verifiers_environment

        return load_verifiers_environment(spec, **kwargs)
    if ":" not in spec:
        raise EnvironmentLoadError(
            f"unknown environment {spec!r}: use a built-in ({', '.join(sorted(BUILTIN_ENVIRONMENTS))}), "
            "a 'module:attribute' path to an Environment, Environment subclass or factory, "
            "or 'vf:TASKSET' for a single-turn taskset of the verifiers library"
        )
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvironmentLoadError(
            f"environment {spec!r}: cannot import module {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    target = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as e:
            raise EnvironmentLoadError(f"environment {spec!r}: module {module_name!r} has no {attribute!r}") from e
    if isinstance(target, Environment):
        if kwargs:
            raise EnvironmentLoadError(
                f"environment {spec!r} is an instance; it takes no arguments (got {sorted(kwargs)})"
            )
        return target
    if not callable(target):
        raise EnvironmentLoadError(f"environment {spec!r} is a {type(target).__name__}, not an Environment or factory")
    env = target(**kwargs)
    if not isinstance(env, Environment):
        raise EnvironmentLoadError(
            f"environment {spec!r} returned a {type(env).__name__}; it must return a veriroll Environment"
        )
    return env
