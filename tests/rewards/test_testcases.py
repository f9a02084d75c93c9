"""Tests as the datasets write them (policyopt.rewards.testcases): the encodings read, HumanEval's
check completed, asserts cut or split in order, the first max_tests kept; each then run
against a program."""

import json

import pytest

from policyopt.rewards import code_correctness
from policyopt.rewards.testcases import limit_tests, parse_tests
from tests.rewards.test_code import ADD_ONE, FAST, GOOD_TESTS, SUM_STDIN, solution

CASES = [{"input": "1 2\n", "output": "3"}, {"input": "5 5", "output": "10"}]


@pytest.mark.parametrize(
    "tests, expected",
    [
        (GOOD_TESTS, GOOD_TESTS),
        (["assert add_one(1) == 2", "assert add_one(-1) == 0"], GOOD_TESTS),  # MBPP test_list
        (CASES, CASES),
        ({"inputs": ["1 2\n", "5 5"], "outputs": ["3", "10"]}, CASES),  # APPS input_output
        ({"input": ["1 2\n", "5 5"], "output": ["3", "10"]}, CASES),  # CodeContests public_tests
        ([{"input": ["1 2", ""], "output": ["3"]}], [{"input": "1 2\n", "output": "3"}]),  # lines
        (json.dumps({"inputs": ["1 2\n", "5 5"], "outputs": ["3", "10"]}), CASES),  # as JSON text
        (json.dumps(CASES), CASES),
        (json.dumps(GOOD_TESTS), GOOD_TESTS),
        (
            "[add_one(x) for x in []]  # Python, not JSON",
            "[add_one(x) for x in []]  # Python, not JSON",
        ),
        (
            {
                "language": "python",
                "test_cases": [
                    {"input": "1 2\n", "output": "3", "type": "stdin_stdout"},
                    {"input": "5 5", "output": "10", "testtype": None},
                ],
            },
            CASES,
        ),  # PrimeIntellect's verification_info
    ],
)
def test_parse_tests_reads_the_datasets_encodings(tests, expected):
    assert parse_tests(tests) == expected


