"""Off-policy correction in policyopt.losses (truncated importance weights, rejection masks and
their metrics) against NumPy loops and hand-worked cases."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt import losses
from tests.test_losses import SHAPE, make_inputs


def test_truncated_importance_weights():
    _, old_log_probs, _, mask = make_inputs(7)
    behaviour = old_log_probs + np.random.default_rng(3).normal(size=SHAPE).astype(np.float32)
    weights = np.asarray(
        losses.truncated_importance_weights(old_log_probs, behaviour, mask, cap=2.0)
    )
    for i, t in np.ndindex(*SHAPE):
        expected = min(math.exp(float(old_log_probs[i, t]) - float(behaviour[i, t])), 2.0)
        np.testing.assert_allclose(weights[i, t], expected if mask[i, t] else 0.0, rtol=1e-6)
    grad = jax.grad(lambda x: jnp.sum(losses.truncated_importance_weights(x, behaviour, mask)))(
        old_log_probs
    )
    assert np.all(np.asarray(grad) == 0)  # stop-gradient


def _rollout_inputs(seed):
    """pi_old and behaviour log-probs (a few rows far apart) with the mixed masks."""
    _, old_log_probs, _, mask = make_inputs(seed)
    rng = np.random.default_rng(seed + 100)
    spread = np.where(np.arange(SHAPE[0])[:, None] % 3 == 0, 0.6, 0.05)
    behaviour = (old_log_probs + spread * rng.normal(size=SHAPE)).astype(np.float32)
    return old_log_probs, behaviour, mask


def _numpy_log_rhos(old_log_probs, behaviour, mask, i):
    return [
        float(old_log_probs[i, t]) - float(behaviour[i, t]) for t in range(SHAPE[1]) if mask[i, t]
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_importance_weights_against_a_loop(seed):
    old_log_probs, behaviour, mask = _rollout_inputs(seed)
    weights = np.asarray(
        losses.truncated_importance_weights(
            old_log_probs, behaviour, mask, cap=1.5, level="sequence"
        )
    )
    capped = 0
    for i in range(SHAPE[0]):
        product = math.exp(sum(_numpy_log_rhos(old_log_probs, behaviour, mask, i)))
        capped += product > 1.5
        for t in range(SHAPE[1]):
            np.testing.assert_allclose(
                weights[i, t], min(product, 1.5) if mask[i, t] else 0.0, rtol=1e-5
            )
    assert 0 < capped < SHAPE[0]  # both branches


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "level,upper,lower",
    [
        ("token", 1.1, None),
        ("token", 1.3, 0.95),
        ("sequence", 1.5, None),
        ("geometric", 1.02, None),
        ("geometric", 1.05, 0.99),
    ],
)
def test_rejection_mask_against_a_loop(seed, level, upper, lower):
    old_log_probs, behaviour, mask = _rollout_inputs(seed)
    keep = np.asarray(
        losses.rejection_mask(old_log_probs, behaviour, mask, level=level, upper=upper, lower=lower)
    )
    low = 1.0 / upper if lower is None else lower
    for i in range(SHAPE[0]):
        log_rhos = _numpy_log_rhos(old_log_probs, behaviour, mask, i)
        if level == "sequence":
            seq_ok = low <= math.exp(sum(log_rhos)) <= upper
        elif level == "geometric":
            seq_ok = low <= math.exp(sum(log_rhos) / max(len(log_rhos), 1)) <= upper
        for t in range(SHAPE[1]):
            if not mask[i, t]:
                expected = 0.0
            elif level == "token":
                expected = float(
                    low <= math.exp(float(old_log_probs[i, t]) - float(behaviour[i, t])) <= upper
                )
            else:
                expected = float(seq_ok)
            assert keep[i, t] == expected, (i, t)
    assert 0 < keep.sum() < mask.sum()  # some kept, some rejected


@pytest.mark.parametrize("level", [None, "token", "geometric"])
def test_veto_rejects_every_sequence_with_one_unlikely_token(level):
    old_log_probs, behaviour, mask = _rollout_inputs(4)
    keep = np.asarray(
        losses.rejection_mask(
            old_log_probs,
            behaviour,
            mask,
            level=level,
            upper=None if level is None else 1.1,
            veto=0.7,
        )
    )
    plain = (
        np.asarray(mask) > 0
        if level is None
        else np.asarray(
            losses.rejection_mask(old_log_probs, behaviour, mask, level=level, upper=1.1)
        )
        > 0
    )
    vetoed = 0
    for i in range(SHAPE[0]):
        veto = any(math.exp(x) < 0.7 for x in _numpy_log_rhos(old_log_probs, behaviour, mask, i))
        vetoed += veto
        np.testing.assert_array_equal(keep[i], 0.0 if veto else plain[i].astype(np.float32))
    assert 0 < vetoed < SHAPE[0] - 1


def test_rollout_correction_by_hand():
    # One sequence of two tokens with rho = 2 and 2 (product 4, geometric mean 2), one with
    # rho = 0.5 then padding, one fully masked.
    old = np.log(np.array([[2.0, 2.0], [0.5, 9.0], [3.0, 3.0]], np.float32))
    behaviour = np.zeros((3, 2), np.float32)
    mask = np.array([[1, 1], [1, 0], [0, 0]], np.float32)
    np.testing.assert_allclose(
        losses.truncated_importance_weights(old, behaviour, mask, cap=3.0),
        [[2, 2], [0.5, 0], [0, 0]],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        losses.truncated_importance_weights(old, behaviour, mask, cap=3.0, level="sequence"),
        [[3, 3], [0.5, 0], [0, 0]],
        rtol=1e-6,
    )
    rs = lambda **kw: np.asarray(losses.rejection_mask(old, behaviour, mask, **kw)).tolist()
    assert rs(level="token", upper=2.5) == [[1, 1], [1, 0], [0, 0]]  # 0.5 >= 1 / 2.5
    assert rs(level="token", upper=1.9) == [[0, 0], [0, 0], [0, 0]]  # 2 > 1.9, 0.5 < 1 / 1.9
    assert rs(level="token", upper=1.9, lower=0.45) == [[0, 0], [1, 0], [0, 0]]
    assert rs(level="sequence", upper=3.0) == [[0, 0], [1, 0], [0, 0]]  # 4 > 3
    assert rs(level="sequence", upper=3.0, lower=0.6) == [[0, 0], [0, 0], [0, 0]]
    assert rs(level="sequence", upper=4.5) == [[1, 1], [1, 0], [0, 0]]
    assert rs(level="geometric", upper=2.5) == [[1, 1], [1, 0], [0, 0]]  # geometric means 2, 0.5
    assert rs(level="geometric", upper=2.5, lower=0.6) == [[1, 1], [0, 0], [0, 0]]
    assert rs(veto=0.6) == [[1, 1], [0, 0], [0, 0]]
    metrics = {k: float(v) for k, v in losses.offpolicy_metrics(old, behaviour, mask).items()}
    log2 = math.log(2.0)
    np.testing.assert_allclose(metrics["kl_k1"], (-log2 - log2 + log2) / 3, rtol=1e-6)
    np.testing.assert_allclose(
        metrics["kl_k3"], (2 * (2 - 1 - log2) + (0.5 - 1 + log2)) / 3, rtol=1e-6
    )
    np.testing.assert_allclose(metrics["ppl_ratio"], (0.5 + 2.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["chi2_token"], (3 + 3 - 0.75) / 3, rtol=1e-6)
    np.testing.assert_allclose(metrics["chi2_seq"], (15 - 0.75) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["log_ratio_abs_max"], log2, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 3])
def test_offpolicy_metrics_against_a_loop(seed):
    old_log_probs, behaviour, mask = _rollout_inputs(seed)
    behaviour = np.where(mask > 0, behaviour, np.nan)  # padding never matters
    metrics = {
        k: float(v) for k, v in losses.offpolicy_metrics(old_log_probs, behaviour, mask).items()
    }
    tokens, sequences = [], []
    for i in range(SHAPE[0]):
        log_rhos = _numpy_log_rhos(old_log_probs, behaviour, mask, i)
        tokens += log_rhos
        if log_rhos:
            sequences.append(log_rhos)
    np.testing.assert_allclose(
        metrics["kl_k1"], np.mean([-x for x in tokens]), rtol=1e-4, atol=1e-7
    )
    np.testing.assert_allclose(
        metrics["kl_k3"], np.mean([math.exp(x) - 1 - x for x in tokens]), rtol=1e-4
    )
    np.testing.assert_allclose(
        metrics["chi2_token"], np.mean([math.exp(2 * x) - 1 for x in tokens]), rtol=1e-4
    )
    np.testing.assert_allclose(
        metrics["ppl_ratio"], np.mean([math.exp(-np.mean(s)) for s in sequences]), rtol=1e-5
    )
    np.testing.assert_allclose(
        metrics["chi2_seq"], np.mean([math.exp(2 * sum(s)) - 1 for s in sequences]), rtol=1e-4
    )
    np.testing.assert_allclose(metrics["log_ratio_abs_max"], max(abs(x) for x in tokens), rtol=1e-6)
    same = losses.offpolicy_metrics(old_log_probs, old_log_probs, mask)
    assert {k: float(v) for k, v in same.items()} == {
        "kl_k1": 0.0,
        "kl_k3": 0.0,
        "ppl_ratio": 1.0,
        "chi2_token": 0.0,
        "chi2_seq": 0.0,
        "log_ratio_abs_max": 0.0,
    }


def test_offpolicy_metrics_stay_finite_for_far_off_tokens():
    """Log-ratios are clamped to +-20 in the metrics (verl's convention): one token 50 nats
    apart, or a sequence 100 nats apart, gives large finite values, not inf."""
    old = np.zeros((2, 3), np.float32)
    behaviour = np.array([[-50.0, 0.0, 0.0], [100.0, 100.0, 100.0]], np.float32)
    metrics = {
        k: float(v) for k, v in losses.offpolicy_metrics(old, behaviour, np.ones((2, 3))).items()
    }
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    np.testing.assert_allclose(
        metrics["chi2_token"], (math.exp(40) - 1 + 2 * 0 + 3 * (math.exp(-40) - 1)) / 6, rtol=1e-4
    )
    np.testing.assert_allclose(
        metrics["ppl_ratio"], (math.exp(-50 / 3) + math.exp(20)) / 2, rtol=1e-4
    )
    np.testing.assert_allclose(metrics["kl_k1"], (-50 + 300) / 6, rtol=1e-6)  # not clamped
    assert metrics["log_ratio_abs_max"] == 100.0


def test_rollout_correction_arguments_are_checked():
    old_log_probs, behaviour, mask = _rollout_inputs(0)
    with pytest.raises(ValueError, match="level='tok'"):
        losses.truncated_importance_weights(old_log_probs, behaviour, mask, level="tok")
    with pytest.raises(ValueError, match="cap must be > 0"):
        losses.truncated_importance_weights(old_log_probs, behaviour, mask, cap=0.0)
    with pytest.raises(ValueError, match="level='geo'"):
        losses.rejection_mask(old_log_probs, behaviour, mask, level="geo", upper=2.0)
    with pytest.raises(ValueError, match="needs upper > 0"):
        losses.rejection_mask(old_log_probs, behaviour, mask, level="token")
    with pytest.raises(ValueError, match="0 < lower <= upper"):
        losses.rejection_mask(old_log_probs, behaviour, mask, level="token", upper=2.0, lower=3.0)
    with pytest.raises(ValueError, match="veto must be > 0"):
        losses.rejection_mask(old_log_probs, behaviour, mask, veto=0.0)
