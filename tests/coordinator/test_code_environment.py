"""The ``code`` environment: stdin/stdout tests of model-written programs, each run in the real bubblewrap
sandbox; verdicts the program cannot forge; a coordinator that will not start without isolation unless the
weaker mode is named, and says which mode it runs in."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import signal
import tempfile
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from support import build_tiny_checkpoint, make_coordinator_dir, running_coordinator

from veriroll.cli.main import main
from veriroll.coordinator.code_environment import (
    DEFAULT_SANDBOX,
    CodeEnvironment,
    extract_code,
    generated_problem,
    output_matches,
)
from veriroll.coordinator.config import SandboxConfig
from veriroll.coordinator.environments import EnvironmentLoadError, Prompt, load_environment
from veriroll.coordinator.rewards import RewardRunner
from veriroll.coordinator.sandbox import SandboxLimits, SandboxPool, SandboxUnavailable

# Small limits: a hanging test costs 2 s; every test of a sample runs at once.
SANDBOX = {"wall_s": 2.0, "cpu_s": 1, "pool_size": 4}


def _bwrap_works() -> str | None:
    try:
        SandboxPool(1, SandboxLimits(), warm=False).close()
    except SandboxUnavailable as error:
        return str(error)
    return None


UNAVAILABLE = _bwrap_works()
needs_bwrap = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no bubblewrap sandbox here: {UNAVAILABLE}")

ADD_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "3 4\n", "output": "7\n"},
             {"input": "10 20\n", "output": "30\n"}, {"input": "50 60\n", "output": "110\n"}]
CORRECT = "Here it is:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
HALF = "```python\na, b = map(int, input().split())\nprint(a + b if a < 10 else 0)\n```"
LOOP = "```python\nwhile True:\n    pass\n```"
FORK_BOMB = "```python\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n```"
# Forged verdicts: what a harness reading the program's own words would take for passes.
FORGED = [
    "```python\nprint('PASS')\nprint('ok')\nimport sys\nsys.exit(0)\n```",
    "```python\nfor i in range(100):\n    print(f'test {i}: PASS')\nprint('ALL TESTS PASSED')\n```",
    "```python\nimport os\nos._exit(0)\n```",  # the status alone is no pass
]


def _problem_file(tmp_path, name="problems.jsonl", rows=None):
    rows = rows if rows is not None else [{"prompt": "Read a and b; print a + b.", "tests": ADD_TESTS}]
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    if UNAVAILABLE is not None:
        pytest.skip(f"no bubblewrap sandbox here: {UNAVAILABLE}")
    environment = CodeEnvironment(data=str(_problem_file(tmp_path_factory.mktemp("code"))), sandbox=SANDBOX)
    yield environment
    environment.close()


def _prompt(env) -> Prompt:
    return env.sample_prompt(random.Random(0))


def test_code_is_the_last_python_block_else_the_last_block_else_everything():
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```py\ny = 2\n```\n```text\nz\n```") == "y = 2\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("print(2)") == "print(2)"
    assert output_matches("3  \n\n\n", "3\n") and not output_matches("3\n4\n", "3\n") and not output_matches("", "3")


def test_sandbox_defaults_are_the_config_sections():
    assert SandboxConfig().model_dump() == DEFAULT_SANDBOX


@needs_bwrap
def test_a_correct_program_scores_one_and_a_half_correct_one_half(env):
    prompt = _prompt(env)
    assert env.reward(prompt, CORRECT) == 1.0
    assert env.reward(prompt, HALF) == 0.5
    assert env.reward(prompt, "I cannot solve this.") == 0.0
    assert env.take_sandbox_kills() == {}


@needs_bwrap
@pytest.mark.parametrize("completion", [LOOP, FORK_BOMB], ids=["infinite_loop", "fork_bomb"])
def test_a_hanging_program_scores_zero_and_every_kill_is_counted(env, completion):
    env.take_sandbox_kills()
    assert env.reward(_prompt(env), completion) == 0.0
    kills = env.take_sandbox_kills()
    assert sum(kills.values()) == len(ADD_TESTS) and set(kills) <= {"timeout", "cpu_limit"}, kills
    assert env.reward(_prompt(env), CORRECT) == 1.0  # the pool serves on


@needs_bwrap
def test_one_hanging_test_fails_alone(env):
    hangs_on_ten = "```python\na, b = map(int, input().split())\nwhile a == 10:\n    pass\nprint(a + b)\n```"
    env.take_sandbox_kills()
    assert env.reward(_prompt(env), hangs_on_ten) == 0.75
    assert sum(env.take_sandbox_kills().values()) == 1


@needs_bwrap
def test_a_samples_tests_stop_at_its_time_budget_and_count_as_timeouts(tmp_path):
    """Eight hanging tests, two at a time, each allowed a minute of CPU and wall time by the sandbox: only the
    sample's 1.5 s budget can end them, so every one ends as a timeout (none reaches a sandbox limit: under
    load, a 1 s CPU limit could end one first), and the pool serves the next sample."""
    data = _problem_file(tmp_path, rows=[{"prompt": "Add.", "tests": ADD_TESTS * 2}])
    lenient = {**SANDBOX, "wall_s": 60.0, "cpu_s": 60, "pool_size": 2}
    environment = CodeEnvironment(data=str(data), sandbox=lenient, time_budget_s=1.5)
    try:
        assert environment.reward(_prompt(environment), LOOP) == 0.0
        assert environment.take_sandbox_kills() == {"timeout": 8}
        assert environment.reward(_prompt(environment), CORRECT) == 1.0  # the pool serves on
    finally:
        environment.close()


@needs_bwrap
@pytest.mark.parametrize("completion", FORGED)
def test_forged_pass_output_scores_zero(env, completion):
    assert env.reward(_prompt(env), completion) == 0.0


@needs_bwrap
def test_the_coordinator_key_cannot_be_the_answer(tmp_path):
    """A problem whose expected output is the coordinator key's content: read from the host, it would pass.
    In the sandbox the file is not there; in the weaker mode it is (the check is not vacuous)."""
    # Where the weaker mode's user (nobody, when tests run as root) can read it, as a careless operator's.
    folder = Path(tempfile.mkdtemp(prefix="veriroll-code-key-"))
    folder.chmod(0o755)
    key = folder / "coordinator.key"
    key.write_text("SECRET-KEY-MATERIAL")
    data = _problem_file(tmp_path, rows=[{"prompt": "Print the key.", "tests": [{"input": "", "output": key.read_text()}]}])
    steal = f"```python\nprint(open({str(key)!r}).read())\n```"
    isolated = CodeEnvironment(data=str(data), sandbox=SANDBOX)
    unsafe = CodeEnvironment(data=str(data), sandbox={**SANDBOX, "mode": "unsafe-subprocess"})
    try:
        assert isolated.reward(_prompt(isolated), steal) == 0.0
        assert unsafe.reward(_prompt(unsafe), steal) == 1.0
    finally:
        isolated.close()
        unsafe.close()
        shutil.rmtree(folder)


def _reference_solution(meta: dict) -> str:
    k = meta["k"]
    return [
        f"print(int(input()) + {k})",
        f"print(int(input()) * {k})",
        f"print(sum(map(int, input().split())) + {k})",
        f"print(max(map(int, input().split())) + {k})",
        f"print(sum(int(x) > {k} for x in input().split()))",
        f"s = input()\nprint(s[::-1])\nprint({k})",
        f"s = input()\nfor _ in range({k}):\n    print(s)",
        f"print(input().count({'abcdefgh'[k % 8]!r}))",
    ][meta["kind"]]


def test_generated_problems_are_many_distinct_and_seeded():
    prompts = [generated_problem(random.Random(seed))[0] for seed in range(500)]
    assert len(set(prompts)) > 400
    assert generated_problem(random.Random(7)) == generated_problem(random.Random(7))


@needs_bwrap
def test_every_kind_of_generated_problem_is_solvable():
    environment = load_environment("code", sandbox=SANDBOX)
    try:
        rng, seen = random.Random(1), {}
        while len(seen) < 8:
            prompt = environment.sample_prompt(rng)
            seen.setdefault(prompt.meta["kind"], prompt)
        for prompt in seen.values():
            assert environment.reward(prompt, f"```python\n{_reference_solution(prompt.meta)}\n```") == 1.0, prompt.text
            assert environment.reward(prompt, "```python\nprint(0)\n```") < 1.0
    finally:
        environment.close()


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_problems_load_with_renamed_columns_and_csv_tests_as_json(tmp_path, fmt, monkeypatch):
    monkeypatch.setattr(CodeEnvironment, "_prove_sandbox", lambda self: None)  # loading only
    if fmt == "jsonl":
        path = _problem_file(tmp_path, rows=[{"question": "Add.", "cases": ADD_TESTS}])
    else:
        path = tmp_path / "problems.csv"
        import csv

        with path.open("w", newline="") as f:
            csv.writer(f).writerows([["question", "cases"], ["Add.", json.dumps(ADD_TESTS)]])
    environment = CodeEnvironment(data=str(path), prompt_column="question", tests_column="cases")
    prompt = environment.sample_prompt(random.Random(0))
    assert prompt.text.startswith("Add.") and json.loads(prompt.answer) == ADD_TESTS


@pytest.mark.parametrize("rows, says", [
    ([{"prompt": "Add.", "solution": "x"}], "no column 'tests'"),
    ([{"prompt": "Add.", "tests": []}], "non-empty list"),
    ([{"prompt": "Add.", "tests": [{"stdin": "1", "stdout": "1"}]}], '"input" (stdin)'),
    ([{"prompt": "Add.", "tests": "not json"}], "not JSON"),
])
def test_bad_data_is_refused_with_what_is_wrong(tmp_path, rows, says):
    with pytest.raises(EnvironmentLoadError, match="code environment") as caught:
        CodeEnvironment(data=str(_problem_file(tmp_path, rows=rows)))
    assert says in str(caught.value)


def _hide_bwrap(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **kw: None if name == "bwrap" else real_which(name, *a, **kw))


def test_without_bubblewrap_the_environment_refuses_and_names_the_weaker_mode(monkeypatch, caplog):
    _hide_bwrap(monkeypatch)
    with pytest.raises(EnvironmentLoadError) as caught:
        load_environment("code")
    assert "bubblewrap" in str(caught.value) and 'sandbox.mode = "unsafe-subprocess"' in str(caught.value).replace("'", '"')
    caplog.set_level(logging.WARNING, logger="veriroll.coordinator.sandbox")
    environment = load_environment("code", sandbox={"mode": "unsafe-subprocess"})
    assert not environment.isolated
    assert any("WITHOUT isolation" in r.getMessage() for r in caplog.records)


def _init(tmp_path, *extra):
    return main(["coordinator", "init", "--dir", str(tmp_path / "coord"), "--json", *extra])


def test_init_refuses_the_code_environment_without_isolation_unless_the_weaker_mode_is_named(tmp_path, capsys,
                                                                                           monkeypatch):
    src = build_tiny_checkpoint(tmp_path / "tiny")
    _hide_bwrap(monkeypatch)
    assert _init(tmp_path, "--model", str(src), "--env", "code") == 2
    err = capsys.readouterr().err
    assert "bubblewrap" in err and "unsafe-subprocess" in err, err
    assert not (tmp_path / "coord").exists()
    assert _init(tmp_path, "--model", str(src), "--env", "code", "--set", "sandbox.mode=unsafe-subprocess") == 0
    assert 'mode = "unsafe-subprocess"' in (tmp_path / "coord" / "coordinator.toml").read_text()


def _code_coordinator_dir(tmp_path, mode: str):
    base = make_coordinator_dir(tmp_path, {"environment.name": "code", "environment.kwargs": {},
                                           "sandbox.mode": mode, "sandbox.wall_s": 2.0, "sandbox.cpu_s": 1})
    version0 = base / "checkpoints" / "versions" / "v000000"
    shutil.rmtree(version0)
    # Every printable character is a token: completions decode to exactly the program text.
    build_tiny_checkpoint(version0, alphabet="".join(chr(c) for c in range(32, 127)) + "\n")
    return base


def test_a_coordinator_refuses_to_start_without_isolation_and_shows_the_weaker_mode(tmp_path, monkeypatch, caplog,
                                                                                    capsys):
    from veriroll.coordinator.app import start_coordinator

    _hide_bwrap(monkeypatch)
    base = _code_coordinator_dir(tmp_path, "bwrap")
    with pytest.raises(EnvironmentLoadError, match="unsafe-subprocess"):
        asyncio.run(start_coordinator(base))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["coordinator", "run", "--dir", str(base)]) == 2
    finally:  # `run` installs its stop handlers: give pytest its own back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert "unsafe-subprocess" in capsys.readouterr().err

    caplog.set_level(logging.WARNING, logger="veriroll.coordinator")

    async def scenario():
        async with running_coordinator(base, overrides=["sandbox.mode=unsafe-subprocess"]) as coord, \
                aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{coord.http_port}/api/status") as r:
            return json.loads(await r.read())

    assert asyncio.run(scenario())["sandbox"] == {"mode": "unsafe-subprocess", "isolated": False}
    assert any("WITHOUT isolation" in r.getMessage() for r in caplog.records)


@needs_bwrap
def test_a_submitted_group_is_scored_through_the_reward_workers_and_kills_are_exported(tmp_path, capsys):
    from veriroll.coordinator.intake import Submission, SubmittedSample

    base = _code_coordinator_dir(tmp_path, "bwrap")
    prompt = CodeEnvironment(data=str(_problem_file(tmp_path)), sandbox=SANDBOX).sample_prompt(random.Random(0))
    completions = [CORRECT, HALF, LOOP, FORGED[1]]

    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
            svc = coord.service
            samples = [SubmittedSample(np.asarray(svc.codec.encode(c), dtype=np.int32), np.zeros(1, np.float32), b"",
                                       "stop") for c in completions]
            row = {"prompt_id": 1, "text": prompt.text, "answer": prompt.answer, "env": "code", "meta": "{}"}
            rewards = await svc.intake.score(row, Submission("lease", 0, samples))
            async with s.get(f"http://127.0.0.1:{coord.http_port}/metrics") as r:
                metrics = (await r.text())
            async with s.get(f"http://127.0.0.1:{coord.http_port}/api/status") as r:
                status = json.loads(await r.read())
            return rewards, metrics, status

    rewards, metrics, status = asyncio.run(scenario())
    assert rewards == [1.0, 0.5, 0.0, 0.0]
    kills = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
             if line.startswith("veriroll_sandbox_kills_total{")}
    assert sum(kills.values()) == len(ADD_TESTS), metrics
    assert status["sandbox"] == {"mode": "bwrap", "isolated": True}
    assert main(["coordinator", "status", "--dir", str(base), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sandbox"] == {"mode": "bwrap", "isolated": True}


@needs_bwrap
def test_the_reward_runner_returns_each_groups_sandbox_kills(tmp_path):
    data = str(_problem_file(tmp_path))
    prompt = CodeEnvironment(data=data, sandbox=SANDBOX).sample_prompt(random.Random(0))
    runner = RewardRunner("code", {"data": data, "sandbox": SANDBOX}, timeout_s=20)
    try:
        result = runner.score_group(prompt, [CORRECT, LOOP])
        assert result.rewards == [1.0, 0.0] and result.errors == [None, None]
        assert sum(result.sandbox_kills.values()) == len(ADD_TESTS)
        assert runner.score_group(prompt, [CORRECT]).sandbox_kills == {}
    finally:
        runner.close()


def test_only_environments_that_run_code_get_the_sandbox_settings_and_a_status():
    from veriroll.coordinator.config import CoordinatorConfig
    from veriroll.coordinator.environments import environment_kwargs, sandbox_state

    code = CoordinatorConfig.model_validate({"environment": {"name": "code", "kwargs": {"limit": 3},
                                                             "reward_timeout_s": 10.0},
                                             "sandbox": {"mode": "unsafe-subprocess", "pool_size": 2}})
    kwargs = environment_kwargs(code)
    assert kwargs["limit"] == 3 and kwargs["time_budget_s"] == 8.0
    assert kwargs["sandbox"]["mode"] == "unsafe-subprocess" and kwargs["sandbox"]["pool_size"] == 2
    assert sandbox_state(code) == {"mode": "unsafe-subprocess", "isolated": False}
    math = CoordinatorConfig.model_validate({"environment": {"name": "math", "kwargs": {"limit": 3}}})
    assert environment_kwargs(math) == {"limit": 3} and sandbox_state(math) is None
