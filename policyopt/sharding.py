"""One JAX mesh from a single CPU to many hosts, and the placement of parameters and
batches on it.

The model annotates every parameter with logical axis names and every large activation
with a sharding constraint (``policyopt.models.sharding``: one small rules table maps the
logical names to the mesh axes below). This module only builds the mesh and puts arrays on
it; nothing else in the library needs to know how many devices there are.

Mesh axes (any may have size 1):

  data    pure data parallelism: batch rows split, parameters replicated
  fsdp    batch rows split *and* parameters sharded along ``embed`` (ZeRO-3 style)
  tensor  attention heads, MLP hidden units and the vocabulary split (Megatron style)
  expert  MoE experts split (expert parallelism)

Typical use, identical on one CPU and on a pod::

    initialize_distributed()                           # no-op on one host
    mesh = make_mesh({"data": -1, "fsdp": 1, "tensor": 1, "expert": 1})
    params = shard_params(params, mesh)                # from nnx.split(model)
    batch = jax.device_put(batch, batch_sharding(mesh))
    with jax.set_mesh(mesh):
      state, metrics = update(state, batch)

Tests run it on 8 simulated CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

from __future__ import annotations

import os
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from policyopt.models.sharding import LOGICAL_AXIS_RULES, param_partition_specs

MESH_AXES = ("data", "fsdp", "tensor", "expert")


def initialize_distributed() -> None:
    """Start ``jax.distributed`` when the environment describes a multi-host job.

    On a single host (no coordinator address in the environment, one process) this does
    nothing, so scripts call it unconditionally. On clusters JAX discovers the coordinator
    itself (SLURM, TPU pods, ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` +
    ``JAX_PROCESS_ID``).
    """
    env = os.environ
    multi = (env.get("JAX_COORDINATOR_ADDRESS") or env.get("SLURM_JOB_ID")
             or int(env.get("JAX_NUM_PROCESSES", "1")) > 1)
    if multi and not jax.distributed.is_initialized():
        jax.distributed.initialize()


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
            raise ValueError(f"mesh shape {shape}: {len(devices)} devices are not divisible by {known}")
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh shape {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, "
            f"but {len(devices)} are available")
    # Auto axes: XLA's partitioner propagates shardings from the parameters, the batch and
    # the model's logical constraints (explicit "sharding in types" would need an output
    # sharding on every gather).
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types, devices=devices)


def param_shardings(params, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """``NamedSharding`` for every parameter of an ``nnx.State``, from its logical axes.

    A dimension whose size the mesh axis does not divide is replicated instead (small test
    models on large meshes), so any model can be put on any mesh.
    """
    from flax import nnx

    specs = param_partition_specs(params, rules, mesh.axis_names)

    def fit(variable, spec):
        shape = variable.get_value().shape if isinstance(variable, nnx.Variable) else variable.shape
        dims = []
        for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
            names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            extent = int(np.prod([mesh.shape[a] for a in names])) if names else 1
            dims.append(axes if size % extent == 0 else None)
        return NamedSharding(mesh, PartitionSpec(*dims))

    is_leaf = lambda x: isinstance(x, nnx.Variable)
    return jax.tree.map(fit, params, specs, is_leaf=is_leaf)


def shard_params(params, mesh: Mesh, rules=LOGICAL_AXIS_RULES):
    """Place an ``nnx.State`` of parameters on ``mesh`` by their logical axes."""
    return jax.device_put(params, param_shardings(params, mesh, rules))


def batch_sharding(mesh: Mesh, rank: int = 2) -> NamedSharding:
    """Rows split over ``data`` and ``fsdp``; the other ``rank - 1`` dimensions replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (rank - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (scalars, rng keys, step counters)."""
    return NamedSharding(mesh, PartitionSpec())
