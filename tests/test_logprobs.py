"""policyopt.logprobs.token_log_probs against the naive full-logits computation, a
hand-worked case, gradients, and the compiled memory footprint at Qwen scale."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt.logprobs import default_chunk_size, token_log_probs
from tests.flags import run_script

# Compiled whole (one program per shape and option), not one eager operation at a time.
_jitted = jax.jit(token_log_probs, static_argnames=("temperature", "chunk_size", "return_entropy"))


def _naive(hidden, embedding, targets, temperature):
    logits = (
        np.einsum("btd,dv->btv", np.asarray(hidden, np.float64), np.asarray(embedding, np.float64))
        / temperature
    )
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    log_probs = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0] - lse
    probs = np.exp(logits - lse[..., None])
    entropy = -np.sum(probs * np.log(probs), -1)
    return log_probs, entropy


def test_hand_worked_case():
    # One token, D = 1, V = 2, logits (0, log 3): p = (1/4, 3/4).
    hidden = jnp.ones((1, 1, 1))
    embedding = jnp.array([[0.0, np.log(3.0)]])
    log_probs, entropy = _jitted(hidden, embedding, jnp.array([[1]]), return_entropy=True)
    np.testing.assert_allclose(log_probs, [[np.log(0.75)]], rtol=1e-6)
    np.testing.assert_allclose(entropy, [[-(0.25 * np.log(0.25) + 0.75 * np.log(0.75))]], rtol=1e-6)
    # Temperature 2 halves the logits: p = softmax(0, log 3 / 2) = (1, sqrt 3) / (1 + sqrt 3).
    log_probs = _jitted(hidden, embedding, jnp.array([[0]]), temperature=2.0)
    np.testing.assert_allclose(log_probs, [[-np.log(1 + np.sqrt(3.0))]], rtol=1e-6)


@pytest.mark.parametrize("chunk_size,temperature", [(None, 1.0), (1, 0.7), (5, 0.7), (64, 1.0)])
def test_matches_naive(chunk_size, temperature):
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 7, 16)).astype(np.float32)
    embedding = rng.normal(size=(16, 50)).astype(np.float32)
    targets = rng.integers(0, 50, size=(3, 7)).astype(np.int32)
    log_probs, entropy = _jitted(
        jnp.asarray(hidden),
        jnp.asarray(embedding),
        jnp.asarray(targets),
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=True,
    )
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

    # One program, not one eager op per step of each gradient.
    grads = jax.jit(lambda f, h, w: jax.grad(f, argnums=(0, 1))(h, w), static_argnums=0)
    got, want = grads(chunked, hidden, embedding), grads(full, hidden, embedding)
    for g, w in zip(got, want):
        assert float(jnp.abs(g).max()) > 0
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_bfloat16_hidden_gives_float32():
    hidden = jnp.ones((1, 2, 4), jnp.bfloat16)
    embedding = jnp.ones((4, 6), jnp.float32)
    log_probs = _jitted(hidden, embedding, jnp.zeros((1, 2), jnp.int32))
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
    args = (
        jax.ShapeDtypeStruct((1, tokens, dim), jnp.float32),
        jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
        jax.ShapeDtypeStruct((1, tokens), jnp.int32),
    )
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


def _peaked_reference(logits):
    """float64 log-softmax and entropy with the top term summed apart (log S = log1p(r)):
    the plain float64 forms lose all precision once H < ~1e-14 (S = 1 + r with r below
    float64's epsilon)."""
    logits = np.asarray(logits, np.float64)
    top = np.argmax(logits, axis=-1)[..., None]
    shifted = logits - np.take_along_axis(logits, top, axis=-1)
    is_top = np.arange(logits.shape[-1]) == top
    log_sum = np.log1p(np.sum(np.where(is_top, 0.0, np.exp(shifted)), axis=-1))
    log_probs = shifted - log_sum[..., None]
    return log_probs, -np.sum(np.where(is_top, 0.0, np.exp(log_probs) * shifted), axis=-1) + log_sum


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_of_peaked_distributions(temperature):
    """V = 32,768; one token 20-45 above N(0, 3^2) noise: entropies 1e-13 to 4, median
    < 1e-5, at both temperatures. Never negative (the textbook lse - sum p z gave
    negative entropies here) and within a few float32 ulps of the largest logit (the
    rounding of logsumexp, which log-probs carry too) of the float64 entropy."""
    rng = np.random.default_rng(0)
    vocab, tokens, noise_dim, peaks = 32768, 256, 8, 8
    # logits = noise + height * onehot(peak): hidden = [noise coefficients, height onehot].
    noise = rng.normal(size=(noise_dim, vocab)) * 3 / np.sqrt(noise_dim)
    peak_rows = np.zeros((peaks, vocab))
    peak_rows[np.arange(peaks), rng.choice(vocab, peaks, replace=False)] = 1.0
    embedding = np.concatenate([noise, peak_rows]).astype(np.float32)
    hidden = np.zeros((1, tokens, noise_dim + peaks), np.float32)
    hidden[0, :, :noise_dim] = rng.normal(size=(tokens, noise_dim))
    peak_of = noise_dim + rng.integers(0, peaks, tokens)
    hidden[0, np.arange(tokens), peak_of] = rng.uniform(20, 45, tokens)
    hidden *= temperature  # the same logits / temperature
    targets = np.argmax(hidden[0] @ embedding, axis=-1)[None].astype(np.int32)
    log_probs, entropy = _jitted(
        jnp.asarray(hidden),
        jnp.asarray(embedding),
        jnp.asarray(targets),
        temperature=temperature,
        chunk_size=64,
        return_entropy=True,
    )
    logits = np.einsum("btd,dv->btv", hidden.astype(np.float64), embedding.astype(np.float64))
    ref_log_probs, ref_entropy = _peaked_reference(logits / temperature)
    ref_log_probs = np.take_along_axis(ref_log_probs, targets[..., None], -1)[..., 0]
    assert np.median(ref_entropy) < 1e-5 and ref_entropy.min() < 1e-12
    assert float(entropy.min()) >= 0
    ulp = np.finfo(np.float32).eps * np.abs(logits / temperature).max()
    np.testing.assert_allclose(entropy, ref_entropy, rtol=0, atol=2 * ulp)
    large = ref_entropy > 1e-2
    assert large.sum() > 20
    np.testing.assert_allclose(np.asarray(entropy)[large], ref_entropy[large], rtol=1e-3)
    # z_top - logsumexp(z): an absolute error of ~ulp(z_top), 4e-6 at 45.
    np.testing.assert_allclose(log_probs, ref_log_probs, rtol=0, atol=1e-5)


def test_bfloat16_embedding_gradient_sums_in_float32():
    """bfloat16 hidden, float32 output embedding, 256 chunks: the embedding's gradient
    sums over the chunks in float32, so its error stays that of one chunk (0.24%), where
    a bfloat16 accumulator reached 2.0%. Reference: the NumPy float64 gradient
    dL/dW = h^T (onehot(y) - softmax(h W)) of L = sum log pi(y)."""
    rng = np.random.default_rng(0)
    tokens, dim, vocab = 4096, 64, 512
    hidden = jnp.asarray(rng.normal(size=(1, tokens, dim)), jnp.bfloat16)
    embedding = jnp.asarray(rng.normal(size=(dim, vocab)) * 0.1, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (1, tokens)), jnp.int32)
    h64, w64 = np.asarray(hidden[0], np.float64), np.asarray(embedding, np.float64)
    logits = h64 @ w64
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = h64.T @ (np.eye(vocab)[np.asarray(targets[0])] - probs)

    def error(chunk_size):
        grad = jax.jit(
            jax.grad(lambda w: jnp.sum(token_log_probs(hidden, w, targets, chunk_size=chunk_size)))
        )(embedding)
        assert grad.dtype == jnp.float32
        return np.linalg.norm(np.asarray(grad, np.float64) - want) / np.linalg.norm(want)

    one_chunk, many_chunks = error(tokens), error(16)
    assert one_chunk < 4e-3
    assert many_chunks < 1.25 * one_chunk, (one_chunk, many_chunks)


