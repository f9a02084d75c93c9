"""Grouped-query attention with per-head q/k RMSNorm, RoPE, padding mask and KV cache.

Prefill and one-token decode run the same code: a call with T new tokens writes their
keys and values at cache slots ``[index, index + T)`` (one slot range for every row),
marks those slots valid where ``attention_mask`` is 1, and lets query t (at slot
``index + t``) attend to every valid slot s <= index + t. Rotary phases come from the
explicit ``positions``, not from the slots, so right-padded prompts decode with per-row
positions (prompt_length + step) while writing to a shared slot; their padding slots stay
masked forever.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from policyopt.models.config import ModelConfig
from policyopt.models.layers import RMSNorm, apply_rope, param
from policyopt.models.sharding import constrain

# Finite "minus infinity": a query whose keys are all masked (e.g. a padding token at the
# start of a row) gets a uniform average instead of NaN, and is ignored downstream.
_MASK_VALUE = -1e30

# Logical axes of the cache's keys and values [L, B, Hkv, S, Dh]
# (``policyopt.models.sharding``): rows follow the batch, heads the attention heads.
CACHE_AXES = (None, "batch", "kv_heads", "length", "kv")


@struct.dataclass
class KVCache:
    """Keys and values of every layer, a pytree.

    Attributes:
      k: [L, B, Hkv, S, Dh] rotated keys (heads before slots: a decode step reads each
        head's keys as one contiguous [S, Dh] block, with no transpose per step).
      v: [L, B, Hkv, S, Dh] values.
      key_mask: bool [B, S], True where the slot holds a real (non-padding) key.
      index: int32 scalar, next slot to write.
    """

    k: jax.Array
    v: jax.Array
    key_mask: jax.Array
    index: jax.Array

    @classmethod
    def create(cls, config: ModelConfig, batch_size: int, max_length: int, dtype=None):
        dtype = jnp.dtype(dtype) if dtype is not None else config.compute_dtype
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_length, config.head_dim)
        zeros = lambda: constrain(jnp.zeros(shape, dtype), CACHE_AXES)
        return cls(k=zeros(), v=zeros(),
                   key_mask=jnp.zeros((batch_size, max_length), bool),
                   index=jnp.zeros((), jnp.int32))

    @property
    def max_length(self) -> int:
        return self.k.shape[3]


def attention_weights_mask(query_slots: jax.Array, key_mask: jax.Array) -> jax.Array:
    """bool [B, T, S]: query at slot q may see key slot s iff s <= q and key_mask[b, s].

    Args:
      query_slots: int32 [T] slot of each query.
      key_mask: bool [B, S].
    """
    key_slots = jnp.arange(key_mask.shape[1])
    causal = key_slots[None, :] <= query_slots[:, None]               # [T,S]
    return causal[None, :, :] & key_mask[:, None, :]


def dot_product_attention(q, k, v, mask, *, heads_first: bool = False):
    """softmax(q k^T / sqrt(Dh) + mask) v with grouped heads; softmax in float32.

    Args:
      q: [B, T, H, Dh]; k, v: [B, S, Hkv, Dh], or [B, Hkv, S, Dh] with heads_first (the
        KV cache's layout); mask: bool [B, T, S].
    Returns:
      [B, T, H, Dh] in q's dtype.
    """
    b, t, h, dh = q.shape
    hkv = k.shape[1 if heads_first else 2]
    g = h // hkv
    kv = "bksh" if heads_first else "bskh"
    scores = jnp.einsum(f"btkgh,{kv}->bkgts", q.reshape(b, t, hkv, g, dh), k,
                        preferred_element_type=jnp.float32) * (dh ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if heads_first:
        # Probabilities times values as a batched matmul with the batch dims (b, k)
        # leading and the query rows (t, g) together, the layout XLA:CPU's matmul library
        # takes as is (3x faster there than "bkgts,bksh->btkgh" for a decode step; with
        # t = 1 the transposes are free reshapes). The same form for the scores is slower.
        probs = probs.transpose(0, 1, 3, 2, 4).reshape(b, hkv, t * g, -1)
        out = jnp.einsum("bkqs,bksh->bkqh", probs, v)
        return out.reshape(b, hkv, t, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, t, h, dh)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, h, dh)


class Attention(nnx.Module):
    """Qwen3 attention: q/k/v projections, RMSNorm on each q and k head, RoPE, GQA, o_proj."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, h, hkv, dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        std, pdt = config.initializer_range, config.weight_dtype
        self.dtype = config.compute_dtype
        self.q_proj = param(rngs, (d, h, dh), ("embed", "heads", "kv"), std=std, dtype=pdt)
        self.k_proj = param(rngs, (d, hkv, dh), ("embed", "kv_heads", "kv"), std=std, dtype=pdt)
        self.v_proj = param(rngs, (d, hkv, dh), ("embed", "kv_heads", "kv"), std=std, dtype=pdt)
        self.o_proj = param(rngs, (h, dh, d), ("heads", "kv", "embed"), std=std, dtype=pdt)
        self.q_norm = RMSNorm(dh, config.rms_norm_eps, param_dtype=pdt, axis_name="kv")
        self.k_norm = RMSNorm(dh, config.rms_norm_eps, param_dtype=pdt, axis_name="kv")

    def __call__(self, x, cos, sin, token_mask, cache: KVCache | None, layer: int):
        """Attention of one block.

        Args:
          x: [B, T, D] normed input.
          cos, sin: [B, T, Dh] rotary phases at the tokens' positions.
          token_mask: bool [B, T], False for padding tokens (never attended as keys).
          cache: KVCache (updated at slots [index, index+T) of layer ``layer``) or None.
          layer: index of this block in the cache.
        Returns:
          (out [B, T, D], cache or None). The returned cache's index is NOT advanced here.
        """
        dt = self.dtype
        x = x.astype(dt)
        q = jnp.einsum("btd,dnh->btnh", x, self.q_proj[...].astype(dt))
        k = jnp.einsum("btd,dnh->btnh", x, self.k_proj[...].astype(dt))
        v = jnp.einsum("btd,dnh->btnh", x, self.v_proj[...].astype(dt))
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        q = constrain(q, ("batch", "length", "heads", "kv"))
        t = x.shape[1]
        if cache is None:
            keys, values = k, v
            mask = attention_weights_mask(jnp.arange(t), token_mask)
        else:
            start = (layer, 0, 0, cache.index, 0)
            to_cache = lambda x, c: jnp.swapaxes(x, 1, 2).astype(c.dtype)[None]   # [1,B,Hkv,T,Dh]
            new_k = jax.lax.dynamic_update_slice(cache.k, to_cache(k, cache.k), start)
            new_v = jax.lax.dynamic_update_slice(cache.v, to_cache(v, cache.v), start)
            new_k, new_v = constrain(new_k, CACHE_AXES), constrain(new_v, CACHE_AXES)
            key_mask = jax.lax.dynamic_update_slice(cache.key_mask, token_mask, (0, cache.index))
            cache = cache.replace(k=new_k, v=new_v, key_mask=key_mask)
            keys, values = new_k[layer].astype(dt), new_v[layer].astype(dt)
            mask = attention_weights_mask(cache.index + jnp.arange(t), key_mask)
        out = dot_product_attention(q, keys, values, mask, heads_first=cache is not None)
        out = jnp.einsum("btnh,nhd->btd", out, self.o_proj[...].astype(dt))
        return out, cache
