"""The policyopt side: ``trainer.build_run`` + ``RLRun.step`` of the GRPO recipe at
the shared geometry (``common.GEOMETRY``), as ``experiments/train.py`` runs it.

    python benchmarks/peers/side_policyopt.py --json out.json [--old_log_probs trainer]

The one change to the recipe's run: the sampler draws no end token before the 64th
(``SamplingConfig.min_new_tokens``), so every response has exactly 64 tokens, as on the
other sides. Wall times are the trainer's own (``time/generate_s``, ``time/update_s``,
...); CPU times (``*_cpu_s``) are the process's over ``iteration.generate`` (until the
rollout exists), ``iteration.update_epochs`` and the whole ``RLRun.step``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def config_for(old_log_probs: str):
    from configs import grpo

    g = common.GEOMETRY
    overrides = {
        # moe_7m's shapes without experts: the dense 2.4M-parameter Qwen3.
        "model.preset": "moe_7m",
        "model.num_experts": 0,
        "model.num_layers": g["num_layers"],
        "model.hidden_size": g["hidden_size"],
        "task.num_operands": common.OPERANDS,
        "task.min_digits": common.DIGITS,
        "task.max_digits": common.DIGITS,
        "task.num_train": 2000,
        "task.num_test": 16,
        "batch.n_prompts": g["num_prompts"],
        "batch.group_size": g["group_size"],
        "batch.prompt_buckets": (g["prompt_tokens"],),
        "batch.response_buckets": (g["new_tokens"],),
        "sampling.max_new_tokens": g["new_tokens"],
        "sampling.temperature": g["temperature"],
        # The peers' correctness check (common.reward) through policyopt's own hook for
        # a user's verifier, so that scoring is the same work on every side.
        "reward.verifier": "common:reward",
        "algo.kl_beta": 0.0,
        "algo.clip_low": g["clip_epsilon"],
        "algo.clip_high": g["clip_epsilon"],
        "algo.old_log_probs": old_log_probs,
        "optim.lr": g["lr"],
        "optim.b1": g["b1"],
        "optim.b2": g["b2"],
        "optim.eps": g["eps"],
        "optim.weight_decay": g["weight_decay"],
        "optim.max_grad_norm": g["max_grad_norm"],
        "train.eval_every": 0,
        "train.routing_metrics": False,
        "train.loggers": "jsonl",
    }
    config = grpo.get_config()
    config.unlock()
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        config[section][name] = value
    config.lock()
    return config


def exact_lengths(run):
    """``run``'s sampling config drawing no end token before ``max_new_tokens``: every
    response has that many tokens, as on the other sides."""
    sampling = run.spec.sampling_config
    return dataclasses.replace(sampling, min_new_tokens=sampling.max_new_tokens)


def sampler_run(step: bool = False):
    """``(config, run, sampling)``: the run of ``config_for("sampler")`` (built in a temporary
    directory, removed) and its sampling config at exact lengths; with ``step``, after one
    iteration at those lengths (it compiles everything and keeps ``run.last_batch``)."""
    from policyopt.rl.loop import trainer

    config = config_for("sampler")
    workdir = tempfile.mkdtemp()
    try:
        run = trainer.build_run(config, workdir)
        exact = exact_lengths(run)
        if step:
            run.spec = dataclasses.replace(run.spec, sampling_config=exact)
            run.step()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return config, run, exact


def main() -> None:
    args = common.parse_args()
    start = time.perf_counter()
    import jax

    from policyopt.rl.loop import iteration, trainer
    from policyopt.runtime import keep_freed_host_memory

    keep_freed_host_memory()  # as experiments/train.py does
    compiles = common.JaxCompileLog()
    cpu = common.CpuClock()
    cpu.wrap(iteration, "generate", "generate_cpu_s", block=jax.block_until_ready)
    cpu.wrap(iteration, "update_epochs", "update_cpu_s")
    config = config_for(args.old_log_probs)
    workdir = tempfile.mkdtemp()
    try:
        run = trainer.build_run(config, workdir)
        run.spec = dataclasses.replace(run.spec, sampling_config=exact_lengths(run))
        params = sum(x.size for x in jax.tree.leaves(run.run_state.policy.params))
        setup_s = time.perf_counter() - start
        compiles.mark()  # span 0: the set-up; then one span per iteration
        iterations = []
        for _ in range(args.warmup + args.iterations):
            cpu_start = time.process_time()
            metrics = run.step()
            iteration_cpu_s = time.process_time() - cpu_start
            compiles.mark()
            iterations.append(
                {
                    "iteration_s": metrics["time/iteration_s"],
                    "generate_s": metrics["time/generate_s"],
                    "score_s": metrics["time/score_s"],
                    "update_s": metrics["time/update_s"],
                    "iteration_cpu_s": iteration_cpu_s,
                    "generate_cpu_s": cpu.take("generate_cpu_s"),
                    "update_cpu_s": cpu.take("update_cpu_s"),
                    **(
                        {"old_log_probs_s": metrics["time/old_log_probs_s"]}
                        if "time/old_log_probs_s" in metrics
                        else {}
                    ),
                }
            )
        batch = run.last_round
        checks = {
            "parameters": int(params),
            "rows": int(batch.tokens.shape[0]),
            "prompt_tokens": int(batch.tokens.shape[1] - batch.mask.shape[1]),
            "response_tokens_min": int(batch.mask.sum(axis=1).min()),
            "response_tokens_max": int(batch.mask.sum(axis=1).max()),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    common.write_result(
        args.json,
        "policyopt",
        iterations,
        args.warmup,
        setup_s=setup_s,
        checks=checks,
        versions=common.versions("jax", "jaxlib", "flax", "optax"),
        extra={"old_log_probs": args.old_log_probs, "compilation": compiles.summary()},
    )


if __name__ == "__main__":
    main()
