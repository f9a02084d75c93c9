"""Policy losses (value + gradient) and GAE on B = 256, T = 4096 float32, ragged lengths.

Each row is timed against two references measured in the same run:

* ``floor``: one jitted elementwise pass over the same arrays, reading the same inputs and
  writing outputs of the same size (losses: 4 inputs -> one ``[B, T]`` gradient; GAE:
  rewards, values, mask -> advantages and returns). This is the memory-bandwidth floor:
  nothing that reads its inputs and writes its outputs can be faster.
* ``numpy``: the NumPy reference: for GAE a loop over time vectorised over the batch
  (what a PyTorch/NumPy framework does); for the losses the value and the analytic
  gradient in vectorised NumPy (a per-token Python loop would be ~10^3 slower and says
  nothing). ``--numpy_rows`` times it on that many rows and scales to B (stated in the
  output).

Rows: each ``policy_loss`` method as ``jax.jit(jax.value_and_grad(..., has_aux=True))``
with all metrics returned (``metrics="all"``, the default) and with ``metrics="none"``
(the loss alone); GAE plain with each implementation (``blocked``
with several chunk lengths, ``associative``, ``scan`` with two unroll factors), decoupled
(VC-PPO) and length-adaptive (VAPO) with each implementation, and the default ``blocked``
on a mask with holes (where it falls back to ``scan``). Floors to meet (issue 2): GAE within 2x of
the elementwise pass, each loss within 3x. Times are medians of ``--repeats`` runs.

The process first calls ``policyopt.runtime.keep_freed_host_memory()`` (as the experiments
do), so that XLA:CPU's per-call buffers are reused instead of faulted in again on every
call; ``--system_malloc`` measures with glibc's defaults.

Run: ``python -m benchmarks.bench_core [--repeats 10] [--batch 256] [--length 4096]``.
Writes ``benchmarks/results/bench_core.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from policyopt import advantages as adv
from policyopt import losses, runtime

RESULTS = Path(__file__).parent / "results" / "bench_core.json"
METHODS = ("ppo", "gspo", "gspo_token", "sapo")
LOSS_LIMIT = 3.0
GAE_LIMIT = 2.0


def median_ms(fn, *args, repeats):
    """Median wall time of ``fn(*args)`` in ms after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def paired_ms(fn, args, floor_fn, floor_args, repeats):
    """Wall and CPU times (ms) of ``fn`` and of the floor, timed alternately.

    Alternating the two makes their ratio robust to the load of a shared machine drifting
    during the run. CPU time (``time.process_time``, all threads of this process) is
    mostly independent of other processes' load, so its ratio is the steadier one.
    Returns medians: (wall, floor wall, cpu, floor cpu).
    """
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(floor_fn(*floor_args))
    samples = {"wall": [], "floor_wall": [], "cpu": [], "floor_cpu": []}
    for _ in range(repeats):
        for f, a, key in ((fn, args, ""), (floor_fn, floor_args, "floor_")):
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(f(*a))
            samples[key + "cpu"].append(time.process_time() - cpu)
            samples[key + "wall"].append(time.perf_counter() - wall)
    return tuple(
        1e3 * statistics.median(samples[k]) for k in ("wall", "floor_wall", "cpu", "floor_cpu")
    )


