"""Rewards: math verifier table, time limits, format, length, language and batch scoring.

The code sandbox has its own file, tests/test_rewards_code.py.
"""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from policyopt.rewards import (
    RewardSpec,
    VerifierTimeout,
    extract_answer_line,
    extract_boxed,
    extract_gsm8k,
    format_ok,
    identify_language,
    languages_consistent,
    math_correctness,
    overlong_penalties,
    overlong_penalty,
    score_batch,
    start_workers,
    strip_latex_and_code,
    time_limit,
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


def test_time_limit_interrupts_main_thread_and_restores_handler():
    previous = signal.getsignal(signal.SIGALRM)
    start = time.perf_counter()
    with pytest.raises(VerifierTimeout):
        with time_limit(0.1):
            while True:
                pass
    assert time.perf_counter() - start < 1.0
    assert signal.getsignal(signal.SIGALRM) is previous
    time.sleep(0.15)  # no stray alarm fires after the block


def test_time_limits_nest():
    start = time.perf_counter()
    with pytest.raises(VerifierTimeout):
        with time_limit(0.3):
            with time_limit(0.05):
                pass  # the inner block ends in time; the outer limit must still fire
            while True:
                pass
    assert 0.25 < time.perf_counter() - start < 1.0
    with pytest.raises(VerifierTimeout):
        with time_limit(0.05):
            with time_limit(10.0):  # the shorter, outer limit wins
                while True:
                    pass
    assert time.perf_counter() - start < 2.0


def test_time_limit_interrupts_worker_thread():
    def spin():
        start = time.perf_counter()
        try:
            with time_limit(0.1):
                while True:
                    pass
        except VerifierTimeout:
            return time.perf_counter() - start
        return None

    with ThreadPoolExecutor(1) as pool:
        elapsed = pool.submit(spin).result(timeout=10)
    assert elapsed is not None and elapsed < 1.0


def test_time_limit_does_not_fire_after_the_block():
    def quick():
        with time_limit(0.05):
            pass
        time.sleep(0.2)  # a late exception would surface here
        return "ok"

    assert quick() == "ok"
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(quick).result(timeout=10) == "ok"


def test_math_verifier_works_in_threads_and_times_out():
    # math-verify's own signal.alarm timeouts raise in non-main threads; ours do not.
    with ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(
                lambda ref: math_correctness(boxed(r"\frac{\sqrt{2}}{2}"), ref),
                [r"\frac{1}{\sqrt{2}}", "0.7"],
            )
        )
    assert results == [1.0, 0.0]
    # A slow but screened-in answer (a huge binomial) is interrupted by the time limit.
    start = time.perf_counter()
    verdict = verify_math(boxed(r"\binom{1000000}{500000}"), "1", timeout_s=0.5)
    assert verdict.status == "timeout" and time.perf_counter() - start < 2.0
    verdict = verify_math(boxed(r"\frac{\sqrt{3}}{2}"), r"\sin(\pi/3)", timeout_s=1e-4)
    assert verdict.status == "timeout" and verdict.score == 0.0
    assert verify_math(boxed(r"\frac{\sqrt{3}}{2}"), r"\sin(\pi/3)").score == 1.0


# ----------------------------------------------------------------------------- format

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


# ----------------------------------------------------------------------------- length


def dapo_reference(length, max_len, cache_len):
    """docs/algorithms.md "Reward" (DAPO eq. 13, Magistral), written out case by case."""
    if length <= max_len - cache_len:
        return 0.0
    if length <= max_len:
        return ((max_len - cache_len) - length) / cache_len
    return -1.0


