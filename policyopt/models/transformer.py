"""The decoder: embedding, pre-norm blocks (attention + MLP or MoE), final norm, output
projection; returns logits or hidden states, the updated KV cache, the routing of every
MoE layer and the auxiliary router losses."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from policyopt.models.attention import Attention, KVCache
from policyopt.models.config import ModelConfig
from policyopt.models.layers import MLP, RMSNorm, param, rope_cos_sin
from policyopt.models.moe import MoE
from policyopt.models.sharding import constrain


@struct.dataclass
class ModelOutput:
    """What one forward pass returns (a pytree, so it can leave a jit).

    Attributes:
      logits: float32 [B, T, V], or None when called with return_logits=False.
      hidden: [B, T, D] final hidden states (after the final norm), the input of the
        vocabulary projection (see policyopt.logprobs.token_log_probs).
      cache: the updated KVCache, or None when no cache was passed.
      routing: int32 [L_moe, B, T, k] experts chosen (or replayed) per MoE layer; None for
        a dense model.
      aux: dict with "load_balancing_loss", "router_z_loss", "dropped_tokens" (float32
        scalars, mean over MoE layers for the losses, sum for dropped) and
        "tokens_per_expert" float32 [L_moe, E]; empty for a dense model. The
        load-balancing loss is 1 at perfect balance, 1 / k of transformers' aux_loss
        for one MoE layer (policyopt.models.moe.router_aux).
    """

    logits: jax.Array | None
    hidden: jax.Array
    cache: KVCache | None
    routing: jax.Array | None
    aux: dict


class Block(nnx.Module):
    """x + Attn(RMSNorm(x)), then h + FFN(RMSNorm(h)), FFN = SwiGLU MLP or MoE."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        self.layer = layer
        self.is_moe = layer in config.moe_layer_indices
        pdt = config.weight_dtype
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=pdt)
        self.attn = Attention(config, rngs=rngs)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=pdt)
        if self.is_moe:
            self.mlp = MoE(config, rngs=rngs)
        else:
            self.mlp = MLP(config, config.intermediate_size, rngs=rngs)

    def __call__(self, x, cos, sin, token_mask, cache, routing, segment_ids=None):
        attn_out, cache = self.attn(self.input_norm(x), cos, sin, token_mask, cache, self.layer,
                                    segment_ids)
        x = x + attn_out.astype(x.dtype)
        h = self.post_attention_norm(x)
        if self.is_moe:
            ffn_out, routing, aux = self.mlp(h, token_mask, routing)
        else:
            ffn_out, routing, aux = self.mlp(h), None, None
        x = x + ffn_out.astype(x.dtype)
        return constrain(x, ("batch", "length", "embed")), cache, routing, aux


