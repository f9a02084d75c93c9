r"""Held-out evaluation of a run's checkpoint: greedy pass@1 and, with `--k`, mean@k and
pass@k at `--temperature`.

    python -m experiments.eval --config configs/sapo.py --workdir runs/sapo
    python -m experiments.eval --workdir runs/ablate/sapo_tau/equal/seed0     # its config.json
    python -m experiments.eval --config configs/sapo.py --workdir runs/sapo --step 50 \
        --num_prompts 512 --k 8

`--config` is the run's recipe (as given to `experiments/train.py`); without it, the
config the run wrote (`workdir/config.json`: also runs of `experiments/ablate.py`, whose
configs no recipe string rebuilds). The parameters come from `workdir/checkpoints` (the
latest step, or `--step`). Prints the metrics and writes
`workdir/eval_step<N>.json` and every greedy completion with its verdict to
`workdir/eval_step<N>_samples.jsonl`. At the step of a training-time evaluation and with the same
settings it reproduces that evaluation's figures (the same sampling key).
"""

from __future__ import annotations

import json
import os

from absl import flags

from configs.base import load_run_config
from experiments import cli
from policyopt.metrics import quiet_library_logging
from policyopt.rl.trainer import build_run, evaluate_run, restore
from policyopt.runtime import keep_freed_host_memory
from policyopt.sharding import initialize_distributed, is_primary


def define_flags() -> None:
    """The command line (defined when run as a script: importing ``evaluate_checkpoint``
    defines no flags)."""
    cli.define_config_flag(
        "The run's recipe, e.g. configs/sapo.py[:variant] (default: the run's own config.json).",
        dry_run=False,
    )
    flags.DEFINE_string("workdir", None, "The run directory (holding checkpoints/).")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
    flags.DEFINE_integer(
        "num_prompts", None, "Held-out prompts (default: config.eval.num_prompts)."
    )
    flags.DEFINE_integer(
        "k", None, "Samples per prompt for mean@k / pass@k (default: config.eval.k)."
    )
    flags.DEFINE_float("temperature", None, "Sampling temperature of mean@k.")
    flags.adopt_module_key_flags(cli)


def evaluate_checkpoint(
    config,
    workdir: str,
    *,
    step: int | None = None,
    num_prompts: int | None = None,
    k: int | None = None,
    temperature: float | None = None,
    samples: list | None = None,
) -> dict:
    """Restores ``workdir``'s checkpoint (latest, or ``step``) and evaluates it.

    ``samples``, when given, receives one record per greedy completion (``evaluate``).

    Returns:
      ``{"step", "eval/pass@1", "eval/length_mean", "eval/num_prompts"}`` and, with
      ``k > 0``, ``"eval/mean@k"`` and ``"eval/pass@k"``.
    """
    config = config.copy_and_resolve_references()
    config.unlock()
    for field, value in (("num_prompts", num_prompts), ("k", k), ("temperature", temperature)):
        if value is not None:
            config.eval[field] = value
    config.lock()
    if config.eval.num_prompts < 1:
        raise ValueError(
            "config.eval.num_prompts is 0 (the run did not evaluate): pass num_prompts"
        )
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(checkpoints):  # before building: evaluating writes nothing there
        raise FileNotFoundError(f"no checkpoint in {checkpoints} (no such directory)")
    # Evaluation may change any setting, and leaves the run's directory as it is.
    run = build_run(config, workdir, check_config=False, owner=False)
    if run.checkpointer.latest_step() is None:
        raise FileNotFoundError(f"no checkpoint in {checkpoints}")
    if step is not None and step != run.iteration:
        if step not in run.checkpointer.all_steps():
            raise ValueError(
                f"no checkpoint at step {step} in {workdir} "
                f"(steps: {sorted(run.checkpointer.all_steps())})"
            )
        restore(run, step, check_config=False)
    return {"step": run.iteration, **evaluate_run(run, samples=samples)}


def main(argv):
    del argv
    args = flags.FLAGS
    if args.workdir is None:
        raise cli.UsageError("--workdir is required (the run directory)")
    initialize_distributed()  # jax.distributed on a multi-host job; no-op on one host
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    config = (
        cli.final_config()
        if cli.config_given()
        else load_run_config(os.path.join(args.workdir, "config.json"))
    )
    samples: list[dict] = []
    result = evaluate_checkpoint(
        config,
        args.workdir,
        step=args.step,
        num_prompts=args.num_prompts,
        k=args.k,
        temperature=args.temperature,
        samples=samples,
    )
    if not is_primary():  # every process evaluated; process 0 writes
        return
    path = os.path.join(args.workdir, f"eval_step{result['step']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    samples_path = os.path.join(args.workdir, f"eval_step{result['step']}_samples.jsonl")
    with open(samples_path, "w", encoding="utf-8") as f:
        for row in samples:
            f.write(json.dumps({"step": result["step"], **row}, ensure_ascii=False) + "\n")
    print(json.dumps(result, indent=1))
    print(f"wrote {path} and {samples_path} (every greedy completion)")


if __name__ == "__main__":
    define_flags()
    cli.run(main)
