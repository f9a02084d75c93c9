"""Causal self-attention of a full sequence, by one of several implementations.

``attend(q, k, v, key_mask=..., segment_ids=..., implementation=...)`` computes, for
every query t, kv head g(h) of query head h (grouped-query attention),

    out[b, t, h] = sum_s p[b, h, t, s] v[b, s, g(h)],
    p[b, h, t, :] = softmax_s(q[b, t, h] . k[b, s, g(h)] / sqrt(Dh) over allowed s),

    allowed(b, t, s) = s <= t and key_mask[b, s]
                       and (segment_ids is None or segment_ids[b, s] == segment_ids[b, t] != 0),

with the softmax statistics in float32. The implementations differ in what they hold in
memory and where they run:

  "xla"        the einsum (``dot_product_attention`` below, also the KV-cache path of
               ``policyopt.models.attention``): float32 [B, H, T, T] scores, a softmax.
               Fastest for short rows; memory quadratic in T.
  "blockwise"  flash-style online softmax over key blocks in plain JAX, with a custom
               VJP that recomputes each block's probabilities from the saved per-row
               log-sum-exp (FlashAttention-2, Dao 2023, arXiv:2307.08691, Algorithms 1
               and 2). Memory linear in T; runs on every backend.
  "cudnn"      ``jax.nn.dot_product_attention(implementation="cudnn")``: cuDNN's fused
               flash attention on NVIDIA GPUs (bf16 / fp16, head dim a multiple of 8, at
               most 256).
  "splash"     the Pallas splash-attention kernel that ships with JAX
               (``jax.experimental.pallas.ops.tpu.splash_attention``) on TPUs.
  "auto"       cudnn on a GPU where it applies, splash on a TPU, else the einsum below
               ``XLA_MAX_LENGTH`` tokens and blockwise from there (benchmarks/RESULTS.md,
               bench_attention).

Query rows of padding tokens (``key_mask`` False, or segment 0) have no defined output:
every implementation returns finite values there ("blockwise": zeros for rows that see
no key and for blocks of padding only, which it skips), which callers ignore. Every other
row is the same function in all implementations, up to float summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from policyopt.sharding import logical_to_mesh_axes

IMPLEMENTATIONS = ("auto", "xla", "blockwise", "cudnn", "splash")

# Row length from which "auto" leaves the einsum for "blockwise" on CPUs (and on GPUs
# where cuDNN does not apply). Below it a row is one or two blocks and the two ran within
# this machine's noise; from 1,024 tokens blockwise trained 1.8x faster and more, with
# temporaries that stop growing with T (benchmarks/bench_attention.py, RESULTS.md).
XLA_MAX_LENGTH = 1024

# Finite "minus infinity" of masked scores: in the einsum, a query whose keys are all
# masked (e.g. a padding token at the start of a row) gets a uniform average instead of
# NaN, and is ignored downstream; the online softmax never meets inf - inf.
_MASK_VALUE = -1e30
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Splash attention's tiles: rows are padded to a multiple of this.
_SPLASH_BLOCK = 128


def check_implementation(
    implementation: str, *, backend: str, dtype, head_dim: int, interpret: bool = False
) -> None:
    """Raises ValueError when ``implementation`` cannot run on ``backend``.

    Args:
      implementation: one of IMPLEMENTATIONS.
      backend: ``jax.default_backend()`` ("cpu", "gpu", "tpu").
      dtype: the compute dtype of q, k and v.
      head_dim: Dh.
      interpret: splash in Pallas interpret mode (tests on CPUs), allowed off a TPU.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"model.attention must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    if implementation == "cudnn":
        reason = _cudnn_unsupported(backend, dtype, head_dim)
        if reason:
            raise ValueError(
                f"model.attention='cudnn' cannot run here: {reason}; use 'auto', "
                "'blockwise' or 'xla'"
            )
    if implementation == "splash" and backend != "tpu" and not interpret:
        raise ValueError(
            f"model.attention='splash' needs a TPU, but the JAX backend is "
            f"{backend!r}; use 'auto', 'blockwise' or 'xla'"
        )


