"""Compile-only memory simulator: per-device memory and collectives of the project's own
jitted steps at pod scale, on N simulated CPU devices, without allocating a parameter.

    python -m benchmarks.scale_sim --step update --preset qwen3_30b_a3b --devices 64 \\
        --mesh fsdp=8,expert=8 --seq-len 32768 --prompt-len 1024 --rows-per-device 1 \\
        --method gspo --json out.json
    python -m benchmarks.scale_sim --step rollout --preset qwen3_30b_a3b --devices 64 \\
        --mesh fsdp=8,expert=8 --prompts 512 --samples 16 --prompt-len 1024 \\
        --new-tokens 20480

What it compiles. The process starts with ``--xla_force_host_platform_device_count=N``
(set here, before JAX starts) and builds the run's mesh (``policyopt.sharding.make_mesh``,
the axes of ``--mesh``), the model from its preset under that mesh with abstract shapes
only (``nnx.eval_shape``), the Learner of the recipe ``configs/<method>.py`` (its
``LossConfig`` and optimiser, as ``policyopt.rl.trainer.build_run`` builds it) and the
train state as ``jax.ShapeDtypeStruct`` leaves carrying the shardings ``state_specs``
gives (what ``place_state`` places). Then, under ``jax.set_mesh``, as the trainer runs:

- ``--step update``: ``Learner.update`` (``guarded_update``: value_and_grad, AdamW, state
  donated) on one minibatch of ``rows_per_device x devices`` rows of ``seq_len`` tokens
  (``prompt_len`` of them prompt), every field the recipe's update reads (reference
  log-probs with a KL, importance weights with ``algo.tis_cap``, replayed routing with
  R2 / R3 on MoE, values and returns for critic methods), rows placed as
  ``shard_batch`` places them;
- ``--step rollout``: every jitted generation call the synchronous trainer makes for one
  round of ``--prompts`` prompts x ``--samples`` samples, its ``SamplingConfig`` the
  recipe's, parameters as the train state holds them. Through the engine
  (``policyopt.engine``, one shard per device along the row axes): its admission (a
  prefill of one prompt per shard, ``[S, P]``), its decode (``steps_per_call`` steps of
  every row) and its eviction, with the per-device budget ``--engine-kv-tokens`` (default
  the recipe's ``sampling.engine_kv_tokens``, else 2^17) and ``--engine-rows`` rows per
  device (default: the round's rows over the devices). The engine's whole state (page
  pool, page tables, tokens, routing) is an argument of each call. ``--engine-kv-tokens
  0``: one ``policyopt.sampling.generate_fn`` call over all the rows (prompts placed by
  ``shard_rows``), as the trainer does without the engine.

Each is lowered and compiled (``.lower(...).compile()``), never run, and read with
``compiled.memory_analysis()`` and the optimized HLO text (``compiled.as_text()``).

How to read it. ``per_device_peak_gib`` = argument + output - alias + temp bytes of the
compiled SPMD program, which is one device's program: what that device would hold at
once during the call, parameters and optimiser state included for the update (they are
its arguments; donation aliases them to the outputs). ``state_gib_per_device``:
parameters plus optimiser moments per device, from the shapes and shardings (exact, at
full depth). For the rollout the optimiser state is not an argument of the call but stays
resident beside it on an accelerator: ``peak_with_resident_state_gib`` adds it. By default
the preset's depth L is extrapolated from compiles at 1 and 2 layers,
``peak(L) = peak(1) + (L - 1) (peak(2) - peak(1))`` (``extrapolated: true``): unrolled
layers add their buffers linearly, and the compile time grows with the depth (qwen3_8b's
update at 8k tokens on 8 devices: ~40 s for 1, 2 or 4 layers, 67 s for 12, 270 s for all
36 on a loaded 2-core machine; the 36-layer peak compiled whole, 710.75 GiB, is 0.03% from
the extrapolated 710.55; benchmarks/HISTORY.md "2026-12-02: scale_sim baseline").
``--full-depth`` compiles the whole model (with scanned layers it costs about one layer's
time); ``tests/test_scale_sim.py`` checks the extrapolation against it on a small model.
``collectives``: the collective ops of the optimized program, counted by kind with their
result sizes (static: an op inside a loop body counts once, however often the loop runs),
from the largest compile made.

What XLA:CPU's figures predict for GPUs and TPUs, and what they do not:
- They are the program's buffers as XLA:CPU's buffer assignment lays them out: which
  arrays exist at once given the HLO's order. Arrays that scale with T x T, with the
  global batch, or with the number of devices show up as they would on an accelerator;
  this is what the simulator is for (attention scores, MoE gathers of every token,
  all-reduced full-size gradients).
- XLA:CPU computes a bfloat16 matmul in float32: it converts both operands to float32
  copies, multiplies, and converts the result back (its optimized HLO, jax 0.10). So a
  ``dtype=bfloat16`` program holds float32 temporaries that a GPU or TPU, whose matrix
  units take bf16 in and accumulate internally, would not; XLA:CPU also fuses less
  (no fusion of softmax or matmul epilogues as on GPUs, no TPU layout passes). The CPU's
  activation figures are therefore an upper bound, by up to ~2x where matmul outputs
  dominate. Parameters and optimiser state are exact. The same holds for every bfloat16
  gather, scatter, select, dynamic-(update-)slice and collective: XLA:CPU's
  ``float-normalization-bf16`` pass rewrites each into float32 (qwen3_30b_a3b at 32k
  tokens: the scan's saved residual stream, bf16[48, 1, 32768, 2048], gets a 12 GiB
  float32 copy before the backward loop; benchmarks/HISTORY.md "2026-12-02: expert
  parallelism at 32k tokens").
- XLA:CPU has no pass that turns an all-reduce followed by a slice into a reduce-scatter
  (XLA's GPU pipeline has one): a gradient whose FSDP reduction is left to the SPMD
  partitioner shows here as a full-size all-reduce; an explicit reduce-scatter (every
  weight gathered in a ``shard_map``: the MoE block's, ``policyopt.models.expert_parallel``,
  and on an fsdp mesh the dense layers', ``policyopt.sharding.fsdp_call``) shows as one.
- Rematerialisation: ``jax.checkpoint`` policies and scanned layers act as on TPUs (the
  checkpoint boundaries are in the HLO XLA:CPU compiles; a scan keeps its carries and saved
  residuals per layer). The GPU and TPU compilers also run XLA's own rematerialisation
  against the device's memory limit, and schedule differently; the CPU has no limit to
  fit, so an accelerator can come out lower than these figures (by how much, the CPU
  cannot say).
- The CPU has no HBM and no memory limit: a program that needs 300 GiB per device
  compiles here and would fail there. Nothing here is a measurement of time or
  bandwidth; ``compile_s`` is only the cost of the simulation.
- Collectives are synchronous on the CPU (no async start / done pairs, no overlap with
  compute: their buffers' lifetimes differ on accelerators), and XLA:CPU lacks some
  (``ragged-all-to-all`` is not supported, jax 0.10.2). Which collectives appear, and
  their sizes, come from XLA's SPMD partitioner, which GPUs and TPUs share, so they carry
  over; each backend's combiner passes merge small ones differently, so counts can differ.
- Custom kernels (Pallas, cuDNN) do not compile for the CPU; their memory is the
  kernel's, not shown here (an implementation that only exists on an accelerator must be
  simulated through its XLA fallback).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import os
import re
import sys
import time

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
    """The flags (module docstring); ``--model.FIELD=value`` and ``--config.FIELD=value``
    are collected into ``model_overrides`` / ``config_overrides``."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scale_sim",
        description="Compile-only per-device memory and collectives of the jitted update or "
        "rollout on simulated CPU devices (the module docstring says how to read "
        "them).",
        epilog="--model.FIELD=value overrides a ModelConfig field (any field: e.g. "
        "--model.dtype=bfloat16 --model.moe_dispatch=blocked); --config.FIELD=value a "
        "field of the recipe's config (e.g. --config.algo.kl_beta=0.01).",
    )
    p.add_argument("--step", choices=("update", "rollout"), required=True)
    p.add_argument("--preset", required=True, help="policyopt.models.presets name")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument(
        "--mesh",
        default="fsdp=-1",
        help="axis=size,... over data, fsdp, tensor, expert (one may be -1)",
    )
    p.add_argument("--method", default="gspo", help="recipe: configs/<method>.py")
    p.add_argument("--variant", default="", help="the recipe's variant string (configs/base.py)")
    p.add_argument("--seq-len", type=int, help="update: tokens per row, prompt included")
    p.add_argument("--prompt-len", type=int, help="prompt tokens per row (bucket)")
    p.add_argument(
        "--rows-per-device",
        type=int,
        default=1,
        help="update: rows of the minibatch = this x devices",
    )
    p.add_argument("--prompts", type=int, help="rollout: prompts per round")
    p.add_argument("--samples", type=int, help="rollout: samples per prompt (G)")
    p.add_argument("--new-tokens", type=int, help="rollout: max_new_tokens")
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
        help="compile the preset's depth instead of extrapolating from 1 and 2 layers",
    )
    p.add_argument("--json", help="write the result here")
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
    need = (
        ("seq_len", "prompt_len")
        if args.step == "update"
        else ("prompts", "samples", "prompt_len", "new_tokens")
    )
    for field in need:
        if getattr(args, field) is None:
            p.error(f"--step {args.step} needs --{field.replace('_', '-')}")
    if args.step == "update" and not 0 < args.prompt_len < args.seq_len:
        p.error(f"--prompt-len {args.prompt_len} must be in (0, --seq-len {args.seq_len})")
    return args


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


