"""policyopt.logprobs.token_log_probs against the naive full-logits computation, a
hand-worked case, gradients, and the compiled memory footprint at Qwen scale."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt.logprobs import default_chunk_size, token_log_probs


def _naive(hidden, embedding, targets, temperature):
    logits = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64),
                       np.asarray(embedding, np.float64)) / temperature
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    log_probs = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0] - lse
    probs = np.exp(logits - lse[..., None])
    entropy = -np.sum(probs * np.log(probs), -1)
    return log_probs, entropy


def test_hand_worked_case():
    # One token, D = 1, V = 2, logits (0, log 3): p = (1/4, 3/4).
    hidden = jnp.ones((1, 1, 1))
    embedding = jnp.array([[0.0, np.log(3.0)]])
    log_probs, entropy = token_log_probs(hidden, embedding, jnp.array([[1]]), return_entropy=True)
    np.testing.assert_allclose(log_probs, [[np.log(0.75)]], rtol=1e-6)
    np.testing.assert_allclose(entropy, [[-(0.25 * np.log(0.25) + 0.75 * np.log(0.75))]], rtol=1e-6)
    # Temperature 2 halves the logits: p = softmax(0, log 3 / 2) = (1, sqrt 3) / (1 + sqrt 3).
    log_probs = token_log_probs(hidden, embedding, jnp.array([[0]]), temperature=2.0)
    np.testing.assert_allclose(log_probs, [[-np.log(1 + np.sqrt(3.0))]], rtol=1e-6)


@pytest.mark.parametrize("chunk_size,temperature", [(None, 1.0), (1, 0.7), (5, 0.7), (64, 1.0)])
def test_matches_naive(chunk_size, temperature):
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 7, 16)).astype(np.float32)
    embedding = rng.normal(size=(16, 50)).astype(np.float32)
    targets = rng.integers(0, 50, size=(3, 7)).astype(np.int32)
    log_probs, entropy = token_log_probs(jnp.asarray(hidden), jnp.asarray(embedding),
                                         jnp.asarray(targets), temperature=temperature,
                                         chunk_size=chunk_size, return_entropy=True)
    ref_lp, ref_ent = _naive(hidden, embedding, targets, temperature)
    assert log_probs.dtype == jnp.float32 and log_probs.shape == (3, 7)
    np.testing.assert_allclose(log_probs, ref_lp, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(entropy, ref_ent, atol=1e-5, rtol=1e-5)


def test_gradients_match_full_logits():
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    embedding = jnp.asarray(rng.normal(size=(8, 30)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 30, size=(2, 5)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(2, 5)), jnp.float32)

    def chunked(h, w):
        lp, ent = token_log_probs(h, w, targets, temperature=0.9, chunk_size=3, return_entropy=True)
        return jnp.sum(weights * lp) + 0.1 * jnp.sum(ent)

    def full(h, w):
        logits = jnp.einsum("btd,dv->btv", h, w) / 0.9
        logp = jax.nn.log_softmax(logits)
        lp = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp) * logp, -1)
        return jnp.sum(weights * lp) + 0.1 * jnp.sum(ent)

    got = jax.grad(chunked, argnums=(0, 1))(hidden, embedding)
    want = jax.grad(full, argnums=(0, 1))(hidden, embedding)
    for g, w in zip(got, want):
        assert float(jnp.abs(g).max()) > 0
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_bfloat16_hidden_gives_float32():
    hidden = jnp.ones((1, 2, 4), jnp.bfloat16)
    embedding = jnp.ones((4, 6), jnp.float32)
    log_probs = token_log_probs(hidden, embedding, jnp.zeros((1, 2), jnp.int32))
    assert log_probs.dtype == jnp.float32
    np.testing.assert_allclose(log_probs, np.full((1, 2), -np.log(6.0)), rtol=1e-6)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="embedding"):
        token_log_probs(jnp.ones((1, 2, 4)), jnp.ones((5, 6)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="targets"):
        token_log_probs(jnp.ones((1, 2, 4)), jnp.ones((4, 6)), jnp.zeros((2, 2), jnp.int32))


def test_memory_at_qwen_vocabulary():
    """V = 151,936, 8,192 tokens, D = 1,024: compiled temporary memory < 10% of the float32
    logits (4.98 GB); the backward pass adds only the [D, V] embedding gradient."""
    vocab, tokens, dim = 151936, 8192, 1024
    full_logits_bytes = tokens * vocab * 4
    args = (jax.ShapeDtypeStruct((1, tokens, dim), jnp.float32),
            jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((1, tokens), jnp.int32))
    forward = jax.jit(lambda h, w, y: token_log_probs(h, w, y, return_entropy=True))
    memory = forward.lower(*args).compile().memory_analysis()
    assert memory.temp_size_in_bytes < 0.1 * full_logits_bytes
    backward = jax.jit(jax.grad(lambda h, w, y: jnp.sum(token_log_probs(h, w, y)), argnums=(0, 1)))
    memory = backward.lower(*args).compile().memory_analysis()
    embedding_bytes = dim * vocab * 4
    assert memory.temp_size_in_bytes < 0.1 * full_logits_bytes + embedding_bytes


def test_default_chunk_size():
    assert default_chunk_size(8192, 151936) == 128
    assert default_chunk_size(10, 512) == 10
