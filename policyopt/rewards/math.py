"""Math answer correctness: the last ``\\boxed{...}`` (or ``Answer: ...`` line, or GSM8K's
``#### ...``) compared with the reference.

:func:`verify_math` takes the answer region (after ``</think>``), extracts the answer,
compares identical strings and rational literals exactly, screens out inputs whose
evaluation could sit in one C call (huge powers, towers, factorials), then asks
math-verify under a time limit, in the calling thread's verifier process
(``policyopt.rewards.killable``) unless this is a scoring worker's main thread. Nothing is
``eval``-ed. The pipeline, math-verify's leniencies and where this module differs from
it: ``docs/rewards.md``, "Math answers".
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import logging
import re
import threading
import time
from typing import Any

from policyopt.rewards import killable, relations
from policyopt.rewards.timelimit import VerifierTimeout, time_limit

# Answers longer than this (characters inside the box) are rejected unread.
MAX_ANSWER_CHARS = 1_000
# Deepest allowed nesting of (), [], {} inside an answer.
MAX_NESTING = 24
# Literal exponents (and factorial arguments) with more digits than this are rejected.
MAX_EXPONENT_DIGITS = 5
MAX_FACTORIAL_DIGITS = 3
# Exponents whose bound (product of n + 1 over their numbers n) exceeds this are rejected.
MAX_EXPONENT = 10**MAX_EXPONENT_DIGITS
# Default per-call limit for parsing + verification, seconds (math-verify's own default).
DEFAULT_TIMEOUT_S = 5.0

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Where the answer is: the last closed \boxed{}, the last "Answer: ..." line, or the text
# after the last "####" (GSM8K).
ANSWER_FORMATS = ("boxed", "answer_line", "gsm8k")
GSM8K_MARKER = "####"

_BOX_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|\{|\}")
# LaTeX's brace-less form, `\boxed 5`: the run of characters after the space (up to a
# blank, `$` or a brace), as MATH's and verl's `remove_boxed` read it; not when a brace
# follows that run (`\boxed \frac{1}{2}`: a macro whose arguments the run cuts off).
_BARE_BOX = re.compile(r"\\(?:boxed|fbox)[ \t]+([^\s${}]++)(?!\{)")
_DECIMAL = r"(?:\d+\.?\d*|\.\d+)"
_PLAIN_NUMBER = re.compile(rf"[+-]?{_DECIMAL}")
_PLAIN_RATIO = re.compile(r"([+-]?)(\d+)/(\d+)")
_LATEX_FRAC = re.compile(r"([+-]?)\\[dt]?frac(?:\{([+-]?\d+)\}\{([+-]?\d+)\}|(\d)(\d))")
# Decimals further apart than this round to different 6-place values (math-verify's
# float_rounding=6); closer ones are left to math-verify.
_DECIMAL_SEPARATION = fractions.Fraction(2, 10**6)
_BLANKS = re.compile(r"\s+|\$|\\[,;:! ]|\\quad")
# verl's DAPO reward (math_dapo.py) finds the answer with this pattern, case-insensitive.
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
_DOLLAR_SPAN = re.compile(r"\$([^$]+)\$")
# A thousands separator between digits (`1,000`), dropped from GSM8K answers as
# lm-evaluation-harness's GSM8K filter does.
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


@dataclasses.dataclass(frozen=True)
class MathVerdict:
    """Outcome of one math check.

    Attributes:
      score: 1.0 if the answer is equivalent to the reference, else 0.0.
      status: "correct", "incorrect", "no_answer" (no closed box, or no answer line),
        "rejected" (failed the screen of step 4) or "timeout" (the time limit expired:
        scored 0).
      answer: the extracted answer text (None when there is none).
    """

    score: float
    status: str
    answer: str | None = None


def answer_region(completion: str) -> str:
    """Text after the last ``</think>``, or the whole completion when there is none."""
    cut = completion.rfind(THINK_CLOSE)
    return completion if cut < 0 else completion[cut + len(THINK_CLOSE) :]


def extract_boxed(text: str, *, bare: bool = True) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) whose braces close.

    One linear pass over brace tokens with a stack, so a megabyte of unclosed
    ``\\boxed{`` costs linear time. "Last" means the box that starts last.

    With ``bare`` and no braced box that closes, LaTeX's brace-less ``\\boxed 5`` counts
    (its content: the characters up to the next blank, ``$`` or brace, without a
    sentence's final ``.,;:``; the last such box). A braced box always wins: prose after
    it such as "(formatted with \\boxed as asked)" is not an answer.

    Returns:
      The content between the box's braces, or None when no box closes.
    """
    stack: list[int] = []  # for each open brace: start of box content, or -1 for a plain brace
    last_start, last_content = -1, None
    for token in _BOX_TOKENS.finditer(text):
        if token.group() == "}":
            if not stack:
                continue  # unmatched closing brace: ignore
            start = stack.pop()
            if start >= 0 and start > last_start:
                last_start, last_content = start, text[start : token.start()]
        elif token.group() == "{":
            stack.append(-1)
        else:
            stack.append(token.end())
    if last_content is not None or not bare:
        return last_content
    match = None
    for match in _BARE_BOX.finditer(text):
        pass
    if match is not None and match.group(1).rstrip(".,;:"):
        return match.group(1).rstrip(".,;:")
    return None


