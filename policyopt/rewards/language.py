"""Magistral's language-consistency reward (arXiv 2506.10910, section 2.2.1).

Magistral identifies (with fastText) the language of the problem, of the thoughts and of
the answer, after removing LaTeX and code, and adds 0.1 when all three are the same
language. fastText needs a separately downloaded model; policyopt uses ``py3langid``
(langid.py's Naive Bayes model over byte n-grams, 97 languages), whose model ships inside
the package and loads offline.

Stripping (:func:`strip_latex_and_code`), in order: fenced code blocks, inline code,
display and inline maths (``$$...$$``, ``\\[...\\]``, ``$...$``, ``\\(...\\)``),
``\\begin{..}...\\end{..}`` environments, remaining LaTeX commands (``\\frac``,
``\\boxed``: the command name only; the words inside ``\\text{...}`` are kept), braces,
and think tags.

Short texts: a segment with fewer than ``min_letters`` alphabetic characters after
stripping is *undetermined* (a bare ``\\boxed{42}`` answer, an empty problem): it is
skipped rather than counted as a mismatch, because language identification on a handful
of characters is noise. The bonus requires the *reasoning* to be determined and every
determined segment to share its language, so a response whose reasoning is all maths
gets no bonus, and an answer of one sentence in another language loses it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

# Below this many letters a segment's language is "undetermined" (see module docstring).
DEFAULT_MIN_LETTERS = 20
UNDETERMINED = "und"

_STRIP_PATTERNS = [
    re.compile(r"```.*?(?:```|$)", re.DOTALL),  # fenced code (unclosed: to the end)
    re.compile(r"`[^`\n]*`"),  # inline code
    re.compile(r"\$\$.*?\$\$", re.DOTALL),
    re.compile(r"\\\[.*?\\\]", re.DOTALL),
    re.compile(r"\$[^$]*\$"),
    re.compile(r"\\\(.*?\\\)", re.DOTALL),
    re.compile(r"\\begin\{([^}]*)\}.*?\\end\{\1\}", re.DOTALL),
    re.compile(r"</?think>"),
    re.compile(r"\\[A-Za-z]+\*?|\\."),  # commands (name only) and escaped characters
    re.compile(r"[{}^_]"),
]


def strip_latex_and_code(text: str) -> str:
    """``text`` without code, maths and LaTeX commands (see the module docstring)."""
    for pattern in _STRIP_PATTERNS:
        text = pattern.sub(" ", text)
    return re.sub(r"\s+", " ", text).strip()


@functools.cache
def load_language_identifier() -> Any:
    """py3langid's language identifier, loaded once per process (the scoring pool's fork
    server loads it before forking its workers, ``policyopt.rewards.worker``)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    # A private instance: py3langid's module-level one is shared global state.
    return LanguageIdentifier.from_model_file(MODEL_FILE)


def identify_language(text: str, *, min_letters: int = DEFAULT_MIN_LETTERS) -> str:
    """ISO 639-1 code of ``text`` after stripping, or ``"und"`` when it is too short."""
    stripped = strip_latex_and_code(text)
    if sum(char.isalpha() for char in stripped) < min_letters:
        return UNDETERMINED
    return load_language_identifier().classify(stripped)[0]


def languages_consistent(
    problem: str | None, reasoning: str, answer: str, *, min_letters: int = DEFAULT_MIN_LETTERS
) -> bool:
    """True when the reasoning's language is determined and every determined segment
    (problem, reasoning, answer) has that same language."""
    reasoning_language = identify_language(reasoning, min_letters=min_letters)
    if reasoning_language == UNDETERMINED:
        return False
    for segment in (problem or "", answer):
        language = identify_language(segment, min_letters=min_letters)
        if language not in (UNDETERMINED, reasoning_language):
            return False
    return True
