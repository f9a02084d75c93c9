"""A paged KV cache: a pool of fixed-size pages, a page table per row, a free stack
(vLLM's PagedAttention, arXiv 2309.06180), so memory follows the tokens each row holds.

Pools ``[L, Hkv, NP, ps, Dh]`` (or per layer, ``[Hkv, NP, ps, Dh]``: the layout of JAX's TPU
paged-attention kernel); row ``r`` holds token ``s`` at ``page_table[r, s // ps]``, slot
``s % ps``; an entry equal to NP means "no page". Pages are allocated in-jit from a free
stack (``reserve`` / ``release``; a refused row waits, never truncated), a group's samples
share their prompt's full pages (``copy_rows``), and ``attend`` reads the pages by gather,
online softmax, the pool in place, or the Pallas kernel. ``shards`` splits the pool so that
each device allocates from and attends over its own pages. The layout, the attention paths
and their measured costs: docs/scale.md, "The paged KV cache".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from policyopt.models.config import ModelConfig

_MASK_VALUE = -1e30
ATTENTION = ("gather", "online", "pallas", "pool")


@struct.dataclass
class PagedKVCache:
    """Page pools, page tables and the free stack, a pytree.

    Attributes:
      k, v: [L, Hkv, NP, ps, Dh] key and value pools (keys rotated), or in the per-layer
        form tuples of L pools [Hkv, NP, ps, Dh].
      page_table: int32 [R, max_pages]; NP where a row has no page.
      lengths: int32 [R]; tokens each row holds.
      free: int32 [NP]; ``free[:num_free]`` are the free page ids (a stack, top last).
      num_free: int32 []; free pages.
      refs: int32 [NP]; table entries pointing at each page (> 1: a prompt's full pages
        shared by the rows of its group, ``copy_rows``).
      index: int32 []; advanced by ``Transformer`` after each call, unused here.
      attention: "gather", "online", "pallas" or "pool" (static; see the module
        docstring).
      shared_refs: static, table entries beyond each page's first (shared pages) that the
        "pool" attention takes per step of its loop over them (0: max_pages).
      shards: S (static), independent pools side by side (see "Shards" in the module
        docstring); with S > 1, num_free is int32 [S] and page ids are local to a shard.
    """

    k: jax.Array
    v: jax.Array
    page_table: jax.Array
    lengths: jax.Array
    free: jax.Array
    num_free: jax.Array
    refs: jax.Array
    index: jax.Array
    attention: str = struct.field(pytree_node=False, default="gather")
    shared_refs: int = struct.field(pytree_node=False, default=0)
    held_pages: int = struct.field(pytree_node=False, default=0)
    shards: int = struct.field(pytree_node=False, default=1)

    # Read by ``Attention`` to route a forward call here (``models.interface.Cache``).
    paged = True

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        rows: int,
        num_pages: int,
        page_size: int,
        max_pages: int,
        dtype=None,
        *,
        attention: str = "gather",
        shards: int = 1,
        shared_refs: int = 0,
        per_layer: bool = False,
    ) -> "PagedKVCache":
        """An empty cache: every page free, every row empty.

        Args:
          rows: R, rows decoded together (all shards; a multiple of ``shards``).
          num_pages: NP, pages in the pool (the memory budget: NP * ps tokens per layer;
            all shards, a multiple of ``shards``).
          page_size: ps, token slots per page.
          max_pages: pages one row may hold (its longest sequence / ps, rounded up).
          dtype: pool dtype (default: the model's compute dtype).
          attention: "gather", "online", "pallas" or "pool" ("pallas": bfloat16 pools
            only, see the module docstring).
          shards: S pools of NP / S pages for R / S rows each.
          shared_refs: "pool" attention's chunk of shared references (see the class).
          per_layer: the pools as tuples of L per-layer arrays (see the module docstring).
        """
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        for name, value in (
            ("rows", rows),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("max_pages", max_pages),
            ("shards", shards),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if shared_refs < 0:
            raise ValueError(f"shared_refs must be >= 0, got {shared_refs}")
        if rows % shards or num_pages % shards:
            raise ValueError(
                f"rows ({rows}) and num_pages ({num_pages}) must be multiples of shards ({shards})"
            )
        dtype = jnp.dtype(dtype) if dtype is not None else config.compute_dtype
        if attention == "pallas" and dtype != jnp.bfloat16:
            raise ValueError(
                f"attention='pallas' needs a bfloat16 pool, got {jnp.dtype(dtype).name}: JAX's "
                "TPU paged-attention kernel reads every K and V page as bfloat16, so a wider "
                "pool would decode at bfloat16 precision (log-probs ~1e-2 off per step); pass "
                "dtype=bfloat16 (a bfloat16 model's default) or use attention='pool'"
            )
        local = num_pages // shards
        shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
        if per_layer:
            pools = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        else:
            pools = lambda: jnp.zeros((config.num_layers,) + shape, dtype)
        num_free = jnp.full((shards,) if shards > 1 else (), local, jnp.int32)
        return cls(
            k=pools(),
            v=pools(),
            page_table=jnp.full((rows, max_pages), local, jnp.int32),
            lengths=jnp.zeros((rows,), jnp.int32),
            free=jnp.tile(jnp.arange(local, dtype=jnp.int32)[::-1], shards),
            num_free=num_free,
            refs=jnp.zeros((num_pages,), jnp.int32),
            index=jnp.zeros((), jnp.int32),
            attention=attention,
            shards=shards,
            shared_refs=shared_refs,
        )

    @property
    def per_layer(self) -> bool:
        """Pools held as tuples of per-layer arrays (read by a scanned ``Transformer``,
        which stacks them for its layer scan)."""
        return isinstance(self.k, tuple)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        """One layer's pool: (Hkv, NP, ps, Dh), NP counting every shard's pages."""
        return tuple(self.k[0].shape if self.per_layer else self.k.shape[1:])

    def unstack(self) -> "PagedKVCache":
        """The per-layer form (tuples of [Hkv, NP, ps, Dh] pools)."""
        if self.per_layer:
            return self
        return self.replace(k=tuple(self.k), v=tuple(self.v))

    def stack(self) -> "PagedKVCache":
        """The stacked form ([L, Hkv, NP, ps, Dh] pools)."""
        if not self.per_layer:
            return self
        return self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

    def map_pools(self, fn) -> "PagedKVCache":
        """``fn`` applied to every layer's key and value pool [Hkv, NP, ...] (either form;
        ``fn`` keeps the leading Hkv axis)."""
        if self.per_layer:
            return self.replace(k=tuple(map(fn, self.k)), v=tuple(map(fn, self.v)))
        return self.replace(k=jax.vmap(fn)(self.k), v=jax.vmap(fn)(self.v))

    def layer_pools(self, layer) -> tuple[jax.Array, jax.Array]:
        """Keys and values [Hkv, NP, ps, Dh] of ``layer`` (an int in the per-layer form)."""
        return self.k[layer], self.v[layer]

    @property
    def num_pages(self) -> int:
        """Pages of one shard's pool (all of them without shards): the "no page" id."""
        return self.pool_shape[1] // self.shards

    def pages_in_use(self) -> jax.Array:
        """int32 [] (or [S] with shards): pages held by some row, per shard."""
        return self.num_pages - self.num_free

    # ----------------------------------------------------------------------------------
    # Shards: each method runs on every shard's pool and rows (a vmap, no communication).
    # ----------------------------------------------------------------------------------

    def _per_shard(self, fn, *args):
        """``fn(cache, *args)`` on each shard: a cache of NP / S pages and R / S rows, each
        arg split on its leading axis into [S, ...]. Returns fn's cache joined back and its
        other results as [S, ...]."""
        s = self.shards
        # The pools' page axis (1 of a layer's pool, 2 of the stacked one) split into [S, ...].
        page_axis = 1 if self.per_layer else 2
        pool = lambda x: x.reshape(x.shape[:page_axis] + (s, -1) + x.shape[page_axis + 1 :])
        per_pool = lambda fn, x: tuple(map(fn, x)) if self.per_layer else fn(x)
        split = self.replace(
            k=per_pool(pool, self.k),
            v=per_pool(pool, self.v),
            page_table=self.page_table.reshape(s, -1, self.max_pages),
            lengths=self.lengths.reshape(s, -1),
            free=self.free.reshape(s, -1),
            refs=self.refs.reshape(s, -1),
            shards=1,
        )
        pool_axes = tuple(page_axis for _ in self.k) if self.per_layer else page_axis
        axes = split.replace(
            k=pool_axes,
            v=pool_axes,
            page_table=0,
            lengths=0,
            free=0,
            num_free=0,
            refs=0,
            index=None,
        )

        def run(cache, *shard_args):
            out = fn(cache, *shard_args)
            return (out, ()) if isinstance(out, PagedKVCache) else (out[0], tuple(out[1:]))

        cache, rest = jax.vmap(run, in_axes=(axes,) + (0,) * len(args), out_axes=(axes, 0))(
            split, *args
        )
        flat = lambda x: x.reshape((-1,) + x.shape[2:])
        join = lambda x: x.reshape(x.shape[:page_axis] + (-1,) + x.shape[page_axis + 2 :])
        joined = cache.replace(
            k=per_pool(join, cache.k),
            v=per_pool(join, cache.v),
            page_table=flat(cache.page_table),
            lengths=flat(cache.lengths),
            free=flat(cache.free),
            refs=flat(cache.refs),
            shards=s,
        )
        return joined, rest

    @property
    def page_size(self) -> int:
        return self.pool_shape[2]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    @property
    def max_length(self) -> int:
        return self.max_pages * self.page_size

    def pages_held(self) -> jax.Array:
        """int32 [R]: pages each row holds."""
        return jnp.sum(self.page_table < self.num_pages, axis=1).astype(jnp.int32)

    # ----------------------------------------------------------------------------------
    # Allocation.
    # ----------------------------------------------------------------------------------

    def reserve(
        self, new_tokens: jax.Array, max_new_pages: int | None = None
    ) -> tuple["PagedKVCache", jax.Array]:
        """Pages for ``new_tokens`` more tokens of each row, all or none per row.

        Row r needs ceil((len_r + n_r) / ps) - pages_r more pages. Asking rows are served
        in row order while the stack lasts: with c_r the inclusive cumsum of the needs,
        row r is granted iff c_r <= num_free (or it needs none), so the granted rows that
        need pages are a prefix of the asking ones, and pop their pages off the stack.
        A row whose sequence would pass ``max_pages`` pages is refused too.

        Args:
          new_tokens: int32 [R], tokens each row is about to write (0: asks nothing).
          max_new_pages: static bound on the pages one row may need now (1 for a decode
            step, whatever ``new_tokens`` <= page size); default ``max_pages``. Keeps the
            table update at R x max_new_pages entries.
        Returns:
          (cache, granted bool [R]); granted is True for rows that need no page.
        """
        if self.shards > 1:
            cache, (granted,) = self._per_shard(
                lambda c, n: c.reserve(n, max_new_pages), new_tokens.reshape(self.shards, -1)
            )
            return cache, granted.reshape(-1)
        ps, num_pages = self.page_size, self.num_pages
        held = self.pages_held()
        wanted = (self.lengths + new_tokens + ps - 1) // ps
        need = jnp.maximum(wanted - held, 0)
        fits = wanted <= self.max_pages
        asked = jnp.where(fits, need, 0)
        cum = jnp.cumsum(asked)
        granted = fits & ((need == 0) | (cum <= self.num_free))
        take = jnp.where(granted, need, 0)
        start = jnp.cumsum(take) - take  # exclusive, [R]
        total = jnp.sum(take)
        j = jnp.arange(max_new_pages or self.max_pages)[None, :]  # [1, max_new_pages]
        valid = j < take[:, None]
        stack_pos = self.num_free - 1 - (start[:, None] + j)  # popped from the top
        page = jnp.where(valid, self.free[jnp.clip(stack_pos, 0, num_pages - 1)], num_pages)
        column = jnp.where(valid, held[:, None] + j, self.max_pages)  # drop when invalid
        rows = jnp.broadcast_to(jnp.arange(self.page_table.shape[0])[:, None], column.shape)
        table = self.page_table.at[rows, column].set(page, mode="drop")
        refs = self.refs.at[page.reshape(-1)].set(1, mode="drop")
        return self.replace(page_table=table, num_free=self.num_free - total, refs=refs), granted

    def release(self, rows: jax.Array) -> "PagedKVCache":
        """Empties ``rows`` (bool [R]): each page they point at loses one reference, and the
        pages left with none go back on the stack (in page order)."""
        if self.shards > 1:
            return self._per_shard(lambda c, r: c.release(r), rows.reshape(self.shards, -1))[0]
        num_pages = self.num_pages
        held = (self.page_table < num_pages) & rows[:, None]
        dropped = jnp.where(held, self.page_table, num_pages).reshape(-1)
        refs = self.refs.at[dropped].add(-1, mode="drop")
        freed = (self.refs > 0) & (refs == 0)  # [NP]
        pos = jnp.where(freed, self.num_free + jnp.cumsum(freed) - freed, num_pages)
        free = self.free.at[pos].set(jnp.arange(num_pages, dtype=jnp.int32), mode="drop")
        table = jnp.where(rows[:, None], num_pages, self.page_table)
        return self.replace(
            page_table=table,
            free=free,
            refs=refs,
            num_free=self.num_free + jnp.sum(freed, dtype=jnp.int32),
            lengths=jnp.where(rows, 0, self.lengths),
        )

    def copy_rows(
        self, source: jax.Array, dest: jax.Array, num_pages: int
    ) -> tuple["PagedKVCache", jax.Array]:
        """Gives each row in ``dest`` row ``source``'s tokens (e.g. the G samples of one
        prefilled prompt). The rows must be empty.

        The source's full pages are shared (their references counted in ``refs``): no row
        ever writes below its length, so they are read-only. A last, partly filled page is
        copied into a page of each row's own, which it goes on filling.

        Args:
          source: int32 scalar row.
          dest: int32 [D] rows; entries >= R are skipped.
          num_pages: static bound on the pages ``source`` holds (e.g. ceil(P / ps)).
          With S > 1 shards: source [S] and dest [S, D], rows local to each shard (< R / S).
        Returns:
          (cache, granted bool [D]) ([S, D] with shards); a row not granted (no page for
          the partial page) stays empty.
        """
        if self.shards > 1:
            cache, (copied,) = self._per_shard(
                lambda c, src, dst: c.copy_rows(src, dst, num_pages), source, dest
            )
            return cache, copied
        rows, ps = self.lengths.shape[0], self.page_size
        length = self.lengths[source]
        full = length // ps
        inside = dest < rows
        safe_dest = jnp.minimum(dest, rows - 1)
        source_pages = self.page_table[source, :num_pages]  # [n]
        shared = inside[:, None] & (jnp.arange(num_pages)[None, :] < full)  # [D, n]
        column = jnp.where(shared, jnp.arange(num_pages)[None, :], self.max_pages)
        table = self.page_table.at[safe_dest[:, None], column].set(
            jnp.broadcast_to(source_pages[None], shared.shape), mode="drop"
        )
        refs = self.refs.at[jnp.where(shared, source_pages[None], self.num_pages).reshape(-1)].add(
            1, mode="drop"
        )
        lengths = self.lengths.at[jnp.where(inside, dest, rows)].set(full * ps, mode="drop")
        cache = self.replace(page_table=table, refs=refs, lengths=lengths)
        asks = jnp.zeros((rows,), jnp.int32).at[dest].set(length - full * ps, mode="drop")
        cache, granted = cache.reserve(asks, 1)
        copy = inside & granted[safe_dest]  # [D]
        refused = jnp.zeros((rows,), bool).at[dest].set(inside & ~copy, mode="drop")
        cache = cache.release(refused)
        # The partial page: source's page at column `full` into each row's own.
        partial = copy & (length > full * ps)
        src = jnp.where(partial, self.page_table[source, jnp.minimum(full, self.max_pages - 1)], 0)
        dst = jnp.where(
            partial,
            cache.page_table[safe_dest, jnp.minimum(full, self.max_pages - 1)],
            self.num_pages,
        )

        def move(pool):  # one layer's [Hkv, NP, ps, Dh]
            return _write(pool, (slice(None), dst), jnp.take(pool, src, axis=1, mode="clip"))

        lengths = cache.lengths.at[jnp.where(copy, dest, rows)].set(length, mode="drop")
        return cache.map_pools(move).replace(lengths=lengths), copy

    def advance(self, token_mask: jax.Array) -> "PagedKVCache":
        """Lengths after a forward call whose real tokens were ``token_mask`` [R, T]."""
        return self.replace(lengths=self.lengths + jnp.sum(token_mask, axis=1, dtype=jnp.int32))

    # ----------------------------------------------------------------------------------
    # Attention.
    # ----------------------------------------------------------------------------------

    def attend(self, layer, q, k, v, token_mask) -> tuple[jax.Array, "PagedKVCache"]:
        """Writes this call's keys and values of ``layer`` and attends over the row's pages.

        Query t of row r sits at slot p = lengths[r] + t and sees slots s <= p with
        s < lengths[r] + n_r (n_r real tokens in this call).

        Args:
          layer: int, or a traced int32 scalar with stacked pools.
          q: [B, T, H, Dh] rotated queries; k, v: [B, T, Hkv, Dh] (k rotated).
          token_mask: bool [B, T], a prefix of real tokens per row.
        Returns:
          (out [B, T, H, Dh] in the pool's dtype, cache with this layer written).
        """
        if self.shards > 1:
            split = lambda x: x.reshape((self.shards, -1) + x.shape[1:])
            cache, (out,) = self._per_shard(
                lambda c, *a: c.attend(layer, *a)[::-1],
                split(q),
                split(k),
                split(v),
                split(token_mask),
            )
            return out.reshape(q.shape[:1] + out.shape[2:]), cache
        b, t, h, dh = q.shape
        ps, num_pages = self.page_size, self.num_pages
        slots = self.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
        column = slots // ps
        page = jnp.take_along_axis(self.page_table, jnp.minimum(column, self.max_pages - 1), axis=1)
        page = jnp.where(token_mask & (column < self.max_pages), page, num_pages)
        offset = slots % ps
        if self.per_layer:
            # Adjacent advanced indices (page, offset) after Hkv: [Hkv, B, T, Dh].
            put = lambda pools, x: (
                pools[:layer]
                + (_write(pools[layer], (slice(None), page, offset), jnp.moveaxis(x, 2, 0)),)
                + pools[layer + 1 :]
            )
        else:
            # Advanced indices (layer, page, offset) around a slice: the result's leading
            # axes are [B, T], then Hkv, Dh: the projections' layout.
            put = lambda pools, x: _write(pools, (layer, slice(None), page, offset), x)
        cache = self.replace(k=put(self.k, k), v=put(self.v, v))
        pool_k, pool_v = cache.layer_pools(layer)
        ends = self.lengths + jnp.sum(token_mask, axis=1, dtype=jnp.int32)  # [B]
        if self.attention == "pallas" and t == 1:
            out = _pallas_decode(
                q[:, 0],
                pool_k,
                pool_v,
                ends,
                jnp.minimum(self.page_table, num_pages - 1),
            )
            return out[:, None].astype(pool_v.dtype), cache
        if self.attention == "pool" and t == 1:
            out = pool_attention(
                q, pool_k, pool_v, self.page_table, ends, self.shared_refs, self.held_pages
            )
            return out, cache
        attend = online_attention if self.attention == "online" else gather_attention
        return attend(q, pool_k, pool_v, self.page_table, slots, ends), cache


