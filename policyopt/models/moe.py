"""Mixture-of-Experts block: router, top-k routing (captured or replayed), dropless
ragged, blocked, dense and gathered dispatch, capacity-factor one-hot dispatch, auxiliary
outputs.

Router logits in float32, top-k selection (or the replayed selection under R2 / R3: only
the selection; gate weights are always recomputed from the current logits, renormalised
over the k experts with ``norm_topk_prob``), the experts by one of six dispatches
(``model.moe_dispatch``), and the load-balancing and z-loss statistics. Under a mesh with an
``expert`` or ``fsdp`` axis the dropless dispatches run under ``jax.shard_map``
(``policyopt.models.expert_parallel``). Modules: ``router`` (routing, aux), ``experts`` (one
device's dispatches), ``expert_parallel``, and this one (the ``MoE`` module). Step by step,
with each dispatch's cost: docs/scale.md, "The MoE block, step by step".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from policyopt.models import lora
from policyopt.models.config import ModelConfig
from policyopt.models.expert_parallel import expert_parallel_block, expert_parallel_mesh
from policyopt.models.experts import capacity_experts, configured_experts
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
            y = configured_experts(flat.astype(dt), expert_ids, gates, params, cfg, dispatch)
        aux = router_aux(logits, probs, expert_ids, valid, cfg.num_experts)
        aux["dropped_tokens"] = dropped
        return y.reshape(b, t, d), expert_ids.reshape(b, t, k), aux
