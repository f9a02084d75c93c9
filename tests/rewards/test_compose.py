"""The reward arithmetic (``compose_rewards``) on hand-worked cases and against a per-sample
loop written from the formula; no verifier runs here."""

import numpy as np
import pytest

from policyopt.rewards import (
    ComposedRewards,
    RewardSpec,
    Verdicts,
    compose_rewards,
    overlong_penalty,
)

MAGISTRAL = RewardSpec(
    format_reward=True,
    format_value=0.1,
    correct_value=0.9,
    overlong="magistral",
    max_len=100,
    cache_len=20,
    language_bonus=0.1,
)
DAPO = RewardSpec(
    format_reward=False,
    plain_correct_value=1.0,
    incorrect_value=-1.0,
    overlong="dapo",
    max_len=100,
    cache_len=20,
    overlong_filter=True,
)


def verdicts(correctness, format_ok, language_ok, scored):
    return Verdicts(
        np.asarray(correctness, np.float32),
        np.asarray(format_ok, bool),
        np.asarray(language_ok, bool),
        np.asarray(scored, bool),
    )


def test_magistral_by_hand():
    """Format gate on; L_max 100, L_cache 20 (ramp from 80), scale 0.1; bonus 0.1."""
    out = compose_rewards(
        verdicts(
            correctness=[1.0, 0.0, 0.0, 1.0, 0.0],
            format_ok=[True, False, True, True, False],
            language_ok=[True, True, False, True, True],
            scored=[True, True, True, True, False],
        ),
        lengths=[50, 90, 90, 120, 10],
        spec=MAGISTRAL,
    )
    assert isinstance(out, ComposedRewards)
    expected = [
        0.1 + 0.9 + 0.0 + 0.1,  # right, short, languages agree: 1.1
        0.0,  # format fails: 0, no penalty, no bonus
        0.1 + 0.1 * (80 - 90) / 20,  # wrong, 10 tokens into the ramp: 0.1 - 0.05 = 0.05
        0.1 + 0.9 - 0.1 + 0.1,  # right, past L_max: full penalty -0.1; 1.0
        0.0,  # no verdict: a failed sample's reward
    ]
    np.testing.assert_allclose(out.rewards, expected, atol=1e-6)
    assert out.rewards.dtype == np.float32
    np.testing.assert_allclose(out.length_penalty, [0.0, 0.0, -0.05, -0.1, 0.0], atol=1e-7)
    np.testing.assert_array_equal(out.correct, [True, False, False, True, False])
    np.testing.assert_array_equal(out.truncated, [False, False, False, True, False])
    np.testing.assert_array_equal(out.sample_mask, [1, 1, 1, 1, 0])  # no overlong filter


def test_dapo_by_hand():
    """Format gate off, +1 / -1, scale 1, overlong filtering on."""
    out = compose_rewards(
        verdicts(
            correctness=[1.0, 0.0, 1.0, 0.5, 1.0],
            format_ok=[False, True, True, False, True],  # ignored without the gate
            language_ok=[True] * 5,  # no bonus: language_bonus 0
            scored=[True, True, True, True, False],
        ),
        lengths=[10, 85, 100, 0, 200],
        spec=DAPO,
    )
    expected = [
        1.0,  # right, short
        -1.0 + (80 - 85) / 20,  # wrong, 5 tokens into the ramp: -1.25
        1.0 + (80 - 100) / 20,  # right, exactly L_max: 1 - 1 = 0
        -1.0 + 2.0 * 0.5,  # half the tests pass: 0
        -1.0,  # no verdict: incorrect_value, no penalty
    ]
    np.testing.assert_allclose(out.rewards, expected, atol=1e-6)
    np.testing.assert_array_equal(out.correct, [True, False, True, False, False])
    # truncated = length >= L_max; overlong filtering drops it, as it drops no verdict
    np.testing.assert_array_equal(out.truncated, [False, False, True, False, True])
    np.testing.assert_array_equal(out.sample_mask, [1, 1, 0, 1, 0])
    # the sampler's own flag replaces length >= L_max
    flagged = compose_rewards(
        verdicts([1.0, 0.0], [True] * 2, [False] * 2, [True] * 2),
        [100, 30],
        DAPO,
        truncated=[False, True],
    )
    np.testing.assert_array_equal(flagged.sample_mask, [1, 0])
    np.testing.assert_allclose(flagged.rewards, [0.0, -1.0], atol=1e-6)


def test_no_shaping_and_no_max_len():
    """Overlong "none" and no L_max: no penalty, nothing truncated, nothing masked."""
    spec = RewardSpec(format_reward=False, incorrect_value=0.0)
    out = compose_rewards(
        verdicts([1.0, 0.0, 0.25], [True] * 3, [True] * 3, [True] * 3), [10**6, 5, 7], spec
    )
    np.testing.assert_allclose(out.rewards, [1.0, 0.0, 0.25])
    np.testing.assert_array_equal(out.length_penalty, [0, 0, 0])
    np.testing.assert_array_equal(out.truncated, [False] * 3)
    np.testing.assert_array_equal(out.sample_mask, [1, 1, 1])
    empty = compose_rewards(verdicts([], [], [], []), [], MAGISTRAL)
    assert all(field.shape == (0,) for field in empty)


def reference_reward(c, format_ok, language_ok, scored, length, spec):
    """One sample's reward, written from the module docstring of policyopt.rewards.compose."""
    graded = scored and (format_ok or not spec.format_reward)
    if not graded:
        return 0.0 if spec.format_reward else spec.incorrect_value
    if spec.format_reward:
        reward = spec.format_value + spec.correct_value * c
    else:
        reward = spec.incorrect_value + (spec.plain_correct_value - spec.incorrect_value) * c
    if spec.overlong != "none":
        reward += overlong_penalty(length, spec.max_len, spec.cache_len, scale=spec.penalty_scale)
    return reward + (spec.language_bonus if language_ok else 0.0)


@pytest.mark.parametrize("spec", [MAGISTRAL, DAPO], ids=["magistral", "dapo"])
def test_matches_a_per_sample_loop(spec):
    rng = np.random.default_rng(0)
    n = 64
    case = verdicts(
        rng.choice([0.0, 0.25, 1.0], n),
        rng.random(n) < 0.7,
        rng.random(n) < 0.5,
        rng.random(n) < 0.9,
    )
    lengths = rng.integers(0, 130, n)
    out = compose_rewards(case, lengths, spec)
    expected = [
        reference_reward(float(c), bool(f), bool(lang), bool(s), int(length), spec)
        for c, f, lang, s, length in zip(*case, lengths)
    ]
    np.testing.assert_allclose(out.rewards, expected, atol=1e-6)
    np.testing.assert_array_equal(
        out.correct, [s and (f or not spec.format_reward) and c >= 1.0 for c, f, _, s in zip(*case)]
    )


def test_mismatched_sizes_name_the_argument():
    case = verdicts([1.0, 0.0], [True, True], [True, True], [True, True])
    with pytest.raises(ValueError, match="lengths has 3 entries, verdicts.correctness has 2"):
        compose_rewards(case, [1, 2, 3], MAGISTRAL)
    with pytest.raises(ValueError, match="scored has 1 entries"):
        compose_rewards(case._replace(scored=np.ones(1, bool)), [1, 2], MAGISTRAL)
