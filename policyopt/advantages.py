"""Advantage estimators: group statistics (GRPO family) and GAE (PPO family).

Critic-free methods give every token of response ``y_i`` one outcome advantage computed
from the rewards of its group (``outcome_advantages``). Critic-based methods use
generalised advantage estimation (Schulman et al., 1506.02438) over the response tokens
(``gae``), with the decoupled lambdas of VC-PPO (2503.01491) and the length-adaptive lambda
of VAPO (2504.05118).

GAE has three implementations, equal up to float rounding (``impl=``): ``"scan"``, the
reference, a reverse ``lax.scan`` over time (``T`` sequential steps); ``"associative"``,
``lax.associative_scan``; and the default ``"blocked"``, which writes the recurrence as
discounted suffix sums computed by matrix products over chunks of ``chunk`` tokens (no
sequential loop; ``benchmarks/bench_core.py``: ~4-6x faster than the scan on CPU at
B = 256, T = 4096). The blocked form needs each row's valid tokens to form one run (right
or left padding, the usual case); a mask with holes (e.g. masked tool output) is detected
at run time and sent to the scan.
"""

from __future__ import annotations

import dataclasses
import importlib
import numbers
from typing import Callable

import jax
import jax.numpy as jnp

from policyopt.losses import masked_mean, masked_var
from policyopt.registry import Registry, caller

Array = jax.Array

__all__ = [
    "register_estimator",
    "ESTIMATORS",
    "outcome_advantages",
    "zero_variance_groups",
    "gae",
    "decoupled_gae",
    "length_adaptive_lambda",
    "length_adaptive_gae",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]

CENTERS = ("group", "none")
SCALES = ("group", "batch", "none")
GAE_IMPLS = ("blocked", "scan", "associative")


def _group_rewards(rewards: Array, group_size: int) -> Array:
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], got shape {rewards.shape}")
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(
            f"group_size={group_size} must divide the number of rewards ({rewards.shape[0]}); "
            "rewards are laid out group after group"
        )
    return rewards.astype(jnp.result_type(rewards, jnp.float32)).reshape(-1, group_size)


# The group statistics below take ``valid`` (``[N / G, G]`` bool) or None for "every
# sample": None keeps the static group size in the formulas (XLA divides by a constant),
# so runs without invalid samples get the same bits as before masks existed.


def _unbiased_std(grouped: Array, valid: Array | None) -> Array:
    """``[N / G, 1]`` sample standard deviation (ddof 1) of each group's (valid) rewards;
    0 for a single one."""
    if valid is None:
        mean = jnp.mean(grouped, axis=1, keepdims=True)
        count = grouped.shape[1]
        return jnp.sqrt(
            jnp.sum(jnp.square(grouped - mean), axis=1, keepdims=True) / max(count - 1, 1)
        )
    count = jnp.sum(valid, axis=1, keepdims=True)
    centred = jnp.where(valid, grouped - _group_mean(grouped, valid), 0.0)
    return jnp.sqrt(jnp.sum(jnp.square(centred), axis=1, keepdims=True) / jnp.maximum(count - 1, 1))