def extract_answer_line(text: str) -> str | None:
    """The answer written on the last ``Answer: ...`` line (DAPO-Math-17k's format).

    The line is found as verl's DAPO reward finds it: the last match of
    ``Answer\\s*:\\s*([^\\n]+)``, case-insensitive (so ``Final answer: 3`` counts, and
    ``Answer:`` followed by a line break takes the next line). What a model writes around
    the answer then goes: Markdown emphasis (``**Answer:** 34``), a ``\\boxed{...}`` on
    the line (its content is the answer), else the first ``$...$`` span (its content, as
    Minerva's normalisation keeps), surrounding ``$`` and one final full stop (not an
    ellipsis).

    Differences from verl, deliberate: the answer is compared like a boxed one (exact,
    rational, then math-verify), which also accepts equivalent forms (``0.5`` for
    ``\\frac{1}{2}``, ``x = 3`` for ``3``) where verl compares normalised strings; verl's
    normalisation removes units and words (``5 dollars``) that math-verify may reject; and
    verl reads only the last 300 characters of the response, this all of it (after
    ``</think>``, see ``answer_region``).

    Returns:
      The answer text, or None when there is no such line or it is empty once cleaned.
    """
    answer = None
    for match in _ANSWER_LINE.finditer(text):
        answer = match.group(1)
    if answer is None:
        return None
    return _clean_answer(answer)


def _clean_answer(answer: str) -> str | None:
    """An answer line without Markdown emphasis, a final full stop and ``$``; the content
    of a ``\\boxed{}`` or else of the first ``$...$`` span on it (``extract_answer_line``)."""
    for _ in range(2):  # Markdown emphasis and a full stop, in either order ("**34**.")
        answer = answer.strip().strip("*").strip()
        if answer.endswith(".") and not answer.endswith(".."):
            answer = answer[:-1]
    boxed = extract_boxed(answer)
    dollars = _DOLLAR_SPAN.search(answer)
    if boxed is not None and boxed.strip():
        answer = boxed
    elif dollars is not None:
        answer = dollars.group(1)
    answer = answer.strip()
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1]
    return answer.strip().strip("$").strip() or None


def extract_gsm8k(text: str) -> str | None:
    """The answer after the last ``####`` (GSM8K's ``... 5 + 7 = 12\\n#### 12``).

    The first non-blank line after the marker, cleaned as an ``Answer:`` line is
    (:func:`extract_answer_line`: emphasis, ``$``, a final full stop, a box on it), with
    thousands separators between digits removed (``1,000`` -> ``1000``, as
    lm-evaluation-harness's GSM8K filter does; ``1,2`` stays).

    Returns:
      The answer text, or None when there is no marker or nothing after it.
    """
    cut = text.rfind(GSM8K_MARKER)
    if cut < 0:
        return None
    rest = text[cut + len(GSM8K_MARKER) :].strip()
    if not rest:
        return None
    answer = _clean_answer(rest.splitlines()[0])
    return None if answer is None else _THOUSANDS.sub("", answer)


def extract_answer(text: str, answer_format: str = "boxed") -> str | None:
    """The answer of ``text`` by ``answer_format`` (one of ``ANSWER_FORMATS``), or None."""
    if answer_format == "boxed":
        return extract_boxed(text)
    if answer_format == "answer_line":
        return extract_answer_line(text)
    if answer_format == "gsm8k":
        return extract_gsm8k(text)
    raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")


