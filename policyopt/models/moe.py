"""Mixture-of-Experts block: router, top-k routing (captured or replayed), dropless
ragged, blocked, dense and gathered dispatch, capacity-factor one-hot dispatch, auxiliary outputs.

Routing, step by step, for N = B*T tokens x [N, D], E experts, k experts per token:

  1. Router logits   z = x W_r                        [N, E]   (float32)
  2. Probabilities   p = softmax(z)                   [N, E]
  3. Selection       e = top_k(p, k)                  [N, k]   int32, best first
     -- or, under replay (R2 / R3, docs/algorithms.md), e = the given routing: only the
     *selection* is replayed.
  4. Gate weights    g_j = p[e_j]  and, if norm_topk_prob, g_j /= sum_j g_j
     (= softmax of z over the k selected experts). Always recomputed from the *current*
     logits, so under replay the router still receives gradient through g.
  5. Experts         y = sum_j g_j * SwiGLU_{e_j}(x)   via one of five dispatches:

     ragged (dropless, default; MegaBlocks / MaxText "sparse matmul"):
       a. flatten the N*k token copies, argsort them by expert id (stable)
       b. group sizes = bincount(expert ids, E)
       c. gather x in that order and run the three expert matmuls as
          jax.lax.ragged_dot (one grouped GEMM per projection)
       d. scatter the outputs back to copy order, weight by g and sum over the k copies.

     megablox (dropless): as ragged, the grouped matmuls by the megablox GMM kernel for
       TPUs (``megablox_matmul``; Pallas interpret mode on other backends), on one device
       or on each device's local experts under expert parallelism.

     blocked (dropless, plain XLA; MegaBlocks' padded block-sparse form): as ragged,
       but each expert's group is padded to a multiple of ``moe_block_size`` rows, so
       every block of rows belongs to one expert; the blocks are multiplied by their
       expert's weights in one batched matmul. Work is O((N k + E * block) D F) on any
       backend. (XLA:CPU and XLA:GPU lower ragged_dot to a dense product over all
       experts, O(E N k D F); TPUs have grouped-matmul kernels.) The weights reach the
       blocks by an indexed gather on CPUs and by a one-hot [blocks, E] matmul on
       accelerators, whose gradient is then a matmul, not a scatter-add
       (``moe_weight_gather``).

     dense (dropless, no sort): every token through every expert, weighted by its gate
       for the k experts it chose and by 0 for the others (so a non-finite output of any
       expert reaches every token). E / k times the expert FLOPs of the dropless
       dispatches, but three batched matmuls over the experts with no sort, gather or
       scatter, and each weight read once: the fastest for decoding (few tokens) with
       small E / k on CPUs.

     gathered (dropless, for decoding): each expert's tokens gathered into a buffer
       of C rows, C a small multiple of the mean load N k / E chosen per call from a few
       static sizes (the busiest expert's count picks one; "dense" when it exceeds them
       all); three batched matmuls over the experts on the stored weights, as dense,
       with E C rows instead of E N.

     capacity (GShard / Switch Transformer): every expert has a buffer of
       C = ceil(capacity_factor * N * k / E) copies; copies claim buffer positions in
       priority order (all first choices, then all second choices, ...; token order
       within a choice), copies beyond C are dropped (their contribution is zero and
       they are counted). Dispatch and combine are one-hot einsums [N, E, C].

  6. Auxiliary outputs over the valid (non-padding) tokens:
       tokens_per_expert c_e = number of copies routed to e            [E]
       load-balancing loss = E * sum_e f_e P_e, f_e = c_e / (N_valid k),
         P_e = mean_n p_ne   (Switch Transformer eq. 4; 1 at perfect balance; the
         Transformer reports its mean over the MoE layers. Not the scale of transformers'
         aux_loss: see router_aux)
       router z-loss = mean_n logsumexp(z_n)^2                  (ST-MoE eq. 5)
       dropped_tokens = copies dropped by the capacity path (0 for ragged).

On a mesh with an ``expert`` axis of size > 1 the dropless dispatches run expert-parallel
under ``jax.shard_map``: each device routes its own rows and sends each token copy to the
device holding its expert (section "Expert parallelism" below).
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from policyopt.models.config import ModelConfig
from policyopt.models.layers import param
from policyopt.sharding import logical_to_mesh_axes


def route(router_logits: jax.Array, k: int, norm_topk_prob: bool, routing: jax.Array | None = None):
    """Steps 2-4: select k experts per token (or take the replayed ones) and gate them.

    Args:
      router_logits: float32 [N, E].
      k: experts per token.
      norm_topk_prob: renormalise the gathered probabilities over the k experts.
      routing: int32 [N, k] experts to replay, or None to choose top-k.
    Returns:
      expert_ids int32 [N, k], gates float32 [N, k], probs float32 [N, E].
    """
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    if routing is None:
        _, expert_ids = jax.lax.top_k(probs, k)
    else:
        # Out-of-range ids cannot raise inside jit; clip them so they stay harmless.
        expert_ids = jnp.clip(routing, 0, probs.shape[-1] - 1)
    expert_ids = expert_ids.astype(jnp.int32)
    gates = jnp.take_along_axis(probs, expert_ids, axis=-1)
    if norm_topk_prob:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return expert_ids, gates, probs


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
    gate = grouped(x_sorted, w_gate, group_sizes)
    up = grouped(x_sorted, w_up, group_sizes)
    y_sorted = grouped(jax.nn.silu(gate) * up, w_down, group_sizes)
    y_copies = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    y_copies = y_copies.reshape(n, k, -1)
    return jnp.einsum("nkd,nk->nd", y_copies, gates.astype(y_copies.dtype))


def blocked_experts(
    x, expert_ids, gates, w_gate, w_up, w_down, block_size: int, gather: str = "take"
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
    rows = jnp.zeros((num_blocks * block_size, d), x.dtype)
    rows = rows.at[dest].set(jnp.take(x, order // k, axis=0), unique_indices=True)
    rows = rows.reshape(num_blocks, block_size, d)
    block_starts = jnp.arange(num_blocks) * block_size
    # compare_all: one [blocks, E] comparison instead of a while loop of binary search
    # steps (each a kernel launch on accelerators).
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_ends, block_starts, side="right", method="compare_all"),
        num_experts - 1,
    )  # unused blocks: zeros
    if gather == "take":

        def weights_of(w):
            return jnp.take(w, block_expert, axis=0).astype(x.dtype)
    elif gather == "onehot":
        # In the compute dtype: the matmul's gradient sums over the blocks in its
        # accumulator (its error matched the ragged dispatch's), and a float32 matmul
        # would double the bytes it reads.
        onehot = jax.nn.one_hot(block_expert, num_experts, dtype=x.dtype)

        def weights_of(w):
            # HIGHEST: a float32 product at default precision would round the weights
            # (TF32 on GPUs, bfloat16 passes on TPUs), and the weight gradient with them.
            return jnp.einsum(
                "be,e...->b...", onehot, w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST
            )
    else:
        raise ValueError(f"gather must be 'take' or 'onehot', got {gather!r}")
    gate = jnp.einsum("brd,bdf->brf", rows, weights_of(w_gate))
    up = jnp.einsum("brd,bdf->brf", rows, weights_of(w_up))
    out = jnp.einsum("brf,bfd->brd", jax.nn.silu(gate) * up, weights_of(w_down))
    y_sorted = jnp.take(out.reshape(-1, d), dest, axis=0)
    y_copies = jnp.zeros_like(y_sorted).at[order].set(y_sorted, unique_indices=True)
    return jnp.einsum("nkd,nk->nd", y_copies.reshape(n, k, d), gates.astype(x.dtype))


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
    gate = jnp.einsum("end,edf->enf", x, w_gate)
    up = jnp.einsum("end,edf->enf", x, w_up)
    hidden = jax.nn.silu(gate) * up * combine[:, :, None]  # [E, N, F]
    return jnp.sum(jnp.einsum("enf,efd->end", hidden, w_down), axis=0)


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
            gate = jnp.einsum("ecd,edf->ecf", xg, w_gate)
            up = jnp.einsum("ecd,edf->ecf", xg, w_up)
            hidden = jax.nn.silu(gate) * up * weights[:, :, None]
            out = jnp.einsum("ecf,efd->ecd", hidden, w_down)  # [E, C, D]
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
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", expert_in, w_gate)) * jnp.einsum(
        "ecd,edf->ecf", expert_in, w_up
    )
    expert_out = jnp.einsum("ecf,efd->ecd", h, w_down)
    return jnp.einsum("nec,ecd->nd", combine, expert_out), dropped


def router_aux(
    router_logits, probs, expert_ids, valid, num_experts: int, axis_names: tuple[str, ...] = ()
):
    """Step 6: load-balancing loss, router z-loss and tokens per expert over valid tokens.

    With c_e the copies routed to expert e (k per token) and P_e the mean router
    probability over the N valid tokens, the load-balancing loss is

        LB = E * sum_e f_e P_e,   f_e = c_e / (N k),

    1 at perfect balance (f_e = P_e = 1 / E) and E when every token sends all its
    probability and copies to one expert (k = 1). The Transformer reports the mean over
    its L MoE layers, mean_l LB_l.

    transformers' ``load_balancing_loss_func`` (the ``aux_loss`` of Qwen3-MoE, Mixtral,
    ...; ``router_aux_loss_coef`` times it enters their loss) divides the counts by N
    only, and pools counts and probabilities over the layers before the product:

        LB_HF = k E sum_e (mean_l f_le) (mean_l P_le),

    k at perfect balance. For one MoE layer (or layers with equal statistics)
    LB_HF = k * LB exactly (tests/test_hf.py checks both forms against transformers),
    so a coefficient alpha on LB_HF equals k alpha on LB here: HF's coefficient
    (Qwen3-MoE: 0.001) used unchanged on this loss pulls k times more weakly (8 times for
    Qwen3-30B-A3B's k = 8). With several layers HF's gradient pushes each layer towards
    the balance of the pooled load, this one towards that of its own.

    Under ``jax.shard_map`` with the tokens split over ``axis_names`` (expert
    parallelism), the counts and sums are ``psum``-ed over those axes first, so every
    device returns the statistics of the global batch.
    """
    k = expert_ids.shape[-1]
    total = (lambda v: jax.lax.psum(v, axis_names)) if axis_names else (lambda v: v)
    valid_f = valid.astype(jnp.float32)
    n_valid = jnp.maximum(total(jnp.sum(valid_f)), 1.0)
    counts = total(
        jnp.sum(
            jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32) * valid_f[:, None, None],
            axis=(0, 1),
        )
    )  # [E]
    fraction = counts / (n_valid * k)
    mean_prob = total(jnp.sum(probs * valid_f[:, None], axis=0)) / n_valid
    load_balancing = num_experts * jnp.sum(fraction * mean_prob)
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1)
    z_loss = total(jnp.sum(valid_f * z * z)) / n_valid
    return {
        "load_balancing_loss": load_balancing,
        "router_z_loss": z_loss,
        "tokens_per_expert": counts,
    }


# ---- Expert parallelism ---------------------------------------------------------------
# With a mesh whose ``expert`` axis has n_ep > 1 devices, the tokens' rows split over the
# row axes (``batch``: data x fsdp x expert) and experts [E, ...] split over ``expert``
# (E_l = E / n_ep per device), the block runs under ``jax.shard_map``; per device, with
# its n local tokens and m = n k copies:
#
#   0. the router and expert weights arrive as their FSDP shards (model width D split
#      over the ``embed`` rule's axes) and are all-gathered along D in the block, so that
#      their gradients are reduce-scattered back onto the shards (ZeRO-3);
#   1. route the local tokens (replay takes the local rows of [B, T, k]); aux
#      statistics psum-ed over the row axes (``router_aux``);
#   2. sort the copies by expert id: the copies for device j (experts j E_l ... ) are a
#      contiguous run of s_j copies;
#   3. send each run to its device over the expert axis: ``all_to_all`` of fixed
#      [n_ep, C, D] buffers, C = ceil(f m / n_ep) copies per device pair
#      (f = moe_ep_buffer_factor), or ``ragged_all_to_all`` of exactly s_j rows into a
#      receive buffer of C = ceil(f m) rows;
#   4. run the received rows through the E_l local experts (the blocked / ragged /
#      megablox / dense computation of one device, k = 1, gate 1; empty buffer rows are
#      zeros and give zeros: SwiGLU(0) = 0; the megablox kernel inside the shard_map as
#      ``_gmm`` says);
#   5. send the outputs back the same way, put them in copy order and combine them with
#      the gates: y_n = sum_j g_nj out_nj.
#
# Dropless with bounded memory: all_to_all runs ceil(max_j s_j / C) passes (max over
# every device; pass p carries the copies of rank [p C, (p + 1) C) for their device;
# one pass at f >= the imbalance), a while loop with its own backward pass. When a
# device would receive more than the ragged buffer holds, the step takes the all_to_all
# passes instead (one ``lax.cond``, the predicate pmax-ed over the mesh so every device
# takes the same branch). Everything but the buffers is the arithmetic of one device,
# so loss, gradients and routing match it up to float summation order.


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
    """``(mesh, row_axes)`` when the MoE block runs expert-parallel, else None.

    Expert parallel: a mesh is set (``jax.set_mesh``) with an ``expert`` axis of size
    > 1, the dispatch is dropless (not "capacity") and the row axes divide ``rows`` (a
    batch the mesh cannot split, e.g. one evaluation prompt, takes the plain path, whose
    shardings XLA propagates).

    Raises:
      ValueError: the expert axis does not divide ``config.num_experts``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.shape.get("expert", 1) == 1:
        return None
    n_ep = mesh.shape["expert"]
    if config.num_experts % n_ep:
        raise ValueError(
            f"mesh.expert={n_ep} does not divide ModelConfig.num_experts="
            f"{config.num_experts}: every device must hold num_experts / expert "
            "experts"
        )
    axes = _row_axes(mesh)
    split = int(np.prod([mesh.shape[a] for a in axes]))
    if "expert" not in axes or rows % split:
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
    the pass buffers were f32[8, 65536, 2048], 4 GiB each; benchmarks/RESULTS.md)."""
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


def _expert_parallel_block(
    x,
    token_mask,
    routing,
    router,
    params,
    config: ModelConfig,
    dispatch: str,
    mesh,
    row_axes: tuple[str, ...],
):
    """The MoE block under ``jax.shard_map`` (see the section comment above).

    Args:
      x: [B, T, D]; token_mask: bool [B, T]; routing: int32 [B, T, k] or None;
      router: [D, E]; params: (w_gate, w_up [E, D, F], w_down [E, F, D]) in their
        parameter dtype; mesh: the abstract mesh; row_axes: mesh axes splitting B.
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

    def gathered(w, axis):
        # FSDP (ZeRO-3) inside the block: the model width of a weight arrives as this
        # device's shard and is all-gathered here, so that the weight's gradient, the
        # transpose of the all-gather, is reduce-scattered onto the shards (a psum_scatter;
        # left to XLA, the gradient is all-reduced at full size and then sliced on XLA:CPU,
        # which has no pass turning the two into a reduce-scatter).
        # Typed as varying over the other row axes first, so that the gradient's psum over
        # them (data parallelism) runs on the shard, after the reduce-scatter.
        others = tuple(a for a in row_axes if a not in width and a not in jax.typeof(w).mat.varying)
        w = jax.lax.pcast(w, others, to="varying") if others else w
        return jax.lax.all_gather(w, width, axis=axis, tiled=True) if width else w

    def body(x, token_mask, router, w_gate, w_up, w_down, *replay):
        b, t, d = x.shape
        router, w_gate, w_up = gathered(router, 0), gathered(w_gate, 1), gathered(w_up, 1)
        w_down = gathered(w_down, 2)
        flat = x.reshape(b * t, d)
        valid = token_mask.reshape(b * t)
        logits = flat.astype(jnp.float32) @ router.astype(jnp.float32)
        chosen = replay[0].reshape(b * t, k) if replay else None
        expert_ids, gates, probs = route(logits, k, cfg.norm_topk_prob, chosen)
        aux = router_aux(logits, probs, expert_ids, valid, num_experts, axis_names=row_axes)
        local_fn = functools.partial(_local_experts, config=cfg, dispatch=dispatch)
        y_copies = _exchange(
            flat.astype(dt),
            expert_ids,
            (w_gate, w_up, w_down),
            local_fn,
            n_ep,
            e_local,
            transport,
            cfg.moe_ep_buffer_factor,
            all_axes,
        )
        y = jnp.einsum("nkd,nk->nd", y_copies.reshape(b * t, k, d), gates.astype(dt))
        return y.reshape(b, t, d), expert_ids.reshape(b, t, k), aux

    rows = PartitionSpec(row_axes)
    shard = width or None
    args = (x, token_mask, router, *params) + (() if routing is None else (routing,))
    in_specs = (
        rows,
        rows,
        PartitionSpec(shard, None),
        PartitionSpec("expert", shard, None),
        PartitionSpec("expert", shard, None),
        PartitionSpec("expert", None, shard),
    ) + (() if routing is None else (rows,))
    return jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(rows, rows, PartitionSpec())
    )(*args)


