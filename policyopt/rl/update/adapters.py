"""The weights of an RL run with LoRA adapters (``config.model.lora``): the trainable
adapters, the frozen base they join, what the sampler decodes with, and the base's
identity in a checkpoint.

Only the adapters are trainable (``TrainState.params``, the optimiser's state); the base
is held once (``PolicyWeights.frozen``, in ``model.lora.base_dtype``), is the KL
reference policy (``RunSpec.ref_params``: the same arrays, the adapters off) and is not
saved: a checkpoint holds the adapters, the optimiser state and ``lora_record`` (rank,
alpha, targets and the base's source and fingerprint), and a run rebuilds the base from
its config (or the record's source) and checks the fingerprint. docs/lora.md has the
how-to, the init-checkpoint rules and the figures.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from policyopt import sharding
from policyopt.checkpoint import Checkpointer, tree_checksums
from policyopt.models import lora

SAMPLER_WEIGHTS = ("merged", "unmerged")
CRITIC_WEIGHTS = ("adapters", "full")


@dataclasses.dataclass(frozen=True)
class PolicyWeights:
    """How a run's trainable parameters become the model the forwards and the sampler run.

    Attributes:
      graphdef: the policy's structure (with its adapters, if any).
      frozen: the base's parameters (LoRA), or None (full weights: trainable is all).
      base_graphdef: the structure without adapters (LoRA), for the merged sampler and
        the reference policy.
      scale: the adapters' alpha / r.
      sampler: "merged" (the sampler decodes the base graph with W + scale A B, merged
        once per weight version) or "unmerged" (the adapted graph, A and B applied at
        every step).
    """

    graphdef: Any
    frozen: Any = None
    base_graphdef: Any = None
    scale: float = 1.0
    sampler: str = "merged"
    _merge: Callable | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.sampler not in SAMPLER_WEIGHTS:
            raise ValueError(
                f"config.model.lora.sampler must be one of {SAMPLER_WEIGHTS}, got {self.sampler!r}"
            )
        if self.frozen is not None and self._merge is None:
            # Out on the base's shardings, so that the sampler's programs see one layout.
            shardings = jax.tree.map(lambda x: x.sharding, self.frozen)
            merge = jax.jit(
                lambda frozen, adapters: lora.merged_params(frozen, adapters, self.scale),
                out_shardings=shardings,
            )
            object.__setattr__(self, "_merge", merge)

    @property
    def lora(self) -> bool:
        return self.frozen is not None

    def full(self, trainable):
        """The whole model's state (no copy): the adapters joined to the base."""
        return lora.combine(self.frozen, trainable)

    def for_sampler(self, trainable) -> tuple[Any, Any]:
        """``(graphdef, params)`` the sampler, the engine and the evaluation decode with,
        for one weight version of ``trainable``."""
        if self.frozen is None:
            return self.graphdef, trainable
        if self.sampler == "merged":
            return self.base_graphdef, self._merge(self.frozen, trainable)
        return self.graphdef, self.full(trainable)


def make_weights(config, model: nnx.Module, trainable, frozen) -> PolicyWeights:
    """The run's ``PolicyWeights`` from its model and ``lora.split``'s states."""
    if frozen is None:
        return PolicyWeights(graphdef=nnx.graphdef(model))
    return PolicyWeights(
        graphdef=lora.split(model)[0],
        frozen=frozen,
        base_graphdef=lora.base_graphdef(model),
        scale=model.config.lora.scale,
        sampler=config.model.lora.sampler,
    )


# --------------------------------------------------------------------------- identity


def fingerprint(params) -> str:
    """A hex digest of every array of ``params`` (by path: the bits of each, weighted by
    position, summed mod 2^32 on the devices, ``checkpoint.tree_checksums``, then SHA-256
    over the sorted sums): equal for equal arrays, whatever the mesh."""
    sums = tree_checksums(params)
    return hashlib.sha256(json.dumps(sums, sort_keys=True).encode()).hexdigest()[:16]


def base_source(config) -> dict:
    """Where a run's base comes from: a HuggingFace folder, an orbax checkpoint (read as
    the base, ``model.lora.init_checkpoint="base"``) or the preset's initialisation."""
    if config.init_checkpoint and config.model.lora.init_checkpoint == "base":
        directory = os.path.abspath(config.init_checkpoint)
        with Checkpointer(directory) as source:
            step = source.latest_step()
        return {"kind": "checkpoint", "directory": directory, "step": step}
    if config.model.pretrained:
        return {"kind": "pretrained", "path": os.path.abspath(config.model.pretrained)}
    return {"kind": "init", "preset": config.model.preset, "seed": int(config.seed)}


def lora_record(config, model_config, frozen, source: dict) -> dict:
    """What a LoRA checkpoint's meta says of its adapters and their base (``"lora"``)."""
    adapters = model_config.lora
    dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(frozen)})
    return {
        "rank": adapters.rank,
        "alpha": adapters.alpha,
        "targets": list(adapters.targets),
        "dtype": adapters.dtype,
        "base": {"source": source, "dtype": ",".join(dtypes), "fingerprint": fingerprint(frozen)},
    }


def describe(source: dict) -> str:
    """A base source in words."""
    if source.get("kind") == "checkpoint":
        return f"the checkpoint {source['directory']} (step {source['step']})"
    if source.get("kind") == "pretrained":
        return f"the HuggingFace folder {source['path']}"
    return f"preset {source.get('preset')!r} initialised from seed {source.get('seed')}"


