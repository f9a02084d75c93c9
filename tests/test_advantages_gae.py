"""GAE in policyopt.advantages (plain, decoupled, length-adaptive; the scan and the blocked
matrix form over chunks) against NumPy loops and hand-worked cases."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt import advantages as adv
from tests.test_advantages import SHAPE, make_mask

# ----------------------------------------------------------------------------------------
# GAE.
# ----------------------------------------------------------------------------------------


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
