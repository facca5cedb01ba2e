"""The built-in ``math`` environment: problems with a checkable final answer, scored by ``math-verify``.

Problems come from a dataset file (JSONL, JSON, CSV or Parquet, read offline through ``datasets``;
``question`` and ``answer`` columns unless renamed) or, when no file is given, from a generator of
arithmetic word problems whose difficulty is a parameter, so that smoke tests need no download.

Scoring: the final answer is taken from the completion (the last ``\\boxed{...}``, else the last number)
and compared with the reference by ``math-verify``: reward 1.0 when they are equal or mathematically
equivalent (``0.75`` and ``3/4``, ``1,234`` and ``1234``), else 0.0. There is no partial credit by
string similarity: a nearly right number is a wrong answer.
"""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

from veriroll.coordinator.environments import (
    Environment,
    EnvironmentLoadError,
    Prompt,
    RewardFunction,
    Rubric,
)

__all__ = [
    "DATA_FORMATS",
    "read_data_file",
    "DEFAULT_INSTRUCTION",
    "MathEnvironment",
    "extract_answer",
    "math_verify_reward",
    "reference_answer",
    "too_costly",
    "word_problem",
]

DEFAULT_INSTRUCTION = "Put the final answer in \\boxed{}."
DATA_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""File suffix → ``datasets`` builder."""

# ---------------------------------------------------------------------------------------------------
# Answer extraction and scoring

_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces matched; None if none is closed."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_answer(completion: str) -> str | None:
    """The completion's final answer: the last ``\\boxed{}``'s content, else its last number
    (integer, decimal, negative, with thousands commas like ``1,234``, or a fraction ``a/b``), with
    commas removed; None when it has neither."""
    boxed = _last_boxed(completion)
    if boxed:
        return boxed
    numbers = _NUMBER.findall(completion)
    if not numbers:
        return None
    return re.sub(r"\s+", "", numbers[-1]).replace(",", "")


def reference_answer(answer: str) -> str:
    """The reference's final answer: GSM8K-style ``reasoning #### 42`` gives ``42``; a boxed reference its box."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    return (_last_boxed(answer) or answer).strip().replace(",", "")


def _parse(expr: str) -> list:
    from math_verify import parse

    # parsing_timeout=None: math-verify's own timeout is signal.alarm, which only works in a process's
    # main thread; the reward runner (coordinator/rewards.py) enforces the time limit instead.
    parsed = parse(f"${expr}$", parsing_timeout=None)
    return parsed or parse(expr, parsing_timeout=None)


MAX_EXPONENT = 10**5
MAX_FACTORIAL = 1000


def too_costly(parsed: list) -> bool:
    """Whether comparing a parsed answer could run sympy for unbounded time: a power tower
    (``9^{9^{9^9}}``: verify evaluates it), a power or factorial of a huge or symbolic size. No
    honest final answer looks like that, and a node could send one in every sample to tie up the
    reward workers until each sample's time limit; such an answer is simply wrong (0)."""
    import sympy

    for item in parsed:
        if not isinstance(item, sympy.Basic):
            continue
        for node in sympy.preorder_traversal(item):
            if isinstance(node, sympy.Pow):
                exponent = node.exp
                if exponent.has(sympy.Pow, sympy.factorial) or (exponent.is_Number and abs(exponent) > MAX_EXPONENT):
                    return True
            elif isinstance(node, sympy.factorial | sympy.factorial2):
                arg = node.args[0]
                if not arg.is_Number or abs(arg) > MAX_FACTORIAL:
                    return True
    return False