def _normalise(answer: str) -> str:
    return _BLANKS.sub("", answer)


def _rational_literal(text: str) -> tuple[fractions.Fraction, bool] | None:
    """(exact value, has a decimal point) of a plain number or fraction literal, else None."""
    if len(text) > 40:
        return None
    if _PLAIN_NUMBER.fullmatch(text):
        return fractions.Fraction(text), "." in text
    match = _PLAIN_RATIO.fullmatch(text) or _LATEX_FRAC.fullmatch(text)
    if match is None:
        return None
    sign, *parts = match.groups()
    numerator, denominator = [int(p) for p in parts if p is not None]
    if denominator == 0:
        return None
    value = fractions.Fraction(numerator, denominator)
    return (-value if sign == "-" else value), False


def _fast_compare(answer_key: str, gold_key: str) -> bool | None:
    """True / False when both are rational literals and the outcome is certain, else None."""
    answer, gold = _rational_literal(answer_key), _rational_literal(gold_key)
    if answer is None or gold is None:
        return None
    (answer_value, answer_decimal), (gold_value, gold_decimal) = answer, gold
    if answer_value == gold_value:
        return True
    if not (answer_decimal or gold_decimal):
        return False
    far_apart = abs(answer_value - gold_value) > _DECIMAL_SEPARATION
    if far_apart and max(abs(answer_value), abs(gold_value)) < 10**8:  # within Float precision
        return False
    return None


def _nesting_depth(text: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(depth - 1, 0)
    return deepest


_POWER = re.compile(r"\^|\*\*")
_FACTORIAL = re.compile(r"!")
_DIGITS = re.compile(r"\d+")
_OPENERS = {"{": "}", "(": ")", "[": "]"}


def _operand_after(text: str, pos: int) -> tuple[str, int]:
    """The exponent that follows a power operator ending at ``pos`` and where it ends."""
    while pos < len(text) and text[pos] in " \t\n":
        pos += 1
    if pos < len(text) and text[pos] in _OPENERS:
        closer, depth = _OPENERS[text[pos]], 0
        for end in range(pos, len(text)):
            if text[end] == text[pos]:
                depth += 1
            elif text[end] == closer:
                depth -= 1
                if depth == 0:
                    return text[pos : end + 1], end + 1
        return text[pos:], len(text)
    match = re.compile(r"[+-]?[\w.\\]*").match(text, pos)
    return match.group(), match.end()


def _group_before(text: str, end: int) -> str | None:
    """The bracketed group that closes just before ``end`` (blanks and ``\\right``
    skipped), found by matching brackets backwards, or None when none closes there."""
    before = text[:end].rstrip()
    if before.endswith("\\right)") or before.endswith("\\right]"):
        before = before[: -len("\\right)")] + before[-1]
    if not before or before[-1] not in ")}]":
        return None
    depth = 0
    for start in range(len(before) - 1, -1, -1):
        if before[start] in ")}]":
            depth += 1
        elif before[start] in "({[":
            depth -= 1
            if depth == 0:
                return before[start:]
    return before


def _exponent_bound(exponent: str) -> int:
    """An upper bound of the magnitude of an exponent made of literals: the product of
    (n + 1) over its numbers n, which bounds any sum, difference and product of them
    (a + b <= (a + 1)(b + 1)); 1 for a purely symbolic exponent."""
    bound = 1
    for digits in _DIGITS.findall(exponent):
        if len(digits) > MAX_EXPONENT_DIGITS:
            return MAX_EXPONENT + 1
        bound *= int(digits) + 1
        if bound > MAX_EXPONENT:
            return bound
    return bound


def _is_explosive(answer: str) -> bool:
    """True for power towers, exponents that may be huge (long literals, arithmetic on
    literals), powers of bracketed powers and factorials of huge arguments."""
    for power in _POWER.finditer(answer):
        exponent, end = _operand_after(answer, power.end())
        if _POWER.search(exponent) or _FACTORIAL.search(exponent):
            return True  # a^(b^c) or a^(b!)
        if _POWER.match(answer[end:].lstrip()):
            return True  # a**b**c, which binds as a**(b**c), or a^b^c
        bound = _exponent_bound(exponent)
        if bound > MAX_EXPONENT:
            return True  # 2^{123456}, 3^{99999 \cdot 9999}, 2^{99999+99999}
        base = _group_before(answer, power.start())
        if base is not None and _POWER.search(base):  # (a^b)^c = a^(b c)
            inner = max(
                _exponent_bound(_operand_after(base, p.end())[0]) for p in _POWER.finditer(base)
            )
            if inner * bound > MAX_EXPONENT:
                return True
    for bang in _FACTORIAL.finditer(answer):
        group = _group_before(answer, bang.start())
        if group is not None:
            if _POWER.search(group) or any(
                len(d) > MAX_FACTORIAL_DIGITS for d in _DIGITS.findall(group)
            ):
                return True
        else:
            digits = re.search(r"\d+$", answer[: bang.start()].rstrip())
            if digits and len(digits.group()) > MAX_FACTORIAL_DIGITS:
                return True
    return False


def screen_answer(answer: str) -> bool:
    """True when ``answer`` is safe to hand to the parser (see module docstring, step 4)."""
    return (
        len(answer) <= MAX_ANSWER_CHARS
        and _nesting_depth(answer) <= MAX_NESTING
        and not _is_explosive(answer)
    )


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; ours replace them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.cache
def load_math_verify() -> Any:
    """math-verify, imported and warmed up once per process, outside any time limit.

    SymPy imports much of itself lazily on first use (simplification, polynomials, sets);
    one unlimited comparison of each kind pays that cost here rather than inside the first
    graded sample's time limit.
    """
    import math_verify  # deferred: importing SymPy takes about half a second

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropDisabledTimeoutWarning())
    warm_up = [
        ("(x+1)^2", "x^2+2x+1"),
        (r"\frac{1}{3}", "0.3333333"),
        ("[1, 2)", r"\{1\}"),
        (r"\sqrt{8}", r"2\sqrt{2}"),
    ]
    for gold, answer in warm_up:
        math_verify.verify(
            math_verify.parse("\\boxed{" + gold + "}", parsing_timeout=None),
            math_verify.parse("\\boxed{" + answer + "}", parsing_timeout=None),
            timeout_seconds=None,
        )
    return math_verify