def _cudnn_unsupported(backend: str, dtype, head_dim: int) -> str | None:
    """Why cuDNN flash attention does not apply, or None when it does."""
    if backend != "gpu":
        return f"it needs an NVIDIA GPU, but the JAX backend is {backend!r}"
    if jnp.dtype(dtype) not in _CUDNN_DTYPES:
        return f"it needs model.dtype bfloat16 or float16, got {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 256:
        return f"it needs a head_dim that is a multiple of 8 and at most 256, got {head_dim}"
    return None


def choose_implementation(
    implementation: str, *, backend: str, dtype, head_dim: int, length: int, packed: bool
) -> str:
    """The implementation a call runs: ``implementation`` unless it is "auto".

    "auto": "cudnn" on a GPU where it applies and the rows are not packed (cuDNN's
    public entry point takes no segment ids; packed rows would need a [B, T, T] mask),
    "splash" on a TPU, else "xla" below XLA_MAX_LENGTH tokens and "blockwise" from there.
    """
    if implementation != "auto":
        return implementation
    if backend == "gpu" and not packed and _cudnn_unsupported(backend, dtype, head_dim) is None:
        return "cudnn"
    if backend == "tpu":
        return "splash"
    return "xla" if length < XLA_MAX_LENGTH else "blockwise"


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    key_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    implementation: str = "auto",
    block_size: int = 512,
    interpret: bool = False,
) -> jax.Array:
    """Causal grouped-query self-attention of full rows (see the module docstring).

    Args:
      q: [B, T, H, Dh] queries (already rotated).
      k, v: [B, T, Hkv, Dh] keys (rotated) and values; H % Hkv == 0.
      key_mask: bool [B, T], False for padding keys (left or right padding); None: all.
      segment_ids: int32 [B, T] or None: packed rows; a query sees only keys of its own
        segment, and segment 0 is padding.
      implementation: one of IMPLEMENTATIONS.
      block_size: query and key block of "blockwise" (need not divide T).
      interpret: run "splash" in Pallas interpret mode (tests on CPUs).
    Returns:
      [B, T, H, Dh] in v's dtype.
    """
    b, t, h, dh = q.shape
    if k.shape[1] != t or v.shape != k.shape or h % k.shape[2]:
        raise ValueError(
            f"attend takes self-attention q [B, T, H, Dh] and k, v [B, T, Hkv, Dh] "
            f"with H % Hkv == 0; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    backend = jax.default_backend()
    check_implementation(
        implementation, backend=backend, dtype=q.dtype, head_dim=dh, interpret=interpret
    )
    implementation = choose_implementation(
        implementation,
        backend=backend,
        dtype=q.dtype,
        head_dim=dh,
        length=t,
        packed=segment_ids is not None,
    )
    if key_mask is None:
        key_mask = jnp.ones((b, t), bool)
    key_mask = key_mask.astype(bool)
    if implementation == "xla":
        mask = attention_weights_mask(jnp.arange(t), key_mask, segment_ids)
        return dot_product_attention(q, k, v, mask)
    if implementation == "blockwise":
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        return blockwise_attention(
            q, k, v, key_mask, segment_ids.astype(jnp.int32), block_size=block_size
        )
    if implementation == "cudnn":
        return cudnn_attention(q, k, v, key_mask, segment_ids)
    return splash_attention(q, k, v, key_mask, segment_ids, interpret=interpret)


def attention_weights_mask(
    query_slots: jax.Array, key_mask: jax.Array, segment_ids: jax.Array | None = None
) -> jax.Array:
    """bool [B, T, S]: query at slot q may see key slot s iff s <= q and key_mask[b, s]
    (and, with ``segment_ids``, iff both lie in the same segment).

    Args:
      query_slots: int32 [T] slot of each query.
      key_mask: bool [B, S].
      segment_ids: int32 [B, T] (then S == T, no cache): packed rows' segment of each
        token, 0 for padding; a key of segment 0 is never seen.
    """
    key_slots = jnp.arange(key_mask.shape[1])
    causal = key_slots[None, :] <= query_slots[:, None]  # [T,S]
    mask = causal[None, :, :] & key_mask[:, None, :]
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = mask & same & (segment_ids != 0)[:, None, :]
    return mask


def dot_product_attention(q, k, v, mask, *, cache_layout: bool = False):
    """softmax(q k^T / sqrt(Dh) + mask) v with grouped heads; softmax in float32.

    Args:
      q: [B, T, H, Dh]; k, v: [B, S, Hkv, Dh]; or, with cache_layout (KVCache's),
        k [B, Hkv, Dh, S] and v [B, Hkv, S, Dh]; mask: bool [B, T, S].
    Returns:
      [B, T, H, Dh] in v's dtype.
    """
    b, t, h, dh = q.shape
    if not cache_layout:
        hkv = k.shape[2]
        g = h // hkv
        scores = jnp.einsum(
            "btkgh,bskh->bkgts", q.reshape(b, t, hkv, g, dh), k, preferred_element_type=jnp.float32
        ) * (dh**-0.5)
        scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
        return out.reshape(b, t, h, dh)
    # Both products as batched matmuls with the batch dims (b, k) leading, the query rows
    # (t, g) together and plain [rows, K] x [K, cols] operands, the layout XLA:CPU's
    # matmul library takes as is: 1.8x (scores) and 3x (values) faster for a decode step
    # than contracting over the keys' and values' minor axes. With t = 1 the transposes
    # of q and of the output are free reshapes.
    hkv = k.shape[1]
    g = h // hkv
    rows = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dh)
    scores = jnp.einsum("bkqh,bkhs->bkqs", rows, k, preferred_element_type=jnp.float32) * (dh**-0.5)
    scores = jnp.where(mask[:, None, :, None, :], scores.reshape(b, hkv, t, g, -1), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, hkv, t * g, -1)
    out = jnp.einsum("bkqs,bksh->bkqh", probs, v)
    return out.reshape(b, hkv, t, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, t, h, dh)


