"""Code correctness: programs pass or fail their tests, reward hacks fail, isolated tests
see the program's values. The datasets' tests have their own file (test_testcases.py), as
has the sandbox (test_sandbox.py)."""

import json
import os

import pytest

from policyopt.rewards import code as code_lib
from policyopt.rewards import code_correctness
from policyopt.rewards.testcases import split_asserts

IS_ROOT = os.geteuid() == 0
FAST = dict(timeout_s=1.0)


def solution(code: str, language: str = "python") -> str:
    return f"<think>Plan the function.</think>\nHere it is:\n```{language}\n{code}\n```\n"


ADD_ONE = solution("def add_one(x):\n    return x + 1")
GOOD_TESTS = "assert add_one(1) == 2\nassert add_one(-1) == 0"
SUM_STDIN = solution("import sys\nprint(sum(map(int, sys.stdin.read().split())))")


def assert_scorer_still_works():
    assert code_correctness(ADD_ONE, GOOD_TESTS, **FAST) == 1.0


def test_assert_tests_pass_and_fail():
    assert code_correctness(ADD_ONE, GOOD_TESTS) == 1.0
    assert code_correctness(ADD_ONE, "assert add_one(1) == 3") == 0.0
    assert (
        code_correctness(solution("def add_one(x):\n    return x +"), GOOD_TESTS) == 0.0
    )  # syntax error


@pytest.mark.parametrize(
    "program, expected",
    [
        (
            "def add_one(x):\n    return x + 1\nimport sys\nsys.exit(0)",
            1.0,
        ),  # a habit: the tests still run
        ("def add_one(x):\n    return x\nimport sys\nsys.exit(0)", 0.0),  # ... and still fail
        ("import sys\nsys.exit(0)", 0.0),  # no function, no tests run: not a pass
        ("raise SystemExit(0)", 0.0),
        ("import os\nos._exit(0)", 0.0),  # leaves before the tests: no marker
        ("def add_one(x):\n    import os\n    os._exit(0)", 0.0),  # leaves from inside a test
        ("def add_one(x):\n    return x + 1\nprint('chatter')", 1.0),
        # Replacing what the harness runs the tests with, or reading its source, does not help.
        ("exec = lambda *a, **k: None\ndef add_one(x):\n    return 'x'", 0.0),
        (
            "import builtins\nbuiltins.exec = lambda *a, **k: None\n"
            "def add_one(x):\n    return 'x'",
            0.0,
        ),
        (
            "import re, sys, os\n"
            "sys.stdout.write(' '.join(re.findall('[0-9a-f]{32}', open('main.py').read())))\n"
            "sys.stdout.flush()\nos._exit(0)",
            0.0,
        ),
        (
            "import re, sys, os\nmain = vars(sys.modules['__main__'])\n"
            "text = ' '.join(str(v) + ' ' + str(getattr(v, 'co_consts', '')) "
            "for v in main.values())\n"
            "os.write(1, ' '.join(re.findall('[0-9a-f]{32}', text)).encode())\nos._exit(0)",
            0.0,
        ),
        # A correct program may define its own compile() or close its stdout.
        (
            "import re\ndef compile(p):\n    return re.compile(p)\n"
            "def add_one(x):\n    return x + 1",
            1.0,
        ),
        ("import sys\ndef add_one(x):\n    return x + 1\nsys.stdout.close()", 1.0),
    ],
)
@pytest.mark.parametrize("isolation", code_lib.ISOLATIONS)
def test_a_program_that_exits_early_does_not_pass(program, expected, isolation):
    """Exiting with status 0 before the tests (or from inside them) must not count as
    passing them, whether they run after the program in its process or in their own."""
    assert code_correctness(solution(program), GOOD_TESTS, isolation=isolation, **FAST) == expected
    assert (
        code_correctness(solution(program), GOOD_TESTS, partial=True, isolation=isolation, **FAST)
        == expected
    )


