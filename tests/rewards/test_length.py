"""DAPO's overlong penalty (policyopt.rewards.length) by hand and against a case-by-case
reference."""

import numpy as np
import pytest

from policyopt.rewards import overlong_penalties, overlong_penalty


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
