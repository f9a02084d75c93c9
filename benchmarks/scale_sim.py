"""Will it fit: per-device memory of a recipe's jitted update or rollout at pod scale,
compiled (never run) on N simulated CPU devices without allocating a parameter.

    python -m benchmarks.scale_sim --step update --config configs/gspo.py:scale=paper,\\
        sampling.max_new_tokens=20480 --devices 64 --mesh fsdp=8,expert=8 \\
        --seq-len 32768 --prompt-len 1024 --device-memory-gib 80

The recipe string is ``train``'s (or ``--method`` and ``--variant``). The step is
compiled and read with ``compiled.memory_analysis()`` and its optimized HLO; what the run
keeps on each device beside it is added (``benchmarks/scale_fit.py``); with
``--device-memory-gib`` the output ends with ``fits: yes`` or ``fits: no ... try ...``.
docs/scale.md, "Will it fit: scale_sim", says how to read the figures.

LoRA (``model.lora.rank`` > 0 in the recipe string; docs/lora.md): the train state holds
the adapters and their optimiser state, the frozen base is an argument of every call as
the trainer passes it (``frozen_gib_per_device``, inside the peak); the rollout decodes
the sampler's weights of ``model.lora.sampler`` (merged: a base-sized copy, with the base
and the adapters resident beside it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import sys
import time

from benchmarks import scale_fit
from benchmarks.scale_fit import gib_text

GIB = 1024**3
# KV token slots per device of the engine's pool when neither --engine-kv-tokens nor the
# recipe sets one: 2^17 (qwen3_30b_a3b: 12 GiB of bf16 keys and values at 96 KiB per token,
# 24 GiB in the preset's float32).
DEFAULT_ENGINE_KV_TOKENS = 1 << 17
KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
)
_COLLECTIVE = re.compile(
    r"=\s+(?P<type>\S.*?)\s+(?P<kind>ragged-all-to-all|all-reduce|all-gather|reduce-scatter"
    r"|all-to-all|collective-permute)(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|c64|c128)\[([\d,]*)\]")
_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}


def _dtype_bytes(name: str) -> float:
    if name in _BYTES:
        return _BYTES[name]
    if name.startswith("f8"):
        return 1
    return int(re.sub(r"\D", "", name)) / 8


def collectives(hlo_text: str, top: int = 3) -> dict:
    """Collective ops of an optimized HLO module, by kind.

    Returns:
      ``{kind: {"count", "bytes", "largest": [{"shape", "bytes"}, ...]}}`` for every kind
      of ``KINDS`` (count 0 when absent); ``bytes`` sums the result sizes of the ops as
      written (static: once per op, not per loop iteration); an async ``-start`` op counts
      its largest array.
    """
    found = {kind: [] for kind in KINDS}
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match:
            continue
        arrays = [
            (f"{dtype}[{dims}]", _dtype_bytes(dtype) * _prod(dims))
            for dtype, dims in _ARRAY.findall(match["type"])
        ]
        if not arrays:
            continue
        if match["start"]:
            arrays = [max(arrays, key=lambda a: a[1])]
        shapes = [a[0] for a in arrays]
        if len(shapes) == 1:
            shape = shapes[0]
        elif len(set(shapes)) == 1:  # a combined op over equal arrays
            shape = f"{len(shapes)} x {shapes[0]}"
        else:
            shape = "(" + ", ".join(shapes) + ")"
        found[match["kind"]].append((shape, int(sum(a[1] for a in arrays))))
    return {
        kind: {
            "count": len(ops),
            "bytes": sum(b for _, b in ops),
            "largest": [
                {"shape": s, "bytes": b} for s, b in sorted(ops, key=lambda o: -o[1])[:top]
            ],
        }
        for kind, ops in found.items()
    }


def _prod(dims: str) -> int:
    out = 1
    for d in dims.split(","):
        if d:
            out *= int(d)
    return out


def _literal(text: str):
    """A command-line value: a Python literal, ``true`` / ``false``, or the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_args(argv=None) -> argparse.Namespace:
    """The flags (``--help``); ``--model.FIELD=value`` and ``--config.FIELD=value`` are
    collected into ``model_overrides`` / ``config_overrides``. Geometry left out comes from
    the recipe (``resolve_inputs``)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scale_sim",
        description="Compile-only per-device memory and collectives of a recipe's jitted "
        "update or rollout on simulated CPU devices, what stays resident beside it, and "
        "whether it fits (docs/scale.md, 'Will it fit: scale_sim').",
        epilog="--config.FIELD=value overrides a field of the recipe's config, as in train "
        "(e.g. --config.model.remat=full); --model.FIELD=value a ModelConfig field "
        "(any field, e.g. --model.moe_block_size=1024).",
    )
    p.add_argument("--step", choices=("update", "rollout"), required=True)
    p.add_argument(
        "--config",
        help="the recipe string as train takes it: configs/<name>.py[:variant] "
        "(or --method and --variant)",
    )
    p.add_argument("--method", help="recipe configs/<method>.py (default gspo)")
    p.add_argument("--variant", help="the recipe's variant string (configs/base.py)")
    p.add_argument("--preset", help="policyopt.models.presets name (default: model.preset)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument(
        "--mesh",
        help="axis=size,... over data, fsdp, tensor, expert (one may be -1; default: the "
        "recipe's config.mesh)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        help="update: tokens per row, prompt included (default: the recipe's widest row, "
        "max(batch.prompt_buckets) + sampling.max_new_tokens)",
    )
    p.add_argument(
        "--prompt-len", type=int, help="prompt tokens per row (default: max(batch.prompt_buckets))"
    )
    p.add_argument(
        "--rows-per-device",
        type=int,
        default=1,
        help="update: rows of the minibatch = this x devices",
    )
    p.add_argument("--prompts", type=int, help="rollout: prompts per round (batch.n_prompts)")
    p.add_argument("--samples", type=int, help="rollout: samples per prompt (batch.group_size)")
    p.add_argument(
        "--new-tokens", type=int, help="rollout: max_new_tokens (sampling.max_new_tokens)"
    )
    p.add_argument(
        "--engine-kv-tokens",
        type=int,
        help="rollout: KV token slots of the engine's pool per device (0: one "
        "generate_fn call over every row; default: the recipe's "
        "sampling.engine_kv_tokens, else 2^17)",
    )
    p.add_argument(
        "--engine-attention",
        default="pool",
        choices=("gather", "online", "pool"),
        help="rollout: the engine's attention over pages (policyopt.models.paged; default "
        'the engine\'s, "pool"; '
        'the TPU kernel, "pallas", does not compile for the CPU: '
        '"online" reads the pages one at a time as it does; "pool" scores the pages '
        "in place for decode steps, compiled here over the whole pool, held_pages 0)",
    )
    p.add_argument(
        "--engine-rows",
        type=int,
        help="rollout: rows the engine decodes per device (default: the recipe's "
        "sampling.engine_rows, else prompts x samples / devices on the row axes)",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="config.batch.micro_batch_tokens, where the learner has micro-batches",
    )
    p.add_argument(
        "--full-depth",
        action="store_true",
        help="compile every layer of an unrolled model too (scanned layers always compile "
        "whole; unrolled ones are otherwise extrapolated from 1 and 2 layers)",
    )
    p.add_argument(
        "--device-memory-gib",
        type=float,
        help="one device's memory: the output ends with 'fits: yes' or 'fits: no ... try' "
        "and the settings that lower it",
    )
    p.add_argument("--json", help="write the result here")
    p.add_argument("--verbose", action="store_true", help="show the traceback of an error")
    args, rest = p.parse_known_args(argv)
    args.model_overrides, args.config_overrides = {}, []
    for item in rest:
        name, sep, value = item.partition("=")
        if not sep or not name.startswith(("--model.", "--config.")):
            p.error(
                f"unrecognized argument {item!r} (expected --model.FIELD=value or "
                "--config.FIELD=value)"
            )
        if name.startswith("--model."):
            args.model_overrides[name[len("--model.") :]] = _literal(value)
        else:
            args.config_overrides.append(f"{name[len('--config.') :]}={value}")
    if args.config and (args.method or args.variant):
        p.error("give the recipe as --config PATH[:variant] or as --method/--variant, not both")
    return args


def load_recipe(args) -> tuple[str, object, str]:
    """``(name, module, variant)`` of the recipe: ``--config PATH[:variant]``, or
    ``configs/<--method>.py`` with ``--variant``."""
    if args.config:
        path, _, variant = args.config.partition(":")
        if not os.path.isfile(path):
            raise ValueError(f"config file not found: {path!r} (--config {args.config})")
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(f"_scale_sim_recipe_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return name, module, variant
    name = args.method or "gspo"
    try:
        module = importlib.import_module(f"configs.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"configs.{name}":
            raise
        raise ValueError(f"--method {name!r}: there is no recipe configs/{name}.py") from None
    return name, module, args.variant or ""


def recipe_config(args):
    """The recipe's config with its variant, ``--config.*`` and ``--micro-batch-tokens``
    (checked and locked by the recipe's ``finalize``); sets ``args.recipe`` (its name) and
    ``args.variant_items`` (the variant's ``key=value`` items)."""
    from configs import base

    args.recipe, recipe, variant = load_recipe(args)
    args.variant_items = [item.replace(" ", "") for item in base.split_variant(variant)]
    variant = [variant] if variant else []
    variant += args.config_overrides
    if args.micro_batch_tokens is not None:
        variant.append(f"batch.micro_batch_tokens={args.micro_batch_tokens}")
    return recipe.get_config(",".join(variant) or None)


def resolve_inputs(args, config) -> None:
    """Fills the geometry the command line leaves out from the recipe (the widest row of
    its update, its round of prompts x samples) and refuses one the step cannot run, each
    error one line naming the flag or field."""
    b, s = config.batch, config.sampling
    if args.prompt_len is None:
        args.prompt_len = int(max(b.prompt_buckets))
    if args.step == "rollout":
        args.prompts = int(b.n_prompts) if args.prompts is None else args.prompts
        args.samples = int(b.group_size) if args.samples is None else args.samples
        args.new_tokens = int(s.max_new_tokens) if args.new_tokens is None else args.new_tokens
        return
    if args.seq_len is None:
        args.seq_len = args.prompt_len + int(s.max_new_tokens)
    if not 0 < args.prompt_len < args.seq_len:
        raise ValueError(f"--prompt-len {args.prompt_len} must be in (0, --seq-len {args.seq_len})")
    rows, group = args.rows_per_device * args.devices, int(b.group_size)
    if config.algo.aggregation == "group_token_mean" and rows % group:
        need = group // math.gcd(group, args.devices)
        raise ValueError(
            f"the minibatch of {rows} rows (--rows-per-device {args.rows_per_device} x "
            f"--devices {args.devices}) does not hold whole groups of "
            f"batch.group_size={group}, which algo.aggregation='group_token_mean' needs: "
            f"use --rows-per-device {need} (or a multiple)"
        )


def mesh_shape(args, config) -> dict[str, int]:
    """``--mesh``, else the recipe's ``config.mesh`` (as train builds it)."""
    from policyopt import sharding

    if args.mesh is not None:
        return parse_mesh(args.mesh)
    return {name: int(getattr(config.mesh, name)) for name in sharding.MESH_AXES}


def parse_mesh(text: str) -> dict[str, int]:
    """``"fsdp=8,expert=8"`` -> ``{"fsdp": 8, "expert": 8}``."""
    shape = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, size = item.partition("=")
        if not sep:
            raise ValueError(f"--mesh item {item!r} is not axis=size")
        shape[name.strip()] = int(size)
    return shape


def set_device_count(devices: int) -> None:
    """Puts ``--xla_force_host_platform_device_count=devices`` into ``XLA_FLAGS`` (and the
    CPU platform into ``JAX_PLATFORMS``); JAX reads them once, when it starts. In a process
    where JAX already runs (tests calling ``main`` twice), its device count must match."""
    if "jax" in sys.modules:
        import jax

        if jax.device_count() != devices:
            raise RuntimeError(
                f"JAX already started with {jax.device_count()} devices; run "
                f"scale_sim in a fresh process for --devices {devices}"
            )
        return
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    if not any(f.startswith("--xla_backend_optimization_level") for f in flags):
        # LLVM's optimisation level: compiles ~1.5x faster at 0, and buffer assignment (what
        # memory_analysis reports) runs before it: the same bytes either way (measured).
        flags.append("--xla_backend_optimization_level=0")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    os.environ["JAX_PLATFORMS"] = "cpu"


def model_config(args, config, num_layers: int | None = None):
    """The preset with the recipe's ``config.model`` overrides (every field of ``config.model``
    that names a ``ModelConfig`` field and is set), then ``--model.*``; at ``num_layers``
    layers, or the depth those give; with ``config.model.lora.rank > 0`` LoRA adapters as
    the trainer builds them (``policyopt.rl.loop.build.make_model``: the base in
    ``model.lora.base_dtype``, the adapters in the parameter dtype)."""
    from policyopt.models import ModelConfig, preset
    from policyopt.rl.loop.build import lora_config

    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"lora"}
    overrides = {k: v for k, v in config.model.items() if k in fields and v is not None}
    overrides.update(args.model_overrides)
    if num_layers is not None:
        overrides["num_layers"] = num_layers
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"--model.{unknown[0]}: ModelConfig has no field {unknown[0]!r} "
            f"(fields: {', '.join(sorted(fields))}; LoRA: model.lora.* in the recipe string)"
        )
    model = preset(args.preset, **overrides)
    if config.model.lora.rank > 0:
        model = model.replace(
            param_dtype=config.model.lora.base_dtype or model.param_dtype,
            lora=lora_config(config, model.param_dtype),
        )
    return model


