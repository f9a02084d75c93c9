"""Time per RL iteration on the CPU, split into generation, scoring, old log-probs and
updates (the demo's geometry: tiny MoE, 16 prompts x 8 samples, 20 new tokens; another
recipe with ``--recipe``, e.g. testbed_long), with the process's minor page faults per
iteration and its peak resident size.

    python -m benchmarks.bench_rl [--iterations 5] [--recipe demo] [--config_arg ...] \
        [--malloc auto|bounded|every_block|system]

Reference measured in the same run: the old-log-prob pass is one forward over the batch,
so updates (forward + backward + AdamW, same rows) should cost about 3x it; generation
is compared with the same forward (decode runs N sequential steps over the same rows).
Writes benchmarks/results/bench_rl.json.
"""

import importlib
import json
import os
import resource
import shutil
import statistics
import tempfile
import time

from absl import app, flags

from policyopt.rl.loop import trainer
from policyopt.runtime import keep_freed_host_memory

_ITERATIONS = flags.DEFINE_integer("iterations", 5, "Measured iterations (after 2 warm-up ones).")
_RECIPE = flags.DEFINE_string("recipe", "demo", "Recipe module in configs/ (demo, testbed_long).")
_ARG = flags.DEFINE_string("config_arg", "", "Variant string for the recipe.")
_OUT = flags.DEFINE_string("out", "benchmarks/results/bench_rl.json", "JSON output.")
_MALLOC = flags.DEFINE_enum(
    "malloc",
    "auto",
    ["auto", "bounded", "every_block", "system"],
    "glibc's malloc: keep_freed_host_memory() as the experiments call it (auto), with "
    "blocks up to 256 MiB kept (bounded), with every block kept (every_block), or "
    "glibc's defaults (system).",
)

PARTS = (
    "time/generate_s",
    "time/score_s",
    "time/old_log_probs_s",
    "time/update_s",
    "time/iteration_s",
)


def main(argv):
    del argv
    if _MALLOC.value != "system":
        every = {"auto": None, "bounded": False, "every_block": True}[_MALLOC.value]
        keep_freed_host_memory(every_block=every)
    recipe = importlib.import_module(f"configs.{_RECIPE.value}")
    config = recipe.get_config(_ARG.value)
    workdir = tempfile.mkdtemp()
    try:
        start = time.perf_counter()
        run = trainer.build_run(config, workdir)
        warm = [run.step() for _ in range(2)]
        warmup_s = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        measured = [run.step() for _ in range(_ITERATIONS.value)]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    median = {k: statistics.median(m[k] for m in measured) for k in PARTS}
    total = median["time/iteration_s"]
    rows = int(config.batch.n_prompts * config.batch.group_size)
    result = {
        "config": f"configs/{_RECIPE.value}.py:{_ARG.value}",
        "rows_per_batch": rows,
        "max_new_tokens": int(config.sampling.max_new_tokens),
        "warmup_s_incl_compile": warmup_s,
        "first_iteration_s": warm[0]["time/iteration_s"],
        "median_s": median,
        "fraction": {k: median[k] / total for k in PARTS[:-1]},
        "ratio_update_to_old_log_probs": median["time/update_s"] / median["time/old_log_probs_s"],
        "ratio_generate_to_old_log_probs": median["time/generate_s"]
        / median["time/old_log_probs_s"],
        "iterations": _ITERATIONS.value,
        "malloc": _MALLOC.value,
        "minor_faults_per_iteration": faults / _ITERATIONS.value,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(
        f"RL iteration on the CPU ({rows} sequences, {config.sampling.max_new_tokens} new tokens), "
        f"median of {_ITERATIONS.value}"
    )
    print(f"{'part':<22}{'seconds':>10}{'share':>8}")
    for k in PARTS:
        share = median[k] / total
        print(f"{k.split('/')[1]:<22}{median[k]:>10.3f}{share:>8.1%}")
    print(
        f"update / old log-probs: {result['ratio_update_to_old_log_probs']:.2f}x "
        "(fwd+bwd+adam vs fwd; ~3x expected)"
    )
    print(f"generate / old log-probs: {result['ratio_generate_to_old_log_probs']:.2f}x")
    print(f"warm-up (build + 2 iterations incl. compilation): {warmup_s:.1f} s")
    print(
        f"malloc {_MALLOC.value}: {result['minor_faults_per_iteration']:,.0f} minor page faults "
        f"per iteration, peak resident {result['max_rss_mib']:,.0f} MiB"
    )
    os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
    with open(_OUT.value, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    app.run(main)
