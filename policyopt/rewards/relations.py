"""Relations in a final answer (``43 = 42``, ``41 \\lor 42``, a ``cases`` block): its sides,
and which of them are names rather than values.

math-verify grades a relation against a plain reference by one side (``43 = 42`` equals
``42``). :func:`value_sides` splits an answer at its relation symbols so that the math
verifier can ask every value side to equal the reference; names (``x``, ``f(2)``,
``a_1``, ``\\theta``) are left out. The rule: ``docs/rewards.md``, "Relations in an
answer".
"""

from __future__ import annotations

import re

# Relation and connective commands that separate sides (`\ne`, inequalities and `\in` are
# left to math-verify: `x \ne 42` does not say that the answer is 42).
_RELATION_COMMANDS = frozenset(
    "equiv approx sim simeq cong to rightarrow longrightarrow Rightarrow Longrightarrow "
    "implies leftarrow Leftarrow impliedby mapsto iff Leftrightarrow leftrightarrow "
    "Longleftrightarrow longleftrightarrow lor vee land wedge newline".split()
)
# Environments whose rows (`\\`) and cells (`&`) are sides; their markers are dropped.
_ROW_ENVIRONMENTS = (
    "cases|dcases|rcases|aligned|alignedat|align\\*?|gathered|gather\\*?|split|array|eqnarray\\*?"
)
_ENVIRONMENT = re.compile(r"\\(?:begin|end)\{(?:" + _ROW_ENVIRONMENTS + r")\}(?:\{[^{}]*\})?")
# "or" / "and" written as text between two sides.
_TEXT_CONNECTIVE = re.compile(
    r"\\(?:text|textrm|textnormal|mathrm|mbox|textbf)\s*\{\s*(?:or|and)\s*\}|\b(?:or|and)\b"
)
# A LaTeX token: \left / \right with their delimiter, a line break, a command, an escaped
# character, or one character.
_TOKEN = re.compile(
    r"\\(?:left|right)(?![A-Za-z])\s*(?:\\[A-Za-z]+|\\.|.)|\\\\|\\[A-Za-z]+|\\.|.", re.S
)
_OPENERS = frozenset("([{") | {"\\{", "\\langle", "\\lbrace"}
_CLOSERS = frozenset(")]}") | {"\\}", "\\rangle", "\\rbrace"}
# Greek letters that name variables (\pi is a number; \infty is no letter at all).
_GREEK = frozenset(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu "
    "nu xi rho varrho sigma varsigma tau upsilon phi varphi chi psi omega Gamma Delta "
    "Theta Lambda Xi Sigma Upsilon Phi Psi Omega".split()
)
_COMMAND = re.compile(r"\\([A-Za-z]+)")
_MODULUS = re.compile(r"\\pmod\s*\{[^{}]*\}|\\pmod\s*\w+|\\(?:bmod|mod)\s*\{?\w*\}?")
_WRAPPERS = (
    ("\\left(", "\\right)"),
    ("\\left[", "\\right]"),
    ("\\left\\{", "\\right\\}"),
    ("(", ")"),
    ("[", "]"),
    ("\\{", "\\}"),
    ("{", "}"),
)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textrm|mathrm|mbox)\s*\{(.*)\}", re.S)


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


_DELIMITED = re.compile(r"\\(left|right)(?![A-Za-z])")


def _sized(token: str) -> str:
    """``"left"`` for ``\\left(`` and the like, ``"right"`` for ``\\right)``, else ""."""
    match = _DELIMITED.match(token)
    return match.group(1) if match else ""


def _is_opener(token: str) -> bool:
    return token in _OPENERS or _sized(token) == "left"


def _is_closer(token: str) -> bool:
    return token in _CLOSERS or _sized(token) == "right"


def _encloses(text: str, opener: str, closer: str) -> bool:
    """Whether ``text`` is ``opener ... closer`` with the two matching each other."""
    if not (text.startswith(opener) and text.endswith(closer)):
        return False
    depth = 0
    tokens = _tokens(text)
    for index, token in enumerate(tokens):
        if _is_opener(token):
            depth += 1
        elif _is_closer(token):
            depth -= 1
            if depth == 0 and index < len(tokens) - 1:
                return False  # the first bracket closes before the end: `(1)+(2)`
    return depth == 0


def _unwrap(text: str) -> str:
    """``text`` without brackets, braces or a ``\\text{}`` around the whole of it."""
    text = text.strip()
    while True:
        match = _TEXT_WRAPPER.fullmatch(text)
        if match is not None and "}" not in match.group(1).replace("\\}", ""):
            text = match.group(1).strip()
            continue
        for opener, closer in _WRAPPERS:
            if len(text) > len(opener) + len(closer) and _encloses(text, opener, closer):
                text = text[len(opener) : -len(closer)].strip()
                break
        else:
            return text


def _is_separator(token: str) -> bool:
    if token in ("=", "&", "\\\\"):
        return True
    return token.startswith("\\") and token[1:] in _RELATION_COMMANDS


def sides(text: str) -> list[str]:
    """The sides of ``text`` split at its relations and connectives outside brackets
    (``=``, ``==``, ``:=``, ``\\equiv``, ``\\to``, ``\\iff``, ``\\lor``, ``\\land``, line
    breaks and the cells of ``cases``-like environments, "or" / "and" in words), after
    removing brackets around the whole; empty sides dropped. One side: no relation."""
    text = _TEXT_CONNECTIVE.sub(" = ", _ENVIRONMENT.sub(" \\\\\\\\ ", _unwrap(text)))
    found, current, depth = [], [], 0
    tokens = _tokens(text)
    for index, token in enumerate(tokens):
        before = tokens[index - 1] if index else ""
        after = tokens[index + 1] if index + 1 < len(tokens) else ""
        if _is_opener(token):
            depth += 1
        elif _is_closer(token):
            depth = max(depth - 1, 0)
        elif depth == 0 and (
            (token == "=" and before == "=") or (token == ":" and "=" in (before, after))
        ):
            continue  # `==` and `=:` split at their first `=`, `:=` at its `=`
        elif depth == 0 and _is_separator(token) and before not in ("<", ">", "!"):
            found.append("".join(current))  # (`<=`, `>=`, `!=` are no equalities)
            current = []
            continue
        current.append(token)
    found.append("".join(current))
    return [side.strip() for side in found if side.strip()]


def is_name(side: str) -> bool:
    """Whether a side names something rather than states a value: it holds a letter that
    is a variable (``x``, ``f(2)``, ``a_1``, ``\\theta``, ``\\text{Answer}``), not only
    numbers and constants (``6 \\cdot 7``, ``\\frac{\\pi}{2}``, ``\\infty``)."""

    def letters(match: re.Match) -> str:
        return " v " if match.group(1) in _GREEK else " "

    return re.search(r"[A-Za-z]", _COMMAND.sub(letters, side)) is not None


def value_sides(answer: str, reference: str) -> list[str] | None:
    """The sides of ``answer`` that must each equal ``reference``, or None when the rule
    does not apply: the answer states no relation, the reference states one or is a
    collection (a comma: a tuple, set or interval; those are compared whole), or every
    side is a name (``f(x) = x^2``: compared whole, as math-verify does)."""
    if len(sides(reference)) > 1 or "," in reference or ";" in reference:
        return None
    found = sides(answer)
    if len(found) < 2:
        return None
    values = [_MODULUS.sub("", side).strip() for side in found if not is_name(side)]
    values = [value for value in values if value]
    return values or None
