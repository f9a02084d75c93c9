"""The format reward (policyopt.rewards.format): think tags, boxes and answer lines."""

import pytest

from policyopt.rewards import format_ok

FORMAT_CASES = [
    (r"<think>reason</think> \boxed{1}", "math", True),
    (r"  <think>reason</think> \boxed{1}", "math", True),
    (r"<think></think>\boxed{}", "math", True),
    (r"Answer: <think>reason</think> \boxed{1}", "math", False),
    (r"<think>a</think><think>b</think> \boxed{1}", "math", False),
    (r"<think>a</think> </think> \boxed{1}", "math", False),
    (r"<think>reason \boxed{1}", "math", False),
    (r"<think>reason \boxed{1}</think> so 1", "math", False),
    (r"<think>reason</think> \boxed{1", "math", False),
    (
        r"<think>reason</think> \boxed 1",
        "math",
        False,
    ),  # the verifier reads it; the gate asks for {}
    ("<think>plan</think>\n```python\nprint(1)\n```", "code", True),
    ("<think>plan</think>\n```\nprint(1)\n```", "code", False),
    ("<think>```python\nprint(1)\n```</think> done", "code", False),
    ("<think>plan</think> print(1)", "code", False),
]


@pytest.mark.parametrize("completion, task, expected", FORMAT_CASES)
def test_format_ok(completion, task, expected):
    assert format_ok(completion, task) is expected


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>reason</think>\nAnswer: 1", True),
        ("<think>reason</think> \\boxed{1}", False),
        ("<think>reason\nAnswer: 1</think> so 1", False),
        ("Answer: 1", False),
    ],
)
def test_format_ok_answer_line(completion, expected):
    assert format_ok(completion, "math", "answer_line") is expected


def test_format_rejects_unknown_task():
    with pytest.raises(ValueError, match="task"):
        format_ok("<think></think>", "chess")
