"""One decode step's attention over a paged cache: gather into one block vs a per-page
online softmax (policyopt.models.paged), and the dense KVCache's attention for scale.

    python -m benchmarks.bench_paged_attention   # ~1 minute on 2 CPU cores

Geometry of moe_7m's sampler benchmark (B = 64 rows, 32 + 128 tokens, Hkv = 2, H = 4,
Dh = 64), pages of 16 slots, every row's pages scattered over the pool.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from policyopt.models.attention import dot_product_attention
from policyopt.models.paged import gather_attention, online_attention


def _time(fn, *args, reps=30):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / reps


def main(batch=64, heads=4, kv_heads=2, head_dim=64, page_size=16, length=160):
    rng = np.random.default_rng(0)
    max_pages = length // page_size
    num_pages = batch * max_pages
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.float32)
    pool = lambda: jnp.asarray(
        rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), jnp.float32
    )
    k_pages, v_pages = pool(), pool()
    table = jnp.asarray(rng.permutation(num_pages).reshape(batch, max_pages), jnp.int32)
    ends = jnp.asarray(rng.integers(length // 2, length + 1, batch), jnp.int32)
    slots = (ends - 1)[:, None]
    args = (q, k_pages, v_pages, table, slots, ends)
    results = {
        name: _time(jax.jit(fn), *args)
        for name, fn in (("gather", gather_attention), ("online", online_attention))
    }
    keys = jnp.asarray(rng.standard_normal((batch, kv_heads, head_dim, length)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((batch, kv_heads, length, head_dim)), jnp.float32)
    mask = jnp.arange(length)[None, None, :] < ends[:, None, None]
    dense = jax.jit(lambda q, k, v, m: dot_product_attention(q, k, v, m, cache_layout=True))
    results["dense KVCache"] = _time(dense, q, keys, values, mask)
    for name, seconds in results.items():
        print(f"{name:>14}: {seconds * 1e6:8.1f} us per decode step (one layer)")


if __name__ == "__main__":
    main()