def outcome_advantages(
    rewards: Array,
    group_size: int,
    *,
    center: str = "group",
    scale: str = "group",
    eps: float = 1e-6,
    valid: Array | None = None,
) -> Array:
    """Per-sequence advantages from scalar rewards laid out group after group.

    - ``center="group"``: ``A_i = R_i - mean_{j in g(i)} R_j``; ``"none"``: ``A_i = R_i``.
    - ``scale="group"`` (GRPO, 2402.03300): ``A_i / (std_g(R) + eps)``.
    - ``scale="batch"`` (Magistral, 2506.10910): ``(A - mean(A)) / (std(A) + eps)``
      over the ``N`` sequences passed in (pass one minibatch at a time for the paper's
      minibatch normalisation). Magistral drops zero-variance groups before forming the
      batch; with ``center="group"`` such groups are excluded from the batch mean and std
      and keep advantages of exactly 0, which is equivalent.
    - ``scale="none"`` (Dr. GRPO, 2503.20783): no division.

    Standard deviations are the unbiased (ddof 1) sample std, with ``eps`` added to it
    (the papers do not state the convention; this is common practice).

    Exact zeros, never NaN, where the rewards carry no signal (set explicitly: the float32
    mean of G copies of 0.9 is not 0.9, so ``R - mean(R)`` and the std are rounding
    errors, which dividing by ``std + eps`` would blow up):

    - a group whose (valid) rewards are all equal, or that has fewer than two valid ones,
      gets 0 with ``center="group"`` under every scale, and with ``scale="group"`` under
      every center (its std is 0: ``R / (0 + eps)`` would be ~1e6 R);
    - with ``scale="batch"``, a batch whose kept values are all equal (with
      ``center="none"``: every valid reward of the batch equal) gets 0. With
      ``center="none"`` an all-equal group in a batch that is not keeps its normalised
      rewards (they differ from the batch's);
    - ``center="none"``, ``scale="none"`` returns the (valid) rewards unchanged.

    Args:
      rewards: ``[N]`` scalar rewards, ``N = num_groups * group_size``, group by group.
      group_size: responses per prompt (G).
      center: ``"group"`` or ``"none"``.
      scale: ``"group"``, ``"batch"`` or ``"none"``.
      eps: added to the std.
      valid: optional ``[N]`` bool, False for samples whose reward is no verdict (e.g. a
        sample that missed the scoring deadline got a stand-in reward). They are left out
        of every statistic (group mean, group std, batch mean and std, the all-equal
        test, which then needs two valid rewards to differ) and get advantage 0. None:
        every sample is valid.

    Returns:
      ``[N]`` float32 advantages (broadcast them over each sequence's tokens).
    """
    if center not in CENTERS:
        raise ValueError(f"center={center!r} is not one of {CENTERS}")
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r} is not one of {SCALES}")
    grouped = _group_rewards(rewards, group_size)
    valid = _group_valid(valid, grouped)
    # All-equal groups (and invalid samples) get exact zeros. R - mean(R) alone does not
    # give them: the float32 mean of G copies of 0.9 is not 0.9 for most G, and the std
    # scaling then divides that rounding error by eps (measured with 0.9s: advantages up to
    # 0.19 at G = 64 with center="group", 8.5e5 at G = 8 with center="none").
    drop = _all_equal(grouped, valid)[:, None]
    if valid is not None:
        drop = drop | ~valid
    if center == "group":
        advantages = jnp.where(drop, 0.0, grouped - _group_mean(grouped, valid))
    else:
        advantages = grouped if valid is None else jnp.where(valid, grouped, 0.0)
    if scale == "group":
        if group_size < 2:
            raise ValueError(
                "scale='group' needs group_size >= 2 (the std of one reward is undefined)"
            )
        # (With center="group" the dropped rows are 0 already: the same bits either way.)
        advantages = jnp.where(drop, 0.0, advantages / (_unbiased_std(grouped, valid) + eps))
    if scale == "batch":
        # Magistral drops zero-variance groups before the batch is formed: with group
        # centering their advantages are exactly 0, so they are left out of the batch
        # statistics here and keep their zeros (the same result as dropping them).
        keep = jnp.ones(grouped.shape, bool) if valid is None else valid
        if center == "group":
            keep = keep & ~_all_equal(grouped, valid)[:, None]
        # Kept values all equal (or fewer than two): no signal, exact zeros (their float32
        # mean need not equal them, and (A - mean) / (0 + eps) would be rounding / eps).
        high = jnp.max(jnp.where(keep, advantages, -jnp.inf))
        low = jnp.min(jnp.where(keep, advantages, jnp.inf))
        keep = keep & (high > low)
        count = jnp.sum(keep)
        mean = jnp.sum(jnp.where(keep, advantages, 0)) / jnp.maximum(count, 1)
        var = jnp.sum(jnp.where(keep, jnp.square(advantages - mean), 0)) / jnp.maximum(count - 1, 1)
        advantages = jnp.where(keep, (advantages - mean) / (jnp.sqrt(var) + eps), 0)
    return advantages.reshape(-1)


def zero_variance_groups(rewards: Array, group_size: int, valid: Array | None = None) -> Array:
    """Which groups have all-equal rewards (for DAPO's dynamic sampling, Magistral's filter).

    Args:
      rewards: ``[N]`` rewards laid out group after group.
      group_size: G.
      valid: optional ``[N]`` bool: only these rewards are compared (see
        ``outcome_advantages``); a group with fewer than two valid rewards counts as
        all-equal.

    Returns:
      ``[N // G]`` bool, True where every (valid) reward of the group is exactly equal
      (their advantages are zero and they carry no gradient).
    """
    grouped = _group_rewards(rewards, group_size)
    return _all_equal(grouped, _group_valid(valid, grouped))