def math_verify_reward(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion's final answer equals the prompt's answer or is equivalent to it, else 0.0."""
    from math_verify import verify

    got = extract_answer(completion)
    if got is None:
        return 0.0
    gold, pred = _parse(reference_answer(prompt.answer)), _parse(got)
    if not gold or not pred or too_costly(pred):
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


# ---------------------------------------------------------------------------------------------------
# Generated word problems

_PEOPLE = (("Tom", "he"), ("Ana", "she"), ("Ravi", "he"), ("Mei", "she"), ("Omar", "he"), ("Lena", "she"),
           ("Kofi", "he"), ("Sara", "she"))
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "stamps", "shells")
_ADD = ("{P} buys {k} more.", "A friend gives {o} {k} more.", "{P} finds {k} more.", "{P} wins {k} more in a game.")
_SUB = ("{P} gives {k} to a friend.", "{P} sells {k}.", "{P} loses {k}.", "{P} donates {k} to a school.")
_MUL = ("{P} buys {m} boxes with {k} {items} in each.", "{P} gets {m} bags of {k} {items} each.")
_QUESTION = ("How many {items} does {name} have now?", "How many {items} does {name} have in the end?",
             "How many {items} are left with {name}?")
_OBJECT = {"he": "him", "she": "her"}


def _difficulty_plan(difficulty: int) -> tuple[int, int]:
    """(steps after the start, largest number) for a difficulty: 1 → (1, 20), 2 → (1, 100), 3 → (2, 100),
    4 → (2, 1000), 5 → (3, 1000), ... capped at 6 steps and 10^6."""
    steps = min((difficulty + 1) // 2, 6)
    high = 20 if difficulty == 1 else 10 ** min(1 + difficulty // 2, 6)
    return steps, high


def word_problem(rng: random.Random, difficulty: int = 1) -> tuple[str, int]:
    """An arithmetic word problem and its integer answer, drawn with ``rng`` only (so a seed reproduces it)."""
    steps, high = _difficulty_plan(difficulty)
    name, pronoun = rng.choice(_PEOPLE)
    items = rng.choice(_ITEMS)
    fill = {"P": pronoun.capitalize(), "o": _OBJECT[pronoun], "name": name, "items": items}
    total = rng.randint(1, high)
    sentences = [f"{name} has {total} {items}."]
    for _ in range(steps):
        kind = rng.choice(("add", "sub", "mul")) if difficulty >= 3 else rng.choice(("add", "sub"))
        if kind == "sub" and total < 2:
            kind = "add"
        if kind == "add":
            k = rng.randint(1, high)
            total += k
            sentences.append(rng.choice(_ADD).format(k=k, **fill))
        elif kind == "sub":
            k = rng.randint(1, total - 1)  # never to zero or below: "has 0 left" questions read oddly
            total -= k
            sentences.append(rng.choice(_SUB).format(k=k, **fill))
        else:
            m, k = rng.randint(2, 9), rng.randint(2, max(2, min(high // 10, 99)))
            total += m * k
            sentences.append(rng.choice(_MUL).format(m=m, k=k, **fill))
    sentences.append(rng.choice(_QUESTION).format(**fill))
    return " ".join(sentences), total


# ---------------------------------------------------------------------------------------------------
# The environment


def read_data_file(env: str, data: str, columns: dict[str, str], split: str, limit: int | None):
    """``data`` (a file of one of :data:`DATA_FORMATS`) as a ``datasets.Dataset`` of at most ``limit`` rows that
    has each of ``columns`` (setting name -> column name); anything else is refused naming the file and the
    fix, as ``env`` environment's error."""
    path = Path(data).expanduser()
    builder = DATA_FORMATS.get(path.suffix.lower())
    if builder is None:
        raise EnvironmentLoadError(f"{env} environment: cannot read {str(path)!r}: unknown file type {path.suffix!r}; "
                                   f"use one of {', '.join(DATA_FORMATS)}")
    if not path.is_file():
        raise EnvironmentLoadError(f"{env} environment: data file {str(path)!r} does not exist")
    if path.stat().st_size == 0:
        raise EnvironmentLoadError(f"{env} environment: data file {str(path)!r} is empty")
    import datasets

    try:
        # A file path only: no hub access. The cache stays under datasets' default cache directory.
        ds = datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    except Exception as e:  # datasets raises many types for unreadable files; say which file
        raise EnvironmentLoadError(f"{env} environment: cannot read {str(path)!r} as {builder}: {type(e).__name__}: {e}") from e
    missing = [c for c in columns.values() if c not in ds.column_names]
    if missing:
        raise EnvironmentLoadError(
            f"{env} environment: {str(path)!r} has no column {', '.join(map(repr, missing))}; its columns are "
            f"{', '.join(map(repr, ds.column_names))}: set {' / '.join(columns)} to the right ones")
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds


def _load_rows(data: str, question_column: str, answer_column: str, split: str, limit: int | None) -> list[tuple[str, str]]:
    path = Path(data).expanduser()
    ds = read_data_file("math", data, {"question_column": question_column, "answer_column": answer_column}, split, limit)
    rows = [(str(q), str(a)) for q, a in zip(ds[question_column], ds[answer_column], strict=True)
            if q is not None and a is not None and str(q).strip() and str(a).strip()]
    if not rows:
        raise EnvironmentLoadError(f"math environment: {str(path)!r} has no rows with both a question and an answer")
    return rows


class MathEnvironment(Environment):
    """Math problems with a final answer, scored by ``math-verify`` (1.0 equivalent, 0.0 otherwise).

    ``data``: a ``.jsonl``, ``.json``, ``.csv`` or ``.parquet`` file; None draws generated word
    problems of ``difficulty`` (1 = one step with numbers up to 20; each level adds range or steps).
    ``question_column`` / ``answer_column`` name the columns; ``split`` is the split name given to
    ``datasets``; ``limit`` keeps the first rows only. ``instruction`` is appended to every question
    (empty: none). Rows are drawn uniformly with the coordinator's seeded prompt stream, so the same
    ``environment.seed`` gives the same prompts, and a restarted coordinator continues the stream.
    """

    def __init__(
        self,
        *,
        data: str | None = None,
        question_column: str = "question",
        answer_column: str = "answer",
        split: str = "train",
        limit: int | None = None,
        difficulty: int = 1,
        instruction: str = DEFAULT_INSTRUCTION,
        max_new_tokens: int = 512,
        name: str = "math",
    ):
        if difficulty < 1:
            raise EnvironmentLoadError(f"math environment: difficulty must be >= 1, got {difficulty}")
        if limit is not None and limit < 1:
            raise EnvironmentLoadError(f"math environment: limit must be >= 1, got {limit}")
        self.data, self.difficulty, self.instruction = data, difficulty, instruction
        self.rows = None if data is None else _load_rows(str(data), question_column, answer_column, split, limit)
        super().__init__(
            name,
            Rubric([RewardFunction(math_verify_reward, 1.0, "math_verify")]),
            # Only the char-level demo tokenizer is built from an alphabet; real tokenizers ignore it.
            alphabet="0123456789+-*/=.,()\\{} " + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ?",
            max_new_tokens=max_new_tokens,
        )

    def sample_prompt(self, rng: random.Random) -> Prompt:
        if self.rows is None:
            question, answer = word_problem(rng, self.difficulty)
            answer, meta = str(answer), {"difficulty": self.difficulty}
        else:
            index = rng.randrange(len(self.rows))
            (question, answer), meta = self.rows[index], {"row": index}
        text = f"{question}\n{self.instruction}" if self.instruction else question
        return Prompt(text=text, answer=answer, env=self.name, meta=meta,
                      messages=[{"role": "user", "content": text}])


logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warning: we time out ourselves
