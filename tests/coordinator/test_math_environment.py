"""The built-in ``math`` environment: dataset files, generated word problems, answer extraction, math-verify scoring."""

from __future__ import annotations

import json
import random
import re

import pytest

from veriroll.coordinator.environments import EnvironmentLoadError, Prompt, load_environment
from veriroll.coordinator.math_environment import (
    DEFAULT_INSTRUCTION,
    extract_answer,
    math_verify_reward,
    reference_answer,
    word_problem,
)


@pytest.mark.parametrize("completion, expected", [
    ("The answer is \\boxed{42}.", "42"),
    ("so \\boxed{\\frac{3}{4}} and then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
    ("nested \\boxed{\\frac{\\sqrt{2}}{2}} done", "\\frac{\\sqrt{2}}{2}"),
    ("First 3 apples, then 12, so 15", "15"),
    ("it is -7 degrees", "-7"),
    ("costs 3.25 dollars", "3.25"),
    ("a total of 1,234,567 stars", "1234567"),
    ("half: 1/2", "1/2"),
    ("unclosed \\boxed{12 but 13 at the end", "13"),  # a box never closed is not an answer; the last number is
    ("no digits here", None),
    ("", None),
])
def test_answer_is_the_last_box_else_the_last_number(completion, expected):
    assert extract_answer(completion) == expected


def test_reference_answers_take_the_part_after_gsm8k_marks_or_the_box():
    assert reference_answer("She has 3 + 4 = 7 left.\n#### 7") == "7"
    assert reference_answer("#### 1,200") == "1200"
    assert reference_answer("\\boxed{\\frac{1}{3}}") == "\\frac{1}{3}"
    assert reference_answer(" 42 ") == "42"


@pytest.mark.parametrize("answer, completion, reward", [
    ("42", "\\boxed{42}", 1.0),
    ("42", "It is 42.", 1.0),
    ("42", "42.0", 1.0),
    ("0.75", "\\boxed{\\frac{3}{4}}", 1.0),
    ("3/4", "so 0.75", 1.0),
    ("1234", "1,234", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("-5", "\\boxed{-5}", 1.0),
    ("Working: 2+2 = 4\n#### 4", "The answer is 4", 1.0),
    ("42", "\\boxed{43}", 0.0),
    ("42", "41.99", 0.0),  # close is wrong: no partial credit
    ("100", "1000", 0.0),
    ("42", "I do not know", 0.0),
    ("42", "\\boxed{42} then actually 41", 1.0),  # a box wins over later numbers
])
def test_math_verify_scores_equivalent_answers_one_and_others_zero(answer, completion, reward):
    assert math_verify_reward(Prompt("q", answer, "math"), completion) == reward


@pytest.mark.parametrize("answer, completion, reward", [
    ("1024", "\\boxed{2^{10}}", 1.0),
    ("24", "\\boxed{4!}", 1.0),
    ("0.5", "\\boxed{2^{-1}}", 1.0),
    # Comparing these would keep sympy busy without bound (verify evaluates them): scored wrong at once.
    ("42", "\\boxed{9^{9^{9^{9}}}}", 0.0),
    ("42", "\\boxed{(10^{6})!}", 0.0),
    ("42", "\\boxed{10^{10^{10}}!}", 0.0),
    ("42", "\\boxed{2^{100000000}}", 0.0),
])
def test_powers_and_factorials_are_compared_unless_unbounded(answer, completion, reward):
    assert math_verify_reward(Prompt("q", answer, "math"), completion) == reward


def _numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def test_generated_word_problems_are_seeded_and_answered():
    env = load_environment("math")
    prompts = env.sample_prompts(random.Random(3), 50)
    assert prompts == env.sample_prompts(random.Random(3), 50)
    assert prompts != env.sample_prompts(random.Random(4), 50)
    for p in prompts:
        assert p.text.endswith("\n" + DEFAULT_INSTRUCTION) and p.messages == [{"role": "user", "content": p.text}]
        assert p.env == "math" and p.meta == {"difficulty": 1}
        a, b = _numbers(p.text.split("\n")[0])
        assert int(p.answer) in (a + b, a - b)  # difficulty 1: one addition or subtraction
        assert max(a, b) <= 20 and int(p.answer) >= 1
        assert env.reward(p, f"So the answer is \\boxed{{{p.answer}}}.") == 1.0
        assert env.reward(p, f"\\boxed{{{int(p.answer) + 1}}}") == 0.0
    assert len({p.text.split(".")[1] for p in prompts}) >= 4  # varied sentence templates


def test_difficulty_adds_steps_and_range():
    rng = random.Random(0)
    easy = [word_problem(rng, 1) for _ in range(200)]
    hard = [word_problem(rng, 5) for _ in range(200)]
    assert max(max(_numbers(t)) for t, _ in easy) <= 20
    assert max(max(_numbers(t)) for t, _ in hard) > 100
    assert max(t.count(".") for t, _ in easy) == 2  # the start and one step
    assert max(t.count(".") for t, _ in hard) == 4  # the start and three steps
    assert all(isinstance(a, int) and a >= 1 for _, a in easy + hard)
    # The answer follows from the text: replay the operations of a few multi-step problems.
    for text, answer in hard[:50]:
        total = _numbers(text.split(".")[0])[0]
        for sentence in text.split(".")[1:-1]:
            nums = _numbers(sentence)
            if "boxes" in sentence or "bags" in sentence:
                total += nums[0] * nums[1]
            elif any(w in sentence for w in ("gives", "sells", "loses", "donates")) and "gives him" not in sentence \
                    and "gives her" not in sentence:
                total -= nums[0]
            else:
                total += nums[0]
        assert total == answer, text
    with pytest.raises(EnvironmentLoadError, match="difficulty"):
        load_environment("math", difficulty=0)


ROWS = [{"problem": "What is 6 times 7?", "solution": "42"},
        {"problem": "Half of 3?", "solution": "3/2"},
        {"problem": "Ten minus twelve?", "solution": "-2"}]


def _write(path, fmt):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif fmt == "json":
        path.write_text(json.dumps(ROWS))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.to_parquet(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_problems_load_from_each_file_format_with_renamed_columns(tmp_path, fmt):
    path = _write(tmp_path / f"problems.{fmt}", fmt)
    env = load_environment("math", data=str(path), question_column="problem", answer_column="solution",
                           instruction="")
    prompts = env.sample_prompts(random.Random(0), 30)
    assert {p.text for p in prompts} == {r["problem"] for r in ROWS}
    for p in prompts:
        assert p.answer == ROWS[p.meta["row"]]["solution"]
    half = next(p for p in prompts if p.text == "Half of 3?")
    assert env.reward(half, "That is \\boxed{1.5}") == 1.0
    assert env.reward(half, "That is \\boxed{1.6}") == 0.0


def test_limit_keeps_the_first_rows(tmp_path):
    env = load_environment("math", data=str(_write(tmp_path / "p.jsonl", "jsonl")), question_column="problem",
                           answer_column="solution", limit=1)
    assert {p.meta["row"] for p in env.sample_prompts(random.Random(0), 20)} == {0}


def test_bad_data_files_are_clear_errors(tmp_path):
    with pytest.raises(EnvironmentLoadError, match="does not exist"):
        load_environment("math", data=str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(EnvironmentLoadError, match="is empty"):
        load_environment("math", data=str(tmp_path / "empty.jsonl"))
    (tmp_path / "p.txt").write_text("What is 1+1? 2")
    with pytest.raises(EnvironmentLoadError, match=r"unknown file type '\.txt'.*\.jsonl"):
        load_environment("math", data=str(tmp_path / "p.txt"))
    path = _write(tmp_path / "p.jsonl", "jsonl")
    with pytest.raises(EnvironmentLoadError, match="no column 'question', 'answer'; its columns are 'problem', 'solution'"):
        load_environment("math", data=str(path))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(EnvironmentLoadError, match="cannot read"):
        load_environment("math", data=str(tmp_path / "broken.json"))
