"""The jitted steps of RL and SFT: forward log-probs, routing, and ``update(state, batch)``.

Everything here is a pure function of pytrees. The model enters as an NNX ``GraphDef``
(static) and its parameters as an ``nnx.State`` of ``nnx.Param`` leaves
(``graphdef, params = nnx.split(model, nnx.Param)``); the optimiser is optax.

One update (``Learner.update``, jitted once per shape bucket, the state donated):

    (loss, metrics), grads = value_and_grad(loss_fn)(params, batch)
    new_params, new_opt_state = AdamW(clip_by_global_norm(grads))
    finite = isfinite(loss) and isfinite(global_norm(grads))
             and every value of new_params and new_opt_state is finite
    params, opt_state = new_params, new_opt_state               if finite
                        unchanged                               otherwise (counted)

``loss_fn`` runs the policy forward on the batch (replaying ``batch.routing`` when it is
given: R2 / R3), takes the log-probs of the response tokens from the final hidden
states (``policyopt.logprobs.token_log_probs``, chunked over the vocabulary, at the
sampling temperature) and returns ``policyopt.losses.policy_loss`` with the recipe's
method, clip / temperatures, aggregation, optional KL (GRPO, k3), optional truncated
importance weights and, with rollout rejection sampling, over ``batch.loss_mask``, plus
optional load-balancing and entropy terms and VAPO's NLL on correct samples
(``mu * losses.nll_loss``). ``batch.advantages`` is one advantage per
sequence (outcome advantages) or one per token (GAE, ``policyopt.rl.update.critic``).
With ``batch.packing`` (``policyopt.rl.update.packing``) the forward runs on packed rows and its
log-probs are gathered back to ``[R, N]`` before the loss, which is therefore unchanged.

With LoRA adapters (``policyopt.models.lora``, ``policyopt.rl.update.adapters``) the state's
parameters are the adapters and ``update``'s ``frozen`` argument is the base: the forward
runs the two joined (``lora.combine``), the gradient and AdamW see the adapters only.

With ``batch.micro_batch_tokens`` the gradient is summed over micro-batches of the
minibatch inside the same jitted step, each micro-batch's loss its share of the
minibatch's (``micro_batched_rl_grads``, ``policyopt.rl.update.micro_batches``), then the same
guard and one update.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import PartitionSpec

from policyopt import sharding
from policyopt.config import Algo, Optim, Sampling
from policyopt.config import Batch as BatchSection
from policyopt.logprobs import token_log_probs
from policyopt.losses import (
    aggregate,
    aggregation_weights,
    nll_loss,
    policy_loss,
    weighted_row_sum,
)
from policyopt.models import lora
from policyopt.models.interface import PolicyModel
from policyopt.rl.batch import Batch
from policyopt.rl.update import micro_batches
from policyopt.rl.update.packing import PackedLayout, gather_slots


@struct.dataclass
class TrainState:
    """Parameters, optimiser state and update counters (a pytree; donated to ``update``)."""

    step: jax.Array  # int32 []: updates applied (the optimiser's schedule count)
    skipped: jax.Array  # int32 []: updates skipped for a non-finite loss, gradient or new state
    params: Any  # nnx.State of nnx.Param
    opt_state: Any

    @classmethod
    def create(cls, params, optimizer: optax.GradientTransformation) -> "TrainState":
        return cls(
            step=jnp.zeros((), jnp.int32),
            skipped=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=optimizer.init(params),
        )


def state_specs(state: TrainState, optimizer: optax.GradientTransformation, mesh) -> TrainState:
    """The ``PartitionSpec`` of every part of ``state`` on ``mesh`` (a ``Mesh``, or inside
    jit the ``AbstractMesh``): parameters by their logical axes
    (``sharding.param_specs``), the optimiser's copies of them (Adam's moments) alike,
    counters and the optimiser's step counts replicated."""
    params = sharding.param_specs(state.params, mesh)
    return TrainState(
        step=PartitionSpec(),
        skipped=PartitionSpec(),
        params=params,
        opt_state=sharding.optimizer_specs(optimizer, state.opt_state, params),
    )


