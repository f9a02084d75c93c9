"""Local JSONL files of math problems (GSM8K / MATH style) or code problems with tests
(MBPP / HumanEval / APPS / CodeContests style) as task records.

One JSON object per line; the question and the answer come from configurable fields, the
reference is extracted from the answer (the last `\\boxed{}`, else the text after `####`,
else the whole field). A record is `{"prompt", "answer", "solution"}` (and `task` in mixed
files); the solution is not rewritten into a response format. Code rows' tests are read by
`policyopt.rewards.parse_tests` and stored as JSON text in `answer`. A malformed row raises
`MalformedRowError` naming `file:line`, or is skipped and counted with `skip_malformed`.
What is read from each kind of row: docs/quickstart.md, "What a JSONL row holds".
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

from absl import logging

from policyopt.checks import check_prompt_template

_BOXED_PREFIXES = ("\\boxed{", "\\fbox{")


TASKS = ("math", "code", "mixed")


class MalformedRowError(ValueError):
    """A data row that cannot be read; the message starts with `file:line:`."""


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced.

    Returns None when there is none, or when the last one is never closed.
    `last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"`.
    """
    start = -1  # index just after the opening brace of the last box
    for prefix in _BOXED_PREFIXES:
        position = text.rfind(prefix)
        if position >= 0:
            start = max(start, position + len(prefix))
    if start < 0:
        return None
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


@dataclasses.dataclass(frozen=True)
class JsonlConfig:
    """How to read a math (or code) JSONL file.

    Field names may be dotted paths into nested objects (verl-style rows:
    ``"reward_model.ground_truth"``), and a question field may hold a list of chat
    messages (``[{"role": "user", "content": ...}, ...]``, as in DAPO-Math-17k or
    verl's parquet files exported with ``datasets``' ``to_json``): the content of its
    last user message is the problem.

    Attributes:
      question_fields: candidate names of the problem field, the first present is used
        (GSM8K: "question"; MATH: "problem").
      answer_fields: candidate names of the field the reference is extracted from, the first
        present is used (GSM8K: "answer"; MATH: "solution"; MATH-500 has both "answer" and
        "solution": "answer" comes first).
      solution_field: field kept as the record's worked `solution` (None: the first field
        among "solution", "answer" that exists, for code rows among "solution", "code",
        else empty).
      extract: "auto" (last `\\boxed{}` if any, else the text after the last
        `answer_marker` if any, else the whole text), "boxed" (a box is required), "marker"
        (the marker is required) or "none" (the whole text).
      answer_marker: GSM8K's final-answer marker.
      prompt_template: format string for the prompt, with `{question}`, e.g.
        `"{question}\\nPut the final answer in \\\\boxed{{}}."`.
      skip_malformed: skip, count and report malformed rows instead of raising.
      task: "math" (a reference answer, from `answer_fields`), "code" (tests, from
        `tests_fields`; `answer_fields` and `extract` are unused) or "mixed" (per row:
        code when a tests field is present, else math; records get a `task` field).
      tests_fields: candidate names of the tests field, the first present is used
        (MBPP: "test_list"; HumanEval: "test"; APPS: "input_output"; CodeContests:
        "public_tests"; verl-style rows: "reward_model.ground_truth").
      task_field: "mixed" only: a field naming each row's task (verl-style rows:
        "ability"; a value containing "code", "coding" or "program" is code, one
        containing "math" is math, anything else is malformed), for files whose math
        answers and code tests share a field. None: a row is code when one of
        `tests_fields` holds tests (not empty, also as JSON text: "[]" is none).
      code_prompt_template: the prompt of code rows, with `{question}` (e.g. asking for
        a fenced Python block, where `prompt_template` asks math rows for a box); None:
        `prompt_template`.
    """

    question_fields: tuple[str, ...] = ("question", "problem", "prompt")
    answer_fields: tuple[str, ...] = ("answer", "solution")
    solution_field: str | None = None
    extract: str = "auto"
    answer_marker: str = "####"
    prompt_template: str = "{question}"
    skip_malformed: bool = False
    task: str = "math"
    tests_fields: tuple[str, ...] = ("tests", "test_list", "test", "input_output", "public_tests")
    task_field: str | None = None
    code_prompt_template: str | None = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"JsonlConfig.task must be one of {TASKS}, got {self.task!r}")
        if isinstance(self.tests_fields, str):
            raise ValueError("JsonlConfig.tests_fields is a tuple of names, e.g. ('test_list',)")
        if self.task_field is not None and self.task != "mixed":
            raise ValueError(f"JsonlConfig.task_field is for task='mixed', got task={self.task!r}")
        if self.extract not in ("auto", "boxed", "marker", "none"):
            raise ValueError(
                f"JsonlConfig.extract must be 'auto', 'boxed', 'marker' or 'none', "
                f"got {self.extract!r}"
            )
        if isinstance(self.question_fields, str) or isinstance(self.answer_fields, str):
            raise ValueError(
                "JsonlConfig.question_fields / answer_fields are tuples of names, "
                "e.g. ('question',)"
            )
        for name in ("prompt_template", "code_prompt_template"):
            check_prompt_template(f"JsonlConfig.{name}", getattr(self, name))


