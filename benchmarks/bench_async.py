"""Asynchronous generation's decode throughput on the CPU, against the synchronous sampler.

`policyopt.rl.rollouts.async_generation.SlotGenerator` decodes R rows in segments of K steps, each
row at its own step (rows are refilled as their groups finish), and records per token the
parameter version, the behaviour log-probs and the MoE routing. The synchronous sampler
(`policyopt.sampling.generate_fn`) decodes all rows in lock step. Both decode the same
rows of the same model here: 8 prompts of 32 tokens x 8 samples (R = 64), no EOS, so
every row decodes all N new tokens; the slot generator in ceil(N / K) segments after one
refill per group. Per-token time is the reference's: the slot machinery should cost
little on top of the model's forward passes, at any N.

    python -m benchmarks.bench_async [--runs 5] [--max_new_tokens 128 512] [--segment_steps 16]

Rows: the synchronous sampler (reference), the slot generator's round (refills and
segments), and its segments alone, for each N. Limit: the round within
`LIMIT` x the synchronous sampler's time, at every N (medians of ``--runs``, timed
alternately). Writes benchmarks/results/bench_async.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from policyopt import sampling  # noqa: E402
from policyopt.models import Transformer, preset  # noqa: E402
from policyopt.rl.rollouts.async_generation import SlotConfig, SlotGenerator  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results", "bench_async.json")
LIMIT = 1.5


def _sync_call(graphdef, params, prompts, lengths, config):
    seeds = iter(range(10_000))

    def call():
        rollout = sampling.generate_fn(
            graphdef, params, prompts, lengths, jax.random.key(next(seeds)), config=config
        )
        jax.block_until_ready(rollout.tokens)
        assert int(rollout.num_steps) == config.max_new_tokens

    return call


def _async_calls(graphdef, params, prompts, lengths, config: SlotConfig):
    """(round, segments_only): one refill per group then segments until every row is done;
    the second call re-times only the segments of a fresh round."""
    slots = SlotGenerator(graphdef, config, params)
    seeds = iter(range(10_000))
    segments = -(-config.sampling.max_new_tokens // config.segment_steps)

    def refill():
        for group in slots.free_groups():
            slots.refill(
                group,
                {"prompt_tokens": prompts[group], "prompt_length": int(lengths[group])},
                params,
                0,
            )

    def decode():
        finished = []
        for _ in range(segments):
            finished += slots.segment(params, 0, jax.random.key(next(seeds)))
        assert len(finished) == config.num_groups and not slots.num_active, "rows still decoding"
        assert all(int(c.lengths.min()) == config.sampling.max_new_tokens for c in finished)

    def round_():
        refill()
        decode()

    def segments_only():
        refill()
        jax.block_until_ready(slots.state)
        start = time.perf_counter()
        decode()
        return time.perf_counter() - start

    return round_, segments_only


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num_prompts", type=int, default=8)
    parser.add_argument("--num_samples", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--segment_steps", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)

    model_config = preset("moe_7m")
    model = Transformer(model_config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = rng.integers(
        1, model_config.vocab_size, (args.num_prompts, args.prompt_len), dtype=np.int32
    )
    lengths = np.full(args.num_prompts, args.prompt_len, np.int32)
    rows = args.num_prompts * args.num_samples

    table = []
    for num_new in args.max_new_tokens:
        sampling_config = sampling.SamplingConfig(
            max_new_tokens=num_new,
            method=sampling.sampling_method(1.0),
            num_samples=args.num_samples,
        )
        slot_config = SlotConfig(
            sampling=sampling_config,
            num_groups=args.num_prompts,
            prompt_width=args.prompt_len,
            segment_steps=args.segment_steps,
        )
        sync = _sync_call(
            graphdef, params, jnp.asarray(prompts), jnp.asarray(lengths), sampling_config
        )
        round_, segments_only = _async_calls(graphdef, params, prompts, lengths, slot_config)
        for fn in (sync, round_):  # compile
            fn()
        sync_times, round_times, segment_times = [], [], []
        for _ in range(args.runs):  # alternated: the machine's load affects both alike
            start = time.perf_counter()
            sync()
            sync_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            round_()
            round_times.append(time.perf_counter() - start)
            segment_times.append(segments_only())
        tokens = rows * num_new
        sync_s, round_s, segment_s = (
            float(np.median(t)) for t in (sync_times, round_times, segment_times)
        )
        ratio = round_s / sync_s
        table.append(
            dict(
                max_new_tokens=num_new,
                tokens=tokens,
                sync_s=sync_s,
                round_s=round_s,
                segments_s=segment_s,
                sync_us_per_token=1e6 * sync_s / tokens,
                round_us_per_token=1e6 * round_s / tokens,
                ratio=ratio,
                segments_ratio=segment_s / sync_s,
                passed=ratio <= LIMIT,
                times=dict(sync=sync_times, round=round_times, segments=segment_times),
            )
        )

    print(
        f"\nAsynchronous decode vs the synchronous sampler: {model_config.num_layers}-layer "
        f"Qwen3-MoE preset moe_7m, {args.num_prompts} prompts x {args.prompt_len} tokens x "
        f"{args.num_samples} samples (R = {rows}), segments of K = {args.segment_steps}, "
        f"CPU ({os.cpu_count()} cores), medians of {args.runs}"
    )
    print(
        f"{'N':>6s} {'sync s':>8s} {'round s':>8s} {'segments s':>11s} {'sync us/tok':>12s} "
        f"{'round us/tok':>13s} {'round/sync':>11s} {'segments/sync':>14s} {'limit':>6s}"
    )
    for row in table:
        print(
            f"{row['max_new_tokens']:6d} {row['sync_s']:8.2f} {row['round_s']:8.2f} "
            f"{row['segments_s']:11.2f} {row['sync_us_per_token']:12.1f} "
            f"{row['round_us_per_token']:13.1f} {row['ratio']:10.2f}x "
            f"{row['segments_ratio']:13.2f}x "
            f"{LIMIT:5.1f}x {'PASS' if row['passed'] else 'FAIL'}"
        )
    result = dict(
        benchmark="bench_async",
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        model="moe_7m",
        rows=rows,
        prompt_len=args.prompt_len,
        segment_steps=args.segment_steps,
        runs=args.runs,
        limit=LIMIT,
        cpu_count=os.cpu_count(),
        platform=platform.platform(terse=True),
        jax=jax.__version__,
        table=table,
        passed=all(row["passed"] for row in table),
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
