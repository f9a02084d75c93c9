"""The critic of PPO, VC-PPO and VAPO: a value model, its jitted steps, and GAE targets.

The value model is a backbone (the policy's, or a model of its own:
``critic.init_checkpoint``) with a scalar head (zeros at the start, so every first value is
0), its values aligned with the log-probs (``values[:, t]`` is the state before token
``t``); ``gae_targets`` puts the outcome reward on the last response token and
gives the policy's advantages (lambda_actor, fixed or VAPO's length-adaptive) and the value
targets (lambda_critic); ``reward_model_targets`` fits it as an outcome reward model first
(``critic.reward_model_iterations``); ``Critic.update`` is PPO's clipped value loss through
the policy's non-finite guard. The choices and their reasons: docs/algorithms.md,
"The critic (value model)".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from policyopt.advantages import decoupled_gae, length_adaptive_lambda, masked_whiten
from policyopt.config import Algo, Optim, typed
from policyopt.config import Batch as BatchSection
from policyopt.config import Critic as CriticSection
from policyopt.losses import (
    aggregation_weights,
    explained_variance,
    masked_mean,
    masked_var,
    value_loss,
)
from policyopt.models import lora
from policyopt.rl.batch import Batch
from policyopt.rl.update import micro_batches
from policyopt.rl.update.learner import TrainState, guarded_update, optimizer_of, packed_forward
from policyopt.rl.update.packing import gather_slots


def init_critic_params(policy_params, hidden_size: int) -> dict:
    """Critic parameters: a copy of the policy's parameters and a zero value head.

    Args:
      policy_params: the policy's initial ``nnx.State`` (copied: the policy's buffers are
        donated to its update, the critic must not share them).
      hidden_size: D.

    Returns:
      ``{"backbone": nnx.State, "head": {"kernel": float32 [D], "bias": float32 []}}``.
    """
    backbone = jax.tree.map(jnp.copy, policy_params)
    head = {"kernel": jnp.zeros((hidden_size,), jnp.float32), "bias": jnp.zeros((), jnp.float32)}
    return {"backbone": backbone, "head": head}


def forward_values(
    graphdef,
    params: dict,
    tokens,
    positions,
    attention_mask,
    num_response: int,
    *,
    return_aux: bool = False,
    packing=None,
    frozen=None,
):
    """Values ``V(s_t)`` of the states before each response token of a training-layout batch.

    ``V(s_t) = h[P - 1 + t] . w + b`` with ``h`` the backbone's final hidden states and
    ``P = S - num_response``: the column that predicts response token ``t`` (the alignment
    of ``learner.forward_log_probs``), in float32.

    Args:
      graphdef: the backbone's structure (the policy's ``GraphDef``).
      params: critic parameters (``init_critic_params``).
      tokens, positions, attention_mask: ``[R, S]``.
      num_response: N.

      return_aux: also return the backbone's auxiliary outputs (MoE: ``load_balancing_loss``,
        ``router_z_loss``, ``dropped_tokens``; empty for a dense backbone).
      packing: a ``packing.PackedLayout`` of these rows: the backbone runs on the packed
        rows and the values of columns ``P - 1 .. S - 2`` are read back from their slots
        (0 where the response token is padding); equal results.
      frozen: the base the backbone's adapters join (LoRA, ``model.lora.critic =
        "adapters"``: the policy's frozen base, shared), or None (full weights).

    Returns:
      float32 ``[R, N]`` values (not masked), and the aux dict when ``return_aux``.
    """
    model = nnx.merge(graphdef, lora.combine(frozen, params["backbone"]))
    head = params["head"]

    def value_of(hidden):
        return jnp.einsum("rnd,d->rn", hidden.astype(jnp.float32), head["kernel"]) + head["bias"]

    start = tokens.shape[1] - num_response - 1
    if packing is None:
        out = model(tokens, positions=positions, attention_mask=attention_mask, return_logits=False)
        values = value_of(jax.lax.slice_in_dim(out.hidden, start, start + num_response, axis=1))
    else:
        out, _ = packed_forward(model, tokens, positions, packing)
        valid = packing.target[:, start + 1 :] >= 0  # response token real
        index = jnp.where(valid, packing.target[:, start : start + num_response], -1)
        values = gather_slots(value_of(out.hidden), index)  # [N_p, T] -> [R, N]
    return (values, out.aux or {}) if return_aux else values


class CriticSettings(NamedTuple):
    """The sections the value loss reads (hashable: part of a Critic's cache key):
    ``critic`` (the value clip), ``algo`` (the MoE backbone's ``load_balancing_coef``, the
    policy's) and ``batch`` (micro-batches). Checked when the config is
    (``policyopt.config``)."""

    critic: CriticSection
    algo: Algo
    batch: BatchSection

    @classmethod
    def of(cls, config) -> "CriticSettings":
        return cls(config.critic, config.algo, config.batch)

    @property
    def value_clip(self) -> float | None:
        return self.critic.value_clip

    @property
    def load_balancing_coef(self) -> float:
        """The MoE backbone's load-balancing loss in the critic's loss (0 = off, the loss is
        still reported)."""
        return self.algo.load_balancing_coef

    @property
    def micro_batch_tokens(self) -> int | None:
        """Tokens per micro-batch of an update (None: one pass over the minibatch)."""
        return self.batch.micro_batch_tokens or None

    # The value loss is a token mean over the minibatch (verl's and OpenRLHF's; the papers
    # do not say): not a config field.
    aggregation = "token_mean"


def critic_optim(config) -> Optim:
    """The critic's optimiser settings: ``config.critic.lr`` / ``warmup_steps`` /
    ``weight_decay``, Adam's betas, eps and gradient clipping shared with ``config.optim``
    (the policy's ``router_lr_scale`` is not)."""
    config = typed(config)
    return dataclasses.replace(
        config.optim,
        lr=float(config.critic.lr),
        warmup_steps=int(config.critic.warmup_steps),
        weight_decay=float(config.critic.weight_decay),
        router_lr_scale=1.0,
    )


def critic_loss(
    graphdef, params, batch: Batch, settings: CriticSettings, frozen=None
) -> tuple[jax.Array, dict]:
    """The value loss of one minibatch (``batch.old_values`` and ``batch.returns`` set),
    plus ``load_balancing_coef`` times the MoE backbone's load-balancing loss (as the
    policy's update adds it; ``critic/moe_load_balancing_loss`` reports it)."""
    values, aux = forward_values(
        graphdef,
        params,
        batch.tokens,
        batch.positions,
        batch.attention_mask,
        batch.num_response,
        return_aux=True,
        packing=batch.packing,
        frozen=frozen,
    )
    return critic_objective(values, aux, batch, settings)


def critic_objective(
    values, aux: dict, batch: Batch, settings: CriticSettings
) -> tuple[jax.Array, dict]:
    """``critic_loss`` from the critic's values ``[R, N]`` and backbone aux on ``batch``."""
    loss, metrics = value_loss(
        values,
        batch.old_values,
        batch.returns,
        batch.mask,
        clip=settings.value_clip,
        aggregation=settings.aggregation,
    )
    metrics = {f"critic/{k}": v for k, v in metrics.items()}
    metrics["critic/values_mean"] = jax.lax.stop_gradient(masked_mean(values, batch.mask))
    if "load_balancing_loss" in aux:
        metrics["critic/moe_load_balancing_loss"] = jax.lax.stop_gradient(
            aux["load_balancing_loss"]
        )
        if settings.load_balancing_coef:
            loss = loss + settings.load_balancing_coef * aux["load_balancing_loss"]
    return loss, metrics


def micro_batched_critic_grads(
    graphdef, settings: CriticSettings, params, batch: Batch, frozen=None
):
    """``((loss, metrics), grads)`` of ``critic_loss`` on a minibatch run as micro-batches
    of at most ``settings.micro_batch_tokens`` tokens (``policyopt.rl.update.micro_batches``).

    Each micro-batch's loss is its share of the minibatch's: the value loss with the
    minibatch's row weights (``losses.aggregation_weights``), the MoE load-balancing loss
    with the minibatch's load fractions, counted by a forward pass of the micro-batches
    before the gradient's (``micro_batches.load_balancing_share``). Loss and metrics are
    ``critic_objective`` over the whole minibatch's values and router statistics.
    """
    if batch.packing is not None:
        raise ValueError(
            "micro-batches of a packed minibatch are not supported: "
            "config.batch.micro_batch_tokens needs config.batch.pack off"
        )
    rows, width = batch.tokens.shape
    per, count = micro_batches.plan(rows, width, settings.micro_batch_tokens)
    row_weights = aggregation_weights(batch.mask, settings.aggregation)
    total_tokens = jnp.sum(batch.attention_mask > 0).astype(jnp.float32)
    split_batch = micro_batches.split(batch, per, count)

    def forward(params, micro):
        micro = micro_batches.constrain_rows(micro)
        return forward_values(
            graphdef,
            params,
            micro.tokens,
            micro.positions,
            micro.attention_mask,
            micro.num_response,
            return_aux=True,
            frozen=frozen,
        )

    counts = None
    if settings.load_balancing_coef:  # the minibatch's load fractions, before the gradient
        counts = micro_batches.expert_counts(lambda micro: forward(params, micro)[1], split_batch)

    def share_fn(params, xs):
        micro, weights = xs
        values, aux = forward(params, micro)
        share, _ = value_loss(
            values,
            micro.old_values,
            micro.returns,
            micro.mask,
            clip=settings.value_clip,
            row_weights=weights,
        )
        outputs = {"values": values}
        if "load_balancing_loss" in aux:
            for name in ("tokens_per_expert", "router_prob_sum"):
                outputs[name] = jax.lax.stop_gradient(aux[name])
            if settings.load_balancing_coef:
                share = share + settings.load_balancing_coef * micro_batches.load_balancing_share(
                    aux["router_prob_sum"], counts, total_tokens
                )
        return share, outputs

    _, grads, outputs = micro_batches.accumulate(
        share_fn, params, (split_batch, micro_batches.split_rows(row_weights, per, count))
    )
    values = jax.lax.stop_gradient(micro_batches.merge_rows(outputs.pop("values"), rows))
    aux = {}
    if "router_prob_sum" in outputs:  # the minibatch's load-balancing loss
        aux["load_balancing_loss"] = micro_batches.load_balancing_share(
            jnp.sum(outputs["router_prob_sum"], axis=0),
            jnp.sum(outputs["tokens_per_expert"], axis=0),
            total_tokens,
        )
    return critic_objective(values, aux, batch, settings), grads


_CRITICS: dict = {}


def get_critic(graphdef, settings: CriticSettings, optim: Optim) -> "Critic":
    """The Critic for (backbone structure, loss settings, optimiser), created once per
    process (as ``learner.get_learner``), so that runs share compiled functions."""
    key = (graphdef, settings, optim)
    if key not in _CRITICS:
        _CRITICS[key] = Critic(graphdef, settings, optim)
    return _CRITICS[key]


class Critic:
    """The jitted functions of one value model, compiled once per shape bucket.

    Attributes:
      values: ``(params, tokens, positions, attention_mask, mask, packing=None,
        frozen=None) -> values [R, N]`` (0 where ``mask`` is 0; with a ``PackedLayout``,
        run packed; ``frozen``: the base of a LoRA critic's adapters, ``forward_values``).
      update: ``(state, batch, frozen=None) -> (state, metrics)``, the state donated
        (LoRA: its adapters and head trained, ``frozen`` shared and fixed); metrics are
        ``critic/value_loss``, ``critic/explained_variance``, ``critic/value_clip_frac``,
        ``critic/values_mean``, ``critic/grad_norm``, ``critic/lr``, ``critic/skipped``.
      trace_counts: how many times each function was traced.
    """

    def __init__(self, graphdef, settings: CriticSettings, optim: Optim):
        self.graphdef, self.settings = graphdef, settings
        self.optimizer, self.schedule = optimizer_of(optim)
        self.trace_counts: collections.Counter = collections.Counter()
        self.values = jax.jit(self._values)
        self.update = jax.jit(self._update, donate_argnums=0)

    def init_state(self, policy_params, hidden_size: int) -> TrainState:
        return TrainState.create(init_critic_params(policy_params, hidden_size), self.optimizer)

    def loss(self, params, batch: Batch, frozen=None):
        return critic_loss(self.graphdef, params, batch, self.settings, frozen)

    def _values(self, params, tokens, positions, attention_mask, mask, packing=None, frozen=None):
        self.trace_counts["values"] += 1
        values = forward_values(
            self.graphdef,
            params,
            tokens,
            positions,
            attention_mask,
            mask.shape[1],
            packing=packing,
            frozen=frozen,
        )
        return jnp.where(mask > 0, values, 0.0)

    def _update(self, state: TrainState, batch: Batch, frozen=None):
        self.trace_counts["update"] += 1
        grad_fn = None
        if (
            self.settings.micro_batch_tokens
            and micro_batches.plan(*batch.tokens.shape, self.settings.micro_batch_tokens)[1] > 1
        ):
            grad_fn = functools.partial(
                micro_batched_critic_grads, self.graphdef, self.settings, frozen=frozen
            )
        state, metrics = guarded_update(
            lambda params, batch: self.loss(params, batch, frozen),
            self.optimizer,
            self.schedule,
            state,
            batch,
            active=jnp.any(batch.mask > 0),
            grad_fn=grad_fn,
        )
        renamed = {
            "update/grad_norm": "critic/grad_norm",
            "update/lr": "critic/lr",
            "update/skipped": "critic/skipped",
            "update/empty": "critic/empty",
        }
        return state, {renamed.get(k, k): v for k, v in metrics.items()}


def token_rewards(rewards: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-token rewards: each sequence's outcome reward on its last valid token, 0 elsewhere.

    Args:
      rewards: ``[R]`` outcome rewards.
      mask: ``[R, N]`` 1 on valid response tokens.

    Returns:
      float32 ``[R, N]``; a row without valid tokens is all 0.
    """
    valid = jnp.asarray(mask) > 0
    width = valid.shape[1]
    last = width - 1 - jnp.argmax(valid[:, ::-1], axis=1)  # index of the last valid token
    at_last = (jnp.arange(width)[None, :] == last[:, None]) & valid
    return jnp.where(at_last, jnp.asarray(rewards, jnp.float32)[:, None], 0.0)


def reward_model_targets(rewards: jax.Array, mask: jax.Array):
    """The critic's batch fields while it is trained as an outcome reward model
    (``config.critic.reward_model_iterations``; module docstring): ``(mask, returns,
    old_values)``, each ``[R, N]``: the loss mask on each row's last valid response token
    only, the outcome reward there, and old values equal to the returns, which make PPO's
    value clip inactive (``clip(V, R - c, R + c) - R`` is never further from 0 than
    ``V - R``, so the clipped loss is the squared error): a reward model is fitted
    without a trust region."""
    returns = token_rewards(rewards, mask)
    last = token_rewards(jnp.ones(jnp.shape(rewards), jnp.float32), mask)
    return last, returns, returns


def gae_targets(rewards, values, mask, algo: Algo) -> tuple[jax.Array, jax.Array, dict]:
    """Policy advantages and value targets of a batch from outcome rewards and values.

    ``r_t`` = the outcome reward on the last valid token (``token_rewards``);
    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` after the last token = 0);
    advantages ``A_t = sum_l (gamma lambda_actor)^l delta_{t+l}`` and value targets
    ``A^{lambda_critic}_t + V_t`` (``advantages.decoupled_gae``; PPO: one lambda, VC-PPO
    2503.01491: lambda_actor 0.95 / lambda_critic 1.0). With ``length_adaptive`` (VAPO
    2504.05118) ``lambda_actor = 1 - 1 / (alpha |y_i|)`` per sequence, clamped at 0 when
    ``alpha |y_i| <= 1`` (``advantages.length_adaptive_lambda``). With ``whiten`` the
    advantages are whitened over the valid tokens of the batch (``masked_whiten``; the
    value targets never are).

    Args:
      rewards: ``[R]`` outcome rewards.
      values: ``[R, N]`` the critic's values of the rollout (``Critic.values``).
      mask: ``[R, N]``.
      algo: the ``algo`` section: ``gae_gamma``, ``gae_lambda`` (lambda_actor),
        ``critic_lambda`` (lambda_critic), ``gae_length_adaptive``, ``gae_alpha``, ``adv_whiten``.

    Returns:
      ``(advantages [R, N], returns [R, N], metrics)``, 0 at padding; metrics (scalars)
      ``advantages/lambda_policy_token_mean`` (the policy's lambda averaged over the valid
      tokens: the fixed lambda where it is not length-adaptive),
      ``advantages/lambda_policy_zero_token_frac`` (the share of valid tokens whose lambda is
      0: one-step TD advantages), ``advantages/mean``, ``advantages/std`` (before
      whitening), ``critic/returns_mean``,
      ``critic/rollout_values_mean`` and ``critic/rollout_explained_variance``
      ``1 - Var[R - V] / Var[R]`` of the values the rollout was scored with (the
      convention of ``losses.explained_variance`` for constant returns), against the
      value targets; ``critic/rollout_mc_explained_variance`` the same against
      Monte-Carlo returns (lambda 1), a held-out fit at any ``lam_critic`` (the ceiling a
      perfect critic reaches: `experiments/value_ceiling.py`).
    """
    per_token = token_rewards(rewards, mask)
    mask_f = (jnp.asarray(mask) > 0).astype(jnp.float32)
    lengths = jnp.sum(mask_f, axis=1)
    if algo.gae_length_adaptive:
        lam_actor = length_adaptive_lambda(lengths, algo.gae_alpha)
    else:
        lam_actor = jnp.full(lengths.shape, algo.gae_lambda, jnp.float32)
    advantages, returns = decoupled_gae(
        per_token,
        values,
        mask,
        gamma=algo.gae_gamma,
        lam_actor=lam_actor if algo.gae_length_adaptive else algo.gae_lambda,
        lam_critic=algo.critic_lambda,
    )
    # Monte-Carlo returns (lambda 1): the targets of value pretraining, and a critic's
    # held-out fit whatever lambda_critic the run uses (GAE returns below 1 contain V).
    if algo.critic_lambda == 1.0:
        mc_returns = returns
    else:
        _, mc_returns = decoupled_gae(
            per_token, values, mask, gamma=algo.gae_gamma, lam_actor=1.0, lam_critic=1.0
        )
    tokens = jnp.maximum(jnp.sum(lengths), 1.0)
    metrics = {
        # The policy's lambda as its tokens see it: a fixed lambda's matched control
        # (VAPO's length-adaptive one against a fixed one of the same token mean).
        "advantages/lambda_policy_token_mean": jnp.sum(lam_actor * lengths) / tokens,
        "advantages/lambda_policy_zero_token_frac": jnp.sum(jnp.where(lam_actor == 0, lengths, 0))
        / tokens,
        "advantages/mean": masked_mean(advantages, mask_f),
        "advantages/std": jnp.sqrt(masked_var(advantages, mask_f)),
        "critic/returns_mean": masked_mean(returns, mask_f),
        "critic/rollout_values_mean": masked_mean(values, mask_f),
        "critic/rollout_explained_variance": explained_variance(returns, values, mask_f),
        "critic/rollout_mc_explained_variance": explained_variance(mc_returns, values, mask_f),
    }
    if algo.adv_whiten:
        advantages = masked_whiten(advantages, mask_f)
    return advantages, returns, metrics
