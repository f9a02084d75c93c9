"""Local JSONL math files: reference extraction, malformed rows named by file:line."""

import json

import pytest

from policyopt.data.jsonl import (
    JsonlConfig,
    MalformedRowError,
    extract_reference,
    last_boxed,
    parse_row,
    read_math_jsonl,
)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("$\\boxed{\\{1, 2\\} \\cup \\{3\\}}$", "\\{1, 2\\} \\cup \\{3\\}"),
        ("\\boxed{3} then \\fbox{7}", "7"),
        ("\\boxed{{a}{b{c}}}", "{a}{b{c}}"),
        ("no box here", None),
        ("\\boxed{unclosed {", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_gsm8k_and_math_files(tmp_path):
    gsm8k = _write(
        tmp_path / "gsm8k.jsonl",
        [
            json.dumps(
                {
                    "question": "Tom has 3 apples and buys 4. How many?",
                    "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
                }
            ),
            json.dumps({"question": "What is 5 - 8?", "answer": "5 - 8 = -3\n####  -3 "}),
        ],
    )
    records, report = read_math_jsonl(gsm8k)
    assert [r["answer"] for r in records] == ["7", "-3"]
    assert records[0]["prompt"] == "Tom has 3 apples and buys 4. How many?"
    assert records[0]["solution"].endswith("#### 7")
    assert (report.lines, report.loaded, report.skipped) == (2, 2, [])

    math = _write(
        tmp_path / "math.jsonl",
        [
            json.dumps({"problem": "Compute $1/2$.", "solution": "It is $\\boxed{\\frac{1}{2}}$."}),
            # MATH-500 style: a short "answer" field next to the solution; "answer" comes first.
            json.dumps({"problem": "p", "solution": "\\boxed{0.5}", "answer": "\\frac12"}),
        ],
    )
    config = JsonlConfig(prompt_template="{question}\nPut the answer in \\boxed{{}}.")
    records, _ = read_math_jsonl(math, config)
    assert [r["answer"] for r in records] == ["\\frac{1}{2}", "\\frac12"]
    assert records[0]["prompt"] == "Compute $1/2$.\nPut the answer in \\boxed{}."
    assert records[1]["solution"] == "\\boxed{0.5}"


def test_custom_fields_and_numbers(tmp_path):
    path = _write(
        tmp_path / "custom.jsonl", [json.dumps({"q": "six times seven", "a": 42, "work": "6*7"})]
    )
    records, _ = read_math_jsonl(
        path, JsonlConfig(question_fields=("q",), answer_fields=("a",), solution_field="work")
    )
    assert records == [{"prompt": "six times seven", "answer": "42", "solution": "6*7"}]


def test_verl_style_rows_nested_fields_and_chat_prompts(tmp_path):
    """A DAPO-Math-17k / verl row (a chat list as the prompt, the reference nested under
    reward_model): the last user message is the problem, dotted names reach the answer."""
    row = {
        "data_source": "math_dapo",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Find x if 2x = 68."},
        ],
        "reward_model": {"style": "rule", "ground_truth": "34"},
        "extra_info": {"index": 7, "solution": "x = 34"},
    }
    no_user = dict(row, prompt=[{"role": "system", "content": "hi"}])
    path = _write(tmp_path / "dapo.jsonl", [json.dumps(row), json.dumps(no_user)])
    config = JsonlConfig(
        question_fields=("prompt",),
        answer_fields=("reward_model.ground_truth",),
        solution_field="extra_info.solution",
        extract="none",
        skip_malformed=True,
    )
    records, report = read_math_jsonl(path, config)
    assert records == [{"prompt": "Find x if 2x = 68.", "answer": "34", "solution": "x = 34"}]
    assert report.skipped == [
        f"{path}:2: question field 'prompt' is a list without a user "
        "message ({'role': 'user', 'content': ...})"
    ]
    missing = JsonlConfig(question_fields=("prompt",), answer_fields=("reward_model.answer",))
    with pytest.raises(
        MalformedRowError, match="missing answer field: none of \\['reward_model.answer'\\] present"
    ):
        read_math_jsonl(path, missing)


def test_extract_rules():
    assert extract_reference("x \\boxed{2} #### 3", JsonlConfig()) == "2"
    assert extract_reference("x #### 3", JsonlConfig(extract="boxed")) is None
    assert extract_reference("x \\boxed{2} #### 3", JsonlConfig(extract="marker")) == "3"
    assert extract_reference("  12 ", JsonlConfig(extract="none")) == "12"
    assert extract_reference("The answer: 5", JsonlConfig(answer_marker="The answer:")) == "5"


