"""What glibc's malloc settings cost an RL iteration on the CPU
(``policyopt.runtime.keep_freed_host_memory``): ``benchmarks.bench_rl`` in a process of its
own per setting, the settings interleaved over rounds, the same recipe and seed.

    python -m benchmarks.bench_host_memory [--recipe testbed_long] [--rounds 2] \
        [--iterations 6] [--parallel 2]

Settings: ``system`` (glibc's defaults), ``bounded`` (blocks up to 256 MiB kept: what an
accelerator host gets) and ``every_block`` (what a CPU-only host gets). ``--parallel N``
runs N copies of each setting side by side, as sweeps run on a small machine. The
reference is ``bounded``, measured in the same run. Prints the table (median over rounds
and copies of the median iteration) and writes benchmarks/results/bench_host_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SETTINGS = ("system", "bounded", "every_block")
REFERENCE = "bounded"


def _round(setting: str, args, directory: str, tag: str) -> list[dict]:
    """``args.parallel`` copies of bench_rl under ``setting``, side by side; their JSON."""
    outs = [os.path.join(directory, f"{setting}_{tag}_{i}.json") for i in range(args.parallel)]
    command = [sys.executable, "-m", "benchmarks.bench_rl", "--recipe", args.recipe]
    command += ["--iterations", str(args.iterations), "--malloc", setting]
    if args.config_arg:
        command += ["--config_arg", args.config_arg]
    procs = [
        subprocess.Popen(
            command + ["--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        for out in outs
    ]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"bench_rl --malloc {setting} failed:\n{err.decode()[-2000:]}")
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="testbed_long")
    parser.add_argument("--config_arg", default="")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/bench_host_memory.json")
    args = parser.parse_args()

    load = [os.getloadavg()[0]]
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as directory:
        for r in range(args.rounds):
            order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
            for setting in order:
                print(f"round {r + 1}/{args.rounds}: {setting} x {args.parallel}", flush=True)
                runs[setting] += _round(setting, args, directory, str(r))
                load.append(os.getloadavg()[0])

    def median(setting, pick):
        return statistics.median(pick(run) for run in runs[setting])

    table = {}
    for setting in SETTINGS:
        table[setting] = {
            "iteration_s": median(setting, lambda x: x["median_s"]["time/iteration_s"]),
            "update_s": median(setting, lambda x: x["median_s"]["time/update_s"]),
            "generate_s": median(setting, lambda x: x["median_s"]["time/generate_s"]),
            "minor_faults_per_iteration": median(
                setting, lambda x: x["minor_faults_per_iteration"]
            ),
            "max_rss_mib": max(x["max_rss_mib"] for x in runs[setting]),
            "runs": len(runs[setting]),
        }
    base = table[REFERENCE]["iteration_s"]
    for row in table.values():
        row["speedup_vs_bounded"] = base / row["iteration_s"]

    print(
        f"\nRL iteration, configs/{args.recipe}.py, {args.parallel} process(es) side by side, "
        f"median over {args.rounds} round(s) x {args.parallel} of {args.iterations} iterations"
    )
    header = f"{'malloc':<13}{'s/iter':>8}{'update':>8}{'generate':>9}{'faults/iter':>13}"
    print(header + f"{'peak MiB':>10}{'vs bounded':>12}")
    for setting, row in table.items():
        print(
            f"{setting:<13}{row['iteration_s']:>8.2f}{row['update_s']:>8.2f}"
            f"{row['generate_s']:>9.2f}{row['minor_faults_per_iteration']:>13,.0f}"
            f"{row['max_rss_mib']:>10,.0f}{row['speedup_vs_bounded']:>11.2f}x"
        )
    print(f"load average {min(load):.1f}-{max(load):.1f}")
    result = {
        "recipe": args.recipe,
        "config_arg": args.config_arg,
        "rounds": args.rounds,
        "iterations": args.iterations,
        "parallel": args.parallel,
        "table": table,
        "load_average": [min(load), max(load)],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
