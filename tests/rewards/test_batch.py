"""Batch scoring (policyopt.rewards.scoring): the reward spec, Magistral's and DAPO's rewards by
hand, serial equals parallel, custom verifiers, deadlines and workers that die."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from policyopt.rewards import RewardSpec, score_batch, start_workers
from tests.rewards.test_language import (
    ENGLISH_ANSWER,
    ENGLISH_PROBLEM,
    ENGLISH_REASONING,
    FRENCH_REASONING,
)

# warm_verifier: test_math's autouse fixture, SymPy warmed before anything is timed here too.
from tests.rewards.test_math import boxed, warm_verifier  # noqa: F401


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
    # The workers that took a chunk are new; one that took none (the other thread may run
    # every chunk) is replaced at its next call: its old pid, dead, may still be listed.
    now = set(batch_lib._POOLS[("default", 2)].pids)
    assert now - set(pids) and wait_gone(now & set(pids), timeout_s=0.0)