@dataclasses.dataclass
class Setup:
    """What one compile needs: the abstract train state and the learner."""

    learner: object
    graphdef: object
    state: object  # TrainState of ShapeDtypeStruct, sharded (LoRA: the adapters')
    model_config: object
    frozen: object = None  # LoRA: the frozen base, ShapeDtypeStruct, sharded; else None
    base_graphdef: object = None  # LoRA: the model without adapters

    def sampler(self, form: str = "merged") -> tuple:
        """``(graphdef, params)`` the generation calls take (LoRA: the base with the
        adapters merged in, shaped as the base, or the adapted graph unmerged)."""
        if self.frozen is None:
            return self.graphdef, self.state.params
        if form == "merged":
            return self.base_graphdef, self.frozen
        from policyopt.models import lora

        return self.graphdef, lora.combine(self.frozen, self.state.params)


def build(args, config, mesh, num_layers: int) -> Setup:
    """The model (abstract), learner and sharded abstract train state at ``num_layers``."""
    import jax
    from flax import nnx

    from policyopt import sharding
    from policyopt.config import typed
    from policyopt.models import Transformer, lora
    from policyopt.rl.update.learner import (
        LossSettings,
        TrainState,
        get_learner,
        state_specs,
    )

    cfg = model_config(args, config, num_layers)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, frozen = lora.split(model)
    run_config = typed(config)
    learner = get_learner(graphdef, LossSettings.of(run_config), run_config.optim)
    state = jax.eval_shape(lambda p: TrainState.create(p, learner.optimizer), params)
    state = scale_fit.abstract(state, state_specs(state, learner.optimizer, mesh), mesh)
    if frozen is None:
        return Setup(learner, graphdef, state, cfg)
    frozen = scale_fit.abstract(frozen, sharding.param_specs(frozen, mesh), mesh)
    return Setup(learner, graphdef, state, cfg, frozen, lora.base_graphdef(model))


