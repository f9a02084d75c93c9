"""The policyopt update at the peers' geometry under each lever, timed against the unchanged
update in the same process, interleaved.

    python -m benchmarks.peers.levers [--variants base,eigen,onednn] [--rounds 5]
    python -m benchmarks.peers.levers --target generate --variants base,eigen

Builds the run of ``side_policyopt.py``, samples one batch (its advantages replaced by
N(0, 1) draws, so that the gradient is not zero), compiles each variant of
``Learner.update`` (an XLA:CPU option set, ``FLAG_VARIANTS``, or code other than the
library's, ``CODE_VARIANTS``: the code before a lever, or a lever tried), checks that its
new parameters match the library's update (``base``), then times ``--rounds`` rounds in
which every variant runs once (the order rotating). Reports per variant: compile time,
the compiled program's size (dots, fusions, bytes accessed), the median wall and CPU time
of one update, and the median of its per-round ratios to ``base``.
Writes ``benchmarks/results/peers_levers.json``. ``--target generate`` does the same for
the jitted sampler (``sampling.generate_fn``), checking each variant's tokens and
log-probs against ``base``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_policyopt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "peers_levers.json"

_YNN = "xla_cpu_experimental_ynn_fusion_type"
_ONEDNN = "xla_cpu_experimental_onednn_fusion_type"

# XLA:CPU options (compile-time, per program) by name.
FLAG_VARIANTS = {
    "base": {},
    # Every dot on Eigen (no YNNPACK).
    "eigen": {_YNN: ""},
    # YNNPACK for the dots only (reductions back to XLA's own loop fusions).
    "ynn_dots_only": {_YNN: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
    # YNNPACK fusions of dots with their elementwise neighbours, and elementwise chains.
    "ynn_fusions": {
        _YNN: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_DOT,"
        "LIBRARY_FUSION_TYPE_ELTWISE"
    },
    # oneDNN for the dots.
    "onednn": {"xla_cpu_use_onednn": True, _ONEDNN: "LIBRARY_FUSION_TYPE_DOT", _YNN: ""},
    "onednn_individual": {
        "xla_cpu_use_onednn": True,
        _ONEDNN: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
        _YNN: "",
    },
    # Fast math (not a default candidate: it changes rounding and NaN handling).
    "fast_math": {"xla_cpu_enable_fast_math": True},
    # The scheduler that orders independent ops for concurrency off.
    "no_concurrency_scheduler": {"xla_cpu_enable_concurrency_optimized_scheduler": False},
    # Compile time: LLVM's optimisation level of the kernels (default 3), its expensive
    # passes, and the number of parts the module is split into for parallel codegen.
    "llvm_o1": {"xla_backend_optimization_level": 1},
    "llvm_o2": {"xla_backend_optimization_level": 2},
    "llvm_cheap": {"xla_llvm_disable_expensive_passes": True},
    "codegen_split_4": {"xla_cpu_parallel_codegen_split_count": 4},
}


def build_batch():
    """The run, its state and one minibatch of the peers' geometry with random advantages."""
    import jax

    from policyopt.rl.batch import minibatch_indices, shard_batch, take_rows

    config, run, _ = side_policyopt.sampler_run(step=True)
    group = config.batch.group_size
    rows = next(iter(minibatch_indices(run.last_batch.tokens.shape[0] // group, group, 1, None)))
    batch = take_rows(run.last_batch, rows)
    advantages = jax.random.normal(jax.random.key(1), batch.advantages.shape)
    with jax.set_mesh(run.spec.mesh):
        batch = shard_batch(batch._replace(advantages=advantages))
    return run, batch


@contextlib.contextmanager
def _einsum_projections():
    """The model's weight products as plain ``jnp.einsum`` (before
    ``policyopt.models.projection``), while a variant is traced."""
    import jax.numpy as jnp

    from policyopt.models import attention, layers

    def einsum(spec, x, w):
        return jnp.einsum(spec, x, w)

    saved = attention.project, layers.project
    attention.project = layers.project = einsum
    try:
        yield
    finally:
        attention.project, layers.project = saved


def _einsum_fused(spec: str, x, weights) -> tuple:
    """``tuple(lora.einsum(spec, x, w) for w in weights)`` as one product: the weights
    (sharing their input axes) concatenated along their flattened outputs, one
    ``projection.project`` with ``x``, the output split after. ``"btd,dnh->btnh"`` with
    q, k, v: one ``"btd,dn->btn"`` with ``[D, (H + 2 Hkv) Dh]``. Plain weights only (the
    peers' geometry has no LoRA adapters)."""
    import jax.numpy as jnp
    import numpy as np

    from policyopt.models import lora
    from policyopt.models.projection import project

    inputs, out = spec.split("->")
    xs, ws = inputs.split(",")
    contracted = "".join(c for c in ws if c in xs)
    produced = ws[len(contracted) :]
    if any(isinstance(w, lora.Adapted) for w in weights):
        raise ValueError("the fused_projections variant takes no LoRA adapters (model.lora)")
    flat = [w.reshape(w.shape[: len(contracted)] + (-1,)) for w in weights]
    fused = project(
        f"{xs},{contracted}n->{out[: -len(produced)]}n", x, jnp.concatenate(flat, axis=-1)
    )
    outputs, ends = [], np.cumsum([w.shape[-1] for w in flat])[:-1].tolist()
    for part, weight in zip(jnp.split(fused, ends, axis=-1), weights):
        outputs.append(part.reshape(part.shape[:-1] + weight.shape[len(contracted) :]))
    return tuple(outputs)


@contextlib.contextmanager
def _fused_projections():
    """q/k/v as one product with the concatenated weights ``[D, (H + 2 Hkv) Dh]`` and the
    MLP's gate/up as one with ``[D, 2F]`` (``_einsum_fused``), split after: the dense
    model's attention and MLP (the experts' gate/up are not at this geometry)."""
    import jax

    from policyopt.models import lora
    from policyopt.models.attention import Attention
    from policyopt.models.layers import MLP

    def attention_project(self, x, weights):
        return _einsum_fused("btd,dnh->btnh", x, [w.astype(self.dtype) for w in weights])

    def mlp_apply(self, x, weights):
        w_gate, w_up, w_down = (w.astype(self.dtype) for w in weights)
        gate, up = _einsum_fused("btd,df->btf", x, [w_gate, w_up])
        return lora.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w_down)

    saved = Attention._project, MLP._apply
    Attention._project, MLP._apply = attention_project, mlp_apply
    try:
        yield
    finally:
        Attention._project, MLP._apply = saved


# Code variants: name -> a context manager active while the update is traced.
CODE_VARIANTS = {
    "einsum_projections": _einsum_projections,
    "fused_projections": _fused_projections,
}


def program_size(compiled) -> dict:
    """A compiled program's size: optimised HLO instructions, fusions and dots, and XLA's
    cost analysis (FLOPs, bytes accessed)."""
    hlo = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    return {
        "instructions": sum(1 for line in hlo.splitlines() if " = " in line),
        "fusions": len(re.findall(r" fusion\(", hlo)),
        "dots": len(re.findall(r" dot\(", hlo)),
        "gflop": float(cost.get("flops", 0.0)) / 1e9,
        "gb_accessed": float(cost.get("bytes accessed", 0.0)) / 1e9,
    }


def compile_variant(name: str, jitted, *args, **kwargs):
    """``jitted`` lowered for ``args`` under variant ``name``'s code patch and compiled with
    its XLA flags: the executable and the variant's record (options, compile wall and CPU
    seconds, program size; empty ``wall_s`` / ``cpu_s`` for the timed rounds). The caches
    are cleared first: inner jitted functions keep their traces across outer jits, and
    without this a code variant would reuse base's."""
    import jax

    options = FLAG_VARIANTS.get(name, {})
    patch = CODE_VARIANTS.get(name, contextlib.nullcontext)
    jax.clear_caches()
    wall, cpu = time.perf_counter(), time.process_time()
    with patch():
        lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile(compiler_options=options or None)
    record = {
        "options": options,
        "compile_wall_s": time.perf_counter() - wall,
        "compile_cpu_s": time.process_time() - cpu,
        "program": program_size(compiled),
        "wall_s": [],
        "cpu_s": [],
    }
    return compiled, record


def time_rounds(names: list[str], rounds: int, record: dict, call) -> None:
    """``rounds`` rounds of ``call(name)`` for every variant, each round starting one variant
    later (interleaved), appending the wall and CPU seconds of each call to ``record[name]``;
    one line a round."""
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            call(name)
            record[name]["wall_s"].append(time.perf_counter() - wall)
            record[name]["cpu_s"].append(time.process_time() - cpu)
        print(
            f"round {r + 1}: " + ", ".join(f"{n} {record[n]['wall_s'][-1]:.2f}" for n in names),
            flush=True,
        )


def time_generate(names: list[str], rounds: int) -> dict:
    """The jitted sampler (``sampling.generate_fn``: prefill, then the 64-step decode loop of
    128 rows) under each variant, interleaved; each variant's tokens and log-probs checked
    against ``base``'s (the same key)."""
    import jax
    import numpy as np

    from policyopt import sampling as sampling_module
    from policyopt import sharding

    _, run, sampling = side_policyopt.sampler_run()
    prompts = next(run.spec.prompts)
    compiled, outputs, record = {}, {}, {}
    with jax.set_mesh(run.spec.mesh):
        inputs = (
            run.run_state.policy.params,
            sharding.shard_rows(prompts["prompt_tokens"]),
            sharding.shard_rows(prompts["prompt_lengths"]),
            jax.random.key(0),
        )
        for name in names:
            # A fresh function object: no variant reuses another's compiled program.
            jitted = jax.jit(
                sampling_module.generate_fn.__wrapped__,
                static_argnums=(0,),
                static_argnames="config",
            )
            compiled[name], record[name] = compile_variant(
                name, jitted, run.spec.graphdef, *inputs, config=sampling
            )
            outputs[name] = jax.block_until_ready(compiled[name](*inputs))
            print(f"compiled {name}: {record[name]['compile_wall_s']:.1f} s", flush=True)
        base = outputs["base"]
        for name in names:
            out = outputs[name]
            record[name]["tokens_equal_base"] = bool(np.array_equal(out.tokens, base.tokens))
            record[name]["max_abs_param_diff_vs_base"] = float(
                np.max(np.abs(np.asarray(out.log_probs) - np.asarray(base.log_probs)))
            )
        time_rounds(names, rounds, record, lambda n: jax.block_until_ready(compiled[n](*inputs)))
    return record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="base,eigen,ynn_fusions,onednn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--target",
        choices=("update", "generate"),
        default="update",
        help="the program timed: the update, or the sampler (its log-probs compared)",
    )
    args = parser.parse_args(argv)

    from policyopt.runtime import keep_freed_host_memory

    keep_freed_host_memory()
    names = [n for n in args.variants.split(",") if n]
    known = sorted(FLAG_VARIANTS) + sorted(CODE_VARIANTS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {known}")
    if names[0] != "base":
        names.insert(0, "base")
    if args.target == "generate":
        record = time_generate(names, args.rounds)
    else:
        record = time_update(names, args.rounds)
    report(record, names, args)


def time_update(names: list[str], rounds: int) -> dict:
    """``Learner.update`` under each variant, interleaved; each variant's new parameters
    checked against ``base``'s."""
    import jax
    import numpy as np

    run, batch = build_batch()
    compiled, states, record = {}, {}, {}
    with jax.set_mesh(run.spec.mesh):
        for name in names:
            # A fresh function object: no variant reuses another's compiled program.
            jitted = jax.jit(
                lambda state, batch: run.spec.learner._update(state, batch), donate_argnums=0
            )
            state = jax.tree.map(lambda x: x.copy(), run.run_state.policy)
            compiled[name], record[name] = compile_variant(name, jitted, state, batch)
            state, metrics = compiled[name](state, batch)
            states[name] = jax.block_until_ready(state)
            print(f"compiled {name}: {record[name]['compile_wall_s']:.1f} s", flush=True)
        reference = jax.tree.leaves(states["base"].params)
        before = jax.tree.leaves(run.run_state.policy.params)
        moved = max(
            float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(reference, before)
        )
        for name in names:
            leaves = jax.tree.leaves(states[name].params)
            diff = max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(leaves, reference)
            )
            record[name]["max_abs_param_diff_vs_base"] = diff
            record[name]["base_update_max_abs_step"] = moved

        def step(name):
            state, _ = compiled[name](states[name], batch)
            states[name] = jax.block_until_ready(state)

        time_rounds(names, rounds, record, step)  # --rounds 0: compile times and checks only
    return record


def report(record: dict, names: list[str], args) -> None:
    for name in names:
        rec = record[name]
        if not args.rounds:
            rec.update(median_wall_s=0.0, median_cpu_s=0.0, ratio_wall_vs_base=0.0)
            rec["ratio_cpu_vs_base"] = 0.0
            continue
        rec["median_wall_s"] = statistics.median(rec["wall_s"])
        rec["median_cpu_s"] = statistics.median(rec["cpu_s"])
        rec["ratio_wall_vs_base"] = statistics.median(
            a / b for a, b in zip(rec["wall_s"], record["base"]["wall_s"])
        )
        rec["ratio_cpu_vs_base"] = statistics.median(
            a / b for a, b in zip(rec["cpu_s"], record["base"]["cpu_s"])
        )
    result = {
        "target": args.target,
        "variants": record,
        "rounds": args.rounds,
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{'variant':<26}{'compile s':>10}{'wall s':>9}{'cpu s':>9}{'wall/base':>10}"
        f"{'cpu/base':>9}{'max |dp|':>10}"
    )
    for name in names:
        rec = record[name]
        print(
            f"{name:<26}{rec['compile_wall_s']:>10.1f}{rec['median_wall_s']:>9.3f}{rec['median_cpu_s']:>9.3f}"
            f"{rec['ratio_wall_vs_base']:>10.3f}{rec['ratio_cpu_vs_base']:>9.3f}{rec['max_abs_param_diff_vs_base']:>10.2e}"
        )
    print(
        "program: "
        + "; ".join(
            f"{n} {record[n]['program']['dots']} dots, {record[n]['program']['fusions']} fusions, "
            f"{record[n]['program']['gb_accessed']:.2f} GB accessed"
            for n in names
        )
    )
    if args.target == "generate":
        print("(max |dp|: of the sampled tokens' log-probs; tokens equal to base's: ", end="")
        print(", ".join(f"{n} {record[n]['tokens_equal_base']}" for n in names) + ")")
    else:
        print(
            "(the base update moved parameters by up to "
            f"{record['base']['base_update_max_abs_step']:.2e})"
        )
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
