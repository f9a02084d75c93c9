"""The main job (`make demo`): RL with a verifiable reward fixes what more SFT cannot.

1. SFT cold start of the tiny MoE on synthetic addition where 60% of the worked solutions
   forget to carry (`configs/demo.py`); cached once done, per seed: WORKDIR/sft for seed
   0 (the start of `--setting demo` ablations, `configs/ablations.py`), WORKDIR/sft_seed<N>
   for another.
2. SAPO from that checkpoint (WORKDIR/rl).
3. Control: the same number of updates spent on more SFT instead (WORKDIR/control).

Each run directory holds its metrics.jsonl and TensorBoard events (`tensorboard --logdir
WORKDIR`), the RL run also samples.jsonl; `experiments/plot.py --runs WORKDIR/rl,WORKDIR/control`
draws them. Greedy pass@1 on the held-out prompts before RL (X), after RL (Y) and after the control
(Z) is printed at the end, and written to WORKDIR/demo.json:

    control pass@1 (continued SFT, same budget): X -> Z
    eval pass@1: X -> Y

    python -m experiments.demo --workdir runs/demo [--seed 1] [--fresh]
"""

import json
import os
import shutil
import sys
import time

from absl import flags

from configs import demo
from experiments import cli
from policyopt.metrics import quiet_library_logging
from policyopt.rl.loop.trainer import run_rl
from policyopt.rl.sft import run_sft
from policyopt.runtime import keep_freed_host_memory
from policyopt.sharding import initialize_distributed

_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "Where the three runs and demo.json go.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of initialisation, sampling and minibatch order.")
_FRESH = flags.DEFINE_bool("fresh", False, "Start over: delete WORKDIR first (the SFT caches too).")
_RERUN = flags.DEFINE_bool(
    "rerun_rl",
    True,
    "Redo the RL and control runs even if WORKDIR holds them (the SFT cold start is reused).",
)


def _stop_if_interrupted(summary: dict) -> None:
    """A stage stopped by SIGINT / SIGTERM (it saved a checkpoint) ends the demo."""
    if summary.get("interrupted"):
        sys.exit(cli.interrupted_status(summary["interrupted"]))


def main(argv):
    del argv
    initialize_distributed()  # jax.distributed on a multi-host job; no-op on one host
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    workdir = _WORKDIR.value
    if _FRESH.value:
        shutil.rmtree(workdir, ignore_errors=True)
    if _RERUN.value:
        for name in ("rl", "control"):
            shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    variant = f"seed={_SEED.value}"
    config = demo.get_config(variant)
    times = {}

    start = time.perf_counter()
    print("== 1/3 SFT cold start (60% of the solutions forget to carry)", flush=True)
    sft_dir = "sft" if _SEED.value == 0 else f"sft_seed{_SEED.value}"  # one cache per seed
    sft = run_sft(config, os.path.join(workdir, sft_dir), recipe=f"configs/demo.py:{variant} (SFT)")
    _stop_if_interrupted(sft)
    before = sft["eval"]["eval/pass@1"]
    times["sft_s"] = time.perf_counter() - start

    start = time.perf_counter()
    print("== 2/3 RL with SAPO from the SFT policy", flush=True)
    rl_config = demo.get_config(f"{variant},init_checkpoint={sft['checkpoint_dir']}")
    rl = run_rl(rl_config, os.path.join(workdir, "rl"), recipe=f"configs/demo.py:{variant} (SAPO)")
    _stop_if_interrupted(rl)
    after_rl = rl["eval"]["eval/pass@1"]
    updates = int(rl["run"].run_state.policy.step)
    times["rl_s"] = time.perf_counter() - start

    start = time.perf_counter()
    print(f"== 3/3 control: {updates} more SFT updates instead of RL", flush=True)
    control = run_sft(
        config,
        os.path.join(workdir, "control"),
        steps=config.sft.steps + updates,
        init_checkpoint=sft["checkpoint_dir"],
        recipe="configs/demo.py (control: more SFT)",
    )
    _stop_if_interrupted(control)
    after_sft = control["eval"]["eval/pass@1"]
    times["control_s"] = time.perf_counter() - start

    result = {
        "seed": _SEED.value,
        "X": before,
        "Y": after_rl,
        "Z": after_sft,
        "updates": updates,
        "num_prompts": config.eval.num_prompts,
        **times,
    }
    with open(os.path.join(workdir, "demo.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"\nheld-out prompts: {config.eval.num_prompts}, greedy; "
        f"time: SFT {times['sft_s']:.0f}s, RL {times['rl_s']:.0f}s, "
        f"control {times['control_s']:.0f}s"
    )
    print(f"control pass@1 (continued SFT, same budget): {before:.3f} -> {after_sft:.3f}")
    print(f"eval pass@1: {before:.3f} -> {after_rl:.3f}")


if __name__ == "__main__":
    cli.run(main)
