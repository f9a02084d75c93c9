"""GSM8K-style word problems made from templates: a question, and a worked solution with
calculator annotations ending in ``#### answer``, as GSM8K's rows are.

The project's own small data for the quickstart (``data/gsm8k_tiny``, written by
``python -m experiments.word_problems``): one- and two-step problems over small whole
numbers, so that a tiny model trained from scratch on a few thousand rows solves some of
them and RL has something to improve. Deterministic in ``seed``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Callable

NAMES = (
    ("Ana", "She"),
    ("Ben", "He"),
    ("Carla", "She"),
    ("Dev", "He"),
    ("Elif", "She"),
    ("Farid", "He"),
    ("Grace", "She"),
    ("Hugo", "He"),
    ("Ines", "She"),
    ("Jamal", "He"),
    ("Kenji", "He"),
    ("Lena", "She"),
    ("Marco", "He"),
    ("Nadia", "She"),
    ("Omar", "He"),
    ("Priya", "She"),
)
ITEMS = (
    "apples",
    "stickers",
    "marbles",
    "pencils",
    "cookies",
    "stamps",
    "shells",
    "books",
    "cards",
    "beads",
    "eggs",
    "coins",
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One row: ``question`` and GSM8K's ``answer`` field (worked solution + ``#### N``)."""

    question: str
    answer: str

    def row(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.answer}


def _calc(a: int, op: str, b: int) -> tuple[str, int]:
    """``"a op b = <<a op b=c>>c"`` and ``c`` (GSM8K's calculator annotation)."""
    c = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return f"{a} {op} {b} = <<{a}{op}{b}={c}>>{c}", c


def _add(rng, name, pronoun, item) -> Problem:
    a, b = rng.randint(2, 40), rng.randint(2, 20)
    work, c = _calc(a, "+", b)
    return Problem(
        f"{name} has {a} {item}. {pronoun} buys {b} more. How many {item} does {name} have now?",
        f"{name} has {work} {item} now.\n#### {c}",
    )


def _subtract(rng, name, pronoun, item) -> Problem:
    a = rng.randint(10, 50)
    b = rng.randint(2, a - 2)
    work, c = _calc(a, "-", b)
    return Problem(
        f"{name} had {a} {item} and gave {b} of them away. How many {item} does {name} have left?",
        f"{name} has {work} {item} left.\n#### {c}",
    )


def _multiply(rng, name, pronoun, item) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    work, c = _calc(a, "*", b)
    return Problem(
        f"{name} buys {a} boxes of {item}. Each box holds {b} {item}. How many {item} does "
        f"{name} buy?",
        f"{name} buys {work} {item}.\n#### {c}",
    )


def _divide(rng, name, pronoun, item) -> Problem:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    work, c = _calc(a * b, "/", a)
    return Problem(
        f"{name} shares {a * b} {item} equally among {a} friends. How many {item} does each "
        "friend get?",
        f"Each friend gets {work} {item}.\n#### {c}",
    )


def _bags(rng, name, pronoun, item) -> Problem:
    a, bags, each = rng.randint(2, 30), rng.randint(2, 5), rng.randint(2, 9)
    work_bags, in_bags = _calc(bags, "*", each)
    work, c = _calc(a, "+", in_bags)
    return Problem(
        f"{name} has {a} {item}. {pronoun} buys {bags} bags with {each} {item} in each bag. "
        f"How many {item} does {name} have now?",
        f"The bags hold {work_bags} {item}.\n{name} has {work} {item} now.\n#### {c}",
    )


def _two_days(rng, name, pronoun, item) -> Problem:
    a, b = rng.randint(2, 25), rng.randint(2, 25)
    eaten = rng.randint(1, a + b - 1)
    work_sum, total = _calc(a, "+", b)
    work, c = _calc(total, "-", eaten)
    return Problem(
        f"{name} found {a} {item} on Monday and {b} on Tuesday. {pronoun} lost {eaten} of "
        f"them. How many {item} does {name} have left?",
        f"{name} found {work_sum} {item}.\n{name} has {work} {item} left.\n#### {c}",
    )


def _half(rng, name, pronoun, item) -> Problem:
    a = 2 * rng.randint(2, 24)
    work_half, half = _calc(a, "/", 2)
    work, c = _calc(a, "+", half)
    return Problem(
        f"{name} sold {a} {item} in April, and then {pronoun.lower()} sold half as many "
        f"{item} in May. How many {item} did {name} sell altogether in April and May?",
        f"{name} sold {work_half} {item} in May.\n{name} sold {work} {item} altogether.\n#### {c}",
    )


# The templates, each drawn equally often.
TEMPLATES: tuple[Callable, ...] = (
    _add,
    _subtract,
    _multiply,
    _divide,
    _bags,
    _two_days,
    _half,
)


def generate_word_problems(num: int, seed: int, *, exclude=frozenset()) -> list[Problem]:
    """``num`` distinct problems from ``seed``, none of whose questions is in ``exclude``
    (a test split drawn without the training split's questions)."""
    rng = random.Random(seed)
    seen, problems = set(exclude), []
    while len(problems) < num:
        name, pronoun = rng.choice(NAMES)
        problem = rng.choice(TEMPLATES)(rng, name, pronoun, rng.choice(ITEMS))
        if problem.question not in seen:
            seen.add(problem.question)
            problems.append(problem)
    return problems


def word_problem_splits(
    num_train: int = 3000, num_test: int = 150, seed: int = 0
) -> dict[str, list[Problem]]:
    """``{"train": ..., "test": ...}``: disjoint splits (the shipped ``data/gsm8k_tiny``)."""
    train = generate_word_problems(num_train, seed)
    test = generate_word_problems(num_test, seed + 1, exclude=frozenset(p.question for p in train))
    return {"train": train, "test": test}


def jsonl_text(problems: list[Problem]) -> str:
    """The rows as JSONL text, one object per line."""
    return "".join(json.dumps(p.row(), ensure_ascii=False) + "\n" for p in problems)


def write_splits(directory: str, splits: dict[str, list[Problem]]) -> list[str]:
    """Writes ``<directory>/<split>.jsonl`` for each split; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for split, problems in splits.items():
        path = os.path.join(directory, f"{split}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.write(jsonl_text(problems))
        paths.append(path)
    return paths
