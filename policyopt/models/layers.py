"""Small building blocks: parameter helper, RMSNorm, rotary embeddings, SwiGLU MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from policyopt import sharding
from policyopt.models.config import ModelConfig
from policyopt.models.projection import project


def param(rngs: nnx.Rngs | None, shape, logical_axes, *, std: float | None, dtype):
    """An ``nnx.Param`` of ``shape``, normal(0, std) (or ones when std is None), tagged with
    its logical axis names (see ``policyopt.sharding``).

    Outside a trace the values are drawn on the host with NumPy, seeded by
    ``rngs.params()``: building a model then compiles nothing (an eager
    ``jax.random.normal`` compiles a kernel per distinct shape, seconds each on a CPU).
    Under a mesh of several devices (``jax.set_mesh``) each device then receives only its
    shard of the draw (``policyopt.sharding.place_host_array``: the placement of
    ``shard_params``), so a model too large for one device can be built; the values are
    the same as without a mesh. Under ``jit`` / ``eval_shape`` they come from
    ``jax.random.normal``.
    """
    if len(shape) != len(logical_axes):
        raise ValueError(f"param shape {shape} and logical axes {logical_axes} differ in rank")
    dtype = jnp.dtype(dtype)
    logical_axes = tuple(logical_axes)
    if std is None:
        value = np.ones(shape, dtype)
    else:
        key = rngs.params()
        if isinstance(key, jax.core.Tracer):
            value = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
            return nnx.Param(value, logical_axes=logical_axes)
        seed = np.asarray(jax.random.key_data(key)).astype(np.uint32).ravel().tolist()
        draw = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        value = (std * draw).astype(dtype)
    return nnx.Param(sharding.place_host_array(value, logical_axes), logical_axes=logical_axes)


class RMSNorm(nnx.Module):
    """y = w * x / sqrt(mean(x^2) + eps)  (Zhang & Sennrich 2019), statistics in float32.

    As in Qwen3 the normalised value is cast back to the input dtype before the scale.
    """

    def __init__(self, size: int, eps: float, *, param_dtype, axis_name: str | None = "embed"):
        self.eps = eps
        self.axis_name = axis_name
        self.scale = param(None, (size,), (axis_name,), std=None, dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, ..., size] -> the same shape; the scale gathered per call on an fsdp mesh
        (``policyopt.sharding.fsdp_call``) when it is split along ``embed``."""
        return sharding.fsdp_call(self._apply, x, (self.scale[...],), ((self.axis_name,),))

    def _apply(self, x: jax.Array, weights) -> jax.Array:
        (scale,) = weights
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(x.dtype) * normed.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float):
    """cos, sin [B, T, Dh] of rotary embeddings (Su et al. 2021) at integer positions.

    inv_freq_i = theta^(-2i/Dh), i < Dh/2; angles = position * inv_freq, duplicated as
    [angles, angles] (the "rotate half" layout of Llama / Qwen / HuggingFace).
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B,T,Dh]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B,T,N,Dh] rotated: x * cos + rotate_half(x) * sin, rotate_half(a, b) = (-b, a)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :]
    sin = sin[:, :, None, :]
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward (Shazeer 2020): down( silu(x W_gate) * (x W_up) ).

    On an fsdp mesh the three weights are gathered inside one ``shard_map`` per call and
    their gradients reduce-scattered (``policyopt.sharding.fsdp_call``).
    """

    def __init__(self, config: ModelConfig, intermediate_size: int, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, intermediate_size
        std, pdt = config.initializer_range, config.weight_dtype
        self.dtype = config.compute_dtype
        self.gate_proj = param(rngs, (d, f), ("embed", "mlp"), std=std, dtype=pdt)
        self.up_proj = param(rngs, (d, f), ("embed", "mlp"), std=std, dtype=pdt)
        self.down_proj = param(rngs, (f, d), ("mlp", "embed"), std=std, dtype=pdt)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D] in the compute dtype."""
        weights = tuple(w[...] for w in (self.gate_proj, self.up_proj, self.down_proj))
        axes = (("embed", "mlp"), ("embed", "mlp"), ("mlp", "embed"))
        return sharding.fsdp_call(self._apply, x.astype(self.dtype), weights, axes)

    def _apply(self, x: jax.Array, weights) -> jax.Array:
        w_gate, w_up, w_down = (w.astype(self.dtype) for w in weights)
        gate = project("btd,df->btf", x, w_gate)
        up = project("btd,df->btf", x, w_up)
        return project("btf,fd->btd", jax.nn.silu(gate) * up, w_down)
