"""Held-out evaluation: pass@1 with greedy decoding, mean@k with sampling.

- ``pass@1``: one greedy completion per prompt, fraction correct.
- ``mean@k``: k sampled completions per prompt (at ``temperature``), fraction correct
  averaged over all of them (the expected accuracy of one sample); ``pass@k`` (at least
  one of the k correct) is reported alongside.

Correctness is the math verifier of ``policyopt.rewards`` on the last ``\\boxed{}``.
Prompts are sent in fixed-size chunks (the last one padded by repeating prompts whose
results are discarded), so evaluation compiles the sampler once per prompt bucket. Under
``jax.set_mesh`` the prompts' rows are split over the mesh (``sharding.shard_rows``).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from policyopt.rewards.scoring import RewardSpec, score_batch
from policyopt.rl.batch import encode_prompts
from policyopt.sampling import Greedy, SamplingConfig, generate_fn, sampling_method
from policyopt.sharding import shard_rows, to_host


def decode(tokens: np.ndarray, lengths: np.ndarray, tokenizer) -> list[str]:
    """Completion texts of ``tokens [R, N]`` cut at ``lengths [R]`` (special tokens dropped)."""
    return [tokenizer.decode([int(t) for t in row[:n]]) for row, n in zip(tokens, lengths)]


def complete(
    graphdef,
    params,
    prompts: Sequence[str],
    tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int,
    prompt_buckets: Sequence[int],
    rng: jax.Array,
    temperature: float = 0.0,
    num_samples: int = 1,
    decode_segments: int = 1,
) -> tuple[list[str], np.ndarray]:
    """Completes every prompt ``num_samples`` times, in chunks of ``batch_size`` prompts.

    Returns:
      ``(completions, lengths)``: ``len(prompts) * num_samples`` texts (prompt by prompt)
      and their token counts.
    """
    method = Greedy() if temperature == 0 else sampling_method(temperature)
    config = SamplingConfig(
        max_new_tokens=max_new_tokens,
        method=method,
        eos_id=tokenizer.eos_id,
        stop_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        num_samples=num_samples,
        decode_segments=decode_segments,
    )
    texts, lengths = [], []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        real = len(chunk)
        chunk += [chunk[0]] * (batch_size - real)
        tokens, prompt_lengths = encode_prompts(chunk, tokenizer, prompt_buckets)
        rollout = generate_fn(
            graphdef,
            params,
            shard_rows(tokens),
            shard_rows(prompt_lengths),
            jax.random.fold_in(rng, start),
            config=config,
        )
        out_tokens, out_lengths = to_host((rollout.tokens, rollout.lengths))
        rows = real * num_samples
        texts += decode(out_tokens[:rows], out_lengths[:rows], tokenizer)
        lengths.append(out_lengths[:rows])
    return texts, np.concatenate(lengths)


def task_accuracies(correct, tasks, name: str) -> dict[str, float]:
    """``{f"{name}_{task}": mean correct of the task's samples}`` for each task of a mixed
    batch (``tasks`` None: nothing)."""
    if tasks is None:
        return {}
    correct, tasks = np.asarray(correct, bool), np.asarray(tasks)
    return {
        f"{name}_{task}": float(correct[tasks == task].mean())
        for task in sorted(set(tasks.tolist()))
    }


def evaluate(
    graphdef,
    params,
    records: Sequence[dict],
    tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int = 256,
    prompt_buckets: Sequence[int] = (16, 32, 64, 128, 256, 512),
    k: int = 0,
    temperature: float = 1.0,
    rng: jax.Array | None = None,
    decode_segments: int = 1,
    spec: RewardSpec | None = None,
    num_workers: int = 0,
    samples: list | None = None,
) -> dict[str, float]:
    """pass@1 (greedy) and, with ``k > 0``, mean@k / pass@k (sampled) on ``records``.

    Args:
      graphdef, params: the policy.
      records: held-out records with ``prompt`` and ``answer``.
      tokenizer: encodes prompts, decodes completions.
      max_new_tokens: generation limit.
      batch_size: prompts per sampler call.
      prompt_buckets: prompt padding buckets.
      k, temperature: mean@k sampling (k = 0 skips it).
      rng: key of the sampled evaluation.
      decode_segments: the sampler's decode loops (``SamplingConfig.decode_segments``).
      spec: how correctness is judged (default: the math verifier, no format gate;
        ``policyopt.rl.loop.build.correctness_spec`` gives the run's, with its custom verifier).
      num_workers: scoring worker processes (``score_batch``; 0: in this process).
      samples: a list that receives, when given, one record per greedy completion
        (``prompt``, ``completion``, ``reference``, ``reward`` = correctness, ``correct``,
        ``status``; the run's ``eval_samples.jsonl``).

    Returns:
      ``{"eval/pass@1", "eval/length_mean", "eval/num_prompts"}`` and, with k,
      ``"eval/mean@k"``, ``"eval/pass@k"``.
    """
    prompts = [r["prompt"] for r in records]
    answers = [r["answer"] for r in records]
    # Mixed math and code records say their task (None: the spec's).
    tasks = [r["task"] for r in records] if records and "task" in records[0] else None
    spec = RewardSpec(task="math", format_reward=False) if spec is None else spec
    rng = jax.random.PRNGKey(0) if rng is None else rng
    batch_size = min(batch_size, len(prompts))
    sample = functools.partial(
        complete,
        graphdef,
        params,
        prompts,
        tokenizer,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        prompt_buckets=prompt_buckets,
        decode_segments=decode_segments,
    )
    texts, lengths = sample(rng=rng)
    scores = score_batch(
        texts, answers, lengths, spec, num_workers=num_workers, across_processes=True, tasks=tasks
    )
    correct = scores.correct
    if samples is not None:
        for i, text in enumerate(texts):
            samples.append(
                {
                    "split": "eval",
                    "prompt": prompts[i],
                    "completion": text,
                    "reference": str(answers[i]),
                    "reward": float(scores.rewards[i]),
                    "correct": bool(correct[i]),
                    "status": str(scores.status[i]),
                }
            )
    metrics = {
        "eval/pass@1": float(np.mean(correct)),
        "eval/length_mean": float(np.mean(lengths)),
        "eval/num_prompts": float(len(prompts)),
    }
    metrics.update(task_accuracies(correct, tasks, "eval/pass@1"))
    if k > 0:
        texts, lengths = sample(
            rng=jax.random.fold_in(rng, 1), temperature=temperature, num_samples=k
        )
        references = [a for a in answers for _ in range(k)]
        _, correct, _ = score_batch(
            texts,
            references,
            lengths,
            spec,
            num_workers=num_workers,
            across_processes=True,
            tasks=None if tasks is None else [t for t in tasks for _ in range(k)],
        )
        correct = np.asarray(correct).reshape(len(prompts), k)
        metrics[f"eval/mean@{k}"] = float(correct.mean())
        metrics[f"eval/pass@{k}"] = float(correct.any(axis=1).mean())
        for task in sorted(set(tasks or ())):  # mixed math and code records
            rows = np.asarray(tasks) == task
            metrics[f"eval/mean@{k}_{task}"] = float(correct[rows].mean())
            metrics[f"eval/pass@{k}_{task}"] = float(correct[rows].any(axis=1).mean())
    return metrics