class Transformer(nnx.Module):
    """Qwen3 / Qwen3-MoE decoder-only language model (see ModelConfig)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        pdt, std = config.weight_dtype, config.initializer_range
        self.embed = param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"),
                           std=std, dtype=pdt)
        self.layers = nnx.List([Block(config, i, rngs=rngs) for i in range(config.num_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=pdt)
        if not config.tie_word_embeddings:
            self.lm_head = param(rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"),
                                 std=std, dtype=pdt)

    def init_cache(self, batch_size: int, max_length: int, dtype=None, *,
                   per_layer: bool = False) -> KVCache:
        """An empty KVCache for ``batch_size`` rows and ``max_length`` slots (compute dtype
        unless ``dtype`` is given), stacked or per layer (see KVCache)."""
        return KVCache.create(self.config, batch_size, max_length, dtype, per_layer=per_layer)

    def output_embedding(self) -> jax.Array:
        """[D, V] matrix W with logits = hidden @ W (the embedding transposed when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, cache: KVCache | None = None,
                 routing: jax.Array | None = None, return_logits: bool = True,
                 segment_ids: jax.Array | None = None) -> ModelOutput:
        """Forward pass.

        Args:
          tokens: int32 [B, T]. Ids outside [0, V) are clamped into it: such ids are
            meant for padding (attention_mask 0), which they must not poison (a NaN
            embedding, as an out-of-range lookup gives, reaches every real token of
            its row through attention: probability 0 times NaN is NaN).
          positions: int32 [B, T] RoPE positions; default 0..T-1, or cache.index + 0..T-1
            with a cache. Right-padded rows need explicit ones (prompt_length + step).
          attention_mask: [B, T], 1 = real token; keys with 0 are never attended. Default ones.
          cache: KVCache to read and extend at slots [index, index+T), or None.
          routing: int32 [L_moe, B, T, k] experts to replay in every MoE layer, or None.
          return_logits: False skips the vocabulary projection (logits=None).
          segment_ids: int32 [B, T] or None: packed rows, several sequences per row; a
            token attends only to earlier tokens of its own segment, and tokens of
            segment 0 are padding (as with attention_mask 0). Positions stay the
            caller's (per segment: 0.. at each segment's start). Not with a cache.
        Returns:
          ModelOutput.
        """
        cfg = self.config
        b, t = tokens.shape
        if positions is None:
            start = 0 if cache is None else cache.index
            positions = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
        if attention_mask is None:
            token_mask = jnp.ones((b, t), bool)
        else:
            token_mask = attention_mask.astype(bool)
        if segment_ids is not None:
            if cache is not None:
                raise ValueError("segment_ids (packed rows) cannot be used with a KV cache")
            if tuple(segment_ids.shape) != (b, t):
                raise ValueError(f"segment_ids must have the tokens' shape [B, T] = {(b, t)}, "
                                 f"got {tuple(segment_ids.shape)}")
            segment_ids = segment_ids.astype(jnp.int32)
            token_mask = token_mask & (segment_ids != 0)
        if routing is not None:
            expected = (cfg.num_moe_layers, b, t, cfg.num_experts_per_tok)
            if not cfg.is_moe:
                raise ValueError("routing was passed to a dense model (num_experts == 0)")
            if tuple(routing.shape) != expected:
                raise ValueError(f"routing must have shape [L_moe, B, T, k] = {expected}, "
                                 f"got {tuple(routing.shape)}")
        # The table is gathered whole along `embed` first (as FSDP gathers every weight at
        # use): a lookup into a table sharded along `embed` yields rows sharded along it,
        # which XLA can only reshard to batch rows by replicating them in full
        # ("involuntary full rematerialization" on a data x fsdp x tensor mesh).
        table = constrain(self.embed[...], ("vocab", None))
        x = jnp.take(table, tokens, axis=0, mode="clip").astype(cfg.compute_dtype)
        x = constrain(x, ("batch", "length", "embed"))
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        routings, auxes = [], []
        for block in self.layers:
            layer_routing = None
            if block.is_moe and routing is not None:
                layer_routing = routing[len(routings)]
            x, cache, layer_routing, aux = block(x, cos, sin, token_mask, cache, layer_routing,
                                                 segment_ids)
            if block.is_moe:
                routings.append(layer_routing)
                auxes.append(aux)
        hidden = self.final_norm(x)
        logits = None
        if return_logits:
            logits = jnp.einsum("btd,dv->btv", hidden, self.output_embedding().astype(hidden.dtype),
                                preferred_element_type=jnp.float32)
        if cache is not None:
            cache = cache.replace(index=cache.index + t)
        out_routing, out_aux = None, {}
        if routings:
            out_routing = jnp.stack(routings)
            out_aux = {
                "load_balancing_loss": jnp.mean(jnp.stack([a["load_balancing_loss"] for a in auxes])),
                "router_z_loss": jnp.mean(jnp.stack([a["router_z_loss"] for a in auxes])),
                "dropped_tokens": jnp.sum(jnp.stack([a["dropped_tokens"] for a in auxes])),
                "tokens_per_expert": jnp.stack([a["tokens_per_expert"] for a in auxes]),
            }
        return ModelOutput(logits=logits, hidden=hidden, cache=cache, routing=out_routing,
                           aux=out_aux)
