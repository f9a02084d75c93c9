"""The method-specific steps of an RL iteration, chosen once when the run is built.

``choose(config, is_moe)`` reads ``config.algo`` and returns ``Methods``, a frozen record
of small functions that the stages of ``policyopt.rl.loop.iteration`` call without asking
which method they run:

- ``old_log_probs``: pi_old from the trainer's forward (``algo.old_log_probs =
  "trainer"``) or the sampler's behaviour log-probs (``"sampler"``);
- ``correction``: the rollout correction between sampler and trainer, truncated
  importance weights and rejection sampling (``algo.tis_*``, ``algo.rs_*``;
  docs/algorithms.md), or None when pi_old is the sampler's;
- ``advantages``: the registered estimator of ``algo.advantage``
  (``advantages.register_estimator``): group statistics of the outcome rewards (GRPO,
  DAPO, Dr. GRPO, GSPO, SAPO, Magistral) or the critic's values and GAE (PPO, VC-PPO,
  VAPO), or one of a user's, by its kind;
- ``minibatch_advantages``: Magistral's advantages normalised per minibatch
  (``algo.adv_scale = "minibatch"``), or None;
- ``old_replay`` and ``update_replay``: the routing that the old-log-prob forward and the
  updates replay (R2, R3; MoE only);
- ``nll_weights``: the rows of VAPO's NLL term (its correct samples), or None.

Packing and micro-batches are not chosen here: ``config.batch.pack`` is read by
``forwards.pack_rows``, and ``batch.micro_batch_tokens`` by the learner's update.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from policyopt import sharding
from policyopt.advantages import ESTIMATORS, outcome_advantages
from policyopt.config import Algo, typed
from policyopt.losses import offpolicy_metrics, rejection_mask, truncated_importance_weights
from policyopt.rl.update import forwards


@dataclasses.dataclass(frozen=True)
class Methods:
    """The method-specific steps of an iteration (``choose``); see the module docstring.

    Attributes:
      old_log_probs: ``(learner, params, rows, chunks, behaviour, replay) -> (old_log_probs
        [R, N], routing used [L, R, S, k] or None)``; ``rows``: a ``Batch`` whose tokens,
        positions and masks are set, ``chunks``: ``forwards.chunk_layouts``.
      correction: ``(old_log_probs, behaviour, mask) -> (weights or None, loss_mask or None,
        metrics)`` (``rollout_correction``), or None.
      advantages: ``(spec, state, rows, chunks, rewards [R], valid, warming_up) ->
        (advantages [R] or [R, N], returns or None, old_values or None, metrics)``.
      minibatch_advantages: ``(rewards [R_mb], valid) -> advantages [R_mb]``, or None.
      old_replay: ``sampler_routing -> routing`` replayed by the old-log-prob forward.
      update_replay: ``(sampler_routing, old_routing) -> routing`` replayed by the updates.
      nll_weights: ``correct [R] bool -> [R] float32``, or None.
    """

    old_log_probs: Callable
    correction: Callable | None
    advantages: Callable
    minibatch_advantages: Callable | None
    old_replay: Callable
    update_replay: Callable
    nll_weights: Callable | None


def choose(config, *, is_moe: bool) -> Methods:
    """The ``Methods`` of ``config.algo`` (fields checked by ``configs/base.check``)."""
    algo, group = config.algo, config.batch.group_size
    from_trainer = algo.old_log_probs == "trainer"
    estimator = ESTIMATORS[algo.advantage]  # registered: checked with the config
    critic = estimator.kind == "gae"
    replay = algo.routing_replay if is_moe else "none"
    correction = None
    if from_trainer:
        correction = functools.partial(rollout_correction, algo=algo)
    if critic:
        advantages = functools.partial(gae_advantages, config, estimator.function())
    else:  # Magistral's minibatch scale: the batch is centred only, each minibatch scales
        advantages = functools.partial(
            group_advantages, estimator=estimator.function(), group_size=group, algo=algo
        )
    per_minibatch = None
    if algo.adv_scale == "minibatch" and not critic:
        per_minibatch = functools.partial(
            minibatch_advantages, group_size=group, center=algo.adv_center, eps=algo.adv_eps
        )
    return Methods(
        old_log_probs=trainer_old_log_probs if from_trainer else sampler_old_log_probs,
        correction=correction,
        advantages=advantages,
        minibatch_advantages=per_minibatch,
        old_replay=(lambda sampler: sampler) if replay == "R3" else (lambda sampler: None),
        update_replay={
            "none": lambda sampler, old: None,
            "R2": lambda sampler, old: old,
            "R3": lambda sampler, old: sampler,
        }[replay],
        nll_weights=_correct_rows if algo.nll_coef > 0 else None,
    )


def trainer_old_log_probs(learner, params, rows, chunks, behaviour, replay):
    """pi_old from the trainer's forward (the minibatch's shape, ``forwards``), replaying
    ``replay`` (R3) or recording the routing it uses (R2)."""
    del behaviour
    return forwards.policy_log_probs(learner, params, rows, chunks, replay)


def sampler_old_log_probs(learner, params, rows, chunks, behaviour, replay):
    """pi_old = the sampler's behaviour log-probs (no forward pass, no routing recorded)."""
    del learner, params, rows, chunks, replay
    return behaviour, None


def _correct_rows(correct: np.ndarray) -> jax.Array:
    """VAPO's NLL term (2504.05118) covers the correct samples: weight 1 on them."""
    return sharding.shard_rows(correct.astype(np.float32))