def make_inputs(batch, length, seed=0):
    rng = np.random.default_rng(seed)
    # Ragged response lengths: uniform between T/8 and T, right padding.
    lengths = rng.integers(length // 8, length + 1, size=batch)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
    old_log_probs = (-rng.exponential(1.0, size=(batch, length))).astype(np.float32)
    log_probs = (old_log_probs + 0.1 * rng.normal(size=(batch, length))).astype(np.float32)
    seq_adv = rng.normal(size=(batch, 1)).astype(np.float32)
    advantages = np.broadcast_to(seq_adv, (batch, length)).copy()
    rewards = np.zeros((batch, length), np.float32)
    rewards[np.arange(batch), lengths - 1] = rng.integers(0, 2, size=batch)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    return dict(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        mask=mask,
        rewards=rewards,
        values=values,
    )


# ----------------------------------------------------------------------------------------
# NumPy references.
# ----------------------------------------------------------------------------------------


def numpy_gae(rewards, values, mask, gamma, lam_actor, lam_critic):
    """GAE as a loop over time, vectorised over the batch (verl-style), with masking."""
    batch, length = rewards.shape
    next_value = np.zeros(batch, np.float32)
    adv_actor = np.zeros(batch, np.float32)
    adv_critic = np.zeros(batch, np.float32)
    out_actor = np.zeros_like(rewards)
    out_critic = np.zeros_like(rewards)
    for t in range(length - 1, -1, -1):
        valid = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_actor = np.where(valid, delta + gamma * lam_actor * adv_actor, adv_actor)
        adv_critic = np.where(valid, delta + gamma * lam_critic * adv_critic, adv_critic)
        next_value = np.where(valid, values[:, t], next_value)
        out_actor[:, t] = np.where(valid, adv_actor, 0)
        out_critic[:, t] = np.where(valid, adv_critic + values[:, t], 0)
    return out_actor, out_critic


def numpy_loss_and_grad(
    log_probs,
    old_log_probs,
    advantages,
    mask,
    method,
    clip_low=0.2,
    clip_high=0.2,
    tau_pos=1.0,
    tau_neg=1.05,
):
    """Token-mean loss and d loss / d log_probs in vectorised NumPy, from docs/algorithms.md."""
    valid = mask > 0
    weight = mask / max(mask.sum(), 1)
    log_ratio = np.where(valid, log_probs - old_log_probs, 0)
    lengths = np.maximum(mask.sum(1, keepdims=True), 1)
    if method in ("ppo", "gspo_token"):
        if method == "ppo":
            ratio = np.exp(log_ratio)
        else:
            ratio = np.broadcast_to(np.exp(log_ratio.sum(1, keepdims=True) / lengths), mask.shape)
        clipped = ((advantages > 0) & (ratio > 1 + clip_high)) | (
            (advantages < 0) & (ratio < 1 - clip_low)
        )
        objective = (
            np.where(clipped, np.clip(ratio, 1 - clip_low, 1 + clip_high), ratio) * advantages
        )
        grad = -weight * np.where(clipped, 0, ratio * advantages)
    elif method == "gspo":
        seq_ratio = np.exp(log_ratio.sum(1, keepdims=True) / lengths)
        seq_adv = (advantages * mask).sum(1, keepdims=True) / lengths
        clipped = ((seq_adv > 0) & (seq_ratio > 1 + clip_high)) | (
            (seq_adv < 0) & (seq_ratio < 1 - clip_low)
        )
        objective = np.broadcast_to(
            np.where(clipped, np.clip(seq_ratio, 1 - clip_low, 1 + clip_high), seq_ratio) * seq_adv,
            mask.shape,
        )
        seq_weight = weight.sum(1, keepdims=True)
        grad = -seq_weight * np.where(clipped, 0, seq_ratio * seq_adv) * mask / lengths
    else:
        ratio = np.exp(log_ratio)
        tau = np.where(advantages > 0, tau_pos, tau_neg)
        p = 1 / (1 + np.exp(-tau * (ratio - 1)))
        objective = p * 4 / tau * advantages
        grad = -weight * 4 * p * (1 - p) * ratio * advantages
    return -np.sum(weight * objective), grad


def time_numpy(fn, inputs, rows, batch, repeats):
    """Median ms of fn on the first ``rows`` rows, scaled to the full batch."""
    sliced = {k: v[:rows] for k, v in inputs.items()}
    times = []
    for _ in range(max(1, repeats // 3)):
        start = time.perf_counter()
        fn(**sliced)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times) * batch / rows


# ----------------------------------------------------------------------------------------
# Benchmark.
# ----------------------------------------------------------------------------------------


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--numpy_rows", type=int, default=256)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--system_malloc",
        action="store_true",
        help="leave glibc's malloc settings alone (default: keep freed blocks, "
        "policyopt.runtime.keep_freed_host_memory)",
    )
    args = parser.parse_args(argv)
    kept = False if args.system_malloc else runtime.keep_freed_host_memory()
    print(f"keep_freed_host_memory: {kept}")
    batch, length, repeats = args.batch, args.length, args.repeats
    host = make_inputs(batch, length)
    dev = {k: jnp.asarray(v) for k, v in host.items()}
    rows = []

    def record(group, name, fn, args, floor_fn, limit, numpy_ms=None, note=""):
        ms, floor_ms, cpu_ms, floor_cpu_ms = paired_ms(fn, args, floor_fn, args, repeats)
        row = dict(
            group=group,
            name=name,
            ms=round(ms, 3),
            floor_ms=round(floor_ms, 3),
            x_floor=round(ms / floor_ms, 2),
            cpu_ms=round(cpu_ms, 3),
            floor_cpu_ms=round(floor_cpu_ms, 3),
            x_floor_cpu=round(cpu_ms / floor_cpu_ms, 2),
            limit=limit,
            within_limit=ms / floor_ms <= limit,
            numpy_ms=None if numpy_ms is None else round(numpy_ms, 2),
            speedup_vs_numpy=None if numpy_ms is None else round(numpy_ms / ms, 1),
            note=note,
        )
        rows.append(row)
        print(
            f"{group:4s} {name:40s} {ms:8.2f} ms  floor {floor_ms:6.2f} ms  x{ms / floor_ms:5.2f}"
            f" (cpu x{cpu_ms / floor_cpu_ms:5.2f}; limit {limit:.0f}x)"
            + (
                ""
                if numpy_ms is None
                else f"  numpy {numpy_ms:8.1f} ms  ({numpy_ms / ms:5.1f}x faster)"
            ),
            flush=True,
        )

    # Floors: one fused elementwise pass, same inputs and output sizes.
    loss_floor_fn = jax.jit(lambda lp, old, a, m: (lp - old) * a * m)
    gae_floor_fn = jax.jit(lambda r, v, m: (r * m + v, (r - v) * m))
    loss_args = (dev["log_probs"], dev["old_log_probs"], dev["advantages"], dev["mask"])
    gae_args = (dev["rewards"], dev["values"], dev["mask"])

    def floors():
        return (
            median_ms(loss_floor_fn, *loss_args, repeats=repeats),
            median_ms(gae_floor_fn, *gae_args, repeats=repeats),
        )

    loss_floor, gae_floor = floors()
    print(
        f"floors at the start: loss elementwise {loss_floor:.2f} ms, "
        f"gae elementwise {gae_floor:.2f} ms"
    )

    for method in METHODS:

        def with_metrics(lp, old, a, m, method=method):
            return losses.policy_loss(lp, old, a, m, method=method)

        def loss_only(lp, old, a, m, method=method):
            return losses.policy_loss(lp, old, a, m, method=method, metrics="none")

        full = jax.jit(jax.value_and_grad(with_metrics, has_aux=True))
        bare = jax.jit(jax.value_and_grad(loss_only, has_aux=True))
        numpy_ms = time_numpy(
            lambda log_probs, old_log_probs, advantages, mask, **_: numpy_loss_and_grad(
                log_probs, old_log_probs, advantages, mask, method
            ),
            host,
            min(args.numpy_rows, batch),
            batch,
            repeats,
        )
        record(
            "loss",
            f"{method} value+grad+metrics",
            full,
            loss_args,
            loss_floor_fn,
            LOSS_LIMIT,
            numpy_ms,
        )
        record(
            "loss",
            f"{method} value+grad, metrics='none'",
            bare,
            loss_args,
            loss_floor_fn,
            LOSS_LIMIT,
        )

    gae_numpy = time_numpy(
        lambda rewards, values, mask, **_: numpy_gae(rewards, values, mask, 1.0, 0.95, 0.95),
        host,
        min(args.numpy_rows, batch),
        batch,
        repeats,
    )
    lengths = host["mask"].sum(1)
    lam_adaptive = np.maximum(1 - 1 / (0.05 * lengths), 0).astype(np.float32)
    variants = [("plain", dict(impl="blocked", chunk=c)) for c in (16, 32, 64)]
    variants += [("plain", dict(impl="associative"))]
    variants += [("plain", dict(impl="scan", unroll=u)) for u in (1, 8)]
    for name, options in variants:
        fn = jax.jit(
            lambda r, v, m, options=options: adv.gae(r, v, m, gamma=1.0, lam=0.95, **options)
        )
        label = f"gae {name} " + ",".join(f"{k}={v}" for k, v in options.items())
        record("gae", label, fn, gae_args, gae_floor_fn, GAE_LIMIT, gae_numpy)
    for impl in adv.GAE_IMPLS:
        fn = jax.jit(
            lambda r, v, m, impl=impl: adv.decoupled_gae(
                r, v, m, gamma=1.0, lam_actor=0.95, lam_critic=1.0, impl=impl
            )
        )
        numpy_ms = time_numpy(
            lambda rewards, values, mask, **_: numpy_gae(rewards, values, mask, 1.0, 0.95, 1.0),
            host,
            min(args.numpy_rows, batch),
            batch,
            repeats,
        )
        record("gae", f"decoupled_gae impl={impl}", fn, gae_args, gae_floor_fn, GAE_LIMIT, numpy_ms)
        fn = jax.jit(
            lambda r, v, m, impl=impl: adv.length_adaptive_gae(
                r, v, m, gamma=1.0, alpha=0.05, impl=impl
            )
        )
        numpy_ms = time_numpy(
            lambda rewards, values, mask, lam=lam_adaptive, **_: numpy_gae(
                rewards, values, mask, 1.0, lam[: len(rewards)], 1.0
            ),
            host,
            min(args.numpy_rows, batch),
            batch,
            repeats,
        )
        record(
            "gae",
            f"length_adaptive_gae impl={impl}",
            fn,
            gae_args,
            gae_floor_fn,
            GAE_LIMIT,
            numpy_ms,
        )

    # impl="blocked" on a mask with holes (one masked position inside every response, as
    # tool output would make): the run-time check sends it to the lax.scan fallback.
    holes = host["mask"].copy()
    holes[:, length // 16] = 0
    holes_args = (dev["rewards"], dev["values"], jnp.asarray(holes))
    fn = jax.jit(lambda r, v, m: adv.gae(r, v, m, gamma=1.0, lam=0.95))
    record(
        "gae",
        "gae impl=blocked, mask with holes (scan fallback)",
        fn,
        holes_args,
        gae_floor_fn,
        GAE_LIMIT,
        gae_numpy,
    )

    plain = [row for row in rows if row["name"].startswith("gae plain")]
    fastest = min(plain, key=lambda row: row["ms"])
    print(
        f"fastest plain GAE: {fastest['name']} ({fastest['ms']:.2f} ms, x{fastest['x_floor']:.2f})"
    )
    loss_floor_end, gae_floor_end = floors()
    print(
        f"floors at the end: loss {loss_floor_end:.2f} ms, gae {gae_floor_end:.2f} ms "
        "(each ratio above uses the floor timed alternately with its row)"
    )
    result = dict(
        benchmark="bench_core",
        batch=batch,
        length=length,
        repeats=repeats,
        numpy_rows=min(args.numpy_rows, batch),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        jax=jax.__version__,
        backend=jax.default_backend(),
        cpu_count=os.cpu_count(),
        python=platform.python_version(),
        floors_ms=dict(
            loss=loss_floor, gae=gae_floor, loss_end=loss_floor_end, gae_end=gae_floor_end
        ),
        fastest_plain_gae=fastest["name"],
        keep_freed_host_memory=kept,
        load_average=os.getloadavg(),
        rows=rows,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