def place_state(state: TrainState, optimizer: optax.GradientTransformation, mesh) -> TrainState:
    """``state`` placed on ``mesh`` by ``state_specs``. ``guarded_update`` returns its state
    with these shardings, and a checkpoint restored onto a placed state comes back with
    them, so the jitted steps compile once for a run, across save and restore."""
    return sharding.put(state, sharding.named_shardings(state_specs(state, optimizer, mesh), mesh))


def warmup_constant_schedule(lr: float, warmup_steps: int) -> optax.Schedule:
    """``lr * min(1, (count + 1) / warmup_steps)``: linear warm-up, then constant.

    The first update already gets ``lr / warmup_steps`` (a schedule starting at 0 would
    waste it). ``warmup_steps <= 0``: constant ``lr``.
    """
    if warmup_steps <= 0:
        return optax.constant_schedule(lr)
    return lambda count: lr * jnp.minimum(1.0, (count + 1.0) / warmup_steps)


def warmup_cosine_schedule(
    lr: float, warmup_steps: int, decay_steps: int, min_lr_ratio: float = 0.0
) -> optax.Schedule:
    """``warmup_constant_schedule``'s warm-up, then a cosine from ``lr`` at update
    ``warmup_steps`` to ``lr * min_lr_ratio`` at update ``decay_steps`` (0-based counts: a
    run of ``decay_steps`` updates ends one step short of it), constant after it: update
    ``count`` gets ``lr * (r + (1 - r) (1 + cos(pi p)) / 2)`` with ``r = min_lr_ratio`` and
    ``p = (count - warmup_steps) / (decay_steps - warmup_steps)`` clipped to [0, 1].
    ``decay_steps <= warmup_steps``: ``warmup_constant_schedule``."""
    if decay_steps <= warmup_steps:
        return warmup_constant_schedule(lr, warmup_steps)
    warm = warmup_constant_schedule(lr, warmup_steps)
    span = float(decay_steps - warmup_steps)

    def schedule(count):
        progress = jnp.clip((count - warmup_steps) / span, 0.0, 1.0)
        cosine = min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < warmup_steps, warm(count), lr * cosine)

    return schedule


