"""LoRA adapters on the transformer's weights (Hu et al. 2021, arXiv 2106.09685).

A target weight W of shape ``[*batch, *in, *out]`` (the experts' batch axis E) gets
``A [*batch, *in, r]`` and ``B [*batch, r, *out]``, and every product with it becomes

    x W  ->  x W + (alpha / r) (x A) B,

A drawn as Flax NNX's ``nnx.LoRA`` draws it (He-uniform over the fan-in), B zero, so an
adapted model starts equal to its base. The adapters are ``nnx.LoRAParam`` variables (the
trainable filter), held by an ``Adapters`` module beside the weights they adapt, and are
applied unmerged in every matmul path: the attention and MLP einsums (``einsum``), each
expert's inside the grouped matmuls (``grouped``: ragged_dot and megablox; the blocked,
dense, gathered and capacity einsums) and the expert-parallel block. ``merged_params``
folds them into the base (sampler, export). docs/lora.md is the manual.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from policyopt import sharding
from policyopt.models.projection import project

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")  # the dense MLP's
EXPERTS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")  # every expert's
ROUTER = "router"
# Names that stand for several targets ("mlp": the feed-forward of every layer, dense or
# experts), each expanding to those of them the model has.
GROUPS = {
    "attention": ATTENTION,
    "mlp": MLP + EXPERTS,
    "experts": EXPERTS,
    "all": ATTENTION + MLP + EXPERTS + (ROUTER,),
}
_DTYPES = ("float32", "bfloat16", "float16")
INIT_CHECKPOINT = ("match", "base", "merged")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Which weights get adapters, their rank, scale and storage (``config.model.lora``).

    Attributes:
      rank: r of every adapter; 0 = no adapters (full-weight training).
      alpha: the scale numerator: adapters add (alpha / r) x A B (Hu et al. 2021 §4.1).
      targets: target names or groups (``GROUPS``): "q_proj", "k_proj", "v_proj",
        "o_proj", "gate_proj", "up_proj", "down_proj" (dense MLP), "experts.gate_proj",
        "experts.up_proj", "experts.down_proj" (one adapter per expert), "router".
      dtype: storage dtype of the adapters (the base's is ``ModelConfig.param_dtype``).
    """

    rank: int = 0
    alpha: float = 32.0
    targets: tuple[str, ...] = ("all",)
    dtype: str = "float32"

    def __post_init__(self):
        targets = self.targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        object.__setattr__(self, "targets", tuple(targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"model.lora.rank must be an int >= 0 (0: off), got {self.rank!r}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"model.lora.alpha must be a number > 0, got {alpha!r}")
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"model.lora.alpha must be a finite number > 0, got {alpha!r}")
        if self.rank and not self.targets:
            raise ValueError("model.lora.targets is empty: name at least one target or group")
        if self.dtype not in _DTYPES:
            raise ValueError(f"model.lora.dtype must be one of {_DTYPES}, got {self.dtype!r}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def resolve(self, model_config) -> tuple[str, ...]:
        """The targets ``model_config`` has that ``targets`` names, in ``GROUPS["all"]``
        order.

        Raises:
          ValueError: a name that is neither a target nor a group of this model, listing
            the model's targets and groups.
        """
        available = model_targets(model_config)
        chosen = set()
        for name in self.targets:
            members = [t for t in GROUPS.get(name, (name,)) if t in available]
            if not members:
                groups = [g for g in GROUPS if any(t in available for t in GROUPS[g])]
                raise ValueError(
                    f"model.lora.targets: {name!r} is not a target of this model; its "
                    f"targets: {', '.join(available)}; groups: {', '.join(groups)}"
                )
            chosen.update(members)
        return tuple(t for t in GROUPS["all"] if t in chosen)

    def check(self, model_config) -> tuple[str, ...]:
        """``resolve``, and every target's smaller dimension at least ``rank``.

        Raises:
          ValueError: one line naming the first target too small for the rank.
        """
        targets = self.resolve(model_config)
        sizes = target_sizes(model_config)
        for target in targets:
            d_in, d_out = sizes[target]
            if self.rank > min(d_in, d_out):
                raise ValueError(
                    f"model.lora.rank={self.rank} is larger than {target}'s smaller "
                    f"dimension ({d_in} x {d_out}, min {min(d_in, d_out)}); lower the rank "
                    "or leave the target out of model.lora.targets"
                )
        return targets


def model_targets(model_config) -> tuple[str, ...]:
    """The target names a model has: attention always, the dense MLP's where a layer is
    dense, the experts' and the router's where one is MoE."""
    targets = list(ATTENTION)
    if model_config.num_moe_layers < model_config.num_layers:
        targets += MLP
    if model_config.is_moe:
        targets += EXPERTS + (ROUTER,)
    return tuple(targets)


def target_sizes(model_config) -> dict[str, tuple[int, int]]:
    """(input size, output size) of each target's matrix (one expert's for the experts)."""
    c = model_config
    d, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    f, fe = c.intermediate_size, c.expert_intermediate_size
    return {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, f),
        "up_proj": (d, f),
        "down_proj": (f, d),
        "experts.gate_proj": (d, fe),
        "experts.up_proj": (d, fe),
        "experts.down_proj": (fe, d),
        "router": (d, c.num_experts),
    }


# --------------------------------------------------------------------------- adapted weights


class Adapted(NamedTuple):
    """A weight with its adapter: ``base [*batch, *in, *out]``, ``a [*batch, *in, r]``,
    ``b [*batch, r, *out]`` already times alpha / r. Casts and shapes read as the base's,
    so code written for a plain weight takes it where it only casts or reads the shape."""

    base: Any
    a: Any
    b: Any

    @property
    def shape(self):
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype

    def astype(self, dtype) -> "Adapted":
        return Adapted(*(x.astype(dtype) for x in self))

    def map(self, fn) -> "Adapted":
        """``fn`` applied to each of the three (e.g. a gather of the experts' rows)."""
        return Adapted(*(fn(x) for x in self))


def apply(fn, weight):
    """``fn(weight)``, or ``Adapted.map(fn)`` for an adapted one."""
    return weight.map(fn) if isinstance(weight, Adapted) else fn(weight)


def einsum(spec: str, x, weight, product=project):
    """``product(spec, x, weight)``: by default ``projection.project`` (the einsum whose
    backward runs as 2-D matmuls), ``jnp.einsum`` where a caller wants autodiff's own; for
    an ``Adapted`` weight plus the low-rank path ``(x A) B``, its two products taken alike
    (the weight's letters must read batch, contracted, produced).

    E.g. ``"btd,dnh->btnh"``: ``x W + project("btr,rnh->btnh", project("btd,dr->btr", x, A), B)``.
    """
    if not isinstance(weight, Adapted):
        return product(spec, x, weight)
    inputs, out = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    batch = "".join(c for c in ws if c in xs and c in out)
    contracted = "".join(c for c in ws if c in xs and c not in out)
    produced = "".join(c for c in ws if c not in xs)
    if ws != batch + contracted + produced:
        raise ValueError(f"lora.einsum: weight letters {ws!r} of {spec!r} are not batch, in, out")
    r = next(c for c in "rzyxwvu" if c not in spec)
    low = "".join(c for c in xs if c not in contracted) + r
    hidden = product(f"{xs},{batch}{contracted}{r}->{low}", x, weight.a)
    delta = product(f"{low},{batch}{r}{produced}->{out}", hidden, weight.b)
    return product(spec, x, weight.base) + delta


def grouped(matmul, rows, weight, group_sizes):
    """A grouped matmul (``jax.lax.ragged_dot`` or the megablox kernel: rows sorted by
    group, ``rows[i] @ weight[group(i)]``) with each group's own adapter:
    ``matmul(rows, W) + matmul(matmul(rows, A), B)``."""
    if not isinstance(weight, Adapted):
        return matmul(rows, weight, group_sizes)
    low = matmul(rows, weight.a, group_sizes)
    return matmul(rows, weight.base, group_sizes) + matmul(low, weight.b, group_sizes)


def adapter_axes(axes: tuple, batch_dims: int, in_dims: int) -> tuple[tuple, tuple]:
    """Logical axes of A and B from the base weight's. The rank axis is ``"lora"`` (split
    over the FSDP axes, ``policyopt.sharding``) where the matrix has no model width
    (``"embed"``), else whole: every adapter matrix is then sharded by FSDP."""
    axes = tuple(axes)
    lead, inputs, outputs = (
        axes[:batch_dims],
        axes[batch_dims : batch_dims + in_dims],
        axes[batch_dims + in_dims :],
    )
    rank = lambda others: None if "embed" in others else "lora"
    return lead + inputs + (rank(lead + inputs),), lead + (rank(lead + outputs),) + outputs


def flatten(weights) -> tuple[tuple, tuple, tuple]:
    """``[(weight, axes), ...]`` (``Adapters.adapt``'s) -> (arrays, their logical axes,
    structure for ``unflatten``): an adapted weight contributes base, A and B."""
    arrays, axes, structure = [], [], []
    for weight, weight_axes in weights:
        adapted = isinstance(weight, Adapted)
        structure.append(adapted)
        arrays.extend(weight if adapted else (weight,))
        axes.extend(weight_axes if adapted else (weight_axes,))
    return tuple(arrays), tuple(axes), tuple(structure)


def unflatten(structure: tuple, arrays) -> list:
    """The inverse of ``flatten``: the weights (arrays or ``Adapted``)."""
    arrays, weights = list(arrays), []
    for adapted in structure:
        if adapted:
            weights.append(Adapted(*arrays[:3]))
            del arrays[:3]
        else:
            weights.append(arrays.pop(0))
    return weights


# --------------------------------------------------------------------------- modules


class Adapter(nnx.Module):
    """One weight's adapter: ``lora_a`` and ``lora_b``, ``nnx.LoRAParam`` (as ``nnx.LoRA``)."""

    def __init__(self, lora_a: nnx.LoRAParam, lora_b: nnx.LoRAParam):
        self.lora_a = lora_a
        self.lora_b = lora_b


class Adapters(nnx.Module):
    """The adapters of one module's weights, one ``Adapter`` attribute per adapted weight
    (named as the weight), with their scale alpha / r and layouts."""

    def __init__(self, scale: float, layout: dict[str, tuple[int, int]], adapters: dict):
        self.scale = float(scale)
        # ((weight name, (batch dims, input dims)), ...): static, so hashable.
        self.layout = tuple(sorted(layout.items()))
        for name, adapter in adapters.items():
            setattr(self, name, adapter)


def adapt(adapters: Adapters | None, name: str, base, axes: tuple):
    """``(weight, axes)`` of the module weight ``name`` (``base``: its value, ``axes``: its
    logical axes): ``base`` as it is, or ``Adapted(base, A, B alpha / r)`` with
    ``Adapted`` axes when ``adapters`` holds one for it."""
    adapter = None if adapters is None else getattr(adapters, name, None)
    if adapter is None:
        return base, tuple(axes)
    b = adapter.lora_b[...]
    a_axes, b_axes = adapter_axes(axes, *dict(adapters.layout)[name])
    return (
        Adapted(base, adapter.lora_a[...], (b * adapters.scale).astype(b.dtype)),
        Adapted(tuple(axes), a_axes, b_axes),
    )


def build_adapters(
    module,
    slots: dict[str, tuple[str, int, int]],
    config: LoRAConfig,
    targets: tuple[str, ...],
    key,
    layers: tuple[int, ...] | None,
) -> Adapters | None:
    """The ``Adapters`` of ``module`` for those of its weights whose target is chosen.

    Args:
      module: holds each weight of ``slots`` as an ``nnx.Param`` attribute.
      slots: weight name -> (target name, batch dims, input dims).
      config: rank, alpha, dtype; targets: the chosen ones (``LoRAConfig.check``).
      key: the adapters' PRNG key; A of layer l and target t is a pure function of
        (key, l, t), so the values do not depend on the layout or the build order.
      layers: the module's layer indices: one (per-layer block) or a run (stacked, the
        weights with a leading ``layers`` axis); None: not in a layer (layer 0).
    Returns:
      ``Adapters`` or None when no weight of ``module`` is a target.
    """
    stacked = layers is not None and len(layers) > 0 and _is_stacked(module, slots, layers)
    layer_ids = tuple(layers) if layers else (0,)
    adapters, layout = {}, {}
    for name, (target, batch_dims, in_dims) in slots.items():
        if target not in targets:
            continue
        variable = getattr(module, name)
        shape = tuple(variable.get_value().shape)
        axes = tuple(variable.get_metadata().get("logical_axes") or (None,) * len(shape))
        if stacked:
            shape, axes = shape[1:], axes[1:]
        a_axes, b_axes = adapter_axes(axes, batch_dims, in_dims)
        lead, inputs = shape[:batch_dims], shape[batch_dims : batch_dims + in_dims]
        a_shape = lead + inputs + (config.rank,)
        b_shape = lead + (config.rank,) + shape[batch_dims + in_dims :]
        # He-uniform over the fan-in, nnx.LoRA's default for A: U(-sqrt(6 / fan_in), +).
        bound = math.sqrt(6.0 / math.prod(inputs))
        index = GROUPS["all"].index(target)
        draws = [_uniform(key, layer, index, a_shape, bound) for layer in layer_ids]
        zeros = [np.zeros(b_shape, np.float32)] * len(layer_ids)
        a = _variable(draws, a_axes, config.dtype, stacked)
        b = _variable(zeros, b_axes, config.dtype, stacked)
        adapters[name], layout[name] = Adapter(a, b), (batch_dims, in_dims)
    if not adapters:
        return None
    return Adapters(config.scale, layout, adapters)


def _is_stacked(module, slots, layers) -> bool:
    """Whether ``module``'s weights carry a leading ``layers`` axis (a scanned run)."""
    name = next(iter(slots))
    axes = getattr(module, name).get_metadata().get("logical_axes") or ()
    return bool(axes) and axes[0] == "layers"


def _uniform(key, layer: int, target: int, shape, bound: float):
    """U(-bound, bound) of ``shape`` for (key, layer, target): drawn on the host with NumPy
    (building compiles nothing, as ``policyopt.models.layers.param``), or with
    ``jax.random`` under a trace (``nnx.eval_shape``)."""
    if isinstance(key, jax.core.Tracer):
        key = jax.random.fold_in(jax.random.fold_in(key, layer), target)
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound)
    seed = np.asarray(jax.random.key_data(key)).astype(np.uint32).ravel().tolist()
    draw = np.random.default_rng(seed + [layer, target]).uniform(-bound, bound, shape)
    return draw.astype(np.float32)


