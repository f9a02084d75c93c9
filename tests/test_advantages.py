"""policyopt.advantages against plain NumPy loops and hand-worked cases."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt import advantages as adv

SHAPE = (12, 9)


# ----------------------------------------------------------------------------------------
# Outcome advantages.
# ----------------------------------------------------------------------------------------


def ref_outcome_advantages(rewards, group_size, center, scale, eps=1e-6, valid=None):
    """GRPO / Dr. GRPO / Magistral advantages with explicit loops (ddof-1 std + eps).

    ``valid``: samples left out of every statistic, with advantage 0 (None: all valid).
    No signal, exact zeros: a group of all-equal (or fewer than two) valid rewards with
    center "group" or scale "group"; with scale "batch", all-equal kept values."""

    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1))

    valid = [True] * len(rewards) if valid is None else [bool(v) for v in valid]
    out = []
    for start in range(0, len(rewards), group_size):
        group = [
            float(r)
            for r, v in zip(rewards[start : start + group_size], valid[start : start + group_size])
            if v
        ]
        for r, v in zip(rewards[start : start + group_size], valid[start : start + group_size]):
            if not v:
                out.append(0.0)
                continue
            if (center == "group" or scale == "group") and (
                len(group) < 2 or max(group) == min(group)
            ):
                out.append(0.0)
                continue
            a = float(r) - mean(group) if center == "group" else float(r)
            if scale == "group":
                a = a / (std(group) + eps)
            out.append(a)
    if scale == "batch":  # over the groups whose rewards are not all equal (Magistral)
        keep = []
        for k in range(len(rewards)):
            start = k // group_size * group_size
            group = [
                float(r)
                for r, v in zip(
                    rewards[start : start + group_size], valid[start : start + group_size]
                )
                if v
            ]
            keep.append(valid[k] and (center == "none" or max(group) > min(group)))
        if len({a for a, k in zip(out, keep) if k}) < 2:  # all kept values equal
            keep = [False] * len(keep)
        kept = [a for a, k in zip(out, keep) if k]
        m, s = mean(kept), std(kept)
        out = [(a - m) / (s + eps) if k else 0.0 for a, k in zip(out, keep)]
    return np.array(out)


OUTCOME_OPTIONS = [(c, s) for c in ("group", "none") for s in ("group", "batch", "none")]


# Jitted, as the trainer runs it: one program per shape and options, not one per eager op.
outcome_advantages = jax.jit(
    adv.outcome_advantages, static_argnums=1, static_argnames=("center", "scale")
)


@functools.partial(jax.jit, static_argnums=1)
def every_outcome(rewards, group_size=4):
    return {
        (c, s): adv.outcome_advantages(rewards, group_size, center=c, scale=s)
        for c, s in OUTCOME_OPTIONS
    }


def test_outcome_advantages_match_loops():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=16).astype(np.float32)
    rewards[4:8] = 1.0  # an all-correct group
    rewards[8:12] = rng.integers(0, 2, size=4)  # binary rewards
    results = every_outcome(rewards)
    for (center, scale), got in results.items():
        expected = ref_outcome_advantages(rewards, 4, center, scale)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"{center} {scale}")
        if center == "group" or scale == "group":
            assert np.all(np.asarray(got)[4:8] == 0), f"{center} {scale}"  # exact zeros
    # Another shape: 3 groups of 2.
    rewards = rng.normal(size=6).astype(np.float32)
    for (center, scale), got in every_outcome(rewards, 2).items():
        np.testing.assert_allclose(
            got, ref_outcome_advantages(rewards, 2, center, scale), rtol=1e-5, atol=1e-6
        )


def test_outcome_advantages_hand_worked():
    rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0], np.float32)
    results = every_outcome(rewards)
    # Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 * sqrt(3) = +-0.8660.
    np.testing.assert_allclose(
        results["group", "group"][:4], [0.8660254, -0.8660254, -0.8660254, 0.8660254], rtol=1e-5
    )
    # Group [0, 0, 0, 1]: mean 0.25, std 0.5 -> -0.5 and 1.5.
    np.testing.assert_allclose(results["group", "group"][8:12], [-0.5, -0.5, -0.5, 1.5], rtol=1e-5)
    # Dr. GRPO: no scaling.
    np.testing.assert_allclose(results["group", "none"][:4], [0.5, -0.5, -0.5, 0.5])
    # All-equal groups: zeros under every scale, never NaN.
    for (center, scale), got in results.items():
        assert np.all(np.isfinite(got))
        if center == "group":
            assert np.all(np.asarray(got)[4:8] == 0) and np.all(np.asarray(got)[12:] == 0)
    np.testing.assert_array_equal(adv.zero_variance_groups(rewards, 4), [False, True, False, True])
    all_equal = every_outcome(np.full(16, 0.3, np.float32))
    for (center, scale), got in all_equal.items():
        assert np.all(np.isfinite(got))
        if center == "group":
            assert np.all(np.asarray(got) == 0)
    # Values whose float32 group mean is not the value itself (0.9 at G = 16 or 64 gave
    # advantages of 0.1-0.2 from rounding divided by eps): still exact zeros.
    for group_size in (3, 16, 64):
        rewards = np.full(2 * group_size, 0.9, np.float32)
        rewards[group_size] = 0.1  # the second group is informative
        for scale in ("group", "batch", "none"):
            got = np.asarray(outcome_advantages(rewards, group_size, scale=scale))
            assert np.all(got[:group_size] == 0), (group_size, scale)
            assert np.any(got[group_size:] != 0)


def test_outcome_advantages_leave_invalid_samples_out():
    """Samples with valid=False (a stand-in reward: missed scoring deadline) count in no
    statistic and get advantage 0; their rewards change nothing."""
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=20).astype(np.float32)
    rewards[8:12] = rng.integers(0, 2, size=4)
    valid = np.ones(20, bool)
    valid[[1, 6, 7, 10]] = False  # groups with 3, 2 and 3 valid samples
    valid[13:16] = False  # a group with a single valid sample
    valid[16:20] = False  # a group with none
    for center, scale in OUTCOME_OPTIONS:
        got = np.asarray(outcome_advantages(rewards, 4, center=center, scale=scale, valid=valid))
        expected = ref_outcome_advantages(rewards, 4, center, scale, valid=valid)
        assert np.all(got[~valid] == 0), f"{center} {scale}"
        if center == "group" or scale == "group":  # the lone valid sample: no signal
            assert got[12] == 0, f"{center} {scale}"
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=f"{center} {scale}")
        changed = np.where(valid, rewards, 100.0).astype(np.float32)
        np.testing.assert_array_equal(
            outcome_advantages(changed, 4, center=center, scale=scale, valid=valid),
            outcome_advantages(rewards, 4, center=center, scale=scale, valid=valid),
        )
        # All valid: the same numbers as no mask at all (up to rounding: without a mask the
        # group size is a constant; the trainer passes None when nothing was missed).
        np.testing.assert_allclose(
            outcome_advantages(rewards, 4, center=center, scale=scale, valid=np.ones(20, bool)),
            outcome_advantages(rewards, 4, center=center, scale=scale),
            rtol=1e-6,
            atol=1e-6,
        )
    # Hand-worked: [1, 0, (missed), 0] -> mean 1/3, std sqrt(1/3) over the three.
    got = outcome_advantages(
        np.array([1, 0, 0, 0], np.float32), 4, valid=np.array([1, 1, 0, 1], bool)
    )
    np.testing.assert_allclose(
        got,
        [(2 / 3) / math.sqrt(1 / 3), -(1 / 3) / math.sqrt(1 / 3), 0, -(1 / 3) / math.sqrt(1 / 3)],
        rtol=1e-5,
    )
    # Zero variance among the valid ones (a missed sample's reward differs): uninformative.
    np.testing.assert_array_equal(
        adv.zero_variance_groups(
            np.array([1, 1, 0, 1, 0, 1, 5, 5], np.float32),
            4,
            valid=np.array([1, 1, 0, 1, 1, 0, 0, 0], bool),
        ),
        [True, True],
    )
    with pytest.raises(ValueError, match="valid"):
        outcome_advantages(rewards, 4, valid=valid[:8])


def test_no_signal_gives_exact_zeros_for_every_center_and_scale():
    """All-equal rewards whose float32 mean is not the value itself (0.9): exact zeros for
    an all-equal group under center "group" or scale "group", for an all-equal batch under
    scale "batch", whatever the other option; with the valid mask too. Hand-worked."""
    nine = np.float32(0.9)
    # 64 rewards of 0.9, G = 8 (before: center "none", scale "group" gave up to 8.46e5, and
    # scale "batch" |A| 0.056). Only center "none", scale "none" keeps them: A = R.
    rewards = np.full(64, nine)
    for center, scale in OUTCOME_OPTIONS:
        got = np.asarray(outcome_advantages(rewards, 8, center=center, scale=scale))
        expected = rewards if (center, scale) == ("none", "none") else np.zeros(64, np.float32)
        np.testing.assert_array_equal(got, expected, err_msg=f"{center} {scale}")
    # [0.9] * 4 then [1, 0, 0, 1], G = 4.
    rewards = np.array([nine] * 4 + [1, 0, 0, 1], np.float32)
    root3 = math.sqrt(3.0)
    # Second group: mean 0.5, std sqrt(1/3); centred +-0.5 -> +-0.5 sqrt(3) = +-0.8660.
    # Center "none", scale "group": R / sqrt(1/3) = sqrt(3) R.
    # Center "none", scale "batch": mean (3.6 + 2) / 8 = 0.7, std sqrt(1.32 / 7) = 0.434248.
    # Center "group", scale "batch": kept [0.5, -0.5, -0.5, 0.5], mean 0, std sqrt(1/3).
    batch_std = math.sqrt(1.32 / 7)
    expected = {
        ("group", "group"): [0, 0, 0, 0, root3 / 2, -root3 / 2, -root3 / 2, root3 / 2],
        ("group", "batch"): [0, 0, 0, 0, root3 / 2, -root3 / 2, -root3 / 2, root3 / 2],
        ("group", "none"): [0, 0, 0, 0, 0.5, -0.5, -0.5, 0.5],
        ("none", "group"): [0, 0, 0, 0, root3, 0, 0, root3],
        ("none", "batch"): [0.2 / batch_std] * 4
        + [0.3 / batch_std, -0.7 / batch_std, -0.7 / batch_std, 0.3 / batch_std],
        ("none", "none"): [nine] * 4 + [1, 0, 0, 1],
    }
    for (center, scale), want in expected.items():
        got = np.asarray(outcome_advantages(rewards, 4, center=center, scale=scale))
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{center} {scale}")
        if center == "group" or scale == "group":  # the 0.9 group: exact zeros, not ~1e-7
            assert np.all(got[:4] == 0), (center, scale)
    # [0.9] * 4 then [0.1] * 4: center "none", scale "batch" keeps the constant groups'
    # values (they differ from the batch's): mean 0.5, std sqrt(8 * 0.16 / 7) -> +-0.935414.
    got = outcome_advantages(
        np.array([nine] * 4 + [0.1] * 4, np.float32), 4, center="none", scale="batch"
    )
    np.testing.assert_allclose(
        got, [0.4 / math.sqrt(1.28 / 7)] * 4 + [-0.4 / math.sqrt(1.28 / 7)] * 4, rtol=1e-5
    )
    # With the valid mask: the one reward that differs (5.0) is not valid, so every group
    # and the batch hold only 0.9s; a group with one valid sample has no signal either.
    rewards = np.array(
        [nine, nine, 5.0, nine, nine, nine, nine, nine, nine, 2.0, 3.0, 4.0], np.float32
    )
    valid = np.array([1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0], bool)
    for center, scale in OUTCOME_OPTIONS:
        got = np.asarray(outcome_advantages(rewards, 4, center=center, scale=scale, valid=valid))
        expected = np.where(valid, nine, 0) if (center, scale) == ("none", "none") else np.zeros(12)
        np.testing.assert_array_equal(got, expected.astype(np.float32), err_msg=f"{center} {scale}")
    # The same groups, one informative valid pair in the last: [0.9, 0.1] -> centred +-0.4,
    # std sqrt(0.32); the 0.9-only groups stay exact zeros.
    rewards[10], valid[10] = 0.1, True
    got = np.asarray(outcome_advantages(rewards, 4, center="none", scale="group", valid=valid))
    np.testing.assert_allclose(
        got, [0, 0, 0, 0, 0, 0, 0, 0, 0.9 / math.sqrt(0.32), 0, 0.1 / math.sqrt(0.32), 0], rtol=1e-5
    )
    assert np.all(got[:8] == 0)


def test_grpo_advantages_without_a_mask_keep_their_bits():
    """Without ``valid`` GRPO's statistics divide by the static group size, as before masks
    existed: runs with no missed sample get bit for bit the numbers they always had."""
    rng = np.random.default_rng(5)
    for group_size in (3, 8, 16):
        rewards = rng.normal(size=4 * group_size).astype(np.float32)
        grouped = jnp.asarray(rewards).reshape(-1, group_size)
        mean = jnp.mean(grouped, axis=1, keepdims=True)
        equal = jnp.max(grouped, axis=1, keepdims=True) == jnp.min(grouped, axis=1, keepdims=True)
        std = jnp.sqrt(
            jnp.sum(jnp.square(grouped - mean), axis=1, keepdims=True) / (group_size - 1)
        )
        expected = (jnp.where(equal, 0.0, grouped - mean) / (std + 1e-6)).reshape(-1)
        np.testing.assert_array_equal(adv.outcome_advantages(rewards, group_size), expected)


def test_outcome_advantages_errors():
    with pytest.raises(ValueError, match="group_size"):
        adv.outcome_advantages(np.zeros(6), 4)
    with pytest.raises(ValueError, match="group_size"):
        adv.outcome_advantages(np.zeros(6), 1, scale="group")
    with pytest.raises(ValueError, match="scale"):
        adv.outcome_advantages(np.zeros(6), 2, scale="minibatch")
    with pytest.raises(ValueError, match="center"):
        adv.outcome_advantages(np.zeros(6), 2, center="batch")


# ----------------------------------------------------------------------------------------
# GAE.
# ----------------------------------------------------------------------------------------


def make_mask(rng, shape):
    """Masked at the end, unmasked and arbitrary rows; a length-1 and an empty sequence."""
    batch, length = shape
    mask = np.ones(shape, np.float32)
    for i in range(batch):
        if i % 3 == 0:
            mask[i, rng.integers(1, length + 1) :] = 0
        elif i % 3 == 2:
            mask[i] = rng.random(length) < 0.6
    mask[0] = 0
    mask[0, rng.integers(length)] = 1
    mask[1] = 0
    return mask


def ref_gae(rewards, values, mask, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l} over the valid positions, from the definition."""
    batch, length = rewards.shape
    advantages = np.zeros((batch, length))
    lam = np.broadcast_to(np.asarray(lam, np.float64), (batch,))
    for i in range(batch):
        valid = [t for t in range(length) if mask[i, t] > 0]
        deltas = []
        for k, t in enumerate(valid):
            next_value = float(values[i, valid[k + 1]]) if k + 1 < len(valid) else 0.0
            deltas.append(float(rewards[i, t]) + gamma * next_value - float(values[i, t]))
        for k, t in enumerate(valid):
            advantages[i, t] = sum(
                (gamma * lam[i]) ** l * deltas[k + l] for l in range(len(valid) - k)
            )
    returns = np.where(mask > 0, advantages + values, 0.0)
    return advantages, returns