def group_advantages(
    spec, state, rows, chunks, rewards, valid, warming_up, *, estimator, group_size: int, algo: Algo
):
    """Outcome advantages of an ``"outcome"`` estimator (the built-in's: group statistics,
    ``advantages.group_outcome``): ``(advantages [R], None, None, {})``; no critic, no
    forward pass."""
    del spec, state, rows, chunks, warming_up
    return estimator(rewards, group_size, valid=valid, algo=algo), None, None, {}


@functools.lru_cache(maxsize=None)
def _jitted(targets):
    """``targets`` jitted once per response bucket (the algo section is static and
    hashable)."""
    return jax.jit(targets, static_argnames="algo")


def gae_advantages(config, targets, spec, state, rows, chunks, rewards, valid, warming_up):
    """The critic's values of the rollout (in the minibatch's shape) and the advantages and
    value targets of a ``"gae"`` estimator (the built-in's: ``critic.gae_targets``), with
    ``gae_settings``: ``(advantages [R, N], returns [R, N], old_values [R, N], metrics)``."""
    del valid  # a sample left out of scoring has a zero mask: no GAE target
    old_values = forwards.critic_values(
        spec.critic, state.critic.params, rows, chunks, frozen=spec.critic_frozen
    )
    advantages, returns, metrics = _jitted(targets)(
        rewards, old_values, rows.mask, algo=gae_settings(config, pretraining=warming_up)
    )
    return advantages, returns, old_values, jax.device_get(metrics)


def gae_settings(config, *, pretraining: bool) -> Algo:
    """The ``algo`` section GAE runs with in an iteration: ``config.algo``, except that value
    pretraining trains the critic on Monte-Carlo returns, ``lambda_critic = 1`` (VC-PPO
    2503.01491, docs/algorithms.md), whatever ``algo.gae_lambda_critic`` the later PPO
    updates use."""
    algo = typed(config).algo
    return dataclasses.replace(algo, gae_lambda_critic=1.0) if pretraining else algo


def minibatch_advantages(
    rewards, group_size: int, *, center: str = "group", eps: float = 1e-6, valid=None
):
    """Magistral's advantages (2506.10910 §2.1): ``A = R - mean(R_group)``, then
    ``(A - mean_mb(A)) / std_mb(A)`` over the sequences of one minibatch.

    Magistral drops groups whose rewards are all equal before forming the batch, so their
    rows (advantage 0 either way) count in neither ``mean_mb`` nor ``std_mb``: computed
    from the minibatch's rewards with ``outcome_advantages(scale="batch")``, which leaves
    zero-variance groups out of the batch statistics. Minibatches hold whole groups.

    Args:
      rewards: ``[R]`` rewards of the minibatch's rows, group after group.
      group_size: G.
      center: ``"group"`` (Magistral) or ``"none"``.
      eps: added to the minibatch std.
      valid: optional ``[R]`` bool, False for samples left out of every statistic (a
        missed scoring deadline; ``outcome_advantages``).

    Returns:
      ``[R]`` advantages.
    """
    return outcome_advantages(
        rewards, group_size, center=center, scale="batch", eps=eps, valid=valid
    )


@functools.partial(jax.jit, static_argnames="algo")
def rollout_correction(old_log_probs, behaviour_log_probs, mask, algo: Algo):
    """Importance weights, the loss mask of rejection sampling, and metrics, by the ``algo``
    section's ``tis_*`` and ``rs_*`` fields (docs/algorithms.md).

    Returns:
      ``(weights, loss_mask, metrics)``: truncated importance weights ``[R, N]`` (None
      without ``tis_cap``), the tokens rejection sampling keeps ``[R, N]`` (None without
      ``rs_level`` and ``rs_veto``), and ``offpolicy/*`` metrics: ``losses.offpolicy_metrics``
      (KL, PPL ratio, chi-square between mu and pi_old), ``is_truncated_frac`` (valid tokens
      whose weight the cap set), ``rs_rejected_token_frac`` and ``rs_rejected_seq_frac``
      (valid tokens, and non-empty sequences wholly, left out of the policy loss).
    """
    metrics = {
        f"offpolicy/{k}": v
        for k, v in offpolicy_metrics(old_log_probs, behaviour_log_probs, mask).items()
    }
    valid = mask > 0
    n_tokens = jnp.maximum(jnp.sum(valid), 1)
    weights = loss_mask = None
    if algo.tis_cap is not None:
        weights = truncated_importance_weights(
            old_log_probs, behaviour_log_probs, mask, cap=algo.tis_cap, level=algo.tis_level
        )
        metrics["offpolicy/is_truncated_frac"] = (
            jnp.sum(valid & (weights >= algo.tis_cap)) / n_tokens
        )
    if algo.rs_level is not None or algo.rs_veto is not None:
        loss_mask = rejection_mask(
            old_log_probs,
            behaviour_log_probs,
            mask,
            level=algo.rs_level,
            upper=algo.rs_upper,
            lower=algo.rs_lower,
            veto=algo.rs_veto,
        )
        kept = loss_mask > 0
        metrics["offpolicy/rs_rejected_token_frac"] = 1 - jnp.sum(kept) / n_tokens
        non_empty = jnp.any(valid, axis=-1)
        metrics["offpolicy/rs_rejected_seq_frac"] = jnp.sum(
            non_empty & ~jnp.any(kept, axis=-1)
        ) / jnp.maximum(jnp.sum(non_empty), 1)
    return weights, loss_mask, metrics