@pytest.mark.parametrize(
    "bad_line, config, reason",
    [
        ('{"question": "q", "answer": "#### 1"', JsonlConfig(), "invalid JSON"),
        ("[1, 2]", JsonlConfig(), "expected a JSON object, got list"),
        ('{"question": "q"}', JsonlConfig(), "missing answer field"),
        ('{"answer": "1"}', JsonlConfig(), "missing question field"),
        ('{"question": "q", "answer": "#### "}', JsonlConfig(), "empty answer"),
        ('{"question": "q", "answer": "\\\\boxed{}"}', JsonlConfig(), "empty answer"),
        ('{"question": "  ", "answer": "1"}', JsonlConfig(), "empty question"),
        (
            '{"question": "q", "answer": ["1"]}',
            JsonlConfig(),
            "answer field 'answer' must be text or a number",
        ),
        ('{"question": "q", "answer": "7"}', JsonlConfig(extract="boxed"), "no \\\\boxed"),
        ('{"question": "q", "answer": "7"}', JsonlConfig(extract="marker"), "no '####'"),
        # A number is an answer, not a problem.
        ('{"question": 5, "answer": "7"}', JsonlConfig(), "question field 'question' must be text"),
        # Two values for one key: json keeps the last silently.
        (
            '{"question": "q", "answer": "1", "question": "r"}',
            JsonlConfig(),
            "invalid JSON \\(duplicate key 'question'\\)",
        ),
        (
            '{"question": "q", "answer": "1", "m": {"a": 1, "a": 2}}',
            JsonlConfig(),
            "invalid JSON \\(duplicate key 'a'",
        ),
        # Nested past Python's recursion limit (a RecursionError traceback before).
        (
            '{"question": "q", "answer": "1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
            JsonlConfig(),
            "invalid JSON \\(nested deeper than Python.s recursion limit",
        ),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, bad_line, config, reason):
    good = json.dumps({"question": "ok", "answer": "\\boxed{1} #### 1"})
    path = _write(tmp_path / "data.jsonl", [good, "", good, bad_line, good])
    with pytest.raises(MalformedRowError, match=f"data.jsonl:4: {reason}"):
        read_math_jsonl(path, config)
    records, report = read_math_jsonl(
        path, JsonlConfig(**{**config.__dict__, "skip_malformed": True})
    )
    assert len(records) == report.loaded == 3
    assert report.blank_lines == 1 and len(report.skipped) == 1
    assert report.skipped[0].startswith(f"{path}:4: ")
    assert report.lines == report.blank_lines + report.loaded + len(report.skipped) == 5
    assert "1 malformed rows skipped" in report.summary()


def test_a_file_without_rows_is_named(tmp_path):
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError) as error:
        read_math_jsonl(empty)
    assert str(error.value) == f"{empty}: no rows (1 blank lines): expected one JSON object a line"
    (tmp_path / "zero.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"zero.jsonl: no rows \(an empty file\)"):
        read_math_jsonl(tmp_path / "zero.jsonl")
    bad = _write(tmp_path / "bad.jsonl", ['{"q": "1"}', '{"q": "2"}'])
    with pytest.raises(ValueError) as error:
        read_math_jsonl(bad, JsonlConfig(skip_malformed=True))
    assert str(error.value).startswith(
        f"{bad}: no rows left: all 2 rows are malformed; first: {bad}:1: missing question field"
    )


def test_a_row_that_is_not_utf8_is_one_malformed_row(tmp_path):
    good = json.dumps({"question": "ok", "answer": "#### 1"}).encode()
    path = tmp_path / "data.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + good
        + b"\n"
        + b'{"question": "caf\xe9", "answer": "#### 2"}\n'
        + good
        + b"\n"
    )
    with pytest.raises(MalformedRowError, match=r"data.jsonl:2: not UTF-8 text \(byte 17"):
        read_math_jsonl(path, JsonlConfig())
    records, report = read_math_jsonl(path, JsonlConfig(skip_malformed=True))
    assert [r["prompt"] for r in records] == ["ok", "ok"] and len(report.skipped) == 1  # BOM read


def test_prompt_templates_are_checked_when_the_config_is_made():
    with pytest.raises(ValueError, match="not a format string with only {question}"):
        JsonlConfig(prompt_template="{question} in {unit}")
    with pytest.raises(ValueError, match="write literal braces twice"):
        JsonlConfig(code_prompt_template="{question} \\boxed{}")
    with pytest.raises(ValueError, match="must contain"):
        JsonlConfig(prompt_template="{{question}}")
    assert JsonlConfig(prompt_template="{question} \\boxed{{}}").prompt_template.endswith("{{}}")
    # The task section's templates get the same one-line errors, named as the config spells them.
    from configs import base

    config = base.get_config()
    config.task.name = "math_jsonl"
    config.task.train_file = config.task.test_file = "x.jsonl"
    config.task.prompt_template = "{question} in {unit}"
    with pytest.raises(ValueError, match=r"config\.task\.prompt_template=.* not a format string"):
        base.check(config)