def _variable(values: list, axes: tuple, dtype: str, stacked: bool) -> nnx.LoRAParam:
    """An ``nnx.LoRAParam`` of one layer's value, or of the layers' stacked."""
    axes = (("layers",) if stacked else ()) + tuple(axes)
    if any(isinstance(v, jax.core.Tracer) for v in values):
        value = (jnp.stack(values) if stacked else values[0]).astype(dtype)
        return nnx.LoRAParam(value, logical_axes=axes)
    value = (np.stack(values) if stacked else values[0]).astype(jnp.dtype(dtype))
    return nnx.LoRAParam(sharding.place_host_array(value, axes), logical_axes=axes)


# --------------------------------------------------------------------------- states


def split(model: nnx.Module):
    """``(graphdef, trainable, frozen)``: with adapters, the ``nnx.LoRAParam`` state and
    the rest of the parameters (the base); without, every ``nnx.Param`` and None.

    Raises:
      ValueError: the model holds state other than parameters.
    """
    graphdef, trainable, frozen, rest = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError(
            "the policy holds non-parameter state (e.g. batch statistics or rngs); "
            "the RL steps only carry nnx.Param"
        )
    if not jax.tree.leaves(trainable):
        return graphdef, frozen, None
    return graphdef, trainable, frozen


