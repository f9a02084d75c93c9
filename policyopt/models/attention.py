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

from policyopt.models import lora
from policyopt.models.attention_ops import attend, attention_weights_mask, dot_product_attention
from policyopt.models.config import ModelConfig
from policyopt.models.layers import RMSNorm, apply_rope, param
from policyopt.sharding import constrain, fsdp_call

# Logical axes (``policyopt.sharding``) of the cache's keys [L, B, Hkv, Dh, S] and
# values [L, B, Hkv, S, Dh]: rows follow the batch, heads the attention heads.
KEY_CACHE_AXES = (None, "batch", "kv_heads", "kv", "length")
VALUE_CACHE_AXES = (None, "batch", "kv_heads", "length", "kv")
# Logical axes of the projections' weights: q [D, H, Dh], k and v [D, Hkv, Dh], o [H, Dh, D].
_Q_AXES = ("embed", "heads", "kv")
_KV_AXES = ("embed", "kv_heads", "kv")
_O_AXES = ("heads", "kv", "embed")


@struct.dataclass
class KVCache:
    """Keys and values of every layer, a pytree.

    Attributes:
      k: [L, B, Hkv, Dh, S] rotated keys, stored transposed (slots last), so that a
        decode step's scores are a plain [G, Dh] x [Dh, S] product per row and head; or,
        in the per-layer form, a tuple of L arrays [B, Hkv, Dh, S].
      v: [L, B, Hkv, S, Dh] values, or a tuple of L [B, Hkv, S, Dh] arrays.
      key_mask: bool [B, S], True where the slot holds a real (non-padding) key.
      index: int32 scalar, next slot to write.

    Heads come before slots in both, so a decode step reads each head's keys and values
    as contiguous blocks. The per-layer form (``per_layer=True``, ``unstack()``) is what
    the sampler's decode loop carries: each layer's attention then reads its own
    buffers, where a layer of a stacked array is first copied out of it (XLA cannot
    hand a slice of a buffer to a matmul). Both forms give the same results.
    """

    k: jax.Array | tuple
    v: jax.Array | tuple
    key_mask: jax.Array
    index: jax.Array

    # Dense slots: attention runs here (``policyopt.models.interface.Cache``).
    paged = False

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        batch_size: int,
        max_length: int,
        dtype=None,
        *,
        per_layer: bool = False,
    ):
        dtype = jnp.dtype(dtype) if dtype is not None else config.compute_dtype
        b, hkv, dh, layers = batch_size, config.num_kv_heads, config.head_dim, config.num_layers

        def zeros(shape, axes):
            if per_layer:
                return tuple(constrain(jnp.zeros(shape, dtype), axes[1:]) for _ in range(layers))
            return constrain(jnp.zeros((layers,) + shape, dtype), axes)

        return cls(
            k=zeros((b, hkv, dh, max_length), KEY_CACHE_AXES),
            v=zeros((b, hkv, max_length, dh), VALUE_CACHE_AXES),
            key_mask=jnp.zeros((batch_size, max_length), bool),
            index=jnp.zeros((), jnp.int32),
        )

    @property
    def per_layer(self) -> bool:
        return isinstance(self.k, tuple)

    @property
    def max_length(self) -> int:
        return self.key_mask.shape[1]

    def unstack(self) -> "KVCache":
        """The per-layer form (tuples of per-layer arrays)."""
        if self.per_layer:
            return self
        return self.replace(k=tuple(self.k), v=tuple(self.v))

    def stack(self) -> "KVCache":
        """The stacked form ([L, ...] arrays)."""
        if not self.per_layer:
            return self
        return self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

    def map_layers(self, fn) -> "KVCache":
        """Applies ``fn`` to every per-layer key and value array (either form); ``fn``
        must keep the axes of [B, Hkv, ...] in place (e.g. repeat or select rows)."""
        if self.per_layer:
            return self.replace(k=tuple(fn(x) for x in self.k), v=tuple(fn(x) for x in self.v))
        return self.replace(k=jax.vmap(fn)(self.k), v=jax.vmap(fn)(self.v))

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Keys [B, Hkv, Dh, S] and values [B, Hkv, S, Dh] of ``layer``."""
        return self.k[layer], self.v[layer]

    def write(self, layer: int, k: jax.Array, v: jax.Array) -> "KVCache":
        """Writes ``k, v`` [B, T, Hkv, Dh] (the projections' layout) of ``layer`` at slots
        [index, index + T)."""
        k = jnp.transpose(k, (0, 2, 3, 1))  # [B, Hkv, Dh, T]
        v = jnp.swapaxes(v, 1, 2)  # [B, Hkv, T, Dh]

        def put(buf, new, start, axes):
            if self.per_layer:
                out = jax.lax.dynamic_update_slice(buf[layer], new.astype(buf[layer].dtype), start)
                return buf[:layer] + (constrain(out, axes[1:]),) + buf[layer + 1 :]
            out = jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype)[None], (layer,) + start)
            return constrain(out, axes)

        return self.replace(
            k=put(self.k, k, (0, 0, 0, self.index), KEY_CACHE_AXES),
            v=put(self.v, v, (0, 0, self.index, 0), VALUE_CACHE_AXES),
        )

    def resize(self, length: int) -> "KVCache":
        """This cache with ``length`` slots: empty slots (``key_mask`` False) appended at the
        end, or the last slots dropped. Index, keys and values of the kept slots unchanged;
        ``length`` must stay above the slots still to be written (``dynamic_update_slice``
        would clamp a write past the end onto the last slots)."""
        extra = length - self.max_length
        if extra == 0:
            return self

        def fit(x, axis, axes=None):
            if extra < 0:
                x = jax.lax.slice_in_dim(x, 0, length, axis=axis)
            else:
                widths = [(0, 0)] * x.ndim
                widths[axis] = (0, extra)
                x = jnp.pad(x, widths)
            return x if axes is None else constrain(x, axes)

        def fit_all(buf, axes):
            if self.per_layer:
                return tuple(fit(x, axes.index("length") - 1, axes[1:]) for x in buf)
            return fit(buf, axes.index("length"), axes)

        return self.replace(
            k=fit_all(self.k, KEY_CACHE_AXES),
            v=fit_all(self.v, VALUE_CACHE_AXES),
            key_mask=fit(self.key_mask, 1),
        )

    def roll_slots(self, shift) -> "KVCache":
        """Every layer's keys, values and ``key_mask`` rolled by ``shift`` slots
        (``jnp.roll`` along the slot axis)."""
        if self.per_layer:
            raise ValueError("roll_slots needs the stacked form (KVCache.stack())")
        return self.replace(
            k=jnp.roll(self.k, shift, axis=4),
            v=jnp.roll(self.v, shift, axis=3),
            key_mask=jnp.roll(self.key_mask, shift, axis=1),
        )

    def put_rows(self, other: "KVCache", row, slot) -> "KVCache":
        """This cache with ``other``'s keys and values (stacked, [L, B', ...], all of its
        S' slots) written at rows [row, row + B'), slots [slot, slot + S') (``row`` and
        ``slot``: ints or traced int32 scalars). The key mask and index are left alone."""
        if self.per_layer or other.per_layer:
            raise ValueError("put_rows needs the stacked form (KVCache.stack())")
        k = jax.lax.dynamic_update_slice(self.k, other.k.astype(self.k.dtype), (0, row, 0, 0, slot))
        v = jax.lax.dynamic_update_slice(self.v, other.v.astype(self.v.dtype), (0, row, 0, slot, 0))
        return self.replace(k=k, v=v)


class Attention(nnx.Module):
    """Qwen3 attention: q/k/v projections, RMSNorm on each q and k head, RoPE, GQA, o_proj;
    LoRA adapters on the projections (``policyopt.models.lora``) when ``lora`` holds them."""

    # Weight -> (LoRA target, batch dims, input dims).
    LORA_SLOTS = {
        "q_proj": ("q_proj", 0, 1),
        "k_proj": ("k_proj", 0, 1),
        "v_proj": ("v_proj", 0, 1),
        "o_proj": ("o_proj", 0, 2),
    }

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, h, hkv, dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        std, pdt = config.initializer_range, config.weight_dtype
        self.dtype = config.compute_dtype
        # Checked here, at model build time, so that a backend without it fails before
        # anything compiles.
        self.implementation = config.resolved_attention()
        self.block_size = config.attention_block_size
        self.q_proj = param(rngs, (d, h, dh), _Q_AXES, std=std, dtype=pdt)
        self.k_proj = param(rngs, (d, hkv, dh), _KV_AXES, std=std, dtype=pdt)
        self.v_proj = param(rngs, (d, hkv, dh), _KV_AXES, std=std, dtype=pdt)
        self.o_proj = param(rngs, (h, dh, d), _O_AXES, std=std, dtype=pdt)
        self.q_norm = RMSNorm(dh, config.rms_norm_eps, param_dtype=pdt, axis_name="kv")
        self.k_norm = RMSNorm(dh, config.rms_norm_eps, param_dtype=pdt, axis_name="kv")
        self.lora = nnx.data(None)  # lora.Adapters, set by Transformer

    def __call__(
        self,
        x,
        cos,
        sin,
        token_mask,
        cache: KVCache | None,
        layer: int,
        segment_ids: jax.Array | None = None,
    ):
        """Attention of one block.

        Args:
          x: [B, T, D] normed input.
          cos, sin: [B, T, Dh] rotary phases at the tokens' positions.
          token_mask: bool [B, T], False for padding tokens (never attended as keys).
          cache: KVCache (updated at slots [index, index+T) of layer ``layer``), a
            ``policyopt.models.paged.PagedKVCache`` (see its ``attend``), or None.
          layer: index of this block in the cache.
          segment_ids: int32 [B, T] or None: packed rows, a query sees only the keys of
            its own segment (0 = padding, never seen). Not with a cache.
        Returns:
          (out [B, T, D], cache or None). The returned cache's index is NOT advanced here.
        """
        dt = self.dtype
        x = x.astype(dt)
        arrays, axes, structure = lora.flatten(
            [
                lora.adapt(self.lora, "q_proj", self.q_proj[...], _Q_AXES),
                lora.adapt(self.lora, "k_proj", self.k_proj[...], _KV_AXES),
                lora.adapt(self.lora, "v_proj", self.v_proj[...], _KV_AXES),
            ]
        )
        q, k, v = fsdp_call(
            lambda x, arrays: self._project(x, lora.unflatten(structure, arrays)), x, arrays, axes
        )
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        q = constrain(q, ("batch", "length", "heads", "kv"))
        t = x.shape[1]
        if cache is not None and cache.paged:  # policyopt.models.paged.PagedKVCache
            out, cache = cache.attend(layer, q, k, v, token_mask)
            return self._output(out.astype(dt)), cache
        if cache is None:
            out = attend(
                q,
                k,
                v,
                key_mask=token_mask,
                segment_ids=segment_ids,
                implementation=self.implementation,
                block_size=self.block_size,
            )
        else:
            if segment_ids is not None:
                raise ValueError(
                    "segment_ids (packed rows) cannot be used with a KV cache: "
                    "packing is for training forwards; decode unpacked rows"
                )
            cache = cache.write(layer, k, v)
            key_mask = jax.lax.dynamic_update_slice(cache.key_mask, token_mask, (0, cache.index))
            cache = cache.replace(key_mask=key_mask)
            keys, values = (x.astype(dt) for x in cache.layer(layer))
            mask = attention_weights_mask(cache.index + jnp.arange(t), key_mask)
            out = dot_product_attention(q, keys, values, mask, cache_layout=True)
        return self._output(out), cache

    # The projections run under ``policyopt.sharding.fsdp_call``: on an fsdp mesh their
    # weights are gathered inside a shard_map and their gradients reduce-scattered. Each
    # product is ``projection.project``'s (through ``lora.einsum``, which adds an adapter's).

    def _project(self, x, weights):
        """x [B, T, D] -> q [B, T, H, Dh], k and v [B, T, Hkv, Dh]."""
        return tuple(lora.einsum("btd,dnh->btnh", x, w.astype(self.dtype)) for w in weights)

    def _output(self, out):
        """Attention outputs [B, T, H, Dh] -> [B, T, D] (o_proj)."""
        arrays, axes, structure = lora.flatten(
            [lora.adapt(self.lora, "o_proj", self.o_proj[...], _O_AXES)]
        )

        def o_proj(out, arrays):
            (w,) = lora.unflatten(structure, arrays)
            return lora.einsum("btnh,nhd->btd", out, w.astype(self.dtype))

        return fsdp_call(o_proj, out, arrays, axes)