def test_code_files_from_mbpp_humaneval_apps_and_codecontests_rows(tmp_path):
    """Code problems: the tests of each dataset's row shape become the record's answer
    (JSON text the code verifier reads back); unreadable tests make the row malformed."""
    rows = [
        {
            "text": "Write add_one.",
            "test_list": ["assert add_one(1) == 2"],
            "code": "def add_one(x): return x + 1",
        },
        {
            "prompt": "def add_one(x):",
            "test": "def check(candidate):\n    assert candidate(1) == 2\n",
            "entry_point": "add_one",
            "canonical_solution": "    return x + 1",
        },
        {
            "question": "Sum two numbers.",
            "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]}),
        },
        {"description": "Sum.", "public_tests": {"input": ["1 2\n"], "output": ["3\n"]}},
        {
            "prompt": [{"role": "user", "content": "Sum."}],
            "reward_model": {"ground_truth": json.dumps([{"input": "1 2", "output": "3"}])},
        },
    ]
    path = _write(tmp_path / "code.jsonl", [json.dumps(r) for r in rows])
    config = JsonlConfig(
        task="code",
        question_fields=("text", "prompt", "question", "description"),
        tests_fields=(
            "test_list",
            "test",
            "input_output",
            "public_tests",
            "reward_model.ground_truth",
        ),
    )
    records, report = read_math_jsonl(path, config)
    assert report.loaded == 5 and [r["prompt"] for r in records] == [
        "Write add_one.",
        "def add_one(x):",
        "Sum two numbers.",
        "Sum.",
        "Sum.",
    ]
    assert json.loads(records[0]["answer"]) == "assert add_one(1) == 2"
    assert json.loads(records[1]["answer"]).endswith("check(add_one)\n")
    stdin_cases = [{"input": "1 2\n", "output": "3\n"}]
    assert json.loads(records[2]["answer"]) == json.loads(records[3]["answer"]) == stdin_cases
    assert json.loads(records[4]["answer"]) == [{"input": "1 2", "output": "3"}]
    # A solution without a fence gets one: the format the code verifier reads (indents kept).
    assert (
        records[0]["solution"] == "```python\ndef add_one(x): return x + 1\n```"
        and records[2]["solution"] == ""
    )
    indented = parse_row(
        json.dumps(
            {"text": "q", "test_list": ["assert f(1) == 1"], "code": "\r\n    return x\r\n"}
        ),
        config,
    )
    assert indented["solution"] == "```python\n    return x\n```"  # CRLF gone, the indent kept
    # Unreadable tests, named by file:line.
    bad = [
        json.dumps(rows[0]),
        json.dumps({"text": "q", "test_list": []}),
        json.dumps({"text": "q", "input_output": {"fn_name": "f", "inputs": [], "outputs": []}}),
        json.dumps({"text": "q", "code": "x"}),
    ]
    path = _write(tmp_path / "bad.jsonl", bad)
    for line, reason in [
        (2, "tests field 'test_list': empty tests"),
        (3, "tests field 'input_output': call-based"),
        (4, "missing tests field"),
    ]:
        lines = bad[:1] + [bad[line - 1]]
        with pytest.raises(MalformedRowError, match=f"bad_{line}.jsonl:2: {reason}"):
            read_math_jsonl(_write(tmp_path / f"bad_{line}.jsonl", lines), config)
    records, report = read_math_jsonl(
        path, JsonlConfig(**{**config.__dict__, "skip_malformed": True})
    )
    assert report.loaded == 1 and len(report.skipped) == 3


def test_code_rows_setup_empty_fields_and_unverifiable_tests(tmp_path):
    """MBPP's setup code and imports run before its asserts; an empty tests field gives
    way to the next (CodeContests' public / private tests); tests that would pass every
    program or cannot run as stdin / stdout make the row malformed."""
    config = JsonlConfig(
        task="code", tests_fields=("test_list", "public_tests", "private_tests", "test")
    )
    rows = [
        {
            "question": "q",
            "test_list": ["assert f(4) == 2.0"],
            "test_setup_code": "import math",
            "test_imports": ["import cmath"],
        },
        {
            "question": "q",
            "public_tests": {"input": [], "output": []},
            "private_tests": {"input": ["1\n"], "output": [1]},
        },  # a number as the output
    ]
    records, _ = read_math_jsonl(
        _write(tmp_path / "ok.jsonl", [json.dumps(r) for r in rows]), config
    )
    assert json.loads(records[0]["answer"]) == "import cmath\nimport math\nassert f(4) == 2.0"
    assert json.loads(records[1]["answer"]) == [{"input": "1\n", "output": "1"}]
    unverifiable = [
        (
            {"question": "q", "test": "def check(candidate):\n    assert candidate(1) == 2\n"},
            "never call it",
        ),
        (
            {
                "question": "q",
                "test_list": [{"input": "[1]", "output": "1", "testtype": "functional"}],
            },
            "call-based",
        ),
        (
            {"question": "q", "public_tests": {"input": [], "output": []}},
            "public_tests': empty tests",
        ),
    ]
    for i, (row, reason) in enumerate(unverifiable):
        with pytest.raises(MalformedRowError, match=reason):
            read_math_jsonl(_write(tmp_path / f"bad{i}.jsonl", [json.dumps(row)]), config)


