"""Generation next to an asynchronous trainer (Magistral, arXiv 2506.10910): slot groups of
G samples decoded in segments, refilled as groups finish, under parameters that may change
between segments (the KV cache is kept), every token's parameter version recorded.
``SlotGenerator`` decodes on a dense KV cache, ``EngineSlots`` on the engine's paged one
(``policyopt.engine.ContinuousBatch``); ``AsyncGenerator`` runs either in a thread with a
scoring thread beside it (docs/scale.md, "Generation engine"; docs/algorithms.md,
"Asynchronous generation").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
import time
from functools import partial
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx, struct

from policyopt import sharding
from policyopt.engine import (
    ContinuousBatch,
    Engine,
    EngineConfig,
    GenerationStopped,
    finish_rows,
    row_shards,
)
from policyopt.models.attention import KEY_CACHE_AXES, VALUE_CACHE_AXES
from policyopt.models.interface import PolicyModel
from policyopt.models.paged import pages_for
from policyopt.sampling import Rollout, SamplingConfig, decode_step, next_logits
from policyopt.scheduler import Request, group_pages

__all__ = [
    "SlotConfig",
    "SlotGenerator",
    "EngineSlots",
    "engine_pages_needed",
    "GroupCompletion",
    "AsyncGenerator",
    "GeneratorExhausted",
    "staleness_bound",
]


def staleness_bound(
    n_async: int,
    n_batch: int,
    group_size: int,
    max_new_tokens: int,
    segment_steps: int,
    rows: int | None = None,
) -> int:
    """Largest possible ``b - v`` for a token generated at version v and trained at b,
    with ``rows`` generation rows (default n_async; docs/scale.md, "Staleness")."""
    rows = n_async if rows is None else min(rows, n_async)
    segments = math.ceil(max_new_tokens / segment_steps)
    return 1 + ((n_async - group_size) + (rows - group_size) * (segments - 1)) // n_batch


@dataclasses.dataclass(frozen=True)
class SlotConfig:
    """Static settings of a SlotGenerator (hashable: a jit cache key)."""

    # max_new_tokens N, sampling method, end tokens, G = num_samples, pad and cache dtype.
    sampling: SamplingConfig
    # Slot groups (prompts generated at once); R = num_groups * G rows.
    num_groups: int
    # P: prompts are right-padded (or cut, if only padding is cut) to this width.
    prompt_width: int
    # K: most decode steps per segment (between weight pick-ups).
    segment_steps: int

    def __post_init__(self):
        for name in ("num_groups", "prompt_width", "segment_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SlotConfig.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def group_size(self) -> int:
        return self.sampling.num_samples

    @property
    def rows(self) -> int:
        return self.num_groups * self.sampling.num_samples

    @property
    def window(self) -> int:
        """W = P + N slots: what a live row can occupy."""
        return self.prompt_width + self.sampling.max_new_tokens

    @property
    def cache_length(self) -> int:
        return self.window + self.segment_steps


@struct.dataclass
class _SlotState:
    """Everything the decode segments carry, R rows (one KV cache for all)."""

    cache: Any  # KVCache, stacked: k [L, R, Hkv, Dh, S], v [L, R, Hkv, S, Dh]
    active: jax.Array  # bool [R]: holds a completion that has not been taken out
    done: jax.Array  # bool [R]: the row has ended
    step: jax.Array  # int32 [R]: tokens sampled so far
    logits: jax.Array  # float32 [R, V]: next-token logits
    logits_version: jax.Array  # int32 [R]: parameter version that computed `logits`
    prompt_tokens: jax.Array  # int32 [R, P], right-padded
    prompt_lengths: jax.Array  # int32 [R]
    tokens: jax.Array  # int32 [R, N]
    mask: jax.Array  # float32 [R, N]
    log_probs: jax.Array  # float32 [R, N]: distribution sampled from
    raw_log_probs: jax.Array  # float32 [R, N]: temperature-scaled, untruncated
    versions: jax.Array  # int32 [R, N]: version of each token's logits (-1: none)
    start_version: jax.Array  # int32 [R]: version of the prompt's prefill
    prompt_routing: jax.Array | None  # int32 [L_moe, R, P, k], prompt right-padded
    routing: jax.Array | None  # int32 [L_moe, R, N, k]
    recent: jax.Array | None  # int32 [R, M]: last M tokens, for stop sequences


def init_slot_state(model: PolicyModel, config: SlotConfig) -> _SlotState:
    """The empty slot state of ``config``'s rows (KV cache, tokens, lengths, routing)."""
    mc, s = model.config, config.sampling
    rows, num_new, prompt_width = config.rows, s.max_new_tokens, config.prompt_width
    cache = model.init_cache(rows, config.cache_length, dtype=s.cache_dtype)
    cache = cache.replace(index=jnp.asarray(config.window, jnp.int32))
    prompt_routing = routing = None
    if mc.is_moe:
        k = mc.num_experts_per_tok
        filler = jnp.arange(k, dtype=jnp.int32)
        prompt_routing = jnp.broadcast_to(filler, (mc.num_moe_layers, rows, prompt_width, k))
        routing = jnp.broadcast_to(filler, (mc.num_moe_layers, rows, num_new, k))
    window = s.stop_window
    zeros = lambda shape, dtype: jnp.zeros(shape, dtype)
    return _SlotState(
        cache=cache,
        active=zeros((rows,), bool),
        done=zeros((rows,), bool),
        step=zeros((rows,), jnp.int32),
        logits=zeros((rows, mc.vocab_size), jnp.float32),
        logits_version=zeros((rows,), jnp.int32),
        prompt_tokens=jnp.full((rows, prompt_width), s.fill_id, jnp.int32),
        prompt_lengths=jnp.ones((rows,), jnp.int32),
        tokens=jnp.full((rows, num_new), s.fill_id, jnp.int32),
        mask=zeros((rows, num_new), jnp.float32),
        log_probs=zeros((rows, num_new), jnp.float32),
        raw_log_probs=zeros((rows, num_new), jnp.float32),
        versions=jnp.full((rows, num_new), -1, jnp.int32),
        start_version=zeros((rows,), jnp.int32),
        prompt_routing=prompt_routing,
        routing=routing,
        recent=jnp.full((rows, window), -1, jnp.int32) if window else None,
    )


