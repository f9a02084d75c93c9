"""MoE router: top-k selection (or replay) and gates, and the router's auxiliary outputs.

Steps 2-4 and 6 of the routing in ``policyopt.models.moe`` (its module docstring numbers
them): ``route`` turns router logits into k experts and gates per token, ``router_aux``
gives the load-balancing loss, router z-loss and tokens per expert. Used by the MoE
block on one device and inside the expert-parallel block
(``policyopt.models.expert_parallel``), where ``router_aux`` sums its statistics over the
row axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(router_logits: jax.Array, k: int, norm_topk_prob: bool, routing: jax.Array | None = None):
    """Steps 2-4: select k experts per token (or take the replayed ones) and gate them.

    Args:
      router_logits: float32 [N, E].
      k: experts per token.
      norm_topk_prob: renormalise the gathered probabilities over the k experts.
      routing: int32 [N, k] experts to replay, or None to choose top-k.
    Returns:
      expert_ids int32 [N, k], gates float32 [N, k], probs float32 [N, E].
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    if routing is None:
        _, expert_ids = jax.lax.top_k(probs, k)
    else:
        # Out-of-range ids cannot raise inside jit; clip them so they stay harmless.
        expert_ids = jnp.clip(routing, 0, probs.shape[-1] - 1)
    expert_ids = expert_ids.astype(jnp.int32)
    gates = jnp.take_along_axis(probs, expert_ids, axis=-1)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return expert_ids, gates, probs


def router_aux(
    router_logits, probs, expert_ids, valid, num_experts: int, axis_names: tuple[str, ...] = ()
):
    """Step 6: load-balancing loss, router z-loss and tokens per expert over valid tokens.

    With c_e the copies routed to expert e (k per token) and P_e the mean router
    probability over the N valid tokens, the load-balancing loss is

        LB = E * sum_e f_e P_e,   f_e = c_e / (N k),

    1 at perfect balance (f_e = P_e = 1 / E) and E when every token sends all its
    probability and copies to one expert (k = 1). The Transformer reports the mean over
    its L MoE layers, mean_l LB_l.

    transformers' ``load_balancing_loss_func`` (the ``aux_loss`` of Qwen3-MoE, Mixtral,
    ...; ``router_aux_loss_coef`` times it enters their loss) divides the counts by N
    only, and pools counts and probabilities over the layers before the product:

        LB_HF = k E sum_e (mean_l f_le) (mean_l P_le),

    k at perfect balance. For one MoE layer (or layers with equal statistics)
    LB_HF = k * LB exactly (tests/models/test_hf.py checks both forms against transformers),
    so a coefficient alpha on LB_HF equals k alpha on LB here: HF's coefficient
    (Qwen3-MoE: 0.001) used unchanged on this loss pulls k times more weakly (8 times for
    Qwen3-30B-A3B's k = 8). With several layers HF's gradient pushes each layer towards
    the balance of the pooled load, this one towards that of its own.

    Under ``jax.shard_map`` with the tokens split over ``axis_names`` (expert
    parallelism), the counts and sums are ``psum``-ed over those axes first, so every
    device returns the statistics of the global batch.

    Also returned, for a loss over several calls (micro-batches,
    ``policyopt.rl.update.micro_batches.load_balancing_share``): ``tokens_per_expert`` c_e and
    ``router_prob_sum`` N P_e, the sum of the router probabilities over the valid tokens.
    """
    k = expert_ids.shape[-1]
    total = (lambda v: jax.lax.psum(v, axis_names)) if axis_names else (lambda v: v)
    valid_f = valid.astype(jnp.float32)
    n_valid = jnp.maximum(total(jnp.sum(valid_f)), 1.0)
    counts = total(
        jnp.sum(
            jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32) * valid_f[:, None, None],
            axis=(0, 1),
        )
    )  # [E]
    fraction = counts / (n_valid * k)
    prob_sum = total(jnp.sum(probs * valid_f[:, None], axis=0))  # [E]
    mean_prob = prob_sum / n_valid
    load_balancing = num_experts * jnp.sum(fraction * mean_prob)
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
    z_loss = total(jnp.sum(valid_f * z * z)) / n_valid
    return {
        "load_balancing_loss": load_balancing,
        "router_z_loss": z_loss,
        "tokens_per_expert": counts,
        "router_prob_sum": prob_sum,
    }