def _reference_answer(reference: str, answer_format: str = "boxed") -> str:
    if answer_format == "gsm8k" and GSM8K_MARKER in reference:  # a whole GSM8K solution
        return extract_gsm8k(reference) or ""
    boxed = extract_boxed(reference) if "\\boxed" in reference or "\\fbox" in reference else None
    text = boxed if boxed is not None else reference
    return text.strip().strip("$").strip()


@functools.lru_cache(maxsize=4096)
def _parse_gold(reference_answer: str) -> list:
    # Cached: the G samples of a group share their reference. Exceptions (timeouts) are
    # not cached by lru_cache.
    return load_math_verify().parse("\\boxed{" + reference_answer + "}", parsing_timeout=None)


@functools.lru_cache(maxsize=16384)
def _symbolic_equal(gold: str, answer: str) -> bool:
    # Cached: samples of a group often repeat an answer. Call under a time limit; a
    # timeout propagates and is not cached.
    math_verify = load_math_verify()
    parsed = math_verify.parse("\\boxed{" + answer + "}", parsing_timeout=None)
    return bool(math_verify.verify(_parse_gold(gold), parsed, timeout_seconds=None))


# True in a process whose main thread may run math-verify in-process: a scoring worker of
# `score_batch` (its parent kills it at the deadline) or a `KillableWorker`.
_KILLABLE_PROCESS = False


def mark_killable_process() -> None:
    """Declares this process killable by its parent: math-verify then runs in-process on
    its main thread (``score_batch``'s workers call this when they start)."""
    global _KILLABLE_PROCESS
    _KILLABLE_PROCESS = True


def start_verifier() -> None:
    """Starts the calling thread's verifier process now (the first of a process starts
    their server: seconds of imports), so that no answer's limit or latency pays for it;
    in a scoring worker's main thread, where math-verify runs in-process, imports it."""
    if _KILLABLE_PROCESS and threading.current_thread() is threading.main_thread():
        load_math_verify()
    else:
        killable.thread_worker("math").start()


