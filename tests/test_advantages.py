"""policyopt.advantages' outcome advantages and masked statistics against plain NumPy loops
and hand-worked cases (GAE: test_advantages_gae.py)."""

import functools
import math

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
