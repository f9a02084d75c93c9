"""LoRA's sampler forms on the CPU: decoding with the adapters merged into the base once per
weight version, or applied unmerged at every step (``model.lora.sampler``).

A preset (default ``moe_7m``: 4 layers, D 256, 8 experts top-2) with rank-r adapters on
every target samples ``--new_tokens`` tokens for ``--prompts`` prompts of 32 tokens at
temperature 1 through ``policyopt.sampling.generate_fn``:

  * merged: the base graph on ``W + (alpha / r) A B`` (``lora.merged_params``, jitted; its
    time per weight version is reported apart, and added for the per-version total);
  * unmerged: the adapted graph, ``x W + (x A) B`` in every product of every step;
  * base: the model without adapters (the floor both are held against).

The timed calls alternate (``--runs`` rounds) so that a change in the machine's load
reaches all of them; medians are reported, with the ratio unmerged / merged.

    python -m benchmarks.bench_lora [--preset moe_7m] [--rank 8] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from policyopt.models import Transformer, lora, preset
from policyopt.models.lora import LoRAConfig
from policyopt.sampling import SamplingConfig, Temperature, generate_fn


def _timed(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_lora")
    p.add_argument("--preset", default="moe_7m")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="all")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", default="benchmarks/results/bench_lora.json")
    args = p.parse_args(argv)

    config = preset(args.preset)
    adapters = LoRAConfig(rank=args.rank, targets=args.targets)
    model = Transformer(config.replace(lora=adapters), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        if path[-1] == "lora_b":  # trained adapters: B away from 0
            shape = variable.get_value().shape
            variable.set_value(jnp.asarray(0.02 * rng.normal(size=shape), jnp.float32))
    graphdef, trainable, frozen = lora.split(model)
    base_graphdef = lora.base_graphdef(model)
    merge = jax.jit(lambda f, a: lora.merged_params(f, a, adapters.scale))
    merged = merge(frozen, trainable)
    full = lora.combine(frozen, trainable)

    sampling = SamplingConfig(max_new_tokens=args.new_tokens, method=Temperature(1.0), pad_id=0)
    prompts = jnp.asarray(rng.integers(1, config.vocab_size, (args.prompts, 32)), jnp.int32)
    lengths = jnp.full((args.prompts,), 32, jnp.int32)
    key = jax.random.key(0)
    forms = {
        "merged": lambda: (
            generate_fn(base_graphdef, merged, prompts, lengths, key, config=sampling).tokens
        ),
        "unmerged": lambda: (
            generate_fn(graphdef, full, prompts, lengths, key, config=sampling).tokens
        ),
        "base": lambda: (
            generate_fn(base_graphdef, frozen, prompts, lengths, key, config=sampling).tokens
        ),
        "merge": lambda: merge(frozen, trainable),
    }
    compile_s = {name: _timed(fn) for name, fn in forms.items()}
    times = {name: [] for name in forms}
    for _ in range(args.runs):
        for name, fn in forms.items():
            times[name].append(_timed(fn))
    median = {name: statistics.median(t) for name, t in times.items()}
    tokens = args.prompts * args.new_tokens
    record = {
        "preset": args.preset,
        "rank": args.rank,
        "targets": args.targets,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "runs": args.runs,
        "median_s": median,
        "first_call_s": compile_s,
        "tokens_per_s": {k: tokens / median[k] for k in ("merged", "unmerged", "base")},
        "merged_per_version_s": median["merged"] + median["merge"],
        "unmerged_over_merged": median["unmerged"] / (median["merged"] + median["merge"]),
        "load_average": os.getloadavg(),
    }
    print(
        f"{args.preset}, LoRA rank {args.rank} on {args.targets}, {args.prompts} prompts x "
        f"{args.new_tokens} new tokens, median of {args.runs} (load {os.getloadavg()[0]:.1f})"
    )
    for name in ("base", "merged", "unmerged"):
        print(f"  {name:<9} {median[name]:7.3f} s  {record['tokens_per_s'][name]:8.0f} tokens/s")
    print(f"  merge     {median['merge']:7.3f} s  (once per weight version)")
    print(f"  unmerged / (merged + merge): {record['unmerged_over_merged']:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
