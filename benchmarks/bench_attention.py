"""Attention time by row length: the einsum ("xla") against "blockwise", in the same run.

Causal grouped-query self-attention of a fixed number of tokens per call (rows of T
tokens, ``--tokens // T`` rows), so that the einsum's [B, H, T, T] scores grow linearly
in T per call while the token count stays put. Times the jitted forward and the jitted
forward + backward (``jax.grad`` with respect to q, k and v) of
``policyopt.models.attention_ops.attend``, median of ``--repeats`` calls after one warm-up,
and the compiled temporaries of the backward (``memory_analysis().temp_size_in_bytes``).
``blockwise / xla`` below 1 means blockwise is faster: the length from which it stays so
is ``XLA_MAX_LENGTH``, where "auto" leaves the einsum on CPUs.

    python -m benchmarks.bench_attention    # table + benchmarks/results/bench_attention.json

``--layer-memory 4096 8192`` instead compiles (does not run) ``jax.grad`` of a one-layer
decoder with Qwen3-30B-A3B's attention shape (D=2048, H=32, Hkv=4, Dh=128; a dense MLP of
width 6144, vocabulary 1024, bf16, one row) at each length, for "xla" and "blockwise",
and prints the compiled temporaries: the [B, H, T, T] term that the einsum adds per layer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from policyopt.models import ModelConfig, Transformer
from policyopt.models.attention_ops import attend


def _time(fn, *inputs, repeats):
    jax.block_until_ready(fn(*inputs))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(length, implementation, args):
    rows = max(1, args.tokens // length)
    keys = jax.random.split(jax.random.key(length), 3)
    dtype = jnp.dtype(args.dtype)
    q = jax.random.normal(keys[0], (rows, length, args.heads, args.head_dim), dtype)
    k, v = (
        jax.random.normal(key, (rows, length, args.kv_heads, args.head_dim), dtype)
        for key in keys[1:]
    )
    # Ragged rows: the last eighth of every row is padding.
    key_mask = jnp.arange(length)[None, :] < jnp.full((rows, 1), length - length // 8)

    def forward(q, k, v):
        return attend(
            q, k, v, key_mask=key_mask, implementation=implementation, block_size=args.block_size
        )

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) ** 2)

    fwd = jax.jit(forward)
    train = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    temp = train.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
    return {
        "length": length,
        "rows": rows,
        "implementation": implementation,
        "forward_ms": 1e3 * _time(fwd, q, k, v, repeats=args.repeats),
        "train_ms": 1e3 * _time(train, q, k, v, repeats=args.repeats),
        "train_temp_mib": temp / 2**20,
    }


def layer_memory(length, implementation):
    """Compiled temporaries (GiB) of jax.grad of a one-layer decoder at ``length``."""
    config = ModelConfig(
        vocab_size=1024,
        hidden_size=2048,
        num_layers=1,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        dtype="bfloat16",
        attention=implementation,
    )
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)

    def loss(params, tokens):
        return jnp.mean(nnx.merge(graphdef, params)(tokens).logits)

    compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
    return {
        "length": length,
        "implementation": implementation,
        "train_temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per call")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--layer-memory",
        type=int,
        nargs="*",
        default=None,
        help="lengths: compile-only temporaries of a one-layer decoder",
    )
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "bench_attention.json")
    )
    args = parser.parse_args()
    if args.layer_memory:
        args.out = args.out.replace(".json", "_layer.json")
        rows = [
            layer_memory(length, name)
            for length in args.layer_memory
            for name in ("xla", "blockwise")
        ]
        print(f"{'T':>6} {'impl':>10} {'grad temp GiB':>14}")
        for r in rows:
            print(f"{r['length']:>6} {r['implementation']:>10} {r['train_temp_gib']:>14.2f}")
        _write(args, rows)
        return

    rows = []
    print(
        f"attention, {args.tokens} tokens per call, H={args.heads}, Hkv={args.kv_heads}, "
        f"Dh={args.head_dim}, block {args.block_size}, {args.dtype}, "
        f"{jax.devices()[0].platform}"
    )
    print(
        f"{'T':>6} {'rows':>5} {'impl':>10} {'fwd ms':>9} {'train ms':>9} "
        f"{'train temp MiB':>15} {'fwd / xla':>10} {'train / xla':>12}"
    )
    for length in args.lengths:
        einsum = measure(length, "xla", args)
        blockwise = measure(length, "blockwise", args)
        blockwise["forward_over_xla"] = blockwise["forward_ms"] / einsum["forward_ms"]
        blockwise["train_over_xla"] = blockwise["train_ms"] / einsum["train_ms"]
        for r in (einsum, blockwise):
            ratios = (
                f"{r['forward_over_xla']:>10.2f} {r['train_over_xla']:>12.2f}"
                if "train_over_xla" in r
                else ""
            )
            print(
                f"{r['length']:>6} {r['rows']:>5} {r['implementation']:>10} "
                f"{r['forward_ms']:>9.2f} {r['train_ms']:>9.2f} "
                f"{r['train_temp_mib']:>15.1f} {ratios}",
                flush=True,
            )
        rows += [einsum, blockwise]
    _write(args, rows)


def _write(args, rows):
    result = {
        "config": vars(args)
        | {
            "platform": jax.devices()[0].platform,
            "device": str(jax.devices()[0].device_kind),
            "machine": platform.machine(),
            "jax": jax.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        },
        "rows": rows,
    }
    result["config"].pop("out")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