def test_overlong_penalty_hand_worked():
    # L_max = 20, L_cache = 5: the ramp starts after 15 tokens.
    assert overlong_penalty(0, 20, 5) == 0.0
    assert overlong_penalty(15, 20, 5) == 0.0
    assert overlong_penalty(16, 20, 5) == pytest.approx(-0.2)
    assert overlong_penalty(18, 20, 5) == pytest.approx(-0.6)
    assert overlong_penalty(20, 20, 5) == pytest.approx(-1.0)
    assert overlong_penalty(21, 20, 5) == -1.0
    # Magistral: -0.1 * (|y| - l_max + l_cache) / l_cache, floor -0.1.
    assert overlong_penalty(15, 20, 5, scale=0.1) == 0.0
    assert overlong_penalty(16, 20, 5, scale=0.1) == pytest.approx(-0.02)
    assert overlong_penalty(20, 20, 5, scale=0.1) == pytest.approx(-0.1)
    assert overlong_penalty(99, 20, 5, scale=0.1) == pytest.approx(-0.1)
    # DAPO's own setting: L_max 20480, L_cache 4096.
    assert overlong_penalty(16384, 20480, 4096) == 0.0
    assert overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5)
    assert overlong_penalty(20480, 20480, 4096) == pytest.approx(-1.0)


def test_overlong_penalties_match_case_by_case_reference():
    lengths = np.arange(0, 40)
    for scale in (1.0, 0.1):
        expected = [scale * dapo_reference(int(n), 30, 8) for n in lengths]
        np.testing.assert_allclose(
            overlong_penalties(lengths, 30, 8, scale=scale), expected, rtol=1e-6, atol=1e-7
        )


def test_overlong_penalty_rejects_bad_cache():
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(5, 10, 0)
    with pytest.raises(ValueError, match="cache_len"):
        overlong_penalty(5, 10, 11)


# ----------------------------------------------------------------------------- language

ENGLISH_PROBLEM = (
    "A farmer has twelve apples and buys seven more. How many apples does the farmer have now?"
)
ENGLISH_REASONING = (
    "The farmer starts with twelve apples. Buying seven more gives $12 + 7 = 19$ apples in total."
)
FRENCH_REASONING = (
    "Le fermier commence avec douze pommes. En achetant sept de plus, il obtient "
    "$12 + 7 = 19$ pommes."
)
ENGLISH_ANSWER = r"So the farmer now has nineteen apples in total: \boxed{19}."
GERMAN_ANSWER = r"Also hat der Bauer jetzt insgesamt neunzehn Äpfel: \boxed{19}."


def test_strip_latex_and_code():
    text = (
        "Compute $\\frac{1}{2}$ and \\(x^2\\) \\[y\\] $$z$$ ```python\nprint('hello world')\n``` "
        "then `len(x)` done \\textbf{now}"
    )
    assert strip_latex_and_code(text) == "Compute and then done now"
    env = "Solve \\begin{align} x &= 1 \\end{align} please </think>"
    assert strip_latex_and_code(env) == "Solve please"


def test_identify_language():
    assert identify_language(ENGLISH_REASONING) == "en"
    assert identify_language(FRENCH_REASONING) == "fr"
    assert identify_language(GERMAN_ANSWER) == "de"
    assert identify_language(r"\boxed{19}") == "und"
    assert identify_language("") == "und"
    # Code is stripped: French prose around English-named code is still French.
    code = "```python\ndef compute_total_number_of_apples_for_the_farmer(x):\n    return x\n```"
    assert identify_language(FRENCH_REASONING + "\n" + code) == "fr"


def test_languages_consistent_cases():
    assert languages_consistent(ENGLISH_PROBLEM, ENGLISH_REASONING, ENGLISH_ANSWER)
    assert not languages_consistent(ENGLISH_PROBLEM, FRENCH_REASONING, ENGLISH_ANSWER)
    assert not languages_consistent(ENGLISH_PROBLEM, ENGLISH_REASONING, GERMAN_ANSWER)
    # A bare boxed answer and a missing problem are undetermined: skipped.
    assert languages_consistent(None, ENGLISH_REASONING, r"\boxed{19}")
    # Reasoning that is all maths is undetermined: no bonus.
    assert not languages_consistent(ENGLISH_PROBLEM, "$12 + 7 = 19$", ENGLISH_ANSWER)