def _group_valid(valid: Array | None, grouped: Array) -> Array | None:
    """``valid`` as ``[N / G, G]`` bool (None stays None: every sample)."""
    if valid is None:
        return None
    valid = jnp.asarray(valid)
    if valid.shape != (grouped.size,):
        raise ValueError(
            f"valid must be [N] = [{grouped.size}] like rewards, got shape {valid.shape}"
        )
    return valid.astype(bool).reshape(grouped.shape)


def _all_equal(grouped: Array, valid: Array | None) -> Array:
    """``[N / G]``: the group's (valid) rewards are all equal (or fewer than two)."""
    if valid is None:
        return jnp.max(grouped, axis=1) == jnp.min(grouped, axis=1)
    high = jnp.max(jnp.where(valid, grouped, -jnp.inf), axis=1)
    low = jnp.min(jnp.where(valid, grouped, jnp.inf), axis=1)
    return (high <= low) | (jnp.sum(valid, axis=1) < 2)


def _group_mean(grouped: Array, valid: Array | None) -> Array:
    if valid is None:
        return jnp.mean(grouped, axis=1, keepdims=True)
    count = jnp.maximum(jnp.sum(valid, axis=1, keepdims=True), 1)
    return jnp.sum(jnp.where(valid, grouped, 0.0), axis=1, keepdims=True) / count


