"""What a device holds beside the step ``scale_sim`` compiles, and whether it all fits.

``resident(...)`` lists the arrays a run keeps on each device while the step runs without
passing them to it (the reference policy, the critic, the iteration's batch, the
asynchronous generator's parameters and KV cache; for the rollout, the optimiser's
moments), each as a ``Resident`` with its bytes per device, from abstract shapes and the
shardings the trainer places them with. ``levers(...)`` names the settings that lower a
device's memory for a run that does not fit, ``format_verdict(...)`` prints the end of the
table, ``paper_scale_notes(...)`` warns of a paper-sized model compiled with the CPU
settings. docs/scale.md, "Will it fit: scale_sim".
"""

from __future__ import annotations

import dataclasses

GIB = 1024**3
# Parameters from which a preset is paper-sized: compiled without scale=paper (float32,
# unrolled layers, no remat) it is not what a run at scale would compile, and a note says so.
PAPER_SIZE_PARAMS = 10**9


@dataclasses.dataclass(frozen=True)
class Resident:
    """One thing on each device beside the compiled call: ``name`` (what it is),
    ``bytes`` (per device, the most loaded one), ``why`` (which setting keeps it)."""

    name: str
    bytes: int
    why: str

    def as_dict(self) -> dict:
        return dict(name=self.name, gib=self.bytes / GIB, why=self.why)


def abstract(tree, specs, mesh):
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


def resident(step: str, config, setup, mesh, *, batch=None, prompt_len: int) -> list[Resident]:
    """What stays on each device beside the compiled ``step`` ("update" or "rollout") of
    the run ``config`` describes.

    Args:
      setup: ``scale_sim.Setup`` (graphdef, abstract sharded train state, model config;
        LoRA: the frozen base).
      batch: the update's abstract minibatch (``step == "update"``).
      prompt_len: the prompts' width (the asynchronous generator's slots).
    """
    from policyopt.advantages import uses_critic

    state, algo = setup.state, config.algo
    params = per_device_bytes(state.params)
    lora = setup.frozen is not None
    merged = lora and config.model.lora.sampler == "merged"
    items = []
    if step == "rollout":
        items.append(
            Resident(
                "the policy's optimiser state",
                per_device_bytes(state.opt_state),
                "kept between updates; the rollout reads the parameters only",
            )
        )
        if merged:
            items.append(
                Resident(
                    "the frozen base and the adapters",
                    per_device_bytes((setup.frozen, state.params)),
                    "model.lora.sampler='merged': the rollout decodes a merged copy",
                )
            )
    if algo.kl_beta > 0 and not lora:  # LoRA: the base with the adapters off, no copy
        items.append(
            Resident(
                "the reference policy's parameters",
                params,
                f"algo.kl_beta={algo.kl_beta:g}: a frozen copy of the initial parameters",
            )
        )
    if uses_critic(algo.advantage):
        items.append(
            Resident(
                "the critic's parameters and optimiser state",
                per_device_bytes(critic_state(config, setup, mesh)),
                "algo.advantage='gae': the value model, a copy of the policy with a head",
            )
        )
    if step == "update":
        n_minibatches = int(config.batch.n_minibatches)
        if n_minibatches > 1:
            items.append(
                Resident(
                    "the iteration's batch",
                    n_minibatches * per_device_bytes(batch),
                    f"batch.n_minibatches={n_minibatches} minibatches of these rows, "
                    "each taken from it in turn",
                )
            )
        if config.async_mode.enabled:
            items.append(
                Resident(
                    "the asynchronous generator's parameters",
                    params + (per_device_bytes(setup.frozen) if merged else 0),
                    "async_mode.enabled: the published copy it decodes with"
                    + (" (LoRA: the adapters, and the merged copy)" if merged else ""),
                )
            )
            kv_name, kv_bytes, kv_why = generator_cache(config, setup, mesh, prompt_len)
            items.append(Resident(kv_name, kv_bytes, kv_why))
    return items


def critic_state(config, setup, mesh):
    """The critic's abstract ``TrainState`` (backbone, value head, optimiser moments),
    sharded as ``trainer.build_run`` places it."""
    import jax

    from policyopt.config import typed
    from policyopt.rl.update.critic import CriticSettings, critic_optim, get_critic
    from policyopt.rl.update.learner import state_specs

    config = typed(config)
    if config.critic.init_checkpoint:
        raise ValueError(
            "config.critic.init_checkpoint: the fit counts the critic as a copy of the "
            "policy; a critic of its own (another model) is not estimated here"
        )
    graphdef, params = setup.graphdef, setup.state.params
    if setup.frozen is not None and config.model.lora.critic == "full":
        # A full-weight critic beside a LoRA policy: a copy of the base in the adapters' dtype.
        dtype = setup.model_config.lora.dtype
        graphdef = setup.base_graphdef
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), setup.frozen)
    critic = get_critic(graphdef, CriticSettings.of(config), critic_optim(config))
    hidden = setup.model_config.hidden_size
    state = jax.eval_shape(lambda p: critic.init_state(p, hidden), params)
    return abstract(state, state_specs(state, critic.optimizer, mesh), mesh)


