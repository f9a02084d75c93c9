"""Attention: packed segments through the model, every implementation of
``policyopt.models.attention_ops.attend`` against the einsum attention (values and
gradients on ragged, left-padded, packed and GQA inputs), config errors, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import ModelConfig, Transformer

TINY = dict(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, intermediate_size=48, rope_theta=1e4)


def _model(**overrides):
    model = Transformer(ModelConfig(**{**TINY, **overrides}), rngs=nnx.Rngs(0))
    # Larger weights than the 0.02 default make attention non-trivial.
    state = nnx.state(model, nnx.Param)
    state = jax.tree.map(lambda x: x * (10.0 if x.ndim > 1 else 1.0), state)
    nnx.update(model, state)
    return model


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(state, tokens, *, graphdef, **kwargs):
    return nnx.merge(graphdef, state)(tokens, **kwargs)


def _call(model, tokens, **kwargs):
    graphdef, state = nnx.split(model)
    return _forward(state, tokens, graphdef=graphdef, **kwargs)


# One packed row of three sequences (lengths 3, 2, 4) and two padding tokens, and a
# second row of one sequence (length 6) and five padding tokens.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0],
                     [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0]], np.int32)


def _positions(segment_ids):
    """Per-segment positions 0, 1, ... restarting at each segment's first token."""
    positions = np.zeros_like(segment_ids)
    for r, row in enumerate(segment_ids):
        for i in range(1, len(row)):
            positions[r, i] = positions[r, i - 1] + 1 if row[i] == row[i - 1] else 0
    return positions


@pytest.mark.parametrize("moe", [False, True])
def test_packed_segments_equal_separate_rows(moe):
    extra = dict(num_experts=4, num_experts_per_tok=2, moe_dispatch="ragged") if moe else {}
    model = _model(**extra)
    tokens = np.random.default_rng(0).integers(0, TINY["vocab_size"], SEGMENTS.shape)
    packed = _call(model, jnp.asarray(tokens), positions=jnp.asarray(_positions(SEGMENTS)),
                   segment_ids=jnp.asarray(SEGMENTS))
    for r, row in enumerate(SEGMENTS):
        for seg in set(row.tolist()) - {0}:
            (cols,) = np.nonzero(row == seg)
            alone = _call(model, jnp.asarray(tokens[r:r + 1, cols]))
            np.testing.assert_allclose(packed.logits[r, cols], alone.logits[0],
                                       rtol=1e-5, atol=1e-5)
            if moe:
                np.testing.assert_array_equal(packed.routing[:, r, cols], alone.routing[:, 0])


def test_segment_ids_refused_with_cache():
    model = _model()
    tokens = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, cache=model.init_cache(1, 8), segment_ids=jnp.ones((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, segment_ids=jnp.ones((1, 4), jnp.int32))
