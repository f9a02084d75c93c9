"""A trained critic's squared error by depth (`experiments/critic_error.py`): a hand-worked
case and a tiny run measured without writing to it."""

import os

import numpy as np
import pytest

from experiments.critic_error import depth_errors, measure
from policyopt.rl.loop import trainer
from tests.rl.test_critic import _tiny_vapo
from tests.rl.test_trainer import tiny


def test_depth_errors_hand_worked():
    # Row 0: 4 tokens, V = 0, R = 1 (error 1 at depths 0, 1/4, 1/2, 3/4). Row 1: 2 tokens
    # of 4 columns, V = (0.5, 1), R = -1 (errors 2.25 at depth 0, 4 at depth 1/2).
    values = [[0, 0, 0, 0], [0.5, 1, 0, 0]]
    returns = [[1, 1, 1, 1], [-1, -1, 0, 0]]
    mask = [[1, 1, 1, 1], [1, 1, 0, 0]]
    result = depth_errors(values, returns, mask)
    assert result["tokens"] == 6
    assert result["error_by_depth"] == {
        "0-0.25": pytest.approx((1 + 2.25) / 2),
        "0.25-0.5": pytest.approx(1.0),
        "0.5-0.75": pytest.approx((1 + 4) / 2),
        "0.75-1": pytest.approx(1.0),
    }
    r = np.array([1, 1, 1, 1, -1, -1.0])
    v = np.array([0, 0, 0, 0, 0.5, 1.0])
    assert result["return_variance"] == pytest.approx(8 / 9)
    assert result["explained_variance"] == pytest.approx(1 - np.var(r - v) / np.var(r))


def test_a_run_is_measured_in_a_copy(tmp_path):
    """A finished tiny VC-PPO-style run: two fresh rollouts' held-out values, every depth
    bin filled; the run's own checkpoints untouched. A run without a critic is refused."""
    run_dir = str(tmp_path / "run")
    trainer.run_rl(_tiny_vapo(), run_dir, quiet=True)
    steps = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    result = measure(run_dir, rollouts=2)
    assert result["rollouts"] == 2 and result["tokens"] > 0
    assert set(result["error_by_depth"]) == {"0-0.25", "0.25-0.5", "0.5-0.75", "0.75-1"}
    assert all(np.isfinite(v) for v in result["error_by_depth"].values())
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == steps
    grpo = tmp_path / "grpo"
    grpo.mkdir()
    (grpo / "config.json").write_text(tiny("grpo").to_json())  # as a run writes it
    with pytest.raises(ValueError, match="trains no critic"):
        measure(str(grpo))
    with pytest.raises(FileNotFoundError, match="holds no run"):
        measure(str(tmp_path))
