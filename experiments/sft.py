r"""SFT cold start on the task's worked solutions: the base policy for RL.

    python -m experiments.sft --config configs/sapo.py:task.wrong_procedure_fraction=0.6 \
        --workdir runs/sft --config.sft.steps=300

RL then starts from it with `--config.init_checkpoint=runs/sft/checkpoints`.
Rerunning resumes; `--steps` extends a finished run (continued SFT, the control of RL).
The config is checked before anything is built (`--print_config` lists every field);
Ctrl-C or SIGTERM stops after the current update with a checkpoint.
"""

import sys

from absl import flags

from experiments import cli
from policyopt.metrics import quiet_library_logging
from policyopt.runtime import keep_freed_host_memory
from policyopt.sharding import initialize_distributed

cli.define_config_flag("Recipe file (its sft.*, task.*, model.* fields are used).", dry_run=False)
_WORKDIR = cli.define_workdir_flag()
_STEPS = flags.DEFINE_integer("steps", None, "Total SFT updates (default config.sft.steps).")
_INIT = flags.DEFINE_string(
    "init_checkpoint", None, "Continue another SFT run's checkpoint directory."
)
flags.adopt_module_key_flags(cli)


def main(argv):
    del argv
    config = cli.final_config()
    workdir = cli.required_workdir(_WORKDIR)
    if _STEPS.value is not None and _STEPS.value < 0:
        raise cli.UsageError(f"--steps must be >= 0, got {_STEPS.value}")
    initialize_distributed()  # jax.distributed on a multi-host job; no-op on one host
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    from policyopt.rl.sft import run_sft  # noqa: PLC0415 - after the config is checked

    summary = run_sft(
        config,
        workdir,
        steps=_STEPS.value,
        init_checkpoint=_INIT.value,
        recipe=cli.config_source(),
    )
    if summary.get("interrupted"):
        sys.exit(cli.interrupted_status(summary["interrupted"]))
    print("final eval:", summary["eval"])


if __name__ == "__main__":
    cli.run(main)
