"""Code tests as datasets store them, brought to the two forms the code verifier runs;
assert strings cut to their first asserts, or split into one test per assert (partial credit).

The two forms: a string of Python statements (asserts), or a list of ``{"input": str,
"output": str}`` stdin / stdout cases. ``docs/rewards.md`` ("Code tests") lists the
encodings read. Test strings are trusted: ``ast.parse`` reads them, nothing evaluates them.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

# Keys that mark call-based cases (the function's arguments and return value, not stdin and
# stdout): APPS's fn_name, LiveCodeBench's testtype "functional" (DeepCoder's rows),
# PrimeIntellect's type "function_call".
_CALL_BASED = ("fn_name", "func_name")


def _refuse_call_based(tests: dict) -> None:
    if (
        any(tests.get(key) for key in _CALL_BASED)
        or tests.get("type") == "function_call"
        or (tests.get("testtype") not in (None, "stdin"))
    ):
        raise ValueError(
            "call-based tests (fn_name / testtype 'functional' / type 'function_call') are not "
            "supported: the cases must be stdin / stdout"
        )


def parse_tests(tests: Any, *, entry_point: str | None = None) -> str | list[dict[str, str]]:
    """Tests in any of the encodings datasets use, as the code verifier runs them.

    - A string of Python statements (asserts; HumanEval, MBPP's ``test``): as it is. A
      string holding JSON text (an array, an object or a string: ``"[...]"``) is decoded
      first and read by these rules; a string that is not valid JSON is Python.
    - A list of strings (MBPP's ``test_list``): the statements, one per line.
    - A list of ``{"input": ..., "output": ...}`` cases: stdin / expected stdout; either
      may be a number or a list of lines.
    - An object of parallel lists, ``{"inputs": [...], "outputs": [...]}`` (APPS's
      ``input_output``) or ``{"input": [...], "output": [...]}`` (CodeContests'
      ``public_tests``): the cases, in order; or with a ``test_cases`` list
      (PrimeIntellect's ``verification_info``): those cases.

    Args:
      tests: the tests, in one of those encodings.
      entry_point: HumanEval's function name: a test string that defines
        ``check(candidate)`` and never calls it gets ``check(<entry_point>)`` appended.

    Returns:
      An assert string, or a list of ``{"input": str, "output": str}`` dicts.

      Empty tests stay empty (the code verifier reports "no_tests" for an empty list).

    Raises:
      ValueError: an encoding not listed above; call-based cases (APPS's ``fn_name``,
        LiveCodeBench's ``testtype: "functional"``, ``type: "function_call"``: the
        function's arguments and return value instead of stdin / stdout); a
        ``check(candidate)`` that is never called and no ``entry_point``; a test string
        that is not Python, or whose top level neither asserts, raises nor calls
        anything (it would fail, or pass, every program).
    """
    if isinstance(tests, str):
        text = tests.strip()
        if text[:1] in ("[", "{", '"'):
            try:
                decoded = json.loads(text)
            except json.JSONDecodeError:
                decoded = None
            if decoded is not None:
                return parse_tests(decoded, entry_point=entry_point)
        if not text:
            return tests
        if re.search(r"^def check\(", tests, re.M) and not _calls_check(tests):
            if not entry_point:
                raise ValueError(
                    "the tests define check(candidate) but never call it, and no entry_point "
                    "names the function to check (every program would pass)"
                )
            if not entry_point.isidentifier():
                raise ValueError(f"entry_point {entry_point!r} is not a Python name")
            tests = tests.rstrip() + f"\n\n\ncheck({entry_point})\n"
        _check_runnable(tests)
        return tests
    if isinstance(tests, dict):
        _refuse_call_based(tests)
        if isinstance(tests.get("test_cases"), (list, tuple)):  # PrimeIntellect's verification_info
            return parse_tests(tests["test_cases"], entry_point=entry_point)
        inputs = tests.get("inputs", tests.get("input"))
        outputs = tests.get("outputs", tests.get("output"))
        if not isinstance(inputs, (list, tuple)) or not isinstance(outputs, (list, tuple)):
            raise ValueError(
                "a tests object needs parallel lists 'inputs' / 'outputs' (or 'input' / 'output'), "
                f"got keys {sorted(tests)[:6]}"
            )
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if isinstance(tests, (list, tuple)):
        if not tests:
            return []
        if all(isinstance(t, str) for t in tests):
            return parse_tests("\n".join(tests), entry_point=entry_point)
        if all(isinstance(t, dict) for t in tests):
            cases = []
            for case in tests:
                _refuse_call_based(case)
                if "input" not in case or "output" not in case:
                    raise ValueError(
                        f"a test case needs 'input' and 'output', got keys {sorted(case)[:6]}"
                    )
                cases.append(
                    {
                        "input": _lines(case["input"], "input"),
                        "output": _lines(case["output"], "output"),
                    }
                )
            return cases
        raise ValueError(
            "a list of tests must hold only assert strings or only {input, output} cases"
        )
    raise ValueError(f"tests must be text, a list or an object, got {type(tests).__name__}")


def limit_tests(
    tests: str | list[dict[str, str]], max_tests: int | None
) -> str | list[dict[str, str]]:
    """The first ``max_tests`` cases of parsed tests, or an assert string cut after its
    ``max_tests``-th top-level assert (the statements before it kept in order; asserts
    inside functions, as in HumanEval's ``check``, are not counted); None: all of them."""
    if max_tests is None:
        return tests
    if max_tests < 1:
        raise ValueError(f"max_tests must be >= 1 or None, got {max_tests}")
    if not isinstance(tests, str):
        return tests[:max_tests]
    try:
        statements = _statements(tests)
    except SyntaxError:
        return tests
    asserts = [i for i, (is_assert, _) in enumerate(statements) if is_assert]
    if len(asserts) <= max_tests:
        return tests
    cut = "\n".join(source for _, source in statements[: asserts[max_tests - 1] + 1]) + "\n"
    return cut if _parses(cut) else tests  # all of them rather than a cut that went wrong


def _statements(tests: str) -> list[tuple[bool, str]]:
    """``(is an assert, source)`` of each top-level statement of a test string, in order,
    decorators included."""
    lines = re.split(r"(?<=\n)|(?<=\r)(?!\n)", tests)  # ast's line breaks: \n, \r\n, \r only
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno: int, col: int) -> int:  # ast columns count UTF-8 bytes
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))

    statements = []
    for node in ast.parse(tests).body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        begin = starts[first - 1] if first < node.lineno else offset(node.lineno, node.col_offset)
        statements.append(
            (
                isinstance(node, ast.Assert),
                tests[begin : offset(node.end_lineno, node.end_col_offset)],
            )
        )
    return statements


def split_asserts(tests: str) -> list[str]:
    """One source string per top-level assert of a test string: the statements before it
    that are not asserts, in order, then the assert (partial credit); and when statements
    after the last assert can fail (a loop of asserts, a ``check(f)`` call), one more
    case: every statement that is not a top-level assert, in order. A string without
    top-level asserts (HumanEval's asserts inside ``check``) is one test."""
    statements = _statements(tests)
    cases = []
    for index, (is_assert, source) in enumerate(statements):
        if is_assert:
            setup = [s for a, s in statements[:index] if not a]
            cases.append("\n".join(setup + [source]) + "\n")
    last = max((i for i, (is_assert, _) in enumerate(statements) if is_assert), default=-1)
    if cases and any(_can_fail(source) for _, source in statements[last + 1 :]):
        cases.append("\n".join(s for a, s in statements if not a) + "\n")
    if not cases or not all(_parses(case) for case in cases):
        return [tests]  # one test rather than a case the split got wrong
    return cases


def _can_fail(source: str) -> bool:
    """Whether a top-level statement can fail a test: it asserts, raises or calls
    (outside a function or class definition, which runs nothing by being defined)."""
    try:
        node = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return True
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    return any(isinstance(sub, (ast.Assert, ast.Raise, ast.Call)) for sub in ast.walk(node))


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def _lines(value: Any, what: str) -> str:
    """A stdin / stdout text: a string, a number, or a list of lines (joined by newlines)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise ValueError(
        f"a test case's {what} must be text, a number or a list of lines, "
        f"got {type(value).__name__}"
    )


def _check_runnable(tests: str) -> None:
    """Raises ``ValueError`` unless ``tests`` is Python that can fail: a string that does not
    parse (a math answer such as ``\\frac12``, a compressed blob) would fail every
    program, and one whose top level neither asserts, raises nor calls anything (``34``;
    ``def test_x(): assert ...`` never called) would pass every program."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as error:
        raise ValueError(f"the tests are not Python ({error.msg}, line {error.lineno})") from None
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if any(name.split(".")[0] in ("unittest", "pytest") for name in names):
            raise ValueError(
                "unittest / pytest tests are not supported: their failures are reported, "
                "not raised (write them as asserts)"
            )
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if any(isinstance(sub, (ast.Assert, ast.Raise, ast.Call)) for sub in ast.walk(node)):
            return
    if any(
        isinstance(node, ast.FunctionDef) and node.name.startswith("test") for node in tree.body
    ):
        raise ValueError(
            "pytest-style tests (def test_...) are not run: call them at the top level of the "
            "tests, or write them as asserts"
        )
    raise ValueError(
        "the tests cannot fail: nothing at their top level asserts, raises or calls "
        "(every program would pass)"
    )


def _calls_check(tests: str) -> bool:
    """Whether a test string calls ``check`` outside ``def check`` (``ast.parse`` of the
    trusted tests: nothing is evaluated)."""
    try:
        tree = ast.parse(tests)
    except SyntaxError:
        return re.search(r"^check\(", tests, re.M) is not None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            continue
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Name)
                and sub.func.id == "check"
            ):
                return True
    return False
