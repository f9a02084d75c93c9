"""Weight products ``x W`` whose backward pass runs as two plain 2-D matmuls.

``project(spec, x, w)`` is ``jnp.einsum(spec, x, w)`` for ``x`` ``<lead><in>``, ``w``
``<in><out>`` (``"btd,df->btf"``, ``"btd,dnh->btnh"``, ``"btnh,nhd->btd"``), with its
gradients written over the flattened arrays (M leading, K input, N output elements):

    dx = dy W^T   ([M, N] x [K, N]),     dW = x^T dy   ([M, K] x [M, N], rows contracted).

Autodiff's transpose of the einsum computes the same products but leaves XLA:CPU to
choose layouts, and it copies activations into transposed layouts for its matmul library;
these forms need no copy (docs/performance.md). Forward values are the einsum's bit for
bit; gradients agree to float rounding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def _letters(spec: str) -> tuple[str, str, str, int] | None:
    """``(x letters, w letters, output letters, leading count)`` of a weight product,
    or None when ``spec`` is another contraction."""
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    contracted = "".join(c for c in xs if c in ws)
    lead = xs[: len(xs) - len(contracted)]
    produced = ws[len(contracted) :]
    if not contracted or xs != lead + contracted or ws != contracted + produced:
        return None
    if out != lead + produced or len(set(xs + ws)) != len(lead + contracted + produced):
        return None
    return xs, ws, out, len(lead)


def project(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, x, w)``, with the backward pass as 2-D matmuls (module docstring).

    Args:
      spec: an einsum of a weight product, ``"<lead><in>,<in><out>-><lead><out>"``; any
        other contraction is passed to ``jnp.einsum`` unchanged.
      x: ``[*lead, *in]`` activations.
      w: ``[*in, *out]`` weight.
    Returns:
      ``[*lead, *out]``.
    """
    letters = _letters(spec)
    if letters is None:
        return jnp.einsum(spec, x, w)
    return _project(spec, letters[3], x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec: str, lead: int, x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum(spec, x, w)


def _project_fwd(spec, lead, x, w):
    return _project(spec, lead, x, w), (x, w)


def _project_bwd(spec, lead, residuals, dy):
    x, w = residuals
    dtype = jnp.result_type(x, w)
    m = math.prod(x.shape[:lead])
    k = math.prod(x.shape[lead:])
    n = w.size // k
    x2 = x.reshape(m, k).astype(dtype)
    w2 = w.reshape(k, n).astype(dtype)
    dy2 = dy.reshape(m, n).astype(dtype)
    dx = jax.lax.dot_general(dy2, w2, (((1,), (1,)), ((), ())))
    dw = jax.lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())))
    return dx.reshape(x.shape).astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)
