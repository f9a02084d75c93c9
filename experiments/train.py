"""RL training from a recipe config.

    python -m experiments.train --config configs/sapo.py --workdir runs/sapo
    python -m experiments.train --config configs/grpo.py:model=tiny_dense \
        --config.algo.routing_replay=R2 --config.train.num_iterations=50 --workdir runs/grpo_r2

The work directory receives the resolved config (config.json), metrics.jsonl,
TensorBoard events, eval.jsonl and orbax checkpoints; rerunning the same command
resumes from the latest checkpoint. A config with `async_mode.enabled`
(configs/magistral_async.py) trains with asynchronous generation (`run_async_rl`).
"""

from absl import app, flags
from ml_collections import config_flags

from policyopt.metrics import quiet_library_logging
from policyopt.runtime import keep_freed_host_memory
from policyopt.sharding import initialize_distributed
from policyopt.rl.async_rl import async_enabled, run_async_rl
from policyopt.rl.trainer import run_rl

_CONFIG = config_flags.DEFINE_config_file("config", None, "Recipe file, e.g. configs/sapo.py[:variant].")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (created; resumed if it holds checkpoints).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    initialize_distributed()  # jax.distributed on a multi-host job; no-op on one host
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    config = _CONFIG.value
    train = run_async_rl if async_enabled(config) else run_rl  # config.async_mode.enabled
    summary = train(config, _WORKDIR.value)
    print("final eval:", summary["eval"])


if __name__ == "__main__":
    app.run(main)
