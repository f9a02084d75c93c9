"""SFT cold start on the task's worked solutions: the base policy for RL.

    python -m experiments.sft --config configs/sapo.py:task.wrong_procedure_fraction=0.6 \
        --workdir runs/sft --config.sft.steps=300

RL then starts from it with `--config.init_checkpoint=runs/sft/checkpoints`.
Rerunning resumes; `--steps` extends a finished run (continued SFT, the control of RL).
"""

from absl import app, flags
from ml_collections import config_flags

from policyopt.metrics import quiet_library_logging
from policyopt.runtime import keep_freed_host_memory
from policyopt.sharding import initialize_distributed
from policyopt.rl.sft import run_sft

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe file (its sft.*, task.*, model.* fields are used).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; resumed if it holds checkpoints).")
_STEPS = flags.DEFINE_integer("steps", None, "Total SFT updates (default config.sft.steps).")
_INIT = flags.DEFINE_string("init_checkpoint", None, "Continue another SFT run's checkpoint directory.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    initialize_distributed()  # jax.distributed on a multi-host job; no-op on one host
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    summary = run_sft(_CONFIG.value, _WORKDIR.value, steps=_STEPS.value, init_checkpoint=_INIT.value)
    print("final eval:", summary["eval"])


if __name__ == "__main__":
    app.run(main)