def sampling_config(config, vocab_size: int, new_tokens: int, samples: int):
    """The run's ``SamplingConfig`` (as ``trainer.build_run`` makes it; end and pad ids of
    a tokenizer of ``vocab_size`` ids)."""
    from policyopt.sampling import SamplingConfig, sampling_method

    s = config.sampling
    return SamplingConfig(
        max_new_tokens=new_tokens,
        method=sampling_method(s.temperature, s.top_k, s.top_p),
        eos_id=min(2, vocab_size - 1),
        pad_id=0,
        num_samples=samples,
        decode_segments=s.decode_segments,
    )


def generator_cache(config, setup, mesh, prompt_len: int) -> tuple[str, int, str]:
    """``(name, bytes per device, why)`` of the asynchronous generator's decode state, as
    ``async_rl.make_generator`` builds it: the engine's page pools
    (``sampling.engine_kv_tokens`` > 0) or the dense slots' KV cache."""
    import jax
    from flax import nnx

    from policyopt import engine
    from policyopt.rl.loop.async_rl import resolved_n_async
    from policyopt.rl.rollouts import async_generation

    async_config, s, group = config.async_mode, config.sampling, config.batch.group_size
    n_async = resolved_n_async(config)
    rows = min(async_config.num_slots or n_async, n_async)
    new_tokens = int(s.max_new_tokens)
    slots = async_generation.SlotConfig(
        sampling=sampling_config(config, setup.model_config.vocab_size, new_tokens, group),
        num_groups=rows // group,
        prompt_width=prompt_len,
        segment_steps=min(async_config.segment_steps, new_tokens),
    )
    if s.engine_kv_tokens > 0:
        shards = engine.row_shards(mesh)
        engine_config = engine.EngineConfig(
            kv_tokens=s.engine_kv_tokens,
            rows=slots.rows // shards,
            page_size=s.engine_page_size,
            steps_per_call=slots.segment_steps,
            capture_routing=True,  # as EngineSlots' default
        )
        state = jax.eval_shape(
            lambda: engine.empty_state(
                setup.model_config, engine_config, slots.sampling, prompt_len, shards
            )
        )
        state = abstract(state, engine.state_specs(state, mesh), mesh)
        why = (
            f"async_mode.enabled, sampling.engine_kv_tokens={s.engine_kv_tokens}: decoding "
            "goes on during the update"
        )
        return "the asynchronous generator's page pools", per_device_bytes(state), why
    # The dense slots (SlotGenerator): its own state builder and placement.
    graphdef, params = setup.sampler(config.model.lora.sampler)
    state = jax.eval_shape(
        lambda p: async_generation.init_slot_state(nnx.merge(graphdef, p), slots), params
    )
    state = abstract(state, async_generation.slot_specs(state, mesh), mesh)
    why = (
        f"async_mode.enabled: {slots.rows} rows x {slots.cache_length} slots of KV cache "
        "(sampling.engine_kv_tokens=0); decoding goes on during the update"
    )
    return "the asynchronous generator's KV cache", per_device_bytes(state), why


