"""The KL penalty, entropy, value and NLL losses of policyopt.losses against NumPy loops,
hand-worked cases and verl's formulas."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt import losses
from tests.test_losses import SHAPE, make_inputs, make_mask

# ----------------------------------------------------------------------------------------
# KL, entropy, value and NLL losses.
# ----------------------------------------------------------------------------------------


def test_kl_penalty_estimators():
    log_probs, ref_log_probs, _, mask = make_inputs(4)
    every_estimator = jax.jit(
        lambda *args: {
            estimator: losses.kl_penalty(*args, estimator=estimator)
            for estimator in losses.KL_ESTIMATORS
        }
    )
    results = every_estimator(log_probs, ref_log_probs, mask)
    for estimator in losses.KL_ESTIMATORS:
        got = np.asarray(results[estimator])
        for i in range(mask.shape[0]):
            for t in range(mask.shape[1]):
                delta = float(ref_log_probs[i, t]) - float(log_probs[i, t])
                expected = (
                    {"k1": -delta, "k2": delta * delta / 2, "k3": math.exp(delta) - delta - 1}[
                        estimator
                    ]
                    if mask[i, t]
                    else 0.0
                )
                np.testing.assert_allclose(got[i, t], expected, rtol=1e-5, atol=1e-7)
    # Hand-worked: delta = log 2.
    delta = math.log(2.0)
    one = np.ones(SHAPE, np.float32)
    results = every_estimator(0 * one, delta * one, one)
    for estimator, value in (("k1", -delta), ("k2", delta**2 / 2), ("k3", 1 - delta)):
        np.testing.assert_allclose(results[estimator], value + 0 * one, rtol=1e-6)
    # In the loss: GRPO's beta * k3, aggregated like the policy term.
    loss_kl, metrics_kl = jax.jit(functools.partial(losses.policy_loss, kl_coef=0.04))(
        log_probs, log_probs, np.zeros_like(mask), mask, ref_log_probs=ref_log_probs
    )
    k3 = losses.kl_penalty(log_probs, ref_log_probs, mask)
    np.testing.assert_allclose(loss_kl, 0.04 * np.sum(k3) / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(metrics_kl["kl_ref"], np.sum(k3) / mask.sum(), rtol=1e-5)


def verl_low_var_kl(log_probs, ref_log_probs):
    """verl's k3 (``core_algos.kl_penalty_forward``, "low_var_kl"), in NumPy float64."""
    delta = np.clip(np.float64(ref_log_probs) - np.float64(log_probs), -20, 20)
    return np.clip(np.exp(delta) - delta - 1, -10, 10)