def slot_specs(state: _SlotState, mesh) -> _SlotState:
    """The ``PartitionSpec`` of every field of the slot state on ``mesh``: the R rows split
    over ``data`` x ``fsdp`` when they divide (the routing along its row axis 1), the KV
    cache by its logical axes (``KEY_CACHE_AXES``, ``VALUE_CACHE_AXES``: rows, and key/value
    heads over ``tensor``), its write index replicated."""
    rows = lambda x, axis=0: sharding.row_spec(x.shape, mesh, axis)
    specs = jax.tree.map(rows, state)
    cache = state.cache
    specs = specs.replace(
        cache=specs.cache.replace(
            k=sharding.logical_spec(cache.k.shape, KEY_CACHE_AXES, mesh),
            v=sharding.logical_spec(cache.v.shape, VALUE_CACHE_AXES, mesh),
        )
    )
    if state.routing is not None:
        specs = specs.replace(
            prompt_routing=rows(state.prompt_routing, 1), routing=rows(state.routing, 1)
        )
    return specs


def _refill(
    graphdef,
    params,
    state: _SlotState,
    group,
    prompt,
    prompt_length,
    version,
    *,
    config: SlotConfig,
) -> _SlotState:
    """Prefills one prompt (under parameters `version`) into the G rows of slot `group`."""
    model: PolicyModel = nnx.merge(graphdef, params)
    s = config.sampling
    group_size, prompt_width = s.num_samples, config.prompt_width
    index = jnp.arange(prompt_width, dtype=jnp.int32)
    prompt_mask = index < prompt_length
    out = model(
        prompt[None].astype(jnp.int32),
        positions=index[None],
        attention_mask=prompt_mask[None],
        cache=model.init_cache(1, prompt_width, dtype=s.cache_dtype),
        return_logits=False,
    )
    last = jax.lax.dynamic_index_in_dim(out.hidden[0], prompt_length - 1, axis=0)  # [1, D]
    logits = next_logits(model, last)  # [1, V]

    row0 = group * group_size
    repeat = lambda x, axis: jnp.repeat(x, group_size, axis=axis)

    def put(buffer, block, axis=0):
        block = jnp.broadcast_to(
            block, buffer.shape[:axis] + (group_size,) + buffer.shape[axis + 1 :]
        )
        return jax.lax.dynamic_update_slice_in_dim(buffer, block.astype(buffer.dtype), row0, axis)

    # The prompt's keys / values go to slots [index - P, index) of the group's rows; every
    # other slot of those rows (the previous completion) is masked out.
    cache = state.cache
    first_slot = cache.index - prompt_width
    row_mask = jnp.zeros((group_size, config.cache_length), bool)
    row_mask = jax.lax.dynamic_update_slice(row_mask, repeat(prompt_mask[None], 0), (0, first_slot))
    cache = cache.put_rows(out.cache.map_layers(lambda x: repeat(x, 0)), row0, first_slot)
    cache = cache.replace(
        key_mask=jax.lax.dynamic_update_slice(cache.key_mask, row_mask, (row0, 0))
    )
    new = state.replace(
        cache=cache,
        active=put(state.active, True),
        done=put(state.done, False),
        step=put(state.step, 0),
        logits=put(state.logits, logits),
        logits_version=put(state.logits_version, version),
        prompt_tokens=put(state.prompt_tokens, prompt[None]),
        prompt_lengths=put(state.prompt_lengths, prompt_length),
        tokens=put(state.tokens, s.fill_id),
        mask=put(state.mask, 0.0),
        log_probs=put(state.log_probs, 0.0),
        raw_log_probs=put(state.raw_log_probs, 0.0),
        versions=put(state.versions, -1),
        start_version=put(state.start_version, version),
    )
    if state.routing is not None:
        k = state.routing.shape[-1]
        new = new.replace(
            prompt_routing=put(state.prompt_routing, out.routing.astype(jnp.int32), axis=1),
            routing=put(state.routing, jnp.arange(k, dtype=jnp.int32), axis=1),
        )
    if state.recent is not None:
        new = new.replace(recent=put(state.recent, -1))
    return sharding.constrain_tree(new, partial(slot_specs, new))