def make_optimizer(
    *,
    lr: float,
    warmup_steps: int = 0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = 1.0,
    decay_steps: int = 0,
    min_lr_ratio: float = 0.0,
    router_lr_scale: float = 1.0,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW after global-norm clipping, with linear warm-up, then a constant learning
    rate (``decay_steps = 0``) or a cosine decay to ``lr * min_lr_ratio`` at update
    ``decay_steps`` (``warmup_cosine_schedule``). ``router_lr_scale`` != 1 multiplies the
    MoE routers' updates (weight decay included: their learning rate) by it.

    Returns:
      ``(optimizer, schedule)``; ``schedule(state.step)`` is the learning rate of the next
      update.
    """
    schedule = warmup_cosine_schedule(lr, warmup_steps, decay_steps, min_lr_ratio)
    parts = []
    if max_grad_norm is not None and max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(max_grad_norm))
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    if router_lr_scale != 1.0:
        parts.append(
            optax.multi_transform(
                {"router": optax.scale(router_lr_scale), "rest": optax.identity()}, router_labels
            )
        )
    return optax.chain(*parts), schedule


def router_labels(params) -> Any:
    """``"router"`` on the MoE routers' weights (a leaf named ``router``), ``"rest"``
    elsewhere: the labels of ``make_optimizer``'s ``router_lr_scale``."""

    def label(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return "router" if "router" in names else "rest"

    return jax.tree_util.tree_map_with_path(label, params)


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, params)``; raises if the model holds state other than ``nnx.Param``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(
            "the policy holds non-parameter state (e.g. batch statistics or rngs); "
            "the RL steps only carry nnx.Param"
        )
    return graphdef, params


class Forward(NamedTuple):
    log_probs: jax.Array  # float32 [R, N]
    entropy: jax.Array  # float32 [R, N]
    routing: jax.Array | None  # int32 [L, R, S, k]
    aux: dict


def forward_log_probs(
    graphdef,
    params,
    tokens,
    positions,
    attention_mask,
    num_response: int,
    *,
    temperature: float = 1.0,
    routing=None,
    packing=None,
) -> Forward:
    """Log-probs and entropies of the response tokens of a training-layout batch.

    Response token ``n`` is predicted by the hidden state at index ``P - 1 + n``
    (``P = S - num_response``), the layout of ``policyopt.rl.batch``.

    Args:
      graphdef, params: the policy.
      tokens, positions, attention_mask: ``[R, S]``.
      num_response: N.
      temperature: the logits are divided by it (the sampling temperature).
      routing: int32 ``[L_moe, R, S, k]`` to replay, or None.
      packing: a ``packing.PackedLayout`` of these rows: the model runs on the packed
        rows (``packed_forward_log_probs``), the results come back in this layout.

    Returns:
      ``Forward``: log_probs and entropy ``[R, N]``, the routing used, the model's aux.
    """
    if packing is not None:
        return packed_forward_log_probs(
            graphdef,
            params,
            tokens,
            positions,
            packing,
            num_response,
            temperature=temperature,
            routing=routing,
        )
    model: PolicyModel = nnx.merge(graphdef, params)
    out = model(
        tokens,
        positions=positions,
        attention_mask=attention_mask,
        routing=routing,
        return_logits=False,
    )
    start = tokens.shape[1] - num_response - 1
    hidden = jax.lax.slice_in_dim(out.hidden, start, start + num_response, axis=1)
    targets = tokens[:, start + 1 :]
    log_probs, entropy = token_log_probs(
        hidden, model.output_embedding(), targets, temperature=temperature, return_entropy=True
    )
    return Forward(log_probs, entropy, out.routing, out.aux)


def packed_forward(model: PolicyModel, tokens, positions, packing: PackedLayout, routing=None):
    """The model on the packed rows of a training-layout batch (``policyopt.rl.update.packing``).

    Tokens, positions and the routing to replay are gathered into ``[N_p, T]`` slots
    (``packing.source``); each segment attends only to itself (``segment_ids``).

    Returns:
      ``(ModelOutput on [N_p, T], packed tokens int32 [N_p, T])``.
    """
    segment_ids = packing.segment_ids
    packed_tokens = gather_slots(tokens, packing.source)
    packed_routing = None if routing is None else gather_slots(routing, packing.source, axis=1)
    out = model(
        packed_tokens,
        positions=gather_slots(positions, packing.source),
        attention_mask=segment_ids > 0,
        segment_ids=segment_ids,
        routing=packed_routing,
        return_logits=False,
    )
    return out, packed_tokens


def packed_forward_log_probs(
    graphdef,
    params,
    tokens,
    positions,
    packing: PackedLayout,
    num_response: int,
    *,
    temperature: float = 1.0,
    routing=None,
) -> Forward:
    """``forward_log_probs`` with the model run on packed rows; equal results.

    In a packed row the token after slot ``t`` of a segment is at slot ``t + 1``, so the
    log-prob of every slot's successor is taken on ``[N_p, T]`` and read back at the slots
    of padded columns ``P - 1 .. S - 2`` (``packing.target``); 0 where the response token
    is padding. The recorded routing comes back as ``[L_moe, R, S, k]`` (0 on padding).

    Args:
      tokens, positions: ``[R, S]`` (training layout).
      packing: ``PackedLayout`` of these rows (device arrays).
      num_response, temperature, routing: as ``forward_log_probs``.

    Returns:
      ``Forward`` in the padded layout: log_probs and entropy ``[R, N]``.
    """
    model: PolicyModel = nnx.merge(graphdef, params)
    out, packed_tokens = packed_forward(model, tokens, positions, packing, routing)
    successors = jnp.pad(packed_tokens[:, 1:], ((0, 0), (0, 1)))
    log_probs, entropy = token_log_probs(
        out.hidden,
        model.output_embedding(),
        successors,
        temperature=temperature,
        return_entropy=True,
    )
    start = tokens.shape[1] - num_response - 1
    predicting = packing.target[:, start : start + num_response]  # [R, N]
    valid = packing.target[:, start + 1 :] >= 0  # response token real
    index = jnp.where(valid, predicting, -1)
    log_probs, entropy = gather_slots(log_probs, index), gather_slots(entropy, index)
    used = None if out.routing is None else gather_slots(out.routing, packing.target, axis=1)
    return Forward(log_probs, entropy, used, out.aux)


class LossSettings(NamedTuple):
    """The sections the RL loss reads (hashable: part of a Learner's cache key): ``algo``
    (objective, aggregation, KL, coefficients), ``batch`` (group size, micro-batches) and
    ``sampling`` (the temperature of the log-probs, and ``max_new_tokens``, the default of
    ``algo.max_len``). Checked when the config is (``policyopt.config``)."""

    algo: Algo
    batch: BatchSection
    sampling: Sampling

    @classmethod
    def of(cls, config) -> "LossSettings":
        return cls(config.algo, config.batch, config.sampling)

    @property
    def group_size(self) -> int:
        """Sequences per group (``"group_token_mean"``)."""
        return int(self.batch.group_size)

    @property
    def max_len(self) -> int:
        """The constant of ``"seq_mean_token_sum_norm"``: ``algo.max_len``, else the budget."""
        return int(self.algo.max_len or self.sampling.max_new_tokens)

    @property
    def temperature(self) -> float:
        return float(self.sampling.temperature)

    @property
    def micro_batch_tokens(self) -> int | None:
        """Tokens per micro-batch of an update (None: one pass over the minibatch). Memory,
        not the result: ``policyopt.rl.update.micro_batches``."""
        return self.batch.micro_batch_tokens or None


def rl_loss(graphdef, params, batch: Batch, settings: LossSettings) -> tuple[jax.Array, dict]:
    """The RL loss of one minibatch and its metrics (see the module docstring)."""
    fwd = forward_log_probs(
        graphdef,
        params,
        batch.tokens,
        batch.positions,
        batch.attention_mask,
        batch.num_response,
        temperature=settings.temperature,
        routing=batch.routing,
        packing=batch.packing,
    )
    return rl_objective(fwd, batch, settings)


def _policy_mask(batch: Batch) -> jax.Array:
    """The policy terms' tokens: those rollout rejection sampling kept, if it ran."""
    return batch.mask if batch.loss_mask is None else batch.loss_mask


def _policy_term(fwd: Forward, batch: Batch, settings: LossSettings, **options):
    """``losses.policy_loss`` of the recipe on ``batch`` (one pass, or a micro-batch's share
    with ``row_weights``): the same call for both, so a setting reaches both."""
    algo, advantages = settings.algo, batch.advantages
    if advantages.ndim == 1:  # one advantage per sequence, shared by its tokens
        advantages = jnp.broadcast_to(advantages[:, None], fwd.log_probs.shape)
    return policy_loss(
        fwd.log_probs,
        batch.old_log_probs,
        advantages,
        _policy_mask(batch),
        method=algo.method,
        settings=algo.objective,
        aggregation=algo.aggregation,
        group_size=settings.group_size,
        max_len=settings.max_len,
        importance_weights=batch.importance_weights,
        ref_log_probs=batch.ref_log_probs if algo.kl_beta > 0 else None,
        kl_coef=algo.kl_beta,
        kl_estimator=algo.kl_estimator,
        kl_clamp=algo.kl_clamp,
        **options,
    )


def rl_objective(fwd: Forward, batch: Batch, settings: LossSettings) -> tuple[jax.Array, dict]:
    """``rl_loss`` from the policy's forward outputs on ``batch``: the loss and metrics."""
    mask = _policy_mask(batch)
    loss, policy_metrics = _policy_term(fwd, batch, settings)
    metrics = {f"loss/{k}": v for k, v in policy_metrics.items()}
    entropy = aggregate(fwd.entropy, mask, "token_mean")
    metrics["policy/entropy"] = jax.lax.stop_gradient(entropy)
    if settings.algo.entropy_coef:
        loss = loss - settings.algo.entropy_coef * entropy
    if fwd.aux and "load_balancing_loss" in fwd.aux:
        metrics["moe/load_balancing_loss"] = jax.lax.stop_gradient(fwd.aux["load_balancing_loss"])
        if settings.algo.load_balancing_coef:
            loss = loss + settings.algo.load_balancing_coef * fwd.aux["load_balancing_loss"]
        metrics["moe/router_z_loss"] = jax.lax.stop_gradient(fwd.aux["router_z_loss"])
        if settings.algo.router_z_coef:  # ST-MoE's z-loss (2202.08906): keeps router logits small
            loss = loss + settings.algo.router_z_coef * fwd.aux["router_z_loss"]
    if settings.algo.nll_coef:
        # VAPO (2504.05118): + mu * L_NLL over the correct samples of the minibatch
        # (batch.nll_weights), at the training temperature like the policy term.
        if batch.nll_weights is None:
            raise ValueError(
                "config.algo.nll_coef > 0 needs batch.nll_weights "
                "(1 on the rows the NLL term covers, e.g. the correct samples)"
            )
        nll = nll_loss(fwd.log_probs, mask, batch.nll_weights)
        metrics["loss/nll"] = jax.lax.stop_gradient(nll)
        loss = loss + settings.algo.nll_coef * nll
    metrics["loss/total"] = jax.lax.stop_gradient(loss)
    return loss, metrics


def tree_all_finite(tree) -> jax.Array:
    """True (a bool scalar) when every floating-point value in ``tree`` is finite: one
    reduction per leaf, fused by XLA into the step that produced them."""
    leaves = [
        leaf for leaf in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)
    ]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.isfinite(leaf).all() for leaf in leaves]).all()