def gae_variants(rewards, values, mask, lam_rows):
    """Every GAE entry point and implementation, in one jitted program."""
    out = {}
    for impl in adv.GAE_IMPLS:
        out["rows", impl] = adv.gae(rewards, values, mask, gamma=1.0, lam=lam_rows, impl=impl)
        out["decoupled", impl] = adv.decoupled_gae(
            rewards, values, mask, gamma=0.95, lam_actor=0.9, lam_critic=1.0, impl=impl
        )
    # The other entry points with the default implementation (they share its code path).
    out["plain", "default"] = adv.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    out["adaptive", "default"] = adv.length_adaptive_gae(
        rewards, values, mask, gamma=1.0, alpha=0.5
    )
    return out


gae_variants_jit = jax.jit(gae_variants)


def make_gae_inputs(seed, shape=SHAPE):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=shape).astype(np.float32)
    values = rng.normal(size=shape).astype(np.float32)
    mask = make_mask(rng, shape)
    lam_rows = rng.random(shape[0]).astype(np.float32)
    lam_rows[2] = 0.0
    lam_rows[3] = 1.0
    return rewards, values, mask, lam_rows


@pytest.mark.parametrize("shape", (SHAPE, (5, 1)))
def test_gae_matches_loops(shape):
    rewards, values, mask, lam_rows = make_gae_inputs(0, shape)
    results = gae_variants_jit(rewards, values, mask, lam_rows)
    lengths = mask.sum(1)
    adaptive_lam = np.array([max(1 - 1 / (0.5 * n), 0.0) if n > 0 else 0.0 for n in lengths])
    expected = {
        "plain": ref_gae(rewards, values, mask, 0.9, 0.8),
        "rows": ref_gae(rewards, values, mask, 1.0, lam_rows),
        "decoupled": (
            ref_gae(rewards, values, mask, 0.95, 0.9)[0],
            ref_gae(rewards, values, mask, 0.95, 1.0)[1],
        ),
        "adaptive": (
            ref_gae(rewards, values, mask, 1.0, adaptive_lam)[0],
            ref_gae(rewards, values, mask, 1.0, 1.0)[1],
        ),
    }
    assert set(results) == {
        (name, impl) for name in ("rows", "decoupled") for impl in adv.GAE_IMPLS
    } | {("plain", "default"), ("adaptive", "default")}
    for (name, impl), (got_advantages, got_returns) in results.items():
        ref_advantages, ref_returns = expected[name]
        np.testing.assert_allclose(
            got_advantages, ref_advantages, rtol=1e-5, atol=1e-5, err_msg=f"{name} {impl}"
        )
        np.testing.assert_allclose(
            got_returns, ref_returns, rtol=1e-5, atol=1e-5, err_msg=f"{name} {impl}"
        )


