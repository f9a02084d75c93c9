"""Token log-probabilities and entropies from final hidden states, without ever holding
float32 logits for every token at once.

For hidden states h_t [D], output embedding W [D, V] and temperature tau,

    z_t = h_t W / tau,   log pi(y_t) = z_t[y_t] - logsumexp(z_t),
    H_t = sum_v pi_v (logsumexp(z_t) - z_t[v]).

The entropy is written as a sum of non-negative terms: the textbook
``logsumexp(z) - sum_v pi_v z_v`` cancels for a peaked distribution (on V = 32,768
logits with a peak 20-45 above N(0, 3^2) noise, float32 gave negative entropies and
150% relative error on entropies below 1e-3). This form is never negative and its
absolute error stays at float32 rounding of logsumexp (~1e-7 nats here), which is also
the error of log pi(y) = z_y - logsumexp(z) that a probability ratio sees; the relative
error of entropies far below that is large, and no metric or loss of this library
reads them.

The B*T tokens are processed in chunks of ``chunk_size`` by a ``lax.scan`` whose body is
``jax.checkpoint``-ed: the forward pass keeps one chunk's [chunk_size, V] float32 logits
alive at a time, and the backward pass recomputes them chunk by chunk instead of storing
them. Peak temporary memory is therefore O(chunk_size * V), not O(B * T * V) (for
V = 151,936 and 8,192 tokens the full float32 logits would be 5 GB).

When the rows are split over devices (a mesh whose ``batch`` axes divide B) and the tokens
need more than one chunk, the chunks are cut along the time axis instead, every chunk
holding all B rows ([B, c] tokens, c a power of two with local rows * c * V <= 2**25):
chunks of the flattened B*T tokens would each hold a few rows' tokens, and the scan over
them would gather every row's hidden states onto every device (measured with
benchmarks/scale_sim.py: a 15.5 GiB all-gather per device for 64 rows of 32k tokens).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from policyopt import sharding

# Default chunk: the largest power of two of tokens whose float32 logits fit in
# 2**25 elements (128 MiB).
_LOGITS_ELEMENT_BUDGET = 2**25


def default_chunk_size(num_tokens: int, vocab_size: int) -> int:
    """Tokens per chunk: a power of two with chunk * V <= 2**25, at most num_tokens."""
    limit = max(1, _LOGITS_ELEMENT_BUDGET // vocab_size)
    chunk = 2 ** int(math.floor(math.log2(limit)))
    return max(1, min(chunk, num_tokens))


def _chunk_stats(embedding, hidden, targets, temperature, with_entropy):
    """log-probs [C] and (with_entropy) entropies [C], else None, of one chunk of hidden
    [C, D] (see the module docstring).

    ``embedding`` arrives in its own dtype and is cast to the hidden dtype here, inside
    the scan body: its gradient is then accumulated across chunks in the parameter dtype
    (a bfloat16 accumulator gave 2.0% relative error after 256 chunks, against 0.24%
    for one chunk; N = 4,096, D = 64, V = 512).
    """
    logits = (
        jnp.einsum(
            "nd,dv->nv", hidden, embedding.astype(hidden.dtype), preferred_element_type=jnp.float32
        )
        / temperature
    )
    lse = jax.nn.logsumexp(logits, axis=-1)
    log_probs = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    if not with_entropy:
        return log_probs, None
    # H = sum_v p_v (lse - z_v): every term >= 0 (see the module docstring).
    probs = jnp.exp(logits - lse[:, None])
    entropy = jnp.sum(probs * (lse[:, None] - logits), axis=-1)
    return log_probs, entropy


def token_log_probs(
    hidden: jax.Array,
    embedding: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
):
    """log pi(targets) under softmax(hidden @ embedding / temperature), in chunks.

    Args:
      hidden: [B, T, D] final hidden states (ModelOutput.hidden), any float dtype.
      embedding: [D, V] output embedding (Transformer.output_embedding()), any float
        dtype; cast to the hidden dtype chunk by chunk, so its gradient sums over the
        chunks in its own dtype.
      targets: int32 [B, T] token ids whose log-probs are wanted (usually the next tokens).
      temperature: divides the logits (sampling temperature), > 0.
      chunk_size: tokens per chunk; None picks one with chunk * V <= 2**25 elements.
      return_entropy: also return the entropy of each token's distribution.
    Returns:
      log_probs float32 [B, T], and entropy float32 [B, T] when return_entropy.
    """
    b, t, d = hidden.shape
    if embedding.ndim != 2 or embedding.shape[0] != d:
        raise ValueError(f"embedding must be [D={d}, V], got shape {embedding.shape}")
    if targets.shape != (b, t):
        raise ValueError(f"targets must be [B, T] = {(b, t)}, got shape {targets.shape}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    # On an fsdp mesh the output embedding is gathered whole along D inside a shard_map
    # over the rows (its gradient then reduce-scattered onto its shards): each device
    # takes its own rows' chunks there. Nothing of it is saved for the backward pass but
    # its inputs (the chunks' logits are recomputed there, as they are here without a
    # mesh; a policy saving matmuls would keep every chunk's).
    def per_device(rows, weights):
        hidden, targets = rows
        return _token_log_probs(
            hidden, weights[0], targets, temperature, chunk_size, return_entropy
        )

    return sharding.fsdp_call(
        per_device,
        (hidden, targets),
        (embedding,),
        (("embed", "vocab"),),
        policy=jax.checkpoint_policies.nothing_saveable,
    )


def _token_log_probs(hidden, embedding, targets, temperature, chunk_size, return_entropy):
    """``token_log_probs`` on the rows this device computes (all of them off a mesh)."""
    b, t, d = hidden.shape
    n, vocab = b * t, embedding.shape[1]
    chunk = chunk_size or default_chunk_size(n, vocab)
    num_chunks = -(-n // chunk)
    local_rows = _local_rows(b)
    if chunk_size is None and num_chunks > 1 and local_rows < b:
        return _time_chunked(
            hidden,
            embedding,
            targets,
            temperature,
            return_entropy,
            default_chunk_size(local_rows * t, vocab) // local_rows or 1,
        )
    pad = num_chunks * chunk - n
    flat_hidden = jnp.pad(hidden.reshape(n, d), ((0, pad), (0, 0)))
    flat_targets = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad))
    stats = jax.checkpoint(_chunk_stats, static_argnums=(3, 4))

    def body(carry, xs):
        return carry, stats(embedding, xs[0], xs[1], temperature, return_entropy)

    _, (log_probs, entropy) = jax.lax.scan(
        body,
        None,
        (flat_hidden.reshape(num_chunks, chunk, d), flat_targets.reshape(num_chunks, chunk)),
    )
    log_probs = log_probs.reshape(-1)[:n].reshape(b, t)
    if return_entropy:
        return log_probs, entropy.reshape(-1)[:n].reshape(b, t)
    return log_probs


def _local_rows(rows: int) -> int:
    """Rows of a [rows, ...] batch on each device under the current mesh (its ``batch``
    axes, as ``policyopt.sharding.row_spec`` splits them); ``rows`` without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.manual_axes:  # inside a shard_map: its own rows
        return rows
    spec = tuple(sharding.row_spec((rows,), mesh))
    spec = spec[0] if spec else None  # replicated rows: an empty spec
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return rows // math.prod(mesh.shape[axis] for axis in axes)