class Normalisers(NamedTuple):
    """The denominators of ``rl_objective``'s terms over a whole minibatch, so that a
    micro-batch's loss is its share of the minibatch's (``policyopt.rl.update.micro_batches``)."""

    policy: jax.Array  # [R]: losses.aggregation_weights of the policy mask
    entropy: jax.Array  # [R]: the token mean's row weights of the policy mask
    nll: jax.Array  # []: sum_i nll_weights_i |y_i| (0 without the NLL term)
    aux_tokens: jax.Array  # []: valid tokens (attention_mask) the MoE aux losses average over
    # [L_moe, E]: the minibatch's tokens per expert, the load-balancing loss's fractions
    # (``micro_batches.expert_counts``); None when the loss is off.
    expert_counts: jax.Array | None = None

    @classmethod
    def of(cls, batch: Batch, settings: LossSettings) -> "Normalisers":
        mask = batch.mask if batch.loss_mask is None else batch.loss_mask
        nll = jnp.zeros((), jnp.float32)
        if settings.algo.nll_coef and batch.nll_weights is not None:
            nll = jnp.sum((mask > 0) * jnp.asarray(batch.nll_weights, jnp.float32)[:, None])
        return cls(
            policy=aggregation_weights(
                mask,
                settings.algo.aggregation,
                group_size=settings.group_size,
                max_len=settings.max_len,
            ),
            entropy=aggregation_weights(mask, "token_mean"),
            nll=nll,
            aux_tokens=jnp.sum(batch.attention_mask > 0).astype(jnp.float32),
        )