def test_gae_hand_worked():
    # rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma 1, lam 0.5 (row 2 of "plain" uses
    # gamma 0.9, so compute with "rows", gamma 1, lam per row = 0.5):
    #   delta = [0.1, 0.1, 0.3]; A_2 = 0.3, A_1 = 0.1 + 0.5 * 0.3 = 0.25,
    #   A_0 = 0.1 + 0.5 * 0.25 = 0.225; returns = A + V = [0.725, 0.85, 1.0].
    # With a hole at t = 1 (mask [1, 0, 1]): delta_0 = 0 + 0.7 - 0.5 = 0.2, A_0 = 0.35.
    rewards = np.zeros(SHAPE, np.float32)
    values = np.zeros(SHAPE, np.float32)
    mask = np.zeros(SHAPE, np.float32)
    for row, row_mask in ((0, [1, 1, 1]), (1, [1, 0, 1])):
        rewards[row, :3] = [0, 0, 1]
        values[row, :3] = [0.5, 0.6, 0.7]
        mask[row, :3] = row_mask
    values[1, 1] = 123.0  # the hole's value is never read
    results = gae_variants_jit(rewards, values, mask, np.full(SHAPE[0], 0.5, np.float32))
    for impl in adv.GAE_IMPLS:
        advantages, returns = results["rows", impl]
        np.testing.assert_allclose(advantages[0, :3], [0.225, 0.25, 0.3], rtol=1e-6)
        np.testing.assert_allclose(returns[0, :3], [0.725, 0.85, 1.0], rtol=1e-6)
        np.testing.assert_allclose(advantages[1, :3], [0.35, 0.0, 0.3], rtol=1e-6)
        np.testing.assert_allclose(returns[1, :3], [0.85, 0.0, 1.0], rtol=1e-6)
        assert np.all(np.asarray(advantages)[2:] == 0)  # fully masked rows


