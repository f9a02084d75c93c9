"""The TRL side: ``trl.GRPOTrainer`` on transformers' Qwen3 at the shared geometry
(``common.GEOMETRY``), generation with transformers' ``generate`` (no vLLM), on the CPU.

    python benchmarks/peers/side_trl.py --json out.json

One optimiser step per generation batch (``num_iterations=1``, ``steps_per_generation=1``):
TRL then takes pi_old as the detached log-probs of the update's own forward, with no
separate pass, which is the work of policyopt's ``algo.old_log_probs=sampler``. Times per
step: ``generate_s`` (``_generate_and_score_completions`` less the reward functions),
``score_s`` (the reward functions), ``update_s`` (from there to the end of the optimiser
step: forward, backward, clipping, AdamW), ``iteration_s`` (from one step's end to the
next's; the first from the start of ``train``, with the trainer's set-up), each also as
the process's CPU time (``*_cpu_s``) between the same points.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    args = common.parse_args()
    start = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    g = common.GEOMETRY
    steps = args.warmup + args.iterations
    tokenizer = common.hf_tokenizer()
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=g["vocab_size"],
            hidden_size=g["hidden_size"],
            intermediate_size=g["intermediate_size"],
            num_hidden_layers=g["num_layers"],
            num_attention_heads=g["num_heads"],
            num_key_value_heads=g["num_kv_heads"],
            head_dim=g["head_dim"],
            rope_theta=g["rope_theta"],
            rms_norm_eps=g["rms_norm_eps"],
            tie_word_embeddings=False,
            max_position_embeddings=256,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            torch_dtype="float32",
        )
    ).float()
    rows = common.prompts(g["num_prompts"] * steps, seed=0)
    dataset = Dataset.from_list(
        [{"prompt": "<bos>" + r["prompt"], "answer": r["answer"]} for r in rows]
    )

    def correct(prompts, completions, answer, **kwargs):
        del prompts, kwargs
        return [common.reward(c, a) for c, a in zip(completions, answer)]

    workdir = tempfile.mkdtemp()
    config = GRPOConfig(
        output_dir=workdir,
        per_device_train_batch_size=g["num_prompts"] * g["group_size"],
        gradient_accumulation_steps=1,
        num_generations=g["group_size"],
        max_completion_length=g["new_tokens"],
        generation_kwargs={"min_new_tokens": g["new_tokens"]},
        temperature=g["temperature"],
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=g["clip_epsilon"],
        loss_type="grpo",
        learning_rate=g["lr"],
        adam_beta1=g["b1"],
        adam_beta2=g["b2"],
        adam_epsilon=g["eps"],
        weight_decay=g["weight_decay"],
        max_grad_norm=g["max_grad_norm"],
        lr_scheduler_type="constant",
        max_steps=steps,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )

    # (wall, process CPU) seconds at each point.
    marks = {"generated": [], "scored": [], "step_end": []}

    def now():
        return time.perf_counter(), time.process_time()

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks["step_end"].append(now())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepEnds()],
    )
    generate_and_score = trainer._generate_and_score_completions
    calculate_rewards = trainer._calculate_rewards
    seen = {}

    def timed_rewards(*a, **k):
        t0 = now()
        out = calculate_rewards(*a, **k)
        marks["scored"].append(tuple(b - a for a, b in zip(t0, now())))
        return out

    def timed_generate(batch):
        t0 = now()
        out = generate_and_score(batch)
        marks["generated"].append((t0, now()))
        seen["prompt_tokens"] = int(out["prompt_ids"].shape[1])
        lengths = out["completion_mask"].sum(dim=1)
        seen["response_tokens_min"] = int(lengths.min())
        seen["response_tokens_max"] = int(lengths.max())
        seen["rows"] = int(out["completion_ids"].shape[0])
        return out

    trainer._calculate_rewards = timed_rewards
    trainer._generate_and_score_completions = timed_generate
    params = sum(p.numel() for p in model.parameters())
    setup_s = time.perf_counter() - start
    train_start = now()
    try:
        trainer.train()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    iterations, previous = [], train_start
    for (g0, g1), score, end in zip(marks["generated"], marks["scored"], marks["step_end"]):
        times = {}
        for clock, suffix in ((0, "_s"), (1, "_cpu_s")):
            times.update(
                {
                    "iteration" + suffix: end[clock] - previous[clock],
                    "generate" + suffix: g1[clock] - g0[clock] - score[clock],
                    "score" + suffix: score[clock],
                    "update" + suffix: end[clock] - g1[clock],
                }
            )
        iterations.append(times)
        previous = end
    if len(iterations) != steps:
        raise RuntimeError(f"expected {steps} steps, timed {len(iterations)}")
    common.write_result(
        args.json,
        "trl",
        iterations,
        args.warmup,
        setup_s=setup_s,
        checks={"parameters": int(params), **seen},
        versions=common.versions("trl", "torch", "transformers", "accelerate"),
        extra={
            "old_log_probs": "sampler (TRL: num_iterations=1, no separate pass)",
            "torch_threads": torch.get_num_threads(),
        },
    )


if __name__ == "__main__":
    main()