def rl_loss_share(
    fwd: Forward, batch: Batch, settings: LossSettings, norms: Normalisers
) -> tuple[jax.Array, dict]:
    """A micro-batch's share of its minibatch's ``rl_objective``, term by term.

    With the minibatch's normalisers ``norms`` (its rows' slices for the row weights),
    the policy term is ``-sum_i w_i sum_t m term`` (``policy_loss(row_weights=...)``), the
    entropy bonus ``-c sum_{i,t} m H / T_mb``, VAPO's NLL ``-mu sum w_i m log pi / sum_mb w m``,
    the router z-loss ``c * z * t / T_mb`` (``t``: this micro-batch's valid tokens) and the
    load-balancing loss ``c * micro_batches.load_balancing_share`` with the minibatch's
    load fractions (``norms.expert_counts``): summed over the micro-batches, the
    minibatch's loss. No metrics: the caller computes them over the whole minibatch.

    Returns:
      ``(share, aux)``: a scalar and ``{"tokens", <router statistics>}`` of this
      micro-batch.
    """
    mask = _policy_mask(batch)
    loss, _ = _policy_term(fwd, batch, settings, metrics="none", row_weights=norms.policy)
    if settings.algo.entropy_coef:
        loss = loss - settings.algo.entropy_coef * weighted_row_sum(
            fwd.entropy, mask, norms.entropy
        )
    tokens = jnp.sum(batch.attention_mask > 0).astype(jnp.float32)
    aux = {"tokens": tokens}
    if fwd.aux and "load_balancing_loss" in fwd.aux:
        share = jnp.where(norms.aux_tokens > 0, tokens / jnp.maximum(norms.aux_tokens, 1.0), 0.0)
        for name in ("router_z_loss", "tokens_per_expert", "router_prob_sum"):
            aux[name] = jax.lax.stop_gradient(fwd.aux[name])
        if settings.algo.router_z_coef:
            loss = loss + settings.algo.router_z_coef * share * fwd.aux["router_z_loss"]
        if settings.algo.load_balancing_coef:
            loss = loss + settings.algo.load_balancing_coef * micro_batches.load_balancing_share(
                fwd.aux["router_prob_sum"], norms.expert_counts, norms.aux_tokens
            )
    if settings.algo.nll_coef:
        if batch.nll_weights is None:
            raise ValueError(
                "config.algo.nll_coef > 0 needs "
                "batch.nll_weights (1 on the rows the NLL term covers, e.g. the "
                "correct samples)"
            )
        loss = loss + settings.algo.nll_coef * nll_loss(
            fwd.log_probs, mask, batch.nll_weights, denominator=norms.nll
        )
    return loss, aux