def masked_whiten(x: Array, mask: Array, *, shift_mean: bool = True, eps: float = 1e-8) -> Array:
    """``(x - mean) / sqrt(var + eps)`` over valid positions (PPO advantage whitening).

    Mean and (population, ddof 0) variance over all valid entries; with
    ``shift_mean=False`` the mean is added back (scale only). Padding positions are 0.
    """
    mask_f = (jnp.asarray(mask) > 0).astype(jnp.result_type(x, jnp.float32))
    mean = masked_mean(x, mask_f)
    whitened = (x - mean) * jax.lax.rsqrt(masked_var(x, mask_f) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(mask_f > 0, whitened, 0)


# ----------------------------------------------------------------------------------------
# GAE.
# ----------------------------------------------------------------------------------------


def length_adaptive_lambda(lengths: Array, alpha: float = 0.05, *, min_lam: float = 0.0) -> Array:
    """VAPO's length-adaptive GAE lambda (2504.05118): ``1 - 1 / (alpha * l)``.

    The paper gives no rule for ``alpha * l <= 1`` (where the formula is <= 0, and
    undefined at l = 0): the result is clamped below at ``min_lam`` (default 0, i.e.
    one-step TD advantages ``r_t + gamma V_{t+1} - V_t`` for very short responses). With
    alpha = 0.05 the clamp changes only responses shorter than 20 tokens: at l = 20 the
    formula itself gives exactly 0.

    Args:
      lengths: ``[B]`` response lengths (number of valid tokens).
      alpha: the paper's alpha (0.05).
      min_lam: lower clamp.

    Returns:
      ``[B]`` float32 lambdas in ``[min_lam, 1)``.
    """
    scaled = alpha * jnp.asarray(lengths, jnp.float32)
    lam = 1.0 - 1.0 / jnp.where(scaled > 0, scaled, 1.0)
    return jnp.where(scaled > 0, jnp.maximum(lam, min_lam), min_lam)


def _scalar_or_per_sequence(lam, batch: int, dtype) -> Array:
    lam = jnp.asarray(lam, dtype)
    if lam.ndim != 0 and lam.shape != (batch,):
        raise ValueError(f"lam must be a float or a [B]={batch} array, got shape {lam.shape}")
    return lam


def _per_sequence(lam, batch: int, dtype) -> Array:
    lam = _scalar_or_per_sequence(lam, batch, dtype)
    return jnp.full((batch,), lam, dtype) if lam.ndim == 0 else lam


def _gae_scan(rewards, values, mask, gamma, lam_actor, lam_critic, unroll):
    """Reverse ``lax.scan`` over time; carry = (next valid value, actor GAE, critic GAE)."""
    batch = rewards.shape[0]

    def step(carry, inputs):
        next_value, adv_actor, adv_critic = carry
        reward, value, valid = inputs
        delta = reward + gamma * next_value - value
        new_actor = delta + gamma * lam_actor * adv_actor
        new_critic = delta + gamma * lam_critic * adv_critic
        carry = (
            jnp.where(valid, value, next_value),
            jnp.where(valid, new_actor, adv_actor),
            jnp.where(valid, new_critic, adv_critic),
        )
        return carry, (jnp.where(valid, new_actor, 0), jnp.where(valid, new_critic, 0))

    zeros = jnp.zeros((batch,), rewards.dtype)
    _, (adv_actor, adv_critic) = jax.lax.scan(
        step, (zeros, zeros, zeros), (rewards.T, values.T, mask.T), reverse=True, unroll=unroll
    )
    return adv_actor.T, adv_critic.T


def _affine_compose(later, earlier):
    """Compose reverse affine recurrences ``x_t = a_t x_{t+1} + b_t`` (associative)."""
    a_later, b_later = later
    a_earlier, b_earlier = earlier
    return a_earlier * a_later, a_earlier * b_later + b_earlier


def _reverse_affine_scan(coeffs, offsets):
    """Solves ``x_t = coeffs_t * x_{t+1} + offsets_t`` backwards along axis 1, ``x_T = 0``."""
    _, solution = jax.lax.associative_scan(_affine_compose, (coeffs, offsets), reverse=True, axis=1)
    return solution


def _contiguous_rows(valid: Array) -> Array:
    """True when every row's valid positions form one run (no holes), e.g. right padding."""
    starts = valid & ~jnp.pad(valid[:, :-1], ((0, 0), (1, 0)))
    return jnp.all(jnp.sum(starts, axis=1) <= 1)


def _discounts(q: Array, exponents: Array) -> Array:
    """``q ** exponents`` for ``q >= 0`` and integer exponents >= 0 (``0 ** 0 = 1``)."""
    return jnp.power(q, exponents.astype(q.dtype))


def _discounted_suffix_sums(x: Array, q: Array, chunk: int) -> Array:
    """``y_t = sum_{t' >= t} q^(t' - t) x_{t'}`` along axis 1 of ``x`` ``[B, T]``, blocked.

    The solution of ``y_t = x_t + q y_{t+1}``, ``y_T = 0``, by matrix products instead of
    ``T`` sequential steps. ``q`` is a scalar or one factor per row ``[B]``. With
    ``C = chunk`` and chunk ``j`` holding positions ``jC .. jC + C - 1``:

    1. inside each chunk, ``local = x @ D`` with the ``C x C`` discount matrix
       ``D[c, k] = q^(c - k)`` for ``c >= k``, else 0 (one product for all rows and chunks;
       a batched product, one matrix per row, when ``q`` is per row);
    2. the solution at the chunk starts solves the same problem one level up,
       ``s_j = local_{j, 0} + q^C s_{j+1}``: a recursive call on ``[B, T / C]`` with
       factor ``q^C`` (so ``log_C T`` levels, no sequential loop);
    3. ``y = local + q^(C - k) s_{j+1}`` at offset ``k`` of chunk ``j``.

    The same products and sums as the recurrence, added in another order; products in
    float32 at ``Precision.HIGHEST`` (as on CPU, also on GPU/TPU).
    """
    batch, length = x.shape
    pad = (-length) % chunk
    if pad:  # zeros past the end add nothing to any suffix sum
        x = jnp.pad(x, ((0, 0), (0, pad)))
    num_chunks = (length + pad) // chunk
    blocks = x.reshape(batch, num_chunks, chunk)
    offsets = jnp.arange(chunk)
    lags = offsets[:, None] - offsets[None, :]  # [c, k]: c - k
    q_lags = q if q.ndim == 0 else q[:, None, None]
    matrix = jnp.where(lags >= 0, _discounts(q_lags, jnp.maximum(lags, 0)), 0)
    spec = "bjc,ck->bjk" if q.ndim == 0 else "bjc,bck->bjk"
    local = jnp.einsum(spec, blocks, matrix, precision=jax.lax.Precision.HIGHEST)
    if num_chunks == 1:
        return local.reshape(batch, chunk)[:, :length]
    starts = _discounted_suffix_sums(local[:, :, 0], _discounts(q, jnp.asarray(chunk)), chunk)
    carry_in = jnp.pad(starts[:, 1:], ((0, 0), (0, 1)))  # s_{j+1}, 0 after the last chunk
    q_rows = q if q.ndim == 0 else q[:, None]
    tail = _discounts(q_rows, chunk - offsets)  # [C] or [B, C]: q^(C - k)
    solution = local + carry_in[:, :, None] * (tail if q.ndim == 0 else tail[:, None, :])
    return solution.reshape(batch, length + pad)[:, :length]


def _gae_blocked(rewards, values, mask, gamma, lam_actor, lam_critic, chunk):
    """GAE as discounted suffix sums, for masks whose rows have no holes.

    When each row's valid positions form one run, the next valid position after a valid
    ``t`` is ``t + 1`` if it is valid (else none: ``V = 0``), so
    ``delta_t = r_t + gamma m_{t+1} V_{t+1} - V_t`` and ``A_t = sum_{t' >= t}
    (gamma lam)^(t' - t) delta_{t'}`` with ``delta = 0`` off the run
    (``_discounted_suffix_sums``). ``lam_*`` are scalars or ``[B]``. Returns
    ``(advantages, returns)``.
    """
    next_value = jnp.pad(jnp.where(mask[:, 1:], values[:, 1:], 0), ((0, 0), (0, 1)))
    delta = jnp.where(mask, rewards + gamma * next_value - values, 0)
    adv_actor = _discounted_suffix_sums(delta, gamma * lam_actor, chunk)
    if lam_critic is lam_actor:
        adv_critic = adv_actor
    else:
        adv_critic = _discounted_suffix_sums(delta, gamma * lam_critic, chunk)
    return jnp.where(mask, adv_actor, 0), jnp.where(mask, adv_critic + values, 0)


def _gae_associative(rewards, values, mask, gamma, lam_actor, lam_critic):
    """GAE as two parallel affine scans (``jax.lax.associative_scan``), O(log T) depth.

    Next valid value: ``N_t = m_t V_t + (1 - m_t) N_{t+1}``, ``N_T = 0``; then
    ``delta_t = r_t + gamma N_{t+1} - V_t`` and
    ``A_t = m_t delta_t + (m_t gamma lam + 1 - m_t) A_{t+1}`` (carried over padding).
    """
    valid = mask > 0
    carried = jnp.where(valid, 0.0, 1.0).astype(rewards.dtype)
    next_valid_value = _reverse_affine_scan(carried, jnp.where(valid, values, 0))
    next_value = jnp.concatenate(
        [next_valid_value[:, 1:], jnp.zeros_like(next_valid_value[:, :1])], axis=1
    )
    delta = jnp.where(valid, rewards + gamma * next_value - values, 0)
    coeff_actor = jnp.where(valid, gamma * lam_actor[:, None], 1.0)
    adv_actor = _reverse_affine_scan(coeff_actor, delta)
    if lam_critic is lam_actor:
        adv_critic = adv_actor
    else:
        coeff_critic = jnp.where(valid, gamma * lam_critic[:, None], 1.0)
        adv_critic = _reverse_affine_scan(coeff_critic, delta)
    return jnp.where(valid, adv_actor, 0), jnp.where(valid, adv_critic, 0)


def decoupled_gae(
    rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float = 1.0,
    lam_actor=0.95,
    lam_critic=1.0,
    impl: str = "blocked",
    unroll: int = 1,
    chunk: int = 16,
) -> tuple[Array, Array]:
    """GAE with separate lambdas for the policy and the critic, in one pass (VC-PPO).

    ``delta_t = r_t + gamma V_{t'} - V_t`` with ``t'`` the next *valid* position after t
    (``V = 0`` past the last one: the episode ends with the response), and
    ``A_t = sum_l (gamma lam)^l delta_{t+l}`` over valid positions only: the recurrence
    ``A_t = delta_t + gamma lam A_{t'}`` skips positions where ``mask`` is 0 (after EOS,
    padding, tool output), whose inputs are never read. Policy advantages use
    ``lam_actor``; value targets are ``A^{lam_critic}_t + V_t`` (VC-PPO 2503.01491:
    lam_critic = 1.0, lam_actor in [0.95, 1)). No whitening (see ``masked_whiten``).

    Args:
      rewards: ``[B, T]`` per-token rewards (outcome reward on the last valid token, KL
        shaping, ...).
      values: ``[B, T]`` critic values ``V(s_t)``.
      mask: ``[B, T]`` 1 on valid tokens.
      gamma: discount (1.0 for LLMs).
      lam_actor, lam_critic: a float or a per-sequence ``[B]`` array each.
      impl: ``"blocked"`` (default, fastest on CPU: chunked matrix products when no row
        of ``mask`` has a hole, e.g. right padding; otherwise ``"scan"``, chosen at run
        time with ``lax.cond``), ``"scan"`` (the reference: a reverse ``lax.scan`` over
        time) or ``"associative"`` (``lax.associative_scan``); equal up to float rounding.
      unroll: scan unroll factor (``impl="scan"``, and ``"blocked"`` when it falls back).
      chunk: block length of ``impl="blocked"`` (``chunk x chunk`` discount matrices,
        applied recursively over ``log_chunk(T)`` levels; needs ``gamma * lam >= 0``).

    Returns:
      ``(advantages, returns)``, ``[B, T]`` each, 0 at padding positions.
    """
    rewards = jnp.asarray(rewards)
    dtype = jnp.result_type(rewards, jnp.float32)
    if jnp.shape(values) != rewards.shape or jnp.shape(mask) != rewards.shape:
        raise ValueError(
            f"rewards {rewards.shape}, values {jnp.shape(values)} and mask {jnp.shape(mask)} "
            "must all be [B, T]"
        )
    rewards = rewards.astype(dtype)
    values = jnp.asarray(values, dtype)
    valid = jnp.asarray(mask) > 0
    batch = rewards.shape[0]
    # The same lambda (the same array, or equal Python / NumPy numbers) runs one recurrence.
    same_lam = lam_actor is lam_critic or (
        isinstance(lam_actor, numbers.Real)
        and isinstance(lam_critic, numbers.Real)
        and float(lam_actor) == float(lam_critic)
    )
    if same_lam:
        lam_critic = lam_actor
    if impl == "blocked":  # scalar lambdas stay scalar: one matrix shared by all rows
        lam_actor = _scalar_or_per_sequence(lam_actor, batch, dtype)
        lam_critic = lam_actor if same_lam else _scalar_or_per_sequence(lam_critic, batch, dtype)

        def scan():
            adv_actor, adv_critic = _gae_scan(
                rewards,
                values,
                valid,
                gamma,
                _per_sequence(lam_actor, batch, dtype),
                _per_sequence(lam_critic, batch, dtype),
                unroll,
            )
            return adv_actor, jnp.where(valid, adv_critic + values, 0)

        return jax.lax.cond(
            _contiguous_rows(valid),
            lambda: _gae_blocked(rewards, values, valid, gamma, lam_actor, lam_critic, chunk),
            scan,
        )
    lam_actor = _per_sequence(lam_actor, batch, dtype)
    lam_critic = lam_actor if same_lam else _per_sequence(lam_critic, batch, dtype)
    if impl == "scan":
        adv_actor, adv_critic = _gae_scan(
            rewards, values, valid, gamma, lam_actor, lam_critic, unroll
        )
    elif impl == "associative":
        adv_actor, adv_critic = _gae_associative(
            rewards, values, valid, gamma, lam_actor, lam_critic
        )
    else:
        raise ValueError(f"impl={impl!r} is not one of {GAE_IMPLS}")
    returns = jnp.where(valid, adv_critic + values, 0)
    return adv_actor, returns


def gae(
    rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float = 1.0,
    lam=0.95,
    impl: str = "blocked",
    unroll: int = 1,
    chunk: int = 16,
) -> tuple[Array, Array]:
    """Generalised advantage estimation (1506.02438 eq. 16) over valid tokens.

    ``A_t = sum_l (gamma lam)^l delta_{t+l}``, ``delta_t = r_t + gamma V_{t'} - V_t``, returns
    ``A_t + V_t``; masked positions are skipped (see ``decoupled_gae``, which this calls with
    ``lam_actor = lam_critic = lam``). Classic PPO for LLMs: gamma 1.0, lam 0.95.

    Args:
      rewards, values, mask: ``[B, T]``.
      gamma: discount.
      lam: a float or a per-sequence ``[B]`` array.
      impl, unroll, chunk: see ``decoupled_gae``.

    Returns:
      ``(advantages, returns)``, ``[B, T]`` each, 0 at padding positions.
    """
    return decoupled_gae(
        rewards,
        values,
        mask,
        gamma=gamma,
        lam_actor=lam,
        lam_critic=lam,
        impl=impl,
        unroll=unroll,
        chunk=chunk,
    )


def length_adaptive_gae(
    rewards: Array,
    values: Array,
    mask: Array,
    *,
    gamma: float = 1.0,
    alpha: float = 0.05,
    lam_critic=1.0,
    min_lam: float = 0.0,
    impl: str = "blocked",
    unroll: int = 1,
    chunk: int = 16,
) -> tuple[Array, Array]:
    """VAPO's GAE: policy lambda ``1 - 1/(alpha |y_i|)`` per sequence, critic lambda 1.0.

    See ``length_adaptive_lambda`` (clamping when ``alpha |y_i| <= 1``) and ``decoupled_gae``.
    """
    lengths = jnp.sum(jnp.asarray(mask) > 0, axis=-1)
    lam_actor = length_adaptive_lambda(lengths, alpha, min_lam=min_lam)
    return decoupled_gae(
        rewards,
        values,
        mask,
        gamma=gamma,
        lam_actor=lam_actor,
        lam_critic=lam_critic,
        impl=impl,
        unroll=unroll,
        chunk=chunk,
    )


# ---- The estimators by name (``config.algo.advantage``) --------------------------------------

# What an estimator computes from, and what the run around it provides:
# - "outcome": ``fn(rewards [N], group_size, *, valid [N] bool or None, algo) -> [N]``, one
#   advantage per sequence from the rewards, group after group; no critic.
# - "gae": ``fn(rewards [R], values [R, N], mask [R, N], algo) -> (advantages [R, N],
#   returns [R, N], metrics)``, per-token advantages and value targets from a critic's values
#   (the run builds and trains the critic: ``config.critic``).
# ``algo`` is the config's ``algo`` section (its fields and objective settings).
KINDS = ("outcome", "gae")


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator: its function (or ``"module:function"``, imported
    on first use), its ``kind`` (``KINDS``) and where it was registered."""

    name: str
    fn: Callable | str
    kind: str
    where: str

    def function(self) -> Callable:
        if callable(self.fn):
            return self.fn
        module, _, name = self.fn.partition(":")
        return getattr(importlib.import_module(module), name)


ESTIMATORS: Registry = Registry("estimator")


def register_estimator(name: str, fn: Callable | str | None = None, *, kind: str = "outcome"):
    """Registers ``fn`` as ``algo.advantage=name``; ``kind`` says what it computes from
    (``KINDS``, the comment above them): ``"outcome"`` (rewards, group by group) or
    ``"gae"`` (a critic's values: the run trains a critic for it). Also a decorator. An
    unregistered ``algo.advantage`` is a config error, never a fallback; a name registered
    twice is an error naming both places."""
    where = caller()
    if kind not in KINDS:
        raise ValueError(f"estimator {name!r} ({where}): kind must be one of {KINDS}, got {kind!r}")

    def add(fn):
        if not (callable(fn) or (isinstance(fn, str) and ":" in fn)):
            raise ValueError(
                f"estimator {name!r} ({where}): fn must be callable or 'module:function', "
                f"got {fn!r}"
            )
        ESTIMATORS.add(name, Estimator(name, fn, kind, where))
        return fn

    return add if fn is None else add(fn)


def uses_critic(name: str) -> bool:
    """Whether estimator ``name`` (registered) computes from a critic's values."""
    return ESTIMATORS[name].kind == "gae"


def group_outcome(rewards: Array, group_size: int, *, valid: Array | None = None, algo) -> Array:
    """The ``"outcome"`` estimator: ``outcome_advantages`` centred and scaled by ``algo``'s
    ``adv_center`` and ``adv_scale`` (``"minibatch"``, Magistral's, only centres here: the
    trainer scales each minibatch, ``policyopt.rl.update.methods.minibatch_advantages``) with
    ``adv_eps``."""
    scale = "none" if algo.adv_scale == "minibatch" else algo.adv_scale
    return outcome_advantages(
        rewards, group_size, center=algo.adv_center, scale=scale, eps=algo.adv_eps, valid=valid
    )


register_estimator("outcome", group_outcome, kind="outcome")
# GAE on the critic's values (GAE 1506.02438; VC-PPO's decoupled and VAPO's length-adaptive
# lambdas): ``policyopt.rl.update.critic.gae_targets``, which lives with the critic.
register_estimator("gae", "policyopt.rl.update.critic:gae_targets", kind="gae")