def combine(frozen, trainable):
    """The whole model's state: ``trainable`` joined to the ``frozen`` base (no copy), or
    ``trainable`` alone when ``frozen`` is None."""
    return trainable if frozen is None else nnx.merge_state(frozen, trainable)


def base_graphdef(model: nnx.Module):
    """The graphdef of ``model`` without its adapters: merged with the base's state alone
    (``split``'s ``frozen``) it is the base model."""
    holders = [m for _, m in model.iter_modules() if getattr(m, "lora", None) is not None]
    saved = [m.lora for m in holders]
    for m in holders:
        m.lora = None
    try:
        return nnx.graphdef(model)
    finally:
        for m, adapters in zip(holders, saved):
            m.lora = adapters


def adapter_pairs(adapters) -> dict[tuple, tuple]:
    """``{base path: (A, B)}`` of an adapter state (``split``'s ``trainable``): the path of
    the weight each adapts (``(..., "lora", name, "lora_a")`` -> ``(..., name)``)."""
    pairs: dict[tuple, dict] = {}
    for path, variable in nnx.to_flat_state(adapters):
        if len(path) < 3 or path[-3] != "lora" or path[-1] not in ("lora_a", "lora_b"):
            raise ValueError(f"{'.'.join(map(str, path))} is not an adapter's A or B")
        pairs.setdefault(tuple(path[:-3]) + (path[-2],), {})[path[-1]] = variable.get_value()
    return {path: (ab["lora_a"], ab["lora_b"]) for path, ab in pairs.items()}