def recipe_config(args):
    """The recipe's config (``configs/<method>.py``) with the variant, ``--config.*`` and
    ``--micro-batch-tokens``."""
    recipe = importlib.import_module(f"configs.{args.method}")
    variant = [args.variant] if args.variant else []
    variant += args.config_overrides
    if args.micro_batch_tokens is not None:
        if "micro_batch_tokens" not in recipe.get_config().batch:
            raise SystemExit(
                "--micro-batch-tokens: this version of the library has no "
                "config.batch.micro_batch_tokens (no micro-batches in the learner)"
            )
        variant.append(f"batch.micro_batch_tokens={args.micro_batch_tokens}")
    return recipe.get_config(",".join(variant) or None)


def model_config(args, config, num_layers: int):
    """The preset with the recipe's ``config.model`` overrides (every field of ``config.model``
    that names a ``ModelConfig`` field and is set), then ``--model.*``, at ``num_layers``."""
    from policyopt.models import ModelConfig, preset

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    overrides = {k: v for k, v in config.model.items() if k in fields and v is not None}
    overrides.update(args.model_overrides)
    overrides["num_layers"] = num_layers
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise SystemExit(
            f"--model.{unknown[0]}: ModelConfig has no field {unknown[0]!r} "
            f"(fields: {', '.join(sorted(fields))})"
        )
    return preset(args.preset, **overrides)