def micro_batched_rl_grads(graphdef, settings: LossSettings, params, batch: Batch, frozen=None):
    """``((loss, metrics), grads)`` of ``rl_loss`` on a minibatch run as micro-batches of
    at most ``settings.micro_batch_tokens`` tokens (``policyopt.rl.update.micro_batches``);
    ``params`` the trainable parameters, joined to ``frozen`` (LoRA's base) in the forward.

    The gradients are the sum of the micro-batches' shares' (``rl_loss_share``); the loss
    and metrics are ``rl_objective`` over the whole minibatch's log-probs, entropies and
    router statistics (as the scan returns them). With the load-balancing loss on, its
    load fractions are the minibatch's: counted from the replayed routing, or by a forward
    pass of the micro-batches before the gradient's (``micro_batches.expert_counts``).
    """
    if batch.packing is not None:
        raise ValueError(
            "micro-batches of a packed minibatch are not supported: "
            "config.batch.micro_batch_tokens needs config.batch.pack off"
        )
    rows, width = batch.tokens.shape
    per, count = micro_batches.plan(rows, width, settings.micro_batch_tokens)
    norms = Normalisers.of(batch, settings)
    row_norms = (
        micro_batches.split_rows(norms.policy, per, count),
        micro_batches.split_rows(norms.entropy, per, count),
    )
    split_batch = micro_batches.split(batch, per, count)
    if settings.algo.load_balancing_coef:
        config = nnx.merge(graphdef, params).config
        if batch.routing is not None and config.is_moe:  # the replayed experts' counts
            counts = micro_batches.replayed_counts(
                batch.routing, batch.attention_mask, config.num_experts
            )
        else:

            def model_aux(micro):
                micro = micro_batches.constrain_rows(micro)
                model: PolicyModel = nnx.merge(graphdef, params)
                return model(
                    micro.tokens,
                    positions=micro.positions,
                    attention_mask=micro.attention_mask,
                    return_logits=False,
                ).aux

            counts = micro_batches.expert_counts(model_aux, split_batch)
        norms = norms._replace(expert_counts=counts)

    def share_fn(params, xs):
        micro, policy_weights, entropy_weights = xs
        micro = micro_batches.constrain_rows(micro)
        fwd = forward_log_probs(
            graphdef,
            lora.combine(frozen, params),
            micro.tokens,
            micro.positions,
            micro.attention_mask,
            micro.num_response,
            temperature=settings.temperature,
            routing=micro.routing,
        )
        share, aux = rl_loss_share(
            fwd, micro, settings, norms._replace(policy=policy_weights, entropy=entropy_weights)
        )
        return share, (fwd.log_probs, fwd.entropy, aux)

    _, grads, (log_probs, entropy, stats) = micro_batches.accumulate(
        share_fn, params, (split_batch, *row_norms)
    )
    aux = {}
    if "router_z_loss" in stats:  # the minibatch's router statistics
        aux["router_z_loss"] = micro_batches.token_weighted_mean(
            stats["router_z_loss"], stats["tokens"]
        )
        aux["load_balancing_loss"] = micro_batches.load_balancing_share(
            jnp.sum(stats["router_prob_sum"], axis=0),
            jnp.sum(stats["tokens_per_expert"], axis=0),
            norms.aux_tokens,
        )
    fwd = Forward(
        micro_batches.merge_rows(log_probs, rows),
        micro_batches.merge_rows(entropy, rows),
        None,
        aux,
    )
    loss, metrics = rl_objective(jax.tree.map(jax.lax.stop_gradient, fwd), batch, settings)
    return (loss, metrics), grads


