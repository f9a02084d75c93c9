"""Magistral's minibatch advantage normalisation and the routing-replay config guard."""

import numpy as np
import pytest

from configs import magistral
from policyopt.rl.update.methods import minibatch_advantages


def test_magistral_minibatch_statistics_leave_out_all_equal_groups():
    # G = 4; the last group's rewards are all equal (Magistral drops such groups).
    rewards = np.array([1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0], np.float32)
    centred = np.array([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, -0.75, 0.25])  # A = R - mean_g
    std = centred.std(ddof=1)  # over the 8 kept sequences (their mean is 0)
    expected = np.concatenate([centred / (std + 1e-6), np.zeros(4)])
    got = np.asarray(minibatch_advantages(rewards, 4))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert got[0] == pytest.approx(1.6202, abs=1e-3)  # not 2.031: the zero group is not counted
    # A minibatch made only of all-equal groups has zero advantages, not NaN.
    np.testing.assert_array_equal(np.asarray(minibatch_advantages(np.ones(8, np.float32), 4)), 0)


@pytest.mark.parametrize("replay", ["R2", "R3"])
def test_routing_replay_needs_the_trainer_old_log_prob_forward(replay):
    with pytest.raises(ValueError, match="routing_replay"):
        magistral.get_config(f"algo.routing_replay={replay},algo.old_log_probs=sampler")
    assert magistral.get_config(f"algo.routing_replay={replay}").algo.routing_replay == replay
