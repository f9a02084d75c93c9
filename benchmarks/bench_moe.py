"""MoE layer time per token as the number of experts grows: ragged_dot, blocked and
one-hot (capacity) dispatch, measured in the same run.

Fixed: tokens N, hidden D, expert width F, top-k. Varied: E in (8, 32, 64). Active
parameters per token (k experts of width F) stay the same, so an ideal dropless dispatch
costs about the same per token whatever E is (only the router, O(N D E), the sort and the
block padding, O(E * block), grow), while the one-hot dispatch builds [N, E, C] tensors
with C = cf * N * k / E, i.e. O(N^2 k) dispatch / combine work (not O(E), but quadratic
in the tokens of a batch) and drops tokens. Note: XLA:CPU lowers jax.lax.ragged_dot to
one dense matmul per expert, so on a CPU "ragged" grows like E; "blocked" is the
backend-independent dropless path.

    python benchmarks/bench_moe.py            # table + benchmarks/results/bench_moe.json

Reports the median of --repeats timed calls (after one warm-up) of the jitted forward and
forward+backward of one MoE block, and ratios: time(E) / time(E=8) against the expert
count ratio E / 8, and one-hot / ragged.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from policyopt.models import ModelConfig
from policyopt.models.moe import MoE


def _config(experts, args, spec):
    dispatch, block, gather = parse_spec(spec, args)
    return ModelConfig(
        vocab_size=8,
        hidden_size=args.hidden,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=8,
        num_experts=experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.expert_width,
        moe_dispatch=dispatch,
        capacity_factor=args.capacity_factor,
        moe_block_size=block,
        moe_weight_gather=gather,
        dtype=args.dtype,
    )


def parse_spec(spec, args):
    """ "dispatch[:block_size[:gather]]" -> (dispatch, block_size, gather)."""
    parts = spec.split(":")
    dispatch = parts[0]
    block = int(parts[1]) if len(parts) > 1 and parts[1] else args.block_size
    gather = parts[2] if len(parts) > 2 else "auto"
    return dispatch, block, gather


def _time(fn, *inputs, repeats):
    jax.block_until_ready(fn(*inputs))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(experts, dispatch, args):
    moe = MoE(_config(experts, args, dispatch), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(moe)
    x = jax.random.normal(jax.random.key(1), (1, args.tokens, args.hidden), jnp.dtype(args.dtype))
    mask = jnp.ones((1, args.tokens), bool)

    def forward(state, x):
        y, _, aux = nnx.merge(graphdef, state)(x, mask)
        return y, aux["dropped_tokens"]

    def loss(state, x):
        y, _, aux = nnx.merge(graphdef, state)(x, mask)
        return jnp.mean(y.astype(jnp.float32) ** 2) + 1e-3 * aux["load_balancing_loss"]

    fwd = jax.jit(forward)
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1)))
    dropped = float(fwd(state, x)[1])
    return {
        "experts": experts,
        "dispatch": dispatch,
        "forward_us_per_token": 1e6 * _time(fwd, state, x, repeats=args.repeats) / args.tokens,
        "train_us_per_token": 1e6 * _time(bwd, state, x, repeats=args.repeats) / args.tokens,
        "dropped_fraction": dropped / (args.tokens * args.top_k),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--dispatches",
        nargs="+",
        default=["ragged", "blocked", "capacity"],
        help="dispatch[:block_size[:gather]] each, e.g. blocked:256:onehot; "
        "the first 'blocked' one is the reference of 'fwd / blocked'",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_moe.json")
    )
    args = parser.parse_args()

    dispatches = args.dispatches
    rows = [measure(e, d, args) for e in args.experts for d in dispatches]
    reference = next((d for d in dispatches if d.startswith("blocked")), dispatches[0])
    by = {(r["experts"], r["dispatch"]): r for r in rows}
    base = args.experts[0]
    print(
        f"MoE block, N={args.tokens} tokens, D={args.hidden}, F={args.expert_width}, "
        f"k={args.top_k}, cf={args.capacity_factor}, {args.dtype}, {jax.devices()[0].platform}"
    )
    header = (
        f"{'E':>4} {'dispatch':>17} {'fwd us/tok':>11} {'train us/tok':>13} "
        f"{'fwd x(E=' + str(base) + ')':>12} {'train x(E=' + str(base) + ')':>14} "
        f"{'fwd / ' + reference:>14} {'dropped':>8}"
    )
    print(header)
    for r in rows:
        r["forward_ratio_vs_smallest"] = (
            r["forward_us_per_token"] / by[(base, r["dispatch"])]["forward_us_per_token"]
        )
        r["train_ratio_vs_smallest"] = (
            r["train_us_per_token"] / by[(base, r["dispatch"])]["train_us_per_token"]
        )
        r["forward_over_reference"] = (
            r["forward_us_per_token"] / by[(r["experts"], reference)]["forward_us_per_token"]
        )
        print(
            f"{r['experts']:>4} {r['dispatch']:>17} {r['forward_us_per_token']:>11.2f} "
            f"{r['train_us_per_token']:>13.2f} {r['forward_ratio_vs_smallest']:>12.2f} "
            f"{r['train_ratio_vs_smallest']:>14.2f} {r['forward_over_reference']:>14.2f} "
            f"{r['dropped_fraction']:>8.3f}"
        )
    print(f"expert-count ratio E/{base}: " + ", ".join(f"{e / base:g}" for e in args.experts))
    result = {
        "config": vars(args)
        | {
            "platform": jax.devices()[0].platform,
            "device": str(jax.devices()[0].device_kind),
            "machine": platform.machine(),
            "jax": jax.__version__,
        },
        "rows": rows,
    }
    result["config"].pop("out")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
