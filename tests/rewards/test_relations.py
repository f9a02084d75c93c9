"""A relation in a final answer scores only when every side that is not a name equals the
reference (docs/rewards.md, "Relations in an answer")."""

import pytest

from policyopt.rewards import math_correctness, verify_math


def boxed(answer: str) -> str:
    return f"<think>Work.</think> The answer is \\boxed{{{answer}}}."


# Against the reference 42, plainly wrong: a relation puts a second value, a wrong one,
# beside the right one (math-verify grades most of them by their last side).
WRONG = [
    "43=42",
    "43 = 42",
    "43==42",
    "43 == 42",
    "43:=42",
    "43 := 42",
    "42 =: 43",
    r"43 \equiv 42",
    r"43 \equiv 42 \pmod{1}",
    r"43 \to 42",
    r"43 \rightarrow 42",
    r"43 \Rightarrow 42",
    r"43 \implies 42",
    r"43 \iff 42",
    r"43 \Leftrightarrow 42",
    r"43 \leftrightarrow 42",
    r"43 \Longleftrightarrow 42",
    r"43 \approx 42",
    r"43 \sim 42",
    r"43 \simeq 42",
    r"43 \cong 42",
    r"43 \mapsto 42",
    "x=43=42",
    "x = 43 = 42",
    "f(x) = 43 = 42",
    r"43 \\ 42",
    r"43 \\ x = 42",
    r"43 \newline 42",
    r"\begin{cases}43\\42\end{cases}",
    r"\begin{cases} x = 43 \\ x = 42 \end{cases}",
    r"\begin{aligned} x &= 43 \\ &= 42 \end{aligned}",
    r"41 \lor 42",
    r"41 \vee 42",
    r"41 \land 42",
    r"41 \wedge 42",
    r"x = 41 \lor x = 42",
    r"x = 41 \text{ or } x = 42",
    "(43 = 42)",
    r"\left(43 = 42\right)",
]


def test_there_are_39_wrong_forms():
    assert len(WRONG) == len(set(WRONG)) == 39


@pytest.mark.parametrize("answer", WRONG + ["40+2=42=43", "x = 43", r"x \approx 43"])
def test_a_relation_with_a_wrong_side_scores_0(answer):
    assert math_correctness(boxed(answer), "42", timeout_s=20.0) == 0.0


# Right forms: a name on one side (a variable, a function value, a labelled quantity), or
# every side equal to the reference; and references that state a relation themselves.
RIGHT = [
    ("x = 42", "42"),
    ("x=42", "42"),
    ("42 = x", "42"),
    ("x == 42", "42"),
    ("x := 42", "42"),
    (r"x \equiv 42", "42"),
    (r"x \to 42", "42"),
    (r"\theta = 42", "42"),
    ("a_1 = 42", "42"),
    ("f(2) = 42", "42"),
    (r"\text{Answer} = 42", "42"),
    (r"\lim_{n\to\infty} a_n = 42", "42"),
    (r"6 \cdot 7 = 42", "42"),
    ("6*7=42", "42"),
    ("42=42", "42"),
    (r"\frac{84}{2}=42", "42"),
    (r"42 \\ 42", "42"),
    (r"\begin{cases} x = 42 \\ y = 42 \end{cases}", "42"),
    (r"(x = 42)", "42"),
    (r"\sqrt{12} = 2\sqrt{3}", r"2\sqrt{3}"),
    (r"x = \frac{\pi}{2}", r"\pi/2"),
    ("y = 2x + 1", "2x+1"),
    ("f(x) = x^2 + 1", "x^2+1"),
    ("x = 5", "x=5"),  # a reference that is an equation: compared whole
    ("x=5", "5"),
    ("1,000", "1000"),
    (r"2\sqrt{3}", r"\sqrt{12}"),
]


@pytest.mark.parametrize("answer, reference", RIGHT)
def test_a_relation_whose_sides_agree_scores_1(answer, reference):
    assert math_correctness(boxed(answer), reference, timeout_s=20.0) == 1.0


def test_the_rule_holds_in_every_answer_format():
    assert math_correctness("Answer: 43 \\iff 42", "42", answer_format="answer_line") == 0.0
    assert math_correctness("Answer: x = 42", "42", answer_format="answer_line") == 1.0
    assert math_correctness("#### 43 == 42", "42", answer_format="gsm8k") == 0.0
    assert math_correctness("#### x = 42", "42", answer_format="gsm8k") == 1.0
    assert verify_math(boxed(r"41 \lor 42"), "42").status == "incorrect"
