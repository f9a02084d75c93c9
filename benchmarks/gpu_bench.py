"""Accelerator benchmark: the RL update step and the sampler of a ~0.5B-parameter MoE.

Run by ``benchmarks/gpu.sh`` on a machine with one accelerator (no network; JAX, flax,
optax, orbax and chex only), or on the CPU with ``--smoke`` to check that it runs.

Measured, in bfloat16 compute with float32 master parameters:

* update: one ``policyopt.rl.update.learner.Learner.update`` (forward, backward, SAPO loss,
  AdamW) on ``rows x (prompt + response)`` tokens. Reported: tokens/s and model FLOPs
  utilisation, counting ``6 * N_active`` FLOPs per token (N_active: the parameters a token
  touches, i.e. attention, the k routed experts, router, norms and the output projection;
  not the embedding lookup) plus causal attention ``6 * L * H * Dh * S`` per token
  (QK^T and AV, forward and backward, half of the S x S square).
* sampler: ``policyopt.sampling.generate`` with a KV cache, tokens/s of decode, and the
  achieved memory bandwidth of decode: per step, the bytes of every expert weight some
  token of the batch used (at batch >= 64 with 32 experts, all of them) in bfloat16 plus
  the KV cache read up to the current position, divided by the step time.

Peak numbers are those of the device named on the command line (default H200 SXM:
989 TFLOP/s dense bf16, 4.8 TB/s HBM3e). Writes a JSON file and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import base
from policyopt import sampling
from policyopt.models import Transformer, preset
from policyopt.rl.batch import Batch
from policyopt.rl.update.learner import Learner, LossSettings, make_optimizer, split_params

PEAKS = {
    "h200": (989e12, 4.8e12),
    "h100": (989e12, 3.35e12),
    "a100": (312e12, 2.0e12),
    "cpu": (1e12, 1e11),
}


def count_params(config) -> dict[str, float]:
    """Total and per-token active parameter counts of a ModelConfig (no embedding lookup)."""
    d, h, kv, dh = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    attn = d * h * dh + 2 * d * kv * dh + h * dh * d + 2 * dh  # q, k, v, o, q/k norms
    dense_mlp = 3 * d * config.intermediate_size
    expert = 3 * d * config.expert_intermediate_size
    total = active = 0.0
    for layer in range(config.num_layers):
        total += attn + 2 * d
        active += attn + 2 * d
        if layer in config.moe_layer_indices:
            total += config.num_experts * expert + d * config.num_experts
            active += config.num_experts_per_tok * expert + d * config.num_experts
        else:
            total += dense_mlp
            active += dense_mlp
    unembed = d * config.vocab_size
    total += unembed + d + (0 if config.tie_word_embeddings else d * config.vocab_size)
    active += unembed + d
    return {
        "total": total,
        "active": active,
        "experts_per_layer_bytes_bf16": config.num_experts * expert * 2,
    }


_HLO_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"")


def hlo_index(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Optimised HLO text -> {instruction name: (result shape, JAX op_name)}."""
    index = {}
    for line in hlo_text.splitlines():
        match = _HLO_LINE.match(line)
        if match:
            name, shape, op_name = match.groups()
            index[name] = (shape[:40], op_name.split("/", 1)[-1][-110:])
    return index