def guarded_update(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    state: TrainState,
    batch,
    active: jax.Array | None = None,
    *,
    grad_fn: Callable | None = None,
) -> tuple[TrainState, dict]:
    """One optimiser step that is skipped when the loss, the gradient, the new parameters
    or the new optimiser state are not all finite, or when the minibatch holds nothing to
    learn from.

    Checking what the step would save, not only its inputs, catches a learning rate of inf
    or NaN, ``eps = 0`` (0 / 0 in Adam where a gradient and its second moment are 0), and a
    NaN already in the optimiser state (every later step is then skipped, and the trainer
    stops after ``train.max_skipped_updates`` of them), at the cost of one fused reduction
    over the new state.

    A skipped step leaves ``params`` and ``opt_state`` bit-identical (``state.step`` counts
    applied updates only, so the learning-rate schedule does not advance either). A
    non-finite step increments ``state.skipped``. ``active`` (a scalar bool, None: True)
    False is an empty minibatch, e.g. only the masked filler groups of dynamic sampling:
    its loss and gradient are 0, but AdamW would still apply weight decay and its momentum,
    so it is skipped too, and reported as ``update/empty``, not counted as a failure. With
    a mesh set (``jax.set_mesh``) the new state is constrained to ``state_specs``, the
    shardings ``place_state`` gives the input.

    ``grad_fn`` (``(params, batch) -> ((loss, metrics), grads)``) computes the gradient
    some other way than ``jax.value_and_grad(loss_fn, has_aux=True)``, the default: over
    micro-batches (``micro_batched_rl_grads``). The guard and the update are the same.

    Returns:
      ``(state, metrics)`` with ``update/grad_norm`` (before clipping), ``update/lr``
      (of this step), ``update/skipped`` and ``update/empty`` (0 or 1) added to
      ``loss_fn``'s metrics.
    """
    if grad_fn is None:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, metrics), grads = grad_fn(state.params, batch)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    active = jnp.asarray(True) if active is None else jnp.asarray(active, bool)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = finite & tree_all_finite((params, opt_state))  # what would be saved
    apply = finite & active
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
    new_state = TrainState(
        step=state.step + apply.astype(jnp.int32),
        skipped=state.skipped + (~finite).astype(jnp.int32),
        params=keep(params, state.params),
        opt_state=keep(opt_state, state.opt_state),
    )
    new_state = sharding.constrain_tree(new_state, lambda mesh: state_specs(state, optimizer, mesh))
    metrics = dict(metrics)
    metrics["update/grad_norm"] = grad_norm
    metrics["update/lr"] = jnp.asarray(schedule(state.step), jnp.float32)
    metrics["update/skipped"] = (~finite).astype(jnp.float32)
    metrics["update/empty"] = (finite & ~active).astype(jnp.float32)
    return new_state, metrics


