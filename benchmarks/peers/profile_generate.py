"""Where policyopt's generation spends its time at the peers' geometry (``common.GEOMETRY``).

    python -m benchmarks.peers.profile_generate [--repeats 3] [--out PATH] [--hlo PATH]

Builds the run of ``side_policyopt.py`` and on its jitted sampler (``sampling.generate_fn``:
the prefill of 16 prompts, then 64 decode steps of 128 rows in a ``lax.while_loop``, one
program):

* the compiled program: its size (HLO instructions, fusions, dots) and compile time;
* its wall and CPU time (median of ``--repeats``);
* a ``jax.profiler`` trace with XLA:CPU's per-thunk events (as ``profile_update``): time per
  fusion / op over the whole call, grouped by kind, by the JAX operation each comes from,
  and by part (prefill, the decode loop's model step, its sampling);
* the decode step's floor: the step's matmuls (those of the loop body) run alone as plain
  ``jax.lax.dot_general``s of the same shapes, times 64.

Run it in the policyopt environment (``.peers-venvs/policyopt`` or the repository's own).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.trace_thunks()  # before jax initialises its CPU client
import profile_update  # noqa: E402
import side_policyopt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "peers_profile_generate.json"


def loop_computations(hlo: str) -> set[str]:
    """Names of the computations a ``while`` loop's body runs (the body and every
    computation it calls, transitively)."""
    calls: dict[str, set[str]] = collections.defaultdict(set)
    bodies, computation = set(), None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and " = " not in line:
            computation = head.group(1)
            continue
        for callee in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line):
            calls[computation].add(callee)
        body = re.search(r" while\(.*body=%?([\w.\-]+)", line)
        if body:
            bodies.add(body.group(1))
    reached, stack = set(), list(bodies)
    while stack:
        name = stack.pop()
        if name not in reached:
            reached.add(name)
            stack.extend(calls.get(name, ()))
    return reached


def part(source: str, in_loop: bool) -> str:
    """prefill / decode: model / decode: sampling, from where an op runs and its JAX
    op_name (the model's ops carry its module names)."""
    if not in_loop:
        return "prefill and set-up"
    model = ("attention", "mlp", "layers", "transformer", "dot_general", "norm", "rope", "einsum")
    if any(word in source for word in model):
        return "decode: model step"
    return "decode: sampling and bookkeeping"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--hlo", type=Path, default=None, help="also write the optimised HLO")
    args = parser.parse_args(argv)

    import jax

    from policyopt import sharding
    from policyopt.runtime import keep_freed_host_memory
    from policyopt.sampling import generate_fn

    keep_freed_host_memory()
    _, run, sampling = side_policyopt.sampler_run()
    prompts = next(run.spec.prompts)
    with jax.set_mesh(run.spec.mesh):
        inputs = (
            run.spec.graphdef,
            run.run_state.policy.params,
            sharding.shard_rows(prompts["prompt_tokens"]),
            sharding.shard_rows(prompts["prompt_lengths"]),
            jax.random.key(0),
        )
        t0 = time.perf_counter()
        lowered = generate_fn.lower(*inputs, config=sampling)
        lower_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        call_args = inputs[1:]

        def step():
            jax.block_until_ready(compiled(*call_args))

        step()
        walls, cpus = [], []
        threads_before = common.thread_cpu_seconds()
        for _ in range(args.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        threads = common.thread_split(threads_before, common.thread_cpu_seconds())
        ops = profile_update.trace_ops(step, args.repeats)
    if args.hlo:
        args.hlo.write_text(hlo)
    steps = sampling.max_new_tokens
    in_loop = loop_computations(hlo)
    dots = profile_update.parse_dots(hlo)
    loop_dots = [d for d in dots if d["computation"] in in_loop]
    dot_times = profile_update.time_dots(loop_dots, args.repeats)
    floor_s = floor_cpu_s = 0.0
    for dot in loop_dots:
        key = json.dumps(
            [dot[k] for k in ("lhs", "rhs", "lhs_contracting", "rhs_contracting", "lhs_batch")]
        )
        dot.update(dot_times[key])
        floor_s += steps * dot["seconds"]
        floor_cpu_s += steps * dot["cpu_seconds"]
    kinds = profile_update.instruction_kinds(hlo)
    # Which computation each instruction is in (the loop's or not).
    owner, computation = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and " = " not in line:
            computation = head.group(1)
            continue
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
        if match:
            owner.setdefault(match.group(1), computation)
    op_times = sorted(
        ((n, s) for n, s in ops.items() if n in kinds and not n.startswith("end: ")),
        key=lambda item: -item[1],
    )
    by_kind: dict[str, float] = collections.defaultdict(float)
    by_source: dict[str, float] = collections.defaultdict(float)
    by_part: dict[str, float] = collections.defaultdict(float)
    for name, s in op_times:
        opcode, source = kinds[name]
        looped = owner.get(name) in in_loop
        by_kind[opcode] += s
        by_source[f"{opcode} {source}"] += s
        by_part[part(source, looped)] += s
    traced_s = sum(s for _, s in op_times)
    wall_s = statistics.median(walls)
    result = {
        "geometry": common.GEOMETRY,
        "generate_wall_s": wall_s,
        "generate_cpu_s": statistics.median(cpus),
        "generate_walls": walls,
        "decode_steps": steps,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "hlo_instructions": sum(1 for line in hlo.splitlines() if " = " in line),
        "hlo_fusions": len(re.findall(r" fusion\(", hlo)),
        "loop_dots": loop_dots,
        "decode_matmul_floor_s": floor_s,
        "decode_matmul_floor_cpu_s": floor_cpu_s,
        "traced_ops_s": traced_s,
        "top_ops": [
            {
                "name": n,
                "kind": kinds[n][0],
                "source": kinds[n][1],
                "in_loop": owner.get(n) in in_loop,
                "seconds": s,
            }
            for n, s in op_times[:60]
        ],
        "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "by_source_s": dict(sorted(by_source.items(), key=lambda kv: -kv[1])),
        "by_part_s": dict(sorted(by_part.items(), key=lambda kv: -kv[1])),
        "threads": threads,
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"generate: {wall_s:.3f} s wall, {result['generate_cpu_s']:.3f} s CPU "
        f"(median of {args.repeats}); {steps} decode steps"
    )
    print(
        f"compile: {compile_s:.1f} s (lowering {lower_s:.1f} s); {result['hlo_instructions']} HLO "
        f"instructions, {result['hlo_fusions']} fusions, {len(dots)} dots "
        f"({len(loop_dots)} in the decode loop)"
    )
    print(
        f"the decode loop's matmuls alone, x {steps}: {floor_s:.3f} s wall, {floor_cpu_s:.3f} s CPU"
    )
    print(f"traced ops: {traced_s:.3f} s per call (shares below are of this)")
    for title, table in (("part", "by_part_s"), ("kind", "by_kind_s"), ("source", "by_source_s")):
        print(f"by {title}:")
        for key, s in list(result[table].items())[:25]:
            print(f"  {s:8.3f} s {s / traced_s:6.1%}  {key[:110]}")
    print(
        f"threads: {threads['busiest_thread_share']:.0%} of the timed calls' CPU time on the "
        "busiest thread; busy threads' seconds "
        + ", ".join(f"{t:.2f}" for t in threads["threads_s"])
    )
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
