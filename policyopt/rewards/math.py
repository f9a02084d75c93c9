"""Math answer correctness: the last ``\\boxed{...}`` (or ``Answer: ...`` line) compared
with the reference by math-verify.

Pipeline of :func:`math_correctness` (each step can only lower the cost of the next):

1. *Answer region*: the text after ``</think>`` when the completion has one (the
   reasoning is never graded), otherwise the whole completion.
2. *Extraction*, by ``answer_format``: ``"boxed"`` (default), the content of the last
   ``\\boxed{...}`` whose braces close, found by a single linear scan (nested braces
   allowed; an unclosed box is no answer; the last box is the one that *starts* last, as
   in the MATH / math-verify convention); ``"answer_line"``, the rest of the last
   ``Answer: ...`` line (DAPO-Math-17k's prompts ask for "The last line of your response
   should be of the form Answer: $Answer"; see :func:`extract_answer_line`).
3. *Exact fast path*: identical strings (after removing blanks and ``$``) are correct.
   Two plain rational literals (``-12``, ``0.50``, ``3/4``, ``\\frac{3}{4}``) are compared
   exactly with :class:`fractions.Fraction`, with no parser at all, reproducing
   math-verify's rule: integers and fractions must be equal; when a decimal is involved
   math-verify compares values rounded to 6 places, so an exact match is correct, a
   difference above 2e-6 is not, and the narrow band in between goes on to math-verify.
   Most answers of arithmetic tasks stop here (microseconds).
4. *Screen* of untrusted text before any parser sees it: answers longer than
   ``MAX_ANSWER_CHARS``, nested deeper than ``MAX_NESTING``, or containing a power tower
   (``10^{10^{10}}``, ``10**10**10``), a power with a huge literal exponent or a factorial
   of a huge argument score 0 at once. These are exactly the inputs whose evaluation can
   sit inside a single C call (big-integer arithmetic) that no time limit interrupts.
5. *Symbolic comparison*: ``math_verify.parse`` of ``\\boxed{answer}`` and of the
   reference, then ``math_verify.verify(gold, prediction)`` (numeric with 6-digit float
   rounding, symbolic simplification, sets, intervals, equations, percentages), all
   under one :func:`~policyopt.rewards.timelimit.time_limit`. math-verify's own
   ``signal.alarm`` timeouts are switched off (they only work in the main thread, in
   whole seconds). Nothing is ever ``eval``-ed: math-verify parses LaTeX with its own
   grammar and builds SymPy objects; ``__import__('os')...`` is just an unparsable string.
   Parsed references and finished verdicts are cached per process (the G samples of a
   group share a reference and often repeat an answer); timeouts are never cached.

math-verify leniencies worth knowing (they are the community's conventions, kept):
``50\\%`` equals both ``50`` and ``0.5``; ``x=3`` equals ``3``; ``\\text{(A)}`` equals
``A``; decimals equal fractions when they agree to 6 places (``0.3333333`` = 1/3, but
``0.333`` != 1/3).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import logging
import re
from typing import Any

from policyopt.rewards.timelimit import VerifierTimeout, time_limit

# Answers longer than this (characters inside the box) are rejected unread.
MAX_ANSWER_CHARS = 1_000
# Deepest allowed nesting of (), [], {} inside an answer.
MAX_NESTING = 24
# Literal exponents (and factorial arguments) with more digits than this are rejected.
MAX_EXPONENT_DIGITS = 5
MAX_FACTORIAL_DIGITS = 3
# Default per-call limit for parsing + verification, seconds (math-verify's own default).
DEFAULT_TIMEOUT_S = 5.0

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Where the answer is: the last closed \boxed{} or the last "Answer: ..." line.
ANSWER_FORMATS = ("boxed", "answer_line")

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


def extract_answer(text: str, answer_format: str = "boxed") -> str | None:
    """The answer of ``text`` by ``answer_format`` (one of ``ANSWER_FORMATS``), or None."""
    if answer_format == "boxed":
        return extract_boxed(text)
    if answer_format == "answer_line":
        return extract_answer_line(text)
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


def _is_explosive(answer: str) -> bool:
    """True for power towers, huge literal exponents and factorials of huge arguments."""
    for power in _POWER.finditer(answer):
        exponent, end = _operand_after(answer, power.end())
        if _POWER.search(exponent) or _FACTORIAL.search(exponent):
            return True  # a^(b^c) or a^(b!)
        if _POWER.match(answer[end:].lstrip()):
            return True  # a**b**c, which binds as a**(b**c)
        if any(len(d) > MAX_EXPONENT_DIGITS for d in _DIGITS.findall(exponent)):
            return True
    for bang in _FACTORIAL.finditer(answer):
        before = answer[: bang.start()].rstrip()
        if before.endswith((")", "}", "]")):
            opener = {")": "(", "}": "{", "]": "["}[before[-1]]
            group = before[before.rfind(opener) :]
            if _POWER.search(group) or any(
                len(d) > MAX_FACTORIAL_DIGITS for d in _DIGITS.findall(group)
            ):
                return True
        else:
            digits = re.search(r"\d+$", before)
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
def _math_verify() -> Any:
    """math-verify, imported and warmed up once per process, outside any time limit.

    SymPy imports much of itself lazily on first use (simplification, polynomials, sets);
    one unlimited comparison of each kind pays that cost here rather than inside the first
    graded sample's time limit.
    """
    import math_verify  # deferred: importing SymPy takes about half a second

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_DropDisabledTimeoutWarning())
    warm_up = [("(x+1)^2", "x^2+2x+1"), (r"\frac{1}{3}", "0.3333333"), ("[1, 2)", r"\{1\}"), (r"\sqrt{8}", r"2\sqrt{2}")]
    for gold, answer in warm_up:
        math_verify.verify(
            math_verify.parse("\\boxed{" + gold + "}", parsing_timeout=None),
            math_verify.parse("\\boxed{" + answer + "}", parsing_timeout=None),
            timeout_seconds=None,
        )
    return math_verify


def _reference_answer(reference: str) -> str:
    boxed = extract_boxed(reference) if "\\boxed" in reference or "\\fbox" in reference else None
    text = boxed if boxed is not None else reference
    return text.strip().strip("$").strip()


@functools.lru_cache(maxsize=4096)
def _parse_gold(reference_answer: str) -> list:
    # Cached: the G samples of a group share their reference. Exceptions (timeouts) are
    # not cached by lru_cache.
    return _math_verify().parse("\\boxed{" + reference_answer + "}", parsing_timeout=None)


@functools.lru_cache(maxsize=16384)
def _symbolic_equal(gold: str, answer: str) -> bool:
    # Cached: samples of a group often repeat an answer. Call under a time limit; a
    # timeout propagates and is not cached.
    math_verify = _math_verify()
    parsed = math_verify.parse("\\boxed{" + answer + "}", parsing_timeout=None)
    return bool(math_verify.verify(_parse_gold(gold), parsed, timeout_seconds=None))


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
      reference: reference answer, plain (``"3/4"``, ``"\\frac{3}{4}"``) or boxed.
      timeout_s: wall-clock limit for parsing and verification; None: no limit.
      answer_format: where the answer is, ``"boxed"`` (the last ``\\boxed{}``) or
        ``"answer_line"`` (the last ``Answer: ...`` line); see the module docstring.

    Returns:
      A :class:`MathVerdict` (score 1.0 / 0.0 and the reason).
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    try:
        answer = extract_answer(answer_region(str(completion)), answer_format)
        if answer is None:
            return MathVerdict(0.0, "no_answer")
        gold = _reference_answer(str(reference))
        answer_key, gold_key = _normalise(answer), _normalise(gold)
        if not answer_key:
            return MathVerdict(0.0, "incorrect", answer)
        if answer_key == gold_key:
            return MathVerdict(1.0, "correct", answer)
        fast = _fast_compare(answer_key, gold_key)
        if fast is not None:
            return MathVerdict(float(fast), "correct" if fast else "incorrect", answer)
        if not screen_answer(answer) or not screen_answer(gold):
            return MathVerdict(0.0, "rejected", answer)
        _math_verify()  # import outside the limit: an interrupted import leaves a broken module
        with time_limit(timeout_s):
            ok = _symbolic_equal(gold, answer)
        return MathVerdict(float(ok), "correct" if ok else "incorrect", answer)
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
    return verify_math(completion, reference, timeout_s=timeout_s, answer_format=answer_format).score