def optimizer_of(
    optim: Optim, *, decay_steps: int = 0, min_lr_ratio: float = 0.0
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``make_optimizer`` with the hyper-parameters of an ``optim`` section: the policy's
    ``config.optim``, or the critic's and SFT's (``critic.critic_optim``, ``sft``: their
    learning rate, warm-up and weight decay in place of the policy's). ``decay_steps`` and
    ``min_lr_ratio``: SFT's cosine decay (0: constant)."""
    return make_optimizer(
        lr=float(optim.lr),
        warmup_steps=int(optim.warmup_steps),
        b1=float(optim.b1),
        b2=float(optim.b2),
        eps=float(optim.eps),
        weight_decay=float(optim.weight_decay),
        max_grad_norm=optim.max_grad_norm,
        decay_steps=int(decay_steps),
        min_lr_ratio=float(min_lr_ratio),
        router_lr_scale=float(optim.router_lr_scale),
    )


_LEARNERS: dict = {}


def get_learner(graphdef, settings: LossSettings, optim: Optim) -> "Learner":
    """The Learner for (model structure, loss settings, optimiser), created once per
    process, so that runs with the same recipe and model (resumes, sweeps, tests) share
    compiled functions instead of compiling them again."""
    key = (graphdef, settings, optim)
    if key not in _LEARNERS:
        _LEARNERS[key] = Learner(graphdef, settings, *optimizer_of(optim))
    return _LEARNERS[key]


class _Forwards:
    """Jitted forward passes shared by every Learner of one (model structure, temperature)."""

    def __init__(self, graphdef, temperature: float):
        self.graphdef, self.temperature = graphdef, temperature
        self.trace_counts: collections.Counter = collections.Counter()
        self.log_probs = jax.jit(self._log_probs)

    def _log_probs(
        self, params, tokens, positions, attention_mask, mask, routing=None, packing=None
    ):
        self.trace_counts["log_probs"] += 1
        fwd = forward_log_probs(
            self.graphdef,
            params,
            tokens,
            positions,
            attention_mask,
            mask.shape[1],
            temperature=self.temperature,
            routing=routing,
            packing=packing,
        )
        valid = mask > 0
        return jnp.where(valid, fwd.log_probs, 0.0), jnp.where(valid, fwd.entropy, 0.0), fwd.routing


_FORWARDS: dict = {}


class Learner:
    """The jitted functions of one policy, compiled once per shape bucket.

    Attributes:
      update: ``(state, batch, frozen=None) -> (state, metrics)``, the state donated;
        ``state.params`` the trainable parameters (LoRA: the adapters, joined in the
        forward to the ``frozen`` base, which gets no gradient and no optimiser state).
      log_probs: ``(params, tokens, positions, attention_mask, mask, routing, packing) ->
        (log_probs, entropy, routing)`` of a training-layout batch (old / reference
        log-probs; returns the routing used, i.e. recorded or replayed; with a
        ``PackedLayout`` the model runs on packed rows, the results are the same).
      trace_counts: how many times each function was traced (a compile-count probe;
        the forward passes are shared by learners of the same model and temperature).
    """

    def __init__(
        self,
        graphdef,
        settings: LossSettings,
        optimizer: optax.GradientTransformation,
        schedule: optax.Schedule,
    ):
        self.graphdef, self.settings = graphdef, settings
        self.optimizer, self.schedule = optimizer, schedule
        self._update_traces = 0
        self.update = jax.jit(self._update, donate_argnums=0)
        key = (graphdef, settings.temperature)
        if key not in _FORWARDS:
            _FORWARDS[key] = _Forwards(graphdef, settings.temperature)
        self._forwards = _FORWARDS[key]
        self.log_probs = self._forwards.log_probs

    @property
    def trace_counts(self) -> collections.Counter:
        return collections.Counter(update=self._update_traces) + self._forwards.trace_counts

    def init_state(self, params) -> TrainState:
        return TrainState.create(params, self.optimizer)

    def loss(self, params, batch: Batch):
        return rl_loss(self.graphdef, params, batch, self.settings)

    def _update(self, state: TrainState, batch: Batch, frozen=None):
        self._update_traces += 1
        # A minibatch without a token in the policy loss (only dynamic sampling's filler
        # groups, or everything rejected) is not an update.
        mask = batch.mask if batch.loss_mask is None else batch.loss_mask
        grad_fn = None
        if (
            self.settings.micro_batch_tokens
            and micro_batches.plan(*batch.tokens.shape, self.settings.micro_batch_tokens)[1] > 1
        ):
            grad_fn = functools.partial(
                micro_batched_rl_grads, self.graphdef, self.settings, frozen=frozen
            )
        return guarded_update(
            lambda params, batch: self.loss(lora.combine(frozen, params), batch),
            self.optimizer,
            self.schedule,
            state,
            batch,
            active=jnp.any(mask > 0),
            grad_fn=grad_fn,
        )
