"""policyopt.models.projection: the einsum's values and gradients, without its transposes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt.models.projection import project

SPECS = {
    "btd,df->btf": ((3, 5, 4), (4, 6)),
    "btd,dnh->btnh": ((3, 5, 4), (4, 2, 3)),
    "btnh,nhd->btd": ((3, 5, 2, 3), (2, 3, 4)),
    "nd,dv->nv": ((7, 4), (4, 5)),
}


def _inputs(spec, dtype=jnp.float32):
    x_shape, w_shape = SPECS[spec]
    x = jax.random.normal(jax.random.key(0), x_shape, dtype)
    w = jax.random.normal(jax.random.key(1), w_shape, dtype)
    return x, w


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_values_and_gradients_match_the_einsum(spec):
    x, w = _inputs(spec)
    out = project(spec, x, w)
    np.testing.assert_array_equal(out, jnp.einsum(spec, x, w))
    cotangent = jax.random.normal(jax.random.key(2), out.shape)

    def loss(fn):
        return lambda x, w: jnp.vdot(fn(spec, x, w), cotangent)

    grads = jax.grad(loss(project), argnums=(0, 1))(x, w)
    expected = jax.grad(loss(jnp.einsum), argnums=(0, 1))(x, w)
    for got, want in zip(grads, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_hand_worked_gradients():
    """y = x W for x = [[1, 2]], W = [[1, 0, 2], [0, 1, 3]], dy = [[1, 1, 1]]:
    dx = dy W^T = [[3, 4]], dW = x^T dy = [[1, 1, 1], [2, 2, 2]]."""
    x = jnp.array([[1.0, 2.0]])
    w = jnp.array([[1.0, 0.0, 2.0], [0.0, 1.0, 3.0]])
    dx, dw = jax.grad(lambda x, w: project("nd,df->nf", x, w).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_array_equal(dx, [[3.0, 4.0]])
    np.testing.assert_array_equal(dw, [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])


def test_bfloat16_keeps_the_dtypes():
    x, w = _inputs("btd,df->btf", jnp.bfloat16)
    dx, dw = jax.grad(
        lambda x, w: project("btd,df->btf", x, w).astype(jnp.float32).sum(), argnums=(0, 1)
    )(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16


def test_other_contractions_are_the_einsum():
    """A batched weight (experts) is not a weight product: the einsum itself."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    w = jax.random.normal(jax.random.key(1), (2, 4, 5))
    np.testing.assert_array_equal(project("etd,edf->etf", x, w), jnp.einsum("etd,edf->etf", x, w))
    grads = jax.grad(lambda x, w: project("etd,edf->etf", x, w).sum(), argnums=(0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.einsum("etd,edf->etf", x, w).sum(), argnums=(0, 1))(x, w)
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_backward_copies_no_activation():
    """The point of it: in a SwiGLU block's backward pass XLA:CPU copies einsum
    cotangents and activations ([B*T, F], [B*T, D]) into transposed [F, B*T] / [D, B*T]
    layouts for its matmul library; with the 2-D forms nothing of that size is copied."""
    x, w_gate, w_up, w_down = (jnp.ones(s) for s in ((8, 16, 32), (32, 64), (32, 64), (64, 32)))

    def transposed(fn):
        def loss(x, w_gate, w_up, w_down):
            h = jax.nn.silu(fn("btd,df->btf", x, w_gate)) * fn("btd,df->btf", x, w_up)
            return jnp.sum(jnp.sin(fn("btf,fd->btd", h, w_down)))

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        text = grad.lower(x, w_gate, w_up, w_down).compile().as_text()
        return [
            line
            for line in text.splitlines()
            if " = " in line and line.split(" = ")[1].startswith(("f32[64,128]", "f32[32,128]"))
        ]

    assert transposed(jnp.einsum), "the einsum's backward no longer transposes: drop project"
    assert not transposed(project)
