"""Sequence packing for the training forwards: rows of real tokens in fixed token buckets.

The training layout (``policyopt.rl.batch``) pads every row to ``[R, S]``, ``S = P + N``:
the prompt left-padded to the prompt bucket, the response right-padded to the response
bucket. A batch of short and long responses then spends most of its forward on padding.
Packing places the real tokens of every row (``attention_mask`` 1: the prompt and the
valid response, which are contiguous in the training layout) one after another in packed
rows of ``T`` slots, ``[N_p, T]``, and runs the model there:

- **segments**: ``segment_ids[p, t]`` is ``r + 1`` for a slot holding a token of row
  ``r``, 0 on padding; attention is causal *within* a segment only (the model's
  ``segment_ids`` argument), so every token sees exactly the keys it sees in the padded
  layout, where padding keys are masked out;
- **positions**: each token keeps its RoPE position of the padded layout (``0 .. p - 1``
  on the prompt, ``p + n`` on the response), so each row restarts at 0 in its segment;
- **placement**: first-fit decreasing. Rows are taken longest first (ties by row index)
  and each goes into the first packed row with room for it, a new one if none has;
  FFD uses at most ``11/9 OPT + 6/9`` packed rows (Dosa 2007), and never more rows than
  the padded layout when ``T >= S``;
- **index maps**: ``source[p, t]`` is the flat padded index ``r * S + s`` of the token in
  slot ``(p, t)`` (-1 on padding) and ``target[r, s]`` the flat packed index
  ``p * T + t`` where padded slot ``(r, s)`` went (-1 for padding). ``gather_slots`` with
  ``source`` packs any per-slot array (tokens, positions, routing ``[L, R, S, k]`` to
  replay); with ``target`` it brings per-slot results (hidden-state functions, log-probs,
  values, entropies, recorded routing) back to the padded layout, so that every loss
  stays a function of ``[R, N]`` arrays per original row (GSPO's sequence ratio, group
  and per-sequence denominators are unchanged).

The log-prob of response token ``n`` of row ``r`` comes from the hidden state at padded
column ``P - 1 + n`` and the token at ``P + n``: in the packed layout, from slot
``target[r, P - 1 + n]`` and the next slot of the same segment (tokens keep their order).

Layouts are computed on the host (NumPy) from the attention mask; the gathers run on
the device inside the jitted forwards. The packed row count is rounded up to
``multiple * 2**j`` (``packed_rows``), so a run compiles a bounded number of shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class PackedLayout(NamedTuple):
    """Where each real token of ``R`` padded rows of ``S`` slots sits in ``N_p`` packed rows
    of ``T`` slots (a pytree: NumPy arrays on the host, device arrays inside jit).

    Attributes:
      segment_ids: int32 ``[N_p, T]``: original row + 1 of the token in each slot, 0 on
        padding.
      source: int32 ``[N_p, T]``: flat padded index ``r * S + s`` of each slot's token,
        -1 on padding.
      target: int32 ``[R, S]``: flat packed index ``p * T + t`` of each padded slot's
        token, -1 where the padded slot is padding.
    """

    segment_ids: np.ndarray
    source: np.ndarray
    target: np.ndarray

    @property
    def num_real(self) -> int:
        """Real tokens placed (host layouts only)."""
        return int(np.sum(np.asarray(self.segment_ids) > 0))

    @property
    def padding_fraction(self) -> float:
        """Share of packed slots that are padding (host layouts only)."""
        return 1.0 - self.num_real / max(int(np.size(self.segment_ids)), 1)


def packed_rows(count: int, multiple: int = 1, padded: int | None = None) -> int:
    """The packed row count used for ``count`` filled rows: the smallest ``multiple * 2**j``
    that is ``>= count`` (``multiple``: the row shards of the mesh), so that a run sees at
    most ``log2(R) + 2`` packed shapes per row length; but never more than ``padded`` (the
    padded layout's row count) rounded up to ``multiple`` when ``count`` fits there."""
    multiple = max(int(multiple), 1)
    rows = multiple
    while rows < count:
        rows *= 2
    if padded is not None:
        cap = -(-int(padded) // multiple) * multiple
        if count <= cap:
            rows = min(rows, cap)
    return rows


def row_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """int64 ``[R]``: real tokens per row, checked to be contiguous (the training layout).

    Raises:
      ValueError: naming the first row whose real tokens have a gap.
    """
    real = np.asarray(attention_mask) > 0
    lengths = real.sum(axis=1)
    first = np.argmax(real, axis=1)
    last = real.shape[1] - 1 - np.argmax(real[:, ::-1], axis=1)
    gaps = np.flatnonzero((lengths > 0) & (last - first + 1 != lengths))
    if gaps.size:
        r = int(gaps[0])
        raise ValueError(
            f"row {r}: its real tokens (attention_mask 1) are not contiguous "
            f"(columns {first[r]}..{last[r]} hold {lengths[r]}); packing needs the "
            "training layout of policyopt.rl.batch"
        )
    return lengths


def pack_layout(
    attention_mask: np.ndarray,
    row_length: int,
    *,
    row_multiple: int = 1,
    field: str = "config.batch.pack_tokens",
    row_ids=None,
) -> PackedLayout:
    """First-fit-decreasing packing of the real tokens of ``attention_mask``'s rows.

    Args:
      attention_mask: ``[R, S]``, 1 on real tokens (contiguous in each row).
      row_length: ``T``, slots per packed row.
      row_multiple: the packed row count is ``packed_rows(filled, row_multiple)``.
      field: the setting ``row_length`` came from, named in errors.
      row_ids: ``[R]`` the rows' numbers in errors (a minibatch's rows in its batch);
        None: ``0 .. R - 1``.

    Returns:
      ``PackedLayout`` of NumPy int32 arrays ``[N_p, T]`` and ``[R, S]``.

    Raises:
      ValueError: a row longer than ``row_length`` (naming the row and both lengths),
        or real tokens that are not contiguous.
    """
    attention_mask = np.asarray(attention_mask)
    rows, width = attention_mask.shape
    lengths = row_lengths(attention_mask)
    if row_length < 1:
        raise ValueError(f"{field} must be >= 1, got {row_length}")
    too_long = np.flatnonzero(lengths > row_length)
    if too_long.size:
        r = int(too_long[0])
        name = r if row_ids is None else int(row_ids[r])
        raise ValueError(
            f"row {name} has {lengths[r]} real tokens (prompt and response), more than "
            f"the packed row length {row_length} ({field}); {too_long.size} row(s) "
            f"do not fit, the longest has {lengths.max()} tokens"
        )
    order = np.argsort(-lengths, kind="stable")
    free = np.zeros((rows,), np.int64)  # free slots of each opened packed row
    bin_of = np.full((rows,), -1, np.int64)
    offset_of = np.zeros((rows,), np.int64)
    opened = 0
    for r in order:
        length = lengths[r]
        if length == 0:
            continue
        fits = np.flatnonzero(free[:opened] >= length)
        if fits.size:
            p = int(fits[0])
        else:
            p, opened = opened, opened + 1
            free[p] = row_length
        bin_of[r], offset_of[r] = p, row_length - free[p]
        free[p] -= length
    num_packed = packed_rows(opened, row_multiple, rows)
    segment_ids = np.zeros((num_packed, row_length), np.int32)
    source = np.full((num_packed, row_length), -1, np.int32)
    target = np.full((rows, width), -1, np.int32)
    first = np.argmax(attention_mask > 0, axis=1)
    for r in np.flatnonzero(bin_of >= 0):
        p, start, length = bin_of[r], offset_of[r], lengths[r]
        cols = first[r] + np.arange(length)
        slots = start + np.arange(length)
        segment_ids[p, slots] = r + 1
        source[p, slots] = r * width + cols
        target[r, cols] = p * row_length + slots
    return PackedLayout(segment_ids, source, target)


def gather_slots(x, index, *, axis: int = 0, fill=0):
    """``x`` read at flat slot indices: packs (``index = layout.source``) or unpacks
    (``index = layout.target``, or columns of it) any per-slot array.

    ``x``'s dimensions ``axis`` and ``axis + 1`` (rows, slots) are flattened and replaced
    by ``index``'s shape: ``out[..., i, j, ...] = x_flat[..., index[i, j], ...]``, and
    ``fill`` where ``index`` is -1. A gather, so its gradient (a scatter-add) reaches
    exactly the slots read.

    Args:
      x: ``[..., A, B, ...]`` (NumPy or JAX) with the slot dimensions at ``axis``.
      index: int ``[I, J]`` flat indices into ``A * B``, -1 for ``fill``.
      axis: where the two slot dimensions of ``x`` start.
      fill: the value of unset slots.

    Returns:
      ``[..., I, J, ...]`` in ``x``'s dtype.
    """
    x = jnp.asarray(x)
    index = jnp.asarray(index)
    shape = x.shape
    flat = x.reshape(shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2 :])
    out = jnp.take(flat, jnp.maximum(index, 0).reshape(-1), axis=axis)
    out = out.reshape(shape[:axis] + index.shape + shape[axis + 2 :])
    valid = (index >= 0).reshape((1,) * axis + index.shape + (1,) * (x.ndim - axis - 2))
    return jnp.where(valid, out, jnp.asarray(fill, x.dtype))