def test_kl_clamp_is_verls_k3():
    # delta = log pi_ref - log pi_theta per token; the last position is padding.
    deltas = np.array([[-0.5, 1.0, 3.0, -15.0, 25.0, -30.0, 100.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], np.float32)
    log_probs = np.full_like(deltas, -2.0)
    ref_log_probs = log_probs + deltas

    def total(log_probs, clamp):
        return jnp.sum(losses.kl_penalty(log_probs, ref_log_probs, mask, clamp=clamp))

    values = {
        clamp: np.asarray(
            jax.jit(losses.kl_penalty, static_argnames="clamp")(
                log_probs, ref_log_probs, mask, clamp=clamp
            )
        )
        for clamp in (False, True)
    }
    grads = {clamp: np.asarray(jax.grad(total)(log_probs, clamp)) for clamp in (False, True)}
    # Hand-worked, k3 = e^d - d - 1 and d k3 / d log pi_theta = 1 - e^d:
    #   d = -0.5: 0.60653 - 0.5 = 0.10653 (grad 0.39347);  d = 1: e - 2 = 0.71828 (grad 1 - e);
    #   d = 3: e^3 - 4 = 16.0855 > 10;  d = -15: 14.0000003 > 10;  d = 25: 7.2e10;
    #   d = -30: 29;  d = 100: e^100 overflows float32 (inf).
    # Clamped (verl): every k3 above 10 is 10 with gradient 0; d is clipped to +-20 first,
    # so d = 100 gives 10 and a zero gradient instead of inf and NaN.
    expected = [0.10653066, 0.71828183, 10.0, 10.0, 10.0, 10.0, 10.0, 0.0]
    np.testing.assert_allclose(values[True][0], expected, rtol=1e-6)
    verl = verl_low_var_kl(log_probs, ref_log_probs)
    np.testing.assert_allclose(values[True][0, :7], verl[0, :7], rtol=1e-6)
    np.testing.assert_allclose(grads[True][0], [0.39346934, 1 - math.e] + [0] * 6, rtol=1e-6)
    # Unclamped: the paper's k3 everywhere (GRPO eq. 4).
    np.testing.assert_allclose(
        values[False][0, :6],
        [0.10653066, 0.71828183, math.exp(3) - 4, math.exp(-15) + 14, math.exp(25) - 26, 29.0],
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        grads[False][0, :4], [0.39346934, 1 - math.e, 1 - math.exp(3), 1 - math.exp(-15)], rtol=1e-5
    )
    assert values[False][0, 6] == np.inf and not np.isfinite(grads[False][0, 6])
    # Where k3 <= 10 the clamp changes nothing: random inputs of test_kl_penalty_estimators.
    log_probs, ref_log_probs, _, mask = make_inputs(4)
    unclamped = np.asarray(losses.kl_penalty(log_probs, ref_log_probs, mask))
    clamped = np.asarray(losses.kl_penalty(log_probs, ref_log_probs, mask, clamp=True))
    np.testing.assert_allclose(clamped, np.where(mask > 0, np.minimum(unclamped, 10), 0), rtol=1e-6)
    verl = np.where(mask > 0, verl_low_var_kl(log_probs, ref_log_probs), 0)
    np.testing.assert_allclose(clamped, verl, rtol=1e-5, atol=1e-7)


def test_kl_clamp_in_the_policy_loss():
    deltas = np.array([[0.5, 3.0, -15.0, 0.0], [1.0, -0.2, 0.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    log_probs = np.full_like(deltas, -1.0)
    zeros = np.zeros_like(deltas)
    loss_fn = jax.jit(
        functools.partial(losses.policy_loss, kl_coef=0.04, aggregation="token_mean"),
        static_argnames="kl_clamp",
    )
    loss, metrics = loss_fn(
        log_probs, log_probs, zeros, mask, ref_log_probs=log_probs + deltas, kl_clamp=True
    )
    # Advantages 0: the loss is beta * token mean of the clamped k3 over the 5 valid tokens.
    k3 = [math.exp(0.5) - 1.5, 10.0, 10.0, math.e - 2, math.exp(-0.2) - 0.8]
    np.testing.assert_allclose(metrics["kl_ref"], sum(k3) / 5, rtol=1e-6)
    np.testing.assert_allclose(loss, 0.04 * sum(k3) / 5, rtol=1e-6)
    with pytest.raises(ValueError, match="kl_clamp=True is defined for kl_estimator='k3' only"):
        losses.policy_loss(
            log_probs,
            log_probs,
            zeros,
            mask,
            ref_log_probs=log_probs,
            kl_coef=0.04,
            kl_estimator="k2",
            kl_clamp=True,
        )
    with pytest.raises(ValueError, match="estimator 'k3' only"):
        losses.kl_penalty(log_probs, log_probs, mask, estimator="k1", clamp=True)


def test_entropy_from_logits():
    logits = np.random.default_rng(0).normal(size=(3, 4, 11)).astype(np.float32) * 3
    entropy = jax.jit(losses.entropy_from_logits)
    got = np.asarray(entropy(logits))
    for index in np.ndindex(3, 4):
        p = np.exp(logits[index] - logits[index].max())
        p /= p.sum()
        np.testing.assert_allclose(got[index], -sum(q * math.log(q) for q in p), rtol=1e-5)
    extremes = np.zeros((3, 4, 11), np.float32)
    extremes[0, 0, :3] = [0.0, -1e30, 1e4]
    extremes[0, 1, :10] = -np.inf  # a masked vocabulary: one token left
    extremes[0, 2, :9] = -np.inf  # two tokens left, equally likely
    got = np.asarray(entropy(extremes))
    np.testing.assert_allclose(got[1:], math.log(11), rtol=1e-6)  # uniform: log V
    assert np.all(np.isfinite(got)) and got[0, 0] < 1e-6 and got[0, 1] == 0
    np.testing.assert_allclose(got[0, 2], math.log(2), rtol=1e-6)


def test_value_loss():
    rng = np.random.default_rng(1)
    mask = make_mask(rng, 5, 6, "arbitrary")
    values, old_values, returns = (rng.normal(size=(5, 6)).astype(np.float32) for _ in range(3))
    fn = jax.jit(
        jax.value_and_grad(
            lambda v: losses.value_loss(v, old_values, returns, mask, clip=0.2), has_aux=True
        )
    )
    (loss, metrics), grad = fn(values)
    total, terms, clipped_count = 0.0, np.zeros((5, 6)), 0
    n = mask.sum()
    for i, t in zip(*np.nonzero(mask)):
        v, vo, r = float(values[i, t]), float(old_values[i, t]), float(returns[i, t])
        vc = vo + min(max(v - vo, -0.2), 0.2)
        unclipped, clipped = (v - r) ** 2, (vc - r) ** 2
        total += 0.5 * max(unclipped, clipped) / n
        clipped_count += clipped > unclipped
        terms[i, t] = (v - r) / n if unclipped >= clipped else (vc - r) / n * (abs(v - vo) < 0.2)
    np.testing.assert_allclose(loss, total, rtol=1e-5)
    np.testing.assert_allclose(grad, terms, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(metrics["value_clip_frac"], clipped_count / n, rtol=1e-6)
    residual = (returns - values)[mask > 0]
    np.testing.assert_allclose(
        metrics["explained_variance"], 1 - residual.var() / returns[mask > 0].var(), rtol=1e-4
    )
    # Constant returns: 1 only when the values equal them, else 0 (not NaN, not 1).
    constant = np.full((2, 3), 0.5, np.float32)
    full = np.ones((2, 3), np.float32)
    ev = jax.jit(lambda v: losses.value_loss(v, v, constant, full)[1]["explained_variance"])
    assert float(ev(constant)) == 1.0
    assert float(ev(constant + np.arange(6, dtype=np.float32).reshape(2, 3))) == 0.0
    # Returns that are one reward up to float32 rounding ((R - V) + V, as GAE with lambda 1
    # computes them) count as constant: 0 for other values (it was -1e13), 1 for equal ones.
    values = np.array([[0.1, 3.7, 123.456], [7.77, 0.013, 1e4 / 3]], np.float32)
    rounded = (np.float32(-1.0) - values) + values
    assert rounded.var() > 0  # the rounding this is about (~5e-14)
    ev_r = jax.jit(lambda v, r: losses.value_loss(v, v, r, full)[1]["explained_variance"])
    assert float(ev_r(values, rounded)) == 0.0
    assert float(ev_r(np.full((2, 3), -1.0, np.float32), rounded)) == 1.0
    # Hand-worked: V = 1.5, V_old = 1, R = 2: clipped V = 1.2, 0.5 * max(0.25, 0.64) = 0.32.
    both = jax.jit(
        lambda *args: (
            losses.value_loss(*args, clip=0.2)[0],
            losses.value_loss(*args, clip=None)[0],
        )
    )
    one = np.ones((1, 1), np.float32)
    clipped, unclipped = both(1.5 * one, one, 2 * one, one)
    np.testing.assert_allclose(clipped, 0.32, rtol=1e-6)
    np.testing.assert_allclose(unclipped, 0.125, rtol=1e-6)


def test_nll_loss_over_correct_samples():
    log_probs, _, _, mask = make_inputs(9, batch=6, kind="end")
    correct = np.array([True, False, True, True, False, True])
    nll = jax.jit(losses.nll_loss)
    got = nll(log_probs, mask, correct)
    total, count = 0.0, 0
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if correct[i] and mask[i, t]:
                total += float(log_probs[i, t])
                count += 1
    np.testing.assert_allclose(got, -total / count, rtol=1e-6)
    # Hand-worked: two selected sequences of lengths 1 and 2, log-probs -1, -2, -3 -> 2.
    hand_log_probs = np.full((6, 7), -9.0, np.float32)
    hand_log_probs[:2, :2] = [[-1.0, 5.0], [-2.0, -3.0]]
    hand_mask = np.zeros((6, 7), np.float32)
    hand_mask[:3, :2] = [[1, 0], [1, 1], [1, 1]]
    np.testing.assert_allclose(nll(hand_log_probs, hand_mask, np.arange(6) < 2), 2.0)
    assert nll(log_probs, mask, np.zeros(6, bool)) == 0.0
