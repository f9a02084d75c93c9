"""Continuous batching on a paged KV cache: a bounded number of rows, refilled one group
of G samples at a time, within a KV memory budget.

How a call runs (``Engine.generate``):

  1. Admission (host). A free group of G rows takes the next prompt when the pool has
     the pages of the prompt, one more per row, and a copy of a partly filled last page
     for each other row, free. The prompt is prefilled once into the group's first row
     (a ``[1, P]`` forward pass writing that row's pages); the other G - 1 rows share its
     full pages and get their own copy of the partial one (``PagedKVCache.copy_rows``).
  2. Decode (one jitted ``lax.while_loop`` of at most ``steps_per_call`` steps). Each
     running row asks for the page its next token needs (``PagedKVCache.reserve``); a row
     refused waits (it samples nothing and writes nothing this step). A row that goes on
     samples its token n with the key fold_in(fold_in(fold_in(rng, prompt), sample), n),
     records it, and feeds it back at its own slot and position prompt_length + n. A row
     that ends (end token, or N tokens) returns its pages at once.
  3. Hand-out (host). A group whose rows have all ended is copied out, and its rows are
     free for the next prompt.
  4. No progress. If a decode call moved no row (every running row waits for a page),
     the most recently admitted group is preempted: its pages are returned and it is
     queued again at the front, to be recomputed from its prompt (the same tokens: keys
     depend on the prompt, sample and token index only). With one group left, its last
     running row is preempted the same way and recomputed alone once pages are free;
     only a single row that cannot reach its end in the whole pool raises.

Greedy outputs equal ``policyopt.sampling.generate``'s for the same prompts. Sampled
outputs follow another key schedule (per row, not per step), so they differ from it.
Behaviour log-probs are those of the distribution each token was drawn from, as there.

Not yet (issue 23): routing capture (R3) of MoE rollouts, stop sequences, a sharded
model.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from policyopt.models.paged import ATTENTION, PagedKVCache, pages_for
from policyopt.sampling import Rollout, SamplingConfig, _next_logits, _take


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's memory budget and batching (hashable: part of the jit cache key)."""

    # KV token slots in the page pool (each holds every layer's key and value of one token):
    # the memory budget, kv_tokens * L * 2 * Hkv * Dh * bytes. Rounded down to pages.
    kv_tokens: int
    # Rows decoded together; a multiple of SamplingConfig.num_samples (whole groups).
    rows: int
    # Token slots per page.
    page_size: int = 16
    # Attention over pages: "gather", "online" or "pallas" (policyopt.models.paged).
    attention: str = "gather"
    # Decode steps per jitted call between the host's hand-outs and admissions.
    steps_per_call: int = 16

    def __post_init__(self):
        for name in ("kv_tokens", "rows", "page_size", "steps_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.attention not in ATTENTION:
            raise ValueError(f"EngineConfig.attention must be one of {ATTENTION}, "
                             f"got {self.attention!r}")

    @property
    def num_pages(self) -> int:
        return self.kv_tokens // self.page_size


@struct.dataclass
class _State:
    """Every row's decode state (a pytree carried by the decode loop)."""

    cache: PagedKVCache
    logits: jax.Array         # float32 [R, V]; next-token logits
    active: jax.Array         # bool [R]; admitted and not ended
    count: jax.Array          # int32 [R]; tokens generated
    prompt_lengths: jax.Array  # int32 [R]
    prompt_ids: jax.Array     # int32 [R]; prompt index b of the row's group
    sample_ids: jax.Array     # int32 [R]; sample j < G within the group
    tokens: jax.Array         # int32 [R, N]
    log_probs: jax.Array      # float32 [R, N]
    raw_log_probs: jax.Array  # float32 [R, N]


def _init_state(model, engine: EngineConfig, config: SamplingConfig, max_length: int) -> _State:
    rows, num_new = engine.rows, config.max_new_tokens
    cache = PagedKVCache.create(model.config, rows, engine.num_pages, engine.page_size,
                                pages_for(max_length, engine.page_size), config.cache_dtype,
                                attention=engine.attention)
    return _State(cache=cache, logits=jnp.zeros((rows, model.config.vocab_size), jnp.float32),
                  active=jnp.zeros((rows,), bool), count=jnp.zeros((rows,), jnp.int32),
                  prompt_lengths=jnp.zeros((rows,), jnp.int32),
                  prompt_ids=jnp.zeros((rows,), jnp.int32),
                  sample_ids=jnp.zeros((rows,), jnp.int32),
                  tokens=jnp.full((rows, num_new), config.fill_id, jnp.int32),
                  log_probs=jnp.zeros((rows, num_new), jnp.float32),
                  raw_log_probs=jnp.zeros((rows, num_new), jnp.float32))


@partial(jax.jit, static_argnums=(0,), static_argnames=("config",), donate_argnums=(2,))
def _admit(graphdef, params, s: _State, prompt, length, row0, num_rows, first_sample,
           prompt_index, *, config: SamplingConfig) -> _State:
    """Prefills ``prompt`` [P] (``length`` real tokens) into row ``row0`` and copies it to
    rows [row0, row0 + num_rows), samples first_sample, first_sample + 1, ..."""
    model = nnx.merge(graphdef, params)
    cache = s.cache
    view = cache.replace(page_table=cache.page_table[row0][None], lengths=cache.lengths[row0][None])
    prompt_len = prompt.shape[0]
    mask = (jnp.arange(prompt_len) < length)[None]
    view, _ = view.reserve(length[None], pages_for(prompt_len, cache.page_size))
    out = model(prompt[None], positions=jnp.arange(prompt_len)[None], attention_mask=mask,
                cache=view, return_logits=False)
    view = out.cache.advance(mask)
    cache = view.replace(page_table=cache.page_table.at[row0].set(view.page_table[0]),
                         lengths=cache.lengths.at[row0].set(view.lengths[0]))
    rows = jnp.arange(cache.lengths.shape[0])
    group_rows = (rows >= row0) & (rows < row0 + num_rows)
    sample = jnp.arange(config.num_samples)
    dest = jnp.where((sample >= 1) & (sample < num_rows), row0 + sample, rows.shape[0])
    cache, _ = cache.copy_rows(row0, dest, pages_for(prompt_len, cache.page_size))
    hidden = jax.lax.dynamic_index_in_dim(out.hidden[0], length - 1, keepdims=False)
    logits = _next_logits(model, hidden[None])[0]
    col = lambda x: group_rows.reshape((-1,) + (1,) * (x.ndim - 1))
    return s.replace(
        cache=cache,
        logits=jnp.where(col(s.logits), logits[None], s.logits),
        active=s.active | group_rows,
        count=jnp.where(group_rows, 0, s.count),
        prompt_lengths=jnp.where(group_rows, length, s.prompt_lengths),
        prompt_ids=jnp.where(group_rows, prompt_index, s.prompt_ids),
        sample_ids=jnp.where(group_rows, first_sample + rows - row0, s.sample_ids),
        tokens=jnp.where(col(s.tokens), config.fill_id, s.tokens),
        log_probs=jnp.where(col(s.log_probs), 0.0, s.log_probs),
        raw_log_probs=jnp.where(col(s.raw_log_probs), 0.0, s.raw_log_probs))


@partial(jax.jit, donate_argnums=(0,))
def _evict(s: _State, rows) -> _State:
    """Returns the pages of ``rows`` (bool [R]) and stops them."""
    return s.replace(cache=s.cache.release(rows), active=s.active & ~rows)


@partial(jax.jit, static_argnums=(0,), static_argnames=("config", "steps"), donate_argnums=(2,))
def _decode(graphdef, params, s: _State, rng, *, config: SamplingConfig, steps: int):
    """At most ``steps`` decode steps of every running row.

    Returns (state, steps run, tokens made, row-steps spent waiting for a page, most pages
    held at once)."""
    model = nnx.merge(graphdef, params)
    num_new = config.max_new_tokens
    end_ids = jnp.asarray(config.end_ids, jnp.int32) if config.end_ids else None

    def body(carry):
        step, made, waits, peak, s = carry
        cache, granted = s.cache.reserve(s.active.astype(jnp.int32), 1)
        go = s.active & granted
        peak = jnp.maximum(peak, cache.num_pages - cache.num_free)
        logits = s.logits
        sample_logits = logits
        if config.min_new_tokens > 0 and end_ids is not None:
            banned = logits.at[:, end_ids].set(-jnp.inf)
            sample_logits = jnp.where((s.count < config.min_new_tokens)[:, None], banned, logits)
        keys = jax.vmap(lambda b, j, n: jax.random.fold_in(jax.random.fold_in(
            jax.random.fold_in(rng, b), j), n))(s.prompt_ids, s.sample_ids, s.count)
        tokens, log_probs = jax.vmap(
            lambda row, key: config.method.sample(row[None], key))(sample_logits, keys)
        tokens, log_probs = tokens[:, 0], log_probs[:, 0]
        raw = _take(jax.nn.log_softmax(config.method.scale(logits), axis=-1), tokens)
        ended = s.count + 1 >= num_new
        if end_ids is not None:
            ended |= jnp.any(tokens[:, None] == end_ids[None, :], axis=-1)
        ended &= go
        feed = (go & ~ended)[:, None]
        out = model(tokens[:, None], positions=(s.prompt_lengths + s.count)[:, None],
                    attention_mask=feed, cache=cache, return_logits=False)
        column = jnp.where(go, s.count, num_new)                     # dropped when waiting
        rows = jnp.arange(tokens.shape[0])
        put = lambda buf, value: buf.at[rows, column].set(value, mode="drop")
        cache = out.cache.advance(feed)
        # A flat pass over every row's table: only on steps where some row ended.
        cache = jax.lax.cond(jnp.any(ended), lambda c: c.release(ended), lambda c: c, cache)
        s = s.replace(cache=cache,
                      logits=jnp.where(feed, _next_logits(model, out.hidden[:, 0]), logits),
                      active=s.active & ~ended, count=s.count + go,
                      tokens=put(s.tokens, tokens), log_probs=put(s.log_probs, log_probs),
                      raw_log_probs=put(s.raw_log_probs, raw))
        return step + 1, made + jnp.sum(go), waits + jnp.sum(s.active & ~granted), peak, s

    zero = jnp.zeros((), jnp.int32)
    run, made, waits, peak, s = jax.lax.while_loop(
        lambda c: (c[0] < steps) & jnp.any(c[4].active), body, (zero, zero, zero, zero, s))
    return s, run, made, waits, peak


class Engine:
    """Generates rollouts by continuous batching (see the module docstring).

    Args:
      model: a ``policyopt.models.Transformer``.
      engine: EngineConfig (budget, rows, page size).
      config: SamplingConfig (stop_sequences and decode_segments are not supported).
      graphdef: the graph to merge ``generate``'s ``params`` into (default: the model's).
    """

    def __init__(self, model, engine: EngineConfig, config: SamplingConfig, *, graphdef=None):
        if engine.rows % config.num_samples:
            raise ValueError(f"EngineConfig.rows = {engine.rows} must be a multiple of "
                             f"SamplingConfig.num_samples = {config.num_samples}")
        if config.stop_sequences:
            raise ValueError("SamplingConfig.stop_sequences are not supported by the engine")
        config.check_vocab(model.config.vocab_size)
        self.model, self.engine, self.config = model, engine, config
        self.graphdef, self.params = nnx.split(model)
        if graphdef is not None:  # a trainer's (its params passed to generate)
            self.graphdef = graphdef
        self.stats: dict[str, int] = {}

    def generate(self, prompts, prompt_lengths, rng, params=None) -> Rollout:
        """G samples of each right-padded prompt, as ``policyopt.sampling.generate``.

        Args:
          prompts: int [B, P], right-padded; prompt_lengths: int [B] in [1, P].
          rng: PRNG key.
          params: the model's state (``nnx.split``) to decode with, e.g. a trainer's
            current parameters; default: the model's at construction.
        Returns:
          A Rollout with B * G rows (prompt b -> rows b*G .. b*G+G-1), routing None,
          num_steps the decode steps run (summed over calls).
        Raises:
          ValueError: a prompt longer than the budget, or a budget smaller than the longest
            prompt plus one page.
        """
        engine, config = self.engine, self.config
        params = self.params if params is None else params
        prompts = np.asarray(prompts, np.int32)
        lengths = np.asarray(prompt_lengths, np.int32)
        batch, prompt_len = prompts.shape
        if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > prompt_len:
            raise ValueError(f"prompt_lengths must be [B={batch}] in [1, P={prompt_len}], got "
                             f"shape {lengths.shape}, min {lengths.min()} max {lengths.max()}")
        budget = engine.num_pages * engine.page_size
        too_long = np.flatnonzero(lengths > budget)
        if too_long.size:
            b = int(too_long[0])
            raise ValueError(f"prompt {b} has {lengths[b]} tokens, more than the KV budget "
                             f"EngineConfig.kv_tokens = {engine.kv_tokens} "
                             f"({budget} slots in whole pages)")
        need = pages_for(int(lengths.max()), engine.page_size) + 1
        if engine.num_pages < need:
            raise ValueError(
                f"EngineConfig.kv_tokens = {engine.kv_tokens} is smaller than the longest "
                f"prompt ({lengths.max()} tokens) plus one page (page_size = "
                f"{engine.page_size}): needs >= {need * engine.page_size}")
        group, num_new = config.num_samples, config.max_new_tokens
        state = _init_state(self.model, engine, config, prompt_len + num_new)
        slots = [-1] * (engine.rows // group)             # prompt held by each group of rows
        waiting = [[] for _ in slots]                      # rows of a slot evicted, to redo
        admitted = []                                      # running slots, oldest first
        queue = list(range(batch))
        out = {name: np.zeros((batch * group, num_new), dtype) for name, dtype in (
            ("tokens", np.int32), ("log_probs", np.float32), ("raw_log_probs", np.float32))}
        counts = np.zeros(batch * group, np.int32)
        steps_run = 0
        # What the last call did: row-steps spent waiting for a page, groups and rows
        # preempted, most pages held at once during decode, pages still held at the end
        # (0: every page came back).
        self.stats = dict(waits=0, preempted_groups=0, preempted_rows=0, peak_pages=0)

        def admit(state, b, row0, num_rows, first_sample):
            return _admit(self.graphdef, params, state, jnp.asarray(prompts[b]),
                          jnp.int32(lengths[b]), jnp.int32(row0), jnp.int32(num_rows),
                          jnp.int32(first_sample), jnp.int32(b), config=config)

        while queue or admitted:
            num_free = int(state.cache.num_free)
            for slot in admitted:                          # evicted rows first
                b = slots[slot]
                while waiting[slot] and num_free >= pages_for(int(lengths[b]), engine.page_size) + 1:
                    row = waiting[slot].pop(0)
                    state = admit(state, b, row, 1, row - slot * group)
                    num_free -= pages_for(int(lengths[b]), engine.page_size)
            for slot in range(len(slots)):
                if slots[slot] >= 0 or not queue:
                    continue
                b = queue[0]
                prompt_pages = (pages_for(int(lengths[b]), engine.page_size)
                                + (group - 1) * int(lengths[b] % engine.page_size > 0))
                if num_free < prompt_pages + group:
                    break
                queue.pop(0)
                state = admit(state, b, slot * group, group, 0)
                num_free -= prompt_pages
                slots[slot] = b
                admitted.append(slot)
            state, run, made, waits, peak = _decode(self.graphdef, params, state, rng,
                                              config=config, steps=engine.steps_per_call)
            steps_run += int(run)
            self.stats["waits"] += int(waits)
            self.stats["peak_pages"] = max(self.stats["peak_pages"], int(peak))
            active = np.asarray(state.active)
            for slot in list(admitted):
                rows = slice(slot * group, (slot + 1) * group)
                if active[rows].any() or waiting[slot]:
                    continue
                b = slots[slot]
                dest = slice(b * group, (b + 1) * group)
                for name in out:
                    out[name][dest] = np.asarray(getattr(state, name)[rows])
                counts[dest] = np.asarray(state.count[rows])
                slots[slot] = -1
                admitted.remove(slot)
            if int(made) == 0 and admitted:
                # Every running row waits for a page: free some, to be recomputed.
                if len(admitted) > 1:
                    slot = admitted.pop()
                    evict = (np.arange(engine.rows) // group) == slot
                    queue.insert(0, slots[slot])
                    self.stats["preempted_groups"] += 1
                    slots[slot], waiting[slot] = -1, []
                else:
                    slot = admitted[0]
                    running = np.flatnonzero(active[slot * group:(slot + 1) * group])
                    if running.size <= 1:
                        raise ValueError(
                            f"EngineConfig.kv_tokens = {engine.kv_tokens} cannot hold one row "
                            f"to its end: needs up to {prompt_len + num_new} slots in pages "
                            f"of {engine.page_size}")
                    row = slot * group + int(running[-1])
                    evict = np.arange(engine.rows) == row
                    waiting[slot].append(row)
                    self.stats["preempted_rows"] += 1
                state = _evict(state, jnp.asarray(evict))
        self.stats["pages_held_at_end"] = engine.num_pages - int(state.cache.num_free)
        mask = (np.arange(num_new)[None, :] < counts[:, None]).astype(np.float32)
        fill = config.fill_id
        shift = prompt_len - lengths
        aligned = np.full_like(prompts, fill)
        for b in range(batch):
            aligned[b, shift[b]:] = prompts[b, :lengths[b]]
        return Rollout(tokens=np.where(mask > 0, out["tokens"], fill).astype(np.int32), mask=mask,
                       log_probs=out["log_probs"] * mask, raw_log_probs=out["raw_log_probs"] * mask,
                       lengths=counts, prompt_tokens=np.repeat(aligned, group, axis=0),
                       prompt_lengths=np.repeat(lengths, group), routing=None,
                       num_steps=np.int32(steps_run))
