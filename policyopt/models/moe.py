"""Mixture-of-Experts block: router, top-k routing (captured or replayed), dropless
ragged, blocked, dense and gathered dispatch, capacity-factor one-hot dispatch, auxiliary outputs.

Routing, step by step, for N = B*T tokens x [N, D], E experts, k experts per token:

  1. Router logits   z = x W_r                        [N, E]   (float32)
  2. Probabilities   p = softmax(z)                   [N, E]
  3. Selection       e = top_k(p, k)                  [N, k]   int32, best first
     -- or, under replay (R2 / R3, docs/algorithms.md), e = the given routing: only the
     *selection* is replayed.
  4. Gate weights    g_j = p[e_j]  and, if norm_topk_prob, g_j /= sum_j g_j
     (= softmax of z over the k selected experts). Always recomputed from the *current*
     logits, so under replay the router still receives gradient through g.
  5. Experts         y = sum_j g_j * SwiGLU_{e_j}(x)   via one of six dispatches:

     ragged (dropless, default; MegaBlocks / MaxText "sparse matmul"):
       a. flatten the N*k token copies, argsort them by expert id (stable)
       b. group sizes = bincount(expert ids, E)
       c. gather x in that order and run the three expert matmuls as
          jax.lax.ragged_dot (one grouped GEMM per projection)
       d. scatter the outputs back to copy order, weight by g and sum over the k copies.

     megablox (dropless): as ragged, the grouped matmuls by the megablox GMM kernel for
       TPUs (``megablox_matmul``; Pallas interpret mode on other backends), on one device
       or on each device's local experts under expert parallelism.

     blocked (dropless, plain XLA; MegaBlocks' padded block-sparse form): as ragged,
       but each expert's group is padded to a multiple of ``moe_block_size`` rows, so
       every block of rows belongs to one expert; the blocks are multiplied by their
       expert's weights in one batched matmul. Work is O((N k + E * block) D F) on any
       backend. (XLA:CPU and XLA:GPU lower ragged_dot to a dense product over all
       experts, O(E N k D F); TPUs have grouped-matmul kernels.) The weights reach the
       blocks by an indexed gather on CPUs and by a one-hot [blocks, E] matmul on
       accelerators, whose gradient is then a matmul, not a scatter-add
       (``moe_weight_gather``).

     dense (dropless, no sort): every token through every expert, weighted by its gate
       for the k experts it chose and by 0 for the others (so a non-finite output of any
       expert reaches every token). E / k times the expert FLOPs of the dropless
       dispatches, but three batched matmuls over the experts with no sort, gather or
       scatter, and each weight read once: the fastest for decoding (few tokens) with
       small E / k on CPUs.

     gathered (dropless, for decoding): each expert's tokens gathered into a buffer
       of C rows, C a small multiple of the mean load N k / E chosen per call from a few
       static sizes (the busiest expert's count picks one; "dense" when it exceeds them
       all); three batched matmuls over the experts on the stored weights, as dense,
       with E C rows instead of E N.

     capacity (GShard / Switch Transformer): every expert has a buffer of
       C = ceil(capacity_factor * N * k / E) copies; copies claim buffer positions in
       priority order (all first choices, then all second choices, ...; token order
       within a choice), copies beyond C are dropped (their contribution is zero and
       they are counted). Dispatch and combine are one-hot einsums [N, E, C].

  6. Auxiliary outputs over the valid (non-padding) tokens:
       tokens_per_expert c_e = number of copies routed to e            [E]
       router_prob_sum = sum_n p_ne (N_valid P_e below)                [E]
       load-balancing loss = E * sum_e f_e P_e, f_e = c_e / (N_valid k),
         P_e = mean_n p_ne   (Switch Transformer eq. 4; 1 at perfect balance; the
         Transformer reports its mean over the MoE layers. Not the scale of transformers'
         aux_loss: see router_aux)
       router z-loss = mean_n logsumexp(z_n)^2                  (ST-MoE eq. 5)
       dropped_tokens = copies dropped by the capacity path (0 for ragged).

On a mesh with an ``expert`` axis of size > 1 the dropless dispatches run expert-parallel
under ``jax.shard_map``: each device routes its own rows and sends each token copy to the
device holding its expert (``policyopt.models.expert_parallel``). On a mesh with an
``fsdp`` axis and no ``expert`` (or ``tensor``) axis they run under the same
``shard_map``, each device on its own rows with every expert, the router and expert
weights all-gathered in it so that their gradients are reduce-scattered (ZeRO-3, as
the dense layers' ``policyopt.sharding.fsdp_call``).

Modules, each importing only the ones above it in this list:

  policyopt.models.router           steps 2-4 (``route``) and 6 (``router_aux``)
  policyopt.models.experts          step 5 on one device: each dispatch's expert
                                    computation, the megablox grouped matmul
  policyopt.models.expert_parallel  the block under ``jax.shard_map``: exchange of the
                                    copies, bounded buffers, local experts
  policyopt.models.moe              the ``MoE`` module: step 1 and the choice of dispatch

With LoRA adapters (``policyopt.models.lora``) on the router or the experts, every weight
above is ``W`` plus its low-rank product, each expert with its own, applied unmerged in
each dispatch (``lora.einsum`` and ``lora.grouped``), so routing, capture and replay are
those of the adapted model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from policyopt.models import lora
from policyopt.models.config import ModelConfig
from policyopt.models.expert_parallel import expert_parallel_block, expert_parallel_mesh
from policyopt.models.experts import capacity_experts, dropless_experts
from policyopt.models.layers import param
from policyopt.models.router import route, router_aux

# Logical axes of the router [D, E] and of the experts' weights [E, D, F] / [E, F, D].
_ROUTER_AXES = ("embed", None)
_IN_AXES = ("expert", "embed", "mlp")
_OUT_AXES = ("expert", "mlp", "embed")


class MoE(nnx.Module):
    """Qwen3-MoE sparse block: linear router + E SwiGLU experts (see module docstring);
    LoRA adapters (``policyopt.models.lora``), one per expert, inside every dispatch."""

    # Weight -> (LoRA target, batch dims, input dims): the experts' batch axis is E.
    LORA_SLOTS = {
        "router": ("router", 0, 1),
        "gate_proj": ("experts.gate_proj", 1, 1),
        "up_proj": ("experts.up_proj", 1, 1),
        "down_proj": ("experts.down_proj", 1, 1),
    }

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e = config.hidden_size, config.expert_intermediate_size, config.num_experts
        std, pdt = config.initializer_range, config.weight_dtype
        self.config = config
        self.router = param(rngs, (d, e), _ROUTER_AXES, std=std, dtype=pdt)
        self.gate_proj = param(rngs, (e, d, f), _IN_AXES, std=std, dtype=pdt)
        self.up_proj = param(rngs, (e, d, f), _IN_AXES, std=std, dtype=pdt)
        self.down_proj = param(rngs, (e, f, d), _OUT_AXES, std=std, dtype=pdt)
        self.lora = nnx.data(None)  # lora.Adapters, set by Transformer

    def weights(self) -> list:
        """``[(weight, logical axes)]`` of the router and the three expert weights, each an
        array or a ``lora.Adapted`` (``lora.adapt``)."""
        axes = (_ROUTER_AXES, _IN_AXES, _IN_AXES, _OUT_AXES)
        names = ("router", "gate_proj", "up_proj", "down_proj")
        return [lora.adapt(self.lora, n, getattr(self, n)[...], a) for n, a in zip(names, axes)]

    def __call__(self, x: jax.Array, token_mask: jax.Array, routing: jax.Array | None = None):
        """Args:
          x: [B, T, D]; token_mask: bool [B, T]; routing: int32 [B, T, k] to replay or None.
        Returns:
          (y [B, T, D], routing int32 [B, T, k], aux dict of float32: load_balancing_loss,
           router_z_loss, dropped_tokens scalars and tokens_per_expert [E]).
        """
        cfg = self.config
        b, t, d = x.shape
        k, dt = cfg.num_experts_per_tok, cfg.compute_dtype
        dispatch = cfg.moe_dispatch
        if t == 1 and cfg.moe_decode_dispatch is not None:
            dispatch = cfg.moe_decode_dispatch  # a decode step
        weights = self.weights()
        plan = None if dispatch == "capacity" else expert_parallel_mesh(cfg, b)
        if plan is not None:
            y, expert_ids, aux = expert_parallel_block(
                x, token_mask, routing, weights, cfg, dispatch, *plan
            )
            aux["dropped_tokens"] = jnp.zeros((), jnp.float32)
            return y, expert_ids, aux
        router, *params = (w for w, _ in weights)
        flat = x.reshape(b * t, d)
        valid = token_mask.reshape(b * t)
        logits = lora.einsum(
            "nd,de->ne", flat.astype(jnp.float32), router.astype(jnp.float32), jnp.einsum
        )
        replay = None if routing is None else routing.reshape(b * t, k)
        expert_ids, gates, probs = route(logits, k, cfg.norm_topk_prob, replay)
        dropped = jnp.zeros((), jnp.float32)
        if dispatch == "capacity":
            y, dropped = capacity_experts(
                flat.astype(dt),
                expert_ids,
                gates,
                valid,
                *[w.astype(dt) for w in params],
                capacity=cfg.expert_capacity(b * t),
            )
        else:
            y = dropless_experts(
                flat.astype(dt),
                expert_ids,
                gates,
                *params,
                dispatch=dispatch,
                block_size=cfg.moe_block_size,
                gather=cfg.resolved_weight_gather(),
            )
        aux = router_aux(logits, probs, expert_ids, valid, cfg.num_experts)
        aux["dropped_tokens"] = dropped
        return y.reshape(b, t, d), expert_ids.reshape(b, t, k), aux