def check_kind(saved: dict | None, config, where: str, field: str) -> None:
    """Refuses a checkpoint of the other kind (adapters vs full weights) than the run.

    ``saved``: the checkpoint's ``meta.get("lora")`` (None: full weights). ``field``:
    what the checkpoint is to the run ("resume", "config.init_checkpoint").

    Raises:
      ValueError: one line naming the checkpoint, both kinds and the field that would make
        the use explicit (``model.lora.init_checkpoint``).
    """
    rank = int(config.model.lora.rank)
    mode = config.model.lora.init_checkpoint
    if field == "resume":
        if rank and saved is None:
            raise ValueError(
                f"resume: {where} was saved without LoRA (full weights) and this run trains "
                f"adapters (model.lora.rank={rank}); start a new workdir "
                "(config.init_checkpoint=<it> with model.lora.init_checkpoint='base')"
            )
        if not rank and saved is not None:
            raise ValueError(
                f"resume: {where} holds LoRA adapters (rank {saved['rank']}) and this run "
                "trains full weights (model.lora.rank=0); resume with the same model.lora.*, "
                "or start a new workdir (model.lora.init_checkpoint='merged')"
            )
        return
    if rank and saved is None and mode != "base":
        raise ValueError(
            f"{field}={where} holds full weights (saved without LoRA) and this run trains "
            f"adapters (model.lora.rank={rank}): set model.lora.init_checkpoint='base' to "
            "use its weights as the frozen base"
        )
    if rank and saved is not None and mode != "match":
        raise ValueError(
            f"{field}={where} holds LoRA adapters (rank {saved['rank']}): "
            f"model.lora.init_checkpoint={mode!r} is for a full-weight checkpoint; use "
            "'match' to continue its adapters"
        )
    if not rank and saved is not None and mode != "merged":
        raise ValueError(
            f"{field}={where} holds LoRA adapters (rank {saved['rank']}) and this run trains "
            "full weights (model.lora.rank=0): set model.lora.init_checkpoint='merged' to "
            "start from its base with the adapters merged in"
        )
    if not rank and saved is None and mode == "merged":
        raise ValueError(
            f"{field}={where} holds full weights: model.lora.init_checkpoint='merged' is "
            "for a LoRA checkpoint; use 'match'"
        )


def check_base(saved: dict, frozen, where: str) -> None:
    """Refuses adapters trained on another base than ``frozen`` (``lora_record``'s
    fingerprint; a base held in another dtype is not compared).

    Raises:
      ValueError: one line naming both bases.
    """
    base = saved.get("base") or {}
    dtypes = ",".join(sorted({str(x.dtype) for x in jax.tree.leaves(frozen)}))
    if base.get("dtype") != dtypes or "fingerprint" not in base:
        return
    have = fingerprint(frozen)
    if have != base["fingerprint"]:
        raise ValueError(
            f"{where}: its adapters were trained on another base ({describe(base['source'])}, "
            f"fingerprint {base['fingerprint']}) than this run's (fingerprint {have}); build "
            "the run on the same base (model.pretrained / model.preset / seed / "
            "config.init_checkpoint)"
        )


# --------------------------------------------------------------------------- restoring


def restore_params(directory: str, target, step: int | None = None, *, check=None):
    """The ``train.params`` of the orbax checkpoint in ``directory`` restored onto
    ``target`` (concrete arrays: shapes, dtypes and shardings; cast to them); ``check``:
    ``(checkpointer, step) -> None`` run on the step about to be read (shape checks)."""
    with Checkpointer(directory) as source:
        return source.restore_subtree(
            ("train", "params"),
            target,
            step,
            check=None if check is None else lambda candidate, _: check(source, candidate),
        )


def saved_lora(directory: str) -> dict | None:
    """The ``"lora"`` record of the checkpoint in ``directory`` (latest), or None."""
    with Checkpointer(directory) as source:
        if source.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        return source.meta().get("lora")


def base_of_record(saved: dict, frozen):
    """The base a LoRA checkpoint's adapters were trained on, onto ``frozen``'s arrays: its
    source checkpoint's parameters when the record names one, else ``frozen`` itself (the
    run builds that base from its own config: same preset and seed, or folder)."""
    source = (saved.get("base") or {}).get("source") or {}
    if source.get("kind") != "checkpoint":
        return frozen
    return restore_params(source["directory"], frozen, source.get("step"))


def saved_adapters(model_config, saved: dict, mesh, seed: int = 0):
    """Zero arrays shaped as a LoRA checkpoint's adapters (its rank, alpha, targets) on
    ``mesh``: the target to restore them onto."""
    from policyopt.models import Transformer  # the model, for the adapters' shapes

    config = model_config.replace(
        lora=lora.LoRAConfig(
            rank=int(saved["rank"]),
            alpha=float(saved["alpha"]),
            targets=tuple(saved["targets"]),
            dtype=saved.get("dtype", "float32"),
        )
    )
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed)))
    adapters = nnx.state(abstract, nnx.LoRAParam)
    zeros = jax.tree.map(
        lambda v: v.replace(jnp.zeros(v.get_value().shape, v.get_value().dtype)),
        adapters,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return sharding.shard_params(zeros, mesh), config.lora.scale
