"""The batch's forward passes in the minibatch's shape, and the packed layouts they run on.

The old-log-prob, reference, value and routing-metric passes over a whole batch run as
``config.batch.n_minibatches`` equal row chunks (``map_row_chunks``): each chunk has the
minibatch's shape, so the passes compile once and need a minibatch's memory, and their
numerics are those of the updates (no batch-shape noise floor in the routing metrics).

With ``config.batch.pack`` the passes and every update run on packed rows
(``pack_rows``, ``chunk_layouts``; ``policyopt.rl.update.packing``): a chunk's real tokens
are packed first-fit-decreasing into rows of ``batch.pack_tokens`` slots with segment ids,
and their per-token results come back to the padded rows.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from policyopt import sharding
from policyopt.rl.batch import Batch
from policyopt.rl.update.packing import PackedLayout, pack_layout


def policy_log_probs(learner, params, rows: Batch, chunks: tuple, routing=None):
    """``learner.log_probs`` of the rows of ``rows`` (a ``Batch``: its tokens, positions and
    masks; old or reference log-probs) in the chunks ``chunks`` (``chunk_layouts``),
    replaying ``routing`` (``[L, R, S, k]``, or None): ``(log_probs [R, N], routing used
    [L, R, S, k] or None)``."""

    def forward(tokens, positions, attention_mask, mask, replay, packing):
        log_probs, _, used = learner.log_probs(
            params, tokens, positions, attention_mask, mask, replay, packing
        )
        return log_probs, used

    arrays = (rows.tokens, rows.positions, rows.attention_mask, rows.mask, routing)
    return map_row_chunks(
        forward, len(chunks), arrays, axes=(0, 0, 0, 0, 1), packings=chunks, out_axes=(0, 1)
    )


def critic_values(critic, params, rows: Batch, chunks: tuple, frozen=None) -> jax.Array:
    """``critic.values`` of the rows of ``rows`` in the chunks ``chunks``: ``[R, N]``, 0
    where ``rows.mask`` is 0 (``frozen``: the base of a LoRA critic's adapters)."""
    arrays = (rows.tokens, rows.positions, rows.attention_mask, rows.mask)

    def values(tokens, positions, attention_mask, mask, packing):
        return critic.values(
            params, tokens, positions, attention_mask, mask, packing, frozen=frozen
        )

    return map_row_chunks(values, len(chunks), arrays, packings=chunks)


def map_row_chunks(
    fn: Callable,
    num_chunks: int,
    arrays: Sequence,
    *,
    axes: Sequence[int] = (),
    packings: Sequence | None = None,
    out_axes: int | tuple = 0,
):
    """``fn`` over ``num_chunks`` equal row chunks of ``arrays``, its outputs concatenated.

    Chunk ``c`` holds rows ``[c R / C, (c + 1) R / C)`` of every array (along its axis in
    ``axes``, default 0; a None array stays None), placed as a batch's rows
    (``sharding.shard_rows``), and calls ``fn(*chunk_arrays, packing)`` with chunk ``c``'s
    ``PackedLayout`` on the mesh (``packings[c]``; None without ``packings``).

    Args:
      fn: ``(*arrays, packing) -> output``, an array or a tuple of arrays (or Nones).
      num_chunks: C, dividing the rows ``R`` of ``arrays[0]``.
      arrays: the row arrays, ``[R, ...]`` (or rows along ``axes[i]``).
      axes: each array's row axis (default 0 for all).
      packings: C layouts (``chunk_layouts``), None entries or None: padded rows.
      out_axes: the row axis of the output, or of each output of a tuple.

    Returns:
      ``fn``'s output over all ``R`` rows (an output that is None stays None).
    """
    axes = tuple(axes) or (0,) * len(arrays)
    per = arrays[0].shape[axes[0]] // num_chunks
    results = []
    for c in range(num_chunks):
        chunk = [_rows(x, c * per, (c + 1) * per, axis) for x, axis in zip(arrays, axes)]
        results.append(fn(*chunk, _place_packing(packings[c] if packings else None)))

    def concatenate(parts, axis):
        return None if parts[0] is None else jnp.concatenate(parts, axis=axis)

    if isinstance(out_axes, tuple):
        return tuple(concatenate([r[i] for r in results], axis) for i, axis in enumerate(out_axes))
    return concatenate(results, out_axes)


def pack_rows(config, attention_mask: np.ndarray, rows=None) -> PackedLayout | None:
    """The packed layout of a minibatch's rows (host ``[R, S]`` attention mask) with
    ``config.batch.pack`` on, else None: rows of ``batch.pack_tokens`` slots (None: the
    padded width ``S``), their number a multiple of the mesh's row shards (``data`` x
    ``fsdp``, so they split like a batch's rows). A row longer than the packed row is a
    ValueError naming it (``packing.pack_layout``; ``rows``: the rows' numbers in the
    batch, for that message)."""
    if not config.batch.pack:
        return None
    mesh = jax.sharding.get_mesh()
    shards = 1 if mesh.empty else int(np.prod([mesh.shape.get(a, 1) for a in ("data", "fsdp")]))
    row_length = config.batch.pack_tokens or attention_mask.shape[1]
    return pack_layout(attention_mask, row_length, row_multiple=shards, row_ids=rows)


def chunk_layouts(config, attention_mask: np.ndarray, num_chunks: int) -> tuple:
    """The ``num_chunks`` equal row chunks the old-log-prob, reference and value passes
    run in: each chunk's ``pack_rows`` (``config.batch.pack``), or None (padded rows)."""
    if not config.batch.pack:
        return (None,) * num_chunks
    per = attention_mask.shape[0] // num_chunks
    chunks = [np.arange(c * per, (c + 1) * per) for c in range(num_chunks)]
    return tuple(pack_rows(config, attention_mask[rows], rows) for rows in chunks)


def _place_packing(packing: PackedLayout | None) -> PackedLayout | None:
    """A host ``PackedLayout`` on the mesh, each array's rows split as a batch's."""
    return None if packing is None else PackedLayout(*(sharding.shard_rows(x) for x in packing))


def _rows(x, start: int, stop: int, axis: int = 0):
    """Rows ``[start, stop)`` of ``x`` (along ``axis``), placed as a batch's rows
    (``sharding.shard_rows``); None stays None."""
    if x is None:
        return None
    return sharding.shard_rows(jax.lax.slice_in_dim(x, start, stop, axis=axis), axis=axis)