# ----------------------------------------------------------------------------- batch


def test_reward_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="task"):
        RewardSpec(task="chess")
    with pytest.raises(ValueError, match="overlong"):
        RewardSpec(overlong="linear")
    with pytest.raises(ValueError, match="max_len"):
        RewardSpec(overlong="dapo")
    with pytest.raises(ValueError, match="cache_len"):
        RewardSpec(overlong="dapo", max_len=10, cache_len=20)
    with pytest.raises(ValueError, match="overlong_filter"):
        RewardSpec(overlong_filter=True)


def test_score_batch_magistral_hand_worked():
    spec = RewardSpec(overlong="magistral", max_len=100, cache_len=20, language_bonus=0.1)
    think = "<think>" + ENGLISH_REASONING + "</think> "
    completions = [
        # English reasoning, bare boxed answer (undetermined, skipped): language bonus 0.1.
        think + r"\boxed{19}",  # correct, short: 0.1 + 0.9 + 0.1 = 1.1
        think + r"\boxed{18}",  # wrong, short: 0.1 + 0.1 = 0.2
        think + r"\boxed{19}",  # correct, 90 tokens: 1.1 - 0.1 * 10/20 = 1.05
        "19",  # format failure: 0, no penalty even at 120 tokens
        think + ENGLISH_ANSWER,  # correct, English answer: 1.1
        "<think>"
        + FRENCH_REASONING
        + "</think> "
        + ENGLISH_ANSWER,  # correct, languages differ: 1.0
        think + r"\boxed{18}",  # wrong, 120 tokens: 0.1 - 0.1 + 0.1 = 0.1
    ]
    lengths = [10, 10, 90, 120, 10, 10, 120]
    rewards, correct, metrics = result = score_batch(
        completions, ["19"] * 7, lengths, spec, prompts=[ENGLISH_PROBLEM] * 7
    )
    np.testing.assert_allclose(rewards, [1.1, 0.2, 1.05, 0.0, 1.1, 1.0, 0.1], atol=1e-6)
    assert rewards.dtype == np.float32 and correct.dtype == np.bool_
    assert correct.tolist() == [True, False, True, False, True, True, False]
    assert metrics["accuracy"] == pytest.approx(4 / 7)
    assert metrics["format_failure_rate"] == pytest.approx(1 / 7)
    assert metrics["reward_mean"] == pytest.approx(
        np.mean([1.1, 0.2, 1.05, 0.0, 1.1, 1.0, 0.1]), abs=1e-6
    )
    np.testing.assert_allclose(result.length_penalty, [0, 0, -0.05, 0, 0, 0, -0.1], atol=1e-7)
    assert metrics["length_penalty_mean"] == pytest.approx(-0.15 / 7, abs=1e-7)
    assert result.truncated.tolist() == [False, False, False, True, False, False, True]
    assert result.sample_mask.tolist() == [1.0] * 7  # filtering is off
    assert result.language_ok.tolist() == [True, True, True, False, True, False, True]
    assert metrics["deadline_missed"] == 0 and metrics["verifier_timeouts"] == 0