# Reward hacks that one process cannot stop (the marker found in the harness's frame, an
# object equal to everything, alone or inside a list, an int subclass equal to
# everything, a built-in the tests compare with redefined): isolation
# "process" fails them all; "none" is shown passing them, so the test fails if the
# hacks stop working there (and this list no longer says what isolation buys).
HACKS = [
    (
        "import sys, os\nf = sys._getframe(1)\n"
        "os.write(f.f_locals['fd'], ('\\n' + f.f_locals['marker'] + '\\n').encode())\nos._exit(0)",
        GOOD_TESTS,
    ),
    (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "def add_one(x):\n    return Anything()",
        GOOD_TESTS,
    ),
    (
        "class Int(int):\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = int.__hash__\n"
        "def add_one(x):\n    return Int(5)",
        GOOD_TESTS,
    ),
    (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "def pair(x):\n    return [Anything(), Anything()]",
        "assert pair(1) == [1, 2]\nassert pair(2) == [4, 8]",
    ),
    (
        "def add_one(x):\n    return 0\ndef set(*args):\n    return 1\n"
        "def len(*args):\n    return 2",
        "assert set([add_one(1)]) == set([2])\nassert len([add_one(0)]) == len([1, 1])",
    ),
]


@pytest.mark.parametrize("hack", range(len(HACKS)))
def test_isolated_tests_are_not_fooled_by_the_program(hack):
    program, tests = solution(HACKS[hack][0]), HACKS[hack][1]
    assert code_correctness(program, tests, isolation="none", **FAST) == 1.0
    assert code_correctness(program, tests, isolation="process", **FAST) == 0.0
    assert code_correctness(program, tests, partial=True, isolation="process", **FAST) == 0.0


# Honest programs whose values cross between the processes: every shape the codec
# carries, and the ways tests use a program (classes, generators, exceptions, in-place
# mutation, its constants and imports, helpers that call it), all pass isolated. (A
# backslash ending a line in these strings continues it on the next: line length only.)
HONEST = """
import math, collections, fractions, decimal
MOD = 10**9 + 7
Pair = collections.namedtuple("Pair", "a b")
def factorial(n):
    return math.factorial(n)
def shapes():
    return [None, True, 1, -2**70, 2.5, float("inf"), 1 + 2j, "é\\udcff", \
b"\\x00\\xff", bytearray(b"ab"),
            (1, [2]), {(1, 2): {3}}, frozenset({4}), range(1, 9, 2), ..., fractions.Fraction(1, 3),
            decimal.Decimal("0.1"), collections.Counter("aab"), collections.OrderedDict(a=1),
            collections.deque([1, 2]), Pair(1, 2)]
def nan():
    return float("nan")
def sort_in_place(items, *, reverse=False, seen=None):
    items.sort(reverse=reverse)
    if seen is not None:
        seen["n"] = len(items)
def evens(n):
    for i in range(0, n, 2):
        yield i
def safe_sqrt(x):
    if x < 0:
        raise ValueError("negative")
    return math.sqrt(x)
class NotFound(Exception):
    pass
def find(items, x):
    if x not in items:
        raise NotFound(x)
    return items.index(x)
class Solution:
    def __init__(self, base=0):
        self.base = base
    def add(self, x):
        return self.base + x
    def __str__(self):
        return f"Solution({self.base})"
class Bag:
    def __init__(self):
        self.items = [3, 1]
    def __len__(self):
        return 2
    def __iter__(self):
        return iter(self.items)
    def __getitem__(self, i):
        return self.items[i]
    def __contains__(self, x):
        return x in self.items
"""
HONEST_TESTS = """
import collections, fractions, decimal
assert factorial(2000) == __import__("math").factorial(2000)  # beyond int's digit limit as text
assert MOD == 1000000007 and math.sqrt(4) == 2.0  # the program's constants and imports
got = shapes()
want = [None, True, 1, -2**70, 2.5, float("inf"), 1 + 2j, "é\\udcff", b"\\x00\\xff", \
bytearray(b"ab"), (1, [2]),
        {(1, 2): {3}}, frozenset({4}), range(1, 9, 2), ..., fractions.Fraction(1, 3), \
decimal.Decimal("0.1"),
        collections.Counter("aab"), collections.OrderedDict(a=1), collections.deque([1, 2]), (1, 2)]
assert got == want and [type(x) for x in got[:-1]] == [type(x) for x in want[:-1]]  \
# a namedtuple: a tuple
assert type(got[4]) is float and type(got[2]) is int
x = nan()
assert x != x
items, seen = [3, 1, 2], {}
assert sort_in_place(items, reverse=True, seen=seen) is None and items == [3, 2, 1] and \
seen == {"n": 3}
assert list(evens(7)) == [0, 2, 4, 6] and sum(evens(5)) == 6
try:
    safe_sqrt(-1)
except ValueError as error:
    assert str(error) == "negative"
else:
    assert False
try:
    find([1], 2)
except Exception as error:
    assert "NotFound" in type(error).__name__ + str(error)  # isolated: ProgramError("NotFound: 2")
else:
    assert False
s = Solution(base=10)
assert s.add(5) == 15 and s.base == 10 and str(s) == "Solution(10)" and "Solution" in repr(Solution)
bag = Bag()
assert len(bag) == 2 and list(bag) == [3, 1] and bag[1] == 1 and 3 in bag and 5 not in bag
def helper(n):  # a function of the tests calling the program (a global lookup)
    return factorial(n) % MOD
assert helper(5) == 120
"""


