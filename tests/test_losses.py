"""policyopt.losses against plain NumPy loops, hand-worked cases and the papers' identities."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt import losses

METHODS = ("ppo", "gspo", "gspo_token", "sapo")
SHAPE = (12, 7)
AGGREGATIONS = losses.AGGREGATIONS
MASK_KINDS = ("end", "none", "arbitrary")


# ----------------------------------------------------------------------------------------
# Inputs.
# ----------------------------------------------------------------------------------------


def make_mask(rng, batch, length, kind):
    """[B, T] 0/1 masks of one kind; rows 0 and 1 are length 1 and fully masked."""
    if kind == "none":
        return np.ones((batch, length), np.float32)
    if kind == "end":
        lengths = rng.integers(1, length + 1, size=batch)
        mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
    else:
        mask = (rng.random((batch, length)) < 0.6).astype(np.float32)
    mask[0] = 0
    mask[0, rng.integers(length)] = 1  # a sequence of length 1
    mask[1] = 0  # a fully masked (zero-length) sequence
    return mask


def make_inputs(seed, batch=12, length=7, kind="mixed", spread=0.3):
    """Random inputs; kind "mixed" stacks masked-at-end, unmasked and arbitrary rows."""
    rng = np.random.default_rng(seed)
    if kind == "mixed":
        third = batch // 3
        mask = np.concatenate(
            [
                make_mask(rng, third, length, "end"),
                make_mask(rng, third, length, "none"),
                make_mask(rng, batch - 2 * third, length, "arbitrary"),
            ]
        )
    else:
        mask = make_mask(rng, batch, length, kind)
    old_log_probs = (-rng.random((batch, length)) * 3).astype(np.float32)
    spreads = np.full((batch, 1), spread)
    spreads[batch // 2 :: 2] = 6 * spread  # a few rows far from the old policy
    log_probs = (old_log_probs + spreads * rng.normal(size=(batch, length))).astype(np.float32)
    advantages = rng.normal(size=(batch, length)).astype(np.float32)
    advantages[2] = 0.7  # constant within a sequence, as outcome advantages are
    return log_probs, old_log_probs, advantages, mask


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------------------
# The NumPy loop reference: value and d loss / d log_probs, written from the papers
# (docs/algorithms.md).
# ----------------------------------------------------------------------------------------


def ref_aggregation_weights(mask, aggregation, group_size=None, max_len=None):
    """c[i, t] such that aggregate(x) = sum_{i,t} c[i, t] x[i, t] (aggregation is linear)."""
    batch, length = mask.shape
    weights = np.zeros((batch, length))
    lengths = [int(sum(mask[i, t] > 0 for t in range(length))) for i in range(batch)]
    nonempty = sum(1 for n in lengths if n > 0)
    total = sum(lengths)
    for i in range(batch):
        for t in range(length):
            if mask[i, t] <= 0:
                continue
            if aggregation == "token_mean":
                weights[i, t] = 1.0 / total
            elif aggregation == "seq_mean_token_mean":
                weights[i, t] = 1.0 / (lengths[i] * nonempty)
            elif aggregation == "seq_mean_token_sum":
                weights[i, t] = 1.0 / nonempty
            elif aggregation == "seq_mean_token_sum_norm":
                weights[i, t] = 1.0 / ((max_len or length) * nonempty)
            elif aggregation == "group_token_mean":
                group = i // group_size
                members = range(group * group_size, (group + 1) * group_size)
                group_tokens = sum(lengths[j] for j in members)
                groups_nonempty = sum(
                    1
                    for g in range(batch // group_size)
                    if sum(lengths[j] for j in range(g * group_size, (g + 1) * group_size)) > 0
                )
                weights[i, t] = 1.0 / (group_tokens * groups_nonempty)
    return weights


def ref_policy_loss(
    log_probs,
    old_log_probs,
    advantages,
    mask,
    *,
    method,
    clip_low=0.2,
    clip_high=0.2,
    dual_clip=None,
    tau_pos=1.0,
    tau_neg=1.05,
    aggregation="token_mean",
    group_size=None,
    max_len=None,
    importance_weights=None,
):
    """Loss, gradient and the core metrics from per-token loops over valid tokens."""
    batch, length = log_probs.shape
    weights = ref_aggregation_weights(mask, aggregation, group_size, max_len)
    objective = np.zeros((batch, length))
    grad = np.zeros((batch, length))  # d loss / d log_probs
    clipped_low = clipped_high = dual = zero_grad = 0
    gate_sum = 0.0
    for i in range(batch):
        valid = [t for t in range(length) if mask[i, t] > 0]
        if not valid:
            continue
        n = len(valid)
        seq_log_ratio = sum(float(log_probs[i, t]) - float(old_log_probs[i, t]) for t in valid) / n
        seq_ratio = math.exp(seq_log_ratio)
        seq_adv = sum(float(advantages[i, t]) for t in valid) / n
        seq_weight = sum(
            weights[i, t] * (1.0 if importance_weights is None else importance_weights[i, t])
            for t in valid
        )
        for t in valid:
            iw = 1.0 if importance_weights is None else float(importance_weights[i, t])
            a = float(advantages[i, t])
            r = math.exp(float(log_probs[i, t]) - float(old_log_probs[i, t]))
            if method in ("ppo", "gspo_token"):
                x = r if method == "ppo" else seq_ratio
                x_clipped = min(max(x, 1 - clip_low), 1 + clip_high)
                value = min(x * a, x_clipped * a)
                gate = 1.0
                if a > 0 and x > 1 + clip_high:
                    gate, clipped_high = 0.0, clipped_high + 1
                if a < 0 and x < 1 - clip_low:
                    gate, clipped_low = 0.0, clipped_low + 1
                if dual_clip is not None and a < 0 and x > dual_clip:
                    value, gate, dual = dual_clip * a, 0.0, dual + 1
                grad[i, t] = -weights[i, t] * iw * gate * x * a
            elif method == "gspo":
                x_clipped = min(max(seq_ratio, 1 - clip_low), 1 + clip_high)
                value = min(seq_ratio * seq_adv, x_clipped * seq_adv)
                gate = 1.0
                if seq_adv > 0 and seq_ratio > 1 + clip_high:
                    gate, clipped_high = 0.0, clipped_high + 1
                if seq_adv < 0 and seq_ratio < 1 - clip_low:
                    gate, clipped_low = 0.0, clipped_low + 1
                # GSPO eq. 10: s_i A_i (1/|y_i|) sum_t grad log pi, weighted by the sequence's
                # total aggregation weight.
                grad[i, t] = -seq_weight * gate * seq_ratio * seq_adv / n
                a = seq_adv
            elif method == "sapo":
                tau = tau_pos if a > 0 else tau_neg
                p = sigmoid(tau * (r - 1))
                value = p * 4 / tau * a
                gate = 4 * p * (1 - p)
                grad[i, t] = -weights[i, t] * iw * gate * r * a
            objective[i, t] = value * iw
            gate_sum += gate
            zero_grad += gate == 0 or a == 0 or iw == 0
    loss = -float(np.sum(weights * objective))
    tokens = max(int(np.sum(mask > 0)), 1)
    metrics = dict(
        clip_frac_low=clipped_low / tokens,
        clip_frac_high=clipped_high / tokens,
        clip_frac=(clipped_low + clipped_high) / tokens,
        dual_clip_frac=dual / tokens,
        gate_mean=gate_sum / tokens,
        zero_grad_frac=zero_grad / tokens,
    )
    return loss, grad, metrics


def ref_token_metrics(log_probs, old_log_probs, mask):
    ratios, kls, seq_vars, seq_ratios = [], [], [], []
    for i in range(mask.shape[0]):
        log_ratios = [
            float(log_probs[i, t]) - float(old_log_probs[i, t])
            for t in range(mask.shape[1])
            if mask[i, t] > 0
        ]
        if not log_ratios:
            continue
        mean = sum(log_ratios) / len(log_ratios)
        seq_vars.append(sum((x - mean) ** 2 for x in log_ratios) / len(log_ratios))
        seq_ratios.append(math.exp(mean))
        for x in log_ratios:
            ratios.append(math.exp(x))
            kls.append(math.exp(x) - 1 - x)
    return dict(
        ratio_mean=np.mean(ratios),
        ratio_min=min(ratios),
        ratio_max=max(ratios),
        approx_kl=np.mean(kls),
        log_ratio_seq_var=np.mean(seq_vars),
        seq_ratio_mean=np.mean(seq_ratios),
        num_tokens=len(ratios),
    )


def loss_and_grad(**options):
    """Jitted value_and_grad of policy_loss w.r.t. log_probs, for one option set."""

    def loss_fn(log_probs, old_log_probs, advantages, mask):
        return losses.policy_loss(log_probs, old_log_probs, advantages, mask, **options)

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


# Options of the per-method programs below; ppo also gets a dual clip.
PROGRAM_OPTIONS = dict(clip_low=0.2, clip_high=0.28, group_size=3, max_len=11)


@functools.lru_cache(maxsize=None)
def all_aggregations(method):
    """One jitted program per method: value_and_grad for every aggregation at once.

    Compiling is the slow part of these tests on a small CPU, so every policy_loss test
    that can runs through these four programs (at shape SHAPE).
    """
    options = dict(method=method, dual_clip=3.0 if method == "ppo" else None, **PROGRAM_OPTIONS)

    @jax.jit
    def run(log_probs, old_log_probs, advantages, mask, importance_weights):
        out = {}
        for aggregation in AGGREGATIONS:

            def loss_fn(x, aggregation=aggregation):
                return losses.policy_loss(
                    x,
                    old_log_probs,
                    advantages,
                    mask,
                    aggregation=aggregation,
                    importance_weights=importance_weights,
                    **options,
                )

            out[aggregation] = jax.value_and_grad(loss_fn, has_aux=True)(log_probs)
        return out

    return run, options


def run_all(method, log_probs, old_log_probs, advantages, mask, importance_weights=None):
    fn, options = all_aggregations(method)
    if importance_weights is None:
        importance_weights = np.ones_like(mask)
    return fn(log_probs, old_log_probs, advantages, mask, importance_weights), options


# ----------------------------------------------------------------------------------------
# policy_loss against the loop reference.
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_policy_loss_matches_loop_reference(method):
    for seed in range(2):
        inputs = make_inputs(seed)
        weights = None
        if seed == 1:  # truncated importance weights from a perturbed behaviour policy
            behaviour = inputs[1] + np.random.default_rng(seed).normal(size=SHAPE).astype(
                np.float32
            )
            weights = np.asarray(
                losses.truncated_importance_weights(inputs[1], behaviour, inputs[3])
            )
        results, options = run_all(method, *inputs, importance_weights=weights)
        for aggregation, ((loss, metrics), grad) in results.items():
            ref_loss, ref_grad, ref_metrics = ref_policy_loss(
                *inputs, aggregation=aggregation, importance_weights=weights, **options
            )
            message = f"{method} {aggregation} seed {seed}"
            np.testing.assert_allclose(loss, ref_loss, rtol=2e-5, atol=1e-6, err_msg=message)
            np.testing.assert_allclose(grad, ref_grad, rtol=2e-4, atol=1e-6, err_msg=message)
            for name, value in ref_metrics.items():
                np.testing.assert_allclose(
                    metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{message} {name}"
                )
            for name, value in ref_token_metrics(*inputs[:2], inputs[3]).items():
                np.testing.assert_allclose(
                    metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{message} {name}"
                )
            np.testing.assert_allclose(metrics["loss"], loss)
            if method == "ppo" and seed == 0:
                assert ref_metrics["dual_clip_frac"] > 0 and ref_metrics["clip_frac_low"] > 0
                assert ref_metrics["clip_frac_high"] > 0  # every branch is exercised


def embed(rows, fill=0.0):
    """Hand-worked rows written into the top-left corner of a SHAPE array."""
    out = np.full(SHAPE, fill, np.float32)
    rows = np.asarray(rows, np.float32)
    out[: rows.shape[0], : rows.shape[1]] = rows
    return out


def test_hand_worked_ppo():
    # Trust region [0.8, 1.28] and dual clip c = 3 (PROGRAM_OPTIONS). r = 1.5 with A = +1:
    # clipped high, 1.28; r = 0.5 with A = -1: clipped low, -0.8; r = 1 with A = 2: inside,
    # 2; r = 4 with A = -1: max(min(-4, -0.8), -3) = -3. Token mean: -(1.28 - 0.8 + 2 - 3) / 4.
    mask = embed([[1, 1, 1, 1]])
    results, _ = run_all(
        "ppo",
        embed(np.log([[1.5, 0.5, 1.0, 4.0]])),
        embed([[0.0] * 4]),
        embed([[1.0, -1.0, 2.0, -1.0]]),
        mask,
    )
    (loss, metrics), grad = results["token_mean"]
    np.testing.assert_allclose(loss, 0.13, rtol=1e-5)
    np.testing.assert_allclose(grad, embed([[0.0, 0.0, -2.0 / 4, 0.0]]), rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac_high"], 1 / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_frac_low"], 1 / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["dual_clip_frac"], 1 / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["zero_grad_frac"], 3 / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["gate_mean"], 1 / 4, rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_max"], 4.0, rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_min"], 0.5, rtol=1e-6)
    np.testing.assert_allclose(metrics["ratio_mean"], 7.0 / 4, rtol=1e-6)


def test_hand_worked_sapo_gspo():
    # SAPO at r = 1: f(1) A = (2 / tau) A: tau_pos = 1 for A = +1, tau_neg = 1.05 for A = -1.
    mask = embed([[1, 1]])
    results, _ = run_all(
        "sapo", embed([[0.0, 0.0]]), embed([[0.0, 0.0]]), embed([[1.0, -1.0]]), mask
    )
    (loss, metrics), grad = results["token_mean"]
    np.testing.assert_allclose(loss, -(2.0 - 2.0 / 1.05) / 2, rtol=1e-5)
    np.testing.assert_allclose(grad, embed([[-0.5, 0.5]]), rtol=1e-6)  # w = 1 at r = 1
    np.testing.assert_allclose(metrics["gate_mean"], 1.0)
    # GSPO: log-ratios 0.1 and -0.3 -> s = exp(-0.1); A = 1, inside the clip range.
    results, _ = run_all(
        "gspo", embed([[0.1, -0.3]]), embed([[0.0, 0.0]]), embed([[1.0, 1.0]]), mask
    )
    (loss, metrics), grad = results["token_mean"]
    np.testing.assert_allclose(loss, -math.exp(-0.1), rtol=1e-6)
    np.testing.assert_allclose(grad, embed([[-math.exp(-0.1) / 2] * 2]), rtol=1e-6)
    np.testing.assert_allclose(metrics["seq_ratio_mean"], math.exp(-0.1), rtol=1e-6)
    np.testing.assert_allclose(metrics["log_ratio_seq_var"], 0.04, rtol=1e-5)


def test_hand_worked_aggregation():
    per_token = jnp.array([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0], [4.0, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 0, 0]])
    expected = {
        "token_mean": 10 / 4,
        "seq_mean_token_mean": (1.5 + 3 + 4) / 3,
        "seq_mean_token_sum": (3 + 3 + 4) / 3,
        "seq_mean_token_sum_norm": (3 / 5 + 3 / 5 + 4 / 5) / 3,
        "group_token_mean": (6 / 3 + 4 / 1) / 2,
    }

    @jax.jit
    def every_aggregation(per_token, mask):
        return {
            aggregation: losses.aggregate(per_token, mask, aggregation, group_size=2, max_len=5)
            for aggregation in AGGREGATIONS
        }

    got = every_aggregation(per_token, mask)
    for aggregation, value in expected.items():
        np.testing.assert_allclose(got[aggregation], value, rtol=1e-6, err_msg=aggregation)
    for aggregation, value in every_aggregation(per_token, jnp.zeros((4, 3))).items():
        assert value == 0, aggregation  # nothing valid: 0, not NaN


def test_sequence_level_terms_aggregate_like_their_broadcast():
    # A [B, 1] term (GSPO's sequence objective) counts once per valid token of its row.
    rng = np.random.default_rng(3)
    per_seq = rng.normal(size=(6, 1)).astype(np.float32)
    mask = (rng.random((6, 7)) < 0.6).astype(np.float32)
    mask[2] = 0  # an empty row counts in no mean
    for aggregation in AGGREGATIONS:
        kwargs = dict(group_size=3, max_len=9)
        row_level = losses.aggregate(jnp.asarray(per_seq), mask, aggregation, **kwargs)
        token_level = losses.aggregate(
            jnp.asarray(np.broadcast_to(per_seq, mask.shape)), mask, aggregation, **kwargs
        )
        np.testing.assert_allclose(
            row_level, token_level, rtol=1e-5, atol=1e-6, err_msg=aggregation
        )


# ----------------------------------------------------------------------------------------
# The papers' identities (docs/algorithms.md).
# ----------------------------------------------------------------------------------------


def test_sapo_gate_identities():
    ratio = np.linspace(0.05, 3.0, 301, dtype=np.float32)[None]
    tau = np.array([[1.0], [1.05], [3.0]], np.float32)

    @jax.jit
    def gate_and_grad(log_ratio):
        def objective(log_ratio):
            ones = jnp.ones_like(log_ratio)
            return losses.sapo_objective(
                losses.GateInputs(log_ratio, ones, ones, None, None), losses.SAPOSettings(tau, tau)
            )

        grad = jax.grad(lambda x: jnp.sum(objective(x).objective))(log_ratio)
        return objective(log_ratio).gate, grad

    gate, grad = gate_and_grad(np.log(ratio) + np.zeros_like(tau))
    p = 1 / (1 + np.exp(-tau * (ratio - 1.0)))
    # rtol 1e-4: 4p(1-p) in float32 cancels in 1 - p where p -> 1 (tau = 3, r ~ 2.9):
    # the float32 reference alone is 2.9e-5 off float64 there, and the GPU's rounding
    # differs from the CPU's (1.7e-5 apart).
    np.testing.assert_allclose(gate, 4 * p * (1 - p), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(gate, 1 / np.cosh(tau * (ratio - 1) / 2) ** 2, rtol=1e-4, atol=1e-6)
    assert np.all(gate > 0) and np.all(gate <= 1)
    np.testing.assert_allclose(gate[:, np.argmin(np.abs(ratio - 1))], 1.0, rtol=1e-4)
    np.testing.assert_allclose(gate_and_grad(np.zeros((3, 301), np.float32))[0], 1.0)  # w(1) = 1
    # d f(r) A / d log pi = w r A (A = 1).
    np.testing.assert_allclose(grad, gate * ratio, rtol=1e-5, atol=1e-7)


def test_sapo_gradient_is_minus_w_r_a_scaled_by_aggregation():
    log_probs, old, advantages, mask = make_inputs(11, kind="end", spread=0.8)
    results, _ = run_all("sapo", log_probs, old, advantages, mask)
    ratio = np.exp(log_probs.astype(np.float64) - old)
    tau = np.where(advantages > 0, 1.0, 1.05)
    p = 1 / (1 + np.exp(-tau * (ratio - 1)))
    for aggregation, (_, grad) in results.items():
        weights = ref_aggregation_weights(mask, aggregation, group_size=3, max_len=11)
        # float32 1 - p loses digits where the gate is ~1e-4 (far from r = 1): atol.
        np.testing.assert_allclose(
            grad,
            -weights * 4 * p * (1 - p) * ratio * advantages,
            rtol=2e-4,
            atol=1e-6,
            err_msg=aggregation,
        )


def test_gspo_gradient_and_gspo_token_equivalence():
    log_probs, old, _, mask = make_inputs(5, kind="end", spread=0.05)
    seq_adv = np.random.default_rng(0).normal(size=(SHAPE[0], 1)).astype(np.float32)
    advantages = np.broadcast_to(seq_adv, SHAPE).copy()
    gspo, _ = run_all("gspo", log_probs, old, advantages, mask)
    gspo_token, _ = run_all("gspo_token", log_probs, old, advantages, mask)
    for aggregation in AGGREGATIONS:
        (loss, _), grad = gspo[aggregation]
        (loss_t, _), grad_t = gspo_token[aggregation]
        np.testing.assert_allclose(loss_t, loss, rtol=1e-6, err_msg=aggregation)
        np.testing.assert_allclose(grad_t, grad, rtol=1e-5, atol=1e-8, err_msg=aggregation)
    # s_i A_i (1/|y_i|) grad log pi, then (1/#sequences) from the sequence mean.
    lengths = mask.sum(1, keepdims=True)
    seq_ratio = np.exp(((log_probs - old) * mask).sum(1, keepdims=True) / np.maximum(lengths, 1))
    nonempty = (lengths > 0).sum()
    expected = -seq_ratio * seq_adv * mask / np.maximum(lengths, 1) / nonempty
    np.testing.assert_allclose(gspo["seq_mean_token_mean"][1], expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("method", ("ppo", "gspo_token"))
def test_clip_gate_zero_gradient_exactly_outside_trust_region(method):
    # One valid token per sequence so that token and sequence ratios coincide; trust
    # region [0.8, 1.28] (PROGRAM_OPTIONS).
    ratio = np.array([0.5, 0.79, 0.799, 0.801, 1.0, 1.27, 1.279, 1.281, 2.0], np.float32)
    mask = np.zeros(SHAPE, np.float32)
    mask[:9, 0] = 1
    log_probs = np.zeros(SHAPE, np.float32)
    log_probs[:9, 0] = np.log(ratio)
    for sign, inside in ((1.0, ratio <= 1.28), (-1.0, ratio >= 0.8)):
        # A > 0: only the high side clips; A < 0: only the low side.
        results, _ = run_all(
            method, log_probs, np.zeros(SHAPE, np.float32), np.full(SHAPE, sign, np.float32), mask
        )
        grad = np.asarray(results["token_mean"][1])[:9, 0]
        np.testing.assert_array_equal(grad == 0, ~inside)
        np.testing.assert_allclose(grad[inside], -sign * ratio[inside] / 9, rtol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_padding_values_change_nothing(method):
    log_probs, old, advantages, mask = make_inputs(3)
    results, _ = run_all(method, log_probs, old, advantages, mask)
    pad = mask == 0
    garbage = [
        np.where(pad, np.float32(value), x)
        for x, value in ((log_probs, np.nan), (old, 1e30), (advantages, -np.inf))
    ]
    results_g, _ = run_all(method, *garbage, mask, importance_weights=np.where(pad, np.nan, 1.0))
    for aggregation in AGGREGATIONS:
        (loss, metrics), grad = results[aggregation]
        (loss_g, metrics_g), grad_g = results_g[aggregation]
        np.testing.assert_array_equal(loss_g, loss)
        np.testing.assert_array_equal(grad_g, grad)
        assert np.all(np.asarray(grad)[pad] == 0)
        for name in metrics:
            np.testing.assert_array_equal(metrics_g[name], metrics[name], err_msg=name)


@pytest.mark.parametrize("method", METHODS)
def test_bool_int_and_float_masks_agree(method):
    """Bool, int and float masks give the same results: anything > 0 is a valid token."""
    log_probs, old, advantages, mask = make_inputs(5)
    expected, _ = run_all(method, log_probs, old, advantages, mask)
    int_mask = np.where(mask > 0, 3, np.where(np.arange(mask.size).reshape(mask.shape) % 2, 0, -2))
    float_mask = np.where(mask > 0, 2.5, int_mask).astype(np.float32)  # 2.5 valid; 0, -2 not
    for other in (mask > 0, int_mask.astype(np.int32), float_mask):
        results, _ = run_all(method, log_probs, old, advantages, other)
        for aggregation in AGGREGATIONS:
            (loss, metrics), grad = results[aggregation]
            (loss_f, metrics_f), grad_f = expected[aggregation]
            np.testing.assert_array_equal(loss, loss_f)
            np.testing.assert_array_equal(grad, grad_f)
            for name in metrics_f:
                np.testing.assert_array_equal(metrics[name], metrics_f[name], err_msg=name)


@pytest.mark.parametrize("method", METHODS)
def test_finite_with_zero_length_responses_and_zero_advantages(method):
    zeros = np.zeros(SHAPE, np.float32)
    one_token = zeros.copy()
    one_token[0, 0] = 1
    for mask in (zeros, one_token):
        results, _ = run_all(method, zeros - 1, zeros - 1, zeros, mask)
        for aggregation, ((loss, metrics), grad) in results.items():
            assert float(loss) == 0.0, aggregation
            assert np.all(np.asarray(grad) == 0), aggregation
            assert all(np.isfinite(v) for v in metrics.values()), aggregation


@pytest.mark.parametrize("method", METHODS)
def test_sequence_advantages_broadcast_over_the_tokens(method):
    """[B] advantages (one per sequence: outcome advantages, GSPO's sequence level) give
    the loss, gradient and metrics of their [B, T] broadcast."""
    log_probs, old, _, mask = make_inputs(9)
    per_sequence = np.random.default_rng(9).normal(size=SHAPE[0]).astype(np.float32)
    expected, _ = run_all(
        method, log_probs, old, np.repeat(per_sequence[:, None], SHAPE[1], axis=1), mask
    )
    results, _ = run_all(method, log_probs, old, per_sequence, mask)
    for aggregation in AGGREGATIONS:
        (loss, metrics), grad = results[aggregation]
        (loss_b, metrics_b), grad_b = expected[aggregation]
        np.testing.assert_array_equal(loss, loss_b, err_msg=aggregation)
        np.testing.assert_array_equal(grad, grad_b, err_msg=aggregation)
        for name in metrics_b:
            np.testing.assert_array_equal(metrics[name], metrics_b[name], err_msg=name)


def test_policy_loss_traces_once_per_shape():
    @jax.jit
    @chex.assert_max_traces(n=2)
    def step(log_probs, old, advantages, mask):
        return losses.policy_loss(log_probs, old, advantages, mask, method="sapo")[0]

    for shape in ((4, 5), (4, 5), (3, 8), (3, 8)):
        ones = jnp.ones(shape)
        jax.block_until_ready(step(ones * 0.1, ones * 0.2, ones, ones))


def test_metrics_none_keeps_loss_and_gradient():
    inputs = make_inputs(12)

    @jax.jit
    def both(log_probs, old_log_probs, advantages, mask):
        return [
            jax.value_and_grad(
                lambda x, metrics=metrics: losses.policy_loss(
                    x, old_log_probs, advantages, mask, method="ppo", dual_clip=3.0, metrics=metrics
                ),
                has_aux=True,
            )(log_probs)
            for metrics in losses.METRICS
        ]

    ((loss, metrics), grad), ((loss_none, metrics_none), grad_none) = both(*inputs)
    assert set(metrics_none) == {"loss"} and len(metrics) > 10
    np.testing.assert_array_equal(loss_none, loss)
    np.testing.assert_array_equal(metrics_none["loss"], metrics["loss"])
    np.testing.assert_array_equal(grad_none, grad)


def test_bad_options_name_the_field():
    ones = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="method"):
        losses.policy_loss(ones, ones, ones, ones, method="grpo++")
    with pytest.raises(ValueError, match="aggregation"):
        losses.policy_loss(ones, ones, ones, ones, aggregation="sum")
    with pytest.raises(ValueError, match="group_size"):
        losses.policy_loss(ones, ones, ones, ones, aggregation="group_token_mean", group_size=3)
    with pytest.raises(ValueError) as error:
        losses.policy_loss(ones, ones, jnp.ones((3,)), ones)
    assert str(error.value) == (
        "advantages has shape (3,), expected [B, T] = (2, 3) like log_probs, or [B] = (2,) "
        "(one per sequence)"
    )
    with pytest.raises(ValueError, match=r"mask has shape \(2,\), expected \(2, 3\)"):
        losses.policy_loss(ones, ones, ones, jnp.ones((2,)))
    with pytest.raises(ValueError, match="dual_clip"):
        losses.policy_loss(ones, ones, ones, ones, method="sapo", dual_clip=3.0)
    with pytest.raises(ValueError, match="metrics"):
        losses.policy_loss(ones, ones, ones, ones, metrics="some")
