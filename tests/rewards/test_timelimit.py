"""Time limits (policyopt.rewards.timelimit) on the main thread and worker threads, nested, and
the math verifier under them."""

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from policyopt.rewards import VerifierTimeout, math_correctness, time_limit, verify_math

# warm_verifier: test_math's autouse fixture, SymPy warmed before anything is timed here too.
from tests.rewards.test_math import boxed, warm_verifier  # noqa: F401


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
