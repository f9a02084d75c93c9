"""Micro-batches: one optimiser step's gradient summed over row slices of its minibatch.

``config.batch.micro_batch_tokens`` bounds the tokens (rows x padded row length, over the
whole mesh) that one forward and backward pass holds. A minibatch of R rows of S tokens
then runs as K micro-batches of M rows (``plan``)::

    M = floor(micro_batch_tokens / S),   K = ceil(R / M)

its rows padded to K M with filler rows (every field 0, replayed routing to experts
0..k-1: no valid token, no weight in any loss) and dealt out strided: micro-batch j holds
rows j, j + K, j + 2K, ... (``split``), so that on a mesh whose devices hold contiguous
blocks of rows every micro-batch spreads over all of them. Inside one jitted step a
``lax.scan`` runs ``value_and_grad`` on each micro-batch and adds the gradients into a
float32 accumulator (``accumulate``); then the step applies ONE optimiser update
(``learner.guarded_update``). Memory holds one micro-batch's activations plus the float32
gradient sum, instead of the minibatch's activations.

**Exactness.** Each micro-batch's loss is its share of the minibatch's loss, not a loss
of its own: every normaliser (token counts, sequence counts, group totals, the NLL term's
token count) is computed once over the whole minibatch before it is split
(``losses.aggregation_weights``), so the shares sum to the minibatch's loss and their
gradients to its gradient, for every aggregation rule. Per-token outputs (log-probs,
entropies, values) come back from the scan and the metrics are computed from them over
the whole minibatch, as one pass computes them. The router z-loss is a token mean (its
micro-batches' values weighted by their valid tokens). The load-balancing loss
``E mean_l sum_e f_le P_le`` is not a sum over tokens: its load fractions ``f`` (top-k
counts, no gradient) must be the minibatch's, so they are counted before the gradient
pass (``expert_counts``: from the replayed routing with routing replay, else a forward
pass of the micro-batches without gradient, one more forward per update) and each
micro-batch adds ``E mean_l sum_e f_le S_le / N`` with ``S`` its router probabilities
summed over its valid tokens and ``N`` the minibatch's (``load_balancing_share``): the
shares sum to the minibatch's loss and their gradients to its gradient.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from policyopt import sharding
from policyopt.rl.batch import Batch


def plan(rows: int, width: int, micro_batch_tokens: int) -> tuple[int, int]:
    """``(M, K)``: rows per micro-batch and micro-batches for ``rows`` rows of ``width``
    tokens, ``M = floor(micro_batch_tokens / width)`` (at most ``rows``), ``K = ceil(rows / M)``.

    Raises:
      ValueError: a row is longer than ``micro_batch_tokens``.
    """
    if width > micro_batch_tokens:
        raise ValueError(
            f"batch.micro_batch_tokens ({micro_batch_tokens}) is below the row "
            f"length {width}: a micro-batch holds whole rows"
        )
    per = min(rows, micro_batch_tokens // width)
    return per, -(-rows // per)


def split_rows(x: jax.Array, per: int, count: int, axis: int = 0, fill=0) -> jax.Array:
    """``x`` with its ``axis`` of R rows padded with ``fill`` to ``count * per`` and dealt
    out strided: ``[..., R, ...] -> [count, ..., per, ...]``, micro-batch j holding rows
    ``j, j + count, j + 2 count, ...``."""
    rows = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, count * per - rows)
    x = jnp.pad(x, pad, constant_values=fill) if count * per > rows else x
    x = x.reshape(x.shape[:axis] + (per, count) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis + 1, 0)


def merge_rows(x: jax.Array, rows: int) -> jax.Array:
    """The inverse of ``split_rows`` (axis 0): ``[count, per, ...] -> [rows, ...]``, the
    filler rows dropped."""
    count, per = x.shape[:2]
    return jnp.swapaxes(x, 0, 1).reshape((count * per,) + x.shape[2:])[:rows]


def split(batch: Batch, per: int, count: int) -> Batch:
    """Every field of ``batch`` split by ``split_rows`` (routing along its row axis 1; its
    filler rows route to experts 0..k-1, as padding slots do)."""
    routing = batch.routing
    if routing is not None:
        layers, rows, width, k = routing.shape
        if count * per > rows:
            filler = jnp.broadcast_to(
                jnp.arange(k, dtype=routing.dtype), (layers, count * per - rows, width, k)
            )
            routing = jnp.concatenate([routing, filler], axis=1)
        routing = split_rows(routing, per, count, axis=1)
    return Batch(
        *(
            routing
            if name == "routing"
            else None
            if value is None
            else split_rows(value, per, count)
            for name, value in zip(Batch._fields, batch)
        )
    )


def constrain_rows(batch: Batch) -> Batch:
    """``batch`` (one micro-batch, inside jit) with its rows split over ``data`` x ``fsdp``
    when a mesh is set and they divide, as ``batch.shard_batch`` places a minibatch."""

    def specs(mesh):
        return Batch(
            *(
                None
                if value is None
                else sharding.row_spec(value.shape, mesh, axis=1 if name == "routing" else 0)
                for name, value in zip(Batch._fields, batch)
            )
        )

    return sharding.constrain_tree(batch, specs)


def accumulate(share_fn: Callable, params, micro_batches) -> tuple[jax.Array, object, object]:
    """Sums ``share_fn``'s values and gradients over micro-batches with a ``lax.scan``.

    ``sum_j share_j`` and ``sum_j grad share_j``, the gradients added in float32 (then cast
    to each parameter's dtype, the dtype one pass gives).

    Args:
      share_fn: ``(params, micro_batch) -> (share, outputs)``: a scalar, and a pytree of
        arrays that the scan stacks.
      params: the parameters (a pytree; the accumulator is sharded like them).
      micro_batches: a pytree of arrays with a leading micro-batch axis ``[K, ...]``.

    Returns:
      ``(sum of shares, gradients, outputs stacked [K, ...])``.
    """
    grad_fn = jax.value_and_grad(share_fn, has_aux=True)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zeros = sharding.constrain_tree(zeros, lambda mesh: sharding.param_specs(params, mesh))

    def body(carry, micro_batch):
        total, summed = carry
        (share, outputs), grads = grad_fn(params, micro_batch)
        summed = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), summed, grads)
        return (total + share.astype(jnp.float32), summed), outputs

    (total, summed), outputs = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), zeros), micro_batches
    )
    grads = jax.tree.map(lambda s, p: s.astype(p.dtype), summed, params)
    return total, grads, outputs


def expert_counts(aux_fn: Callable, micro_batches) -> jax.Array | None:
    """Tokens per expert ``[L_moe, E]`` of the whole minibatch: ``aux_fn(micro_batch)``'s
    ``tokens_per_expert`` summed over the micro-batches, one forward pass each without
    gradient (``lax.map``); None for a dense model (no such output)."""
    counts = jax.lax.map(lambda micro: aux_fn(micro).get("tokens_per_expert"), micro_batches)
    return None if counts is None else jax.lax.stop_gradient(jnp.sum(counts, axis=0))


def replayed_counts(routing: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """Tokens per expert ``[L_moe, E]`` of replayed routing ``[L_moe, R, S, k]`` over the
    valid tokens ``[R, S]``: the counts the replaying forward's router reports."""
    one_hot = jax.nn.one_hot(routing, num_experts, dtype=jnp.float32)  # [L, R, S, k, E]
    return jnp.einsum("lrske,rs->le", one_hot, (valid > 0).astype(jnp.float32))


def load_balancing_share(prob_sum: jax.Array, counts: jax.Array, tokens: jax.Array) -> jax.Array:
    """``E mean_l sum_e f_le S_le / N``: a micro-batch's share of the minibatch's
    load-balancing loss (``policyopt.models.router.router_aux``), with ``S`` its
    ``router_prob_sum`` ``[L_moe, E]``, ``f_le = C_le / sum_e C_le`` the load fractions
    of the minibatch's ``counts`` ``[L_moe, E]`` (k copies per valid token) and ``N`` the
    minibatch's valid tokens. With the minibatch's own ``S``: its loss (0 without
    tokens)."""
    per_layer = jnp.sum(counts, axis=-1, keepdims=True)
    fractions = jnp.where(per_layer > 0, counts / jnp.maximum(per_layer, 1.0), 0.0)
    share = prob_sum.shape[-1] * jnp.mean(jnp.sum(fractions * prob_sum, axis=-1))
    return jnp.where(tokens > 0, share / jnp.maximum(tokens, 1.0), 0.0)


def token_weighted_mean(values: jax.Array, tokens: jax.Array) -> jax.Array:
    """``sum_j v_j t_j / sum_j t_j`` over micro-batches (0 without tokens): the
    minibatch's token mean from its micro-batches' (the router z-loss)."""
    total = jnp.sum(tokens)
    return jnp.where(total > 0, jnp.sum(values * tokens) / jnp.where(total > 0, total, 1), 0.0)