def profile_summary(fn, calls: int, trace_dir: str, hlo_text: str = "", top: int = 30) -> dict:
    """Run ``fn`` ``calls`` times under ``jax.profiler.trace`` and total the device time
    of each HLO op (from the XSpace, read with ``jax.profiler.ProfileData``), per call.

    Returns {"device_ms_per_call", "ops": [{op, ms_per_call, share, kernel, shape, op_name}],
    "planes"}; shape and op_name come from ``hlo_text`` (the compiled program's HLO).
    On a CPU there is no device plane: the host's XLA op events are used instead.
    """
    import collections
    import glob
    import os
    import shutil

    shutil.rmtree(trace_dir, ignore_errors=True)
    jax.block_until_ready(fn())
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            jax.block_until_ready(fn())
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    data = jax.profiler.ProfileData.from_file(files[-1])
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    if not planes:
        planes = [p for p in data.planes if p.name.startswith("/host:CPU")]
    totals, kernels = collections.Counter(), {}
    for plane in planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                op = stats.get("hlo_op")
                if op is None:
                    continue
                totals[op] += event.duration_ns
                kernels.setdefault(op, event.name)
    total_ns = sum(totals.values()) or 1
    index = hlo_index(hlo_text)
    ops = [
        {
            "op": op,
            "ms_per_call": ns / 1e6 / calls,
            "share": ns / total_ns,
            "kernel": kernels[op][:90],
            "shape": index.get(op, ("", ""))[0],
            "op_name": index.get(op, ("", ""))[1],
        }
        for op, ns in totals.most_common(top)
    ]
    return {
        "device_ms_per_call": total_ns / 1e6 / calls,
        "ops": ops,
        "planes": [p.name for p in planes],
    }


def print_profile(title: str, summary: dict) -> None:
    print(
        f"\n{title}: device time {summary['device_ms_per_call']:.2f} ms per call "
        f"({', '.join(summary['planes'])})"
    )
    for row in summary["ops"]:
        print(
            f"  {row['ms_per_call']:8.3f} ms {100 * row['share']:5.1f}%  {row['op'][:34]:34s} "
            f"{row['shape']:28s} {row['op_name']} [{row['kernel'][:40]}]"
        )


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def bench_update(
    config,
    rows: int,
    prompt_len: int,
    response_len: int,
    repeats: int,
    peak_flops: float,
    profile_dir: str | None = None,
):
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params = split_params(model)
    optimizer, schedule = make_optimizer(lr=1e-6, warmup_steps=0)
    defaults = base.check(base.base_config())
    settings = LossSettings(
        dataclasses.replace(
            defaults.algo, method="sapo", aggregation="token_mean", max_len=response_len
        ),
        dataclasses.replace(defaults.batch, group_size=16),
        defaults.sampling,
    )
    learner = Learner(graphdef, settings, optimizer, schedule)
    state = learner.init_state(params)
    seq = prompt_len + response_len
    rng = np.random.default_rng(0)
    batch = Batch(
        tokens=jnp.asarray(rng.integers(0, config.vocab_size, (rows, seq)), jnp.int32),
        positions=jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
        attention_mask=jnp.ones((rows, seq), jnp.int32),
        mask=jnp.ones((rows, response_len), jnp.float32),
        advantages=jnp.asarray(rng.standard_normal(rows), jnp.float32),
        old_log_probs=jnp.full((rows, response_len), -np.log(config.vocab_size), jnp.float32),
    )
    start = time.perf_counter()
    compiled = learner.update.lower(state, batch).compile()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start

    holder = {"state": state}

    def step():
        holder["state"], m = compiled(holder["state"], batch)
        return m

    times = timed(step, repeats)
    median = statistics.median(times)
    extra = {}
    if profile_dir:
        extra["profile"] = profile_summary(step, 2, profile_dir + "/update", compiled.as_text())
    counts = count_params(config)
    tokens = rows * seq
    attn_flops = 6 * config.num_layers * config.num_heads * config.head_dim * seq  # per token
    flops = tokens * (6 * counts["active"] + attn_flops)
    return {
        "rows": rows,
        "seq": seq,
        "tokens_per_step": tokens,
        "compile_s": compile_s,
        "step_s_median": median,
        "step_s_all": times,
        "tokens_per_s": tokens / median,
        "tflops_per_s": flops / median / 1e12,
        "mfu": flops / median / peak_flops,
        "params_total": counts["total"],
        "params_active": counts["active"],
        "model_tflop_per_step": flops / 1e12,
        **extra,
    }


