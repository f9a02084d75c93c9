"""MoE expert computations on one device: step 5 of the routing in ``policyopt.models.moe``.

Each takes the tokens x [N, D], their experts int32 [N, k] and gates [N, k] and the
expert weights (w_gate, w_up [E, D, F], w_down [E, F, D]) and returns
y_n = sum_j g_nj SwiGLU_{e_nj}(x_n) [N, D]:

  ragged_experts     dropless: sort by expert, grouped matmuls (``jax.lax.ragged_dot``, or
                     ``megablox_matmul``: the megablox GMM kernel with its custom VJP)
  blocked_experts    dropless: expert groups padded to blocks, one batched matmul (or a
                     scan over chunks of blocks, ``moe_chunk_rows``)
  dense_experts      dropless: every token through every expert, weighted by its gates
  gathered_experts   dropless, for decoding: each expert's tokens in a small buffer
  capacity_experts   capacity factor: one-hot dispatch into [E, C] buffers; also returns
                     the number of copies dropped

``dropless_experts`` picks one of the first five by its ``moe_dispatch`` name. Every
expert weight may be a ``lora.Adapted`` (each expert with its own adapter): the grouped
matmuls then add ``matmul(matmul(x, A), B)`` (``lora.grouped``), the einsums their
low-rank path (``lora.einsum``), and the weight gathers take A and B along (``lora.apply``).

The expert-parallel block (``policyopt.models.expert_parallel``) runs ragged (with either
matmul, the megablox kernel inside ``jax.shard_map`` included), blocked or dense on each
device's local experts ("gathered" there runs as dense); on an FSDP mesh without an
``expert`` axis, ``dropless_experts`` on each device's own rows.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from policyopt.models import lora


def megablox_matmul(rows, weights, group_sizes, interpret: bool | None = None):
    """Grouped matmul with the megablox GMM kernel of JAX's Pallas TPU ops
    (``jax.experimental.pallas.ops.tpu.megablox``, MegaBlocks' block-sparse product):
    out[r] = rows[r] @ weights[e(r)], rows sorted by group, group e of ``group_sizes[e]``
    rows. Its VJP (``_gmm``) runs the kernel again for the rows' gradient and the
    transposed kernel (``tgmm``) for the weights'. Rows are padded to a multiple of the row
    tile; rows past sum(group_sizes) come out zero, with zero gradient. Inside
    ``jax.shard_map`` (the expert-parallel block's local experts) too: see ``_gmm``.

    Args:
      rows: [M, D]; weights: [E, D, F] (same dtype); group_sizes: int32 [E], sum <= M.
      interpret: run the kernel in Pallas interpret mode; None: on every backend but TPU
        (the kernel is Mosaic TPU code: interpret mode is for tests, and slow).
    Returns:
      [M, F] in the dtype of ``rows`` (accumulated in float32).
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    m, d = rows.shape
    f = weights.shape[-1]
    # Row tile: 512 rows (MaxText's default) or all rows rounded up to 8 sublanes when
    # fewer; k and n tiles: the whole dimension up to 1,024 (multiples of 128 lanes at
    # model sizes; the kernel masks a ragged last tile).
    tm = min(512, -(-m // 8) * 8)
    tiling = (tm, min(d, 1024), min(f, 1024))
    padded = -(-m // tm) * tm
    if padded != m:
        rows = jnp.pad(rows, ((0, padded - m), (0, 0)))
    # The kernel leaves rows past the groups unwritten, in its output and in the rows'
    # gradient (NaN in interpret mode): selected away on both sides (a select's
    # gradient selects too, so the unwritten rows never reach a product).
    grouped = (jnp.arange(padded) < jnp.sum(group_sizes))[:, None]
    rows = jnp.where(grouped, rows, 0)
    out = _gmm(rows, weights.astype(rows.dtype), group_sizes.astype(jnp.int32), tiling, interpret)
    return jnp.where(grouped, out, 0)[:m]


def _megablox_kernels():
    """The module of JAX's megablox kernels, ``gmm`` and ``tgmm`` (the package's own ``gmm``
    attribute is its custom-VJP op, which shadows the module of the same name)."""
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _manual_varying(*arrays) -> frozenset:
    """The mesh axes any of ``arrays`` varies over (``jax.shard_map``'s check_vma types;
    empty outside a shard_map)."""
    return frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))


def _typed_varying(x, axes: frozenset):
    """``x`` typed as varying over ``axes`` (a ``pcast`` of the axes it lacks)."""
    missing = tuple(sorted(axes - _manual_varying(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _unchecked(kernel, *args, interpret: bool):
    """``kernel(*args)``, a Pallas kernel call, traced without shard_map's check_vma when
    it is called inside a ``jax.shard_map``.

    jax 0.10.2's megablox kernels build their ``pallas_call`` outputs without a
    manual-axis type, which a shard_map with check_vma refuses. They run here under a
    nested ``jax.shard_map(check_vma=False)`` over the axes that are manual already: it
    splits nothing, and its transpose adds no collective. Its outputs come back untyped
    (invariant over the mesh); ``_gmm`` types them, inside a custom VJP so that no
    ``pcast`` is ever transposed (into a psum). In interpret mode the arguments are first
    recomputed as untyped values (``+ 0`` under check_vma=False): the HLO interpreter of
    ``pallas_call`` carries its operands through a while loop whose body drops their
    types, and the loop refuses the mismatch (jax 0.10.2).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.manual_axes:
        return kernel(*args)

    def region(*args):
        if interpret:
            args = [a + jnp.zeros((), a.dtype) for a in args]
        return kernel(*args)

    return jax.shard_map(
        region,
        in_specs=tuple(PartitionSpec() for _ in args),
        out_specs=PartitionSpec(),
        axis_names=frozenset(mesh.manual_axes),
        check_vma=False,
    )(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(lhs, rhs, group_sizes, tiling: tuple[int, int, int], interpret: bool):
    """out[r] = lhs[r] @ rhs[e(r)] by the megablox ``gmm`` kernel, typed as varying over
    the mesh axes any operand varies over (inside ``jax.shard_map``; ``_unchecked``).

    Args:
      lhs: [M, D], M a multiple of tiling[0]; rhs: [E, D, F]; group_sizes: int32 [E];
      tiling: the kernel's (m, k, n) tiles; interpret: Pallas interpret mode.
    Returns:
      [M, F] in the dtype of ``lhs``; rows past sum(group_sizes) unwritten.
    """
    kernels = _megablox_kernels()
    out = _unchecked(
        lambda l, r, s: kernels.gmm(l, r, s, l.dtype, tiling, interpret=interpret),
        lhs,
        rhs,
        group_sizes,
        interpret=interpret,
    )
    return _typed_varying(out, _manual_varying(lhs, rhs, group_sizes))


def _gmm_fwd(lhs, rhs, group_sizes, tiling, interpret):
    return _gmm(lhs, rhs, group_sizes, tiling, interpret), (lhs, rhs, group_sizes)


def _gmm_bwd(tiling, interpret, residuals, grad):
    """The VJP of megablox's own op (``megablox.ops``): with G = grad [M, F],

        d lhs[r] = G[r] @ rhs[e(r)]^T                 (``gmm``, rhs transposed)
        d rhs[e] = sum_{r in group e} lhs[r]^T G[r]     (``tgmm``)

    Under ``jax.shard_map`` each is typed as the product (varying over the axes any of
    lhs, rhs, group_sizes, G varies over) and then summed over the axes its primal does
    not vary over: the transpose of using an invariant operand in a varying product (a
    ``psum``, as autodiff inserts for ``jax.lax.ragged_dot``)."""
    lhs, rhs, group_sizes = residuals
    kernels = _megablox_kernels()
    axes = _manual_varying(lhs, rhs, group_sizes, grad)
    d_lhs = _unchecked(
        lambda g, r, s: kernels.gmm(
            g, r, s, lhs.dtype, tiling, transpose_rhs=True, interpret=interpret
        ),
        grad,
        rhs,
        group_sizes,
        interpret=interpret,
    )
    d_rhs = _unchecked(
        lambda l, g, s: kernels.tgmm(
            l.swapaxes(0, 1),
            g,
            s,
            rhs.dtype,
            tiling,
            num_actual_groups=rhs.shape[0],
            interpret=interpret,
        ),
        lhs,
        grad,
        group_sizes,
        interpret=interpret,
    )

    def cotangent(ct, primal):
        ct = _typed_varying(ct, axes)
        extra = tuple(sorted(axes - _manual_varying(primal)))
        return jax.lax.psum(ct, extra) if extra else ct

    return cotangent(d_lhs, lhs), cotangent(d_rhs, rhs), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def ragged_experts(x, expert_ids, gates, w_gate, w_up, w_down, matmul: str = "ragged_dot"):
    """Step 5, dropless: sort copies by expert, grouped matmuls, unsort, weighted sum.

    Args:
      x: [N, D]; expert_ids: int32 [N, k]; gates: [N, k];
      w_gate, w_up: [E, D, F]; w_down: [E, F, D] (all in the compute dtype).
      matmul: the grouped matmul, "ragged_dot" (``jax.lax.ragged_dot``) or "megablox"
        (``megablox_matmul``).
    Returns:
      [N, D].
    """
    n, k = expert_ids.shape
    num_experts = w_gate.shape[0]
    flat_ids = expert_ids.reshape(-1)  # [N*k]
    order = jnp.argsort(flat_ids, stable=True)  # copies by expert
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    x_sorted = jnp.take(x, order // k, axis=0)  # [N*k, D]
    if matmul == "ragged_dot":
        grouped = jax.lax.ragged_dot
    elif matmul == "megablox":
        grouped = megablox_matmul
    else:
        raise ValueError(f"matmul must be 'ragged_dot' or 'megablox', got {matmul!r}")
    gate = lora.grouped(grouped, x_sorted, w_gate, group_sizes)
    up = lora.grouped(grouped, x_sorted, w_up, group_sizes)
    y_sorted = lora.grouped(grouped, jax.nn.silu(gate) * up, w_down, group_sizes)
    y_copies = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    y_copies = y_copies.reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y_copies, gates.astype(y_copies.dtype))


def blocked_experts(
    x,
    expert_ids,
    gates,
    w_gate,
    w_up,
    w_down,
    block_size: int,
    gather: str = "take",
    chunk_rows: int | None = None,
):
    """Step 5, dropless with block padding: every block of ``block_size`` sorted copies
    belongs to one expert, and blocks are multiplied by their expert's weights.

    With M = N*k copies and g_e copies for expert e, expert e occupies
    ceil(g_e / block) blocks starting at row P_e = block * sum_{e'<e} ceil(g_e' / block);
    sum_e ceil(g_e / block) <= ceil(M / block) + E bounds the static number of blocks.

    Args:
      x: [N, D] in the compute dtype; expert_ids: int32 [N, k]; gates: [N, k];
      w_gate, w_up: [E, D, F]; w_down: [E, F, D], in their parameter dtype: cast to the
        dtype of x after the gather ("take"), or before the matmul ("onehot").
      block_size: rows per block (at most; smaller when the mean group is smaller).
      gather: how each block receives its expert's weights. "take": an indexed gather
        from the parameters in their own dtype, cast per block, so that its gradient, a
        scatter-add of the blocks into [E, D, F], sums in the parameter dtype (summed in
        bfloat16 it gave the expert weights 2.7% gradient error against a float32
        reference, the ragged dispatch 0.57%; bfloat16 compute, block 4, 4,096
        tokens); "onehot": a matmul with the one-hot [blocks, E] block-to-expert matrix
        (exact at HIGHEST precision: one nonzero term per sum; its gradient is a matmul
        too, which accelerators run on their matrix units instead of as atomic
        scatter-adds). Unlike "take", a NaN or inf in one expert's weights reaches every
        block (0 * inf).
      chunk_rows: None, or at most this many padded rows (whole blocks, at least one)
        through the matmuls at a time (``_chunked_blocks``) when the blocks hold more.
    Returns:
      [N, D].
    """
    n, k = expert_ids.shape
    num_experts, d = w_gate.shape[0], x.shape[-1]
    copies = n * k
    # Few tokens (decoding): shrink the block to the power of two >= the mean group size,
    # so padding stays O(copies) instead of O(E * block_size).
    mean_group = max(1, -(-copies // num_experts))
    block_size = min(block_size, 1 << (mean_group - 1).bit_length())
    num_blocks = -(-copies // block_size) + num_experts
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    group_sizes = jnp.bincount(flat_ids, length=num_experts)
    padded_sizes = -(-group_sizes // block_size) * block_size
    padded_ends = jnp.cumsum(padded_sizes)
    group_starts = jnp.cumsum(group_sizes) - group_sizes
    dest = (padded_ends - padded_sizes)[sorted_ids] + jnp.arange(copies) - group_starts[sorted_ids]
    block_starts = jnp.arange(num_blocks) * block_size
    # compare_all: one [blocks, E] comparison instead of a while loop of binary search
    # steps (each a kernel launch on accelerators).
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_ends, block_starts, side="right", method="compare_all"),
        num_experts - 1,
    )  # unused blocks: zeros
    if gather not in ("take", "onehot"):
        raise ValueError(f"gather must be 'take' or 'onehot', got {gather!r}")

    def block_weights(block_expert) -> list:
        """The three weights of each block's expert, [blocks, ...] (LoRA: each adapted)."""
        # onehot: in the compute dtype, the matmul's gradient sums over the blocks in its
        # accumulator (its error matched the ragged dispatch's), and a float32 matmul would
        # double the bytes it reads.
        onehot = (
            None if gather == "take" else jax.nn.one_hot(block_expert, num_experts, dtype=x.dtype)
        )

        def of_blocks(v):
            if gather == "take":
                return jnp.take(v, block_expert, axis=0).astype(x.dtype)
            # HIGHEST: a float32 product at default precision would round the weights
            # (TF32 on GPUs, bfloat16 passes on TPUs), and the weight gradient with them.
            return jnp.einsum(
                "be,e...->b...", onehot, v.astype(x.dtype), precision=jax.lax.Precision.HIGHEST
            )

        return [lora.apply(of_blocks, w) for w in (w_gate, w_up, w_down)]

    def mlp(rows, block_expert):
        gate_w, up_w, down_w = block_weights(block_expert)
        gate = lora.einsum("brd,bdf->brf", rows, gate_w)
        up = lora.einsum("brd,bdf->brf", rows, up_w)
        return lora.einsum("brf,bfd->brd", jax.nn.silu(gate) * up, down_w)

    chunk_blocks = num_blocks if chunk_rows is None else max(1, chunk_rows // block_size)
    if chunk_blocks < num_blocks:
        varying = _manual_varying(x, gates, *jax.tree.leaves((w_gate, w_up, w_down)))
        return _chunked_blocks(
            x, gates, order, dest, block_expert, mlp, k, block_size, chunk_blocks, varying
        )
    rows = jnp.zeros((num_blocks * block_size, d), x.dtype)
    rows = rows.at[dest].set(jnp.take(x, order // k, axis=0), unique_indices=True)
    out = mlp(rows.reshape(num_blocks, block_size, d), block_expert)
    y_sorted = jnp.take(out.reshape(-1, d), dest, axis=0)
    y_copies = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    return jnp.einsum("nkd,nk->nd", y_copies.reshape(n, k, d), gates.astype(x.dtype))


def _chunked_blocks(x, gates, order, dest, block_expert, mlp, k, block_size, chunk_blocks, varying):
    """``blocked_experts``' matmuls and combine, ``chunk_blocks`` blocks at a time, in a
    ``jax.lax.scan``: each chunk gathers its rows from ``x``, runs the three matmuls and
    adds its gated outputs into ``y`` [N, D] (float32), under ``jax.checkpoint`` (the
    backward recomputes one chunk at a time). No array of the whole padded layout's
    [rows, D] exists, forward or backward, nor the blocks' weight copies of more than one
    chunk. A token's k outputs are summed by a scatter-add (whose order GPUs do not fix;
    the unchunked path's backward sums its k input gradients so too)."""
    n, d = x.shape
    copies, num_blocks = order.shape[0], block_expert.shape[0]
    chunks = -(-num_blocks // chunk_blocks)
    chunk_blocks = -(-num_blocks // chunks)  # balanced: fewer than `chunks` pad blocks
    padded_rows = chunks * chunk_blocks * block_size
    # The sorted copy each padded row holds (`copies`: none, a padding row).
    source = jnp.full((padded_rows,), copies, jnp.int32)
    source = source.at[dest].set(jnp.arange(copies, dtype=jnp.int32), unique_indices=True)
    valid = source < copies
    copy = order[jnp.minimum(source, copies - 1)]
    row_gate = jnp.where(valid, gates.reshape(-1)[copy].astype(x.dtype), 0)
    block_expert = jnp.pad(block_expert, (0, chunks * chunk_blocks - num_blocks))

    @jax.checkpoint
    def contribution(tokens, valid, row_gate, experts):
        rows = jnp.where(valid[:, None], jnp.take(x, tokens, axis=0), 0)
        out = mlp(rows.reshape(chunk_blocks, block_size, d), experts).reshape(-1, d)
        return jnp.where(valid[:, None], out * row_gate[:, None], 0)

    def body(y, chunk):
        tokens = chunk[0]
        return y.at[tokens].add(contribution(*chunk).astype(y.dtype)), None

    per_chunk = (
        (copy // k).reshape(chunks, -1),
        valid.reshape(chunks, -1),
        row_gate.reshape(chunks, -1),
        block_expert.reshape(chunks, chunk_blocks),
    )
    y = _typed_varying(jnp.zeros((n, d), jnp.float32), varying)  # shard_map's carry type
    y, _ = jax.lax.scan(body, y, per_chunk)
    return y.astype(x.dtype)


def dense_experts(x, expert_ids, gates, w_gate, w_up, w_down):
    """Step 5, dense: every token through every expert, weighted by its gates (0 for the
    experts it did not choose).

    Equal to the dropless dispatches up to float summation order while every expert's
    output is finite: an expert no token chose still enters every token with weight 0,
    and 0 * inf or 0 * NaN is NaN. (A selection instead of the weighting would stop that,
    but it splits the three products that XLA:CPU's matmul library runs as one fused
    graph: a moe_7m sampler call took 25-50% longer.) Memory: [E, N, F] and
    [E, N, D] intermediates, so for few tokens (decoding) and small E / k.

    Args:
      x: [N, D]; expert_ids: int32 [N, k]; gates: [N, k]; w_*: as in ragged_experts.
    Returns:
      [N, D].
    """
    num_experts = w_gate.shape[0]
    onehot = jax.nn.one_hot(expert_ids, num_experts, dtype=x.dtype)  # [N, k, E]
    # [E, N]: the summed gates of expert e for token n (a token listing an expert twice
    # gets both gates, as in the other dropless dispatches; a sum, not a matmul, so no
    # reduced-precision product rounds the gates).
    combine = jnp.sum(onehot * gates.astype(x.dtype)[..., None], axis=1).T
    # Batched over the experts, x broadcast: the weights are used in their stored
    # [E, D, F] layout (contracting D of [E, D, F] against [N, D] directly makes XLA
    # transpose the weights on every call; measured ~10% slower decoding on a CPU).
    x = jnp.broadcast_to(x, (num_experts,) + x.shape)  # [E, N, D]
    gate = lora.einsum("end,edf->enf", x, w_gate)
    up = lora.einsum("end,edf->enf", x, w_up)
    hidden = jax.nn.silu(gate) * up * combine[:, :, None]  # [E, N, F]
    return jnp.sum(lora.einsum("enf,efd->end", hidden, w_down), axis=0)


# Headroom of the "gathered" dispatch's buffers over an expert's mean load N k / E: the
# buffers tried in turn, each as a multiple of the mean (rounded up to 8 rows); a call
# whose busiest expert exceeds the last runs "dense".
GATHERED_HEADROOM = (1.5, 3.0)


def gathered_capacities(num_tokens: int, k: int, num_experts: int) -> tuple[int, ...]:
    """Buffer sizes C of the "gathered" dispatch for N tokens: ceil8(h N k / E) for each
    headroom h in ``GATHERED_HEADROOM``, those below N only (a buffer of N rows is the
    dense dispatch)."""
    mean = num_tokens * k / num_experts
    sizes = sorted({8 * math.ceil(h * mean / 8) for h in GATHERED_HEADROOM})
    return tuple(c for c in sizes if c < num_tokens)


def gathered_experts(x, expert_ids, gates, w_gate, w_up, w_down):
    """Step 5, gathered (dropless; for decoding): each expert runs on its own tokens,
    gathered into a buffer of C rows, with C the smallest of ``gathered_capacities``
    that holds the busiest expert's tokens; "dense" when none does.

    With c_e the tokens that chose expert e and C >= max_e c_e, buffer row i of expert e
    holds token n_{e,i} (its tokens in token order, then tokens with weight 0 as
    padding), and

        y_n = sum_e sum_{i: n_{e,i} = n} w_{e,n} SwiGLU_e(x_n),

    w_{e,n} the summed gates of e for token n: the dense dispatch's sum without its
    E N - N k zero-weight terms. E C rows of expert work instead of dense's E N (at
    N = 64, k = 2, E = 8: C = 24, 2.7x fewer FLOPs), and, unlike "ragged" / "blocked",
    no weight is copied: the batched matmuls read the stored [E, D, F] weights. Padding
    rows are computed but dropped from the sum, so a non-finite output of an expert
    reaches only the tokens that chose it. Equal to the other dropless dispatches up to
    float summation order.

    Args:
      x: [N, D]; expert_ids: int32 [N, k]; gates: [N, k]; w_*: as in ragged_experts.
    Returns:
      [N, D].
    """
    n, d = x.shape
    num_experts = w_gate.shape[0]
    onehot = jax.nn.one_hot(expert_ids, num_experts, dtype=x.dtype)  # [N, k, E]
    combine = jnp.sum(onehot * gates.astype(x.dtype)[..., None], axis=1).T  # [E, N]
    chosen = jnp.any(onehot > 0, axis=1).T  # [E, N]
    counts = jnp.sum(chosen, axis=1)  # [E]
    # Priority n - i for chosen tokens, 0 for the others: top_k lists an expert's tokens
    # in token order, then padding.
    priority = jnp.where(chosen, n - jnp.arange(n, dtype=jnp.int32)[None, :], 0)

    def buffered(capacity):
        def run(_):
            keys, rows = jax.lax.top_k(priority, capacity)  # [E, C]
            weights = jnp.take_along_axis(combine, rows, axis=1)  # [E, C]
            xg = jnp.take(x, rows, axis=0)  # [E, C, D]
            gate = lora.einsum("ecd,edf->ecf", xg, w_gate)
            up = lora.einsum("ecd,edf->ecf", xg, w_up)
            hidden = jax.nn.silu(gate) * up * weights[:, :, None]
            out = lora.einsum("ecf,efd->ecd", hidden, w_down)  # [E, C, D]
            # Padding rows (priority 0) are dropped, not added with weight 0.
            dest = jnp.where(keys > 0, rows, n).reshape(-1)
            return jnp.zeros_like(x).at[dest].add(out.reshape(-1, d), mode="drop")

        return run

    capacities = gathered_capacities(n, expert_ids.shape[1], num_experts)
    branches = [buffered(c) for c in capacities]
    branches.append(lambda _: dense_experts(x, expert_ids, gates, w_gate, w_up, w_down))
    if len(branches) == 1:
        return branches[0](None)
    # The first buffer that holds the busiest expert (len(capacities): none, dense).
    branch = jnp.sum(jnp.max(counts) > jnp.asarray(capacities, counts.dtype))
    return jax.lax.switch(branch, branches, None)


def dropless_experts(
    x,
    expert_ids,
    gates,
    w_gate,
    w_up,
    w_down,
    dispatch: str,
    block_size: int,
    gather: str,
    chunk_rows: int | None = None,
):
    """Step 5 by the dropless dispatch of that name: ``MoE``'s choice on one device, and
    per device under an FSDP mesh without an ``expert`` axis (``expert_parallel``).

    Args:
      x: [N, D] in the compute dtype; expert_ids: int32 [N, k]; gates: [N, k];
      w_gate, w_up: [E, D, F]; w_down: [E, F, D] in their parameter dtype (cast to the
        dtype of x, by ``blocked_experts`` after its gather, here for the others).
      dispatch: "ragged", "megablox", "blocked", "dense" or "gathered".
      block_size, gather: ``blocked_experts``' (``ModelConfig.moe_block_size`` and
        ``resolved_weight_gather()``).
    Returns:
      [N, D] in the dtype of x.
    """
    if dispatch == "blocked":
        return blocked_experts(
            x,
            expert_ids,
            gates,
            w_gate,
            w_up,
            w_down,
            block_size=block_size,
            gather=gather,
            chunk_rows=chunk_rows,
        )
    weights = [w.astype(x.dtype) for w in (w_gate, w_up, w_down)]
    if dispatch in ("ragged", "megablox"):
        matmul = "megablox" if dispatch == "megablox" else "ragged_dot"
        return ragged_experts(x, expert_ids, gates, *weights, matmul=matmul)
    if dispatch == "dense":
        return dense_experts(x, expert_ids, gates, *weights)
    if dispatch == "gathered":
        return gathered_experts(x, expert_ids, gates, *weights)
    raise ValueError(
        "ModelConfig.moe_dispatch must be 'ragged', 'megablox', 'blocked', 'dense' or "
        f"'gathered' here (dropless), got {dispatch!r}"
    )


def configured_experts(x, expert_ids, gates, params, config, dispatch: str):
    """:func:`dropless_experts` at ``config``'s kernel settings (a ``ModelConfig``: its
    ``moe_block_size``, weight gather and ``moe_chunk_rows``); ``params`` the three expert
    weights (gate, up, down)."""
    return dropless_experts(
        x,
        expert_ids,
        gates,
        *params,
        dispatch=dispatch,
        block_size=config.moe_block_size,
        gather=config.resolved_weight_gather(),
        chunk_rows=config.moe_chunk_rows,
    )


def capacity_experts(x, expert_ids, gates, valid, w_gate, w_up, w_down, capacity: int):
    """Step 5, capacity factor: one-hot dispatch into [E, C] buffers, overflow dropped.

    Args:
      x: [N, D]; expert_ids: int32 [N, k]; gates: [N, k]; valid: bool [N] (padding tokens
        take no buffer space); w_*: as in ragged_experts; capacity: C.
    Returns:
      (y [N, D], dropped: float32 scalar number of valid copies that found no slot).
    """
    n, k = expert_ids.shape
    num_experts = w_gate.shape[0]
    onehot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.int32) * valid[:, None, None]
    # Priority: choice j of every token before choice j+1 of any token.
    by_choice = onehot.transpose(1, 0, 2).reshape(k * n, num_experts)
    position = jnp.sum((jnp.cumsum(by_choice, axis=0) - 1) * by_choice, axis=-1)
    position = position.reshape(k, n).T  # [N,k]
    kept = (position < capacity) & valid[:, None]
    dropped = jnp.sum(valid[:, None] & ~kept).astype(jnp.float32)
    slot = jax.nn.one_hot(jnp.where(kept, position, capacity), capacity, dtype=x.dtype)
    expert_onehot = onehot.astype(x.dtype) * kept[..., None].astype(x.dtype)  # [N,k,E]
    dispatch = jnp.einsum("nke,nkc->nec", expert_onehot, slot)
    combine = jnp.einsum("nke,nkc->nec", expert_onehot * gates[..., None].astype(x.dtype), slot)
    expert_in = jnp.einsum("nec,nd->ecd", dispatch, x)
    h = jax.nn.silu(lora.einsum("ecd,edf->ecf", expert_in, w_gate)) * lora.einsum(
        "ecd,edf->ecf", expert_in, w_up
    )
    expert_out = lora.einsum("ecf,efd->ecd", h, w_down)
    return jnp.einsum("nec,ecd->nd", combine, expert_out), dropped
