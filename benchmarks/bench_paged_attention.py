"""One decode step's attention over a paged cache: gather into one block, a per-page
online softmax, and the pool read in place ("pool") (policyopt.models.paged), with the
dense KVCache's attention over the same slots per row for scale.

    python -m benchmarks.bench_paged_attention   # ~2 minutes on 2 CPU cores

Two geometries, moe_7m's heads (Hkv = 2, H = 4, Dh = 64), pages of 16 slots, every row's
pages scattered over the pool:
  * uniform: the sampler benchmark's main case, B = 64 rows of 80-160 tokens (max 160,
    10 pages), a pool of 640 pages;
  * long tail: bench_sampling's long-tailed mix late in its run, 26 of 64 rows holding
    33-544 tokens (max 544, 34 pages), the rest empty, a pool of 1,024 pages (the
    engine's budget of 256 slots per row).
"pool" runs over the whole pool in place and, where the engine would pick a smaller
bucket of held pages (``EngineConfig.held_page_bucket``), over the held pages only.
Times are the best of 5 rounds (wall and process CPU), per call of one layer.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from policyopt.models.attention import dot_product_attention
from policyopt.models.paged import gather_attention, online_attention, pool_attention


def _time(fn, *args, reps=10, rounds=5):
    jax.block_until_ready(fn(*args))
    walls, cpus = [], []
    for _ in range(rounds):
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        walls.append((time.perf_counter() - start) / reps)
        cpus.append((time.process_time() - cpu) / reps)
    return min(walls), min(cpus)


def case(name, lengths, num_pages, max_pages, heads=4, kv_heads=2, head_dim=64, page_size=16):
    rng = np.random.default_rng(0)
    batch = len(lengths)
    q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.float32)
    pool = lambda: jnp.asarray(
        rng.standard_normal((kv_heads, num_pages, page_size, head_dim)), jnp.float32
    )
    k_pages, v_pages = pool(), pool()
    order = rng.permutation(num_pages)
    table = np.full((batch, max_pages), num_pages, np.int32)
    used = 0
    for row, length in enumerate(lengths):
        pages = -(-length // page_size)
        table[row, :pages] = order[used : used + pages]
        used += pages
    table, ends = jnp.asarray(table), jnp.asarray(lengths, jnp.int32)
    slots = (ends - 1)[:, None]
    results = {
        "gather": _time(jax.jit(gather_attention), q, k_pages, v_pages, table, slots, ends),
        "online": _time(jax.jit(online_attention), q, k_pages, v_pages, table, slots, ends),
        "pool": _time(jax.jit(pool_attention), q, k_pages, v_pages, table, ends),
    }
    # "pool" over the held pages only, in the engine's bucket (EngineConfig.held_page_bucket
    # = 64: the smallest power-of-two multiple of 64 holding them; the engine takes it only
    # at half the pool or less, where it measures faster than the whole pool in place).
    bucket = 64
    while bucket < used:
        bucket *= 2
    if bucket < num_pages:
        held = jax.jit(lambda *a: pool_attention(*a, 0, bucket))
        results[f"pool, {bucket} held"] = _time(held, q, k_pages, v_pages, table, ends)
    length = max_pages * page_size
    keys = jnp.asarray(rng.standard_normal((batch, kv_heads, head_dim, length)), jnp.float32)
    values = jnp.asarray(rng.standard_normal((batch, kv_heads, length, head_dim)), jnp.float32)
    mask = jnp.arange(length)[None, None, :] < ends[:, None, None]
    dense = jax.jit(lambda q, k, v, m: dot_product_attention(q, k, v, m, cache_layout=True))
    results[f"dense KVCache, {length} slots"] = _time(dense, q, keys, values, mask)
    print(f"{name}: {batch} rows, {used} of {num_pages} pages held, max {max_pages} per row")
    for label, (wall, cpu) in results.items():
        print(f"  {label:>24}: {wall * 1e3:6.2f} ms, {cpu * 1e3:6.2f} ms CPU per call")


def main():
    rng = np.random.default_rng(1)
    case("uniform", rng.integers(80, 161, 64), num_pages=640, max_pages=10)
    tail = np.zeros(64, int)
    tail[:26] = rng.integers(33, 545, 26)
    case("long tail", tail, num_pages=1024, max_pages=34)


if __name__ == "__main__":
    main()
