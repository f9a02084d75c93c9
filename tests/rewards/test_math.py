"""The math reward (policyopt.rewards.math): the verifier's table of answers, hostile and
explosive inputs, answers killed in C code, and the boxed, GSM8K and answer-line extractors.

Each reward module has its own file beside this one: format, length, language, batch
scoring, time limits, code (test_code.py), the sandbox (test_sandbox.py)."""

import threading
import time

import pytest

from policyopt.rewards import (
    RewardSpec,
    VerifierTimeout,
    extract_answer_line,
    extract_boxed,
    extract_gsm8k,
    format_ok,
    math_correctness,
    score_batch,
    verify_math,
)


def boxed(answer: str) -> str:
    return f"<think>Let me work it out step by step.</think> The answer is \\boxed{{{answer}}}."


MEGABYTE = 1 << 20

# (completion, reference, expected score)
MATH_CASES = [
    # Equivalent forms.
    (boxed(r"\frac{1}{2}"), "0.5", 1.0),
    (boxed("0.5"), r"\frac12", 1.0),
    (boxed(r"2\sqrt{2}"), r"\sqrt{8}", 1.0),
    (boxed("1/2"), r"\frac{1}{2}", 1.0),
    (boxed(r"\dfrac{3}{4}"), "0.75", 1.0),
    (boxed(r"\frac{6}{8}"), r"\frac{3}{4}", 1.0),
    (boxed(r"50\%"), "50", 1.0),
    (boxed(r"50\%"), "0.5", 1.0),  # math-verify accepts both readings of a percentage
    (boxed(r"\{1,2\}"), r"\{2,1\}", 1.0),
    (boxed(r"\{3, 1, 2\}"), r"\{1,2,3\}", 1.0),
    (boxed("(0,1]"), "(0, 1]", 1.0),
    (boxed(r"[1,2)\cup(3,4]"), r"[1,2) \cup (3,4]", 1.0),
    (boxed("1,000"), "1000", 1.0),
    (boxed("x=3"), "3", 1.0),
    (boxed("5.0"), "5", 1.0),
    (boxed("0.50"), ".5", 1.0),
    (boxed("+7"), "7", 1.0),
    (boxed("-0"), "0", 1.0),
    (boxed(" 42 "), "42", 1.0),
    (boxed("12"), "12", 1.0),
    (boxed(r"-\frac{1}{2}"), r"\frac{-1}{2}", 1.0),
    (boxed("2^{10}"), "1024", 1.0),
    (boxed("10^{3}"), "1000", 1.0),
    (boxed(r"3\times 4"), "12", 1.0),
    (boxed("x^2+2x+1"), "(x+1)^2", 1.0),
    (boxed("2x+3"), "3+2x", 1.0),
    (boxed(r"\infty"), r"\infty", 1.0),
    (boxed("0.3333333"), r"\frac13", 1.0),  # agrees with 1/3 to 6 places
    (boxed(r"\pi/2"), r"\frac{\pi}{2}", 1.0),
    (boxed(r"\frac{\sqrt{2}}{2}"), r"\frac{1}{\sqrt{2}}", 1.0),
    (boxed(r"5 \text{ cm}"), "5", 1.0),
    (boxed(r"\text{(A)}"), "A", 1.0),
    (boxed(r"\left(1, 2\right)"), "(1,2)", 1.0),
    (boxed("7"), r"\boxed{7}", 1.0),  # boxed reference
    (boxed("7"), 7, 1.0),  # non-string reference
    (boxed(r"\boxed{5}"), "5", 1.0),  # nested box: the inner one starts last
    (r"<think>\boxed{3}</think> First \boxed{3}, final \boxed{4}.", "4", 1.0),
    (r"<think>I guess \boxed{1}.</think> So \boxed{2}.", "2", 1.0),
    # Wrong answers that look right.
    (boxed("0.333"), r"\frac13", 0.0),
    (boxed("(0,1)"), "[0,1]", 0.0),
    (boxed("[0,1]"), "(0,1]", 0.0),
    (boxed("12"), "13", 0.0),
    (boxed(r"\frac{1}{2}"), r"\frac{1}{3}", 0.0),
    (boxed(r"2\sqrt{3}"), r"\sqrt{8}", 0.0),
    (boxed("-5"), "5", 0.0),
    (boxed("1000"), "100", 0.0),
    (boxed("0.51"), "0.5", 0.0),
    (boxed("12.0001"), "12", 0.0),
    (boxed(r"51\%"), "0.5", 0.0),
    (boxed("x^2+2x"), "(x+1)^2", 0.0),
    (boxed(r"\{1,2\}"), r"\{1,2,3\}", 0.0),
    (boxed("3.14"), r"\pi", 0.0),
    (r"<think>x</think> First \boxed{3}, final \boxed{4}.", "3", 0.0),  # last box counts
    (r"<think>I guess \boxed{1}.</think> So \boxed{2}.", "1", 0.0),  # reasoning is not graded
    # Missing or malformed answers.
    ("<think>5</think> The answer is 5.", "5", 0.0),
    (r"<think>x</think> \boxed{5", "5", 0.0),
    (boxed(""), "5", 0.0),
    (r"<think>x</think> \boxed{\frac{1}{2}", "0.5", 0.0),
    (boxed(r"\frac{1}{}"), "0.5", 0.0),
    (boxed(")("), "1", 0.0),
    (boxed(r"\sqrt"), "1", 0.0),
    (boxed(r"\input{/etc/passwd}"), "1", 0.0),
    ("", "1", 0.0),
    (None, "1", 0.0),
]
# Hostile strings: screened out, or rejected by the parser, quickly.
HOSTILE_CASES = [
    (boxed("__import__('os').system('echo hacked')"), "0", 0.0),
    (boxed("exec('import os')"), "0", 0.0),
    (boxed("10**10**10"), "1", 0.0),
    (boxed("10^{10^{10}}"), "1", 0.0),
    (boxed("9^{9^{9}}"), "1", 0.0),
    (boxed(r"\frac{1}{10^{10^{10}}}"), "0", 0.0),
    (boxed("(10^{10})!"), "1", 0.0),
    (boxed("99999999!"), "1", 0.0),
    (boxed("2^{1000000}"), "1", 0.0),
    (boxed("{" * 5000 + "1" + "}" * 5000), "1", 0.0),
    (boxed("(" * 500 + "1" + ")" * 500), "1", 0.0),
    (boxed("1" * MEGABYTE), "1", 0.0),
    (boxed(r"\frac{1}{2}+" * (MEGABYTE // 12)), "1", 0.0),
    ("<think>x</think>" + r"\boxed{" * (MEGABYTE // 7), "1", 0.0),
    ("<think>" + "Add the tens. " * 80_000 + "</think> \\boxed{12}", "12", 1.0),
]


@pytest.fixture(scope="module", autouse=True)
def warm_verifier():
    """Imports and warms SymPy and math-verify (a second or two) before anything is timed."""
    math_correctness(boxed("x^2+2x+1"), "(x+1)^2", timeout_s=None)


def test_math_table_has_enough_cases():
    assert len(MATH_CASES) + len(HOSTILE_CASES) >= 60


@pytest.mark.parametrize("completion, reference, expected", MATH_CASES, ids=range(len(MATH_CASES)))
def test_math_correctness_table(completion, reference, expected):
    # A generous limit: on a loaded machine SymPy can be slow, and a timeout scores 0.
    start = time.perf_counter()
    assert math_correctness(completion, reference, timeout_s=20.0) == expected
    assert time.perf_counter() - start < 20.5


@pytest.mark.parametrize(
    "completion, reference, expected", HOSTILE_CASES, ids=range(len(HOSTILE_CASES))
)
def test_math_correctness_hostile(completion, reference, expected):
    # Most are screened out in microseconds (see the next test); the few that reach the
    # parser fail to parse quickly. Bounded well below the 5 s verifier limit even on a
    # loaded machine.
    start = time.perf_counter()
    assert math_correctness(completion, reference) == expected
    assert time.perf_counter() - start < 4.0


def test_hostile_answer_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    attack = f"__import__('os').system('touch {marker}')"
    assert math_correctness(boxed(attack), "0") == 0.0
    assert math_correctness(boxed(f'eval("{attack}")'), "0") == 0.0
    assert not marker.exists()


def test_hostile_answers_are_rejected_before_parsing():
    for answer in [
        "10**10**10",
        "10^{10^{10}}",
        "(10^{10})!",
        "{" * 5000 + "1" + "}" * 5000,
        "1" * MEGABYTE,
    ]:
        start = time.perf_counter()
        assert verify_math(boxed(answer), "1").status == "rejected"
        assert time.perf_counter() - start < 0.5


# Arithmetic inside exponents, towers and powers of bracketed powers: a big-integer power
# that sits in one C call. Each must be rejected unparsed.
EXPLOSIVE_EXPONENTS = [
    r"3^{99999 \cdot 9999}",  # the issue's reproduction
    r"3^{99999 \times 9999}",
    "3^{99999*9999}",
    "2^{99999+99999}",
    "2^{(999)(999)}",
    "2^{999 999}",
    "(3^{999})^{999}",
    r"\left(3^{999}\right)^{999}",
    "{3^{999}}^{999}",
    "2^{3^{4}}",
    "2^3^4",
    "2^{123456}",
]


@pytest.mark.parametrize("answer", EXPLOSIVE_EXPONENTS)
def test_arithmetic_in_exponents_is_rejected_unparsed(answer):
    start = time.perf_counter()
    assert verify_math(boxed(answer), "42").status == "rejected"
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    "answer, reference",
    [
        ("2^{10}", "1024"),
        ("2^{3 \\cdot 4}", "4096"),
        ("x^{2n+1}", "x^{2n+1}"),
        ("10^{-3}", "0.001"),
        ("(x^2)^3", "x^6"),
        ("2^{99999}", "2^{99999}"),
    ],
)
def test_small_exponents_still_reach_the_verifier(answer, reference):
    assert verify_math(boxed(answer), reference).status == "correct"


def test_the_issue_reproduction_returns_promptly_from_a_thread():
    box = r"\boxed{3^{99999 \cdot 9999}}"
    results = []
    thread = threading.Thread(
        target=lambda: results.append(math_correctness(box, "42", timeout_s=1.0)), daemon=True
    )
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and results == [0.0]


def test_a_stuck_verification_off_the_main_thread_is_killed(monkeypatch):
    """With the screen switched off, the reproduction reaches SymPy: a power of about 10^9
    digits, one C call that a limit inside a thread cannot interrupt (the asynchronous
    exception waits for it; this froze the process). Verification off a scoring worker's
    main thread runs in the calling thread's verifier process instead, stopped or killed
    at the limit: a timeout (scored 0) in about the limit, from the main thread and from
    another one, and the next verification works."""
    from policyopt.rewards import math as math_lib

    monkeypatch.setattr(math_lib, "screen_answer", lambda answer: True)
    verify_math(boxed(r"\sqrt{8}"), r"2\sqrt{2}", timeout_s=30)  # start the worker: seconds
    results = []

    def grade(root):  # a new pair each time: verdicts are cached
        results.append(verify_math(boxed(r"3^{99999 \cdot 9999}"), "42", timeout_s=1.0))
        results.append(
            verify_math(boxed(rf"\sqrt{{{2 * root * root}}}"), rf"{root}\sqrt{{2}}", timeout_s=30)
        )

    for root, in_thread in ((3, False), (4, True)):
        results.clear()
        start = time.perf_counter()
        if in_thread:
            thread = threading.Thread(target=grade, args=(root,), daemon=True)
            thread.start()
            thread.join(60)
            assert not thread.is_alive()
        else:
            grade(root)  # the main thread of a process that is no scoring worker
        assert [r.status for r in results] == ["timeout", "correct"]
        assert time.perf_counter() - start < 45


def test_a_killable_worker_is_killed_in_c_code_and_replaced():
    from policyopt.rewards.killable import KillableWorker
    from tests import verifiers

    worker = KillableWorker()
    try:
        assert worker.call(pow, (3, 4), 30.0) == 81
        first = worker.pid
        start = time.perf_counter()
        with pytest.raises(VerifierTimeout, match="call exceeded 0.2 s$"):
            worker.call(pow, (3, 10**10), 0.2)  # interruptible: the worker's own limit
        assert worker.pid == first
        with pytest.raises(VerifierTimeout, match="killed"):
            worker.call(verifiers.deaf, (60,), 0.2)  # deaf to SIGALRM: killed
        assert time.perf_counter() - start < 5
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            worker.call(divmod, (1, 0), 30.0)
        assert worker.call(pow, (2, 5), 30.0) == 32 and worker.pid != first
    finally:
        worker.kill()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 + 4 = <<3+4=7>>7 apples.\n#### 7", "7"),
        ("#### 1,000.", "1000"),
        ("#### **$12**", "12"),
        ("#### 5\nextra text #### 6\nmore", "6"),
        ("####\n  -3  ", "-3"),
        ("no marker 7", None),
        ("#### ", None),
    ],
)
def test_extract_gsm8k(text, expected):
    assert extract_gsm8k(text) == expected


def test_gsm8k_answer_format_in_verifier_gate_and_sft_targets(tmp_path):
    """reward.answer_format="gsm8k": a GSM8K solution (the SFT target of its row) is
    correct against the row's reference under the verifier and passes the format gate;
    under "boxed" it has no answer, which was the disagreement between SFT and RL."""
    import json

    from policyopt.data.jsonl import read_math_jsonl

    path = tmp_path / "gsm8k.jsonl"
    path.write_text(
        json.dumps(
            {
                "question": "Tom has 3 apples and buys 4. How many?",
                "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7",
            }
        )
        + "\n"
    )
    (record,), _ = read_math_jsonl(str(path))
    target = record["solution"]
    assert verify_math(target, record["answer"], answer_format="gsm8k").status == "correct"
    assert math_correctness(target, "8", answer_format="gsm8k") == 0.0
    assert verify_math(target, record["answer"]).status == "no_answer"
    # A whole GSM8K solution as the reference reads its final answer too.
    assert math_correctness("#### 7", target, answer_format="gsm8k") == 1.0
    gated = "<think>3 + 4 = 7</think> #### 7"
    assert format_ok(gated, "math", "gsm8k") and not format_ok(gated, "math")
    assert not format_ok("<think>7</think> 7", "math", "gsm8k")
    scores = score_batch(
        [gated, "<think>7</think> \\boxed{7}"],
        ["7", "7"],
        [5, 5],
        RewardSpec(answer_format="gsm8k"),
    )
    assert scores.rewards.tolist() == pytest.approx([1.0, 0.0])


def test_extract_boxed():
    assert extract_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{a{b}c}") == "a{b}c"
    assert extract_boxed(r"\boxed{x} \boxed{unclosed") == "x"
    assert extract_boxed(r"\fbox{3}") == "3"
    assert extract_boxed("} no box {") is None
    assert extract_boxed(r"\boxed {5}") == "5"
    # The brace-less form, only where no braced box closes (prose after a box is no answer).
    assert extract_boxed(r"so \boxed 42.") == "42"
    assert extract_boxed(r"$\boxed -3$ then \boxed 4") == "4"
    assert extract_boxed(r"\boxed{1} then \boxed 2") == "1"
    assert extract_boxed(r"\boxed 2 then \boxed{1}") == "1"
    assert extract_boxed(r"\boxed{12} (formatted with \boxed as you asked).") == "12"
    assert extract_boxed(r"\boxed \frac{1}{2}") is None and extract_boxed(r"\boxed \pi") == r"\pi"
    assert extract_boxed(r"\boxed .") is None
    assert extract_boxed(r"so \boxed 42.", bare=False) is None
    assert verify_math(r"<think>6*7</think> so \boxed 42.", "42").score == 1.0


# DAPO-Math-17k's prompts end "The last line of your response should be of the form
# Answer: $Answer (without quotes) where $Answer is the answer to the problem."
ANSWER_LINE_CASES = [
    ("Some work.\nAnswer: 34", "34"),
    ("Answer: $\\frac{1}{2}$.", "\\frac{1}{2}"),  # dollars and a full stop go
    ("Answer: 3.5.", "3.5"),
    ("Answer: \\boxed{7}", "7"),  # a box on the line gives its content
    ("answer: 1\nFINAL ANSWER: 2", "2"),  # the last line, any case (verl's (?i) pattern)
    ("The answer:\n 42", "42"),  # verl's \s* crosses a line break
    ("Answer: x = 3\nThanks", "x = 3"),
    ("Answer: 1\nAnswer: .", None),  # the last match counts, even when nothing is left of it
    ("Answer: 1\nAnswer:", "1"),  # an empty "Answer:" is no match (verl's [^\n]+)
    ("Answer: $5$ dollars", "5"),  # the first $...$ span, as Minerva's normalisation keeps
    ("**Answer:** 34", "34"),  # Markdown emphasis
    ("Answer: **34**", "34"),
    ("Answer: **34**.", "34"),
    ("Answer: **34.**", "34"),
    ("Answer: 1, 2, 3, ...", "1, 2, 3, ..."),  # one full stop goes, not an ellipsis
    ("the answer is 5", None),
    ("\\boxed{5}", None),
    ("", None),
]


@pytest.mark.parametrize("text, expected", ANSWER_LINE_CASES)
def test_extract_answer_line(text, expected):
    assert extract_answer_line(text) == expected


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("Work...\nAnswer: 34", "34", 1.0),
        ("Answer: 0.5", "\\frac{1}{2}", 1.0),  # math-verify, where verl's string match says no
        ("Answer: x = 3", "3", 1.0),  # verl keeps what follows the last "=": the same verdict
        ("Answer: 35", "34", 0.0),
        ("\\boxed{34}", "34", 0.0),  # a box alone is not an answer line
        ("<think>Answer: 34</think>\nAnswer: 35", "34", 0.0),  # the reasoning is not graded
        ("<think>Answer: 35</think>\nAnswer: 34", "34", 1.0),
    ],
)
def test_math_correctness_answer_line(completion, reference, expected):
    assert math_correctness(completion, reference, answer_format="answer_line") == expected
    verdict = verify_math(completion, reference, answer_format="answer_line")
    assert verdict.score == expected
    if extract_answer_line(completion.rsplit("</think>", 1)[-1]) is None:
        assert verdict.status == "no_answer"
    # The default format reads boxes only.
    assert math_correctness(completion, reference) == (1.0 if "\\boxed{34}" in completion else 0.0)


def test_unknown_answer_format_is_refused():
    with pytest.raises(ValueError, match="answer_format"):
        verify_math("Answer: 1", "1", answer_format="last_line")
    with pytest.raises(ValueError, match="answer_format"):
        format_ok("<think></think>Answer: 1", "math", "last_line")
    with pytest.raises(ValueError, match="answer_format"):
        RewardSpec(answer_format="last_line")