def _compact(cache, window: int):
    """Rolls the cache so that slots [index - W, index) become [0, W); index := W."""
    keep = jnp.arange(cache.max_length) < window
    cache = cache.roll_slots(window - cache.index)
    return cache.replace(key_mask=cache.key_mask & keep[None], index=jnp.asarray(window, jnp.int32))


def _segment(
    graphdef, params, state: _SlotState, version, rng, *, config: SlotConfig
) -> _SlotState:
    """Up to K decode steps of every live row under parameters `version`
    (``policyopt.sampling.decode_step``, here with a step per row)."""
    model: PolicyModel = nnx.merge(graphdef, params)
    s = config.sampling
    num_new = s.max_new_tokens
    rows = jnp.arange(config.rows, dtype=jnp.int32)
    # The loop carries one buffer per layer (KVCache.unstack): a layer of the stacked
    # cache would be copied out of it at every step. Stacked again after the segment.
    # A scanned model (scan_layers) keeps the stacked cache, its layer scan's carry.
    cache = _compact(state.cache, config.window)
    state = state.replace(cache=cache if model.config.scan_layers else cache.unstack())

    def cond(carry):
        i, st = carry
        return (i < config.segment_steps) & jnp.any(st.active & ~st.done)

    def body(carry):
        i, st = carry
        live = st.active & ~st.done
        step = decode_step(
            model,
            s,
            st.logits,
            st.cache,
            count=st.step,
            live=live,
            positions=st.prompt_lengths + st.step,
            rng=jax.random.fold_in(rng, i),
            recent=st.recent,
        )
        # This step's column of each live row; N (out of range: the write is dropped) for
        # the others. Scatters touch R entries per step, not the whole [R, N] buffers.
        column = jnp.where(live, st.step, num_new)

        def put(buffer, values):
            return buffer.at[rows, column].set(values.astype(buffer.dtype), mode="drop")

        routing = st.routing
        if routing is not None:  # [L, R, N, k] <- [L, R, k]
            routing = routing.at[:, rows, column].set(step.routing, mode="drop")
        count = st.step + live.astype(jnp.int32)
        return i + 1, st.replace(
            cache=step.cache,
            done=st.done | step.ended | (live & (count >= num_new)),
            step=count,
            logits=step.logits,
            logits_version=jnp.where(live, version, st.logits_version),
            tokens=put(st.tokens, step.tokens),
            mask=put(st.mask, jnp.ones_like(step.log_probs)),
            log_probs=put(st.log_probs, step.log_probs),
            raw_log_probs=put(st.raw_log_probs, step.raw_log_probs),
            versions=put(st.versions, st.logits_version),
            routing=routing,
            recent=step.recent,
        )

    _, state = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), state))
    state = state.replace(cache=state.cache.stack())
    return sharding.constrain_tree(state, partial(slot_specs, state))


def _group_rows(state: _SlotState, group, *, group_size: int) -> dict:
    """The fields of a GroupCompletion for the G rows of slot ``group`` (routing: axis 1)."""
    take = lambda x, axis=0: (
        None if x is None else jax.lax.dynamic_slice_in_dim(x, group * group_size, group_size, axis)
    )
    return dict(
        tokens=take(state.tokens),
        mask=take(state.mask),
        log_probs=take(state.log_probs),
        raw_log_probs=take(state.raw_log_probs),
        versions=take(state.versions),
        prompt_tokens=take(state.prompt_tokens),
        prompt_lengths=take(state.prompt_lengths),
        start_version=take(state.start_version),
        prompt_routing=take(state.prompt_routing, 1),
        routing=take(state.routing, 1),
    )


_group_rows_fn = jax.jit(_group_rows, static_argnames=("group_size",))
_refill_fn = jax.jit(_refill, static_argnums=(0,), static_argnames=("config",), donate_argnums=(2,))
_segment_fn = jax.jit(
    _segment, static_argnums=(0,), static_argnames=("config",), donate_argnums=(2,)
)


class GroupCompletion(NamedTuple):
    """The G finished samples of one prompt, on the host (numpy), in `Rollout`'s layout.

    Shapes: G rows, P prompt width, N max_new_tokens.
    """

    tokens: np.ndarray  # int32 [G, N]
    mask: np.ndarray  # float32 [G, N]
    log_probs: np.ndarray  # float32 [G, N]: distribution sampled from
    raw_log_probs: np.ndarray  # float32 [G, N]: behaviour log-probs (untruncated)
    lengths: np.ndarray  # int32 [G]
    prompt_tokens: np.ndarray  # int32 [G, P], right-aligned (left-padded)
    prompt_lengths: np.ndarray  # int32 [G]
    routing: np.ndarray | None  # int32 [L_moe, G, P + N, k], `Rollout.sequences()` layout
    versions: np.ndarray  # int32 [G, N]: parameter version of each token (-1 past the end)
    start_version: int  # version of the prompt's prefill (and of token 0's logits)
    finish_version: int  # version of the segment in which the group finished
    meta: dict  # what came with the prompt (text, reference answer, ...)
    rewards: np.ndarray | None = None  # float32 [G], once scored
    correct: np.ndarray | None = None  # bool [G]
    sample_mask: np.ndarray | None = None  # float32 [G]: 0 drops a sample from the loss
    scored: np.ndarray | None = None  # bool [G]: False where the reward is a stand-in
    scoring: dict | None = None  # the scorer's metrics (`score_batch`'s), once scored

    def rollout(self) -> Rollout:
        """As a `policyopt.sampling.Rollout` (for `policyopt.rl.batch.round_from_rollout`)."""
        return Rollout(
            tokens=self.tokens,
            mask=self.mask,
            log_probs=self.log_probs,
            raw_log_probs=self.raw_log_probs,
            lengths=self.lengths,
            prompt_tokens=self.prompt_tokens,
            prompt_lengths=self.prompt_lengths,
            routing=self.routing,
            num_steps=np.int32(self.lengths.max()),
        )