def test_gae_padding_values_change_nothing():
    rewards, values, mask, lam_rows = make_gae_inputs(1)
    results = gae_variants_jit(rewards, values, mask, lam_rows)
    pad = mask == 0
    garbage = gae_variants_jit(
        np.where(pad, np.nan, rewards), np.where(pad, np.inf, values), mask, lam_rows
    )
    for key, (advantages, returns) in results.items():
        np.testing.assert_array_equal(garbage[key][0], advantages, err_msg=str(key))
        np.testing.assert_array_equal(garbage[key][1], returns, err_msg=str(key))
        assert np.all(np.asarray(advantages)[pad] == 0) and np.all(np.asarray(returns)[pad] == 0)


def test_length_adaptive_lambda():
    lengths = np.array([100, 40, 21, 20, 10, 1, 0])
    # alpha = 0.05: 1 - 1 / (0.05 l); l = 20 gives exactly 0, l < 20 would be negative.
    expected = [0.8, 0.5, 1 - 1 / 1.05, 0.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(
        adv.length_adaptive_lambda(lengths, 0.05), expected, rtol=1e-6, atol=1e-7
    )
    clamped = adv.length_adaptive_lambda(lengths, 0.05, min_lam=0.5)
    np.testing.assert_allclose(clamped, [0.8, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5], rtol=1e-6)


def test_gae_traces_once_per_shape():
    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(rewards, values, mask):
        return adv.gae(rewards, values, mask, gamma=1.0, lam=0.95)

    rewards, values, mask, _ = make_gae_inputs(2)
    for _ in range(3):
        jax.block_until_ready(step(rewards, values, mask))
    jax.block_until_ready(step(values, rewards, mask))


def test_gae_errors():
    with pytest.raises(ValueError, match="lam"):
        adv.gae(np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 3)), lam=np.ones(3))
    with pytest.raises(ValueError, match="impl"):
        adv.gae(np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 3)), impl="fft")
    with pytest.raises(ValueError, match="values"):
        adv.gae(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))


