r"""Held-out evaluation of a run's checkpoint: greedy pass@1 and, with `--k`, mean@k and
pass@k at `--temperature`.

    python -m experiments.eval --config configs/sapo.py --workdir runs/sapo
    python -m experiments.eval --workdir runs/ablate/sapo_tau/equal/seed0     # its config.json
    python -m experiments.eval --workdir runs/qs/sft      # an SFT run (experiments.sft)
    python -m experiments.eval --config configs/sapo.py --workdir runs/sapo --step 50 \
        --num_prompts 512 --k 8

`--config` is the run's recipe (as given to `experiments/train.py` or `experiments/sft.py`);
without it, the config the run wrote (`workdir/config.json`: also runs of
`experiments/ablate.py`, whose configs no recipe string rebuilds), or for an SFT run (which
writes none) the config its checkpoint was saved under. The parameters come from
`workdir/checkpoints` (the latest step, or `--step`). Prints the metrics and writes
`workdir/eval_step<N>.json` and every greedy completion with its verdict to
`workdir/eval_step<N>_samples.jsonl`. At the step of a training-time evaluation and with the same
settings it reproduces that evaluation's figures (the same sampling key).
"""

from __future__ import annotations

import json
import os

from absl import flags

from configs import base
from configs.base import load_run_config
from experiments import cli
from policyopt import sharding
from policyopt.checkpoint import Checkpointer
from policyopt.metrics import quiet_library_logging
from policyopt.rl.loop import build
from policyopt.rl.loop.trainer import build_run, evaluate_run, restore
from policyopt.rl.sft import evaluate_policy
from policyopt.rl.update.learner import split_params
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


def _checkpoints(workdir: str) -> str:
    """``workdir/checkpoints``, or a one-line error when there is none (checked before any
    ``Checkpointer`` opens it: opening creates the directory)."""
    checkpoints = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(checkpoints):
        raise FileNotFoundError(
            f"no checkpoint in {checkpoints} (no such directory; --workdir names the directory "
            "of a run of experiments.train or experiments.sft)"
        )
    return checkpoints


def _config_from_record(record: dict, where: str):
    """A config rebuilt from a checkpoint's flat record (``build.config_record``) on
    ``base_config()`` (tuples stay tuples); checked and locked."""
    config = base.base_config()
    for name, value in sorted(record.items()):
        *sections, field = name.split(".")
        node = config
        for section in sections:
            node = node.get(section) if hasattr(node, "get") else None
        if node is None or field not in node:
            raise KeyError(f"{where}: {name!r} is not a config field")
        node[field] = tuple(value) if isinstance(value, list) else value
    base.check(config)
    config.lock()
    return config


def run_config(workdir: str, step: int | None = None):
    """The config of the run in ``workdir`` when no recipe is given: the ``config.json``
    an RL run writes, else (an SFT run writes none) the config its checkpoint at ``step``
    (default: the latest) was saved under."""
    path = os.path.join(workdir, "config.json")
    if os.path.isfile(path):
        return load_run_config(path)
    checkpoints = _checkpoints(workdir)
    with Checkpointer(checkpoints) as source:
        _check_step(source, step, workdir)
        record = source.meta(step).get("config")
    if not record:
        raise ValueError(
            f"{workdir} has no config.json and its checkpoint no config record: pass the "
            "run's recipe with --config"
        )
    return _config_from_record(record, f"the checkpoint in {checkpoints}")


def _check_step(source: Checkpointer, step: int | None, workdir: str) -> None:
    if source.latest_step() is None:
        raise FileNotFoundError(f"no checkpoint in {source.directory}")
    if step is not None and step not in source.all_steps():
        raise ValueError(
            f"no checkpoint at step {step} in {workdir} (steps: {sorted(source.all_steps())})"
        )


def _is_sft_checkpoint(source: Checkpointer, step: int | None) -> bool:
    """An SFT run's checkpoint holds the policy's training state alone; an RL run's also
    its run key (``rng``) and, with a critic, the critic's state."""
    names = source.saved_shapes(step)
    return not any(name == "rng" or name.startswith("rng.") for name in names)


def _evaluate_sft(config, source: Checkpointer, step: int | None, samples) -> dict:
    """Restores an SFT checkpoint's parameters and evaluates them as the SFT run's final
    evaluation does (``policyopt.rl.sft.evaluate_policy``: the same sampling key)."""
    step = source.latest_step() if step is None else step
    mesh = build.make_mesh(config)
    tokenizer = build.make_tokenizer(config)
    model = build.make_model(config, tokenizer.vocab_size, mesh)
    graphdef, params = split_params(model)
    params = sharding.shard_params(params, mesh)
    target = {"train": {"params": params}}
    params = source.restore_subtree(
        ("train", "params"),
        params,
        step,
        check=lambda candidate, _: build.check_checkpoint_shapes(
            source, target, config, step=candidate, field="--workdir"
        ),
    )
    return {
        "step": step,
        **evaluate_policy(config, graphdef, params, tokenizer, mesh, samples=samples),
    }


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
    """Restores ``workdir``'s checkpoint (latest, or ``step``) and evaluates it: an RL
    run's as its training-time evaluation does, an SFT run's as its final one does.

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
    checkpoints = _checkpoints(workdir)  # before building: evaluating writes nothing there
    with Checkpointer(checkpoints) as source:
        _check_step(source, step, workdir)
        if _is_sft_checkpoint(source, step):
            return _evaluate_sft(config, source, step, samples)
    # Evaluation may change any setting, and leaves the run's directory as it is.
    run = build_run(config, workdir, check_config=False, owner=False)
    if step is not None and step != run.run_state.iteration:
        restore(run, step, check_config=False)
    return {"step": run.run_state.iteration, **evaluate_run(run, samples=samples)}


def main(argv):
    del argv
    args = flags.FLAGS
    if args.workdir is None:
        raise cli.UsageError("--workdir is required (the run directory)")
    initialize_distributed()  # jax.distributed on a multi-host job; no-op on one host
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    config = cli.final_config() if cli.config_given() else run_config(args.workdir, args.step)
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