def _time_chunked(hidden, embedding, targets, temperature, with_entropy, chunk: int):
    """``token_log_probs`` over chunks of ``chunk`` time steps holding every row (the rows
    stay split over the devices): scan over [C, B, chunk] slices of the time axis."""
    b, t, d = hidden.shape
    chunk = max(1, min(chunk, t))
    num_chunks = -(-t // chunk)
    pad = num_chunks * chunk - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
    xs = (
        jnp.moveaxis(hidden.reshape(b, num_chunks, chunk, d), 1, 0),
        jnp.moveaxis(targets.reshape(b, num_chunks, chunk), 1, 0),
    )
    stats = jax.checkpoint(_chunk_stats, static_argnums=(3, 4))

    def body(carry, xs):
        rows_hidden, rows_targets = xs  # [B, c, D], [B, c]
        log_probs, entropy = stats(
            embedding,
            rows_hidden.reshape(b * chunk, d),
            rows_targets.reshape(b * chunk),
            temperature,
            with_entropy,
        )
        entropy = None if entropy is None else entropy.reshape(b, chunk)
        return carry, (log_probs.reshape(b, chunk), entropy)

    _, (log_probs, entropy) = jax.lax.scan(body, None, xs)  # [C, B, c]
    log_probs = jnp.moveaxis(log_probs, 0, 1).reshape(b, -1)[:, :t]
    if with_entropy:
        return log_probs, jnp.moveaxis(entropy, 0, 1).reshape(b, -1)[:, :t]
    return log_probs
