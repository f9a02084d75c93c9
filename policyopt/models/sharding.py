"""Logical axis names of the model's parameters and activations, and the one table
that maps them to mesh axes.

Every parameter is created with a ``logical_axes`` metadata tuple naming its dimensions
(``embed``, ``heads``, ``kv``, ``mlp``, ``vocab``, ``expert``; ``layers``, the leading axis of
the stacked parameters of ``ModelConfig.scan_layers``; ``None`` = replicated), and
activations pass through :func:`constrain` with names such as ``batch`` and ``length``.
Without a mesh both are inert. Sharding a model then only needs a mesh::

    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    specs = param_partition_specs(nnx.state(model, nnx.Param))
    with jax.set_mesh(mesh): ...

(The metadata key is ``logical_axes`` rather than flax's ``out_sharding`` because flax
0.12 shards eagerly at creation and refuses ``out_sharding`` without a mesh.)
"""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import PartitionSpec

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
    # (ZeRO-3) shard; gathered per layer for the matmul, gradients reduce-scattered back.
    # Activations' D stays whole (it is contracted in every matmul).
    ("embed", "fsdp"),
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
    ("layers", None),        # stacked decoder layers (scan_layers): every device holds all
)


def logical_to_mesh_axes(logical_axes: Sequence[str | None],
                         rules=LOGICAL_AXIS_RULES,
                         mesh_axis_names: Sequence[str] | None = None) -> PartitionSpec:
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
        keep = tuple(t for t in targets
                     if t not in used and (mesh_axis_names is None or t in mesh_axis_names))
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
    """``with_sharding_constraint`` by logical names when a mesh is set; identity otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    spec = logical_to_mesh_axes(logical_axes, rules, mesh.axis_names)
    return jax.lax.with_sharding_constraint(x, spec)
