"""The built-in ``code`` environment: programming problems with tests, the reward the share passed.

Problems come from a dataset file (JSONL, JSON, CSV or Parquet, read offline through ``datasets``;
``prompt`` and ``tests`` columns unless renamed) or, when no file is given, from a generator of easy
problems with many distinct prompts, so that smoke tests need no download.

A test is a stdin/stdout pair, ``{"input": "3 4\\n", "output": "7\\n"}``; a row's ``tests`` is a list
of them (in a CSV, that list as a JSON string). The model writes a whole Python 3 program; its code is
the last ```` ```python ```` fenced block of the completion (else the last fenced block, else the whole
completion). Each test is one run of that program in the sandbox (coordinator/sandbox.py) with the
test's input as stdin. A test passes when the run ended on its own with status 0 and its stdout equals
the expected output, compared line by line with trailing whitespace and trailing blank lines ignored.
The reward is the share of tests passed. A run that hangs, crashes or exceeds a limit fails that test
only: every test is its own container. A sample's tests run at once (up to the pool's size) within a
shared time budget, a share of the reward's time limit, so a hanging program never reaches that limit.

Why stdin/stdout pairs and not assert snippets: a verdict must not be something the program can say
about itself. Code run in the same interpreter as an ``assert`` can end the process with status 0 before
the assert runs (``os._exit(0)``), return objects whose ``__eq__`` is always true, or find any secret
marker the harness would print (it is a constant in the code object, reachable by frame inspection). Here
the expected output never enters the sandbox: the coordinator compares what the program printed with it,
outside. A program that prints "PASS" or "ok" has printed a wrong answer; the only way to pass a test
is to print its expected output, which is solving it.

The sandbox pool lives in the process that scores: a reward worker process (coordinator/rewards.py)
creates one, lazily, on its first sample, and uses it from that thread only (a pool is bound to the
thread that started its containers). Creating the environment proves that a sandbox can be created
here (one container runs ``pass``) and otherwise raises :class:`EnvironmentLoadError` naming what is
missing: the coordinator refuses to start rather than score code outside a sandbox. Only the named
weaker mode (``sandbox.mode = "unsafe-subprocess"``) runs it without isolation, with a warning.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
from collections import Counter
from pathlib import Path

from veriroll.coordinator.environments import (
    Environment,
    EnvironmentLoadError,
    Prompt,
    RewardFunction,
    Rubric,
)
from veriroll.coordinator.math_environment import read_data_file
from veriroll.coordinator.sandbox import (
    BWRAP_MODE,
    UNSAFE_SUBPROCESS_MODE,
    KillReason,
    SandboxLimits,
    SandboxPool,
    SandboxResult,
    SandboxUnavailable,
)

__all__ = [
    "DEFAULT_INSTRUCTION",
    "CodeEnvironment",
    "extract_code",
    "generated_problem",
    "output_matches",
    "parse_tests",
]

DEFAULT_INSTRUCTION = ("Write a complete Python 3 program that reads standard input and writes the answer to "
                       "standard output. Put the program in one ```python code block.")
DEFAULT_SANDBOX = {"mode": BWRAP_MODE, "pool_size": 4, "wall_s": 3.0, "cpu_s": 2, "memory_mb": 512, "processes": 16,
                   "output_bytes": 1 << 20}
"""The sandbox settings when none are given (the coordinator passes its ``[sandbox]`` section)."""
REWARD_BUDGET_SHARE = 0.8
"""Share of the reward's per-sample time limit the tests of a sample may take together: the rest is left for
starting, comparing and answering, so the limit itself (which kills the reward worker) is never reached."""

# ---------------------------------------------------------------------------------------------------
# Code extraction and test verdicts

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The program in a completion: the last ```` ```python ```` (or ``py``/``python3``) fenced block, else
    the last fenced block of any language, else the whole completion."""
    blocks = _FENCE.findall(completion)
    python = [body for language, body in blocks if language.lower() in ("python", "py", "python3")]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def _normalized(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def output_matches(got: str, expected: str) -> bool:
    """Whether a program's stdout is the expected output: equal line by line, trailing whitespace on each
    line and trailing blank lines ignored."""
    return _normalized(got) == _normalized(expected)


def parse_tests(value, where: str) -> list[dict]:
    """A row's tests as ``[{"input": str, "output": str}, ...]``: a list of such objects, or that list as a
    JSON string (CSV). Raises :class:`EnvironmentLoadError` saying what is wrong, and ``where``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise EnvironmentLoadError(f"code environment: {where}: tests is a string but not JSON: {e}") from e
    if not isinstance(value, list) or not value:
        raise EnvironmentLoadError(f"code environment: {where}: tests must be a non-empty list of "
                                   f'{{"input": ..., "output": ...}} objects, not {type(value).__name__}')
    tests = []
    for i, test in enumerate(value):
        if not isinstance(test, dict) or not isinstance(test.get("input"), str) \
                or not isinstance(test.get("output"), str):
            raise EnvironmentLoadError(f"code environment: {where}: test {i} must be an object with string "
                                       f'"input" (stdin) and "output" (expected stdout), not {test!r:.120}')
        tests.append({"input": test["input"], "output": test["output"]})
    return tests


# ---------------------------------------------------------------------------------------------------
# Generated problems


_LETTERS = "abcdefgh"


def _words(rng: random.Random) -> str:
    return " ".join("".join(rng.choice(_LETTERS) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5)))


def _numbers(rng: random.Random) -> str:
    return " ".join(str(rng.randint(-50, 50)) for _ in range(rng.randint(1, 8)))


_WIDE, _FEW = (1, 99), (2, 9)  # the range of a problem's k: wide where any k reads well, few for repeats

_PROBLEMS = (  # (statement with {k} or {letter}, range of k, the answer to a stdin given k, a stdin drawn with rng)
    ("The input is one integer n. Print n + {k}.", _WIDE, lambda s, k: str(int(s) + k),
     lambda rng: str(rng.randint(-100, 100))),
    ("The input is one integer n. Print n * {k}.", _WIDE, lambda s, k: str(int(s) * k),
     lambda rng: str(rng.randint(-100, 100))),
    ("The input is two integers a and b on one line. Print a + b + {k}.", _WIDE,
     lambda s, k: str(sum(map(int, s.split())) + k), lambda rng: f"{rng.randint(-99, 99)} {rng.randint(-99, 99)}"),
    ("The input is one line of integers separated by spaces. Print the largest of them plus {k}.", _WIDE,
     lambda s, k: str(max(map(int, s.split())) + k), _numbers),
    ("The input is one line of integers separated by spaces. Print how many of them are greater than {k}.", _WIDE,
     lambda s, k: str(sum(int(x) > k for x in s.split())), _numbers),
    ("The input is one line of text. Print it reversed, then the number {k} on the next line.", _WIDE,
     lambda s, k: f"{s[::-1]}\n{k}", _words),
    ("The input is one line of text. Print it {k} times, each on its own line.", _FEW,
     lambda s, k: "\n".join([s] * k), _words),
    ("The input is one line of lowercase words. Print how many times the letter '{letter}' occurs in it.", _FEW,
     lambda s, k: str(s.count(_LETTERS[k % 8])), _words),
)
TESTS_PER_GENERATED_PROBLEM = 4


def generated_problem(rng: random.Random) -> tuple[str, list[dict], dict]:
    """(statement, tests, meta) of an easy stdin/stdout problem, drawn with ``rng`` only (a seed reproduces
    it): one of a few kinds, each with a parameter ``k`` in the statement, so prompts are many and distinct."""
    kind = rng.randrange(len(_PROBLEMS))
    statement, (low, high), answer, draw = _PROBLEMS[kind]
    k = rng.randint(low, high)
    text = statement.format(k=k, letter=_LETTERS[k % 8])
    # The example is not one of the tests: a program that hard-codes it gains nothing.
    example, *inputs = [draw(rng) for _ in range(TESTS_PER_GENERATED_PROBLEM + 1)]
    tests = [{"input": s + "\n", "output": answer(s, k) + "\n"} for s in inputs]
    text += f"\n\nExample input:\n{example}\nExample output:\n{answer(example, k)}\n"
    return text, tests, {"kind": kind, "k": k}


# ---------------------------------------------------------------------------------------------------
# The environment


def _load_rows(data: str, prompt_column: str, tests_column: str, split: str, limit: int | None) -> list[tuple[str, list]]:
    path = Path(data).expanduser()
    ds = read_data_file("code", data, {"prompt_column": prompt_column, "tests_column": tests_column}, split, limit)
    rows = []
    for i, (prompt, tests) in enumerate(zip(ds[prompt_column], ds[tests_column], strict=True)):
        if prompt is None or not str(prompt).strip():
            raise EnvironmentLoadError(f"code environment: {str(path)!r} row {i}: empty {prompt_column!r}")
        rows.append((str(prompt), parse_tests(tests, f"{str(path)!r} row {i}")))
    if not rows:
        raise EnvironmentLoadError(f"code environment: {str(path)!r} has no rows")
    return rows


def sandbox_settings(sandbox: dict | None) -> dict:
    """The sandbox settings with defaults filled in; unknown names are refused."""
    settings = {**DEFAULT_SANDBOX, **(sandbox or {})}
    unknown = sorted(set(settings) - set(DEFAULT_SANDBOX))
    if unknown:
        raise EnvironmentLoadError(f"code environment: unknown sandbox settings {unknown}; known: {sorted(DEFAULT_SANDBOX)}")
    return settings


class CodeEnvironment(Environment):
    """Programming problems with stdin/stdout tests, run in the sandbox; reward = share of tests passed.

    ``data``: a ``.jsonl``, ``.json``, ``.csv`` or ``.parquet`` file with ``prompt_column`` (the problem
    statement) and ``tests_column`` (see :func:`parse_tests`); None draws generated problems. ``split``,
    ``limit``, ``instruction`` as in the ``math`` environment. ``sandbox``: the coordinator's ``[sandbox]``
    section as a dict (mode, pool_size per scoring process, per-test limits); see :data:`DEFAULT_SANDBOX`.
    ``time_budget_s``: the wall time all of one sample's tests may take together (the coordinator passes
    :data:`REWARD_BUDGET_SHARE` of ``environment.reward_timeout_s``); tests still running then fail, counted
    as ``timeout`` kills, so hanging programs never cost the reward worker its life. None: no budget.
    """

    def __init__(
        self,
        *,
        data: str | None = None,
        prompt_column: str = "prompt",
        tests_column: str = "tests",
        split: str = "train",
        limit: int | None = None,
        instruction: str = DEFAULT_INSTRUCTION,
        max_new_tokens: int = 512,
        sandbox: dict | None = None,
        time_budget_s: float | None = None,
        name: str = "code",
    ):
        if limit is not None and limit < 1:
            raise EnvironmentLoadError(f"code environment: limit must be >= 1, got {limit}")
        self.settings = sandbox_settings(sandbox)
        self.mode = self.settings["mode"]
        self.limits = SandboxLimits(wall_s=float(self.settings["wall_s"]), cpu_s=int(self.settings["cpu_s"]),
                                    memory_bytes=int(self.settings["memory_mb"]) << 20,
                                    processes=int(self.settings["processes"]),
                                    output_bytes=int(self.settings["output_bytes"]))
        if time_budget_s is not None and time_budget_s <= 0:
            raise EnvironmentLoadError(f"code environment: time_budget_s must be positive, got {time_budget_s}")
        self.time_budget_s = time_budget_s
        self.instruction = instruction
        self.rows = None if data is None else _load_rows(str(data), prompt_column, tests_column, split, limit)
        self._prove_sandbox()
        self._local = threading.local()  # this thread's pool: see _pool
        self._kills: Counter[str] = Counter()
        self._kills_lock = threading.Lock()
        super().__init__(
            name,
            Rubric([RewardFunction(self.tests_passed, 1.0, "tests_passed")]),
            alphabet="".join(chr(c) for c in range(32, 127)) + "\n",
            max_new_tokens=max_new_tokens,
        )

    @property
    def isolated(self) -> bool:
        """Whether model code runs in a container (False only in the named weaker mode)."""
        return self.mode == BWRAP_MODE

    def _prove_sandbox(self) -> None:
        """Fail closed: start one sandbox (it runs ``pass``) or raise saying what is missing and how to allow
        the weaker mode. In that mode, the pool logs its warning here, at start."""
        try:
            SandboxPool(1, self.limits, mode=self.mode, warm=False).close()
        except SandboxUnavailable as e:
            raise EnvironmentLoadError(
                f"code environment: model-written code cannot be isolated here: {e}. Install bubblewrap (Debian/"
                f"Ubuntu: apt-get install -y bubblewrap) where unprivileged user namespaces work, or allow the "
                f"weaker mode by name: sandbox.mode = {UNSAFE_SUBPROCESS_MODE!r} in coordinator.toml (or --set "
                f"sandbox.mode={UNSAFE_SUBPROCESS_MODE}), which runs that code WITHOUT isolation") from e
        except ValueError as e:
            raise EnvironmentLoadError(f"code environment: {e}") from e

    def sandbox_pool(self) -> SandboxPool:
        """This thread's pool, created on first use: a pool's containers die with the thread that started
        them, so each thread that scores (one per reward worker process) has its own."""
        pool = getattr(self._local, "pool", None)
        if pool is None:  # a tool call of a multi-turn episode would run in this same pool
            pool = self._local.pool = SandboxPool(int(self.settings["pool_size"]), self.limits, mode=self.mode)
        return pool

    def sample_prompt(self, rng: random.Random) -> Prompt:
        if self.rows is None:
            statement, tests, meta = generated_problem(rng)
        else:
            index = rng.randrange(len(self.rows))
            (statement, tests), meta = self.rows[index], {"row": index}
        text = f"{statement}\n\n{self.instruction}" if self.instruction else statement
        # The tests travel as the prompt's answer (stored with it): scoring needs nothing but the prompt.
        return Prompt(text=text, answer=json.dumps(tests), env=self.name, meta=meta,
                      messages=[{"role": "user", "content": text}])

    def test_results(self, prompt: Prompt, completion: str) -> list[bool]:
        """Whether each of the prompt's tests passed, each a run of the completion's program in the sandbox."""
        tests = parse_tests(prompt.answer, "prompt answer")
        code = extract_code(completion)
        pool = self.sandbox_pool()

        async def all_tests() -> list[SandboxResult | None]:
            runs = [asyncio.ensure_future(pool.run(code, stdin=test["input"])) for test in tests]
            _, late = await asyncio.wait(runs, timeout=self.time_budget_s)
            for run in late:  # a cancelled run kills its container and frees its slot (coordinator/sandbox.py)
                run.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            return [None if run in late else run.result() for run in runs]

        results = asyncio.run(all_tests())
        passed = []
        for test, result in zip(tests, results, strict=True):
            reason = KillReason.TIMEOUT if result is None else result.killed_reason
            if reason is not None:
                with self._kills_lock:
                    self._kills[str(reason)] += 1
            # The verdict is this process's comparison with an output the sandbox never saw; nothing the
            # program printed is read as a verdict.
            passed.append(result is not None and result.ok and output_matches(result.stdout, test["output"]))
        return passed

    def tests_passed(self, prompt: Prompt, completion: str) -> float:
        """The share of the prompt's tests the completion's program passes."""
        passed = self.test_results(prompt, completion)
        return sum(passed) / len(passed)

    def take_sandbox_kills(self) -> dict[str, int]:
        """Sandbox runs killed since the last call, by reason (``KillReason``); the counts restart at zero.
        The reward worker sends them with each group's result (coordinator/rewards.py)."""
        with self._kills_lock:
            kills, self._kills = dict(self._kills), Counter()
        return kills

    def close(self) -> None:
        """Close this thread's pool (other threads' pools die with their threads' processes)."""
        pool = getattr(self._local, "pool", None)
        if pool is not None:
            pool.close()
            self._local.pool = None