def delta(a, b, shape) -> jax.Array:
    """The low-rank product A B (float32) laid out as the base weight of ``shape``:
    ``A [*lead, *in, r]``, ``B [*lead, r, *out]`` (lead: batch axes, and ``layers``)."""
    lead = a.ndim + b.ndim - 2 - len(shape)
    lead_shape, rank = a.shape[:lead], a.shape[-1]
    a2 = a.reshape(lead_shape + (-1, rank)).astype(jnp.float32)
    b2 = b.reshape(lead_shape + (rank, -1)).astype(jnp.float32)
    return jnp.einsum("...ir,...ro->...io", a2, b2).reshape(shape)


def merged_params(frozen, adapters, scale: float):
    """The base's state with every adapted weight replaced by ``W + scale A B`` (in W's
    dtype): the adapted model as a plain one (``base_graphdef``), e.g. for the sampler or
    an export. Jit it to keep it on the devices."""
    pairs = adapter_pairs(adapters)
    flat = []
    for path, variable in nnx.to_flat_state(frozen):
        if tuple(path) in pairs:
            a, b = pairs[tuple(path)]
            w = variable.get_value()
            merged = w.astype(jnp.float32) + scale * delta(a, b, w.shape)
            variable = variable.replace(merged.astype(w.dtype))
        flat.append((path, variable))
    missing = set(pairs) - {tuple(p) for p, _ in nnx.to_flat_state(frozen)}
    if missing:
        raise ValueError(f"adapters without a base weight: {sorted(missing)[:3]}")
    return nnx.from_flat_state(flat)