class MoE(nnx.Module):
    """Qwen3-MoE sparse block: linear router + E SwiGLU experts (see module docstring)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d, f, e = config.hidden_size, config.expert_intermediate_size, config.num_experts
        std, pdt = config.initializer_range, config.weight_dtype
        self.config = config
        self.router = param(rngs, (d, e), ("embed", None), std=std, dtype=pdt)
        self.gate_proj = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std=std, dtype=pdt)
        self.up_proj = param(rngs, (e, d, f), ("expert", "embed", "mlp"), std=std, dtype=pdt)
        self.down_proj = param(rngs, (e, f, d), ("expert", "mlp", "embed"), std=std, dtype=pdt)

    def __call__(self, x: jax.Array, token_mask: jax.Array, routing: jax.Array | None = None):
        """Args:
          x: [B, T, D]; token_mask: bool [B, T]; routing: int32 [B, T, k] to replay or None.
        Returns:
          (y [B, T, D], routing int32 [B, T, k], aux dict of float32: load_balancing_loss,
           router_z_loss, dropped_tokens scalars and tokens_per_expert [E]).
        """
        cfg = self.config
        b, t, d = x.shape
        k, dt = cfg.num_experts_per_tok, cfg.compute_dtype
        dispatch = cfg.moe_dispatch
        if t == 1 and cfg.moe_decode_dispatch is not None:
            dispatch = cfg.moe_decode_dispatch  # a decode step
        plan = None if dispatch == "capacity" else expert_parallel_mesh(cfg, b)
        if plan is not None:
            params = tuple(w[...] for w in (self.gate_proj, self.up_proj, self.down_proj))
            y, expert_ids, aux = _expert_parallel_block(
                x, token_mask, routing, self.router[...], params, cfg, dispatch, *plan
            )
            aux["dropped_tokens"] = jnp.zeros((), jnp.float32)
            return y, expert_ids, aux
        flat = x.reshape(b * t, d)
        valid = token_mask.reshape(b * t)
        logits = flat.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        replay = None if routing is None else routing.reshape(b * t, k)
        expert_ids, gates, probs = route(logits, k, cfg.norm_topk_prob, replay)
        params = [w[...] for w in (self.gate_proj, self.up_proj, self.down_proj)]
        weights = [w.astype(dt) for w in params]
        dropped = jnp.zeros((), jnp.float32)
        if dispatch in ("ragged", "megablox"):
            matmul = "megablox" if dispatch == "megablox" else "ragged_dot"
            y = ragged_experts(flat.astype(dt), expert_ids, gates, *weights, matmul=matmul)
        elif dispatch == "blocked":
            # The parameters themselves: blocked_experts casts them (after its gather).
            y = blocked_experts(
                flat.astype(dt),
                expert_ids,
                gates,
                *params,
                block_size=cfg.moe_block_size,
                gather=cfg.resolved_weight_gather(),
            )
        elif dispatch == "dense":
            y = dense_experts(flat.astype(dt), expert_ids, gates, *weights)
        elif dispatch == "gathered":
            y = gathered_experts(flat.astype(dt), expert_ids, gates, *weights)
        else:
            y, dropped = capacity_experts(
                flat.astype(dt),
                expert_ids,
                gates,
                valid,
                *weights,
                capacity=cfg.expert_capacity(b * t),
            )
        aux = router_aux(logits, probs, expert_ids, valid, cfg.num_experts)
        aux["dropped_tokens"] = dropped
        return y.reshape(b, t, d), expert_ids.reshape(b, t, k), aux