# Verdicts of the verifier processes, kept here too: a repeated answer costs no round trip.
_REMOTE_VERDICTS: dict[tuple[str, str], bool] = {}


def _equal_within(gold: str, answer: str, timeout_s: float | None) -> bool:
    """``_symbolic_equal`` under a time limit of ``timeout_s`` that cannot hang the caller.

    In-process on the main thread of a killable process (or with no limit); otherwise in
    the calling thread's verifier process (module docstring, step 5).

    Raises:
      VerifierTimeout: the limit expired.
    """
    in_process = _KILLABLE_PROCESS and threading.current_thread() is threading.main_thread()
    if in_process or timeout_s is None or timeout_s <= 0:
        load_math_verify()  # import outside the limit: an interrupted import leaves a broken module
        with time_limit(timeout_s):
            return _symbolic_equal(gold, answer)
    key = (gold, answer)
    if key not in _REMOTE_VERDICTS:
        worker = killable.thread_worker("math")
        if len(_REMOTE_VERDICTS) > 16384:
            _REMOTE_VERDICTS.clear()
        _REMOTE_VERDICTS[key] = worker.call(_symbolic_equal, key, timeout_s)
    return _REMOTE_VERDICTS[key]


def _judge(answer: str, gold: str, deadline: float | None) -> str:
    """ "correct", "incorrect" or "rejected" for one answer (steps 3 to 5 of the module
    docstring); raises ``VerifierTimeout`` past ``deadline`` (time.monotonic())."""
    answer_key, gold_key = _normalise(answer), _normalise(gold)
    if not answer_key:
        return "incorrect"
    if answer_key == gold_key:
        return "correct"
    fast = _fast_compare(answer_key, gold_key)
    if fast is not None:
        return "correct" if fast else "incorrect"
    if not screen_answer(answer) or not screen_answer(gold):
        return "rejected"
    timeout_s = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
    return "correct" if _equal_within(gold, answer, timeout_s) else "incorrect"


def verify_math(
    completion: str,
    reference: str,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    answer_format: str = "boxed",
) -> MathVerdict:
    """Grades one math completion; never raises on model output.

    Args:
      completion: model output (text after the prompt).
      reference: reference answer, plain (``"3/4"``, ``"\\frac{3}{4}"``), boxed, or
        with ``answer_format="gsm8k"`` a whole GSM8K solution (``... #### 12``).
      timeout_s: wall-clock limit for parsing and verification; None: no limit.
      answer_format: where the answer is, ``"boxed"`` (the last ``\\boxed{}``),
        ``"answer_line"`` (the last ``Answer: ...`` line) or ``"gsm8k"`` (after the last
        ``####``); see the module docstring.

    Returns:
      A :class:`MathVerdict` (score 1.0 / 0.0 and the reason).
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    try:
        answer = extract_answer(answer_region(str(completion)), answer_format)
        if answer is None:
            return MathVerdict(0.0, "no_answer")
        gold = _reference_answer(str(reference), answer_format)
        deadline = None if timeout_s is None or timeout_s <= 0 else time.monotonic() + timeout_s
        # A relation (`43 = 42`, `41 \\lor 42`): each side that is a value must equal the
        # reference, where math-verify would grade one side (docs/rewards.md).
        values = relations.value_sides(answer, gold) if len(answer) <= MAX_ANSWER_CHARS else None
        for side in values or [answer]:
            status = _judge(side, gold, deadline)
            if status != "correct":
                break
        return MathVerdict(float(status == "correct"), status, answer)
    except VerifierTimeout:
        return MathVerdict(0.0, "timeout")
    except Exception:  # noqa: BLE001 - a verifier bug must not crash training; scored 0
        logging.getLogger(__name__).debug("math verifier error", exc_info=True)
        return MathVerdict(0.0, "incorrect")


def math_correctness(
    completion: str,
    reference: str,
    *,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    answer_format: str = "boxed",
) -> float:
    """1.0 if the last ``\\boxed{}`` answer of ``completion`` (with
    ``answer_format="answer_line"``: its last ``Answer: ...`` line) equals ``reference``,
    else 0.0.

    See the module docstring for the pipeline (fast exact path, screen, math-verify under
    a time limit). Never raises on model output.
    """
    return verify_math(
        completion, reference, timeout_s=timeout_s, answer_format=answer_format
    ).score
