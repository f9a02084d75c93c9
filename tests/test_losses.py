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