def _write(pool, index, values):
    """``pool.at[index].set(values)`` (out-of-range pages dropped). A 16-bit float pool is
    written through its bits (uint16): XLA:CPU has no bfloat16 scatter and would convert
    the whole pool to float32 and back at every write (seen in the compiled decode)."""
    values = values.astype(pool.dtype)
    if pool.dtype.itemsize != 2 or not jnp.issubdtype(pool.dtype, jnp.floating):
        return pool.at[index].set(values, mode="drop")
    bits = jax.lax.bitcast_convert_type(pool, jnp.uint16)
    bits = bits.at[index].set(jax.lax.bitcast_convert_type(values, jnp.uint16), mode="drop")
    return jax.lax.bitcast_convert_type(bits, pool.dtype)


def _gather_pages(pool, table):
    """pool [Hkv, NP, ps, Dh] at pages ``table`` [...] -> [Hkv, ..., ps, Dh].

    A ``take`` in "clip" mode: plain indexing gathers in "fill" mode, whose bounds checks
    made XLA:CPU's gather 3x slower (benchmarks/bench_paged_attention.py).
    """
    flat = jnp.take(pool, table.reshape(-1), axis=1, mode="clip")
    return flat.reshape(pool.shape[:1] + table.shape + pool.shape[2:])


def gather_attention(q, k_pages, v_pages, page_table, query_slots, ends):
    """softmax(q k^T / sqrt(Dh) + mask) v over each row's pages, gathered into one block.

    Key slot s of row r is seen by query t iff s <= query_slots[r, t] and s < ends[r].

    Args:
      q: [B, T, H, Dh]; k_pages, v_pages: [Hkv, NP, ps, Dh] (one layer's pools);
      page_table: int32 [B, max_pages] (entries >= NP: no page, masked by ``ends``);
      query_slots: int32 [B, T]; ends: int32 [B].
    Returns:
      [B, T, H, Dh] in v_pages' dtype.
    """
    b, t, h, dh = q.shape
    hkv, num_pages, ps, _ = k_pages.shape
    g = h // hkv
    table = jnp.minimum(page_table, num_pages - 1)
    length = table.shape[1] * ps
    keys = _gather_pages(k_pages, table).reshape(hkv, b, length, dh)  # [Hkv, B, S, Dh]
    values = _gather_pages(v_pages, table).reshape(hkv, b, length, dh)
    rows = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dh)
    scores = jnp.einsum(
        "bkqd,kbsd->bkqs", rows.astype(keys.dtype), keys, preferred_element_type=jnp.float32
    ) * (dh**-0.5)
    key_slots = jnp.arange(length)
    mask = (key_slots[None, None, :] <= query_slots[:, :, None]) & (
        key_slots[None, None, :] < ends[:, None, None]
    )  # [B, T, S]
    scores = jnp.where(mask[:, None, :, None, :], scores.reshape(b, hkv, t, g, length), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype).reshape(b, hkv, t * g, length)
    out = jnp.einsum("bkqs,kbsd->bkqd", probs, values)
    return out.reshape(b, hkv, t, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, t, h, dh)


