"""A sampling round's host bookkeeping around its scoring: the texts that ``score_batch``
reads, the response bucket the round is trimmed to, the completions kept for
``samples.jsonl``, and the sampling metrics of an iteration's rounds.

    rollout = generate(...)                                # iteration.sample, one round
    texts = round_texts(tokens, lengths, prompts, ...)     # decoded, one entry per sample
    scores = score_batch(texts.completions, texts.references, lengths, ...)
    rnd = round_from_rollout(rollout, ..., response_width(lengths, config), ...)
    ...
    metrics = sampling_metrics(rounds, merged)             # over every round drawn
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from policyopt.rl.batch import Round, bucket, truncated_rows
from policyopt.rl.reporting.evaluate import decode, task_accuracies
from policyopt.rl.reporting.report import batch_metrics, scoring_metrics


class RoundTexts(NamedTuple):
    """What the verifiers read of a round of B prompts x G samples (R = B * G entries, the
    G samples of prompt b at b*G .. b*G+G-1)."""

    completions: list[str]  # the decoded responses
    prompts: list[str]  # each sample's prompt text (the language bonus reads it)
    references: list[Any]  # each sample's reference (math answer, or code tests)
    tasks: list[str] | None  # each sample's task (mixed math and code prompts), or None
    truncated: np.ndarray  # bool [R]: stopped at max_new_tokens without an end token


class ScoredRound(NamedTuple):
    """One sampling round after scoring: its ``Round`` (host arrays in the training layout)
    and what the iteration's metrics and samples read."""

    round: Round
    texts: RoundTexts
    scores: Any  # score_batch's BatchScores: rewards [R], correct [R], metrics, details
    lengths: np.ndarray  # int [R] response lengths

    def samples(self) -> dict:
        """The round's texts and verdicts (``report.sample_rows``' fields)."""
        return dict(
            prompts=self.texts.prompts,
            completions=self.texts.completions,
            references=self.texts.references,
            rewards=self.scores.rewards,
            correct=self.scores.correct,
            status=getattr(self.scores, "status", None),
            format_ok=getattr(self.scores, "format_ok", None),
        )


def round_texts(
    tokens: np.ndarray, lengths: np.ndarray, prompts: dict, config, tokenizer, end_ids
) -> RoundTexts:
    """The texts of a round's samples, each prompt's repeated for its
    ``config.batch.group_size`` samples.

    Args:
      tokens, lengths: the responses ``[R, N]`` and their lengths ``[R]``, on the host.
      prompts: the prompt batch: ``prompt`` and ``answer`` (B each), and ``task`` (B) when
        math and code prompts are mixed (each sample is then checked by its own task's
        verifier).
      config: the run's config (``batch.group_size``, ``sampling.max_new_tokens``).
      tokenizer: decodes the responses (special tokens dropped).
      end_ids: the tokens that end a response (``SamplingConfig.end_ids``): a response of
        ``max_new_tokens`` tokens whose last is not one of them is ``truncated``.
    """
    group, num_new = config.batch.group_size, config.sampling.max_new_tokens
    repeat = lambda values: [v for v in values for _ in range(group)]
    return RoundTexts(
        completions=decode(tokens, lengths, tokenizer),
        prompts=repeat(prompts["prompt"]),
        references=repeat(prompts["answer"]),
        tasks=repeat(prompts["task"]) if "task" in prompts else None,
        truncated=truncated_rows(tokens, lengths, num_new, end_ids),
    )


def response_width(lengths: np.ndarray, config) -> int:
    """N_b, the response columns a round keeps: the bucket of its longest response
    (``config.batch.response_buckets``), at most ``config.sampling.max_new_tokens``."""
    longest = bucket(int(lengths.max()), config.batch.response_buckets, name="response length")
    return min(longest, config.sampling.max_new_tokens)


def sampling_metrics(rounds: Sequence[ScoredRound], merged: Round) -> dict[str, float]:
    """``reward/*`` and ``response/*`` over every sample of ``rounds`` (dynamic sampling's
    dropped groups included; per task in a mixed batch), ``batch/reward_mean`` and
    ``batch/accuracy`` over the ``merged`` batch's scored samples."""
    lengths = np.concatenate([r.lengths for r in rounds])
    correct = np.concatenate([r.scores.correct for r in rounds])
    truncated = np.concatenate([r.texts.truncated for r in rounds])
    tasks = [task for r in rounds for task in r.texts.tasks or ()]
    return {
        "reward/mean": float(np.mean(np.concatenate([r.scores.rewards for r in rounds]))),
        "reward/accuracy": float(np.mean(correct)),
        **batch_metrics(merged),
        "response/length_mean": float(np.mean(lengths)),
        "response/length_max": float(np.max(lengths)),
        "response/truncated_fraction": float(np.mean(truncated)),
        **scoring_metrics([r.scores.metrics for r in rounds]),
        **task_accuracies(correct, tasks or None, "reward/accuracy"),
    }
