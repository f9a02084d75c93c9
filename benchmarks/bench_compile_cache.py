"""The first iteration of a rerun with the persistent compilation cache, against a cold one.

    python -m benchmarks.bench_compile_cache [--iterations 3] [--more 3] [--repeats 1]

Runs the demo-sized recipe (`configs/demo.py`: tiny MoE, 16 prompts x 8 samples) as a user
does, `python -m experiments.train` in a new process, with an empty cache directory for
`--iterations` iterations (cold: everything compiles), then the same command with
`--more` further iterations in the same run directory (it resumes; the cache holds every
program). Each process prints `first iteration: X s ...`; the ratio warm /
cold is the figure (target <= 0.25, docs/runs.md "Compilation cache"). The machine's load
average is recorded beside each run, since wall times on a shared machine move with it.
Writes benchmarks/results/bench_compile_cache.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_ITERATIONS = flags.DEFINE_integer("iterations", 3, "Iterations of the cold run.")
_MORE = flags.DEFINE_integer("more", 3, "Further iterations of the rerun.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Cold/warm pairs, each in new directories.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/bench_compile_cache.json", "JSON output.")
_FIRST = re.compile(r"first iteration: ([0-9.]+)s")
# The demo recipe with a short evaluation (the figure is the first iteration's).
RECIPE = ("--config", "configs/demo.py", "--config.eval.num_prompts=64")


def _load() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def _train(workdir: str, cache: str, iterations: int) -> dict:
    env = dict(os.environ, POLICYOPT_COMPILATION_CACHE=cache, JAX_PLATFORMS="cpu")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    command = [sys.executable, "-m", "experiments.train", *RECIPE, "--workdir", workdir]
    command.append(f"--config.train.num_iterations={iterations}")
    load, start = _load(), time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    first = _FIRST.search(proc.stdout)
    return {
        "first_iteration_s": float(first.group(1)),
        "process_s": time.perf_counter() - start,
        "load_before": load,
        "load_after": _load(),
    }


def main(argv):
    del argv
    pairs = []
    for repeat in range(_REPEATS.value):
        root = tempfile.mkdtemp(prefix="bench-compile-cache-")
        try:
            workdir, cache = os.path.join(root, "run"), os.path.join(root, "cache")
            cold = _train(workdir, cache, _ITERATIONS.value)
            warm = _train(workdir, cache, _ITERATIONS.value + _MORE.value)
            entries = len(os.listdir(cache))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        ratio = warm["first_iteration_s"] / cold["first_iteration_s"]
        pairs.append({"cold": cold, "warm": warm, "ratio": ratio, "cache_entries": entries})
        print(
            f"pair {repeat + 1}: first iteration cold {cold['first_iteration_s']:.1f}s (load "
            f"{cold['load_before']:.1f}), rerun {warm['first_iteration_s']:.1f}s (load "
            f"{warm['load_before']:.1f}): {ratio:.2f} of cold; {entries} cached programs",
            flush=True,
        )
    os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
    with open(_OUT.value, "w") as f:
        json.dump({"recipe": " ".join(RECIPE), "pairs": pairs}, f, indent=1)
    print(f"wrote {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