# ----------------------------------------------------------------------------------------
# Masked statistics.
# ----------------------------------------------------------------------------------------


def test_masked_whiten_and_moments():
    rng = np.random.default_rng(3)
    x = (rng.normal(size=SHAPE) * 3 + 1).astype(np.float32)
    mask = make_mask(rng, SHAPE)

    @jax.jit
    def stats(x, mask):
        return (
            adv.masked_mean(x, mask),
            adv.masked_var(x, mask),
            adv.masked_whiten(x, mask),
            adv.masked_whiten(x, mask, shift_mean=False),
            adv.masked_mean(x, mask, axis=1),
        )

    mean, var, whitened, scaled, row_means = stats(x, mask)
    values = [float(x[i, t]) for i, t in zip(*np.nonzero(mask))]
    ref_mean = sum(values) / len(values)
    ref_var = sum((v - ref_mean) ** 2 for v in values) / len(values)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-5)
    np.testing.assert_allclose(var, ref_var, rtol=1e-5)
    for i, t in np.ndindex(*SHAPE):
        expected = (float(x[i, t]) - ref_mean) / math.sqrt(ref_var + 1e-8) if mask[i, t] else 0.0
        np.testing.assert_allclose(whitened[i, t], expected, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(
            scaled[i, t], expected + ref_mean if mask[i, t] else 0.0, rtol=1e-4, atol=1e-5
        )
    for i in range(SHAPE[0]):
        row = [float(x[i, t]) for t in range(SHAPE[1]) if mask[i, t]]
        np.testing.assert_allclose(row_means[i], sum(row) / len(row) if row else 0.0, rtol=1e-5)
    # Padding values never matter; an empty mask gives zeros, not NaN.
    garbage = stats(np.where(mask > 0, x, np.nan), mask)
    for got, ref in zip(garbage, (mean, var, whitened, scaled, row_means)):
        np.testing.assert_array_equal(got, ref)
    for got in stats(x, np.zeros(SHAPE, np.float32)):
        assert np.all(np.asarray(got) == 0)


# ----------------------------------------------------------------------------------------
# The blocked GAE (matrix products over chunks) on masks without holes.
# ----------------------------------------------------------------------------------------


def contiguous_mask(rng, shape):
    """Rows whose valid positions form one run: right padding, left padding, full, empty."""
    batch, length = shape
    lengths = rng.integers(1, length + 1, size=batch)
    starts = np.where(np.arange(batch) % 4 == 1, rng.integers(0, 3, size=batch), 0)
    positions = np.arange(length)[None]
    mask = (positions >= starts[:, None]) & (positions < starts[:, None] + lengths[:, None])
    mask = mask.astype(np.float32)
    mask[0], mask[1], mask[2] = 0, 1, 0
    mask[2, 0] = 1  # length 1
    return mask


def contiguous_inputs(seed, shape):
    """Normal rewards and values and a ``contiguous_mask``."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=shape).astype(np.float32)
    values = rng.normal(size=shape).astype(np.float32)
    return rewards, values, contiguous_mask(rng, shape)


@functools.partial(jax.jit, static_argnames="chunk")
def blocked_variants(rewards, values, mask, lam_rows, chunk):
    # The blocked kernel itself (decoupled_gae(impl="blocked") dispatches to it when the
    # mask has no hole: see test_blocked_gae_long_sequence_matches_recurrence). lam_rows holds 0
    # and 1 (make_gae_inputs): both ends of the discount range.
    run = functools.partial(adv._gae_blocked, rewards, values, mask > 0, chunk=chunk)
    scalar = jnp.float32(0.8)
    return {
        "scalar": run(gamma=0.9, lam_actor=scalar, lam_critic=scalar),
        "decoupled": run(gamma=0.95, lam_actor=lam_rows, lam_critic=jnp.float32(1.0)),
    }


@pytest.mark.parametrize("shape,chunk", [((9, 70), 8), ((5, 1), 32)])
def test_blocked_gae_matches_loops_on_masks_without_holes(shape, chunk):
    # T / chunk > chunk: several levels of the recursion, each with a padded last chunk.
    rewards, values, _, lam_rows = make_gae_inputs(4, shape)
    mask = contiguous_mask(np.random.default_rng(5), shape)
    assert bool(adv._contiguous_rows(mask > 0))
    results = blocked_variants(rewards, values, mask, lam_rows, chunk)
    expected = {
        "scalar": ref_gae(rewards, values, mask, 0.9, 0.8),
        "decoupled": (
            ref_gae(rewards, values, mask, 0.95, lam_rows)[0],
            ref_gae(rewards, values, mask, 0.95, 1.0)[1],
        ),
    }
    for name, (advantages, returns) in results.items():
        np.testing.assert_allclose(
            advantages, expected[name][0], rtol=1e-5, atol=1e-5, err_msg=name
        )
        np.testing.assert_allclose(returns, expected[name][1], rtol=1e-5, atol=1e-5, err_msg=name)
    # Padding values are never read (NaN and inf there change nothing).
    pad = mask == 0
    garbage = blocked_variants(
        np.where(pad, np.nan, rewards), np.where(pad, np.inf, values), mask, lam_rows, chunk
    )
    for name, outputs in results.items():
        for got, clean in zip(garbage[name], outputs):
            np.testing.assert_array_equal(got, clean, err_msg=name)


def test_contiguous_rows_detects_holes():
    mask = np.zeros((3, 6), bool)
    mask[0, 2:5] = True
    mask[2, :] = True
    assert bool(adv._contiguous_rows(mask))
    mask[1, [0, 2]] = True  # a hole at position 1
    assert not bool(adv._contiguous_rows(mask))


def test_blocked_gae_long_sequence_matches_recurrence():
    # T = 600 with lambda = 1 (the critic's) sums up to 600 terms: the default (blocked)
    # GAE and the float64 recurrence A_t = delta_t + gamma lam A_{t+1} agree to float32
    # rounding.
    shape = (4, 600)
    rewards, values, mask = contiguous_inputs(6, shape)
    advantages, returns = jax.jit(
        functools.partial(adv.decoupled_gae, gamma=1.0, lam_actor=0.95, lam_critic=1.0)
    )(rewards, values, mask)
    valid = mask > 0
    next_values = np.where(valid[:, 1:], values[:, 1:], 0.0)
    delta = np.where(valid, rewards + np.pad(next_values, ((0, 0), (0, 1))) - values, 0.0)
    expected = {0.95: np.zeros(shape), 1.0: np.zeros(shape)}
    for lam, out in expected.items():
        carry = np.zeros(shape[0])
        for t in reversed(range(shape[1])):
            carry = delta[:, t] + lam * carry
            out[:, t] = carry
    np.testing.assert_allclose(advantages, np.where(valid, expected[0.95], 0), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(
        returns, np.where(valid, expected[1.0] + values, 0), rtol=1e-5, atol=1e-4
    )


def test_equal_python_lambdas_run_one_recurrence():
    # decoupled_gae(lam, lam) with equal numbers (not the same object) computes the
    # recurrence once, like gae(lam): as many matrix products in its program.
    x = np.zeros((4, 64), np.float32)

    def products(fn):
        return str(jax.make_jaxpr(fn)(x, x, x)).count("dot_general")

    once = products(lambda r, v, m: adv.gae(r, v, m, gamma=1.0, lam=0.9))
    assert (
        products(
            lambda r, v, m: adv.decoupled_gae(
                r, v, m, gamma=1.0, lam_actor=0.9, lam_critic=float("0.9")
            )
        )
        == once
    )
    assert (
        products(
            lambda r, v, m: adv.decoupled_gae(
                r, v, m, gamma=1.0, lam_actor=np.float32(0.9), lam_critic=np.float32(0.9)
            )
        )
        == once
    )
    assert (
        products(
            lambda r, v, m: adv.decoupled_gae(r, v, m, gamma=1.0, lam_actor=0.9, lam_critic=1.0)
        )
        > once
    )


def test_per_row_lambdas_across_the_discount_range_match_loops():
    # VAPO's lambdas (0 for short responses, up to ~0.99), tiny ones and 1 in one batch,
    # on 200 tokens (two levels of the blocked recursion), against the definition.
    rewards, values, mask = contiguous_inputs(8, (7, 200))
    lam = np.asarray([0.0, 0.003, 0.02, 0.3, 0.9, 0.99, 1.0], np.float32)
    advantages, returns = jax.jit(functools.partial(adv.gae, gamma=1.0))(
        rewards, values, mask, lam=lam
    )
    want_adv, want_ret = ref_gae(rewards, values, mask, 1.0, lam)
    np.testing.assert_allclose(advantages, want_adv, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(returns, want_ret, rtol=1e-5, atol=2e-5)
