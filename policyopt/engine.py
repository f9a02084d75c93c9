"""Continuous batching on a paged KV cache: a bounded number of rows per shard, refilled a
group of G samples at a time within a KV memory budget, one shard per device along the
mesh's row axes. Greedy outputs equal ``policyopt.sampling.generate``'s; a sampled token's
key depends on its prompt, sample and index only (docs/scale.md, "Generation engine").

Device side: the state of every row (``empty_state``), prefill of admitted prompts
(``admit_rows``), a jitted loop of ``sampling.decode_step`` (``decode_steps``) and eviction
(``evict_rows``). Host side: ``policyopt.scheduler.Scheduler``; ``ContinuousBatch`` holds
both, for ``Engine.generate`` and the asynchronous ``rl.rollouts.async_generation.EngineSlots``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.sharding import PartitionSpec

from policyopt import sharding
from policyopt.models.interface import PolicyModel
from policyopt.models.paged import ATTENTION, PagedKVCache, pages_for
from policyopt.sampling import Rollout, SamplingConfig, decode_step, next_logits
from policyopt.scheduler import Admission, Request, Scheduler, group_pages


class GenerationStopped(Exception):
    """``Engine.generate`` (or the asynchronous generator) stopped at the caller's request
    (``should_stop``) before the rollout was complete; nothing of it is returned."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's memory budget and batching (hashable: part of the jit cache key)."""

    # KV token slots in each shard's page pool (each holds every layer's key and value of
    # one token): the memory budget per device on the mesh's row axes,
    # kv_tokens * L * 2 * Hkv * Dh * bytes. Rounded down to pages.
    kv_tokens: int
    # Rows each shard decodes together; a multiple of SamplingConfig.num_samples (whole
    # groups).
    rows: int
    # Token slots per page.
    page_size: int = 16
    # Attention over pages: "gather", "online", "pallas" or "pool" (policyopt.models.paged).
    # "pool" (default): decode steps score the pages held against their rows' queries,
    # prefill gathers; on moe_7m it ties the gather in the uniform case (3.85 s against
    # 3.93) and beats it on the long-tailed mix (22.9 s against 34.3; benchmarks/
    # RESULTS.md "The engine on a long tail"), at the cost of compiling up to one decode
    # program per bucket of held pages (held_page_bucket). "pallas" on TPUs, bfloat16 pools
    # only (JAX's kernel reads pages as bfloat16).
    attention: str = "pool"
    # Decode steps per jitted call between the host's hand-outs and admissions.
    steps_per_call: int = 16
    # Prompts each shard prefills together in one admission call (one compiled shape,
    # [S, A, P] with A = min(admit_prompts, rows / G); places left over are padding).
    # Admitting one prompt per call cost ~41 ms CPU each for moe_7m (benchmarks/HISTORY.md
    # "2026-12-02: paged decode attention").
    admit_prompts: int = 8
    # Decode over a compacted batch of the running rows (``decode_steps``' bucket): per
    # shard, the smallest power of two, at least this, that holds every shard's running
    # rows (at most log2(rows / this) + 2 compiled decode programs); 0: every row always.
    decode_bucket: int = 8
    # "pool" attention over the held pages only: each decode call gathers and scores a
    # list of the pages held, padded to the smallest power-of-two multiple of this that
    # holds every page the call can hold (per shard: pages in use + running rows x
    # ceil(steps_per_call / page_size)); the whole pool in place once that is more than
    # half the pool (at most log2(pages / this) variants per row bucket); 0: always the
    # whole pool.
    held_page_bucket: int = 64
    # Record the experts every prompt and response token was routed to (MoE models; R3,
    # arXiv 2510.11370): [L_moe, R, P + N, k] int32 held on the device during the call.
    capture_routing: bool = True

    def __post_init__(self):
        for name in ("kv_tokens", "rows", "page_size", "steps_per_call", "admit_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("decode_bucket", "held_page_bucket"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.attention not in ATTENTION:
            raise ValueError(
                f"EngineConfig.attention must be one of {ATTENTION}, got {self.attention!r}"
            )

    @property
    def num_pages(self) -> int:
        return self.kv_tokens // self.page_size


@struct.dataclass
class _State:
    """Every row's decode state (a pytree carried by the decode loop)."""

    cache: PagedKVCache
    logits: jax.Array  # float32 [R, V]; next-token logits
    active: jax.Array  # bool [R]; admitted and not ended
    count: jax.Array  # int32 [R]; tokens generated
    prompt_lengths: jax.Array  # int32 [R]
    prompt_ids: jax.Array  # int32 [R]; prompt index b of the row's group
    sample_ids: jax.Array  # int32 [R]; sample j < G within the group
    tokens: jax.Array  # int32 [R, N]
    log_probs: jax.Array  # float32 [R, N]
    raw_log_probs: jax.Array  # float32 [R, N]
    routing: jax.Array | None  # int32 [L_moe, R, P + N, k], Rollout.sequences() layout
    recent: jax.Array | None  # int32 [R, M]; last M tokens, for stop sequences


def empty_state(
    mc, engine: EngineConfig, config: SamplingConfig, prompt_len: int, shards: int = 1
) -> _State:
    """The empty state of ``shards`` x ``engine.rows`` rows (``mc``: the ModelConfig)."""
    rows, num_new = engine.rows * shards, config.max_new_tokens
    group = config.num_samples
    # Shared references: each row but a group's first points at its prompt's full pages.
    shared = -(-engine.rows * (group - 1) // group) * (prompt_len // engine.page_size)
    cache = PagedKVCache.create(
        mc,
        rows,
        engine.num_pages * shards,
        engine.page_size,
        pages_for(prompt_len + num_new, engine.page_size),
        config.cache_dtype,
        attention=engine.attention,
        shards=shards,
        shared_refs=shared,
        # One pool per layer for an unrolled model: each layer's attention reads its own
        # buffers (see policyopt.models.paged); a scanned model carries the stacked pools.
        per_layer=not mc.scan_layers,
    )
    routing = None
    if mc.is_moe and engine.capture_routing:
        k = mc.num_experts_per_tok
        routing = jnp.broadcast_to(
            jnp.arange(k, dtype=jnp.int32), (mc.num_moe_layers, rows, prompt_len + num_new, k)
        )
    window = config.stop_window
    return _State(
        cache=cache,
        logits=jnp.zeros((rows, mc.vocab_size), jnp.float32),
        active=jnp.zeros((rows,), bool),
        count=jnp.zeros((rows,), jnp.int32),
        prompt_lengths=jnp.zeros((rows,), jnp.int32),
        prompt_ids=jnp.zeros((rows,), jnp.int32),
        sample_ids=jnp.zeros((rows,), jnp.int32),
        tokens=jnp.full((rows, num_new), config.fill_id, jnp.int32),
        log_probs=jnp.zeros((rows, num_new), jnp.float32),
        raw_log_probs=jnp.zeros((rows, num_new), jnp.float32),
        routing=routing,
        recent=jnp.full((rows, window), -1, jnp.int32) if window else None,
    )


def state_specs(s: _State, mesh) -> _State:
    """Where each field lives on ``mesh``: rows (and each shard's pages of the pools) split
    over the row axes (``policyopt.sharding.row_spec``, logical ``batch``), the routing
    along its row axis 1, the cache's write index replicated."""
    rows = lambda x, axis=0: sharding.row_spec(x.shape, mesh, axis)
    specs = jax.tree.map(rows, s)
    cache = s.cache
    pool = sharding.logical_spec(cache.pool_shape, (None, "batch", None, None), mesh)
    if not cache.per_layer:
        pool = PartitionSpec(None, *pool)
    pools = tuple(pool for _ in cache.k) if cache.per_layer else pool
    specs = specs.replace(
        cache=specs.cache.replace(
            k=pools,
            v=pools,
            index=PartitionSpec(),
            num_free=rows(cache.num_free) if cache.num_free.ndim else PartitionSpec(),
        )
    )
    if s.routing is not None:
        specs = specs.replace(routing=rows(s.routing, 1))
    return specs


def _pin(s: _State) -> _State:
    """The new state of a jitted call constrained (under a mesh) to ``state_specs``."""
    return sharding.constrain_tree(s, lambda mesh: state_specs(s, mesh))


@partial(jax.jit, static_argnums=(0,), static_argnames=("config",), donate_argnums=(2,))
def admit_rows(
    graphdef,
    params,
    s: _State,
    prompts,
    lengths,
    row0,
    num_rows,
    first_sample,
    prompt_index,
    *,
    config: SamplingConfig,
) -> _State:
    """Admits up to A prompts per shard in one prefill: prompts[i, a] [P] (lengths[i, a]
    real tokens) into row row0[i, a] of shard i, copied to rows [row0[i, a], row0[i, a] +
    num_rows[i, a]) (samples first_sample[i, a], first_sample[i, a] + 1, ...);
    num_rows[i, a] = 0 admits nothing in that place. All arguments after ``s`` are [S, A]
    (prompts [S, A, P]), or [S] (prompts [S, P]) for one prompt per shard; rows are global
    row indices, and the admissions of a shard hold disjoint, empty rows.

    The S x A prompts are one ``[S A, P]`` forward pass; each shard's admissions take
    their pages in order (a prompt's own pages, then its rows' copies of the partial
    last page, ``PagedKVCache.copy_rows``)."""
    if prompts.ndim == 2:  # one prompt per shard
        prompts = prompts[:, None]
        lengths, row0, num_rows, first_sample, prompt_index = (
            x[:, None] for x in (lengths, row0, num_rows, first_sample, prompt_index)
        )
    model: PolicyModel = nnx.merge(graphdef, params)
    cache = s.cache
    shards, num_total = cache.shards, cache.lengths.shape[0]
    per_shard = num_total // shards
    width, prompt_len = prompts.shape[1:]
    ps, group = cache.page_size, config.num_samples
    flat = lambda x: x.reshape((shards * width,) + x.shape[2:])  # [S, A, ...] -> [S A, ...]
    pick = jnp.arange(shards)[:, None]
    used = num_rows > 0  # [S, A]
    # Local first rows; an unused place reads nothing and writes nowhere (row R / S).
    local0 = jnp.where(used, row0 - pick * per_shard, per_shard)
    safe0 = jnp.minimum(local0, per_shard - 1)
    table = cache.page_table.reshape(shards, per_shard, -1)
    held = cache.lengths.reshape(shards, per_shard)
    # The admissions' first rows, shard-major: a cache of S A rows whose shard i holds
    # rows i A .. i A + A - 1 (the forward's attention splits its rows over the shards).
    view = cache.replace(
        page_table=flat(jnp.where(used[..., None], table[pick, safe0], cache.num_pages)),
        lengths=flat(jnp.where(used, held[pick, safe0], 0)),
    )
    mask = (jnp.arange(prompt_len) < lengths[..., None]) & (num_rows > 0)[..., None]
    mask = flat(mask)  # [S A, P]
    view, _ = view.reserve(jnp.sum(mask, axis=1, dtype=jnp.int32), pages_for(prompt_len, ps))
    out = model(
        flat(prompts),
        positions=jnp.broadcast_to(jnp.arange(prompt_len), mask.shape),
        attention_mask=mask,
        cache=view,
        return_logits=False,
    )
    view = out.cache.advance(mask)
    split = lambda x: x.reshape((shards, width) + x.shape[1:])
    cache = view.replace(
        page_table=table.at[pick, local0]
        .set(split(view.page_table), mode="drop")
        .reshape(cache.page_table.shape),
        lengths=held.at[pick, local0].set(split(view.lengths), mode="drop").reshape(-1),
    )
    sample = jnp.arange(group)
    dest = jnp.where(
        (sample >= 1) & (sample < num_rows[..., None]), safe0[..., None] + sample, per_shard
    )  # [S, A, G]
    for a in range(width if group > 1 else 0):  # each admission's copies in turn (unrolled)
        if shards == 1:
            cache, _ = cache.copy_rows(safe0[0, a], dest[0, a], pages_for(prompt_len, ps))
        else:
            cache, _ = cache.copy_rows(safe0[:, a], dest[:, a], pages_for(prompt_len, ps))
    # Each row's admission (a flat index s A + a) if it is in one.
    rows = jnp.arange(num_total)
    start = jnp.repeat(row0, per_shard, axis=0)  # [R, A]
    inside = (rows[:, None] >= start) & (rows[:, None] < start + jnp.repeat(num_rows, per_shard, 0))
    group_rows = jnp.any(inside, axis=1)  # [R]
    which = (rows // per_shard) * width + jnp.argmax(inside, axis=1)  # [R]
    per_row = lambda x, axis=0: jnp.take(x, which, axis=axis)  # [S A, ...] -> [R, ...]
    lengths, first_sample, prompt_index = map(flat, (lengths, first_sample, prompt_index))
    last = jnp.take_along_axis(out.hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    logits = per_row(next_logits(model, last[:, 0]))  # [R, V]
    col = lambda x, axis=0: group_rows.reshape((1,) * axis + (-1,) + (1,) * (x.ndim - axis - 1))
    routing = s.routing
    if routing is not None:
        # The prompt's experts right-aligned (index P - length + j holds prompt token j, as
        # Rollout.sequences() lays tokens out), then k distinct experts on every response
        # slot until its token is generated.
        source = (jnp.arange(prompt_len)[None] - (prompt_len - lengths)[:, None]) % prompt_len
        prompt_routing = jnp.take_along_axis(
            out.routing.astype(jnp.int32), source[None, :, :, None], axis=2
        )  # [L, S A, P, k]
        k = routing.shape[-1]
        filler = jnp.broadcast_to(
            jnp.arange(k, dtype=jnp.int32),
            prompt_routing.shape[:2] + (routing.shape[2] - prompt_len, k),
        )
        new = per_row(jnp.concatenate([prompt_routing, filler], axis=2), axis=1)
        routing = jnp.where(col(routing, 1), new, routing)
    recent = s.recent
    if recent is not None:
        recent = jnp.where(col(recent), -1, recent)
    first_row = jnp.take_along_axis(start, jnp.argmax(inside, axis=1)[:, None], axis=1)[:, 0]
    return _pin(
        s.replace(
            cache=cache,
            logits=jnp.where(col(s.logits), logits, s.logits),
            active=s.active | group_rows,
            count=jnp.where(group_rows, 0, s.count),
            prompt_lengths=jnp.where(group_rows, per_row(lengths), s.prompt_lengths),
            prompt_ids=jnp.where(group_rows, per_row(prompt_index), s.prompt_ids),
            sample_ids=jnp.where(
                group_rows, per_row(first_sample) + rows - first_row, s.sample_ids
            ),
            tokens=jnp.where(col(s.tokens), config.fill_id, s.tokens),
            log_probs=jnp.where(col(s.log_probs), 0.0, s.log_probs),
            raw_log_probs=jnp.where(col(s.raw_log_probs), 0.0, s.raw_log_probs),
            routing=routing,
            recent=recent,
        )
    )


@partial(jax.jit, donate_argnums=(0,))
def evict_rows(s: _State, rows) -> _State:
    """Returns the pages of ``rows`` (bool [R]) and stops them."""
    return _pin(s.replace(cache=s.cache.release(rows), active=s.active & ~rows))


def _row_fields(s: _State) -> dict:
    """The per-row fields of ``s`` and their row axis (the cache's pools, free stack and
    counts are per shard, not per row)."""
    fields = dict(
        page_table=(s.cache.page_table, 0),
        lengths=(s.cache.lengths, 0),
        **{
            name: (getattr(s, name), 0)
            for name in (
                "logits",
                "active",
                "count",
                "prompt_lengths",
                "prompt_ids",
                "sample_ids",
                "tokens",
                "log_probs",
                "raw_log_probs",
                "recent",
            )
        },
        routing=(s.routing, 1),
    )
    return {name: field for name, field in fields.items() if field[0] is not None}


def _with_rows(s: _State, fields: dict) -> _State:
    cache = s.cache.replace(page_table=fields.pop("page_table"), lengths=fields.pop("lengths"))
    return s.replace(cache=cache, **fields)


def compact(s: _State, bucket: int) -> tuple[_State, jax.Array]:
    """The state of ``bucket`` rows per shard: each shard's running rows first, in row
    order, then its other rows (distinct, so ``expand`` writes each row once); the pools
    and free stacks as they are. ``bucket`` must be at least every shard's running rows.
    Returns (state, rows [S, bucket], local to each shard)."""
    shards = s.cache.shards
    per_shard = s.active.shape[0] // shards
    idle = (~s.active).reshape(shards, per_shard).astype(jnp.int32)
    rows = jnp.argsort(idle, axis=1, stable=True)[:, :bucket]  # [S, bucket]

    def take(x, axis):
        x = x.reshape(x.shape[:axis] + (shards, per_shard) + x.shape[axis + 1 :])
        index = rows.reshape((1,) * axis + rows.shape + (1,) * (x.ndim - axis - 2))
        x = jnp.take_along_axis(x, index, axis=axis + 1)
        return x.reshape(x.shape[:axis] + (shards * bucket,) + x.shape[axis + 2 :])

    fields = {name: take(x, axis) for name, (x, axis) in _row_fields(s).items()}
    return _with_rows(s, fields), rows


def expand(s: _State, part: _State, rows) -> _State:
    """``s`` with the rows of ``part`` (``compact``'s, at ``rows`` [S, bucket]) written
    back."""
    shards, bucket = rows.shape
    per_shard = s.active.shape[0] // shards
    pick = jnp.arange(shards)[:, None]
    full, compacted = _row_fields(s), _row_fields(part)

    def put(name):
        (x, axis), (y, _) = full[name], compacted[name]
        x = jnp.moveaxis(x, axis, 0).reshape(
            (shards, per_shard) + x.shape[:axis] + x.shape[axis + 1 :]
        )
        y = jnp.moveaxis(y, axis, 0).reshape(
            (shards, bucket) + y.shape[:axis] + y.shape[axis + 1 :]
        )
        x = x.at[pick, rows].set(y).reshape((shards * per_shard,) + x.shape[2:])
        return jnp.moveaxis(x, 0, axis)

    fields = {name: put(name) for name in full}
    # The pools, tables' pages and free stacks as the compacted loop left them.
    cache = part.cache.replace(page_table=fields.pop("page_table"), lengths=fields.pop("lengths"))
    return s.replace(cache=cache, **fields)


@partial(
    jax.jit,
    static_argnums=(0,),
    static_argnames=("config", "steps", "bucket", "held_pages"),
    donate_argnums=(2,),
)
def decode_steps(
    graphdef,
    params,
    s: _State,
    rng,
    *,
    config: SamplingConfig,
    steps: int,
    bucket: int | None = None,
    held_pages: int = 0,
):
    """At most ``steps`` decode steps of every running row (``sampling.decode_step``).

    With ``bucket`` (< rows per shard, >= every shard's running rows): the steps run on a
    compacted batch of ``bucket`` rows per shard (``compact``: the running rows first, in
    row order, so pages are granted in the same order), written back after the loop
    (``expand``): the forward's work follows the running rows, not ``rows``. With
    ``held_pages`` (> 0, "pool" attention): each step's attention gathers and scores the
    pages held, ``held_pages`` at a time (``PagedKVCache.held_pages``): its work follows the
    pages held, not the pool; a bucket below the pages held costs a loop, never a page.

    Returns (state, steps run, tokens made per shard [S], row-steps spent waiting for a
    page, most pages one shard held at once)."""
    held = lambda s, pages: s.replace(cache=s.cache.replace(held_pages=pages))
    if bucket is not None:
        part, rows = compact(s, bucket)
        part, *rest = _decode_loop(graphdef, params, held(part, held_pages), rng, config, steps)
        return (_pin(expand(s, held(part, 0), rows)), *rest)
    s, *rest = _decode_loop(graphdef, params, held(s, held_pages), rng, config, steps)
    return (_pin(held(s, 0)), *rest)


def _decode_loop(graphdef, params, s: _State, rng, config: SamplingConfig, steps: int):
    """``decode_steps``' loop over the rows of ``s``."""
    model: PolicyModel = nnx.merge(graphdef, params)
    num_new = config.max_new_tokens

    def body(carry):
        i, made, waits, peak, s = carry
        cache, granted = s.cache.reserve(s.active.astype(jnp.int32), 1)
        go = s.active & granted
        peak = jnp.maximum(peak, jnp.max(cache.pages_in_use()))
        keys = jax.vmap(
            lambda b, j, n: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, b), j), n)
        )(s.prompt_ids, s.sample_ids, s.count)
        step = decode_step(
            model,
            config,
            s.logits,
            cache,
            count=s.count,
            live=go,
            positions=s.prompt_lengths + s.count,
            row_rngs=keys,
            recent=s.recent,
        )
        ended = step.ended | (go & (s.count + 1 >= num_new))
        column = jnp.where(go, s.count, num_new)  # dropped when waiting
        rows = jnp.arange(go.shape[0])
        put = lambda buf, value: buf.at[rows, column].set(value, mode="drop")
        routing = s.routing
        if routing is not None:  # [L, R, P + N, k] <- [L, R, k] at slot P + count
            prompt_len = routing.shape[2] - num_new
            routing = routing.at[:, rows, prompt_len + column].set(step.routing, mode="drop")
        cache = step.cache.advance(go[:, None])
        # A flat pass over every row's table: only on steps where some row ended.
        cache = jax.lax.cond(jnp.any(ended), lambda c: c.release(ended), lambda c: c, cache)
        s = s.replace(
            cache=cache,
            logits=step.logits,
            active=s.active & ~ended,
            count=s.count + go,
            tokens=put(s.tokens, step.tokens),
            log_probs=put(s.log_probs, step.log_probs),
            raw_log_probs=put(s.raw_log_probs, step.raw_log_probs),
            routing=routing,
            recent=step.recent,
        )
        made = made + jnp.sum(go.reshape(made.shape[0], -1), axis=1, dtype=jnp.int32)
        return i + 1, made, waits + jnp.sum(s.active & ~granted), peak, s

    zero = jnp.zeros((), jnp.int32)
    made = jnp.zeros((s.cache.shards,), jnp.int32)
    run, made, waits, peak, s = jax.lax.while_loop(
        lambda c: (c[0] < steps) & jnp.any(c[4].active), body, (zero, made, zero, zero, s)
    )
    return s, run, made, waits, peak


ROW_AXES = ("data", "fsdp", "expert")


def row_shards(mesh) -> int:
    """Shards of the engine on ``mesh``: the devices along its row axes (``data``, ``fsdp``,
    ``expert``, the logical ``batch``); 1 without a mesh."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[name] for name in ROW_AXES if name in mesh.shape]))


@partial(jax.jit, static_argnames=("group_size",))
def group_rows(s: _State, slot, *, group_size: int) -> dict:
    """Tokens, log-probs, raw log-probs [G, N], token counts [G] and routing (axis 1) of the
    G rows of slot group ``slot`` (traced: one program for every slot)."""
    take = lambda x, axis=0: (
        None if x is None else jax.lax.dynamic_slice_in_dim(x, slot * group_size, group_size, axis)
    )
    return dict(
        tokens=take(s.tokens),
        log_probs=take(s.log_probs),
        raw_log_probs=take(s.raw_log_probs),
        count=take(s.count),
        routing=take(s.routing, 1),
    )


def finish_rows(tokens, log_probs, raw_log_probs, count, fill_id: int) -> dict:
    """Host rows [R, N] of the state as a ``Rollout`` holds them: mask 1 on the first
    count[r] tokens, ``fill_id`` and log-probs 0 past them."""
    mask = (np.arange(tokens.shape[1])[None] < np.asarray(count)[:, None]).astype(np.float32)
    return dict(
        tokens=np.where(mask > 0, tokens, fill_id).astype(np.int32),
        mask=mask,
        log_probs=np.asarray(log_probs, np.float32) * mask,
        raw_log_probs=np.asarray(raw_log_probs, np.float32) * mask,
        lengths=np.asarray(count, np.int32),
    )


class ContinuousBatch:
    """An engine's rows: their device state and the host's ``Scheduler``, driven a pass at
    a time (``admit``, ``decode``, ``settle``): by ``Engine.generate`` until its prompts
    are done, by the asynchronous ``EngineSlots`` once per segment. Call it under the
    engine's mesh.

    Args:
      engine: the ``Engine`` (model, configs, shards).
      prompt_width: P, the width of every request's tokens.
      budget: the setting behind the pools, as errors name it (default
        ``EngineConfig.kv_tokens``).
    """

    def __init__(self, engine: Engine, prompt_width: int, budget: str | None = None):
        config, group = engine.engine, engine.config.num_samples
        slots_per_shard = config.rows // group
        self.engine, self.prompt_width = engine, prompt_width
        self.state = engine.init_state(prompt_width)
        self.scheduler = Scheduler(
            shards=engine.shards,
            slots_per_shard=slots_per_shard,
            group_size=group,
            page_size=config.page_size,
            num_pages=config.num_pages,
            admit_width=min(config.admit_prompts, slots_per_shard),
            row_tokens=prompt_width + engine.config.max_new_tokens,
            budget=budget or f"EngineConfig.kv_tokens = {config.kv_tokens}",
        )
        self.stats = self.scheduler.stats
        self.steps = 0  # decode steps run, summed over calls
        self._made = np.zeros(engine.shards, np.int32)  # tokens of the last decode call

    def free_pages(self) -> np.ndarray:
        """int [S]: each shard's free pages."""
        return np.asarray(jax.device_get(self.state.cache.num_free)).reshape(-1)

    def pages_held(self) -> int:
        return int(np.sum(np.asarray(self.state.cache.pages_in_use())))

    def admit(self, params) -> list[Admission]:
        """Prefills every request the pools admit now (``Scheduler.admissions``), one
        ``admit_rows`` call per group of admissions; returns the admissions."""
        calls = self.scheduler.admissions(self.free_pages())
        for call in calls:
            self.state = self._prefill(params, call)
        return [admission for call in calls for admission in call]

    def _prefill(self, params, call: list[Admission]) -> _State:
        engine, width = self.engine, self.scheduler.admit_width
        # Per place [S, A]: prompt length, first row, rows, first sample, prompt index; a
        # place left empty admits nothing (0 rows).
        args = np.zeros((5, engine.shards, width), np.int32)
        args[0] = 1
        prompts = np.full((engine.shards, width, self.prompt_width), engine.config.fill_id)
        places = collections.Counter()
        for admission in call:
            place = (admission.shard, places[admission.shard])
            places[admission.shard] += 1
            request = admission.request
            args[(slice(None),) + place] = (
                request.length,
                admission.row0,
                admission.num_rows,
                admission.first_sample,
                request.key,
            )
            prompts[place] = request.tokens
        return admit_rows(
            engine.graphdef,
            params,
            self.state,
            jnp.asarray(prompts, jnp.int32),
            *map(jnp.asarray, args),
            config=engine.config,
        )

    def decode(self, params, rng) -> None:
        """One ``decode_steps`` call of at most ``steps_per_call`` steps of every running
        row, over the buckets of rows and held pages that hold them (``_decode_shape``)."""
        bucket, held_pages = self._decode_shape()
        self.state, run, made, waits, peak = decode_steps(
            self.engine.graphdef,
            params,
            self.state,
            rng,
            config=self.engine.config,
            steps=self.engine.engine.steps_per_call,
            bucket=bucket,
            held_pages=held_pages,
        )
        self.steps += int(run)
        self._made = np.asarray(made)
        self.stats["waits"] += int(waits)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], int(peak))
        self.stats["held_page_calls"] += held_pages > 0

    def _decode_shape(self) -> tuple[int | None, int]:
        """(bucket, held_pages) of the next decode call: rows per shard of the compacted
        batch (``EngineConfig.decode_bucket``; None: every row) and the length of the list
        of held pages "pool" attention reads (``EngineConfig.held_page_bucket``; 0: the
        whole pool)."""
        config = self.engine.engine
        lists = config.held_page_bucket > 0 and config.attention == "pool"
        if not (config.decode_bucket or lists):
            return None, 0
        active = np.asarray(self.state.active).reshape(self.engine.shards, -1)
        running = int(active.sum(1).max())
        bucket, held_pages = None, 0
        if config.decode_bucket:
            bucket = max(config.decode_bucket, 1 << max(running - 1, 0).bit_length())
            bucket = bucket if bucket < config.rows else None
        if lists:
            # Every page this call can hold: in use now, and one per running row each
            # page_size steps (a row's slots of the call cross at most that many pages).
            in_use = config.num_pages - self.free_pages()
            steps = -(-config.steps_per_call // config.page_size)
            can_hold = int(in_use.max()) + running * steps
            held_pages = config.held_page_bucket
            while held_pages < can_hold:
                held_pages *= 2
            # A gather of more than half the pool's pages costs more than scoring the
            # whole pool in place (benchmarks/bench_paged_attention.py, 512 of 640).
            held_pages = held_pages if 2 * held_pages <= config.num_pages else 0
        return bucket, held_pages

    def settle(self) -> list[tuple[int, Request]]:
        """Hands out the groups whose rows all ended, preempts where no row moved and
        evicts the rows preempted (``Scheduler.settle``). Returns the groups handed out
        as (slot, request); their rows stay in the state (``rows``) until the slot is
        refilled."""
        active, num_free = jax.device_get((self.state.active, self.state.cache.num_free))
        finished, evict = self.scheduler.settle(active, self._made, num_free)
        if evict.any():
            evict = jax.device_put(evict, self.state.active.sharding)
            self.state = evict_rows(self.state, evict)
        return finished

    def rows(self, slot: int) -> dict:
        """``group_rows`` of ``slot``, on the host."""
        fields = group_rows(self.state, jnp.int32(slot), group_size=self.scheduler.group_size)
        return jax.device_get(fields)


class Engine:
    """Generates rollouts by continuous batching (``ContinuousBatch``).

    Args:
      model: a ``policyopt.models.PolicyModel`` (``policyopt.models.Transformer``).
      engine: EngineConfig (budget, rows, page size), per shard.
      config: SamplingConfig (decode_segments is ignored: pages grow with the tokens).
      graphdef: the graph to merge ``generate``'s ``params`` into (default: the model's).
      mesh: the mesh the parameters live on (``policyopt.sharding``), or None. The engine
        then runs S = ``row_shards(mesh)`` shards, one per device along the row axes, each
        with ``engine.rows`` rows and a pool of ``engine.kv_tokens`` slots on that device;
        the parameters stay as placed (docs/scale.md, "Generation engine").
      should_stop: a function polled before each decode call (also settable as the
        attribute); when it returns True, ``generate`` raises ``GenerationStopped``
        (a trainer's SIGINT / SIGTERM: ``trainer.RunLoop``).
    """

    def __init__(
        self,
        model,
        engine: EngineConfig,
        config: SamplingConfig,
        *,
        graphdef=None,
        mesh=None,
        should_stop: Callable[[], bool] | None = None,
    ):
        if engine.rows % config.num_samples:
            raise ValueError(
                f"EngineConfig.rows = {engine.rows} must be a multiple of "
                f"SamplingConfig.num_samples = {config.num_samples}"
            )
        config.check_vocab(model.config.vocab_size)
        self.model, self.engine, self.config, self.mesh = model, engine, config, mesh
        self.shards = row_shards(mesh)
        self.graphdef, self.params = nnx.split(model)
        if graphdef is not None:  # a trainer's (its params passed to generate)
            self.graphdef = graphdef
        self.stats: dict[str, int] = {}
        self.should_stop = should_stop

    @classmethod
    def from_config(
        cls, config, model, graphdef, mesh, sampling_config: SamplingConfig
    ) -> "Engine":
        """The engine of a run's config: ``config.sampling.engine_kv_tokens`` and
        ``engine_page_size``; ``engine_rows`` rows per shard (0: the round's B x G rows
        over the shards); routing captured for ``algo.routing_replay = "R3"``."""
        s = config.sampling
        shards = row_shards(None if mesh is None or mesh.size == 1 else mesh)
        group = config.batch.group_size
        rows = s.engine_rows or group * -(-config.batch.n_prompts // shards)
        return cls(
            model,
            EngineConfig(
                kv_tokens=s.engine_kv_tokens,
                rows=rows,
                page_size=s.engine_page_size,
                capture_routing=config.algo.routing_replay == "R3",
            ),
            sampling_config,
            graphdef=graphdef,
            mesh=None if mesh is None or mesh.size == 1 else mesh,
        )

    def _on_mesh(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def init_state(self, prompt_len: int) -> _State:
        """The empty state for prompts of width ``prompt_len``, placed on the mesh."""
        state = empty_state(self.model.config, self.engine, self.config, prompt_len, self.shards)
        if self.mesh is None:
            return jax.device_put(state, jax.devices()[0])
        return jax.device_put(
            state, sharding.named_shardings(state_specs(state, self.mesh), self.mesh)
        )

    def generate(self, prompts, prompt_lengths, rng, params=None) -> Rollout:
        """G samples of each right-padded prompt, as ``policyopt.sampling.generate``.

        Args:
          prompts: int [B, P], right-padded; prompt_lengths: int [B] in [1, P].
          rng: PRNG key.
          params: the model's state (``nnx.split``) to decode with, e.g. a trainer's
            current parameters; default: the model's at construction.
        Returns:
          A Rollout with B * G rows (prompt b -> rows b*G .. b*G+G-1), as NumPy arrays;
          routing [L_moe, B * G, P + N, k] for an MoE model with capture_routing (None
          otherwise); num_steps the decode steps run (summed over calls).
        Raises:
          ValueError: a prompt longer than the budget, or a budget that cannot admit a
            prompt's group (``group_pages``).
          GenerationStopped: ``should_stop`` returned True.
          RuntimeError: decode calls that made no progress (no token, no group handed
            out), naming what the host loop saw; never expected past the check above.
        """
        prompts, lengths = self._check_prompts(prompts, prompt_lengths)
        params = self.params if params is None else params
        with self._on_mesh():
            batch = ContinuousBatch(self, prompts.shape[1])
            self.stats = batch.stats
            for b in range(len(prompts)):
                batch.scheduler.submit(Request(b, prompts[b], int(lengths[b])))
            out = _HandedOut(len(prompts), self.config, batch.state.routing)
            while batch.scheduler.busy:
                self._poll_stop(batch.scheduler, len(prompts))
                batch.admit(params)
                batch.decode(params, rng)
                for slot, request in batch.settle():
                    out.put(request.key, batch.rows(slot))
            self.stats["pages_held_at_end"] = batch.pages_held()
        return out.rollout(prompts, lengths, batch.steps)

    def _poll_stop(self, scheduler: Scheduler, num_prompts: int) -> None:
        if self.should_stop is not None and self.should_stop():
            raise GenerationStopped(
                f"generation stopped on request with {len(scheduler.queue)} of {num_prompts} "
                f"prompts not yet admitted and {len(scheduler.running)} groups running"
            )

    def _check_prompts(self, prompts, prompt_lengths) -> tuple[np.ndarray, np.ndarray]:
        """The prompts and lengths as int32 host arrays, checked (``_check_budget``)."""
        prompts = np.asarray(prompts, np.int32)
        lengths = np.asarray(prompt_lengths, np.int32)
        batch, prompt_len = prompts.shape
        if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > prompt_len:
            raise ValueError(
                f"prompt_lengths must be [B={batch}] in [1, P={prompt_len}], got "
                f"shape {lengths.shape}, min {lengths.min()} max {lengths.max()}"
            )
        self._check_budget(lengths)
        return prompts, lengths

    def _check_budget(self, lengths: np.ndarray) -> None:
        """Refuses prompts whose group the pool could never admit (``group_pages``): the
        host loop would wait for pages that never come."""
        engine, group, ps = self.engine, self.config.num_samples, self.engine.page_size
        budget = engine.num_pages * ps
        too_long = np.flatnonzero(lengths > budget)
        if too_long.size:
            b = int(too_long[0])
            raise ValueError(
                f"prompt {b} has {lengths[b]} tokens, more than the KV budget "
                f"EngineConfig.kv_tokens = {engine.kv_tokens} ({budget} slots in whole pages)"
            )
        needs = [group_pages(int(length), group, ps) for length in lengths]
        b = int(np.argmax(needs))
        if needs[b] > engine.num_pages:
            raise ValueError(
                f"EngineConfig.kv_tokens = {engine.kv_tokens} cannot admit the group of "
                f"{group} rows of prompt {b} ({lengths[b]} tokens): that takes {needs[b]} free "
                f"pages of {ps} slots (the prompt's, a copy of its partly filled last page for "
                f"each other row, one page per row to decode into): needs kv_tokens >= "
                f"{needs[b] * ps}"
            )


class _HandedOut:
    """The rollout of ``Engine.generate``, filled on the host as groups are handed out."""

    def __init__(self, num_prompts: int, config: SamplingConfig, routing):
        rows, num_new = num_prompts * config.num_samples, config.max_new_tokens
        self.config = config
        self.fields = dict(
            tokens=np.zeros((rows, num_new), np.int32),
            log_probs=np.zeros((rows, num_new), np.float32),
            raw_log_probs=np.zeros((rows, num_new), np.float32),
            count=np.zeros((rows,), np.int32),
        )
        if routing is not None:
            num_moe, _, width, k = routing.shape
            self.fields["routing"] = np.zeros((num_moe, rows, width, k), np.int32)

    def put(self, prompt: int, rows: dict) -> None:
        """The G rows of ``prompt`` (``ContinuousBatch.rows``)."""
        group = self.config.num_samples
        dest = slice(prompt * group, (prompt + 1) * group)
        for name, field in self.fields.items():
            if name == "routing":
                field[:, dest] = rows[name]
            else:
                field[dest] = rows[name]

    def rollout(self, prompts: np.ndarray, lengths: np.ndarray, steps: int) -> Rollout:
        fill, group = self.config.fill_id, self.config.num_samples
        fields = self.fields
        aligned = np.full_like(prompts, fill)  # right-aligned, as Rollout.sequences() reads
        for b, length in enumerate(lengths):
            aligned[b, prompts.shape[1] - length :] = prompts[b, :length]
        return Rollout(
            **finish_rows(
                fields["tokens"],
                fields["log_probs"],
                fields["raw_log_probs"],
                fields["count"],
                fill,
            ),
            prompt_tokens=np.repeat(aligned, group, axis=0),
            prompt_lengths=np.repeat(lengths, group),
            routing=fields.get("routing"),
            num_steps=np.int32(steps),
        )