def levers(record: dict, model_config) -> list[tuple[str, str]]:
    """``(setting, what it lowers)`` for a run that does not fit, from the most direct:
    micro-batches (when a device holds several rows), remat and scanned layers, bfloat16
    matmuls, attention without ``[B, H, T, T]`` scores, larger MoE blocks, the MoE
    matmuls in chunks, and more FSDP shards for the parameters and optimiser state."""
    out = []
    mc, inputs, mesh = model_config, record["inputs"], record["mesh"]
    row_devices = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    rows_each = record.get("rows_on_each_device", 1)
    tokens = row_devices * (inputs["seq_len"] or 0)
    current = record.get("micro_batch_tokens") or 0  # None or 0: no micro-batches
    if record["step"] == "update" and rows_each > 1 and not 0 < current <= tokens:
        out.append(
            (
                f"batch.micro_batch_tokens={tokens}",
                f"one row per device at a time: activations of 1 row, not {rows_each}",
            )
        )
    if mc.remat != "full":
        out.append(("model.remat=full", "each layer keeps only its input for the backward"))
    if not mc.scan_layers:
        out.append(
            (
                "model.scan_layers=True",
                "one compiled layer; rematerialised memory is freed layer by layer",
            )
        )
    if mc.dtype == "float32":
        out.append(("model.dtype=bfloat16", "half the activations of float32 matmuls"))
    if mc.attention == "xla":
        out.append(("model.attention=blockwise", "no [B, H, T, T] attention scores"))
    if mc.is_moe and mc.moe_dispatch == "ragged":
        out.append(
            (
                "model.moe_dispatch=blocked",
                "XLA:CPU and XLA:GPU run ragged_dot as a product over every expert",
            )
        )
    if mc.is_moe and mc.moe_dispatch == "blocked" and mc.moe_block_size < 4096:
        out.append(
            (
                "model.moe_block_size=4096",
                f"fewer blocks, so fewer per-block copies of the expert weights "
                f"(now {mc.moe_block_size})",
            )
        )
    copies = rows_each * (inputs["seq_len"] or 0) * (mc.num_experts_per_tok or 0)
    chunk = mc.moe_chunk_rows if mc.is_moe else None
    if (
        mc.is_moe
        and mc.moe_dispatch == "blocked"
        and copies > 65536
        and not 0 < (chunk or 0) <= 65536
    ):
        out.append(
            (
                "model.moe_chunk_rows=65536",
                f"the expert matmuls a chunk of blocks at a time, not all {copies:,} token "
                "copies' padded rows at once",
            )
        )
    # More FSDP shards split the parameters, their copies and the optimiser state: named
    # where that saving is a fair share of the excess, or where nothing else applies.
    state = record["state_gib_per_device"] + sum(
        r["gib"] for r in record["resident"] if "parameters" in r["name"]
    )
    excess = record["total_gib"] - (record["device_memory_gib"] or 0)
    if out and state / 2 < excess / 4:
        return out
    if mesh["data"] > 1:
        out.append(
            (
                f"mesh.fsdp={mesh['fsdp'] * mesh['data']},mesh.data=1",
                f"parameters and optimiser state ({state:.1f} GiB per device) split over "
                "the data axis too, not replicated",
            )
        )
    else:
        out.append(
            (
                f"mesh.fsdp={2 * mesh['fsdp']}",
                f"on twice the devices: parameters and optimiser state ({state:.1f} GiB "
                "per device) halve",
            )
        )
    return out


def paper_scale_notes(args, model, parameters: int) -> list[str]:
    """A note when a paper-size preset compiles with the recipe's CPU model settings (no
    ``scale=paper``): what a run at scale would not compile."""
    if "scale=paper" in args.variant_items or parameters < PAPER_SIZE_PARAMS:
        return []
    cpu = [
        text
        for text, applies in (
            ("float32 matmuls", model.dtype == "float32"),
            ("unscanned layers", not model.scan_layers),
            ("no remat", model.remat == "none"),
        )
        if applies
    ]
    if not cpu:
        return []
    return [
        f"note: {args.preset} ({parameters / 1e9:.1f}B parameters) compiles with the "
        f"recipe's CPU model settings ({', '.join(cpu)}); add scale=paper to the recipe "
        "string for the paper-scale ones (configs/base.py, PAPER_SCALE_MODEL)"
    ]


def gib_text(value: float, width: int) -> str:
    """GiB with 2 decimals, or 2 significant digits below 0.1."""
    return f"{value:>{width}.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:>{width}.2g}"


def format_verdict(record: dict) -> list[str]:
    """The table's last lines: what stays resident, the total, and the verdict with the
    settings to try when ``--device-memory-gib`` is given."""
    step, lines = record["step"], []
    if record["resident"]:
        lines.append(f"  resident beside the {step} on each device (not arguments of the call):")
        for r in record["resident"]:
            lines.append(f"    {r['name']:<45}{gib_text(r['gib'], 8)} GiB  {r['why']}")
    else:
        lines.append(f"  resident beside the {step}: nothing the call does not hold")
    worst = max(record["calls"], key=lambda c: c["total_gib"])
    lines.append(
        f"  per device: {gib_text(worst['per_device_peak_gib'], 0)} GiB ({worst['call']}) + "
        f"{gib_text(record['resident_gib'], 0)} resident = {gib_text(worst['total_gib'], 0)} GiB"
    )
    if record["fits"] is None:
        return lines
    budget = f"{gib_text(record['total_gib'], 0)} GiB of {record['device_memory_gib']:g}"
    if record["fits"]:
        return lines + [f"fits: yes ({budget})"]
    lines.append("  settings that lower it (in the recipe string or as --config.FIELD=value):")
    for lever in record["levers"]:
        lines.append(f"    {lever['setting']:<40}{lever['effect']}")
    names = ", ".join(lever["setting"] for lever in record["levers"])
    return lines + [f"fits: no ({budget}): try {names}"]