def _fit_prompt(prompt: dict, config) -> tuple[np.ndarray, int]:
    """`prompt`'s tokens (right-padded) cut or padded to the generator's prompt width (only
    padding may be cut), and its length."""
    length, width = int(prompt["prompt_length"]), config.prompt_width
    tokens = np.asarray(prompt["prompt_tokens"], np.int32)
    if not 1 <= length <= width:
        raise ValueError(
            f"prompt length {length} does not fit the generator's prompt width "
            f"{width} (set config.async_mode.prompt_width to at least {length})"
        )
    out = np.full((width,), config.sampling.fill_id, np.int32)
    out[:length] = tokens[:length]
    return out, length


class _SlotGroups:
    """What both slot generators share: ``mesh`` (or None) and ``_active``, bool
    [num_groups], a slot group started and not yet handed out."""

    def _on_mesh(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def free_groups(self) -> list[int]:
        return [int(g) for g in np.flatnonzero(~self._active)]

    @property
    def num_active(self) -> int:
        return int(self._active.sum())


class SlotGenerator(_SlotGroups):
    """Slot groups decoded in segments (single-threaded; `AsyncGenerator` runs it in a
    thread; docs/scale.md, "Generation engine").

    Args:
      graphdef: the policy's NNX graph definition (params are passed per call).
      config: the slot geometry and sampling settings.
      params: any parameters of the right structure (used for shapes only).
      mesh: the mesh the parameters live on (``policyopt.sharding``): the slot state is
        placed on it (``slot_specs``) and every step runs under ``jax.set_mesh`` in the
        calling thread (the mesh context is per thread). None: the default device.
    """

    def __init__(self, graphdef, config: SlotConfig, params, mesh: jax.sharding.Mesh | None = None):
        self.graphdef, self.config, self.mesh = graphdef, config, mesh
        # Committed to the device(s) like every later state (the outputs of the jitted
        # refill / segment, pinned to the same shardings): jit keys its cache on
        # committedness and shardings, and a first state placed otherwise would compile
        # the refill (a prefill) more than once.
        model: PolicyModel = nnx.merge(graphdef, params)
        config.sampling.check_vocab(model.config.vocab_size)  # as generate_fn does
        state = init_slot_state(model, config)
        if mesh is None:
            self.state = jax.device_put(state, jax.devices()[0])
        else:
            self.state = jax.device_put(
                state, sharding.named_shardings(slot_specs(state, mesh), mesh)
            )
        self._meta: dict[int, dict] = {}
        self._active = np.zeros((config.num_groups,), bool)

    def refill(self, group: int, prompt: dict, params, version: int) -> None:
        """Starts the G samples of `prompt` in slot `group` (which must be free).

        `prompt` holds ``prompt_tokens`` (int [P'], right-padded), ``prompt_length`` and any
        metadata (kept in ``GroupCompletion.meta``).
        """
        if self._active[group]:
            raise ValueError(f"slot group {group} is still generating")
        cfg = self.config
        tokens, length = _fit_prompt(prompt, cfg)
        with self._on_mesh():
            self.state = _refill_fn(
                self.graphdef,
                params,
                self.state,
                jnp.int32(group),
                tokens,
                jnp.int32(length),
                jnp.int32(version),
                config=cfg,
            )
        self._meta[group] = {
            k: v for k, v in prompt.items() if k not in ("prompt_tokens", "prompt_length")
        }
        self._active[group] = True

    def segment(self, params, version: int, rng: jax.Array) -> list[GroupCompletion]:
        """Runs up to K decode steps under `params` and returns the groups that finished
        (their slots are free afterwards)."""
        cfg = self.config
        with self._on_mesh():
            self.state = _segment_fn(
                self.graphdef, params, self.state, jnp.int32(version), rng, config=cfg
            )
        done = np.asarray(jax.device_get(self.state.done)).reshape(cfg.num_groups, cfg.group_size)
        finished = np.flatnonzero(self._active & done.all(axis=1))
        if finished.size == 0:
            return []
        self._active[finished] = False
        active = np.repeat(self._active, cfg.group_size)  # placed (committed) as the state is
        self.state = self.state.replace(active=jax.device_put(active, self.state.active.sharding))
        return [self._completion(int(g), version) for g in finished]

    def _completion(self, group: int, version: int) -> GroupCompletion:
        """The GroupCompletion of slot ``group``: its G rows, sliced on the device by one
        program compiled once (the group index is traced), then copied to the host."""
        cfg = self.config
        with self._on_mesh():
            fields = jax.device_get(
                _group_rows_fn(self.state, jnp.int32(group), group_size=cfg.group_size)
            )
        lengths = fields["prompt_lengths"].astype(np.int32)
        shift = cfg.prompt_width - int(lengths[0])  # one prompt per group
        prompt = np.where(
            np.arange(cfg.prompt_width)[None] < lengths[:, None],
            fields["prompt_tokens"],
            cfg.sampling.fill_id,
        )
        routing = None
        if fields["routing"] is not None:
            prompt_routing = np.roll(fields["prompt_routing"], shift, axis=2)
            routing = np.concatenate([prompt_routing, fields["routing"]], axis=2).astype(np.int32)
        mask = np.asarray(fields["mask"], np.float32)
        return GroupCompletion(
            tokens=np.asarray(fields["tokens"], np.int32),
            mask=mask,
            log_probs=np.asarray(fields["log_probs"], np.float32),
            raw_log_probs=np.asarray(fields["raw_log_probs"], np.float32),
            lengths=mask.sum(axis=1).astype(np.int32),
            prompt_tokens=np.roll(prompt, shift, axis=1).astype(np.int32),
            prompt_lengths=lengths,
            routing=routing,
            versions=np.asarray(fields["versions"], np.int32),
            start_version=int(fields["start_version"][0]),
            finish_version=int(version),
            meta=self._meta.pop(group),
        )


def engine_pages_needed(
    prompt_width: int, max_new_tokens: int, group_size: int, page_size: int
) -> int:
    """Pages one pool needs so that a single group of G rows, alone, is admitted and
    decodes to its end without waiting, for any prompt length L in [1, P]: the most of

      admission (``scheduler.group_pages``): ceil(L / ps) + (G - 1) [L % ps > 0] + G
      its end:                     floor(L / ps) + G (ceil((L + N) / ps) - floor(L / ps))

    (the prompt's full pages are shared by the G rows, each row holds its own last
    partial prompt page and the pages of its response)."""
    need = 0
    for length in range(1, prompt_width + 1):
        shared = length // page_size
        end = shared + group_size * (pages_for(length + max_new_tokens, page_size) - shared)
        need = max(need, group_pages(length, group_size, page_size), end)
    return need


class EngineSlots(_SlotGroups):
    """``SlotGenerator``'s interface on the paged KV cache of ``policyopt.engine``
    (``sampling.engine_kv_tokens > 0``): a ``ContinuousBatch`` whose requests each keep
    their slot group, one pass per segment (docs/scale.md, "Generation engine").

    Args:
      graphdef: the policy's NNX graph definition (params are passed per call).
      config: the slot geometry and sampling settings (R = num_groups * G rows, P, K).
      params: any parameters of the right structure (used for shapes only).
      kv_tokens: KV token slots of each shard's page pool (the memory budget).
      page_size: token slots per page.
      attention: attention over pages (``models.paged.ATTENTION``; "pool", the engine's
        default: ``EngineConfig.attention``).
      capture_routing: record every token's experts (MoE models), as SlotGenerator does.
      mesh: the mesh the parameters live on, or None: the engine runs one shard per device
        along the row axes (``engine.row_shards``), ``num_groups`` split evenly over them.
    Raises:
      ValueError: num_groups not a multiple of the shards, or a pool that cannot hold one
        group to its end (``engine_pages_needed``).
    """

    def __init__(
        self,
        graphdef,
        config: SlotConfig,
        params,
        *,
        kv_tokens: int,
        page_size: int = 16,
        attention: str = "pool",
        capture_routing: bool = True,
        mesh: jax.sharding.Mesh | None = None,
    ):
        self.graphdef, self.config = graphdef, config
        one_device = mesh if mesh is not None and mesh.size == 1 else None
        mesh = None if one_device is not None else mesh
        shards = row_shards(mesh)
        s = config.sampling
        if config.num_groups % shards:
            raise ValueError(
                f"async_mode.num_slots: {config.num_groups} slot groups cannot be split over "
                f"the engine's {shards} shards (devices on the row axes): needs a multiple"
            )
        need = engine_pages_needed(
            config.prompt_width, s.max_new_tokens, config.group_size, page_size
        )
        if kv_tokens // page_size < need:
            raise ValueError(
                f"config.sampling.engine_kv_tokens = {kv_tokens} cannot hold one group of "
                f"{config.group_size} rows of {config.prompt_width} prompt + "
                f"{s.max_new_tokens} new tokens in pages of {page_size}: needs >= "
                f"{need * page_size}"
            )
        engine_config = EngineConfig(
            kv_tokens=kv_tokens,
            rows=config.rows // shards,
            page_size=page_size,
            attention=attention,
            steps_per_call=config.segment_steps,
            # One prompt per shard and call (a group is admitted as soon as it is refilled),
            # every row decoded over the whole pool: each jitted call compiles once, where
            # buckets of rows or held pages would compile a segment per bucket.
            admit_prompts=1,
            decode_bucket=0,
            held_page_bucket=0,
            capture_routing=capture_routing,
        )
        self.engine = Engine(
            nnx.merge(graphdef, params), engine_config, s, graphdef=graphdef, mesh=mesh
        )
        self.mesh, self.shards = mesh, shards
        with self._on_mesh():
            self.batch = ContinuousBatch(
                self.engine,
                config.prompt_width,
                budget=f"config.sampling.engine_kv_tokens = {kv_tokens}",
            )
        if one_device is not None:
            # Placed as the jitted calls return it with parameters on a one-device mesh
            # (replicated on it): else the first admission compiles admit_rows twice.
            self.batch.state = jax.device_put(
                self.batch.state,
                jax.sharding.NamedSharding(one_device, jax.sharding.PartitionSpec()),
            )
        rows, num_new = config.rows, s.max_new_tokens
        self._active = np.zeros((config.num_groups,), bool)  # started, not handed out
        self._meta: dict[int, dict] = {}
        # Each row's tokens so far, the version of each token's logits and of the row's
        # current logits (the host's record, from each segment's token counts).
        self._count = np.zeros((rows,), np.int32)
        self._versions = np.full((rows, num_new), -1, np.int32)
        self._logits_version = np.zeros((rows,), np.int32)
        self._start_version = np.zeros((config.num_groups,), np.int32)
        # Row-steps spent waiting for a page, groups preempted (recomputed from their
        # prompt), most pages one shard held at once, ... (``Scheduler.stats``).
        self.stats = self.batch.stats

    @property
    def state(self):
        """The engine's device state (``policyopt.engine.empty_state``)."""
        return self.batch.state

    def refill(self, group: int, prompt: dict, params, version: int) -> None:
        """Starts the G samples of `prompt` in slot `group` (which must be free): admitted
        now under `params` if its shard's pool has the pages, else queued and admitted by a
        later `segment`, under that segment's parameters, once pages come back."""
        if self._active[group]:
            raise ValueError(f"slot group {group} is still generating")
        cfg = self.config
        tokens, length = _fit_prompt(prompt, cfg)
        self.batch.scheduler.submit(Request(group, tokens, length, slot=group))
        self._meta[group] = {
            k: v for k, v in prompt.items() if k not in ("prompt_tokens", "prompt_length")
        }
        self._active[group] = True
        with self._on_mesh():
            self._admit(params, version)

    def _admit(self, params, version: int) -> None:
        """Admits what the pools allow (``ContinuousBatch.admit``) under ``version``: its
        rows start with no token and logits of that version."""
        for admission in self.batch.admit(params):
            rows = slice(admission.row0, admission.row0 + admission.num_rows)
            self._count[rows], self._versions[rows] = 0, -1
            self._logits_version[rows] = version
            if admission.num_rows == self.config.group_size:
                self._start_version[admission.slot] = version

    def segment(self, params, version: int, rng: jax.Array) -> list[GroupCompletion]:
        """Admits queued groups, runs up to K decode steps under `params` (a row refused a
        page waits), records each new token's version and returns the groups that
        finished (their slots are free afterwards). A shard on which no row moved gives
        back the pages of its most recently admitted group, queued again at the front,
        and admits nothing until one of its groups finishes (``Scheduler.settle``)."""
        scheduler = self.batch.scheduler
        with self._on_mesh():
            self._admit(params, version)
            scheduler.check_admissible(self.batch.free_pages())
            if not scheduler.running:
                return []
            self.batch.decode(params, rng)
            count = np.asarray(jax.device_get(self.batch.state.count))
            self._record_versions(count, version)
            finished = self.batch.settle()
            completions = [self._completion(slot, request, version) for slot, request in finished]
        for slot, _ in finished:
            self._active[slot] = False
        return completions

    def _record_versions(self, count: np.ndarray, version: int) -> None:
        """Token n's logits came from the forward of token n - 1: the first token a row
        draws in this segment from the one before it (``_logits_version``), the others
        from this segment's."""
        column = np.arange(self.config.sampling.max_new_tokens)[None]
        before, previous = self._count[:, None], self._logits_version[:, None]
        new = (column >= before) & (column < count[:, None])
        self._versions = np.where(
            new, np.where(column == before, previous, version), self._versions
        )
        self._logits_version = np.where(count > self._count, version, self._logits_version)
        self._count = count.astype(np.int32)

    def _completion(self, group: int, request: Request, version: int) -> GroupCompletion:
        cfg, group_size = self.config, self.config.group_size
        fields = self.batch.rows(group)
        rows = finish_rows(
            fields["tokens"],
            fields["log_probs"],
            fields["raw_log_probs"],
            fields["count"],
            cfg.sampling.fill_id,
        )
        length = request.length
        prompt = np.roll(
            np.where(np.arange(cfg.prompt_width) < length, request.tokens, cfg.sampling.fill_id),
            cfg.prompt_width - length,
        )
        routing = fields["routing"]
        return GroupCompletion(
            **rows,
            prompt_tokens=np.repeat(prompt[None], group_size, axis=0).astype(np.int32),
            prompt_lengths=np.full((group_size,), length, np.int32),
            routing=None if routing is None else np.asarray(routing, np.int32),
            versions=np.where(
                rows["mask"] > 0, self._versions[self.batch.scheduler.rows_of(group)], -1
            ).astype(np.int32),
            start_version=int(self._start_version[group]),
            finish_version=int(version),
            meta=self._meta.pop(group),
        )


class GeneratorExhausted(Exception):
    """The prompt source ended and every started group has been taken."""


class AsyncGenerator:
    """Runs a `SlotGenerator` (or `EngineSlots`) in a background thread, next to a trainer.

    The generator thread loops: pick up the latest published parameters; refill free
    slot groups while fewer than `n_async` completions are started and not yet taken; run
    one segment; hand the groups that finished to the scoring thread. The scoring thread
    scores them (`score_fn`) one group at a time, in finish order, and queues them for
    `take`, so decoding does not wait for a verifier while the `n_async` budget lasts
    (a slow verifier delays the groups behind it; groups waiting to be scored count in
    the budget, so a verifier slower than decoding eventually idles the generator). The
    generator never waits for the trainer while a group is in flight; with nothing in
    flight and no budget left it waits for `take`. Errors in
    either thread are re-raised by `take` (and by `close` when no `take` saw them);
    `close` (also on leaving a ``with`` block, on error too) stops the generator between
    segments (and joins it: a segment always ends) and the scorer between groups: it calls
    `interrupt_scoring`, if given, to abandon the group being scored (else that group is
    finished first), and waits `join_timeout_s` for the scorer; a scorer still busy then
    (a verifier blocked in this process, which no time limit can interrupt in a thread) is
    left to finish in the background with a warning.

    Args:
      slots: the slot generator, SlotGenerator or EngineSlots (its R rows are the
        generation slots).
      prompts: iterator of prompt dicts (see `SlotGenerator.refill`).
      params, version: the initial parameters and their version.
      rng: base key; segment i samples with ``fold_in(rng, i)``.
      n_async: most completions started and not yet taken (default R); a multiple of G.
      score_fn: ``GroupCompletion -> GroupCompletion`` with rewards, run in the scoring
        thread (None: groups are queued as they finish).
      join_timeout_s: how long `close` waits for the scoring thread.
      interrupt_scoring: called by `close` after asking the threads to stop, to make the
        scorer's current call return early (``async_rl`` kills the scorer's worker pool).
      weights: turns published parameters into those the slots decode with, once per
        version, in the generator thread (LoRA: the trainer publishes its adapters only,
        joined here to the frozen base or merged into it); None: as published.
      should_stop: polled by `take` while it waits (every 0.5 s at most; also settable
        as the attribute): True makes it raise ``GenerationStopped`` (a trainer's
        SIGINT / SIGTERM, ``async_rl.run_async_rl``); `close` then stops the threads.
    """

    def __init__(
        self,
        slots: "SlotGenerator | EngineSlots",
        prompts: Iterator[dict],
        params,
        version: int,
        *,
        rng: jax.Array,
        n_async: int | None = None,
        score_fn: Callable[[GroupCompletion], GroupCompletion] | None = None,
        join_timeout_s: float = 60.0,
        interrupt_scoring: Callable[[], None] | None = None,
        weights: Callable | None = None,
        should_stop: Callable[[], bool] | None = None,
    ):
        group = slots.config.group_size
        self.n_async = slots.config.rows if n_async is None else int(n_async)
        if self.n_async < group or self.n_async % group:
            raise ValueError(
                f"n_async ({self.n_async}) must be a positive multiple of the group "
                f"size ({group}): groups are started whole"
            )
        self.slots, self.prompts, self.rng = slots, prompts, rng
        self.score_fn, self.join_timeout_s = score_fn, join_timeout_s
        self.interrupt_scoring, self.should_stop = interrupt_scoring, should_stop
        self._cond = threading.Condition()
        self._params, self._version = params, int(version)
        self._weights = weights
        self._decoding: tuple | None = None  # (version, the slots' parameters)
        self._queue: collections.deque[GroupCompletion] = collections.deque()  # for take()
        self._to_score: collections.deque[GroupCompletion] = collections.deque()
        self._outstanding = 0  # completions started and not yet taken
        self._stop = self._exhausted = self._generated_all = False
        self._error: BaseException | None = None
        self._error_seen = False
        # segments, groups_started, idle_waits, groups_scored, score_seconds
        self.stats = collections.Counter()
        self._thread = threading.Thread(
            target=self._run, args=(self._loop,), name="policyopt-async-generator", daemon=True
        )
        self._threads = [self._thread]
        if score_fn is not None:
            self._threads.append(
                threading.Thread(
                    target=self._run,
                    args=(self._score_loop,),
                    name="policyopt-async-scorer",
                    daemon=True,
                )
            )

    # -- trainer side --------------------------------------------------------------------

    def start(self) -> "AsyncGenerator":
        for thread in self._threads:
            thread.start()
        return self

    def publish(self, params, version: int) -> None:
        """Makes `params` the generator's parameters from its next segment on. The caller
        must not donate or delete these buffers afterwards (pass a copy)."""
        with self._cond:
            self._params, self._version = params, int(version)
            self._cond.notify_all()

    def take(self) -> GroupCompletion:
        """The next finished group, in finish order (blocks until there is one, or until
        ``should_stop`` returns True: ``GenerationStopped``)."""
        with self._cond:
            while True:
                self._raise_error()
                if self.should_stop is not None and self.should_stop():
                    raise GenerationStopped(
                        f"asynchronous generation stopped on request with {len(self._queue)} "
                        "finished groups not taken"
                    )
                if self._queue:
                    completion = self._queue.popleft()
                    self._outstanding -= self.slots.config.group_size
                    self._cond.notify_all()
                    return completion
                if self._exhausted:
                    raise GeneratorExhausted("the prompt source is exhausted")
                if not any(thread.is_alive() for thread in self._threads):
                    raise RuntimeError("the async generator thread is not running (call start())")
                self._cond.wait(0.5)

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self) -> None:
        """Stops the generator after its current segment and joins it; stops the scorer
        after its current group (cut short by ``interrupt_scoring``) and waits up to
        ``join_timeout_s`` for it (see the class docstring)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        # The generator stops between segments; a segment always ends (the first one may
        # compile for a while): joined without a limit, so that no thread is left inside
        # XLA when the interpreter exits.
        if self._thread.ident is not None:
            self._thread.join()
        for thread in self._threads[1:]:
            if thread.ident is None:
                continue
            # Interrupt, then wait; again every second: a scorer caught between two steps
            # of its call (decoding, before it reached the pool) may start a new pool.
            end = time.monotonic() + self.join_timeout_s
            while thread.is_alive():
                if self.interrupt_scoring is not None:
                    try:
                        self.interrupt_scoring()
                    except Exception as error:  # noqa: BLE001 - closing goes on
                        logging.warning("interrupting the async scorer failed: %r", error)
                left = end - time.monotonic()
                if left <= 0:
                    break
                thread.join(min(1.0, left))
            if thread.is_alive():
                logging.warning(
                    "the async scoring thread is still scoring a group %.0f s after close(); it is "
                    "left to finish in the background (a verifier blocked in this process: "
                    "reward.num_workers > 0 puts scoring in worker processes, which close() "
                    "stops)",
                    self.join_timeout_s,
                )
        with self._cond:
            self._raise_error()

    def __enter__(self) -> "AsyncGenerator":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:  # the caller's exception wins; the thread still stops
            with self._cond:
                if self._error is not None and not self._error_seen:
                    logging.error("the async generator thread had failed too: %r", self._error)
                self._error_seen = True
        self.close()

    def _raise_error(self) -> None:
        if self._error is not None and not self._error_seen:
            self._error_seen = True
            raise RuntimeError(
                f"the async generator thread failed: {self._error!r}"
            ) from self._error

    # -- generator thread ------------------------------------------------------------------

    def _run(self, loop) -> None:
        try:
            loop()
        except BaseException as error:  # re-raised in the trainer by take() / close()
            with self._cond:
                if self._error is None:  # the first failure; the other thread stops
                    self._error = error
                self._stop = True
                self._cond.notify_all()

    def _finished(self, completion: GroupCompletion) -> None:
        """A group is complete: to the scorer, or (without ``score_fn``) to `take`."""
        with self._cond:
            (self._queue if self.score_fn is None else self._to_score).append(completion)
            self._cond.notify_all()

    def _loop(self) -> None:
        group = self.slots.config.group_size
        segment, source_done = 0, False
        while True:
            with self._cond:
                if self._stop:
                    return
                params, version = self._params, self._version
                free = self.slots.free_groups()
                starts = (
                    0
                    if source_done
                    else min(len(free), (self.n_async - self._outstanding) // group)
                )
                self._outstanding += starts * group  # reserved before the prompts are read
            params = self._decode_params(params, version)
            started = 0
            for slot in free[:starts]:
                try:
                    prompt = next(self.prompts)
                except StopIteration:
                    source_done = True
                    break
                self.slots.refill(slot, prompt, params, version)
                started += 1
            if started < starts:
                with self._cond:
                    self._outstanding -= (starts - started) * group
            self.stats["groups_started"] += started
            if self.slots.num_active == 0:
                with self._cond:
                    if source_done:
                        self._generated_all = True  # the scorer (if any) ends the stream
                        self._exhausted = self.score_fn is None
                        self._cond.notify_all()
                        return
                    # Nothing in flight and no budget: wait for the trainer to take some.
                    self.stats["idle_waits"] += 1
                    self._cond.wait_for(
                        lambda: self._stop or self._outstanding + group <= self.n_async, timeout=1.0
                    )
                continue
            finished = self.slots.segment(params, version, jax.random.fold_in(self.rng, segment))
            segment += 1
            self.stats["segments"] += 1
            for completion in finished:
                self._finished(completion)

    def _decode_params(self, params, version: int):
        """The slots' parameters of a published version (``weights``), made once."""
        if self._weights is None:
            return params
        if self._decoding is None or self._decoding[0] != version:
            self._decoding = (version, self._weights(params))
        return self._decoding[1]

    def _score_loop(self) -> None:
        """Scores finished groups in finish order and queues them for `take`."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._to_score or self._generated_all)
                if self._stop:
                    return
                if not self._to_score:  # generation is over and everything is scored
                    self._exhausted = True
                    self._cond.notify_all()
                    return
                completion = self._to_score.popleft()
            start = time.perf_counter()
            completion = self.score_fn(completion)
            with self._cond:
                self._queue.append(completion)
                self.stats["groups_scored"] += 1
                self.stats["score_seconds"] += time.perf_counter() - start
                self._cond.notify_all()
