"""Built-in environments, rubrics, and loading environments by spec."""

from __future__ import annotations

import random
import re
import textwrap

import pytest

from veriroll.coordinator.environments import (
    ArithmeticEnvironment,
    Environment,
    EnvironmentLoadError,
    Prompt,
    RewardFunction,
    Rubric,
    levenshtein,
    load_environment,
)


def test_arithmetic_prompts_are_sums_with_their_answer():
    env = load_environment("arithmetic", min_digits=1, max_digits=2)
    prompts = env.sample_prompts(random.Random(0), 200)
    for p in prompts:
        m = re.fullmatch(r"(\d+)\+(\d+)=", p.text)
        assert m, p.text
        a, b = int(m[1]), int(m[2])
        assert p.answer == str(a + b) and p.meta == {"a": a, "b": b} and p.env == "arithmetic"
        assert a < 100 and b < 100
        assert set(p.text + p.answer) <= set(env.alphabet)
    assert any(p.meta["a"] >= 10 for p in prompts) and any(p.meta["a"] < 10 for p in prompts)
    assert env.max_new_tokens >= len("198") + 1


def test_arithmetic_default_is_single_digit_and_example_format():
    env = load_environment("arithmetic")
    assert all(p.meta["a"] < 10 and p.meta["b"] < 10 for p in env.sample_prompts(random.Random(1), 100))
    p = Prompt(text="23+58=", answer="81", env="arithmetic", meta={})
    assert env.reward(p, "81") == 1.0
    assert env.reward(p, " 81\n") == 1.0
    assert env.reward(p, "8") == 0.0
    assert env.reward(p, "811") == 0.0
    assert env.reward(p, "") == 0.0


def test_same_seed_gives_same_prompts():
    env = load_environment("arithmetic", max_digits=3)
    assert env.sample_prompts(random.Random(7), 20) == env.sample_prompts(random.Random(7), 20)
    assert env.sample_prompts(random.Random(7), 20) != env.sample_prompts(random.Random(8), 20)


def test_arithmetic_rejects_bad_digit_ranges():
    with pytest.raises(ValueError):
        ArithmeticEnvironment(min_digits=3, max_digits=2)


def test_reverse_text_gives_partial_credit_by_edit_distance():
    env = load_environment("reverse-text", min_length=4, max_length=4)
    for p in env.sample_prompts(random.Random(0), 20):
        assert p.text == p.meta["text"] + "|" and p.answer == p.meta["text"][::-1] and len(p.answer) == 4
        assert set(p.text + p.answer) <= set(env.alphabet)
    p = Prompt(text="abcd|", answer="dcba", env="reverse-text", meta={})
    assert env.reward(p, "dcba") == 1.0
    assert env.reward(p, "dcbx") == pytest.approx(0.75)  # one substitution in 4
    assert env.reward(p, "dcb") == pytest.approx(0.75)  # one deletion, longest 4
    assert env.reward(p, "dcbaaa") == pytest.approx(1 - 2 / 6)
    assert env.reward(p, "abcd") == pytest.approx(0.0)  # 4 substitutions
    assert env.reward(p, "") == 0.0


def test_levenshtein_known_values():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("same", "same") == 0


def test_rubric_is_a_weighted_mean_clamped_to_unit_interval():
    def always_one(prompt, completion):
        return 1.0

    def always_zero(prompt, completion):
        return 0.0

    def too_much(prompt, completion):
        return 5.0

    p = Prompt("x", "y", "t", {})
    rubric = Rubric([RewardFunction(always_one, 3.0), RewardFunction(always_zero, 1.0)])
    assert rubric.score(p, "") == pytest.approx(0.75)
    assert rubric.scores(p, "") == {"always_one": 1.0, "always_zero": 0.0}
    assert Rubric([RewardFunction(too_much)]).score(p, "") == 1.0
    with pytest.raises(ValueError):
        Rubric([])
    with pytest.raises(ValueError):
        RewardFunction(always_one, -1.0)


USER_MODULE = textwrap.dedent(
    """
    import random
    from veriroll.coordinator.environments import Environment, Prompt, RewardFunction, Rubric

    def _prompt(rng):
        return Prompt(text="ab", answer="ba", env="user", meta={})

    def _echo(prompt, completion):
        return float(completion == prompt.answer)

    def make(suffix="", **_):
        return Environment("user" + suffix, Rubric([RewardFunction(_echo)]), alphabet="ab", max_new_tokens=3,
                           prompt_fn=_prompt)

    INSTANCE = make()

    class UserEnv(Environment):
        def __init__(self, width=2):
            super().__init__("user-class", Rubric([RewardFunction(_echo)]), alphabet="ab", max_new_tokens=width)

        def sample_prompt(self, rng):
            return _prompt(rng)

    def not_an_env():
        return 42

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "veriroll_test_user_env.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "veriroll_test_user_env"


def test_user_environment_loads_from_instance_class_or_factory(user_module):
    env = load_environment(f"{user_module}:INSTANCE")
    assert isinstance(env, Environment) and env.name == "user"
    assert env.sample_prompts(random.Random(0), 2)[0].text == "ab"
    assert env.reward(env.sample_prompt(random.Random(0)), "ba") == 1.0

    env = load_environment(f"{user_module}:UserEnv", width=5)
    assert env.name == "user-class" and env.max_new_tokens == 5

    env = load_environment(f"{user_module}:make", suffix="-2")
    assert env.name == "user-2"


def test_unknown_or_broken_specs_say_what_is_expected(user_module):
    with pytest.raises(EnvironmentLoadError, match="arithmetic.*reverse-text.*module:attribute"):
        load_environment("chess")
    with pytest.raises(EnvironmentLoadError, match="cannot import"):
        load_environment("no_such_module_veriroll:env")
    with pytest.raises(EnvironmentLoadError, match="has no 'missing'"):
        load_environment(f"{user_module}:missing")
    with pytest.raises(EnvironmentLoadError, match="must return a veriroll Environment"):
        load_environment(f"{user_module}:not_an_env")
    with pytest.raises(EnvironmentLoadError, match="not an Environment"):
        load_environment(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(EnvironmentLoadError, match="takes no arguments"):
        load_environment(f"{user_module}:INSTANCE", width=3)
    assert issubclass(EnvironmentLoadError, ValueError)