# ---- blockwise -------------------------------------------------------------------------


def _pad_to(x: jax.Array, length: int, axis: int, value=0) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _blocks(x: jax.Array, block: int, axis: int) -> jax.Array:
    """x with ``axis`` (a multiple of ``block`` long) split into [n, ..., block, ...],
    the block index leading."""
    n = x.shape[axis] // block
    x = x.reshape(x.shape[:axis] + (n, block) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def blockwise_attention(q, k, v, key_mask, segment_ids, *, block_size: int = 512):
    """Flash-style causal attention in plain JAX; memory linear in T, forward and backward.

    Forward (FlashAttention-2, arXiv:2307.08691, Algorithm 1): for each query block, a
    loop over the key blocks it can see (causality skips the rest) keeps the running row
    maximum m, the running sum l = sum_s exp(s_ts - m) and the running output
    o = sum_s exp(s_ts - m) v_s, rescaled by exp(m_old - m_new) when m grows; then
    out = o / l and lse = m + log l. Backward (Algorithm 2): per key block, a loop over
    the query blocks that can see it recomputes p = exp(s - lse), then
    dv += p^T do, dp = do v^T, ds = p (dp - D) with D = rowsum(do * out),
    dk += ds^T q / sqrt(Dh), dq += ds k / sqrt(Dh). No [T, T] array exists at any time:
    the largest is one [B, H, block, block] tile.

    Args:
      q: [B, T, H, Dh]; k, v: [B, T, Hkv, Dh].
      key_mask: bool [B, T]; segment_ids: int32 [B, T] (every query sees only keys with
        its own id; id 0 sees nothing).
      block_size: rows of a query block and of a key block; T is padded up to a multiple.
    Returns:
      [B, T, H, Dh] in v's dtype; 0 at rows that see no key and in blocks holding only
      padding (in every row of the batch), whose work is skipped.
    """
    return _blockwise(q, k, v, key_mask, segment_ids, min(block_size, q.shape[1]))


def _block_inputs(q, k, v, key_mask, segment_ids, block):
    """Padded, blocked operands: q [n, B, Hkv, G, bq, Dh], k and v [n, B, Hkv, bk, Dh],
    key_mask [n, B, bk], segment ids [n, B, bq]."""
    b, t, h, dh = q.shape
    hkv = k.shape[2]
    padded = -(-t // block) * block
    q = _pad_to(q, padded, 1).reshape(b, padded, hkv, h // hkv, dh).transpose(0, 2, 3, 1, 4)
    k = _pad_to(k, padded, 1).transpose(0, 2, 1, 3)
    v = _pad_to(v, padded, 1).transpose(0, 2, 1, 3)
    return (
        _blocks(q, block, 3),
        _blocks(k, block, 2),
        _blocks(v, block, 2),
        _blocks(_pad_to(key_mask, padded, 1, False), block, 1),
        _blocks(_pad_to(segment_ids, padded, 1, 0), block, 1),
    )


def _tile_mask(i, j, block, key_mask_j, segment_q, segment_k):
    """bool [B, 1, 1, bq, bk]: which keys of block j each query of block i may see."""
    slots = jnp.arange(block)
    causal = (j * block + slots)[None, :] <= (i * block + slots)[:, None]  # [bq, bk]
    same = (segment_q[:, :, None] == segment_k[:, None, :]) & (segment_q != 0)[:, :, None]
    mask = causal[None] & same & key_mask_j[:, None, :]  # [B, bq, bk]
    return mask[:, None, None]


def _live_blocks(maskb, segb):
    """bool [n]: blocks holding a real token (key_mask True, segment != 0) in some row.
    The others are skipped, as keys (nothing sees them) and as queries (their rows,
    padding, are left at 0)."""
    return (maskb & (segb != 0)).any(axis=(1, 2))


def _scores(q_i, k_j, scale):
    return jnp.einsum("bkgqh,bksh->bkgqs", q_i, k_j, preferred_element_type=jnp.float32) * scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blockwise(q, k, v, key_mask, segment_ids, block):
    return _blockwise_fwd(q, k, v, key_mask, segment_ids, block)[0]


def _blockwise_fwd(q, k, v, key_mask, segment_ids, block):
    b, t, h, dh = q.shape
    qb, kb, vb, maskb, segb = _block_inputs(q, k, v, key_mask, segment_ids, block)
    n = qb.shape[0]
    scale = dh**-0.5
    live = _live_blocks(maskb, segb)

    def query_block(i):
        q_i, seg_i = qb[i], segb[i]
        stats_shape = q_i.shape[:-1]  # [B, Hkv, G, bq]

        def update(j, carry):
            m, l, o = carry
            mask = _tile_mask(i, j, block, maskb[j], seg_i, segb[j])
            s = jnp.where(mask, _scores(q_i, kb[j], scale), _MASK_VALUE)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + p.sum(-1)
            o = alpha[..., None] * o + jnp.einsum(
                "bkgqs,bksh->bkgqh", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32
            )
            return m_new, l, o

        def key_block(j, carry):
            return jax.lax.cond(live[j], update, lambda j, carry: carry, j, carry)

        init = (
            jnp.full(stats_shape, _MASK_VALUE, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (dh,), jnp.float32),
        )
        # Causality: query block i sees key blocks 0..i only.
        m, l, o = jax.lax.cond(
            live[i], lambda: jax.lax.fori_loop(0, i + 1, key_block, init), lambda: init
        )
        seen = l > 0
        out = o / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
        return out.astype(v.dtype), lse

    out, lse = jax.lax.map(query_block, jnp.arange(n))  # [n, B, Hkv, G, bq, ...]
    out_rows = jnp.moveaxis(out, 0, 3).reshape(b, k.shape[2], h // k.shape[2], n * block, dh)
    out_rows = out_rows[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)
    return out_rows, (q, k, v, key_mask, segment_ids, out, lse)


def _blockwise_bwd(block, residuals, d_out):
    q, k, v, key_mask, segment_ids, out, lse = residuals
    b, t, h, dh = q.shape
    hkv = k.shape[2]
    qb, kb, vb, maskb, segb = _block_inputs(q, k, v, key_mask, segment_ids, block)
    (dob,) = _block_inputs(d_out, k, v, key_mask, segment_ids, block)[:1]
    n = qb.shape[0]
    scale = dh**-0.5
    live = _live_blocks(maskb, segb)
    # D_t = sum_h do_t * out_t (FlashAttention-2's row term; = rowsum(p * dp)).
    delta = jnp.einsum("nbkgqh,nbkgqh->nbkgq", dob.astype(jnp.float32), out.astype(jnp.float32))

    def key_block(j, dq):
        k_j, v_j, mask_j, seg_j = kb[j], vb[j], maskb[j], segb[j]

        def update(i, carry):
            dq, dk_j, dv_j = carry
            q_i, do_i = qb[i], dob[i]
            mask = _tile_mask(i, j, block, mask_j, segb[i], seg_j)
            s = _scores(q_i, k_j, scale)
            p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)  # [B,Hkv,G,bq,bk]
            dv_j = dv_j + jnp.einsum(
                "bkgqs,bkgqh->bksh", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32
            )
            dp = jnp.einsum("bkgqh,bksh->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[i][..., None]) * scale
            dk_j = dk_j + jnp.einsum(
                "bkgqs,bkgqh->bksh", ds.astype(q_i.dtype), q_i, preferred_element_type=jnp.float32
            )
            dq_i = jnp.einsum(
                "bkgqs,bksh->bkgqh", ds.astype(k_j.dtype), k_j, preferred_element_type=jnp.float32
            )
            return dq.at[i].add(dq_i), dk_j, dv_j

        def query_block(i, carry):
            return jax.lax.cond(live[i], update, lambda i, carry: carry, i, carry)

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        # Causality: key block j is seen by query blocks j..n-1 only.
        dq, dk_j, dv_j = jax.lax.cond(
            live[j],
            lambda: jax.lax.fori_loop(j, n, query_block, (dq, zeros, zeros)),
            lambda: (dq, zeros, zeros),
        )
        return dq, (dk_j, dv_j)

    dq = jnp.zeros(qb.shape, jnp.float32)
    dq, (dk, dv) = jax.lax.scan(lambda dq, j: key_block(j, dq), dq, jnp.arange(n))

    dq = jnp.moveaxis(dq, 0, 3).reshape(b, hkv, h // hkv, n * block, dh)[:, :, :, :t]
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh)
    dk = jnp.moveaxis(dk, 0, 2).reshape(b, hkv, n * block, dh)[:, :, :t].transpose(0, 2, 1, 3)
    dv = jnp.moveaxis(dv, 0, 2).reshape(b, hkv, n * block, dh)[:, :, :t].transpose(0, 2, 1, 3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


# ---- cuDNN -----------------------------------------------------------------------------


def cudnn_attention(q, k, v, key_mask, segment_ids=None, *, implementation: str = "cudnn"):
    """cuDNN flash attention through ``jax.nn.dot_product_attention``.

    Its public entry point takes causality, per-row lengths of a right-padded prefix
    (``query_seq_lengths``, ``key_value_seq_lengths``) and a dense mask. Unpacked rows
    are mapped onto the lengths, so that no [T, T] array is built: ``key_mask`` must
    hold each row's real tokens as ONE contiguous span [start, end) (the row layout of
    ``policyopt.rl.batch``: a left-padded prompt, then a right-padded response). Each
    row is rotated left by ``start`` (q, k and v already carry their RoPE phases, so
    only the slots move), attended with causal + length ``end - start`` masks, and
    rotated back. A mask with holes inside the span would see the holes' keys: such
    rows need ``segment_ids`` (0 at the holes). Packed rows (``segment_ids``) go through
    the dense boolean mask [B, 1, T, T], which cuDNN turns into a bias: quadratic bytes
    in T, so "auto" sends packed rows to "blockwise" instead. Limits that JAX checks
    only when tracing, on the device: head dims above 128 need Hopper or later, and a
    mask (packed rows) in training needs an even T.

    Args:
      q: [B, T, H, Dh]; k, v: [B, T, Hkv, Dh]; bf16 or fp16 on a GPU.
      key_mask: bool [B, T]; segment_ids: int32 [B, T] or None.
      implementation: passed to ``jax.nn.dot_product_attention``; "xla" runs the same
        mapping on any backend (tests).
    Returns:
      [B, T, H, Dh].
    """
    t = q.shape[1]
    if segment_ids is not None:
        mask = attention_weights_mask(jnp.arange(t), key_mask, segment_ids)[:, None]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation=implementation
        )
    start = jnp.argmax(key_mask, axis=1).astype(jnp.int32)  # [B]
    lengths = jnp.maximum(key_mask.sum(axis=1, dtype=jnp.int32), 1)
    slots = (jnp.arange(t, dtype=jnp.int32)[None, :] + start[:, None]) % t  # [B, T]

    def rotate(x, index):
        return jnp.take_along_axis(x, index[:, :, None, None], axis=1)

    out = jax.nn.dot_product_attention(
        rotate(q, slots),
        rotate(k, slots),
        rotate(v, slots),
        is_causal=True,
        query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        implementation=implementation,
    )
    back = (jnp.arange(t, dtype=jnp.int32)[None, :] - start[:, None]) % t
    return rotate(out, back)


# ---- splash (TPU) ----------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _splash_kernel(num_heads: int, length: int, block: int, interpret: bool):
    """The splash kernel of one row: causal over ``length`` slots, ``num_heads`` heads."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    with jax.ensure_compile_time_eval():  # concrete mask tables, cacheable across jits
        return _make_splash_kernel(splash, num_heads, length, block, interpret)


def _make_splash_kernel(splash, num_heads, length, block, interpret):
    mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * num_heads)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    return splash.make_splash_mha(
        mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def splash_attention(q, k, v, key_mask, segment_ids=None, *, interpret: bool = False):
    """Splash attention (Pallas, TPU), causal, with grouped kv heads and segment ids.

    The kernel's masks are a static causal mask and ``SegmentIds`` (a query sees keys
    of its own id). Padding is mapped onto the ids: a key with ``key_mask`` False gets
    id 0, the padding id, which no real token has, so real queries never see it, and a
    padding query sees at least itself (the kernel needs no empty rows). Rows are
    padded up to a multiple of 128 slots with id 0. GQA: the kernel's multi-head form
    takes Hkv key heads for H query heads. The kernel does not scale the scores, so q
    is multiplied by 1 / sqrt(Dh) first. One kernel per row, vmapped over the batch.

    Args:
      q: [B, T, H, Dh]; k, v: [B, T, Hkv, Dh].
      key_mask: bool [B, T]; segment_ids: int32 [B, T] or None.
      interpret: Pallas interpret mode (runs on CPUs, for tests).
    Returns:
      [B, T, H, Dh] in v's dtype.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, t, h, dh = q.shape
    padded = -(-t // _SPLASH_BLOCK) * _SPLASH_BLOCK
    block = next(size for size in (512, 256, 128) if padded % size == 0)
    ids = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    ids = _pad_to(jnp.where(key_mask, ids, 0), padded, 1)

    def heads_first(x):
        return _pad_to(x, padded, 1).transpose(0, 2, 1, 3)  # [B, heads, T, Dh]

    q, k, v = heads_first(q * jnp.asarray(dh**-0.5, q.dtype)), heads_first(k), heads_first(v)
    axes = _splash_mesh_axes(b, h, k.shape[1])

    def rows(q, k, v, ids):
        kernel = _splash_kernel(q.shape[1], padded, block, interpret)
        return jax.vmap(
            lambda q_b, k_b, v_b, ids_b: kernel(q_b, k_b, v_b, SegmentIds(ids_b, ids_b))
        )(q, k, v, ids)

    if axes is None:
        out = rows(q, k, v, ids)
    else:
        # Pallas TPU kernels are not partitioned automatically: each device runs the
        # kernel on its own rows (and heads) under shard_map.
        from jax.sharding import PartitionSpec as P

        batch_axes, head_axes = axes
        heads = P(batch_axes, head_axes, None, None)
        out = jax.shard_map(
            rows,
            in_specs=(heads, heads, heads, P(batch_axes, None)),
            out_specs=heads,
            check_vma=False,
        )(q, k, v, ids)
    return out.transpose(0, 2, 1, 3)[:, :t].astype(v.dtype)


def _splash_mesh_axes(batch: int, heads: int, kv_heads: int):
    """(batch mesh axes, head mesh axes) for splash's shard_map under the current mesh, by
    the logical rules of ``policyopt.sharding`` ("batch", "heads"); heads are split
    only when both H and Hkv divide evenly (a shard keeps whole kv groups). None without
    a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    spec = logical_to_mesh_axes(("batch", "heads"), mesh_axis_names=mesh.axis_names)

    def size(axes):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        return int(np.prod([mesh.shape[a] for a in axes]))

    batch_axes, head_axes = spec
    if batch % size(batch_axes):
        raise ValueError(
            f"splash attention: {batch} rows do not divide over the mesh axes "
            f"{batch_axes} ({size(batch_axes)} shards)"
        )
    if heads % size(head_axes) or kv_heads % size(head_axes):
        head_axes = None
    return batch_axes, head_axes
