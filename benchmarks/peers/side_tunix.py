"""The tunix side: tunix's ``GRPOLearner`` on its own Qwen3 (``tunix.models.qwen3``) at the
shared geometry (``common.GEOMETRY``), the "vanilla" rollout engine, one CPU device.

    python benchmarks/peers/side_tunix.py --json out.json

One optimiser step per batch (``num_iterations=1``, mini-batch = batch): tunix then takes
pi_old as the detached log-probs of the update's own forward, with no separate pass, the
work of policyopt's ``algo.old_log_probs=sampler``. The rollout stops only at an end token
that the vocabulary does not hold, so every response has exactly 64 tokens. Actor and
rollout share one model (no weight copy). Times per global step: ``generate_s``
(``RLCluster.generate``), ``score_s`` (the reward functions), ``update_s``
(``RLCluster.update_actor``, until the new parameters are computed), ``iteration_s`` (the
global step, ``_run_global_step``), each also as the process's CPU time (``*_cpu_s``).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    args = common.parse_args()
    start = time.perf_counter()
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    g = common.GEOMETRY
    steps = args.warmup + args.iterations
    # tunix's models annotate logical axes for Auto (not Explicit) mesh axes.
    mesh = jax.make_mesh(
        (1, 1),
        ("fsdp", "tp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
        devices=jax.devices()[:1],
    )
    config = qwen3.ModelConfig(
        num_layers=g["num_layers"],
        vocab_size=g["vocab_size"],
        embed_dim=g["hidden_size"],
        hidden_dim=g["intermediate_size"],
        num_heads=g["num_heads"],
        head_dim=g["head_dim"],
        num_kv_heads=g["num_kv_heads"],
        rope_theta=int(g["rope_theta"]),
        norm_eps=g["rms_norm_eps"],
        use_tied_embedding=False,
    )
    model = qwen3.Qwen3(config, rngs=nnx.Rngs(0))  # RLCluster places it on the mesh
    tokenizer = common.hf_tokenizer()
    optimizer = optax.chain(
        optax.clip_by_global_norm(g["max_grad_norm"]),
        optax.adamw(g["lr"], b1=g["b1"], b2=g["b2"], eps=g["eps"], weight_decay=g["weight_decay"]),
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={
            rl_cluster_lib.Role.ACTOR: mesh,
            rl_cluster_lib.Role.REFERENCE: mesh,
            rl_cluster_lib.Role.ROLLOUT: mesh,
        },
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer,
            eval_every_n_steps=10**9,
            max_steps=steps,
            mini_batch_size=g["num_prompts"],
            train_micro_batch_size=g["num_prompts"],
            checkpoint_root_directory=None,
            metrics_logging_options=None,
            pbar_description=None,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=g["new_tokens"],
            max_prompt_length=g["prompt_tokens"],
            kv_cache_size=g["prompt_tokens"] + g["new_tokens"] + 1,
            temperature=g["temperature"],
            top_p=1.0,
            top_k=None,
            # An id outside the vocabulary: never drawn, so all 64 tokens are generated.
            eos_tokens=[g["vocab_size"]],
        ),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=None, tokenizer=tokenizer, cluster_config=cluster_config
    )
    algo = grpo_learner.GRPOConfig(
        num_generations=g["group_size"],
        num_iterations=1,
        beta=0.0,
        epsilon=g["clip_epsilon"],
        loss_agg_mode="sequence-mean-token-mean",
    )

    def correct(prompts, completions, answer, **kwargs):
        del prompts, kwargs
        return [common.reward(c, a) for c, a in zip(completions, answer)]

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[correct])

    # (wall, process CPU) seconds of each call.
    marks = {"generate": [], "score": [], "update": [], "step": []}
    seen = {}

    def timed(owner, name, key, block=None):
        original = getattr(owner, name)

        def wrapper(*a, **k):
            t0, c0 = time.perf_counter(), time.process_time()
            out = original(*a, **k)
            if block is not None:
                jax.block_until_ready(block(out))
            marks[key].append((time.perf_counter() - t0, time.process_time() - c0))
            return out

        setattr(owner, name, wrapper)

    def generated(out):
        lengths = [len(t) for t in out.tokens]
        seen.update(
            rows=len(out.tokens),
            prompt_tokens=int(np.asarray(out.left_padded_prompt_tokens).shape[1]),
            response_tokens_min=min(lengths),
            response_tokens_max=max(lengths),
        )
        return out.tokens

    timed(cluster, "generate", "generate", generated)
    timed(learner, "_compute_rewards", "score")
    timed(cluster, "update_actor", "update", lambda _: nnx.state(cluster.actor_trainer.model))
    timed(learner, "_run_global_step", "step")
    compiles = common.JaxCompileLog()
    step = learner._run_global_step

    def marked(*a, **k):
        out = step(*a, **k)
        compiles.mark()
        return out

    learner._run_global_step = marked
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    rows = common.prompts(g["num_prompts"] * steps, seed=0)
    data = [
        {
            # Arrays, as a batching data loader gives them (tunix repeats them G times).
            "prompts": np.array([r["prompt"] for r in rows[i : i + g["num_prompts"]]]),
            "answer": np.array([r["answer"] for r in rows[i : i + g["num_prompts"]]]),
        }
        for i in range(0, len(rows), g["num_prompts"])
    ]
    setup_s = time.perf_counter() - start
    compiles.mark()  # span 0: the set-up; then one span per global step
    learner.train(data)  # RLCluster enters each role's mesh itself
    iterations = [
        {
            f"{phase}{suffix}": times[clock]
            for phase, times in zip(("iteration", "generate", "score", "update"), phases)
            for clock, suffix in ((0, "_s"), (1, "_cpu_s"))
        }
        for phases in zip(marks["step"], marks["generate"], marks["score"], marks["update"])
    ]
    if len(iterations) != steps:
        raise RuntimeError(f"expected {steps} global steps, timed {len(iterations)}")
    common.write_result(
        args.json,
        "tunix",
        iterations,
        args.warmup,
        setup_s=setup_s,
        checks={"parameters": int(params), **seen},
        versions=common.versions("google-tunix", "jax", "jaxlib", "flax", "optax"),
        extra={
            "old_log_probs": "sampler (tunix: num_iterations=1, no separate pass)",
            "compilation": compiles.summary(),
        },
    )


if __name__ == "__main__":
    main()