def test_score_batch_dapo_rewards_and_overlong_filter():
    spec = RewardSpec(
        format_reward=False,
        incorrect_value=-1.0,
        overlong="dapo",
        max_len=50,
        cache_len=10,
        overlong_filter=True,
    )
    completions = [r"\boxed{3}", r"\boxed{4}", r"\boxed{3}", "no answer", r"\boxed{3}"]
    lengths = [5, 5, 45, 50, 60]
    rewards, correct, metrics = result = score_batch(completions, ["3"] * 5, lengths, spec)
    # correct/incorrect = +1/-1, then the ramp from 40 to 50 tokens.
    np.testing.assert_allclose(rewards, [1.0, -1.0, 0.5, -2.0, 0.0], atol=1e-6)
    assert correct.tolist() == [True, False, True, False, True]
    assert result.sample_mask.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert metrics["truncated_fraction"] == pytest.approx(0.4)
    # The trainer's own truncation flags win over the length rule.
    explicit = score_batch(completions, ["3"] * 5, lengths, spec, truncated=[False] * 4 + [True])
    assert explicit.sample_mask.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_score_batch_answer_line_dapo_and_magistral_recipes():
    # DAPO on DAPO-Math-17k: +1 / -1 from the "Answer:" line, no format gate.
    dapo = RewardSpec(format_reward=False, incorrect_value=-1.0, answer_format="answer_line")
    completions = ["so\nAnswer: 3", "Answer: 4", "\\boxed{3}", "<think>x</think>\nAnswer: 3"]
    rewards, correct, _ = score_batch(completions, ["3"] * 4, [5] * 4, dapo)
    np.testing.assert_allclose(rewards, [1.0, -1.0, -1.0, 1.0])
    assert correct.tolist() == [True, False, False, True]
    # Magistral's gate with answer lines: <think>...</think> then an "Answer:" line.
    gated = RewardSpec(answer_format="answer_line")
    rewards, correct, metrics = score_batch(completions, ["3"] * 4, [5] * 4, gated)
    np.testing.assert_allclose(rewards, [0.0, 0.0, 0.0, 1.0])
    assert metrics["format_failure_rate"] == pytest.approx(0.75)


def test_score_batch_checks_lengths_match():
    with pytest.raises(ValueError, match="references"):
        score_batch(["a", "b"], ["1"], [1, 2], RewardSpec())