def test_isolated_tests_get_the_programs_values_and_objects():
    program = solution(HONEST)
    assert code_correctness(program, HONEST_TESTS, isolation="none") == 1.0
    assert code_correctness(program, HONEST_TESTS, isolation="process") == 1.0
    assert (
        code_correctness(program, HONEST_TESTS.replace("== 15", "== 16"), isolation="process")
        == 0.0
    )
    split = "assert factorial(3) == 6\nassert factorial(3) == 7\nassert list(evens(3)) == [0, 2]"
    assert code_correctness(program, split, partial=True, isolation="process") == pytest.approx(
        2 / 3
    )


OBJECTS = """
import collections
class ListNode:
    def __init__(self, val=0, next=None):
        self.val, self.next = val, next
def reverse(head):
    prev = None
    while head:
        head.next, prev, head = prev, head, head.next
    return prev
class BadInput(ValueError):
    pass
def parse(text):
    if not text.isdigit():
        raise BadInput("not a number", text)
    return int(text)
def squares(n):
    for i in range(n):
        yield i * i
def same(x):
    return x
def flaky():
    yield 1
    yield 2
    raise ValueError("third")
def ascii_text(data):
    return data.decode("ascii")
"""
OBJECT_TESTS = """
import collections
head = ListNode(1)
head.next = ListNode(2)
head.next.next = ListNode(3)
node, values = reverse(head), []
while node:
    values.append(node.val)
    node = node.next
assert values == [3, 2, 1] and node is None
first = reverse(ListNode(7))
assert first is first and len({first, first}) == 1
try:
    parse("x")
except ValueError as error:  # the program's subclass of ValueError
    assert error.args == ("not a number", "x")
try:
    parse("y")
except BadInput:
    pass
else:
    assert False
assert sum(squares(5000)) == sum(i * i for i in range(5000))  # in few round trips
Point = collections.namedtuple("Point", "x y")
assert same(Point(1, 2)) == (1, 2)
items = flaky()  # an error after some items comes after those items
assert next(items) == 1 and next(items) == 2
try:
    next(items)
except ValueError as error:
    assert str(error) == "third"
else:
    assert False
try:
    ascii_text(b"\\xff")
except UnicodeDecodeError as error:  # a built-in exception with five arguments
    assert error.start == 0
else:
    assert False
"""


def test_isolated_program_objects_behave_like_objects():
    """Linked structures built by the tests (attributes set, truth, identity), the
    program's exception classes (caught by name and by their built-in base, with their
    args), long generators, namedtuples from the tests."""
    program = solution(OBJECTS)
    assert code_correctness(program, OBJECT_TESTS, isolation="none") == 1.0
    assert code_correctness(program, OBJECT_TESTS, isolation="process") == 1.0


def test_isolated_partial_credit_runs_the_statements_after_the_last_assert():
    # A loop of asserts after the last top-level assert was dropped by the split.
    tests = "assert add_one(1) == 2\nfor x in range(-3, 3):\n    assert add_one(x) == x + 1\n"
    wrong = solution("def add_one(x):\n    return 2")
    for isolation in code_lib.ISOLATIONS:
        assert code_correctness(wrong, tests, partial=True, isolation=isolation) == pytest.approx(
            0.5
        )
        assert code_correctness(ADD_ONE, tests, partial=True, isolation=isolation) == 1.0
    assert split_asserts("assert f()\ndef g():\n    assert 0\n") == ["assert f()\n"]


