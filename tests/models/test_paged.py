"""Tests of policyopt.models.paged: the paged cache against the dense KVCache, the page
allocator by hand-worked cases, and the TPU kernel (interpreted) against the gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.models import ModelConfig, Transformer
from policyopt.models.paged import (
    PagedKVCache,
    _pallas_decode,
    gather_attention,
    online_attention,
    pool_attention,
)
from tests.settings import TINY_MODEL, TINY_MOE

VOCAB = 64
_BASE = {**TINY_MODEL, "vocab_size": VOCAB, "initializer_range": 0.3}
CONFIGS = {
    "dense": ModelConfig(**_BASE),
    "moe": ModelConfig(**_BASE, **TINY_MOE),
}
PROMPTS = np.array(
    [[5, 17, 3, 9, 22, 41, 0], [7, 2, 0, 0, 0, 0, 0], [11, 30, 8, 60, 0, 0, 0]], np.int32
)
LENGTHS = np.array([6, 2, 4], np.int32)
STEPS = 7


def _step_dense(graphdef, state, tokens, positions, mask, cache):
    out = nnx.merge(graphdef, state)(tokens, positions=positions, attention_mask=mask, cache=cache)
    return out.logits, out.cache


def _step_paged(graphdef, state, tokens, positions, mask, cache):
    cache, granted = cache.reserve(jnp.sum(mask, axis=1, dtype=jnp.int32))
    out = nnx.merge(graphdef, state)(tokens, positions=positions, attention_mask=mask, cache=cache)
    return out.logits, out.cache.advance(mask), granted


step_dense = jax.jit(_step_dense, static_argnums=0)
step_paged = jax.jit(_step_paged, static_argnums=0)
# Jitted once each: op-by-op dispatch compiles every primitive separately.
reserve = jax.jit(lambda cache, new_tokens: cache.reserve(new_tokens))
gather = jax.jit(gather_attention)
online = jax.jit(online_attention)
pool = jax.jit(pool_attention, static_argnums=(5, 6))
release = jax.jit(lambda cache, rows: cache.release(rows))
advance = jax.jit(lambda cache, mask: cache.advance(mask))


@pytest.mark.parametrize(
    "name,attention,per_layer",
    [("dense", "gather", False), ("moe", "pool", False), ("moe", "pool", True)],
)
def test_paged_decode_equals_dense(name, attention, per_layer):
    """Ragged prompts prefilled, then greedy decode: every step's logits and tokens equal
    the dense KVCache's (shared slot P + step, per-row positions), with 3-slot pages that
    the rows take in interleaved order as they grow. ("pool": decode steps read the pool
    in place, the prefill gathers; per_layer: one pool per layer, as the engine holds
    them for an unrolled model. The pools' layout only changes the writes and which pool
    a layer reads, never the attention: each attention on each layout is here or in
    tests/test_engine.py's test_greedy_equals_generate, per-layer, against generate.)"""
    model = Transformer(CONFIGS[name], rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch, prompt_len = PROMPTS.shape
    positions = jnp.broadcast_to(jnp.arange(prompt_len), PROMPTS.shape)
    mask = jnp.arange(prompt_len)[None, :] < LENGTHS[:, None]
    dense = model.init_cache(batch, prompt_len + STEPS)
    paged = PagedKVCache.create(
        model.config,
        batch,
        num_pages=12,
        page_size=3,
        max_pages=5,
        attention=attention,
        per_layer=per_layer,
    )
    # Checks on the host (NumPy): device arrays indexed op by op compile each op.
    dense_logits, dense = step_dense(graphdef, state, PROMPTS, positions, mask, dense)
    paged_logits, paged, granted = step_paged(graphdef, state, PROMPTS, positions, mask, paged)
    dense_logits, paged_logits, mask = map(np.asarray, (dense_logits, paged_logits, mask))
    assert np.all(np.asarray(granted))
    np.testing.assert_array_equal(paged.lengths, LENGTHS)
    last = (np.arange(batch), LENGTHS - 1)
    dense_next, paged_next = dense_logits[last], paged_logits[last]
    np.testing.assert_allclose(paged_logits[mask], dense_logits[mask], atol=1e-5, rtol=1e-5)
    live = jnp.ones((batch, 1), bool)
    for step in range(STEPS):
        np.testing.assert_allclose(paged_next, dense_next, atol=1e-5, rtol=1e-5)
        tokens = np.argmax(dense_next, axis=-1).astype(np.int32)
        np.testing.assert_array_equal(np.argmax(paged_next, axis=-1), tokens)
        pos = (LENGTHS + step)[:, None]
        dense_logits, dense = step_dense(graphdef, state, tokens[:, None], pos, live, dense)
        paged_logits, paged, granted = step_paged(
            graphdef, state, tokens[:, None], pos, live, paged
        )
        assert np.all(np.asarray(granted))
        dense_next, paged_next = np.asarray(dense_logits)[:, 0], np.asarray(paged_logits)[:, 0]
    np.testing.assert_array_equal(paged.lengths, LENGTHS + STEPS)
    # ceil((6, 2, 4) + 7) / 3) = (5, 3, 4) pages, all distinct, 12 - 12 = 0 left.
    held = np.asarray(paged.page_table)
    np.testing.assert_array_equal((held < 12).sum(1), [5, 3, 4])
    assert sorted(held[held < 12].tolist()) == list(range(12))
    assert int(paged.num_free) == 0
    assert paged.per_layer == per_layer and paged.pool_shape == (2, 12, 3, 8)


def test_reserve_release_reuse_hand_worked():
    """5 pages of 2 slots; the stack pops 0, 1, 2, ... in row order."""
    config = CONFIGS["dense"]
    cache = PagedKVCache.create(config, 3, num_pages=5, page_size=2, max_pages=3)
    cache, granted = reserve(cache, jnp.array([3, 2, 4], jnp.int32))  # needs 2, 1, 2
    np.testing.assert_array_equal(granted, [True, True, True])
    np.testing.assert_array_equal(cache.page_table, [[0, 1, 5], [2, 5, 5], [3, 4, 5]])
    assert int(cache.num_free) == 0
    cache = advance(cache, jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool))
    # Row 0 holds 3 tokens in 2 pages: a 4th fits, a 5th needs a page and none is free.
    cache, granted = reserve(cache, jnp.array([1, 0, 0], jnp.int32))
    np.testing.assert_array_equal(granted, [True, True, True])
    cache, granted = reserve(cache, jnp.array([2, 0, 0], jnp.int32))
    np.testing.assert_array_equal(granted, [False, True, True])
    np.testing.assert_array_equal(cache.page_table[0], [0, 1, 5])
    # Row 1 handed out: its page 2 goes back on the stack and row 0 gets it.
    cache = release(cache, jnp.array([False, True, False]))
    np.testing.assert_array_equal(cache.page_table[1], [5, 5, 5])
    np.testing.assert_array_equal(cache.lengths, [3, 0, 4])
    assert int(cache.num_free) == 1
    cache, granted = reserve(cache, jnp.array([2, 0, 0], jnp.int32))
    np.testing.assert_array_equal(granted, [True, True, True])
    np.testing.assert_array_equal(cache.page_table[0], [0, 1, 2])
    # Past max_pages (3 pages = 6 slots) a row is refused, never truncated.
    cache = advance(cache, jnp.array([[1, 1], [0, 0], [0, 0]], bool))
    cache, granted = reserve(cache, jnp.array([2, 0, 0], jnp.int32))
    np.testing.assert_array_equal(granted, [False, True, True])
    # Everything released: the stack holds each page once.
    cache = release(cache, jnp.ones(3, bool))
    assert int(cache.num_free) == 5
    assert sorted(np.asarray(cache.free).tolist()) == [0, 1, 2, 3, 4]


def test_shards_allocate_from_their_own_pools_hand_worked():
    """2 shards of 2 rows and 2 pages of 2 slots (page ids local, 2 = no page): a row is
    refused when its own pool is empty, whatever the other pool holds."""
    cache = PagedKVCache.create(
        CONFIGS["dense"], 4, num_pages=4, page_size=2, max_pages=3, shards=2
    )
    cache, granted = reserve(cache, jnp.array([4, 0, 2, 0], jnp.int32))  # needs 2, 0, 1, 0
    np.testing.assert_array_equal(granted, [True, True, True, True])
    np.testing.assert_array_equal(cache.page_table, [[0, 1, 2], [2, 2, 2], [0, 2, 2], [2, 2, 2]])
    np.testing.assert_array_equal(cache.num_free, [0, 1])
    cache = advance(
        cache, jnp.array([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
    )
    # Row 1 (shard 0) is refused although shard 1 has a free page; row 3 gets it.
    cache, granted = reserve(cache, jnp.array([0, 1, 0, 1], jnp.int32))
    np.testing.assert_array_equal(granted, [True, False, True, True])
    np.testing.assert_array_equal(cache.page_table[3], [1, 2, 2])
    np.testing.assert_array_equal(cache.num_free, [0, 0])
    # Row 0 handed out: its pages go back to shard 0's stack, and row 1 gets one.
    cache = release(cache, jnp.array([True, False, False, False]))
    np.testing.assert_array_equal(cache.num_free, [2, 0])
    np.testing.assert_array_equal(cache.pages_in_use(), [0, 2])
    cache, granted = reserve(cache, jnp.array([0, 1, 0, 0], jnp.int32))
    assert bool(granted[1]) and int(cache.page_table[1, 0]) in (0, 1)
    np.testing.assert_array_equal(cache.lengths, [0, 0, 2, 0])


copy_rows = jax.jit(lambda cache, source, dest: cache.copy_rows(source, dest, 3))


@pytest.mark.parametrize("per_layer", [False, True])
def test_copy_rows_shares_full_pages_and_copies_the_partial_one(per_layer):
    """A 5-token prompt in pages of 2 (pages 0, 1 full, page 2 partial) given to rows 1
    and 2: they share pages 0 and 1 and get pages 3 and 4 holding page 2's keys (in
    every layer's pool, stacked or per layer)."""
    config = CONFIGS["dense"]
    cache = PagedKVCache.create(config, 4, num_pages=6, page_size=2, max_pages=4)
    cache, _ = reserve(cache, jnp.array([5, 0, 0, 0], jnp.int32))
    cache = advance(cache, jnp.array([[1] * 5, [0] * 5, [0] * 5, [0] * 5], bool))
    cache = cache.replace(k=cache.k.at[:, :, 2].set(7.0), v=cache.v.at[:, :, 2].set(-3.0))
    if per_layer:
        cache = cache.unstack()
    cache, granted = copy_rows(cache, jnp.int32(0), jnp.array([1, 2, 4], jnp.int32))
    assert cache.per_layer == per_layer
    np.testing.assert_array_equal(granted, [True, True, False])  # row 4: outside
    np.testing.assert_array_equal(cache.page_table[:3, :3], [[0, 1, 2], [0, 1, 3], [0, 1, 4]])
    np.testing.assert_array_equal(cache.lengths, [5, 5, 5, 0])
    np.testing.assert_array_equal(cache.refs, [3, 3, 1, 1, 1, 0])
    assert int(cache.num_free) == 1
    stacked = cache.stack()
    for page in (3, 4):
        np.testing.assert_array_equal(stacked.k[:, :, page], 7.0)
        np.testing.assert_array_equal(stacked.v[:, :, page], -3.0)
    np.testing.assert_array_equal(stacked.k[:, :, 5], 0.0)
    # One page left: row 3 gets the shared pages but is refused its partial page.
    cache, _ = reserve(cache, jnp.array([0, 0, 0, 0], jnp.int32))
    cache = cache.replace(num_free=jnp.int32(0))
    cache, granted = copy_rows(cache, jnp.int32(0), jnp.array([3, 9, 9], jnp.int32))
    np.testing.assert_array_equal(granted, [False, False, False])
    np.testing.assert_array_equal(cache.page_table[3], [6, 6, 6, 6])
    np.testing.assert_array_equal(cache.refs, [3, 3, 1, 1, 1, 0])
    cache = cache.replace(num_free=jnp.int32(1))
    # The source handed out first: only its own page 2 comes back; the shared pages
    # stay until their last row goes.
    cache = release(cache, jnp.array([True, False, False, False]))
    np.testing.assert_array_equal(cache.refs, [2, 2, 0, 1, 1, 0])
    assert int(cache.num_free) == 2 and int(cache.free[1]) == 2
    cache = release(cache, jnp.array([False, True, True, False]))
    assert int(cache.num_free) == 6
    assert sorted(np.asarray(cache.free).tolist()) == list(range(6))


def test_refused_row_waits_and_writes_nothing():
    """A row refused a page is left out of the step (mask False): the pool and the other
    rows' results are as without it, and it goes on once a page is free."""
    model = Transformer(CONFIGS["dense"], rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jnp.array([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(4), tokens.shape)
    cache = PagedKVCache.create(model.config, 2, num_pages=2, page_size=4, max_pages=2)
    cache, granted = reserve(cache, jnp.array([4, 4], jnp.int32))
    full = jnp.ones((2, 4), bool)
    logits, cache, _ = step_paged(graphdef, state, tokens, positions, full, cache)
    # Both rows need a second page for token 5; none is free.
    cache2, granted = reserve(cache, jnp.array([1, 1], jnp.int32))
    np.testing.assert_array_equal(granted, [False, False])
    # Row 1 handed out; row 0 now gets the freed page and continues where it was.
    cache2 = release(cache2, jnp.array([False, True]))
    one = jnp.array([[True], [False]])
    logits_next, cache3, granted = step_paged(
        graphdef, state, jnp.array([[3], [3]]), jnp.array([[4], [0]]), one, cache2
    )
    np.testing.assert_array_equal(granted, [True, True])
    np.testing.assert_array_equal(cache3.lengths, [5, 0])
    reference, _ = step_dense(
        graphdef,
        state,
        jnp.array([[5, 6, 7, 8, 3]]),
        jnp.arange(5)[None],
        jnp.ones((1, 5), bool),
        None,
    )
    logits, logits_next, reference = map(np.asarray, (logits, logits_next, reference))
    np.testing.assert_allclose(logits_next[0, 0], reference[0, -1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits[0], reference[0, :4], atol=1e-5, rtol=1e-5)


def _random_pools(
    seed=0, batch=3, heads=4, kv_heads=2, head_dim=16, num_pages=10, page_size=4, dtype=jnp.float32
):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), dtype)
    ends = jnp.array([5, 12, 1], jnp.int32)
    table = jnp.array([[3, 7, 10], [1, 2, 9], [5, 10, 10]], jnp.int32)  # 10: no page
    return q, k, v, ends, table


def _numpy_reference(q, k, v, ends, table):
    """Loop over rows and heads: softmax(q k^T / sqrt(Dh)) v over the row's first
    ends[b] slots, read page by page from the table."""
    q, k, v, ends, table = (
        np.asarray(x, np.float64) if i < 3 else np.asarray(x)
        for i, x in enumerate((q, k, v, ends, table))
    )
    batch, _, heads, head_dim = q.shape
    group = heads // k.shape[0]
    out = np.zeros((batch, 1, heads, head_dim))
    for b in range(batch):
        for h in range(heads):
            keys = np.concatenate([k[h // group, p] for p in table[b] if p < k.shape[1]])
            values = np.concatenate([v[h // group, p] for p in table[b] if p < k.shape[1]])
            z = keys[: ends[b]] @ q[b, 0, h] / np.sqrt(head_dim)
            p = np.exp(z - z.max())
            out[b, 0, h] = (p / p.sum()) @ values[: ends[b]]
    return out


def test_gather_and_online_attention_equal_numpy_loop():
    q, k, v, ends, table = _random_pools()
    slots = (np.asarray(ends) - 1)[:, None]
    reference = _numpy_reference(q, k, v, ends, table)
    for attention in (gather, online):
        np.testing.assert_allclose(
            attention(q, k, v, table, slots, ends), reference, atol=1e-5, rtol=1e-5
        )


def test_pallas_kernel_interpreted_equals_gather():
    """JAX's TPU paged-attention kernel in Pallas' TPU interpret mode against the gather.

    On bfloat16 pools (as decoding on a TPU stores them) both paths agree to bfloat16
    rounding. (On float32 pools the interpreted kernel is off by ~1e-2 as well: its dots
    appear to run at one bfloat16 pass, a TPU's default precision; not pursued.)
    """
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, ends, table = _random_pools(dtype=jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        kernel = _pallas_decode(q[:, 0], k, v, ends, jnp.minimum(table, 9))
    gathered = np.asarray(gather(q, k, v, table, (np.asarray(ends) - 1)[:, None], ends))[:, 0]
    np.testing.assert_allclose(
        np.asarray(kernel, np.float32), np.asarray(gathered, np.float32), atol=2e-2, rtol=2e-2
    )
    reference = _numpy_reference(q, k, v, ends, table)[:, 0]
    np.testing.assert_allclose(np.asarray(kernel, np.float32), reference, atol=3e-2, rtol=3e-2)


def test_pallas_kernel_reads_pages_as_bfloat16_so_it_takes_bfloat16_pools_only():
    """JAX's TPU kernel casts every K and V page it loads to bfloat16 (its dequantisation
    step takes no dtype): on a float32 pool, interpreted, it gives exactly the kernel's
    result on the pool rounded to bfloat16, about 1e-2 from the float32 attention. So
    attention="pallas" takes bfloat16 pools only; a float32 pool is an error naming the
    option (it decoded silently at bfloat16 precision before)."""
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, ends, table = _random_pools(dtype=jnp.float32)
    rounded = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    with pltpu.force_tpu_interpret_mode():
        kernel = _pallas_decode(q[:, 0], k, v, ends, jnp.minimum(table, 9))
        kernel_rounded = _pallas_decode(
            q[:, 0], rounded(k), rounded(v), ends, jnp.minimum(table, 9)
        )
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(kernel_rounded))
    error = np.abs(np.asarray(kernel) - _numpy_reference(q, k, v, ends, table)[:, 0]).max()
    assert 1e-3 < error < 5e-2, error
    config = CONFIGS["dense"]
    assert config.compute_dtype == jnp.float32
    with pytest.raises(ValueError) as refused:
        PagedKVCache.create(config, 3, num_pages=8, page_size=4, max_pages=3, attention="pallas")
    assert str(refused.value).startswith(
        "attention='pallas' needs a bfloat16 pool, got float32: JAX's TPU paged-attention "
        "kernel reads every K and V page as bfloat16"
    )
    cache = PagedKVCache.create(
        config, 3, num_pages=8, page_size=4, max_pages=3, dtype=jnp.bfloat16, attention="pallas"
    )
    assert cache.k.dtype == jnp.bfloat16


def test_pallas_attention_in_the_model_decodes_like_the_gather():
    """A decode step of the tiny dense model with attention="pallas" (interpreted, on a
    bfloat16 pool; the prefill takes the gather) gives the float32 gather's logits up to
    bfloat16 rounding."""
    from jax.experimental.pallas import tpu as pltpu

    model = Transformer(CONFIGS["dense"], rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch, prompt_len = PROMPTS.shape
    positions = jnp.broadcast_to(jnp.arange(prompt_len), PROMPTS.shape)
    mask = jnp.arange(prompt_len)[None, :] < LENGTHS[:, None]
    logits = {}
    for attention, dtype in (("gather", jnp.float32), ("pallas", jnp.bfloat16)):
        cache = PagedKVCache.create(model.config, batch, 8, 4, 3, dtype, attention=attention)
        with pltpu.force_tpu_interpret_mode():
            _, cache, _ = step_paged(graphdef, state, PROMPTS, positions, mask, cache)
            tokens = jnp.array([[1], [2], [3]], jnp.int32)
            step, _, _ = step_paged(
                graphdef, state, tokens, LENGTHS[:, None], jnp.ones((batch, 1), bool), cache
            )
        logits[attention] = np.asarray(step[:, 0])
    scale = np.abs(logits["gather"]).max()
    np.testing.assert_allclose(logits["pallas"], logits["gather"], atol=2e-2 * scale)
    np.testing.assert_array_equal(logits["pallas"].argmax(-1), logits["gather"].argmax(-1))


def _shared_table():
    """6 rows over 10 pages of 4 slots (10: no page), pages shared as a group's prompt
    shares them and otherwise: row 0 ends on a page boundary (8 = 2 x 4), row 1 shares its
    first page, row 2 is empty, row 3 has one slot in its third page, row 4 one full page,
    row 5 holds page 7 at column 0 where rows 0 and 3 hold it at column 1. References
    beyond each page's first: page 3 twice (rows 1, 3), page 7 twice (rows 3, 5)."""
    table = jnp.array(
        [[3, 7, 10], [3, 1, 10], [10, 10, 10], [3, 7, 2], [5, 10, 10], [7, 9, 10]], jnp.int32
    )
    ends = jnp.array([8, 6, 0, 9, 4, 7], jnp.int32)
    return table, ends


@pytest.mark.parametrize(
    "shared_refs, held_pages", [(0, 0), (1, 0), (3, 0), (16, 0), (3, 2), (1, 4), (16, 6), (3, 10)]
)
def test_pool_attention_equals_numpy_loop_and_gather(shared_refs, held_pages):
    """Shared pages, an empty row, rows ending on a page boundary; the 4 shared references
    taken 1, 3 or max_pages = 3 at a time (4, 2, 2 chunks: the first, then the overflow
    loop) or all in the first chunk (16). The 6 held pages of the pool's 10 scored in
    place (held_pages 0, or 10 = NP), or gathered 2, 4 or 6 at a time (3 and 2 chunks: a
    bucket smaller than the pages held overflows into the loop, nothing is dropped; 1)."""
    q, k, v, _, _ = _random_pools(batch=6)
    table, ends = _shared_table()
    live = np.asarray(ends) > 0
    out = np.asarray(pool(q, k, v, table, ends, shared_refs, held_pages))
    q, table, ends = map(np.asarray, (q, table, ends))
    reference = _numpy_reference(q[live], k, v, ends[live], table[live])
    np.testing.assert_allclose(out[live], reference, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(out[~live], 0.0)  # no key: zeros
    gathered = np.asarray(gather(q, k, v, table, (ends - 1)[:, None], ends))
    np.testing.assert_allclose(out[live], gathered[live], atol=1e-5, rtol=1e-5)


def test_pool_attention_hand_worked():
    """One head, Dh = 1, q = 1, pages of 2. Page 0 holds keys (0, ln 2), values (1, 3);
    page 1 keys (ln 3, 9), values (5, 100). Row 0 = [page 0], 2 keys: weights (1, 2) / 3,
    out = (1 + 6) / 3 = 7/3. Row 1 = [page 0, page 1], 3 keys (page 0 shared: a second
    reference, taken by the loop; page 1's slot 1 unseen): weights (1, 2, 3) / 6,
    out = (1 + 6 + 15) / 6 = 11/3."""
    q = jnp.ones((2, 1, 1, 1), jnp.float32)
    k = jnp.array([[[[0.0], [np.log(2)]], [[np.log(3)], [9.0]]]], jnp.float32)
    v = jnp.array([[[[1.0], [3.0]], [[5.0], [100.0]]]], jnp.float32)
    table = jnp.array([[0, 2], [0, 1]], jnp.int32)
    for held_pages in (0, 1):  # the pool in place; the 2 held pages one at a time
        out = pool(q, k, v, table, jnp.array([2, 3], jnp.int32), 1, held_pages)
        np.testing.assert_allclose(out[:, 0, 0, 0], [7 / 3, 11 / 3], rtol=1e-6)


def test_pool_attention_on_shards_equals_gather():
    """Two shards (a vmap over pools): shard 0 with two shared references, shard 1 with
    none, so the loop over shared references runs on one shard only; a decode step's
    attention through ``attend`` equals the gather's, over the whole pools or over the
    held pages only."""
    q, k, v, _, _ = _random_pools(batch=4, num_pages=10)
    pools = jnp.concatenate([k, k[:, ::-1]], axis=1)[None], jnp.concatenate([v, -v], axis=1)[None]
    cache = PagedKVCache.create(
        ModelConfig(**{**_BASE, "num_layers": 1, "head_dim": 16}),
        4,
        num_pages=20,
        page_size=4,
        max_pages=3,
        shards=2,
        attention="pool",
        shared_refs=1,
    )
    cache = cache.replace(
        k=pools[0],
        v=pools[1],
        page_table=jnp.array([[3, 7, 10], [3, 7, 2], [4, 10, 10], [1, 5, 10]], jnp.int32),
        lengths=jnp.array([7, 9, 3, 5], jnp.int32),
    )
    new_k = jnp.asarray(np.random.default_rng(1).standard_normal((4, 1, 2, 16)), jnp.float32)
    mask = jnp.array([[True], [True], [True], [False]])
    attend = jax.jit(lambda c: c.attend(0, q, new_k, -new_k, mask))
    out, written = attend(cache)
    reference, written_too = attend(cache.replace(attention="gather"))
    np.testing.assert_allclose(out, reference, atol=1e-5, rtol=1e-5)
    # Over each shard's held pages only (3 and 3 of 10), 2 at a time: the overflow loop
    # runs on both shards.
    held_out, _ = attend(cache.replace(held_pages=2))
    np.testing.assert_allclose(held_out, reference, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(written.k, written_too.k)
    # The per-layer form: the same writes on each shard's pages, the same attention.
    per_layer_out, per_layer = attend(cache.unstack())
    assert per_layer.per_layer
    np.testing.assert_allclose(per_layer_out, out, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(per_layer.stack().k, written.k)
    np.testing.assert_array_equal(per_layer.stack().v, written.v)