def update_batch(args, config, setup: Setup, mesh):
    """The abstract minibatch of the recipe's update, rows placed as ``shard_batch`` does."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from policyopt import sharding
    from policyopt.rl.batch import Batch

    rows, width = args.rows_per_device * args.devices, args.seq_len
    response = width - args.prompt_len

    def sds(shape, dtype, axis=0):
        spec = sharding.row_spec(shape, mesh, axis)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    from policyopt.advantages import uses_critic

    algo, cfg = config.algo, setup.model_config
    gae = uses_critic(algo.advantage)  # a critic beside the policy
    trainer_old = algo.old_log_probs == "trainer"
    replay = cfg.is_moe and algo.routing_replay in ("R2", "R3")
    return Batch(
        tokens=sds((rows, width), jnp.int32),
        positions=sds((rows, width), jnp.int32),
        attention_mask=sds((rows, width), jnp.int32),
        mask=sds((rows, response), jnp.float32),
        advantages=sds((rows, response) if gae else (rows,), jnp.float32),
        old_log_probs=sds((rows, response), jnp.float32),
        importance_weights=(
            sds((rows, response), jnp.float32)
            if trainer_old and algo.get("tis_cap") is not None
            else None
        ),
        ref_log_probs=sds((rows, response), jnp.float32) if algo.kl_beta > 0 else None,
        routing=(
            sds((cfg.num_moe_layers, rows, width, cfg.num_experts_per_tok), jnp.int32, 1)
            if replay
            else None
        ),
        old_values=sds((rows, response), jnp.float32) if gae else None,
        returns=sds((rows, response), jnp.float32) if gae else None,
        nll_weights=sds((rows,), jnp.float32) if algo.nll_coef > 0 else None,
        loss_mask=(
            sds((rows, response), jnp.float32)
            if trainer_old and (algo.get("rs_level") is not None or algo.get("rs_veto") is not None)
            else None
        ),
    )


def rollout_calls(args, config, setup: Setup, mesh) -> list[tuple[str, object]]:
    """``(name, lower)`` of every jitted generation call of one synchronous round of
    ``prompts x samples`` rows: the engine's (``policyopt.engine``: admission, decode,
    eviction; one shard per device along the row axes, each with its budget), or with
    ``--engine-kv-tokens 0`` one ``generate_fn`` over all the rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from policyopt import sharding
    from policyopt.sampling import generate_fn

    vocab = setup.model_config.vocab_size
    sampling_config = scale_fit.sampling_config(config, vocab, args.new_tokens, args.samples)

    def rows(shape, dtype):
        spec = sharding.row_spec(shape, mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
    engine = engine_config(args, config, mesh)
    graphdef, params = setup.sampler(config.model.lora.sampler)
    if engine is None:
        shape = (args.prompts, args.prompt_len)
        prompts, lengths = rows(shape, jnp.int32), rows(shape[:1], jnp.int32)
        lower = lambda: generate_fn.lower(
            graphdef, params, prompts, lengths, rng, config=sampling_config
        )
        return [("generate_fn", lower)]
    from policyopt.engine import (
        admit_rows,
        decode_steps,
        empty_state,
        evict_rows,
        row_shards,
        state_specs,
    )

    shards = row_shards(mesh)
    state = jax.eval_shape(
        lambda: empty_state(setup.model_config, engine, sampling_config, args.prompt_len, shards)
    )
    state = scale_fit.abstract(state, state_specs(state, mesh), mesh)
    per_shard = [rows((shards,), jnp.int32) for _ in range(5)]
    prompts = rows((shards, args.prompt_len), jnp.int32)
    return [
        (
            "engine_admit",
            lambda: admit_rows.lower(
                graphdef, params, state, prompts, *per_shard, config=sampling_config
            ),
        ),
        (
            "engine_decode",
            lambda: decode_steps.lower(
                graphdef,
                params,
                state,
                rng,
                config=sampling_config,
                steps=engine.steps_per_call,
            ),
        ),
        ("engine_evict", lambda: evict_rows.lower(state, rows((engine.rows * shards,), jnp.bool_))),
    ]


def engine_config(args, config, mesh):
    """The engine's per-shard budget: ``--engine-kv-tokens`` (default the recipe's
    ``sampling.engine_kv_tokens``, else ``DEFAULT_ENGINE_KV_TOKENS``), ``--engine-rows``
    (default the recipe's ``engine_rows``, else the round's rows over the shards);
    None for ``--engine-kv-tokens 0``."""
    from policyopt.engine import EngineConfig, row_shards

    s = config.sampling
    kv_tokens = args.engine_kv_tokens
    if kv_tokens is None:
        kv_tokens = s.engine_kv_tokens or DEFAULT_ENGINE_KV_TOKENS
    if kv_tokens == 0:
        return None
    shards = row_shards(mesh)
    rows = args.engine_rows or s.engine_rows or args.samples * -(-args.prompts // shards)
    return EngineConfig(
        kv_tokens=kv_tokens,
        rows=rows,
        page_size=s.engine_page_size,
        attention=args.engine_attention,
        capture_routing=config.algo.routing_replay == "R3",
    )


def compile_once(args, config, mesh, num_layers: int, setup: Setup | None = None) -> dict:
    """Lowers and compiles the step(s) at ``num_layers`` (``compile_s`` times both) and reads
    their memory and collectives."""
    import jax

    setup = setup or build(args, config, mesh, num_layers)
    if args.step == "update":
        batch = update_batch(args, config, setup, mesh)
        calls = [("update", lambda: setup.learner.update.lower(setup.state, batch, setup.frozen))]
    else:
        calls = rollout_calls(args, config, setup, mesh)
    results = []
    for name, lower in calls:
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = lower().compile()
        seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        parts = {
            k: int(getattr(memory, f"{k}_size_in_bytes"))
            for k in ("argument", "output", "alias", "temp")
        }
        results.append(
            dict(
                call=name,
                num_layers=num_layers,
                compile_s=round(seconds, 2),
                peak_bytes=parts["argument"] + parts["output"] - parts["alias"] + parts["temp"],
                **{f"{k}_bytes": v for k, v in parts.items()},
                collectives=collectives(compiled.as_text()),
            )
        )
    return dict(setup=setup, calls=results)


def extrapolate(peak_1: int, peak_2: int, num_layers: int) -> int | None:
    """``peak(L) = peak(1) + (L - 1) (peak(2) - peak(1))``: each unrolled layer adds its
    buffers. None where that is unsound: 2 layers holding less than 1."""
    if peak_2 < peak_1:
        return None
    return peak_1 + (num_layers - 1) * (peak_2 - peak_1)


def depth_plan(args, model) -> tuple[tuple[int, ...], str]:
    """The depths to compile and how the figure is had: scanned layers compile whole (one
    layer's cost), never extrapolated; unrolled layers are extrapolated from 1 and 2
    layers unless ``--full-depth``, two layers or fewer, or ``moe_layers``."""
    depth = model.num_layers
    if model.scan_layers:
        return (depth,), "compiled at full depth: scanned layers compile as one"
    if args.full_depth or depth <= 2:
        return (depth,), "compiled at full depth"
    if model.moe_layers is not None:
        return (depth,), "compiled at full depth: moe_layers mixes layer kinds"
    return (1, 2), "extrapolated"


def num_params(setup: Setup) -> int:
    """The model's parameter count, from the abstract state's shapes."""
    import jax
    import numpy as np

    return int(sum(np.prod(x.shape) for x in jax.tree.leaves((setup.state.params, setup.frozen))))


def simulate(args) -> dict:
    """Runs the simulation (JAX must start after ``set_device_count``) and returns its record."""
    set_device_count(args.devices)
    import jax

    from policyopt import sharding

    config = recipe_config(args)
    resolve_inputs(args, config)
    if args.preset is None:
        if config.model.pretrained:
            raise ValueError(
                f"config.model.pretrained={config.model.pretrained!r}: scale_sim builds "
                "presets; name the preset of the checkpoint's shape with --preset"
            )
        args.preset = config.model.preset
    shape = mesh_shape(args, config)
    try:
        mesh = sharding.make_mesh(shape)
    except ValueError as error:
        raise ValueError(f"mesh {shape} over --devices {args.devices}: {error}") from None
    top_model = model_config(args, config)
    full = top_model.num_layers
    # The abstract state at full depth, from the shapes alone (nothing compiled or allocated).
    top = build(args, config, mesh, full)
    notes = scale_fit.paper_scale_notes(args, top_model, num_params(top))
    for note in notes:
        print(note, flush=True)
    depths, how = depth_plan(args, top_model)
    compiles = [compile_once(args, config, mesh, d, top if d == full else None) for d in depths]
    peaks = [[c["peak_bytes"] for c in calls] for calls in zip(*(x["calls"] for x in compiles))]
    extrapolated = len(depths) > 1
    if extrapolated and any(extrapolate(p[0], p[1], full) is None for p in peaks):
        compiles.append(compile_once(args, config, mesh, full, top))
        how = "compiled at full depth: 2 unrolled layers held less than 1, no extrapolation"
        extrapolated = False
    batch = update_batch(args, config, top, mesh) if args.step == "update" else None
    resident = scale_fit.resident(
        args.step, config, top, mesh, batch=batch, prompt_len=args.prompt_len
    )
    resident_bytes = sum(r.bytes for r in resident)
    state_bytes = scale_fit.per_device_bytes((top.state.params, top.state.opt_state))
    params_bytes = scale_fit.per_device_bytes(top.state.params)
    frozen_bytes = 0 if top.frozen is None else scale_fit.per_device_bytes(top.frozen)
    calls = []
    for index, last in enumerate(compiles[-1]["calls"]):
        record = {k: v for k, v in last.items() if k not in ("peak_bytes", "num_layers")}
        by_depth = [c["calls"][index] for c in compiles]
        if extrapolated:
            p1, p2 = by_depth[0]["peak_bytes"], by_depth[1]["peak_bytes"]
            peak, per_layer = extrapolate(p1, p2, full), p2 - p1
        else:
            by_depth = [c["calls"][index] for c in compiles if c["calls"][0]["num_layers"] == full]
            peak, per_layer = last["peak_bytes"], None
        record.update(
            per_device_peak_gib=peak / GIB,
            per_layer_gib=None if per_layer is None else per_layer / GIB,
            total_gib=(peak + resident_bytes) / GIB,
            compiles=[
                {
                    k: c[k]
                    for k in (
                        "num_layers",
                        "compile_s",
                        "peak_bytes",
                        "argument_bytes",
                        "output_bytes",
                        "alias_bytes",
                        "temp_bytes",
                    )
                }
                for c in by_depth
            ],
            compile_s=round(sum(c["compile_s"] for c in by_depth), 2),
            collectives_num_layers=last["num_layers"],
        )
        calls.append(record)
    worst = max(calls, key=lambda c: c["per_device_peak_gib"])
    mesh_record = {name: int(size) for name, size in mesh.shape.items()}
    b = config.batch
    record = dict(
        step=args.step,
        preset=args.preset,
        method=args.recipe,
        devices=args.devices,
        mesh=mesh_record,
        num_layers=full,
        extrapolated=extrapolated,
        depth=how,
        notes=notes,
        per_device_peak_gib=worst["per_device_peak_gib"],
        state_gib_per_device=state_bytes / GIB,
        params_gib_per_device=params_bytes / GIB,
        frozen_gib_per_device=frozen_bytes / GIB,
        lora=(
            None
            if top.frozen is None
            else dict(dataclasses.asdict(top.model_config.lora), sampler=config.model.lora.sampler)
        ),
        resident=[r.as_dict() for r in resident],
        resident_gib=resident_bytes / GIB,
        total_gib=worst["total_gib"],
        device_memory_gib=args.device_memory_gib,
        fits=None,
        levers=[],
        compile_s=round(sum(c["compile_s"] for c in calls), 2),
        collectives=worst["collectives"],
        calls=calls,
        model={k: v for k, v in dataclasses.asdict(top.model_config).items()},
        inputs=dict(
            config=args.config,
            variant=args.variant,
            seq_len=args.seq_len,
            prompt_len=args.prompt_len,
            rows_per_device=args.rows_per_device,
            prompts=args.prompts,
            samples=args.samples,
            new_tokens=args.new_tokens,
            engine_kv_tokens=args.engine_kv_tokens,
            engine_rows=args.engine_rows,
            engine_attention=args.engine_attention,
            micro_batch_tokens=args.micro_batch_tokens,
            model_overrides=args.model_overrides,
            config_overrides=args.config_overrides,
        ),
        jax_version=jax.__version__,
    )
    if args.step == "update":
        record["rows"] = args.rows_per_device * args.devices
        record["rows_on_each_device"] = rows_on_each_device(record["rows"], mesh)
        record["recipe_minibatch_rows"] = b.n_prompts * b.group_size // b.n_minibatches
        record["micro_batch_tokens"] = b.micro_batch_tokens
    else:
        record["prompt_rows_on_each_device"] = rows_on_each_device(args.prompts, mesh)
        engine = engine_config(args, config, mesh)
        record["engine"] = (
            None if engine is None else dict(dataclasses.asdict(engine), shards=row_shards_of(mesh))
        )
        record["rows"] = args.prompts * args.samples
    if args.device_memory_gib is not None:
        record["fits"] = record["total_gib"] <= args.device_memory_gib
        if not record["fits"]:
            record["levers"] = [
                dict(setting=s, effect=e) for s, e in scale_fit.levers(record, top.model_config)
            ]
    return record


def row_shards_of(mesh) -> int:
    from policyopt.engine import row_shards

    return row_shards(mesh)


def rows_on_each_device(rows: int, mesh) -> int:
    """How many of ``rows`` rows one device holds when placed as ``shard_rows`` places them."""
    from jax.sharding import NamedSharding

    from policyopt import sharding

    spec = sharding.row_spec((rows,), mesh)
    return int(NamedSharding(mesh, spec).shard_shape((rows,))[0])


def format_table(record: dict) -> str:
    """The record as a short readable table, ending with the fits verdict when asked."""
    mesh = ",".join(f"{k}={v}" for k, v in record["mesh"].items() if v > 1) or "1 device"
    lines = [
        f"scale_sim --step {record['step']}: {record['preset']} "
        f"({record['num_layers']} layers), {record['method']}, {record['devices']} devices, "
        f"mesh {mesh}"
    ]
    inputs = record["inputs"]
    if record["step"] == "update":
        recipe_rows = record["recipe_minibatch_rows"]
        lines.append(
            f"  minibatch {record['rows']} rows x {inputs['seq_len']} tokens "
            f"({inputs['prompt_len']} prompt); rows on each device: "
            f"{record['rows_on_each_device']}"
            + (
                f" (the recipe's minibatch: {recipe_rows} rows)"
                if recipe_rows != record["rows"]
                else ""
            )
        )
    else:
        lines.append(
            f"  {inputs['prompts']} prompts x {inputs['samples']} samples, "
            f"{inputs['prompt_len']} prompt + {inputs['new_tokens']} new tokens; "
            f"prompts on each device: {record['prompt_rows_on_each_device']}"
        )
        engine = record.get("engine")
        if engine:
            lines.append(
                f"  engine: {engine['shards']} shards (one per device on the row axes), "
                f"each {engine['rows']} rows, {engine['kv_tokens']} KV token slots "
                f"in pages of {engine['page_size']}, {engine['attention']} attention, "
                f"{engine['steps_per_call']} "
                f"steps per decode call, routing captured: "
                f"{engine['capture_routing']}"
            )
    model = record["model"]
    lines.append(
        f"  model: {model['dtype']} matmuls, scan_layers {model['scan_layers']}, remat "
        f"{model['remat']}, attention {model['attention']}"
        + (
            f", moe_dispatch {model['moe_dispatch']}"
            + (
                f" (blocks of {model['moe_block_size']}"
                + (
                    f", {model['moe_chunk_rows']} rows at a time)"
                    if model.get("moe_chunk_rows")
                    else ")"
                )
                if model["moe_dispatch"] == "blocked"
                else ""
            )
            if model["num_experts"]
            else ""
        )
    )
    if record.get("lora"):
        adapters = record["lora"]
        lines.append(
            f"  LoRA rank {adapters['rank']} (alpha {adapters['alpha']}) on "
            f"{','.join(adapters['targets'])}: frozen base per device "
            f"{gib_text(record['frozen_gib_per_device'], 0)} GiB; trainable adapters + "
            f"optimiser {gib_text(record['state_gib_per_device'], 0)} GiB (adapters "
            f"{gib_text(record['params_gib_per_device'], 0)})"
        )
    else:
        lines.append(
            f"  state (params + optimiser) per device: "
            f"{gib_text(record['state_gib_per_device'], 0)} GiB "
            f"(params {gib_text(record['params_gib_per_device'], 0)})"
        )
    lines.append(
        f"  {'call':<12}{'layers':>7}{'compile s':>10}{'argument':>10}{'output':>9}"
        f"{'alias':>9}{'temp':>10}{'peak GiB':>10}"
    )
    for call in record["calls"]:
        for c in call["compiles"]:
            lines.append(
                f"  {call['call']:<12}{c['num_layers']:>7}{c['compile_s']:>10.1f}"
                + "".join(
                    gib_text(c[k + "_bytes"] / GIB, w)
                    for k, w in (("argument", 10), ("output", 9), ("alias", 9), ("temp", 10))
                )
                + gib_text(c["peak_bytes"] / GIB, 10)
            )
        if record["extrapolated"]:
            how = (
                f"extrapolated from 1 and 2 unrolled layers, {gib_text(call['per_layer_gib'], 0)} "
                f"GiB per layer: each adds its buffers; --full-depth compiles all "
                f"{record['num_layers']}"
            )
        else:
            how = record["depth"]
        lines.append(
            f"  {call['call']:<12}{record['num_layers']:>7}  per-device peak "
            f"{gib_text(call['per_device_peak_gib'], 0)} GiB ({how})"
        )
        lines.append(
            f"  collectives of the {call['collectives_num_layers']}-layer {call['call']} "
            "(static count, largest result):"
        )
        for kind, info in call["collectives"].items():
            if info["count"]:
                big = info["largest"][0]
                lines.append(
                    f"    {kind:<20}{info['count']:>5}  {big['shape']} "
                    f"({big['bytes'] / 2**20:.1f} MiB)"
                )
    return "\n".join(lines + scale_fit.format_verdict(record))


def _message(error: BaseException) -> str:
    """An error as one line (a KeyError's message is the repr of its argument)."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def main(argv=None) -> dict:
    """Parses the flags, simulates and prints the table (and writes ``--json``). Errors a
    user makes end with one line ``error: ...`` and exit status 2 (``--verbose``: raise)."""
    args = parse_args(argv)
    try:
        record = simulate(args)
    except (ValueError, KeyError, AttributeError, FileNotFoundError) as error:
        if args.verbose:
            raise
        print(f"error: {_message(error)}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    print(format_table(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return record


if __name__ == "__main__":
    main()
