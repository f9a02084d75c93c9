"""Routing metrics for MoE policies: routing volatility and sampler-vs-trainer disagreement.

**Routing volatility** (the quantity the GSPO paper, 2507.18071 §5.3, reports as "about
10% of the experts activated for the same rollout differ after one gradient update" on
Qwen3-30B-A3B): for the same batch, compare the experts that the *old* policy chose with
those the *updated* policy chooses, both without replay. Per token and MoE layer the k
chosen experts are compared **as sets** (the order of the top-k slots carries no
meaning), so a token contributes ``k - |S_old ∩ S_new|`` differing choices out of ``k``:

    volatility_l = sum_tokens (k - |S_old ∩ S_new|) / (k * number of tokens),

over the valid tokens (real prompt tokens and valid response tokens: the tokens whose
expert choice influences a log-prob of the batch), per layer and averaged over layers
(overall). The trainer measures it once per iteration, after all the updates of the
batch (after ``epochs * n_minibatches`` updates; after one update with the defaults).

**Sampler-vs-trainer disagreement** is the same quantity between the routing the
sampler recorded (KV-cache decode) and the routing of the trainer's full forward pass
with the same parameters: it is non-zero only through numerical differences (a near-tie
between two router logits resolved differently), which is what rollout routing replay
(R3, 2510.11370) removes.

**Routing share** (``routing/ratio_share``): the part of the importance ratio's noise that
routing causes, at the parameters after the batch's updates, on the batch's response
tokens. With ``lp_old`` pi_old's log-probs (its own routing), ``lp_new`` the updated
policy's (its own routing) and ``lp_replay`` the updated policy's under pi_old's routing,

    log r = (lp_new - lp_replay) + (lp_replay - lp_old) = routing part + parameter part,
    share = E[routing part^2] / (E[routing part^2] + E[parameter part^2]),

means over the valid response tokens (second moments about log r = 0, the ratio's noise
around 1). It is 0 when replaying pi_old's routing leaves the log-probs unchanged, and
near 1 when routing alone moves the ratio (docs/claims.md, "routing_share").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def routing_differences(
    routing_a: jax.Array, routing_b: jax.Array, token_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Fraction of differing expert choices, per MoE layer and overall.

    Args:
      routing_a, routing_b: int32 ``[L, R, S, k]`` expert indices (k distinct per token).
      token_mask: ``[R, S]``, 1 on the tokens to count.

    Returns:
      ``(overall scalar, per_layer [L])``, each in [0, 1]; 0 when no token is counted.
    """
    top_k = routing_a.shape[-1]
    shared = jnp.any(routing_a[..., :, None] == routing_b[..., None, :], axis=-1).sum(-1)  # [L,R,S]
    differing = (top_k - shared).astype(jnp.float32)
    weight = token_mask.astype(jnp.float32)[None]
    count = jnp.sum(weight[0])
    per_layer = jnp.sum(differing * weight, axis=(1, 2)) / jnp.maximum(top_k * count, 1.0)
    return jnp.mean(per_layer), per_layer


def routing_metrics(prefix: str, routing_a, routing_b, token_mask) -> dict[str, jax.Array]:
    """``{prefix: overall, prefix/layer_i: per-layer}`` from ``routing_differences``."""
    overall, per_layer = routing_differences(routing_a, routing_b, token_mask)
    metrics = {prefix: overall}
    for layer in range(per_layer.shape[0]):
        metrics[f"{prefix}/layer_{layer}"] = per_layer[layer]
    return metrics


def ratio_share_metrics(
    new_log_probs: jax.Array, replayed_log_probs: jax.Array, old_log_probs: jax.Array, mask
) -> dict[str, jax.Array]:
    """The routing share of the log-ratio (module doc) and its parts' mean squares.

    Args:
      new_log_probs: ``[R, N]``, the updated policy under its own routing.
      replayed_log_probs: ``[R, N]``, the updated policy under pi_old's routing.
      old_log_probs: ``[R, N]``, pi_old under its own routing.
      mask: ``[R, N]``, 1 on the valid response tokens.

    Returns:
      ``routing/ratio_share`` (NaN when neither part moved), ``routing/log_ratio_ms``
      (E[log r^2]), ``routing/log_ratio_ms_routing`` and ``routing/log_ratio_ms_params``.
    """
    weight = mask.astype(jnp.float32)
    count = jnp.maximum(jnp.sum(weight), 1.0)

    def mean_square(x):
        return jnp.sum(weight * jnp.square(x.astype(jnp.float32))) / count

    routing = mean_square(new_log_probs - replayed_log_probs)
    params = mean_square(replayed_log_probs - old_log_probs)
    total = routing + params
    return {
        "routing/ratio_share": jnp.where(
            total > 0, routing / jnp.where(total > 0, total, 1.0), jnp.nan
        ),
        "routing/log_ratio_ms": mean_square(new_log_probs - old_log_probs),
        "routing/log_ratio_ms_routing": routing,
        "routing/log_ratio_ms_params": params,
    }


def update_routing_metrics(
    old_routing, new_routing, sampler_routing, token_mask, sampler_name: str
) -> dict:
    """An iteration's two routing metrics, as host scalars: ``routing/volatility`` (pi_old's
    routing against the updated policy's) and ``sampler_name`` (pi_old's against the
    sampler's; the asynchronous trainer's sampler is stale and names it so), each with its
    per-layer values.

    Args:
      old_routing, new_routing, sampler_routing: int32 ``[L, R, S, k]`` expert indices,
        none of them replayed.
      token_mask: ``[R, S]``, 1 on the tokens to count (the rows' attention mask).
    """
    volatility = routing_metrics("routing/volatility", old_routing, new_routing, token_mask)
    disagreement = routing_metrics(sampler_name, old_routing, sampler_routing, token_mask)
    return {**jax.device_get(volatility), **jax.device_get(disagreement)}