def _mixed_batch(n):
    answers = [
        ("12", "12"),
        (r"\frac{1}{2}", "0.5"),
        ("7", "8"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        ("10**10**10", "1"),
    ]
    completions, references = [], []
    for i in range(n):
        answer, reference = answers[i % len(answers)]
        completions.append(boxed(answer) if i % 7 else "no format " + boxed(answer))
        references.append(reference)
    return completions, references


def test_score_batch_serial_equals_parallel():
    completions, references = _mixed_batch(24)
    completions[1] = "<think>" + ENGLISH_REASONING + "</think> " + ENGLISH_ANSWER
    completions[2] = "<think>" + FRENCH_REASONING + "</think> " + ENGLISH_ANSWER
    lengths = list(range(24))
    prompts = [ENGLISH_PROBLEM] * 24
    spec = RewardSpec(overlong="dapo", max_len=20, cache_len=8, language_bonus=0.1)
    serial = score_batch(completions, references, lengths, spec, prompts=prompts)
    parallel = score_batch(completions, references, lengths, spec, prompts=prompts, num_workers=2)
    assert serial.language_ok[1] and not serial.language_ok[2]
    np.testing.assert_array_equal(serial.rewards, parallel.rewards)
    np.testing.assert_array_equal(serial.correct, parallel.correct)
    np.testing.assert_array_equal(serial.language_ok, parallel.language_ok)
    assert serial.status == parallel.status
    for key in ("reward_mean", "accuracy", "format_failure_rate", "length_penalty_mean"):
        assert serial.metrics[key] == pytest.approx(parallel.metrics[key])
    assert parallel.metrics["deadline_missed"] == 0


def test_custom_verifier_replaces_the_math_verifier():
    """RewardSpec.verifier: the function's c goes through the usual composition (DAPO's
    -1 / +1 here, half credit in between), with the format gate, its time limit, and
    errors scored 0 and counted; the same in the workers as in this process."""
    spec = RewardSpec(
        format_reward=False, incorrect_value=-1.0, verifier="tests.verifiers:last_word"
    )
    completions = ["so it is 42", "so it is 41", "", "\\boxed{42}"]
    scores = score_batch(completions, ["42"] * 4, [4] * 4, spec)
    np.testing.assert_array_equal(scores.rewards, [1.0, -1.0, -1.0, -1.0])
    assert scores.status == ["correct", "incorrect", "incorrect", "incorrect"]
    parallel = score_batch(completions, ["42"] * 4, [4] * 4, spec, num_workers=2)
    np.testing.assert_array_equal(parallel.rewards, scores.rewards)
    assert parallel.status == scores.status

    half = RewardSpec(
        format_reward=False, incorrect_value=-1.0, verifier="tests.verifiers:half_credit"
    )
    np.testing.assert_array_equal(score_batch(["x"], ["y"], [1], half).rewards, [0.0])
    gated = RewardSpec(verifier="tests.verifiers:always_correct")  # Magistral's format gate
    scores = score_batch(["<think>a</think> \\boxed{1}", "no think"], ["1", "1"], [1, 1], gated)
    np.testing.assert_allclose(scores.rewards, [1.0, 0.0])
    assert scores.status == ["correct", "format"]

    slow = RewardSpec(
        format_reward=False, verifier="tests.verifiers:sleeps", verifier_timeout_s=0.2
    )
    start = time.perf_counter()
    scores = score_batch(["x"], ["y"], [1], slow)
    assert time.perf_counter() - start < 5 and scores.status == ["timeout"]
    assert scores.metrics["verifier_timeouts"] == 1 and scores.rewards[0] == 0.0
    # A verifier that fails on a sample scores c = 0; the format check still counts.
    formatted = "<think>a</think> \\boxed{1}"
    for name in ("says_yes", "raises"):
        broken = RewardSpec(verifier=f"tests.verifiers:{name}")  # Magistral's format gate
        scores = score_batch([formatted, "no think"], ["1", "2"], [1, 1], broken)
        assert scores.status == ["verifier_error", "format"]
        assert (
            scores.metrics["verifier_errors"] == 1 and scores.metrics["format_failure_rate"] == 0.5
        )
        np.testing.assert_allclose(scores.rewards, [0.1, 0.0])
        parallel = score_batch([formatted, "no think"], ["1", "2"], [1, 1], broken, num_workers=2)
        assert parallel.status == scores.status and parallel.metrics["worker_errors"] == 0

    for path, match in (
        ("tests.verifiers", "package.module:function"),
        ("tests.no_such_module:f", "cannot import"),
        ("tests.verifiers:missing", "no function 'missing'"),
        ("tests.verifiers:not_a_function", "no function 'not_a_function'"),
    ):
        with pytest.raises(ValueError, match=match):
            RewardSpec(verifier=path)


def test_a_verifier_the_workers_cannot_import_raises(tmp_path, monkeypatch):
    """A verifier importable here but not in the (already running) scoring workers raises
    from score_batch instead of scoring every sample 0 as a crash."""
    start_workers(2)
    (tmp_path / "late_verifier.py").write_text(
        "def check(completion, reference):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = RewardSpec(format_reward=False, verifier="late_verifier:check")
    assert score_batch(["x"], ["y"], [1], spec).status == ["correct"]  # in this process
    with pytest.raises(ValueError, match="cannot import 'late_verifier'"):
        score_batch(["x"] * 4, ["y"] * 4, [1] * 4, spec, num_workers=2)
    # The pool is intact: the next batch scores.
    assert score_batch(["x"], ["y"], [1], RewardSpec(), num_workers=2).status == ["format"]


def test_score_batch_deadline_counts_missed_samples():
    completions, references = _mixed_batch(10)
    spec = RewardSpec()
    result = score_batch(completions, references, [1] * 10, spec, deadline_s=0.0)
    rewards, correct, metrics = result
    assert metrics["deadline_missed"] == 10
    assert not rewards.any() and not correct.any() and not result.sample_mask.any()
    assert not result.scored.any()  # stand-in rewards, for no group statistic
    # DAPO's recipe (wrong = -1, overlong penalty): a missed sample gets -1 without penalty,
    # not 0 (which would rank it above its group's wrong answers), and leaves the loss.
    dapo = RewardSpec(
        format_reward=False, incorrect_value=-1.0, overlong="dapo", max_len=8, cache_len=4
    )
    missed = score_batch(completions, references, [8] * 10, dapo, deadline_s=0.0)
    np.testing.assert_array_equal(missed.rewards, np.full(10, -1.0, np.float32))
    np.testing.assert_array_equal(missed.sample_mask, np.zeros(10, np.float32))
    assert not missed.correct.any() and missed.metrics["length_penalty_mean"] == 0.0
    scored = score_batch(completions, references, [8] * 10, dapo)
    assert (
        scored.metrics["deadline_missed"] == 0 and scored.sample_mask.all() and scored.scored.all()
    )
    assert scored.rewards.min() == -2.0  # wrong and at L_max: -1 - 1


def test_score_batch_deadline_stops_serial_scoring_midway():
    loop = "<think>plan</think>\n```python\nwhile True:\n    pass\n```"
    spec = RewardSpec(task="code", code_timeout_s=1.0)
    start = time.perf_counter()
    result = score_batch([loop] * 3, ["assert True"] * 3, [1] * 3, spec, deadline_s=0.5)
    assert time.perf_counter() - start < 4.0
    # The first program runs into its 1 s limit; by then the deadline has passed.
    assert result.status == ["timeout", "deadline", "deadline"]
    assert result.metrics["deadline_missed"] == 2 and result.metrics["verifier_timeouts"] == 1


def test_score_batch_parallel_deadline_then_recovers():
    loop = "<think>plan</think>\n```python\nwhile True:\n    pass\n```"
    spec = RewardSpec(task="code", code_timeout_s=1.0)
    start_workers(2)  # pool start-up (seconds on a fresh process) is not part of the deadline
    start = time.perf_counter()
    result = score_batch(
        [loop] * 4, ["assert True"] * 4, [1] * 4, spec, num_workers=2, deadline_s=0.3
    )
    assert time.perf_counter() - start < 3.0
    assert result.metrics["deadline_missed"] == 4 and not result.rewards.any()
    # The stuck pool was killed; the next call gets a fresh one and scores normally.
    completions, references = _mixed_batch(6)
    again = score_batch(completions, references, [1] * 6, RewardSpec(), num_workers=2)
    serial = score_batch(completions, references, [1] * 6, RewardSpec())
    np.testing.assert_array_equal(again.rewards, serial.rewards)


def test_samples_of_a_crashed_worker_get_no_verdict():
    """A worker that dies mid-batch: its samples get the stand-in reward, leave the loss and
    their group's statistics ("worker_error", scored False); the next call has a new pool."""
    from policyopt.rewards import scoring as batch_lib

    completions, references = _mixed_batch(6)
    spec = RewardSpec(
        format_reward=False,
        incorrect_value=-1.0,
        verifier="tests.verifiers:sleeps",
        verifier_timeout_s=60.0,
    )
    start_workers(2)
    worker = batch_lib._POOLS[("default", 2)].pids[0]
    killer = threading.Timer(2.0, os.kill, (worker, signal.SIGKILL))  # the OOM killer, mid-batch
    killer.start()
    lost = score_batch(completions, references, [1] * 6, spec, num_workers=2)
    killer.join()
    assert lost.metrics["worker_errors"] == 6 and lost.metrics["deadline_missed"] == 0
    assert (
        lost.status == ["worker_error"] * 6 and not lost.scored.any() and not lost.sample_mask.any()
    )
    np.testing.assert_array_equal(lost.rewards, np.full(6, -1.0, np.float32))
    again = score_batch(completions, references, [1] * 6, RewardSpec(), num_workers=2)
    assert again.metrics["worker_errors"] == 0 and again.scored.all()
    np.testing.assert_array_equal(
        again.rewards, score_batch(completions, references, [1] * 6, RewardSpec()).rewards
    )


def test_a_call_waiting_without_deadline_returns_when_its_pool_is_killed():
    """Another thread killing the pool (its deadline passed, or a worker crashed) cancels
    this call's queued chunks: the call returns them as lost instead of waiting for ever;
    a caller under another pool name is untouched."""
    from policyopt.rewards import scoring as batch_lib

    spec = RewardSpec(
        format_reward=False, verifier="tests.verifiers:sleeps", verifier_timeout_s=60.0
    )
    completions, references = ["x"] * 12, ["x"] * 12
    start_workers(2)
    start_workers(2, pool="other")
    results = {}
    waiting = threading.Thread(
        target=lambda: results.update(
            lost=score_batch(completions, references, [1] * 12, spec, num_workers=2)
        )
    )
    waiting.start()
    time.sleep(1.0)  # its 2 x 4 chunks are queued, two running
    other = batch_lib._POOLS[("other", 2)]
    batch_lib.kill_pool(2)
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    assert results["lost"].metrics["worker_errors"] == 12 and not results["lost"].scored.any()
    assert batch_lib._POOLS[("other", 2)] is other  # another pool is not affected
    completions, references = _mixed_batch(6)
    again = score_batch(completions, references, [1] * 6, RewardSpec(), num_workers=2)
    np.testing.assert_array_equal(
        again.rewards, score_batch(completions, references, [1] * 6, RewardSpec()).rewards
    )
    batch_lib.kill_pool(2, "other")


def test_a_call_cleaning_up_its_killed_pool_spares_the_next_one():
    """A call whose pool was killed under it must not kill the pool that another caller of
    the same name started since (kill_pool(only=...))."""
    from policyopt.rewards import scoring as batch_lib

    spec = RewardSpec(
        format_reward=False, verifier="tests.verifiers:sleeps", verifier_timeout_s=60.0
    )
    results = {}
    start_workers(2, pool="shared")
    first = threading.Thread(
        target=lambda: results.update(
            first=score_batch(["x"] * 12, ["x"] * 12, [1] * 12, spec, num_workers=2, pool="shared")
        )
    )
    first.start()
    time.sleep(1.0)
    batch_lib.kill_pool(2, "shared")
    # Still scoring (4 x 1.5 s on 2 workers) when the first call notices its loss.
    naps = RewardSpec(format_reward=False, verifier="tests.verifiers:naps", verifier_timeout_s=60.0)
    second = score_batch(["x"] * 4, ["x"] * 4, [1] * 4, naps, num_workers=2, pool="shared")
    first.join(timeout=10)
    # Its queued chunks were cancelled: it notices at its next poll, while the second call
    # is scoring on a new pool of the same name.
    assert not first.is_alive() and results["first"].metrics["worker_errors"] == 12
    assert second.metrics["worker_errors"] == 0 and second.rewards.tolist() == [1.0] * 4
    batch_lib.kill_pool(2, "shared")


def test_score_batch_survives_a_worker_killed_between_calls():
    """Workers killed while idle (e.g. by the OOM killer) are replaced before the next
    chunk: no sample is lost."""
    from policyopt.rewards import scoring as batch_lib
    from policyopt.rewards.worker import wait_gone

    completions, references = _mixed_batch(6)
    start_workers(2)
    pids = batch_lib._POOLS[("default", 2)].pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    assert wait_gone(pids)
    first = score_batch(completions, references, [1] * 6, RewardSpec(), num_workers=2)
    serial = score_batch(completions, references, [1] * 6, RewardSpec())
    assert first.metrics["worker_errors"] == 0 and first.scored.all()
    np.testing.assert_array_equal(first.rewards, serial.rewards)
    assert not set(batch_lib._POOLS[("default", 2)].pids) & set(pids)
