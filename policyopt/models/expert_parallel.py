"""Expert parallelism: the MoE block under ``jax.shard_map``, each token copy sent to the
device holding its expert and back.

With a mesh whose ``expert`` axis has n_ep > 1 devices, the tokens' rows split over the
row axes (``batch``: data x fsdp x expert) and experts [E, ...] split over ``expert``
(E_l = E / n_ep per device), the block runs under ``jax.shard_map``; per device, with
its n local tokens and m = n k copies:

  0. the router and expert weights arrive as their FSDP shards (model width D split
     over the ``embed`` rule's axes) and are all-gathered along D in the block, so that
     their gradients are reduce-scattered back onto the shards (ZeRO-3);
  1. route the local tokens (replay takes the local rows of [B, T, k]); aux
     statistics psum-ed over the row axes (``router_aux``);
  2. sort the copies by expert id: the copies for device j (experts j E_l ... ) are a
     contiguous run of s_j copies;
  3. send each run to its device over the expert axis: ``all_to_all`` of fixed
     [n_ep, C, D] buffers, C = ceil(f m / n_ep) copies per device pair
     (f = moe_ep_buffer_factor), or ``ragged_all_to_all`` of exactly s_j rows into a
     receive buffer of C = ceil(f m) rows;
  4. run the received rows through the E_l local experts (the blocked / ragged /
     megablox / dense computation of one device, k = 1, gate 1; empty buffer rows are
     zeros and give zeros: SwiGLU(0) = 0; the megablox kernel inside the shard_map as
     ``_gmm`` in ``policyopt.models.experts`` says);
  5. send the outputs back the same way, put them in copy order and combine them with
     the gates: y_n = sum_j g_nj out_nj.

Dropless with bounded memory: all_to_all runs ceil(max_j s_j / C) passes (max over
every device; pass p carries the copies of rank [p C, (p + 1) C) for their device;
one pass at f >= the imbalance), a while loop with its own backward pass. When a
device would receive more than the ragged buffer holds, the step takes the all_to_all
passes instead (one ``lax.cond``, the predicate pmax-ed over the mesh so every device
takes the same branch). Everything but the buffers is the arithmetic of one device,
so loss, gradients and routing match it up to float summation order. LoRA adapters
(``policyopt.models.lora``) are split and gathered as their weights are.

On a mesh with ``fsdp`` and no ``expert`` axis the same block runs steps 0-1 and the
dispatch of one device (``dropless_experts``) on each device's rows, under
``jax.checkpoint`` (docs/scale.md, "Expert parallelism"); ``tensor`` meshes and the
"capacity" dispatch keep the plain path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from policyopt.models import lora
from policyopt.models.config import ModelConfig
from policyopt.models.experts import (
    blocked_experts,
    configured_experts,
    dense_experts,
    ragged_experts,
)
from policyopt.models.router import route, router_aux
from policyopt.sharding import fsdp_dim, logical_to_mesh_axes


def _row_axes(mesh) -> tuple[str, ...]:
    """Mesh axes (size > 1) that split the rows: the ``batch`` rule's, in order."""
    target = logical_to_mesh_axes(("batch",), mesh_axis_names=mesh.axis_names)[0]
    names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    return tuple(a for a in names if mesh.shape[a] > 1)


def _width_axes(mesh, hidden_size: int) -> tuple[str, ...]:
    """Mesh axes (size > 1) that split the model width D of the weights (the ``embed``
    rule's, FSDP), or () where they do not divide ``hidden_size`` (the weights are then
    replicated along D, as ``policyopt.sharding.param_specs`` places them)."""
    target = logical_to_mesh_axes(("embed",), mesh_axis_names=mesh.axis_names)[0]
    names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    names = tuple(a for a in names if mesh.shape[a] > 1)
    return names if hidden_size % int(np.prod([mesh.shape[a] for a in names])) == 0 else ()