def _abstract(tree, specs, mesh):
    """``tree``'s leaves as ``jax.ShapeDtypeStruct`` with ``NamedSharding(mesh, spec)``;
    ``specs`` holds one ``PartitionSpec`` per leaf (or per ``nnx.Variable``)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert len(leaves) == len(spec_leaves), (len(leaves), len(spec_leaves))
    return jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s))
            for x, s in zip(leaves, spec_leaves)
        ],
    )


def per_device_bytes(tree) -> int:
    """Bytes one device holds of the sharded ``jax.ShapeDtypeStruct`` leaves of ``tree``
    (the most loaded device: shards are equal-sized)."""
    import jax
    import numpy as np

    return int(
        sum(
            np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(tree)
        )
    )


@dataclasses.dataclass
class Setup:
    """What one compile needs: the abstract train state and the learner."""

    learner: object
    graphdef: object
    state: object  # TrainState of ShapeDtypeStruct, sharded
    model_config: object


def build(args, config, mesh, num_layers: int) -> Setup:
    """The model (abstract), learner and sharded abstract train state at ``num_layers``."""
    import jax
    from flax import nnx

    from policyopt.models import Transformer
    from policyopt.rl.learner import (
        LossConfig,
        OptimConfig,
        TrainState,
        get_learner,
        split_params,
        state_specs,
    )

    cfg = model_config(args, config, num_layers)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = split_params(model)
    learner = get_learner(
        graphdef, LossConfig.from_config(config), OptimConfig.from_config(config.optim)
    )
    state = jax.eval_shape(lambda p: TrainState.create(p, learner.optimizer), params)
    state = _abstract(state, state_specs(state, learner.optimizer, mesh), mesh)
    return Setup(learner, graphdef, state, cfg)


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

    algo, cfg = config.algo, setup.model_config
    gae = algo.advantage == "gae"
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
    from policyopt.sampling import SamplingConfig, generate_fn, sampling_method

    s = config.sampling
    vocab = setup.model_config.vocab_size
    sampling_config = SamplingConfig(
        max_new_tokens=args.new_tokens,
        method=sampling_method(s.temperature, s.top_k, s.top_p),
        eos_id=min(2, vocab - 1),
        pad_id=0,
        num_samples=args.samples,
        decode_segments=s.decode_segments,
    )

    def rows(shape, dtype):
        spec = sharding.row_spec(shape, mesh)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=sharding.replicated(mesh))
    engine = engine_config(args, config, mesh)
    if engine is None:
        shape = (args.prompts, args.prompt_len)
        prompts, lengths = rows(shape, jnp.int32), rows(shape[:1], jnp.int32)
        lower = lambda: generate_fn.lower(
            setup.graphdef, setup.state.params, prompts, lengths, rng, config=sampling_config
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
    state = _abstract(state, state_specs(state, mesh), mesh)
    per_shard = [rows((shards,), jnp.int32) for _ in range(5)]
    prompts = rows((shards, args.prompt_len), jnp.int32)
    params = setup.state.params
    return [
        (
            "engine_admit",
            lambda: admit_rows.lower(
                setup.graphdef, params, state, prompts, *per_shard, config=sampling_config
            ),
        ),
        (
            "engine_decode",
            lambda: decode_steps.lower(
                setup.graphdef,
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


def compile_once(args, config, mesh, num_layers: int) -> dict:
    """Lowers and compiles the step(s) at ``num_layers`` (``compile_s`` times both) and reads
    their memory and collectives."""
    import jax

    setup = build(args, config, mesh, num_layers)
    if args.step == "update":
        batch = update_batch(args, config, setup, mesh)
        calls = [("update", lambda: setup.learner.update.lower(setup.state, batch))]
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


def simulate(args) -> dict:
    """Runs the simulation (JAX must start after ``set_device_count``) and returns its record."""
    set_device_count(args.devices)
    import jax

    from policyopt import sharding

    config = recipe_config(args)
    mesh = sharding.make_mesh(parse_mesh(args.mesh))
    full = model_config(args, config, preset_depth(args, config)).num_layers
    extrapolate = not args.full_depth and full > 2
    if extrapolate and model_config(args, config, full).moe_layers is not None:
        raise SystemExit(
            f"preset {args.preset!r} lists moe_layers: depth cannot be extrapolated "
            "from 1 and 2 layers; use --full-depth"
        )
    depths = (1, 2) if extrapolate else (full,)
    compiles = [compile_once(args, config, mesh, d) for d in depths]
    # Exact state at full depth from the shapes alone (nothing compiled or allocated).
    top = compiles[-1]["setup"] if not extrapolate else build(args, config, mesh, full)
    state_bytes = per_device_bytes((top.state.params, top.state.opt_state))
    params_bytes = per_device_bytes(top.state.params)
    calls = []
    for index, last in enumerate(compiles[-1]["calls"]):
        record = {k: v for k, v in last.items() if k not in ("peak_bytes", "num_layers")}
        by_depth = [c["calls"][index] for c in compiles]
        if extrapolate:
            p1, p2 = by_depth[0]["peak_bytes"], by_depth[1]["peak_bytes"]
            peak, per_layer = p1 + (full - 1) * (p2 - p1), p2 - p1
        else:
            peak, per_layer = last["peak_bytes"], None
        record.update(
            per_device_peak_gib=peak / GIB,
            per_layer_gib=None if per_layer is None else per_layer / GIB,
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
    mesh_shape = {name: int(size) for name, size in mesh.shape.items()}
    record = dict(
        step=args.step,
        preset=args.preset,
        method=args.method,
        devices=args.devices,
        mesh=mesh_shape,
        num_layers=full,
        extrapolated=extrapolate,
        per_device_peak_gib=worst["per_device_peak_gib"],
        state_gib_per_device=state_bytes / GIB,
        params_gib_per_device=params_bytes / GIB,
        compile_s=round(sum(c["compile_s"] for c in calls), 2),
        collectives=worst["collectives"],
        calls=calls,
        model={k: v for k, v in dataclasses.asdict(top.model_config).items()},
        inputs=dict(
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
            variant=args.variant,
            model_overrides=args.model_overrides,
            config_overrides=args.config_overrides,
        ),
        jax_version=jax.__version__,
    )
    if args.step == "update":
        record["rows"] = args.rows_per_device * args.devices
        record["rows_on_each_device"] = rows_on_each_device(record["rows"], mesh)
    else:
        record["prompt_rows_on_each_device"] = rows_on_each_device(args.prompts, mesh)
        engine = engine_config(args, config, mesh)
        record["engine"] = (
            None if engine is None else dict(dataclasses.asdict(engine), shards=row_shards_of(mesh))
        )
        record["rows"] = args.prompts * args.samples
        opt_bytes = state_bytes - params_bytes
        for call in calls:
            call["peak_with_resident_state_gib"] = call["per_device_peak_gib"] + opt_bytes / GIB
        record["peak_with_resident_state_gib"] = worst["peak_with_resident_state_gib"]
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


def preset_depth(args, config) -> int:
    """The model's depth: the preset's, or ``--model.num_layers`` / the recipe's override."""
    from policyopt.models.presets import PRESETS

    depth = args.model_overrides.get("num_layers", config.model.get("num_layers"))
    return int(depth if depth is not None else PRESETS[args.preset]["num_layers"])


