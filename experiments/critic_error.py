r"""A trained critic's squared error by depth in the response, on fresh rollouts: where it
falls short of a perfect critic (`experiments/value_ceiling.py` gives that one's noise by
the same depth bins; docs/claims.md "critic_warmup").

    python -m experiments.critic_error --run RUN_DIR --rollouts 8

The run (a critic method's finished or stopped run directory) continues from its latest
checkpoint in a temporary copy, as value pretraining: the policy frozen, each rollout's
values read before the critic trains on it (held out), its returns Monte-Carlo
(lambda_critic = 1). The run directory itself is not written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
from absl import app, flags

from experiments.value_ceiling import DEPTH_BINS


def depth_errors(values, returns, mask) -> dict:
    """The squared error ``(R - V)^2`` averaged over the response tokens in each
    ``DEPTH_BINS`` interval of ``t / |y|`` (``t`` the token's index among the row's valid
    tokens), and the explained variance over all of them.

    Args:
      values, returns, mask: ``[R, N]`` arrays (``mask`` 1 on response tokens).

    Returns:
      ``{"tokens", "return_variance", "explained_variance", "error_by_depth":
      {"lo-hi": mean}}`` (a bin without tokens is left out).
    """
    values, returns, mask = (np.asarray(x, np.float64) for x in (values, returns, mask))
    errors = {f"{lo:g}-{hi:g}": [] for lo, hi in zip(DEPTH_BINS, DEPTH_BINS[1:])}
    names = list(errors)
    all_r, all_v = [], []
    for row in range(mask.shape[0]):
        index = np.nonzero(mask[row] > 0)[0]
        for k, t in enumerate(index):
            depth = k / len(index)
            b = min(np.searchsorted(DEPTH_BINS, depth, side="right") - 1, len(names) - 1)
            errors[names[b]].append((returns[row, t] - values[row, t]) ** 2)
        all_r.extend(returns[row, index])
        all_v.extend(values[row, index])
    r, v = np.asarray(all_r), np.asarray(all_v)
    variance = float(np.var(r))
    return {
        "tokens": int(r.size),
        "return_variance": variance,
        "explained_variance": float(1 - np.var(r - v) / variance) if variance > 0 else float("nan"),
        "error_by_depth": {k: float(np.mean(e)) for k, e in errors.items() if e},
    }


def measure(run_dir: str, rollouts: int = 8) -> dict:
    """``depth_errors`` over ``rollouts`` fresh rollouts of the run in ``run_dir`` (its
    latest checkpoint, continued as value pretraining in a temporary copy)."""
    from configs import base  # noqa: PLC0415
    from policyopt.advantages import uses_critic  # noqa: PLC0415
    from policyopt.checkpoint import Checkpointer  # noqa: PLC0415
    from policyopt.rl.loop import trainer  # noqa: PLC0415

    if not os.path.exists(os.path.join(run_dir, "config.json")):
        raise FileNotFoundError(f"--run {run_dir!r} holds no run (no config.json)")
    config = base.load_run_config(os.path.join(run_dir, "config.json"))
    if not uses_critic(config.algo.advantage):
        raise ValueError(
            f"--run {run_dir!r} trains no critic (algo.advantage={config.algo.advantage!r})"
        )
    with tempfile.TemporaryDirectory() as scratch:
        copy = os.path.join(scratch, "run")
        shutil.copytree(os.path.join(run_dir, "checkpoints"), os.path.join(copy, "checkpoints"))
        config.unlock()
        with Checkpointer(os.path.join(copy, "checkpoints")) as saved:
            done = saved.latest_step() or 0
        # Value pretraining from here on: the policy frozen, the critic's values held out.
        config.critic.pretrain_iterations = done + rollouts + 1
        config.train.num_iterations = done + rollouts + 2
        config.eval.num_prompts = 0
        config.lock()
        run = trainer.build_run(config, copy, check_config=False)
        values, returns, masks = [], [], []
        for _ in range(rollouts):
            run.step()
            batch = run.last_batch
            values.append(np.asarray(batch.old_values))
            returns.append(np.asarray(batch.returns))
            masks.append(np.asarray(batch.mask))
    width = max(m.shape[1] for m in masks)

    def padded(arrays):
        return np.concatenate([np.pad(a, ((0, 0), (0, width - a.shape[1]))) for a in arrays])

    result = depth_errors(padded(values), padded(returns), padded(masks))
    return result | {"run": run_dir, "rollouts": rollouts, "from_iteration": done}


def define_flags() -> None:
    flags.DEFINE_string("run", None, "A critic method's run directory.", required=True)
    flags.DEFINE_integer("rollouts", 8, "Fresh rollouts.")
    flags.DEFINE_string("out", None, "Write the result as JSON here.")


def main(argv):
    del argv
    args = flags.FLAGS
    result = measure(args.run, args.rollouts)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    by_depth = " / ".join(f"{v:.3f}" for v in result["error_by_depth"].values())
    print(
        f"critic squared error by depth ({' / '.join(result['error_by_depth'])}): {by_depth}; "
        f"explained variance {result['explained_variance']:.3f} over {result['tokens']} "
        f"tokens (returns' variance {result['return_variance']:.3f})"
    )


if __name__ == "__main__":
    define_flags()
    app.run(main)