def expert_parallel_mesh(config: ModelConfig, rows: int):
    """``(mesh, row_axes)`` when the MoE block runs under ``jax.shard_map``
    (``expert_parallel_block``), else None.

    Two meshes take it (a mesh set by ``jax.set_mesh``, a dropless dispatch, not
    "capacity", and row axes that divide ``rows``; a batch the mesh cannot split, e.g.
    one evaluation prompt, takes the plain path, whose shardings XLA propagates):

    - expert parallel: an ``expert`` axis of size > 1;
    - FSDP without an ``expert`` axis: an ``fsdp`` axis that splits the model width
      (the ``embed`` rule), one expert group: each device runs every expert on its own
      rows, the weights all-gathered along D in the block so that their gradients are
      reduce-scattered onto their shards, as ``policyopt.sharding.fsdp_call`` does for
      the dense layers (and under its conditions: ``Auto`` row axes, not already inside
      a ``shard_map``), on a mesh whose axes of size > 1 are all row axes (a ``tensor``
      axis keeps the plain path, its split of F left to the partitioner).

    Raises:
      ValueError: the expert axis does not divide ``config.num_experts``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    n_ep = mesh.shape.get("expert", 1)
    if config.num_experts % n_ep:
        raise ValueError(
            f"mesh.expert={n_ep} does not divide ModelConfig.num_experts="
            f"{config.num_experts}: every device must hold num_experts / expert "
            "experts"
        )
    axes = _row_axes(mesh)
    split = int(np.prod([mesh.shape[a] for a in axes]))
    if n_ep == 1:
        width = _width_axes(mesh, config.hidden_size)
        split_axes = {a for a in mesh.axis_names if mesh.shape[a] > 1}
        fsdp = width and not mesh.manual_axes and set(width) <= split_axes == set(axes)
        if not fsdp or not split_axes <= set(mesh.auto_axes):
            return None
    elif "expert" not in axes:
        return None
    if rows % split:
        return None
    return mesh, axes


def _local_experts(rows, local_ids, params, config: ModelConfig, dispatch: str):
    """Step 4: [M, D] rows through this device's experts (``local_ids`` int32 [M] in
    [0, E_l)); the per-row outputs [M, D], unweighted."""
    ids, ones = local_ids[:, None], jnp.ones((rows.shape[0], 1), rows.dtype)
    if dispatch == "blocked":
        return blocked_experts(
            rows,
            ids,
            ones,
            *params,
            block_size=config.moe_block_size,
            gather=config.resolved_weight_gather(),
            chunk_rows=config.moe_chunk_rows,
        )
    weights = [w.astype(rows.dtype) for w in params]
    if dispatch in ("ragged", "megablox"):
        matmul = "megablox" if dispatch == "megablox" else "ragged_dot"
        return ragged_experts(rows, ids, ones, *weights, matmul=matmul)
    return dense_experts(rows, ids, ones, *weights)


def _sort_by_destination(expert_ids, n_ep: int, e_local: int):
    """Steps 2-3 bookkeeping: copies sorted by expert (stable), each copy's destination
    device, its rank among the copies for that device, and the copies per device."""
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    dest = sorted_ids // e_local
    send_counts = jnp.bincount(dest, length=n_ep).astype(jnp.int32)
    dest_start = jnp.cumsum(send_counts) - send_counts
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - dest_start[dest]
    return order, sorted_ids, dest, rank, send_counts, dest_start


def _varying_like(value, ref):
    """``value`` typed as varying over the mesh axes ``ref`` varies over (``shard_map``'s
    check_vma: a loop carry must keep one type across iterations)."""
    varying = lambda x: set(jax.typeof(x).mat.varying)
    missing = tuple(sorted(varying(ref) - varying(value)))
    return jax.lax.pcast(value, missing, to="varying") if missing else value


def _as_bits(x):
    """A float array as the unsigned integers of its bit pattern (other dtypes as they are).

    The passes only move rows (scatter into buffers, all_to_all, gather, select): on
    their bits, the moves keep the storage width on every backend. XLA:CPU's float
    normalization otherwise runs every bfloat16 gather, scatter, select and collective in
    float32, on float32 copies of the buffers (qwen3_30b_a3b at 32k tokens, 64 devices:
    the pass buffers were f32[8, 65536, 2048], 4 GiB each; benchmarks/HISTORY.md "2026-12-02:
    expert parallelism at 32k tokens")."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _from_bits(bits, dtype):
    """The inverse of ``_as_bits``."""
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def _pass_send(rows, dest, slot, n_ep: int, capacity: int):
    """Pack the copies of one pass (0 <= slot < capacity) into [n_ep, capacity, ...] by
    destination and exchange them over the expert axis: [source, capacity, ...] (empty
    slots are zeros)."""
    inside = (slot >= 0) & (slot < capacity)
    bits = _as_bits(rows)
    buf = jnp.zeros((n_ep, capacity) + rows.shape[1:], bits.dtype)
    buf = buf.at[dest, jnp.where(inside, slot, capacity)].set(
        bits, mode="drop", unique_indices=True
    )
    return _from_bits(jax.lax.all_to_all(buf, "expert", 0, 0), rows.dtype)


def _pass_return(out, dest, slot, n_ep: int, capacity: int, into):
    """The reverse of ``_pass_send``: outputs [n_ep * capacity, D] back to their copies,
    written into ``into`` [M, D] (bits, ``_as_bits``) at the copies of the pass: every copy
    travels in exactly one pass."""
    inside = (slot >= 0) & (slot < capacity)
    back = jax.lax.all_to_all(_as_bits(out).reshape(n_ep, capacity, -1), "expert", 0, 0)
    return jnp.where(inside[:, None], back[dest, jnp.clip(slot, 0, capacity - 1)], into)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _multipass(local_fn, n_ep, capacity, x_sorted, params, dest, rank, local_ids, passes):
    """Steps 3-5 over fixed [n_ep, capacity, D] buffers (``lax.all_to_all``), in as many
    passes as the largest load needs: pass p carries the copies of rank
    [p C, (p + 1) C) among those for their device, so nothing is dropped and no buffer
    exceeds C per device pair. A ``while_loop`` (the trip count is data-dependent, the
    same on every device), with its own backward pass (``_multipass_bwd``) since a
    while_loop has no reverse-mode derivative.

    Args:
      local_fn: (rows [R, D], local ids int32 [R], params) -> [R, D].
      x_sorted: [M, D] copies sorted by expert; dest, rank, local_ids: int32 [M] their
        device, rank among the copies for it, expert on it; passes: int32 scalar.
    Returns:
      [M, D] expert outputs of the copies, in the same order.
    """

    def body(p, y):
        slot = rank - p * capacity
        recv = _pass_send(x_sorted, dest, slot, n_ep, capacity)
        ids = _pass_send(local_ids, dest, slot, n_ep, capacity)
        out = local_fn(recv.reshape(n_ep * capacity, -1), ids.reshape(-1), params)
        return _pass_return(out.astype(x_sorted.dtype), dest, slot, n_ep, capacity, y)

    y = _varying_like(jnp.zeros_like(_as_bits(x_sorted)), x_sorted)
    return _from_bits(jax.lax.fori_loop(0, passes, body, y), x_sorted.dtype)


def _multipass_fwd(local_fn, n_ep, capacity, x_sorted, params, dest, rank, local_ids, passes):
    y = _multipass(local_fn, n_ep, capacity, x_sorted, params, dest, rank, local_ids, passes)
    return y, (x_sorted, params, dest, rank, local_ids, passes)


def _multipass_bwd(local_fn, n_ep, capacity, residuals, dy):
    """The same passes again: each sends its copies' inputs and output cotangents to
    their experts, which recompute the forward and take its vjp; the input cotangents
    travel back, the weight cotangents stay on the experts' device."""
    x_sorted, params, dest, rank, local_ids, passes = residuals

    def body(p, carry):
        dx, dparams = carry
        slot = rank - p * capacity
        rows = _pass_send(x_sorted, dest, slot, n_ep, capacity).reshape(n_ep * capacity, -1)
        grads = _pass_send(dy, dest, slot, n_ep, capacity).reshape(n_ep * capacity, -1)
        ids = _pass_send(local_ids, dest, slot, n_ep, capacity).reshape(-1)
        _, vjp = jax.vjp(lambda r, w: local_fn(r, ids, w), rows, params)
        d_rows, d_params = vjp(grads.astype(rows.dtype))
        dx = _pass_return(d_rows.astype(x_sorted.dtype), dest, slot, n_ep, capacity, dx)
        return dx, jax.tree.map(jnp.add, dparams, d_params)

    dx = _varying_like(jnp.zeros_like(_as_bits(x_sorted)), x_sorted)
    dparams = jax.tree.map(lambda w: _varying_like(jnp.zeros_like(w), w), params)
    dx, dparams = jax.lax.fori_loop(0, passes, body, (dx, dparams))
    return _from_bits(dx, x_sorted.dtype), dparams, None, None, None, None


_multipass.defvjp(_multipass_fwd, _multipass_bwd)


def _all_to_all_exchange(
    x,
    expert_ids,
    params,
    local_fn,
    n_ep: int,
    e_local: int,
    capacity: int,
    all_axes: tuple[str, ...],
):
    """Steps 2-5 over the static all_to_all (``_multipass``), ceil(max load / capacity)
    passes, max over every device. Returns [N k, D] in copy order (token-major)."""
    k = expert_ids.shape[1]
    order, sorted_ids, dest, rank, send_counts, _ = _sort_by_destination(expert_ids, n_ep, e_local)
    load = jax.lax.pmax(jnp.max(send_counts), all_axes)
    passes = (load + capacity - 1) // capacity
    x_sorted = jnp.take(x, order // k, axis=0)
    y_sorted = _multipass(
        local_fn, n_ep, capacity, x_sorted, params, dest, rank, sorted_ids - dest * e_local, passes
    )
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)


def _ragged_exchange(x, expert_ids, params, local_fn, n_ep: int, e_local: int, capacity: int):
    """Steps 2-5 with ``lax.ragged_all_to_all``: each device sends exactly its s_j copies
    to device j and receives them into a buffer of ``capacity`` rows (the caller
    guarantees the sum received fits). Returns [N k, D] as ``_all_to_all_exchange``."""
    n, k = expert_ids.shape
    d = x.shape[-1]
    order, sorted_ids, dest, _, send_counts, dest_start = _sort_by_destination(
        expert_ids, n_ep, e_local
    )
    me = jax.lax.axis_index("expert")
    counts = jax.lax.all_gather(send_counts, "expert")  # [source, destination]
    recv_sizes = counts[:, me]
    # Where device i's rows for device j start on j: after the rows of sources < i.
    output_offsets = (jnp.cumsum(counts, axis=0) - counts)[me]
    x_sorted = jnp.take(x, order // k, axis=0)
    # Receive buffers typed as varying over the mesh like the data (shard_map's check_vma:
    # the collective's result has its ``output`` operand's type).
    buffer = lambda shape, dtype: _varying_like(jnp.zeros(shape, dtype), x_sorted)
    recv = _RAGGED_ALL_TO_ALL(
        x_sorted,
        buffer((capacity, d), x.dtype),
        dest_start,
        send_counts,
        output_offsets,
        recv_sizes,
        axis_name="expert",
    )
    recv_ids = _RAGGED_ALL_TO_ALL(
        (sorted_ids - dest * e_local)[:, None],
        buffer((capacity, 1), jnp.int32),
        dest_start,
        send_counts,
        output_offsets,
        recv_sizes,
        axis_name="expert",
    )[:, 0]
    filled = jnp.arange(capacity) < jnp.sum(recv_sizes)
    out = local_fn(jnp.where(filled[:, None], recv, 0), jnp.where(filled, recv_ids, 0), params)
    recv_start = jnp.cumsum(recv_sizes) - recv_sizes
    # On source i, its copies for this device started at its dest_start[me].
    source_offsets = (jnp.cumsum(counts, axis=1) - counts)[:, me]
    y_sorted = _RAGGED_ALL_TO_ALL(
        out,
        buffer((n * k, d), out.dtype),
        recv_start,
        recv_sizes,
        source_offsets,
        send_counts,
        axis_name="expert",
    )
    return jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)


# The collective itself, a module attribute so that the CPU tests can check the offset
# arithmetic above against a reference implementation of its semantics (XLA:CPU does
# not compile ragged-all-to-all).
_RAGGED_ALL_TO_ALL = jax.lax.ragged_all_to_all


def _exchange(
    x,
    expert_ids,
    params,
    local_fn,
    n_ep: int,
    e_local: int,
    transport: str,
    factor: float,
    all_axes: tuple[str, ...],
):
    """Steps 2-5, dropless with bounded buffers. Returns [N k, D] in copy order.

    "all_to_all": per device pair C = ceil(f m / n_ep) copies a pass, as many passes as
    the most loaded pair needs. "ragged_all_to_all": C = ceil(f m) rows received per
    device; when any device would receive more, the step takes the all_to_all passes
    instead (one ``lax.cond``, its predicate pmax-ed over the mesh).
    """
    m = expert_ids.size
    static = functools.partial(
        _all_to_all_exchange,
        params=params,
        local_fn=local_fn,
        n_ep=n_ep,
        e_local=e_local,
        all_axes=all_axes,
        capacity=min(m, math.ceil(factor * m / n_ep)),
    )
    if transport == "all_to_all":
        return static(x, expert_ids)
    if transport != "ragged_all_to_all":
        raise ValueError(
            f"ModelConfig.moe_ep_transport must be 'ragged_all_to_all' or "
            f"'all_to_all' here, got {transport!r}"
        )
    capacity = min(n_ep * m, math.ceil(factor * m))
    ragged = functools.partial(
        _ragged_exchange,
        params=params,
        local_fn=local_fn,
        n_ep=n_ep,
        e_local=e_local,
        capacity=capacity,
    )
    if capacity == n_ep * m:
        return ragged(x, expert_ids)
    _, _, _, _, send_counts, _ = _sort_by_destination(expert_ids, n_ep, e_local)
    received = jax.lax.psum(send_counts, "expert")[jax.lax.axis_index("expert")]
    overflow = jax.lax.pmax(received, all_axes) > capacity
    return jax.lax.cond(overflow, static, ragged, x, expert_ids)


def expert_parallel_block(
    x,
    token_mask,
    routing,
    weights,
    config: ModelConfig,
    dispatch: str,
    mesh,
    row_axes: tuple[str, ...],
):
    """The MoE block under ``jax.shard_map`` (see the module docstring).

    Args:
      x: [B, T, D]; token_mask: bool [B, T]; routing: int32 [B, T, k] or None;
      weights: ``[(weight, logical axes)]`` of the router [D, E] and the experts (w_gate,
        w_up [E, D, F], w_down [E, F, D]) in their parameter dtype, each an array or a
        ``lora.Adapted`` with its adapter's axes (``MoE.weights``); mesh: the abstract
        mesh; row_axes: mesh axes splitting B.
    Returns:
      As ``MoE.__call__`` before the dropped count: (y, routing, aux).
    """
    cfg = config
    k, dt, num_experts = cfg.num_experts_per_tok, cfg.compute_dtype, cfg.num_experts
    n_ep = mesh.shape["expert"]
    e_local = num_experts // n_ep
    transport = cfg.resolved_ep_transport()
    all_axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    width = _width_axes(mesh, cfg.hidden_size)
    arrays, axes, structure = lora.flatten(weights)

    extent = int(np.prod([mesh.shape[a] for a in width]))
    # Per array, the dimension split over the width axes as the parameters are placed
    # (the model width, or a LoRA adapter's rank where it has none: sharding.fsdp_dim;
    # None where it does not divide): gathered in the block, or used whole.
    dims = []
    for w, logical_axes in zip(arrays, axes):
        dim = fsdp_dim(logical_axes) if width else None
        dims.append(None if dim is None or w.shape[dim] % extent else dim)

    def gathered(w, dim):
        # FSDP (ZeRO-3) inside the block: the model width of a weight arrives as this
        # device's shard and is all-gathered here, so that the weight's gradient, the
        # transpose of the all-gather, is reduce-scattered onto the shards (a psum_scatter;
        # left to XLA, the gradient is all-reduced at full size and then sliced on XLA:CPU,
        # which has no pass turning the two into a reduce-scatter).
        # Typed as varying over the other row axes first, so that the gradient's psum over
        # them (data parallelism) runs on the shard, after the reduce-scatter.
        others = tuple(
            a
            for a in row_axes
            if (dim is None or a not in width) and a not in jax.typeof(w).mat.varying
        )
        w = jax.lax.pcast(w, others, to="varying") if others else w
        if dim is None:
            return w
        return jax.lax.all_gather(w, width, axis=dim, tiled=True)

    def body(x, token_mask, arrays, *replay):
        b, t, d = x.shape
        arrays = [gathered(w, d) for w, d in zip(arrays, dims)]
        router, *params = lora.unflatten(structure, arrays)
        flat = x.reshape(b * t, d)
        valid = token_mask.reshape(b * t)
        logits = lora.einsum(
            "nd,de->ne", flat.astype(jnp.float32), router.astype(jnp.float32), jnp.einsum
        )
        chosen = replay[0].reshape(b * t, k) if replay else None
        expert_ids, gates, probs = route(logits, k, cfg.norm_topk_prob, chosen)
        aux = router_aux(logits, probs, expert_ids, valid, num_experts, axis_names=row_axes)
        if n_ep == 1:  # one expert group (FSDP only): every expert here, no exchange
            y = configured_experts(flat.astype(dt), expert_ids, gates, params, cfg, dispatch)
            return y.reshape(b, t, d), expert_ids.reshape(b, t, k), aux
        local_fn = functools.partial(_local_experts, config=cfg, dispatch=dispatch)
        y_copies = _exchange(
            flat.astype(dt),
            expert_ids,
            tuple(params),
            local_fn,
            n_ep,
            e_local,
            transport,
            cfg.moe_ep_buffer_factor,
            all_axes,
        )
        y = jnp.einsum("nkd,nk->nd", y_copies.reshape(b * t, k, d), gates.astype(dt))
        return y.reshape(b, t, d), expert_ids.reshape(b, t, k), aux

    def spec(logical_axes, dim):
        """A weight's PartitionSpec in the block: E over ``expert``, ``dim`` over the width
        axes."""
        names = [None] * len(logical_axes)
        for i, name in enumerate(logical_axes):
            if name == "expert" and n_ep > 1:
                names[i] = "expert"
        if dim is not None:
            names[dim] = width
        return PartitionSpec(*names)

    rows = PartitionSpec(row_axes)
    args = (x, token_mask, arrays) + (() if routing is None else (routing,))
    in_specs = (rows, rows, tuple(spec(a, d) for a, d in zip(axes, dims)))
    in_specs += () if routing is None else (rows,)
    per_device = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(rows, rows, PartitionSpec())
    )
    if n_ep > 1:
        return per_device(*args)
    # One expert group (FSDP only), under ``jax.checkpoint`` as in
    # ``policyopt.sharding.fsdp_call``, so that no whole weight, nor any value computed
    # from one, is saved for the backward pass (a scan over layers would keep every
    # layer's): the block is recomputed there, its weights gathered again. Under
    # ``ModelConfig.remat`` the outer policy applies.
    return jax.checkpoint(per_device, policy=jax.checkpoint_policies.nothing_saveable)(*args)
