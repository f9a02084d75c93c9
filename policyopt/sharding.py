"""One JAX mesh from a single CPU to many hosts, the logical-axis rules that map the
model's dimensions onto it, and the placement of parameters and batches on it.

The model annotates every parameter with logical axis names in a ``logical_axes`` metadata
tuple (not flax's ``out_sharding``, which flax 0.12 refuses without a mesh) and every large
activation with ``constrain``; ``LOGICAL_AXIS_RULES`` maps the names to the mesh axes
``data``, ``fsdp``, ``tensor`` and ``expert``; without a mesh both are inert. Nothing else in
the library needs to know how many devices there are, and this module imports nothing from
the model code. Typical use, identical on one CPU and on a pod::

    initialize_distributed()                           # no-op on one host
    mesh = make_mesh({"data": -1, "fsdp": 1, "tensor": 1, "expert": 1})
    with jax.set_mesh(mesh):
      model = Transformer(config, rngs=nnx.Rngs(0))    # born sharded: each device its shards
    params = shard_params(params, mesh)                # from nnx.split(model); no copy
    batch = jax.device_put(batch, batch_sharding(mesh))

``fsdp_call`` gathers a layer's FSDP-sharded weights inside a ``shard_map`` so their
gradients are reduce-scattered; ``shard_rows`` splits a batch's rows; ``to_host`` gathers
from every process. The mesh, FSDP and several hosts: docs/scale.md.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
# Mesh axes: "data" (batch), "fsdp" (parameter + batch sharding), "tensor" (heads / mlp /
# vocab), "expert" (expert parallelism). A mesh that lacks an axis simply leaves it out.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Activations' rows (sequences): split over every axis that is data parallel for the
    # dense layers. "expert" too: attention, norms, embeddings and the dense MLPs see it as
    # one more data axis (each device its own rows), and the MoE block sends each token
    # copy from its row's device to its expert's (policyopt.models.moe, expert parallelism).
    ("batch", ("data", "fsdp", "expert")),
    # Sequence positions: whole on every device (attention needs them all).
    ("length", None),
    # Model width D of every weight (embedding, attention, MLP, router, experts): the FSDP
    # (ZeRO-3) shard; gathered per layer for the matmul, gradients reduce-scattered back
    # (explicitly, in a shard_map: ``fsdp_call``, and the MoE block's own, with or
    # without an expert axis: policyopt.models.expert_parallel).
    # Activations' D stays whole (it is contracted in every matmul).
    ("embed", "fsdp"),
    # The rank r of a LoRA adapter's matrix that has no model width (B of q_proj [r, H, Dh],
    # of the experts' w_gate / w_up [E, r, F], A of w_down [E, F, r]; policyopt.models.lora):
    # its FSDP shard instead, gathered like `embed` (FSDP_AXES).
    ("lora", "fsdp"),
    # Attention heads of q / o and k / v: Megatron-style tensor parallelism.
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    # head_dim: whole (RoPE and q.k contract it).
    ("kv", None),
    # MLP / expert hidden width F: tensor parallelism (column-split up/gate, row-split down).
    ("mlp", "tensor"),
    # Vocabulary of the embedding and LM head: tensor parallelism (the logits' softmax
    # then reduces over it).
    ("vocab", "tensor"),
    # The expert dimension E of the expert weights [E, D, F]: E / expert experts per device,
    # the destination of their tokens (their D dimension is still split over fsdp).
    ("expert", "expert"),
    ("layers", None),  # stacked decoder layers (scan_layers): every device holds all
)


def logical_to_mesh_axes(
    logical_axes: Sequence[str | None],
    rules=LOGICAL_AXIS_RULES,
    mesh_axis_names: Sequence[str] | None = None,
) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec through ``rules``.

    Mesh axes that are not in ``mesh_axis_names`` (when given) or already used by an
    earlier dimension are dropped, so one rules table serves every mesh shape.
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in logical_axes:
        target = table.get(name) if name is not None else None
        if target is None:
            out.append(None)
            continue
        targets = (target,) if isinstance(target, str) else tuple(target)
        keep = tuple(
            t
            for t in targets
            if t not in used and (mesh_axis_names is None or t in mesh_axis_names)
        )
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return PartitionSpec(*out)


def param_partition_specs(params_state, rules=LOGICAL_AXIS_RULES, mesh_axis_names=None):
    """PartitionSpec for every parameter of an ``nnx.State`` (from ``logical_axes``)."""
    from flax import nnx  # local: keep this module importable without flax at docs time

    def spec(variable):
        axes = variable.get_metadata().get("logical_axes")
        if axes is None:
            return PartitionSpec()
        return logical_to_mesh_axes(axes, rules, mesh_axis_names)

    return jax.tree.map(spec, params_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules=LOGICAL_AXIS_RULES):
    """``with_sharding_constraint`` by logical names when a mesh is set; identity otherwise.
    Inside a ``shard_map`` the axes it makes manual are left out (split by hand there)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    names = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    spec = logical_to_mesh_axes(logical_axes, rules, names)
    return jax.lax.with_sharding_constraint(x, spec)


