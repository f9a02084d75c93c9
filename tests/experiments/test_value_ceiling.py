"""The explained-variance ceiling (`experiments/value_ceiling.py`): a hand-worked case,
a simulation whose ceiling is known in closed form, and a tiny end-to-end run."""

import numpy as np
import pytest

from experiments.value_ceiling import ceiling, measure
from tests.rl.test_trainer import tiny


def test_ceiling_hand_worked():
    # Responses of 2 and 6 tokens, rewards +1 / -1: token mean (2 - 6) / 8 = -0.5, token
    # variance (2 x 1.5^2 + 6 x 0.5^2) / 8 = 0.75. One prefix each: completions (+1, -1)
    # (sample variance 2) and (-1, -1) (0): noise (2 x 2 + 6 x 0) / 8 = 0.5.
    result = ceiling([2, 6], [1.0, -1.0], np.array([[1], [3]]), [[[1, -1]], [[-1, -1]]])
    assert result["return_variance"] == pytest.approx(0.75)
    assert result["noise"] == pytest.approx(0.5)
    assert result["explained_variance_ceiling"] == pytest.approx(1 / 3)
    # Position 1 of 2 is at depth 0.5, position 3 of 6 too.
    assert result["noise_by_depth"] == {"0.5-0.75": pytest.approx(0.5)}
    low, high = result["explained_variance_ceiling_95"]
    assert low <= high


def test_ceiling_matches_the_closed_form_on_a_simulated_task():
    # Response i succeeds with probability p_i (known to the state from the first token):
    # Var(R | s) = 4 p (1 - p) for rewards +-1, so the ceiling is
    # 1 - E_t[4 p (1 - p)] / Var_t(R) with the token weights |y_i|.
    rng = np.random.default_rng(0)
    n, k, m = 4000, 3, 8
    p = rng.uniform(0.05, 0.95, n)
    lengths = rng.integers(5, 200, n)
    rewards = np.where(rng.random(n) < p, 1.0, -1.0)
    positions = np.stack([rng.integers(0, length, k) for length in lengths])
    outcomes = np.where(rng.random((n, k, m)) < p[:, None, None], 1.0, -1.0)
    result = ceiling(lengths, rewards, positions, outcomes, bootstrap=200)
    w = lengths / lengths.sum()
    mean = np.sum(w * (2 * p - 1))
    want = 1 - np.sum(w * 4 * p * (1 - p)) / (
        np.sum(w * (4 * p * (1 - p) + (2 * p - 1) ** 2)) - mean**2
    )
    assert result["explained_variance_ceiling"] == pytest.approx(want, abs=0.03)
    low, high = result["explained_variance_ceiling_95"]
    assert low - 0.02 < want < high + 0.02


def test_ceiling_refuses_bad_shapes():
    with pytest.raises(ValueError, match="M >= 2"):
        ceiling([3], [1.0], np.array([[0]]), [[[1.0]]])
    with pytest.raises(ValueError, match="positions in"):
        ceiling([3], [1.0], np.array([[3]]), [[[1.0, 1.0]]])


def test_measure_runs_end_to_end():
    config = tiny("vc_ppo", "tiny_dense")
    result = measure(config, num_prompts=4, samples=2, positions=2, continuations=2, batch_size=4)
    assert result["responses"] == 8 and result["positions"] == 2
    assert 8 <= result["tokens"] <= 8 * config.sampling.max_new_tokens
    assert result["explained_variance_ceiling"] <= 1.0
    assert 0.0 <= result["accuracy"] <= 1.0


def test_measure_counts_correct_responses_at_the_runs_reward():
    """The batch accuracy counts the verifier's correct responses, whatever the reward
    (+1 in VC-PPO's plain reward, not the format gate's 0.9): with a verifier that accepts
    everything it is 1 and the returns are constant (ceiling 1 by convention)."""
    config = tiny("vc_ppo", "tiny_dense", "reward.verifier=tests.verifiers:always_correct")
    result = measure(config, num_prompts=2, samples=2, positions=1, continuations=2, batch_size=4)
    assert result["accuracy"] == 1.0
    assert result["return_variance"] == 0.0 and result["explained_variance_ceiling"] == 1.0