def test_mixed_files_say_each_rows_task(tmp_path):
    rows = [
        {"question": "1+1?", "answer": "2"},
        {"question": "Print 2.", "test_list": ["assert True"]},
        {"question": "2+2?", "answer": "#### 4", "tests": None},
    ]  # a null tests field: math
    path = _write(tmp_path / "mixed.jsonl", [json.dumps(r) for r in rows])
    records, _ = read_math_jsonl(path, JsonlConfig(task="mixed"))
    assert [(r["task"], r["answer"]) for r in records] == [
        ("math", "2"),
        ("code", json.dumps("assert True")),
        ("math", "4"),
    ]
    math_only, _ = read_math_jsonl(path, JsonlConfig(skip_malformed=True))
    assert "task" not in math_only[0]
    # An empty tests field is no code problem, also as JSON text.
    empties = ["", [], "[]", {"inputs": [], "outputs": []}, json.dumps({"input": [], "output": []})]
    path = _write(
        tmp_path / "empty.jsonl",
        [json.dumps({"question": "1+1?", "answer": "2", "test": e}) for e in empties],
    )
    assert [r["task"] for r in read_math_jsonl(path, JsonlConfig(task="mixed"))[0]] == ["math"] * 5
    # Each task's own prompt template.
    path = _write(tmp_path / "templates.jsonl", [json.dumps(r) for r in rows[:2]])
    config = JsonlConfig(
        task="mixed",
        prompt_template="{question} Put the answer in \\boxed{{}}.",
        code_prompt_template="{question} Answer with a ```python block.",
    )
    assert [r["prompt"] for r in read_math_jsonl(path, config)[0]] == [
        "1+1? Put the answer in \\boxed{}.",
        "Print 2. Answer with a ```python block.",
    ]
    with pytest.raises(ValueError, match="code_prompt_template must contain"):
        JsonlConfig(code_prompt_template="no question")


def test_mixed_files_whose_answers_and_tests_share_a_field(tmp_path):
    """verl-style mixtures keep math answers and code tests in reward_model.ground_truth
    and say which in "ability": task_field reads it."""
    rows = [
        {"prompt": "1+1?", "ability": "math", "reward_model": {"ground_truth": "2"}},
        {
            "prompt": "Sum.",
            "ability": "coding",
            "reward_model": {"ground_truth": json.dumps({"inputs": ["1 2"], "outputs": ["3"]})},
        },
        {"prompt": "?", "ability": "chess", "reward_model": {"ground_truth": "e4"}},
    ]
    path = _write(tmp_path / "verl.jsonl", [json.dumps(r) for r in rows])
    config = JsonlConfig(
        task="mixed",
        task_field="ability",
        answer_fields=("reward_model.ground_truth",),
        tests_fields=("reward_model.ground_truth",),
        extract="none",
        skip_malformed=True,
    )
    records, report = read_math_jsonl(path, config)
    assert [(r["task"], r["answer"]) for r in records] == [
        ("math", "2"),
        ("code", json.dumps([{"input": "1 2", "output": "3"}])),
    ]
    assert "'chess' is neither math nor code" in report.skipped[0]
    # Without it every row would be read as code, and the math answer refused as tests.
    _, report = read_math_jsonl(path, JsonlConfig(**{**config.__dict__, "task_field": None}))
    assert report.loaded == 1 and "tests field 'reward_model.ground_truth'" in report.skipped[0]
    with pytest.raises(ValueError, match="task_field is for task='mixed'"):
        JsonlConfig(task="code", task_field="ability")


def test_config_errors():
    with pytest.raises(ValueError, match="extract"):
        JsonlConfig(extract="last")
    with pytest.raises(ValueError, match="tuples of names"):
        JsonlConfig(question_fields="question")
    with pytest.raises(ValueError, match="prompt_template"):
        JsonlConfig(prompt_template="no placeholder")
    with pytest.raises(ValueError, match="task"):
        JsonlConfig(task="proofs")
    with pytest.raises(ValueError, match="tests_fields"):
        JsonlConfig(tests_fields="tests")