@dataclasses.dataclass
class JsonlReport:
    """What reading a file did: every line is accounted for.

    lines == blank_lines + loaded + len(skipped).
    """

    path: str
    lines: int = 0
    blank_lines: int = 0
    loaded: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)  # "file:line: reason"

    def summary(self) -> str:
        text = (
            f"{self.path}: {self.loaded} rows loaded, {len(self.skipped)} malformed rows "
            f"skipped, {self.blank_lines} blank lines"
        )
        if self.skipped:
            text += "; first skipped: " + "; ".join(self.skipped[:3])
        return text


def extract_reference(text: str, config: JsonlConfig) -> str | None:
    """The reference answer in an answer/solution text (None if the rule finds nothing)."""
    if config.extract in ("auto", "boxed"):
        boxed = last_boxed(text)
        if boxed is not None:
            return boxed.strip()
        if config.extract == "boxed":
            return None
    if config.extract in ("auto", "marker"):
        if config.answer_marker in text:
            return text.rsplit(config.answer_marker, 1)[1].strip()
        if config.extract == "marker":
            return None
    return text.strip()


_MISSING = object()


def _lookup(row: dict, name: str) -> Any:
    """``row[name]``, following dots into nested objects (``_MISSING`` if absent)."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _last_user_message(messages: list) -> str | None:
    """The content of the last ``{"role": "user", "content": str}`` of a chat, or None."""
    for message in reversed(messages):
        if (
            isinstance(message, dict)
            and message.get("role") == "user"
            and isinstance(message.get("content"), str)
        ):
            return message["content"]
    return None


def _text_field(
    row: dict, names: tuple[str, ...], what: str, *, chat: bool = False, numbers: bool = True
) -> tuple[str, str]:
    """(field name, its text) of the first of `names` present (dotted paths allowed; with
    `chat`, a list of chat messages gives its last user message; with `numbers`, a number
    gives its text); raises `ValueError`."""
    for name in names:
        value = _lookup(row, name)
        if value is _MISSING or value is None:
            continue
        if chat and isinstance(value, list):
            content = _last_user_message(value)
            if content is None:
                raise ValueError(
                    f"{what} field {name!r} is a list without a user message "
                    "({'role': 'user', 'content': ...})"
                )
            return name, content
        kinds = (str, int, float) if numbers else (str,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            expected = "text or a number" if numbers else "text"
            raise ValueError(
                f"{what} field {name!r} must be {expected}, got {type(value).__name__}"
            )
        return name, str(value)
    raise ValueError(
        f"missing {what} field: none of {list(names)} present (fields: {sorted(row)[:10]})"
    )


def _find_tests(row: dict, config: JsonlConfig) -> tuple[str | None, list[str]]:
    """``(tests as JSON text, or None when no field holds any; the names of the fields
    present but empty)``: the first of ``tests_fields`` holding tests, read by
    ``policyopt.rewards.parse_tests`` (an empty field gives way to the next, e.g.
    CodeContests' public_tests); raises ``ValueError`` for tests it cannot read."""
    from policyopt.rewards.testcases import parse_tests  # deferred: only code tasks need it

    empty = []
    for name in config.tests_fields:
        value = _lookup(row, name)
        if value is _MISSING or value is None:
            continue
        entry_point = row.get("entry_point")
        try:
            tests = parse_tests(
                value, entry_point=entry_point if isinstance(entry_point, str) else None
            )
        except ValueError as e:
            raise ValueError(f"tests field {name!r}: {e}") from None
        if not (tests.strip() if isinstance(tests, str) else tests):
            empty.append(name)
            continue
        if isinstance(tests, str):
            tests = _mbpp_setup(row) + tests
        return json.dumps(tests), empty
    return None, empty


def _code_tests(row: dict, config: JsonlConfig) -> str:
    """The row's tests as JSON text (``_find_tests``); raises ``ValueError``."""
    tests, empty = _find_tests(row, config)
    if tests is not None:
        return tests
    if empty:
        raise ValueError(f"tests field {empty[0]!r}: empty tests")
    raise ValueError(
        f"missing tests field: none of {list(config.tests_fields)} present "
        f"(fields: {sorted(row)[:10]})"
    )


def _row_task(row: dict, config: JsonlConfig) -> str:
    """ "math" or "code": a mixed file's row, by ``config.task_field`` or by its tests."""
    if config.task_field is not None:
        value = _lookup(row, config.task_field)
        if not isinstance(value, str):
            raise ValueError(f"task field {config.task_field!r} missing or not text")
        name = value.lower()
        if any(word in name for word in ("code", "coding", "program")):
            return "code"
        if "math" in name:
            return "math"
        raise ValueError(f"task field {config.task_field!r}: {value!r} is neither math nor code")
    try:
        return "math" if _find_tests(row, config)[0] is None else "code"
    except ValueError:
        return "code"  # tests it cannot read: the row is malformed, and says why


def _mbpp_setup(row: dict) -> str:
    """MBPP's ``test_setup_code`` and sanitized MBPP's ``test_imports``, to run before its
    asserts (the program and the tests share one namespace)."""
    lines = []
    imports = row.get("test_imports")
    if isinstance(imports, list):
        lines += [line for line in imports if isinstance(line, str) and line.strip()]
    setup = row.get("test_setup_code")
    if isinstance(setup, str) and setup.strip():
        lines.append(setup.rstrip())
    return "\n".join(lines) + "\n" if lines else ""


def _unique_keys(pairs: list) -> dict:
    """A JSON object's pairs as a dict; a key given twice is an error (``json`` would keep
    the last value silently)."""
    row = {}
    for key, value in pairs:
        if key in row:
            raise ValueError(f"invalid JSON (duplicate key {key!r})")
        row[key] = value
    return row


def parse_row(line: str, config: JsonlConfig) -> dict[str, str]:
    """One JSONL line to a record; raises `ValueError` saying what is wrong."""
    try:
        row: Any = json.loads(line, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ValueError(
            f"invalid JSON (nested deeper than Python's recursion limit, {sys.getrecursionlimit()})"
        ) from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    _, question = _text_field(row, config.question_fields, "question", chat=True, numbers=False)
    if not question.strip():
        raise ValueError("empty question")
    task = config.task
    if task == "mixed":
        task = _row_task(row, config)
    if task == "code":
        reference = _code_tests(row, config)
        default_solutions = ("solution", "code")
    else:
        answer_name, answer_text = _text_field(row, config.answer_fields, "answer")
        reference = extract_reference(answer_text, config)
        if reference is None:
            rule = "\\boxed{}" if config.extract == "boxed" else repr(config.answer_marker)
            raise ValueError(f"no {rule} in field {answer_name!r}")
        if not reference:
            raise ValueError(f"empty answer extracted from field {answer_name!r}")
        default_solutions = ("solution", "answer")
    solution_names = (
        (config.solution_field,) if config.solution_field is not None else default_solutions
    )
    solution = ""
    for name in solution_names:
        if isinstance(_lookup(row, name), str):
            solution = _lookup(row, name)
            break
    else:
        if config.solution_field is not None:
            raise ValueError(f"missing solution field {config.solution_field!r}")
    if task == "code" and solution.strip() and "```" not in solution:
        code = solution.replace("\r\n", "\n").strip("\n")  # the first line keeps its indent
        solution = f"```python\n{code}\n```"  # the format the code verifier reads
    template = (
        config.code_prompt_template
        if task == "code" and config.code_prompt_template
        else config.prompt_template
    )
    record = {
        "prompt": template.format(question=question),
        "answer": reference,
        "solution": solution,
    }
    if config.task == "mixed":
        record["task"] = task
    return record


def read_math_jsonl(
    path: str | os.PathLike, config: JsonlConfig = JsonlConfig()
) -> tuple[list[dict[str, str]], JsonlReport]:
    """Reads a JSONL math file (or, with ``config.task = "code"``, code problems) into records.

    Args:
      path: the file.
      config: field names, extraction rule, malformed-row policy.
    Returns:
      (records in file order, report).
    Raises:
      MalformedRowError: `"{path}:{line}: {reason}"` for the first malformed row, unless
        `config.skip_malformed`.
      ValueError: naming the file, when it holds no row (empty, blank, or every row
        malformed and skipped).
    """
    path = os.fspath(path)
    report = JsonlReport(path=path)
    records = []
    with open(path, "rb") as f:  # decoded line by line: a bad byte is one malformed row
        for line_number, raw in enumerate(f, start=1):
            report.lines += 1
            if not raw.strip():
                report.blank_lines += 1
                continue
            try:
                try:
                    line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(
                        f"not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r})"
                    ) from None
                record = parse_row(line, config)
            except ValueError as e:
                message = f"{path}:{line_number}: {e}"
                if not config.skip_malformed:
                    raise MalformedRowError(message) from None
                report.skipped.append(message)
                continue
            records.append(record)
            report.loaded += 1
    if not records:
        if report.skipped:
            raise ValueError(
                f"{path}: no rows left: all {len(report.skipped)} rows are malformed; "
                f"first: {report.skipped[0]}"
            )
        blank = f"{report.blank_lines} blank lines" if report.lines else "an empty file"
        raise ValueError(f"{path}: no rows ({blank}): expected one JSON object a line")
    if report.skipped:
        logging.warning("%s", report.summary())
    return records, report