def _gib(value: float, width: int) -> str:
    return f"{value:>{width}.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:>{width}.2g}"


def format_table(record: dict) -> str:
    """The record as a short readable table."""
    mesh = ",".join(f"{k}={v}" for k, v in record["mesh"].items() if v > 1) or "1 device"
    lines = [
        f"scale_sim --step {record['step']}: {record['preset']} "
        f"({record['num_layers']} layers), {record['method']}, {record['devices']} devices, "
        f"mesh {mesh}"
    ]
    inputs = record["inputs"]
    if record["step"] == "update":
        lines.append(
            f"  minibatch {record['rows']} rows x {inputs['seq_len']} tokens "
            f"({inputs['prompt_len']} prompt); rows on each device: "
            f"{record['rows_on_each_device']}"
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
    lines.append(
        f"  state (params + optimiser) per device: "
        f"{_gib(record['state_gib_per_device'], 0)} GiB "
        f"(params {_gib(record['params_gib_per_device'], 0)})"
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
                    _gib(c[k + "_bytes"] / GIB, w)
                    for k, w in (("argument", 10), ("output", 9), ("alias", 9), ("temp", 10))
                )
                + _gib(c["peak_bytes"] / GIB, 10)
            )
        how = "extrapolated" if record["extrapolated"] else "compiled"
        per_layer = (
            f", {_gib(call['per_layer_gib'], 0)} GiB per layer"
            if call["per_layer_gib"] is not None
            else ""
        )
        lines.append(
            f"  {call['call']:<12}{record['num_layers']:>7}  per-device peak "
            f"{_gib(call['per_device_peak_gib'], 0)} GiB ({how}{per_layer})"
        )
        if "peak_with_resident_state_gib" in call:
            lines.append(
                f"  {'':<12}{'':>7}  with the resident optimiser state "
                f"{call['peak_with_resident_state_gib']:.2f} GiB"
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
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    record = simulate(args)
    print(format_table(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
    return record


if __name__ == "__main__":
    main()
