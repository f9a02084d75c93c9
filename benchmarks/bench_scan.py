"""Compile time of a training gradient as the decoder deepens, with and without
``scan_layers`` (and a remat policy): the scan should compile a deep model in about the
time of one layer, the unrolled loop in time growing with the depth.

Compile only: abstract parameters (``nnx.eval_shape``) and tokens
(``jax.ShapeDtypeStruct``); ``jax.jit(grad).lower(...)`` then ``.compile()`` is timed
separately (tracing + lowering, then XLA), and the size of the lowered text recorded.

    python -m benchmarks.bench_scan                       # moe_7m, 1 vs 12 layers
    python -m benchmarks.bench_scan --preset tiny_dense --layers 2,12,48 --modes scan --remat full
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
from flax import nnx

from policyopt.models import Transformer, preset


def measure(config, batch: int, seq_len: int) -> dict:
    """Seconds to trace + lower and to compile the gradient of a mean-logit loss."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)

    def loss(params, tokens):
        out = nnx.merge(graphdef, params, rest)(tokens, return_logits=False)
        value = jnp.mean(out.hidden.astype(jnp.float32) ** 2)
        return value + (out.aux["load_balancing_loss"] if out.aux else 0.0)

    start = time.perf_counter()
    lowered = jax.jit(jax.grad(loss)).lower(params, tokens)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    return {
        "lower_s": lower_s,
        "compile_s": time.perf_counter() - start,
        "hlo_chars": len(lowered.as_text()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="moe_7m")
    parser.add_argument("--layers", default="1,12", help="comma-separated depths")
    parser.add_argument("--modes", default="loop,scan", help="loop, scan or both")
    parser.add_argument("--remat", default="none", choices=("none", "full", "save_dots"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", default="benchmarks/results/bench_scan.json")
    args = parser.parse_args()
    rows = []
    print(f"{'layers':>6} {'scan':>5} {'lower s':>8} {'compile s':>9} {'HLO chars':>10}")
    for layers in (int(n) for n in args.layers.split(",")):
        for scan in [mode == "scan" for mode in args.modes.split(",")]:
            config = preset(args.preset, num_layers=layers, scan_layers=scan, remat=args.remat)
            row = {
                "layers": layers,
                "scan_layers": scan,
                **measure(config, args.batch, args.seq_len),
            }
            rows.append(row)
            print(
                f"{layers:>6} {str(scan):>5} {row['lower_s']:8.2f} {row['compile_s']:9.2f} "
                f"{row['hlo_chars']:>10}",
                flush=True,
            )
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "preset": args.preset,
                "remat": args.remat,
                "batch": args.batch,
                "seq_len": args.seq_len,
                "jax": jax.__version__,
                "machine": platform.machine(),
                "rows": rows,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