def bench_sampler(
    config,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    peak_bw: float,
    profile_dir: str | None = None,
    decode_segments: int = 1,
):
    model = Transformer(config, rngs=nnx.Rngs(1))
    # Serve in bfloat16 (what a generator holds): cast the parameters once.
    graphdef, state = nnx.split(model)
    state = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, state
    )
    prompts = jnp.asarray(
        np.random.default_rng(0).integers(1, config.vocab_size, (batch, prompt_len)), jnp.int32
    )
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    samp = sampling.SamplingConfig(
        max_new_tokens=new_tokens, method=sampling.Temperature(1.0), decode_segments=decode_segments
    )
    run = jax.jit(lambda s, p, l, k: sampling.generate_fn(graphdef, s, p, l, k, config=samp))
    start = time.perf_counter()
    run = run.lower(state, prompts, lengths, jax.random.key(0)).compile()
    jax.block_until_ready(run(state, prompts, lengths, jax.random.key(0)))
    compile_s = time.perf_counter() - start
    keys = iter(jax.random.split(jax.random.key(1), repeats))
    times = timed(lambda: run(state, prompts, lengths, next(keys)), repeats)
    # Prefill alone, to separate it from decode.
    samp1 = sampling.SamplingConfig(max_new_tokens=1, method=sampling.Temperature(1.0))
    run1 = jax.jit(lambda s, p, l, k: sampling.generate_fn(graphdef, s, p, l, k, config=samp1))
    jax.block_until_ready(run1(state, prompts, lengths, jax.random.key(0)))
    prefill = statistics.median(
        timed(lambda: run1(state, prompts, lengths, jax.random.key(2)), repeats)
    )
    median = statistics.median(times)
    extra = {}
    if profile_dir:
        extra["profile"] = profile_summary(
            lambda: run(state, prompts, lengths, jax.random.key(3)),
            1,
            profile_dir + "/sampler",
            run.as_text(),
        )
    decode_s = max(median - prefill, 1e-9)
    counts = count_params(config)
    weight_bytes = 2 * (
        counts["total"]
        - config.hidden_size * config.vocab_size * (0 if config.tie_word_embeddings else 1)
    )  # bf16, no embedding gather
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2  # k+v bf16
    mean_context = prompt_len + new_tokens / 2
    bytes_per_step = weight_bytes + batch * mean_context * kv_per_token
    step_s = decode_s / new_tokens
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "compile_s": compile_s,
        "total_s_median": median,
        "prefill_s_median": prefill,
        "decode_step_s": step_s,
        "decode_tokens_per_s": batch * new_tokens / decode_s,
        "tokens_per_s_incl_prefill": batch * new_tokens / median,
        "hbm_bytes_per_step": bytes_per_step,
        "hbm_gb_per_s": bytes_per_step / step_s / 1e9,
        "hbm_utilisation": bytes_per_step / step_s / peak_bw,
        "moe_dispatch": config.moe_dispatch,
        "moe_decode_dispatch": config.moe_decode_dispatch or config.moe_dispatch,
        "decode_segments": decode_segments,
        **extra,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_bench.json")
    parser.add_argument("--device-name", default="h200", choices=sorted(PEAKS))
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes, to check it runs on the CPU"
    )
    parser.add_argument(
        "--dispatch",
        default=None,
        choices=("ragged", "blocked", "dense", "capacity"),
        help="override the preset's moe_dispatch",
    )
    parser.add_argument("--block-size", type=int, default=None, help="override moe_block_size")
    parser.add_argument(
        "--gather",
        default=None,
        choices=("auto", "take", "onehot"),
        help="override moe_weight_gather",
    )
    parser.add_argument(
        "--sampler-dispatch",
        default=None,
        choices=("ragged", "blocked", "dense", "capacity"),
        help="one moe_dispatch for the sampler's prefill and decode (default: the "
        "preset's moe_dispatch and moe_decode_dispatch)",
    )
    parser.add_argument(
        "--decode-segments",
        type=int,
        default=1,
        help="the sampler's decode loops over growing caches (SamplingConfig)",
    )
    parser.add_argument("--skip-sampler", action="store_true")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also trace two updates and one sampler call into DIR and print the "
        "device time per HLO op, with its JAX op name",
    )
    args = parser.parse_args()
    peak_flops, peak_bw = PEAKS[args.device_name]
    if args.smoke:
        config = preset("tiny_moe", vocab_size=256, dtype="bfloat16")
        upd = dict(rows=4, prompt_len=8, response_len=8, repeats=2)
        smp = dict(batch=4, prompt_len=8, new_tokens=8, repeats=2)
    else:
        config = preset("moe_0p5b", dtype="bfloat16")
        upd = dict(rows=32, prompt_len=256, response_len=768, repeats=5)
        smp = dict(batch=256, prompt_len=128, new_tokens=256, repeats=3)
    overrides = {
        k: v
        for k, v in (
            ("moe_dispatch", args.dispatch),
            ("moe_block_size", args.block_size),
            ("moe_weight_gather", args.gather),
        )
        if v is not None
    }
    config = config.replace(**overrides)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "python": platform.python_version(),
        "preset": "tiny_moe" if args.smoke else "moe_0p5b",
        "peaks": {"flops": peak_flops, "hbm": peak_bw},
        "moe": {
            "dispatch": config.moe_dispatch,
            "block_size": config.moe_block_size,
            "weight_gather": config.resolved_weight_gather(),
        },
    }
    print(
        f"MoE: train {report['moe']}, decode {config.moe_decode_dispatch or config.moe_dispatch}",
        flush=True,
    )
    report["update"] = bench_update(config, **upd, peak_flops=peak_flops, profile_dir=args.profile)
    print(
        json.dumps(
            {"update": {k: v for k, v in report["update"].items() if k != "step_s_all"}}, indent=1
        ),
        flush=True,
    )
    if not args.skip_sampler:
        sampler_config = config
        if args.sampler_dispatch:
            sampler_config = config.replace(
                moe_dispatch=args.sampler_dispatch, moe_decode_dispatch=None
            )
        report["sampler"] = bench_sampler(
            sampler_config,
            **smp,
            peak_bw=peak_bw,
            profile_dir=args.profile,
            decode_segments=args.decode_segments,
        )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    u, s = report["update"], report.get("sampler")
    print("\n| measure | value |\n|---|---|")
    print(
        f"| params total / active | {u['params_total'] / 1e6:.1f}M / "
        f"{u['params_active'] / 1e6:.1f}M |"
    )
    print(
        f"| update tokens/s | {u['tokens_per_s']:.0f} "
        f"({u['rows']}x{u['seq']}, median of {len(u['step_s_all'])}) |"
    )
    print(f"| update MFU | {100 * u['mfu']:.1f}% ({u['tflops_per_s']:.1f} TFLOP/s) |")
    print(f"| update TFLOP per step (model count) | {u['model_tflop_per_step']:.1f} |")
    print(f"| MoE dispatch | {report['moe']} |")
    print(f"| compile update | {u['compile_s']:.1f}s |")
    if s:
        print(
            f"| sampler decode tokens/s | {s['decode_tokens_per_s']:.0f} (batch {s['batch']}, "
            f"MoE prefill {s['moe_dispatch']}, decode {s['moe_decode_dispatch']}) |"
        )
        print(
            f"| decode HBM bandwidth | {s['hbm_gb_per_s']:.0f} GB/s "
            f"({100 * s['hbm_utilisation']:.1f}% of peak) |"
        )
        print(f"| compile sampler | {s['compile_s']:.1f}s |")
    for name in ("update", "sampler"):
        if name in report and "profile" in report[name]:
            print_profile(name, report[name]["profile"])


if __name__ == "__main__":
    main()