def test_a_fake_module_does_not_answer_for_the_standard_library():
    program = solution(
        "class FakeMath:\n    def isclose(self, *args, **kwargs):\n        return True\n"
        "math = FakeMath()\ndef area(r):\n    return 0"
    )
    tests = "assert math.isclose(area(2), 12.566, rel_tol=1e-3)"
    assert code_correctness(program, tests, isolation="none") == 1.0
    assert code_correctness(program, tests, isolation="process") == 0.0
    honest = solution("import math\ndef area(r):\n    return math.pi * r * r")
    assert code_correctness(honest, tests, isolation="process") == 1.0


@pytest.mark.parametrize(
    "program, tests",
    [
        # What one process allows and isolation does not (module docstring of isolation.py):
        # comparing the program's own objects, passing it a function of the tests', reading a
        # global it changed, a built-in's name it redefined.
        (
            "class P:\n    def __init__(self, x):\n        self.x = x\n"
            "    def __eq__(self, o):\n        return self.x == o.x",
            "assert P(1) == P(1)",
        ),
        ("def apply(f, x):\n    return f(x)", "assert apply(lambda v: v + 1, 1) == 2"),
        ("count = 0\ndef bump():\n    global count\n    count += 1", "bump()\nassert count == 1"),
        ("def max(items):\n    return items[0]", "assert max([1, 5]) == 1"),
    ],
)
def test_what_isolation_refuses(program, tests):
    assert code_correctness(solution(program), tests, isolation="none") == 1.0
    assert code_correctness(solution(program), tests, isolation="process") == 0.0


def test_isolated_protocol_failures_fail_the_tests():
    """A program that talks on the pipes itself, dies in a call, spins in a call, or
    fails before the tests start: the tests fail (and a spin is a timeout)."""
    garbage = (
        "import os\nfor fd in range(3, 4096):\n    try:\n"
        "        os.write(fd, b'\\x00\\x00\\x00\\x02[]')\n    except OSError:\n        pass"
    )
    dies = "def add_one(x):\n    import os\n    os._exit(0)"
    for program in (
        garbage + "\ndef add_one(x):\n    return x + 1",
        dies,
        "raise ValueError('at import')",
    ):
        assert code_correctness(solution(program), GOOD_TESTS, isolation="process", **FAST) == 0.0
    # A test that swallows every exception still fails once the program's process is gone.
    catch_all = "try:\n    add_one(1)\nexcept BaseException:\n    pass"
    assert code_correctness(solution(dies), catch_all, isolation="process", **FAST) == 0.0
    spin = code_lib.run_code_tests(
        solution("def add_one(x):\n    while True:\n        pass"),
        GOOD_TESTS,
        isolation="process",
        timeout_s=1.0,
    )
    assert spin.status == "timeout"
    with pytest.raises(ValueError, match="isolation must be one of"):
        code_lib.run_code_tests(ADD_ONE, GOOD_TESTS, isolation="thread")


def test_codec_round_trips_and_rejects_what_it_does_not_know():
    from policyopt.rewards.sandbox import isolation

    def refuse(value):
        raise TypeError(type(value).__name__)

    values = [
        None,
        False,
        0,
        2**62,
        -(2**62) + 1,
        1.0,
        float("-inf"),
        "",
        "\udcff",
        b"",
        [],
        (),
        {},
        set(),
        frozenset(),
        [[1, (2, {3: frozenset({4})})]],
        range(0),
        complex(0, -1),
        Ellipsis,
    ]
    for value in values:
        data = isolation.encode(value, refuse)
        back = isolation.decode(json.loads(json.dumps(data)), None)
        assert back == value and type(back) is type(value)
    with pytest.raises(TypeError):
        isolation.encode(object(), refuse)
    error = isolation.decode(
        ["Z", "BadInput", "KeyError"], None
    )  # an exception class of the program's
    assert issubclass(error, KeyError) and error.__name__ == "BadInput"
    assert isolation.decode(["Z", "BadInput", "KeyError"], None) is error
    assert issubclass(isolation.decode(["Z", "Oops", "SystemExit"], None), isolation.ProgramError)
    for bad in (
        {"x": 1},
        ["Z", 1],
        ["S", ["L"]],
        ["D", 1],
        ["I", 5],
        ["R", 1.0, 2, 1],
        ["H", "1", "f"],
        ["Q", 1, 0],
        [],
        [1, 2],
    ):
        with pytest.raises(isolation.ProtocolError):
            isolation.decode(bad, lambda key, name: None)
    deep = 1
    for _ in range(100_000):
        deep = ["L", deep]
    with pytest.raises(isolation.ProtocolError):
        isolation.decode(deep, None)