# The logical axes that ZeRO-3 shards over the FSDP mesh axes and gathers per call
# (``fsdp_call``, the MoE block's gather): a weight's model width, else a LoRA adapter's
# rank. A weight has at most one of them.
FSDP_AXES = ("embed", "lora")


def fsdp_dim(logical_axes) -> int | None:
    """The dimension of a weight that FSDP splits (the first of ``FSDP_AXES`` among its
    logical axes), or None."""
    axes = tuple(logical_axes)
    return next((axes.index(name) for name in FSDP_AXES if name in axes), None)


def _mesh_axes_of(logical_name: str, mesh, rules=LOGICAL_AXIS_RULES) -> tuple[str, ...]:
    """The mesh axes (size > 1) that the rule of ``logical_name`` maps to, in order."""
    target = logical_to_mesh_axes((logical_name,), rules, mesh.axis_names)[0]
    names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
    return tuple(a for a in names if mesh.shape[a] > 1)


def fsdp_call(
    fn,
    rows,
    weights,
    weight_axes,
    *,
    policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    rules=LOGICAL_AXIS_RULES,
):
    """``fn(rows, weights)`` with each weight whole along its model width (ZeRO-3): the
    weights enter a ``jax.shard_map`` as their FSDP shards and are all-gathered there, so
    that their gradients are reduce-scattered back onto the shards.

    On a mesh whose ``embed`` rule has axes F of size > 1 (``fsdp``) and whose ``batch``
    rule's axes R (``data``, ``fsdp``, ``expert``; F among them) divide the rows, ``fn``
    runs once per device on its rows under a ``shard_map`` manual over R (``tensor`` stays
    automatic). A weight w of logical axes with ``embed`` (or a LoRA adapter's ``lora``
    rank, ``FSDP_AXES``) at dimension i (split over F where F divides it) is all-gathered
    over F along i; its gradient, the transpose,

        dW_shard = psum_scatter_F(dW_local)   then   psum over R \\ F,

    is the sum over every device's rows, as one device's, reduce-scattered onto the shard
    (left to XLA's SPMD partitioner, the sum is all-reduced at full size and then sliced on
    XLA:CPU, which has no pass forming a reduce-scatter from the two). The reduction over
    the other row axes (data parallelism) runs on the shard, after the reduce-scatter.
    Weights without an ``embed`` dimension are used whole and their gradients psum-ed.

    Elsewhere (no mesh, one device, no ``fsdp`` axis, rows the mesh cannot split, no weight
    split along ``embed``, row axes that are not ``Auto`` as ``make_mesh`` makes them, or
    already inside a ``shard_map``) it is ``fn(rows, weights)``: one device compiles
    exactly the program it did without this.

    Args:
      fn: ``fn(rows, weights) -> outputs``, per device: each rows leaf and output leaf has
        the rows first (each device sees B / |R| of them), ``weights`` whole.
      rows: pytree of arrays [B, ...] (``None`` leaves allowed), the rows first.
      weights: tuple of arrays, each in its parameter dtype (the gather moves that dtype,
        and the gradient is reduce-scattered in it).
      weight_axes: tuple of logical axes tuples, one per weight (``param``'s
        ``logical_axes``).
      policy: the ``jax.checkpoint`` policy of the call on the mesh: what of ``fn``'s
        forward pass is saved for the backward pass. The whole weights, and every value
        computed from them but a product with the rows, must not be (a scan over layers
        would keep every layer's): they are gathered again in the backward pass, as
        ZeRO-3 does. The default saves the matmuls' outputs and recomputes the rest
        (elementwise work); under an outer ``jax.checkpoint`` (``ModelConfig.remat``) the
        outer policy decides instead (JAX applies the outermost).
      rules: logical axis -> mesh axes.
    Returns:
      ``fn``'s outputs, a pytree of [B, ...] arrays (rows split over R on a mesh).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.manual_axes:
        return fn(rows, weights)
    width = _mesh_axes_of("embed", mesh, rules)
    row_axes = _mesh_axes_of("batch", mesh, rules)
    num_rows = {x.shape[0] for x in jax.tree.leaves(rows)}
    split = int(np.prod([mesh.shape[a] for a in row_axes]))
    extent = int(np.prod([mesh.shape[a] for a in width]))
    dims = []
    for w, axes in zip(weights, weight_axes, strict=True):
        dim = fsdp_dim(axes)
        dims.append(None if dim is None or w.shape[dim] % extent else dim)
    if (
        not width
        or not set(width) <= set(row_axes) <= set(mesh.auto_axes)
        or len(num_rows) != 1
        or num_rows.pop() % split
        or all(d is None for d in dims)
    ):
        return fn(rows, weights)

    def gathered(w, dim):
        # Typed as varying over the row axes it is not split over, so that its gradient's
        # psum over them (data parallelism) runs on the shard, after the reduce-scatter.
        others = tuple(
            a
            for a in row_axes
            if (dim is None or a not in width) and a not in jax.typeof(w).mat.varying
        )
        w = jax.lax.pcast(w, others, to="varying") if others else w
        return w if dim is None else jax.lax.all_gather(w, width, axis=dim, tiled=True)

    def body(rows, weights):
        return fn(rows, tuple(gathered(w, d) for w, d in zip(weights, dims)))

    rows_spec = PartitionSpec(row_axes)
    weight_specs = tuple(
        PartitionSpec(*([None] * d + [width])) if d is not None else PartitionSpec() for d in dims
    )
    per_device = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows_spec, weight_specs),
        out_specs=rows_spec,
        axis_names=frozenset(row_axes),
    )
    return jax.checkpoint(per_device, policy=policy)(rows, tuple(weights))


def initialize_distributed() -> None:
    """Start ``jax.distributed`` when the environment describes a multi-process job.

    One process (no coordinator address in the environment, no SLURM job, at most one
    process) does nothing, so scripts call it unconditionally, before any other JAX call.
    With ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES``
    and ``JAX_PROCESS_ID`` set, those are passed to ``jax.distributed.initialize``; without
    them JAX discovers the job itself (SLURM, Open MPI, TPU pods). The CPU backend runs
    its cross-process collectives through Gloo (JAX's default), so the same job runs on
    several CPU processes (``tests/test_multihost.py``).

    Every process then runs the same program: it sees every device
    (``jax.devices()``), holds only its own (``jax.local_devices()``), and host-side work
    is done identically on each (``to_host``, ``is_primary``).
    """
    env = os.environ
    num = int(env.get("JAX_NUM_PROCESSES", "1"))
    multi = env.get("JAX_COORDINATOR_ADDRESS") or env.get("SLURM_JOB_ID") or num > 1
    if not multi or jax.distributed.is_initialized():
        return
    kwargs = {}
    if env.get("JAX_COORDINATOR_ADDRESS") and "JAX_PROCESS_ID" in env:
        if "JAX_NUM_PROCESSES" not in env:
            raise ValueError(
                "JAX_COORDINATOR_ADDRESS and JAX_PROCESS_ID are set but "
                "JAX_NUM_PROCESSES is not: set it to the number of processes"
            )
        kwargs = dict(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=num,
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    jax.distributed.initialize(**kwargs)


def put(tree, shardings):
    """``jax.device_put(tree, shardings)``, also on a mesh that spans processes.

    There an array held by a single local device goes through the host first: with one
    device per process, XLA:CPU's ``device_put`` of such an array to a mesh-wide sharding
    returns an array whose shards cannot be listed (orbax's save then fails with "input
    arrays must have one shard each"). Host (NumPy) leaves and arrays already on the mesh
    are placed as they are.
    """
    if jax.process_count() > 1:
        tree = jax.tree.map(
            lambda x: np.asarray(x) if isinstance(x, jax.Array) and len(x.devices()) == 1 else x,
            tree,
        )
    return jax.device_put(tree, shardings)


def is_primary() -> bool:
    """True in process 0, the one that writes logs, metrics and other host-side files
    (checkpoints are written by every process together, through orbax)."""
    return jax.process_index() == 0


def broadcast_json(value):
    """``value`` (JSON-serialisable) as process 0 has it, in every process: for decisions
    that must agree across processes and come from a file only process 0 reads (e.g.
    whether a resumed run was already evaluated). A collective when there are several
    processes; returns ``value`` itself with one."""
    if jax.process_count() == 1:
        return value
    data = (
        np.frombuffer(json.dumps(value).encode(), np.uint8)
        if is_primary()
        else np.zeros(0, np.uint8)
    )
    size = int(multihost_utils.broadcast_one_to_all(np.asarray(data.size, np.int64)))
    buffer = np.zeros(size, np.uint8)
    if is_primary():
        buffer[:] = data
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).decode())


def to_host(tree):
    """Every array leaf of ``tree`` as a NumPy array holding the whole (global) value.

    On one process this is ``jax.device_get``. When an array spans devices of other
    processes (rows split over a multi-host mesh), its shards are gathered from every
    process (``multihost_utils.process_allgather``): a collective, so every process must
    call it, in the same order, as the same program does. Leaves that are not JAX arrays
    (NumPy arrays, Python numbers) pass through ``np.asarray``; ``None`` stays ``None``.
    """

    def fetch(x):
        if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(fetch, tree)


def make_mesh(shape: Mapping[str, int] | None = None, devices=None) -> Mesh:
    """A mesh over ``devices`` (default: all) with the axes of ``MESH_AXES``.

    Args:
      shape: size per axis name; at most one axis may be -1 (= all remaining devices).
        Missing axes have size 1. Default: everything on ``data``.
      devices: the devices to use, default ``jax.devices()`` (all hosts).

    Returns:
      A ``jax.sharding.Mesh`` with axis names ``MESH_AXES`` in that order.

    Raises:
      ValueError: an unknown axis name, or sizes that do not multiply to the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = dict(shape or {"data": -1})
    unknown = sorted(set(shape) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"mesh shape has unknown axes {unknown}; expected a subset of {MESH_AXES}")
    sizes = [int(shape.get(name, 1)) for name in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one axis may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if len(devices) % known:
            raise ValueError(
                f"mesh shape {shape}: {len(devices)} devices are not divisible by {known}"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh shape {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, "
            f"but {len(devices)} are available"
        )
    # Auto axes: XLA's partitioner propagates shardings from the parameters, the batch and
    # the model's logical constraints (explicit "sharding in types" would need an output
    # sharding on every gather).
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types, devices=devices)


def fit_spec(shape, spec: PartitionSpec, mesh) -> PartitionSpec:
    """``spec`` for an array of ``shape`` on ``mesh`` (a ``Mesh`` or ``AbstractMesh``).

    A dimension whose size its mesh axes do not divide is replicated instead (small test
    models on large meshes), so that any model fits any mesh. The spec is written in the
    canonical form in which ``jax.jit`` reports the shardings of its outputs: mesh axes of
    size 1 left out, a single axis as its name, no trailing replicated dimensions. A
    jitted step whose outputs are constrained to the specs its inputs were placed with
    then returns arrays whose shardings compare equal to the inputs', and the next call
    reuses the compiled step (jit keys its cache on the sharding objects).
    """
    dims = []
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        names = tuple(a for a in names if mesh.shape[a] > 1)
        extent = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        if not names or size % extent:
            dims.append(None)
        else:
            dims.append(names[0] if len(names) == 1 else names)
    while dims and dims[-1] is None:
        dims.pop()
    return PartitionSpec(*dims)


def logical_spec(shape, logical_axes, mesh, rules=LOGICAL_AXIS_RULES) -> PartitionSpec:
    """The ``PartitionSpec`` on ``mesh`` of an array of ``shape`` whose dimensions have these
    logical names (``LOGICAL_AXIS_RULES``), fitted by ``fit_spec``."""
    return fit_spec(shape, logical_to_mesh_axes(logical_axes, rules, mesh.axis_names), mesh)


def param_specs(params, mesh, rules=LOGICAL_AXIS_RULES):
    """``PartitionSpec`` of every parameter of ``params`` on ``mesh``, from its logical axes.

    Args:
      params: an ``nnx.State`` of parameters, or any pytree of ``nnx.Variable`` and array
        leaves (the critic's ``{"backbone": nnx.State, "head": {...}}``); arrays that are
        not ``nnx.Variable`` have no logical axes and are replicated.
      mesh: a ``Mesh``, or inside ``jax.jit`` the ``AbstractMesh`` set by ``jax.set_mesh``.
      rules: logical axis -> mesh axes.

    Returns:
      ``params``' structure down to the variables, a ``PartitionSpec`` (``fit_spec``) in
      place of each.
    """
    from flax import nnx

    def spec(leaf):
        if not isinstance(leaf, nnx.Variable):
            return PartitionSpec()
        axes = leaf.get_metadata().get("logical_axes") or ()
        return logical_spec(leaf.get_value().shape, axes, mesh, rules)

    return jax.tree.map(spec, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(params, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """``NamedSharding`` for every parameter of ``params``, from its logical axes
    (``param_specs``): a dimension whose size the mesh axis does not divide is replicated."""
    return named_shardings(param_specs(params, mesh, rules), mesh)


def shard_params(params, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """Place an ``nnx.State`` of parameters on ``mesh`` by their logical axes. Parameters
    already placed so (a model built under the mesh, ``place_host_array``) are returned as
    they are, without a copy."""
    return put(params, param_shardings(params, mesh, rules))


def current_mesh() -> Mesh | None:
    """The mesh set by ``jax.set_mesh`` when it spans more than one device; ``None`` when no
    mesh is set, when it has one device, or under a trace (``jax.jit``, ``eval_shape``:
    only the abstract mesh is known there)."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # get_mesh refuses to run under a trace
        return None
    return None if mesh.empty or mesh.size == 1 else mesh


def place_host_array(
    value, logical_axes, mesh: Mesh | None = None, rules=LOGICAL_AXIS_RULES
) -> jax.Array:
    """A host (NumPy) array as a device array, laid out as ``shard_params`` lays out a
    parameter with these logical axes.

    On ``mesh`` (default ``current_mesh()``) of more than one device: sharded by
    ``logical_spec``, each device receiving only its own slice of ``value``
    (``jax.make_array_from_callback``), so no device ever holds a dimension that the spec
    splits whole. With several processes each must pass the same ``value``; each places
    only its own devices' slices. Without a mesh, or on one device: ``jnp.asarray(value)``,
    placed by default.
    """
    mesh = current_mesh() if mesh is None else mesh
    if mesh is None or mesh.size == 1:
        return jnp.asarray(value)
    value = np.asarray(value)
    placement = NamedSharding(mesh, logical_spec(value.shape, logical_axes, mesh, rules))
    return jax.make_array_from_callback(value.shape, placement, lambda index: value[index])


def optimizer_specs(optimizer, opt_state, specs):
    """``PartitionSpec`` of every leaf of an optax state: each copy of the parameter tree it
    holds (Adam's moments) as the parameters' ``specs`` (``param_specs``), everything else
    (step counts) replicated (``optax.tree_utils.tree_map_params``)."""
    import optax
    from flax import nnx

    return optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        opt_state,
        specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def named_shardings(specs, mesh: Mesh):
    """A tree of ``PartitionSpec`` as ``NamedSharding`` on ``mesh``."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def constrain_tree(tree, specs_fn):
    """``with_sharding_constraint(tree, specs_fn(mesh))`` when a mesh is set
    (``jax.set_mesh``; ``mesh`` is then the abstract mesh), ``tree`` unchanged otherwise.

    Pins the outputs of a jitted step to the shardings its inputs were placed with, so the
    next call (and a checkpoint restored onto them) finds the same shardings and reuses
    the compiled step.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return tree
    return jax.lax.with_sharding_constraint(tree, specs_fn(mesh))


def row_spec(shape, mesh, axis: int = 0) -> PartitionSpec:
    """Dimension ``axis`` (the rows, logical ``batch``) split over ``data``, ``fsdp`` and
    ``expert`` when they divide it, every other dimension replicated."""
    return logical_spec(shape, (None,) * axis + ("batch",), mesh)


def shard_rows(x, axis: int = 0, mesh: Mesh | None = None):
    """``x`` on ``mesh`` (default: the one set by ``jax.set_mesh``) with its rows, dimension
    ``axis``, split over ``data`` and ``fsdp`` when their number divides (``row_spec``),
    else replicated. Without a mesh: ``x`` as a device array, as placed by default.
    ``None`` stays ``None`` (optional batch fields).

    ``x`` is the whole (global) batch: on a multi-process mesh every process passes the
    same ``x`` and keeps the shards of its own devices.
    """
    if x is None:
        return None
    mesh = jax.sharding.get_mesh() if mesh is None else mesh
    if mesh.empty:
        return jnp.asarray(x)
    return put(x, NamedSharding(mesh, row_spec(np.shape(x), mesh, axis)))


def batch_sharding(mesh: Mesh, rank: int = 2) -> NamedSharding:
    """Rows split over ``data``, ``fsdp`` and ``expert`` (the ``batch`` rule); the other
    ``rank - 1`` dimensions replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp", "expert"), *([None] * (rank - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (scalars, rng keys, step counters)."""
    return NamedSharding(mesh, PartitionSpec())
