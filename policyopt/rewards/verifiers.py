"""Verifiers by name: how a sample of a task is judged correct, and its format gate.

``RewardSpec.task`` names one (a task's own, ``policyopt.data.tasks``); ``"math"`` and
``"code"`` are built in, and a user's module registers more with ``register_verifier``
(named in ``config.imports``, which scoring workers import too: ``RewardSpec.imports``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from policyopt.registry import Registry, caller
from policyopt.rewards import format as format_lib
from policyopt.rewards import math as math_lib

# score(completion, reference, spec, time_left_s) -> (correctness in [0, 1], status)
ScoreFn = Callable[[str, Any, Any, "float | None"], "tuple[float, str]"]
# format_ok(completion, answer_format) -> bool: the format gate (``reward.format``)
FormatFn = Callable[[str, str], bool]


@dataclasses.dataclass(frozen=True)
class Verifier:
    """A registered verifier: its ``score`` and ``format_ok`` functions and where it was
    registered (``file:line``)."""

    name: str
    score: ScoreFn
    format_ok: FormatFn
    where: str


VERIFIERS: Registry = Registry("verifier")


def _no_format(completion: str, answer_format: str) -> bool:
    return format_lib.split_think(completion) is not None


def register_verifier(name: str, score: ScoreFn, *, format_ok: FormatFn | None = None) -> ScoreFn:
    """Registers ``score(completion, reference, spec, time_left_s) -> (correctness, status)``
    as verifier ``name`` (``RewardSpec.task``; a task's ``verifier``). ``format_ok(completion,
    answer_format) -> bool`` is its format gate (default: Magistral's ``<think>...</think>``
    pair alone). A name registered twice is an error naming both places."""
    VERIFIERS.add(name, Verifier(name, score, format_ok or _no_format, caller()))
    return score


def math_score(completion: str, reference, spec, time_left_s: float | None):
    """The math verifier (``policyopt.rewards.math.verify_math``): the answer where
    ``spec.answer_format`` says, compared with the reference symbolically, within
    ``spec.math_timeout_s`` (capped by what is left of the batch's deadline)."""
    timeout_s = (
        spec.math_timeout_s if time_left_s is None else min(spec.math_timeout_s, time_left_s)
    )
    verdict = math_lib.verify_math(
        completion, reference, timeout_s=max(timeout_s, 1e-3), answer_format=spec.answer_format
    )
    return verdict.score, verdict.status


def code_score(completion: str, reference, spec, time_left_s: float | None):
    """The code verifier: the response's first Python block run against the tests in the
    sandbox (``policyopt.rewards.code``) with ``spec``'s limits; the pass rate with
    ``spec.code_partial``, else all or nothing. Code tests keep their own per-test limit."""
    del time_left_s  # the parent's deadline bounds the tests
    from policyopt.rewards import code as code_lib  # deferred: only code tasks need it

    result = code_lib.run_code_tests(
        completion,
        reference,
        timeout_s=spec.code_timeout_s,
        memory_mb=spec.code_memory_mb,
        disk_mb=spec.code_disk_mb,
        stop_at_first_failure=not spec.code_partial,
        max_tests=spec.code_max_tests,
        isolation=spec.code_isolation,
    )
    return (result.pass_rate if spec.code_partial else float(result.all_passed)), result.status


register_verifier(
    "math",
    math_score,
    format_ok=lambda c, answer_format: format_lib.format_ok(c, "math", answer_format),
)
register_verifier(
    "code",
    code_score,
    format_ok=lambda c, answer_format: format_lib.format_ok(c, "code", answer_format),
)