def online_attention(q, k_pages, v_pages, page_table, query_slots, ends):
    """The same attention as ``gather_attention``, one page at a time with an online
    softmax (Milakov & Gimelshein 2018): m' = max(m, max_s z_s), l' = l e^(m - m') +
    sum_s e^(z_s - m'), o' = o e^(m - m') + sum_s e^(z_s - m') v_s; out = o / l.

    Kept as the measured alternative (``benchmarks/bench_paged_attention.py``). Same
    arguments and result as ``gather_attention``.
    """
    b, t, h, dh = q.shape
    hkv, num_pages, ps, _ = k_pages.shape
    g = h // hkv
    table = jnp.minimum(page_table, num_pages - 1)
    rows = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, dh)
    rows = rows.astype(k_pages.dtype)
    query = jnp.repeat(query_slots, g, axis=1)[:, None, :]  # [B, 1, T*G]

    def step(carry, column):
        m, l, o = carry
        keys = _gather_pages(k_pages, table[:, column])  # [Hkv, B, ps, Dh]
        values = _gather_pages(v_pages, table[:, column])
        z = jnp.einsum("bkqd,kbsd->bkqs", rows, keys, preferred_element_type=jnp.float32) * (
            dh**-0.5
        )
        slot = column * ps + jnp.arange(ps)
        seen = (slot <= query[..., None]) & (slot < ends[:, None, None, None])
        z = jnp.where(seen, z, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        scale = jnp.exp(m - safe)
        p = jnp.exp(z - safe[..., None])
        l = l * scale + jnp.sum(p, axis=-1)
        o = o * scale[..., None] + jnp.einsum(
            "bkqs,kbsd->bkqd", p.astype(values.dtype), values, preferred_element_type=jnp.float32
        )
        return (m_new, l, o), None

    init = (
        jnp.full((b, hkv, t * g), -jnp.inf, jnp.float32),
        jnp.zeros((b, hkv, t * g), jnp.float32),
        jnp.zeros((b, hkv, t * g, dh), jnp.float32),
    )
    (m, l, o), _ = jax.lax.scan(step, init, jnp.arange(table.shape[1]))
    out = (o / jnp.maximum(l, 1e-30)[..., None]).astype(v_pages.dtype)
    return out.reshape(b, hkv, t, g, dh).transpose(0, 2, 1, 3, 4).reshape(b, t, h, dh)


def pool_attention(q, k_pages, v_pages, page_table, ends, shared_refs=0, held_pages=0):
    """One-token attention read from the pool in place: each page against the query of
    the row that holds it, so the work follows the pool's pages, not rows x max_pages.

    Each held page p has a first reference (row r_p, column c_p: the smallest
    r * max_pages + c pointing at it). Its scores z[p, h, s] = q[r_p, h] . k[p, s] /
    sqrt(Dh), seen iff c_p ps + s < ends[r_p], are one batched product over the pool, with
    no key gather. Each row's softmax is taken over its segment of references: a segment
    max m_r = max over the row's pages of max_s z, then e = exp(z - m_r), and segment sums
    l_r = sum e, o_r = sum e v; out_r = o_r / l_r. With ``held_pages`` = K < NP, the pages
    held (those with a first reference) are listed in page order, K at a time, and only
    they are gathered and scored: the work follows the pages held, not the pool. The
    other references (a prompt's full pages shared by the rows of its group,
    ``copy_rows``) are listed in table order and taken ``shared_refs`` at a time (their
    pages gathered). Of each list, the first chunk is taken when it holds a reference,
    the others (an overflow of the bound) in a ``lax.while_loop`` that runs only then,
    each chunk's (m, l, o) merged into the rows' as an online softmax does:
    m' = max(m, m_c), l' = l e^(m - m') + l_c e^(m_c - m'), o' = o e^(m - m') +
    o_c e^(m_c - m'). No reference is ever dropped, whatever the bounds.

    Args:
      q: [B, 1, H, Dh]; k_pages, v_pages: [Hkv, NP, ps, Dh] (one layer's pools);
      page_table: int32 [B, max_pages] (entries >= NP: no page); ends: int32 [B], the
        keys of row r are its slots s < ends[r].
      shared_refs: static, references beyond each page's first taken per chunk (0: one
        row's worth, max_pages); ``policyopt.engine`` passes its exact bound, so the
        overflow loop never runs there.
      held_pages: static, held pages taken per chunk (0 or >= NP: the whole pool in
        place, no gather); ``policyopt.engine`` passes a bucket at least the pages its
        decode call can hold, so the overflow loop never runs there.
    Returns:
      [B, 1, H, Dh] in v_pages' dtype; a row with no key gets zeros.
    """
    b, _, h, dh = q.shape
    hkv, num_pages, ps, _ = k_pages.shape
    max_pages = page_table.shape[1]
    queries = q.reshape(b, hkv, h // hkv, dh).transpose(1, 0, 2, 3)  # [Hkv, B, G, Dh]
    row_ends = jnp.concatenate([ends, jnp.zeros((1,), ends.dtype)])  # row B: no keys
    held = page_table < num_pages
    page = jnp.where(held, page_table, num_pages).reshape(-1)  # [B * max_pages]
    ref = jnp.arange(b * max_pages, dtype=jnp.int32)  # r * max_pages + c
    first = jnp.full((num_pages,), b * max_pages, jnp.int32).at[page].min(ref, mode="drop")

    def gathered(refs, at):  # softmax statistics over references refs, their pages at
        return _segment_partial(
            queries,
            refs // max_pages,
            refs % max_pages,
            _gather_pages(k_pages, at),
            _gather_pages(v_pages, at),
            row_ends,
        )

    if 0 < held_pages < num_pages:
        # The held pages in page order, then padding (page NP: no first reference, row B).
        owned = first < b * max_pages
        pages_listed = _listed(owned, jnp.arange(num_pages, dtype=jnp.int32), held_pages, num_pages)
        firsts = jnp.concatenate([first, jnp.full((1,), b * max_pages, jnp.int32)])

        def held_chunk(i):
            at = jax.lax.dynamic_slice(pages_listed, (i * held_pages,), (held_pages,))
            return gathered(firsts[at], jnp.minimum(at, num_pages - 1))

        stats = _chunks(held_chunk, jnp.sum(owned, dtype=jnp.int32), held_pages, None)
    else:
        stats = _segment_partial(
            queries, first // max_pages, first % max_pages, k_pages, v_pages, row_ends
        )
    # References beyond their page's first, compacted to the front in table order.
    other = held.reshape(-1) & (first[jnp.minimum(page, num_pages - 1)] != ref)
    count = jnp.sum(other, dtype=jnp.int32)
    chunk = shared_refs or max_pages
    refs_listed = _listed(other, ref, chunk, b * max_pages)
    pages = jnp.concatenate([page, jnp.full((1,), num_pages, jnp.int32)])

    def shared_chunk(i):
        refs = jax.lax.dynamic_slice(refs_listed, (i * chunk,), (chunk,))
        return gathered(refs, jnp.minimum(pages[refs], num_pages - 1))

    m, l, o = _chunks(shared_chunk, count, chunk, stats)
    out = o[:, :b] / jnp.where(l[:, :b] > 0, l[:, :b], 1.0)[..., None]
    return out.transpose(1, 0, 2, 3).reshape(b, 1, h, dh).astype(v_pages.dtype)


def _listed(mask, values, chunk, fill):
    """``values`` where ``mask`` holds, compacted to the front in order and padded with
    ``fill`` to a multiple of ``chunk``: [ceil(len / chunk) * chunk]."""
    size = -(-mask.shape[0] // chunk) * chunk
    slot = jnp.where(mask, jnp.cumsum(mask) - 1, size)
    return jnp.full((size,), fill, values.dtype).at[slot].set(values, mode="drop")


def _chunks(chunk_stats, count, chunk, stats):
    """``stats`` merged with ``chunk_stats(i)`` for every chunk i of a list of ``count``
    references, ``chunk`` a chunk (stats None: the first chunk's own, always taken).

    The first chunk under a cond (taken iff count > 0), the rest (overflow) in a loop under
    another: XLA:CPU copies the layer's pools into a while loop's operands whether or not
    it runs (17 ms of a 64-row decode step, benchmarks/HISTORY.md, 2026-12-02), and into a
    cond's only when taken."""
    zero = jnp.zeros((), jnp.int32)
    if stats is None:
        stats = chunk_stats(zero)
    else:
        stats = jax.lax.cond(count > 0, lambda s: _merge(s, chunk_stats(zero)), lambda s: s, stats)

    def body(carry):
        i, stats = carry
        return i + 1, _merge(stats, chunk_stats(i))

    rest = lambda stats: jax.lax.while_loop(
        lambda carry: carry[0] * chunk < count, body, (zero + 1, stats)
    )[1]
    return jax.lax.cond(count > chunk, rest, lambda s: s, stats)


def _segment_partial(queries, rows, columns, keys, values, row_ends):
    """Softmax statistics of each row over the references (rows [M], columns [M]) whose
    pages are keys, values [Hkv, M, ps, Dh]; queries [Hkv, B, G, Dh]; a row >= B (row_ends
    [B + 1] gives it no key) marks an unused reference. Returns (m [Hkv, B + 1, G], l of
    the same shape, o [Hkv, B + 1, G, Dh]): max score, sum of e^(z - m), sum of
    e^(z - m) v (m = 0 for a row with no key)."""
    hkv, b, g, dh = queries.shape
    ps = keys.shape[2]
    mine = jnp.take(queries, rows, axis=1, mode="clip").astype(keys.dtype)  # [Hkv, M, G, Dh]
    z = jnp.einsum("kmgd,kmsd->kmgs", mine, keys, preferred_element_type=jnp.float32)
    seen = columns[:, None] * ps + jnp.arange(ps)[None, :] < row_ends[rows][:, None]
    z = jnp.where(seen[None, :, None, :], z * (dh**-0.5), -jnp.inf)  # [Hkv, M, G, ps]
    m = jnp.full((hkv, b + 1, g), -jnp.inf, jnp.float32).at[:, rows].max(jnp.max(z, axis=-1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(z - jnp.take(m, rows, axis=1)[..., None])
    l = jnp.zeros((hkv, b + 1, g), jnp.float32).at[:, rows].add(jnp.sum(e, axis=-1))
    weighted = jnp.einsum(
        "kmgs,kmsd->kmgd", e.astype(values.dtype), values, preferred_element_type=jnp.float32
    )
    o = jnp.zeros((hkv, b + 1, g, dh), jnp.float32).at[:, rows].add(weighted)
    return m, l, o


def _merge(a, b):
    """Two rows' partial softmax statistics (m, l, o) merged into one. A side with no key
    (l = 0, m = 0 by ``_segment_partial``) weighs nothing: its m is taken as -inf, so a row
    whose scores are all far below 0 does not underflow against it."""
    (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
    m_a, m_b = jnp.where(l_a > 0, m_a, -jnp.inf), jnp.where(l_b > 0, m_b, -jnp.inf)
    m = jnp.maximum(m_a, m_b)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    scale_a, scale_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
    return m, l_a * scale_a + l_b * scale_b, o_a * scale_a[..., None] + o_b * scale_b[..., None]


def _pallas_decode(q, k_pages, v_pages, lengths, page_indices):
    """One-token paged attention by JAX's TPU kernel: q [B, H, Dh] -> [B, H, Dh].

    The kernel applies no 1/sqrt(Dh): q is scaled here. ``pages_per_compute_block`` is the
    largest divisor of max_pages up to 8 (the kernel needs one that divides it).
    """
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    max_pages = page_indices.shape[1]
    block = max(d for d in range(1, min(8, max_pages) + 1) if max_pages % d == 0)
    scaled = (q.astype(jnp.float32) * (q.shape[-1] ** -0.5)).astype(k_pages.dtype)
    return paged_attention(
        scaled,
        k_pages,
        v_pages,
        lengths.astype(jnp.int32),
        page_indices.astype(jnp.int32),
        pages_per_compute_block=block,
    )


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens: ceil(tokens / page_size)."""
    return math.ceil(tokens / page_size)
