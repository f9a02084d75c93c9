r"""RL training from a recipe config.

    python -m experiments.train --config configs/sapo.py --workdir runs/sapo
    python -m experiments.train --config configs/grpo.py:model=tiny_dense \
        --config.algo.routing_replay=R2 --config.train.num_iterations=50 --workdir runs/grpo_r2
    python -m experiments.train --config configs/sapo.py --print_config    # every field
    python -m experiments.train --config configs/sapo.py --workdir runs/x --dry_run

The config (recipe, variant and every `--config.X` override) is checked before anything
is built, and the files, data, devices and model before anything is written: a bad value,
file or row ends the run in one line naming it, and no work directory is left. The work
directory receives the resolved config (config.json), metrics.jsonl, TensorBoard events,
eval.jsonl, sampled completions (samples.jsonl, eval_samples.jsonl) and orbax
checkpoints; rerunning the same command resumes from the latest checkpoint. Ctrl-C or
SIGTERM stops at the next iteration with a checkpoint (Ctrl-C twice: at once). A config
with `async_mode.enabled` (configs/magistral_async.py) trains with asynchronous
generation (`run_async_rl`).
"""

import sys

from absl import flags

from experiments import cli
from policyopt.metrics import quiet_library_logging
from policyopt.runtime import keep_freed_host_memory
from policyopt.sharding import initialize_distributed

cli.define_config_flag("Recipe file, e.g. configs/sapo.py[:variant].")
_WORKDIR = cli.define_workdir_flag()
flags.adopt_module_key_flags(cli)


def main(argv):
    del argv
    config = cli.final_config()
    workdir = cli.required_workdir(_WORKDIR)
    initialize_distributed()  # jax.distributed on a multi-host job; no-op on one host
    quiet_library_logging()
    from policyopt.rl.loop.async_rl import async_enabled, run_async_rl  # noqa: PLC0415
    from policyopt.rl.loop.trainer import run_rl  # noqa: PLC0415
    from policyopt.rl.reporting.dry_run import plan_run  # noqa: PLC0415 - after the config is checked

    if cli.dry_run():
        print(plan_run(config, workdir, recipe=cli.config_source()))
        return 0
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    train = run_async_rl if async_enabled(config) else run_rl  # config.async_mode.enabled
    summary = train(config, workdir, recipe=cli.config_source())
    if summary.get("interrupted"):
        sys.exit(cli.interrupted_status(summary["interrupted"]))
    print("final eval:", summary["eval"])
    return 0


if __name__ == "__main__":
    cli.run(main)
