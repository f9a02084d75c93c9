"""Where the policyopt update's time goes at the peers' geometry (``common.GEOMETRY``).

    python -m benchmarks.peers.profile_update [--repeats 5] [--out PATH] [--hlo PATH]

Builds the run of ``side_policyopt.py``, samples one batch, and on the jitted update
(``Learner.update``: forward, backward, clipping, AdamW and the finite guard, one program):

* the compiled program: its XLA cost analysis (FLOPs, bytes), its size (HLO instructions,
  fusions, dots) and its compile time;
* its wall and CPU time (median of ``--repeats``);
* a ``jax.profiler`` trace of ``--repeats`` updates with XLA:CPU's per-thunk trace events on
  (``--xla_cpu_enable_xprof_traceme``): time per fusion / op, grouped by kind;
* every matmul of the program (each ``dot`` of the optimised HLO, fused or not) run alone
  as a plain ``jax.lax.dot_general`` of the same shapes and dimension numbers, in the same
  run: its achieved GFLOP/s, and the sum of their times, the update's matmul floor at that
  rate.

Run it in the policyopt environment (``.peers-venvs/policyopt`` or the repository's own).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.trace_thunks()  # before jax initialises its CPU client
import side_policyopt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "peers_profile.json"

_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"dot\(%?([\w.\-]+), %?([\w.\-]+)\)(.*)")


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _attr(attrs: str, key: str) -> tuple[int, ...]:
    match = re.search(key + r"=\{([\d,]*)\}", attrs)
    return _dims(match.group(1)) if match else ()


def parse_dots(hlo: str) -> list[dict]:
    """Every ``dot`` of an HLO module's text (fused or not): shapes, dtype, dimension
    numbers, FLOPs, and whether XLA:CPU hands it to a YNNPACK fusion."""
    dots, shapes, fusion_of = [], {}, {}
    computation = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and " = " not in line:
            computation, shapes = head.group(1), {}
            continue
        called = re.search(r"%?([\w.\-]+) = .* fusion\(.*calls=%?([\w.\-]+)", line)
        if called:
            fusion_of[called.group(2)] = called.group(1)
        match = _DEF.match(line)
        if not match:
            continue
        name, dtype, dims = match.groups()
        shapes[name] = (dtype, _dims(dims))
        dot = _DOT.search(line)
        if not dot or " dot(" not in line:
            continue
        lhs_name, rhs_name, attrs = dot.groups()
        (lhs_type, lhs), (_, rhs) = shapes[lhs_name], shapes[rhs_name]
        out = _dims(dims)
        contracting = _attr(attrs, "lhs_contracting_dims")
        flops = 2
        for d in out:
            flops *= d
        for d in contracting:
            flops *= lhs[d]
        dots.append(
            {
                "name": name,
                "computation": computation,
                "lhs": lhs,
                "rhs": rhs,
                "out": out,
                "dtype": lhs_type,
                "lhs_batch": _attr(attrs, "lhs_batch_dims"),
                "rhs_batch": _attr(attrs, "rhs_batch_dims"),
                "lhs_contracting": contracting,
                "rhs_contracting": _attr(attrs, "rhs_contracting_dims"),
                "flops": flops,
            }
        )
    for dot in dots:
        caller = fusion_of.get(dot["computation"], "")
        dot["runs_in"] = caller or dot["name"]
        dot["ynn"] = caller.startswith("ynn_fusion")
    return dots


def time_dots(dots: list[dict], repeats: int) -> dict:
    """Each distinct matmul alone, jitted: median seconds and GFLOP/s."""
    import jax
    import jax.numpy as jnp

    timed = {}
    for dot in dots:
        key = json.dumps(
            [dot[k] for k in ("lhs", "rhs", "lhs_contracting", "rhs_contracting", "lhs_batch")]
        )
        if key in timed:
            continue
        dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}.get(dot["dtype"], jnp.float32)
        lhs = jax.random.normal(jax.random.key(0), dot["lhs"], dtype)
        rhs = jax.random.normal(jax.random.key(1), dot["rhs"], dtype)
        numbers = (
            (dot["lhs_contracting"], dot["rhs_contracting"]),
            (dot["lhs_batch"], dot["rhs_batch"]),
        )
        fn = jax.jit(lambda a, b, n=numbers: jax.lax.dot_general(a, b, n))
        jax.block_until_ready(fn(lhs, rhs))
        times, cpus = [], []
        for _ in range(max(repeats, 5)):
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(lhs, rhs))
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        seconds = statistics.median(times)
        timed[key] = {
            "seconds": seconds,
            "cpu_seconds": statistics.median(cpus),
            "gflops": dot["flops"] / seconds / 1e9,
        }
    return timed


def trace_ops(fn, repeats: int) -> dict[str, float]:
    """Seconds per call of each trace event of ``repeats`` calls of ``fn`` (XLA:CPU's
    thunks, by name), from a ``jax.profiler`` Perfetto trace."""
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        for _ in range(repeats):
            fn()
        jax.profiler.stop_trace()
        path = next(Path(tmp).rglob("perfetto_trace.json.gz"))
        data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    totals: dict[str, float] = collections.defaultdict(float)
    for event in events:
        if event.get("ph") == "X" and "dur" in event:
            totals[event["name"]] += event["dur"] * 1e-6 / repeats
    return dict(totals)


def instruction_kinds(hlo: str) -> dict[str, tuple[str, str]]:
    """Name -> (what it is: ``fusion(kind)`` or the opcode, the JAX operation it comes
    from: the ``op_name`` metadata less the ``jit(...)`` prefix) of every instruction."""
    kinds = {}
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = [^ ]+ (\w[\w\-]*)\(", line)
        if not match:
            continue
        name, opcode = match.groups()
        if opcode == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            opcode = f"fusion({kind.group(1) if kind else '?'})"
        source = re.search(r'op_name="([^"]+)"', line)
        source = re.sub(r"^jit\([^)]*\)/", "", source.group(1)) if source else "?"
        kinds.setdefault(name, (opcode, source))
    return kinds


def phase(source: str) -> str:
    """forward / backward / optimiser, from a JAX op_name (``transpose(jvp(...))`` is the
    backward pass, ``jvp(...)`` the forward)."""
    if "transpose(" in source:
        return "backward"
    if "jvp(" in source:
        return "forward"
    return "optimiser and the rest"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--hlo", type=Path, default=None, help="also write the optimised HLO")
    args = parser.parse_args(argv)

    import jax

    from policyopt.rl.batch import minibatch_indices, shard_batch, take_rows
    from policyopt.runtime import keep_freed_host_memory

    keep_freed_host_memory()
    config, run, _ = side_policyopt.sampler_run(step=True)  # compiles everything
    group = config.batch.group_size
    rows = next(iter(minibatch_indices(run.last_batch.tokens.shape[0] // group, group, 1, None)))
    with jax.set_mesh(run.spec.mesh):
        minibatch = shard_batch(take_rows(run.last_batch, rows))
        update = run.spec.learner.update
        jax.clear_caches()  # compile it again, to time the compilation
        t0 = time.perf_counter()
        lowered = update.lower(run.run_state.policy, minibatch)
        lower_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t0
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        hlo = compiled.as_text()
        state = jax.tree.map(lambda x: x.copy(), run.run_state.policy)

        def step():
            nonlocal state
            state, metrics = compiled(state, minibatch)
            jax.block_until_ready(state)

        step()
        walls, cpus = [], []
        threads_before = common.thread_cpu_seconds()
        for _ in range(args.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        threads = common.thread_split(threads_before, common.thread_cpu_seconds())
        ops = trace_ops(step, args.repeats)
    if args.hlo:
        args.hlo.write_text(hlo)
    dots = parse_dots(hlo)
    dot_times = time_dots(dots, args.repeats)
    matmul_s = matmul_cpu_s = 0.0
    for dot in dots:
        key = json.dumps(
            [dot[k] for k in ("lhs", "rhs", "lhs_contracting", "rhs_contracting", "lhs_batch")]
        )
        dot.update(dot_times[key])
        matmul_s += dot["seconds"]
        matmul_cpu_s += dot["cpu_seconds"]
    dot_flops = sum(d["flops"] for d in dots)
    update_s = statistics.median(walls)
    kinds = instruction_kinds(hlo)
    skip = ("Thunk", "Pjrt", "PjRt", "Buffer", "Threadpool", "Pjit", "Python", "$", "Handle")
    op_times = sorted(
        ((n, s) for n, s in ops.items() if n in kinds and not n.startswith("end: ")),
        key=lambda item: -item[1],
    )
    by_kind: dict[str, float] = collections.defaultdict(float)
    by_source: dict[str, float] = collections.defaultdict(float)
    by_phase: dict[str, float] = collections.defaultdict(float)
    for name, s in op_times:
        opcode, source = kinds[name]
        by_kind[opcode] += s
        by_source[f"{opcode} {source}"] += s
        by_phase[phase(source)] += s
    traced_s = sum(s for _, s in op_times)
    result = {
        "geometry": common.GEOMETRY,
        "update_wall_s": update_s,
        "update_cpu_s": statistics.median(cpus),
        "update_walls": walls,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "cost_analysis": {k: float(v) for k, v in cost.items() if isinstance(v, (int, float))},
        "hlo_instructions": sum(1 for line in hlo.splitlines() if " = " in line),
        "hlo_fusions": len(re.findall(r" fusion\(", hlo)),
        "hlo_chars": len(hlo),
        "dots": dots,
        "dot_flops": dot_flops,
        "matmul_floor_s": matmul_s,
        "matmul_floor_cpu_s": matmul_cpu_s,
        "update_gflops": dot_flops / update_s / 1e9,
        "traced_ops_s": traced_s,
        "top_ops": [
            {"name": n, "kind": kinds[n][0], "source": kinds[n][1], "seconds": s}
            for n, s in op_times[:60]
        ],
        "other_events_s": {n: s for n, s in ops.items() if n.startswith(skip) and s > 1e-3},
        "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "by_source_s": dict(sorted(by_source.items(), key=lambda kv: -kv[1])),
        "by_phase_s": dict(sorted(by_phase.items(), key=lambda kv: -kv[1])),
        "threads": threads,
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"update: {update_s:.3f} s wall, {result['update_cpu_s']:.3f} s CPU "
        f"(median of {args.repeats})"
    )
    print(
        f"compile: {compile_s:.1f} s (lowering {lower_s:.1f} s); {result['hlo_instructions']} HLO "
        f"instructions, {result['hlo_fusions']} fusions, {len(dots)} dots"
    )
    print(
        f"cost analysis: {result['cost_analysis'].get('flops', 0) / 1e9:.2f} GFLOP, "
        f"{result['cost_analysis'].get('bytes accessed', 0) / 1e9:.2f} GB accessed"
    )
    print(
        f"dots: {dot_flops / 1e9:.2f} GFLOP; alone as plain matmuls {matmul_s:.3f} s "
        f"({dot_flops / max(matmul_s, 1e-9) / 1e9:.1f} GFLOP/s; CPU {matmul_cpu_s:.3f} s); "
        "the update as a whole "
        f"{result['update_gflops']:.1f} GFLOP/s"
    )
    print(f"traced ops: {traced_s:.3f} s per update (shares below are of this)")
    for title, table in (("phase", "by_phase_s"), ("kind", "by_kind_s"), ("source", "by_source_s")):
        print(f"by {title}:")
        for key, s in list(result[table].items())[:20]:
            print(f"  {s:8.3f} s {s / traced_s:6.1%}  {key[:100]}")
    print(
        f"threads: {threads['busiest_thread_share']:.0%} of the timed calls' CPU time on the "
        "busiest thread; busy threads' seconds "
        + ", ".join(f"{t:.2f}" for t in threads["threads_s"])
    )
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