_MESH_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import policyopt.logprobs as logprobs
from policyopt.logprobs import token_log_probs

logprobs._LOGITS_ELEMENT_BUDGET = 2**14  # chunks of 4 tokens for V = 4096: many chunks
b, t, d, v = 8, 96, 16, 4096
mesh = jax.make_mesh((8,), ("fsdp",))
rng = np.random.default_rng(0)
hidden = rng.normal(size=(b, t, d)).astype(np.float32)
embedding = rng.normal(size=(d, v)).astype(np.float32)
targets = rng.integers(0, v, size=(b, t)).astype(np.int32)


def loss(hidden, embedding, targets):
    lp, ent = token_log_probs(hidden, embedding, targets, return_entropy=True)
    return jnp.sum(lp) + 0.1 * jnp.sum(ent), (lp, ent)


fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
(_, (want_lp, want_ent)), want_grads = fn(hidden, embedding, targets)
with jax.set_mesh(mesh):
    rows = NamedSharding(mesh, P("fsdp"))
    args = (jax.device_put(hidden, rows), jax.device_put(embedding, NamedSharding(mesh, P())),
            jax.device_put(targets, rows))
    hlo = fn.lower(*args).compile().as_text()
    (_, (lp, ent)), grads = fn(*args)
np.testing.assert_allclose(np.asarray(lp), np.asarray(want_lp), rtol=1e-5, atol=1e-5)
np.testing.assert_allclose(np.asarray(ent), np.asarray(want_ent), rtol=1e-5, atol=1e-5)
for g, h in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-4)
# No device gathers the other rows' hidden states ([8, 96, 16] or its flattened form).
gathers = [line for line in hlo.splitlines() if " all-gather(" in line]
assert not any("768" in line or "[8,96" in line for line in gathers), gathers
print("ok")
"""


def test_rows_split_over_devices_stay_split():
    """With the rows split over 8 simulated devices and more tokens than one chunk, the
    chunks run along time with every row (no all-gather of the hidden states), and the
    log-probs, entropies and gradients equal one device's."""

    proc = run_script(_MESH_SCRIPT, 8, timeout=600)
    assert proc.stdout.split() == ["ok"], proc.stdout