def test_parse_tests_completes_humaneval_and_refuses_the_rest():
    check = "def check(candidate):\n    assert candidate(1) == 2\n"
    assert parse_tests(check, entry_point="add_one") == check.rstrip() + "\n\n\ncheck(add_one)\n"
    assert (
        parse_tests(check + "check(add_one)\n", entry_point="add_one") == check + "check(add_one)\n"
    )
    assert parse_tests(GOOD_TESTS, entry_point="add_one") == GOOD_TESTS  # no check()
    assert code_correctness(ADD_ONE, parse_tests(check, entry_point="add_one"), **FAST) == 1.0
    assert parse_tests([]) == [] and parse_tests("") == ""  # "no_tests" downstream
    for bad, reason in [
        (7, "text, a list or an object"),
        ({"fn_name": "f", "inputs": [[1]], "outputs": [2]}, "call-based"),
        ({"inputs": ["1"]}, "parallel lists"),
        ({"inputs": ["1"], "outputs": []}, "1 inputs but 0"),
        ([{"input": "1"}], "needs 'input' and 'output'"),
        (["assert 1", {"input": ""}], "only"),
        ([{"input": None, "output": "1"}], "text, a number or a list of lines"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_tests(bad)
    with pytest.raises(ValueError, match="not a Python name"):
        parse_tests(check, entry_point="add one")
    with pytest.raises(ValueError, match="never call it"):  # every program would pass
        parse_tests(check)
    # Strings that would fail every program (not Python: a math answer in a shared field,
    # a compressed blob) or pass every one (nothing at the top level can fail).
    for text, reason in [
        ("\\frac12", "not Python"),
        ("eJzLSM3JyVcozy/KSQEAGgQEXQ==", "not Python"),
        ("34", "cannot fail"),
        ("import math", "cannot fail"),
        ("def test_add():\n    assert add_one(1) == 2\n", "pytest-style"),
        (
            "import unittest\nclass T(unittest.TestCase):\n"
            "    def test(self):\n        self.assertEqual(1, 2)\n"
            "unittest.main(exit=False)\n",
            "unittest / pytest",
        ),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_tests(text)
    main_guard = check + "\nif __name__ == '__main__':\n    check(add_one)\n"
    assert parse_tests(main_guard, entry_point="other") == main_guard  # called already
    recursive = check + "    check(add_one)\n"  # a call inside check() is no call
    assert parse_tests(recursive, entry_point="add_one").endswith("\n\n\ncheck(add_one)\n")
    for call_based in (
        [{"input": "[1]", "output": "2", "testtype": "functional"}],  # LiveCodeBench
        [{"input": "[1]", "output": "2", "type": "function_call"}],
        {"inputs": [[1]], "outputs": [2], "func_name": "f"},
    ):
        with pytest.raises(ValueError, match="call-based"):
            parse_tests(call_based)
    # Numbers as outputs and tuples of cases, as datasets store them.
    assert code_correctness(SUM_STDIN, ({"input": "1 2", "output": 3},), **FAST) == 1.0
    # The verifier reads every encoding (here APPS's, as JSON text).
    apps = json.dumps({"inputs": ["1 2\n", "5 5"], "outputs": ["3", "10"]})
    assert code_correctness(SUM_STDIN, apps, **FAST) == 1.0
    assert (
        code_correctness(SUM_STDIN, {"fn_name": "f", "inputs": [], "outputs": []}) == 0.0
    )  # never raises


def test_asserts_keep_their_order_and_decorators_when_cut_or_split():
    """Setup between asserts stays where it was, decorators stay on their classes, when
    ``max_tests`` cuts the string or partial credit runs each assert on its own."""
    # Twelve asserts, cut at ten: two-digit indices (an order by string would put 10 before
    # 2) and a cut that drops asserts; partial credit starts two interpreters per assert,
    # so the string is no longer than that needs.
    tests = "\n".join(f"x = add_one({i})\nassert x == {i + 1}" for i in range(12))
    tests = (
        "from dataclasses import dataclass\n@dataclass\nclass P:\n    a: int\n"
        + tests
        + "\nassert P(1).a == 1"
    )
    for options in ({}, {"max_tests": 10}, {"partial": True}, {"partial": True, "max_tests": 10}):
        assert code_correctness(ADD_ONE, tests, **options, **FAST) == 1.0, options
    cut = limit_tests(tests, 2)
    assert (
        cut == "from dataclasses import dataclass\n@dataclass\nclass P:\n    a: int\n"
        "x = add_one(0)\nassert x == 1\n"
        "x = add_one(1)\nassert x == 2\n"
    )
    # Line breaks other than \n / \r (form feed, U+2028) neither cut a test off nor split a
    # string literal: a wrong f fails, a right one passes.
    wrong, right = (
        solution("def f(x):\n    return -1"),
        solution("def f(x):\n    return 1 if x == 'a\u2028b' else x"),
    )
    feed = "\x0cassert f(1) == 1\nassert f(2) == 2\nassert f(3) == 3"
    literal = "assert f('a\u2028b') == 1\nassert f(2) == 2\nassert f(3) == 3"
    for options in ({"max_tests": 1}, {"max_tests": 2}, {"partial": True}):
        assert code_correctness(wrong, feed, **options, **FAST) == 0.0, options
        assert code_correctness(right, literal, **options, **FAST) == 1.0, options
    # HumanEval's asserts sit inside check(): with partial credit the string is one test.
    check = parse_tests(
        "def check(candidate):\n    assert candidate(1) == 2\n", entry_point="add_one"
    )
    assert code_correctness(ADD_ONE, check, partial=True, **FAST) == 1.0


def test_max_tests_runs_the_first_cases_or_asserts():
    """Magistral runs 20 tests per problem: ``max_tests`` keeps the first ones."""
    cases = [{"input": f"{i} 0", "output": str(i)} for i in range(5)] + [
        {"input": "1 1", "output": "3"}
    ]
    assert code_correctness(SUM_STDIN, cases, **FAST) == 0.0  # the sixth case is wrong
    assert code_correctness(SUM_STDIN, cases, max_tests=5, **FAST) == 1.0
    tests = (
        "import math\nassert add_one(1) == 2\n"
        "assert add_one(math.floor(2.5)) == 3\nassert add_one(0) == 5"
    )
    assert (
        limit_tests(tests, 2)
        == "import math\nassert add_one(1) == 2\nassert add_one(math.floor(2.5)) == 3\n"
    )
    assert limit_tests(tests, 3) == tests and limit_tests(cases, None) is cases
    assert code_correctness(ADD_ONE, tests, **FAST) == 0.0
    assert code_correctness(ADD_ONE, tests, max_tests=2, **FAST) == 1.0
    assert code_correctness(ADD_ONE, tests, max_tests=2, partial=True, **FAST) == 1.0
    with pytest.raises(ValueError, match="max_tests"):
        limit_tests(cases, 0)
