"""Magistral's format gate (Magistral, arXiv 2506.10910, section 2.2.1).

A response is well formatted when

1. it starts with ``<think>`` (leading whitespace is tolerated: tokenizers often decode a
   leading space),
2. it contains exactly one ``<think>`` and exactly one ``</think>`` (so exactly one
   ``<think>...</think>`` pair, opened first),
3. after ``</think>``: for math, a ``\\boxed{...}`` whose braces close (LaTeX's brace-less
   ``\\boxed 5``, which the verifier reads, fails the gate: the paper asks for braces; with
   ``answer_format="answer_line"``, an ``Answer: ...`` line instead: DAPO-Math-17k's
   format; with ``answer_format="gsm8k"``, a ``#### answer`` line: GSM8K's); for code, a
   fenced block with a language tag (```` ```python ... ``` ````).

A format failure gives reward 0 and grading stops; a well-formatted response gets 0.1
and a correct one a further 0.9 (values configurable in
:class:`~policyopt.rewards.RewardSpec`).
"""

from __future__ import annotations

import re

from policyopt.rewards.math import (
    ANSWER_FORMATS,
    THINK_CLOSE,
    THINK_OPEN,
    extract_answer,
    extract_boxed,
)

# A fenced block with a language tag: ```lang\n ... ```
FENCED_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+#.-]+)[ \t]*\r?\n(.*?)```", re.DOTALL)

TASKS = ("math", "code")


def split_think(completion: str) -> tuple[str, str] | None:
    """(reasoning, answer) of a well-formed ``<think>reasoning</think>answer`` response.

    Returns None unless the response starts with ``<think>`` and contains exactly one
    ``<think>`` and one ``</think>``.
    """
    text = completion.lstrip()
    if not text.startswith(THINK_OPEN):
        return None
    if text.count(THINK_OPEN) != 1 or text.count(THINK_CLOSE) != 1:
        return None
    reasoning, answer = text[len(THINK_OPEN) :].split(THINK_CLOSE)
    return reasoning, answer


def first_code_block(text: str) -> tuple[str, str] | None:
    """(language tag, code) of the first fenced block that has a language tag, or None."""
    match = FENCED_BLOCK.search(text)
    return None if match is None else (match.group(1).lower(), match.group(2))


def format_ok(completion: str, task: str, answer_format: str = "boxed") -> bool:
    """Magistral's format check for ``task`` in ("math", "code"); see the module docstring.

    ``answer_format`` (math only): where the answer must be, ``"boxed"``,
    ``"answer_line"`` or ``"gsm8k"`` (``policyopt.rewards.math.ANSWER_FORMATS``).
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    parts = split_think(completion)
    if parts is None:
        return False
    answer = parts[1]
    if task == "math" and answer_format == "boxed":
        return extract_boxed(answer, bare=False) is not None  # the paper's \boxed{}
    if task == "math":
        return extract_answer(answer, answer_format) is not None
    return first_code_block(answer) is not None