def test_partial_credit_counts_each_assert():
    tests = (
        "import math\nassert add_one(1) == 2\nassert add_one(2) == 4\n"
        "assert add_one(math.floor(2.5)) == 3\nassert add_one(0) == 0"
    )
    assert code_correctness(ADD_ONE, tests, partial=True) == pytest.approx(0.5)
    assert code_correctness(ADD_ONE, tests) == 0.0  # binary by default (Magistral)


def test_stdin_stdout_cases():
    cases = [
        {"input": "1 2\n", "output": "3"},
        {"input": "5 5", "output": "10\n\n"},
        {"input": "0", "output": "0  "},
    ]
    assert code_correctness(SUM_STDIN, cases) == 1.0
    wrong = cases + [{"input": "2 2", "output": "5"}]
    assert code_correctness(SUM_STDIN, wrong) == 0.0
    assert code_correctness(SUM_STDIN, wrong, partial=True) == pytest.approx(0.75)


def test_first_tagged_block_must_be_python():
    assert code_correctness(solution("int main() { return 0; }", "cpp"), GOOD_TESTS) == 0.0
    untagged = "<think>x</think>\n```\ndef add_one(x):\n    return x + 1\n```"
    assert code_correctness(untagged, GOOD_TESTS) == 0.0
    assert code_correctness("no code at all", GOOD_TESTS) == 0.0
    # A block inside the reasoning is not the answer.
    in_reasoning = "<think>```python\ndef add_one(x):\n    return x + 1\n```</think> done"
    assert code_correctness(in_reasoning, GOOD_TESTS) == 0.0


def test_score_batch_code_task_composes_format_and_pass_rate():
    import numpy as np

    from policyopt.rewards import RewardSpec, score_batch

    tests = "assert add_one(1) == 2\nassert add_one(2) == 4"  # the second assert fails
    completions = [
        ADD_ONE,
        solution("def add_one(x):\n    return x + 2"),
        "def add_one(x): return x + 1",
    ]
    binary = score_batch(
        completions, [GOOD_TESTS, tests, GOOD_TESTS], [5] * 3, RewardSpec(task="code")
    )
    # Format ok + all tests pass: 0.1 + 0.9; format ok, a test fails: 0.1; no format: 0.
    np.testing.assert_allclose(binary.rewards, [1.0, 0.1, 0.0], atol=1e-6)
    assert binary.correct.tolist() == [True, False, False]
    partial = score_batch([ADD_ONE], [tests], [5], RewardSpec(task="code", code_partial=True))
    np.testing.assert_allclose(partial.rewards, [0.1 + 0.9 * 0.5], atol=1e-6)
    assert not partial.correct[0]


def test_a_replacement_character_in_expected_output_is_text():
    """U+FFFD in an expected output is compared as the character it is: a program that
    prints it passes; one that writes an invalid byte (which decoding would turn into
    U+FFFD) does not."""
    case = [{"input": "", "output": "a\ufffdb"}]
    prints_it = solution("print('a\\ufffdb')")
    invalid_byte = solution("import sys\nsys.stdout.buffer.write(b'a\\xffb\\n')")
    assert code_correctness(prints_it, case, **FAST) == 1.0
    assert code_correctness(invalid_byte, case, **FAST) == 0.0
    assert code_correctness(invalid_byte, [{"input": "", "output": "ab"}], **FAST) == 0.0
