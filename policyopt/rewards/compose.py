"""The reward arithmetic: what the verifiers said about N samples, and their lengths, as
the rewards the trainers learn from. Pure NumPy; no verifier, pool or deadline here
(``policyopt.rewards.scoring.score_batch`` runs those, then calls :func:`compose_rewards`).

Reward of one sample (Magistral, arXiv 2506.10910, section 2.2.1; DAPO, arXiv 2503.14476,
eq. 13), with c in [0, 1] its correctness (math: 0/1; code: 0/1, or the pass rate with
``code_partial``; a custom ``verifier``: what it returns) and R_len the overlong penalty
(``policyopt.rewards.length``: 0 up to L_max - L_cache, a ramp down to -scale at L_max):

    format gate on:   r = 0                                   if the format check fails
                      r = format_value + correct_value * c    otherwise
                          + R_len(|y|) + language_bonus * [languages agree]
    format gate off:  r = incorrect_value + (plain_correct_value - incorrect_value) * c
                          + R_len(|y|) + language_bonus * [languages agree]

Magistral: format_value 0.1, correct_value 0.9, overlong "magistral" (scale 0.1),
language_bonus 0.1. DAPO: format gate off, correct 1 / incorrect -1, overlong "dapo"
(scale 1), overlong filtering on.

A sample is *graded* when it has a verdict (``scored``) and, with the gate on, passed the
format check; only graded samples receive R_len and the language bonus, and only they can
be ``correct`` (c = 1). A sample without a verdict (missed deadline, lost to a crashed
worker) gets the reward of a failed sample: 0 with the gate, ``incorrect_value`` without
(0 would rank it above DAPO's wrong answers in its group). The loss mask drops samples
without a verdict and, with ``overlong_filter`` (DAPO section 3.4), samples truncated at
the generation limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from policyopt.rewards import length as length_lib


class Verdicts(NamedTuple):
    """What the verifiers said about N samples.

    Attributes:
      correctness: float [N], c in [0, 1] (0 where the format gate failed).
      format_ok: bool [N], passed the format check.
      language_ok: bool [N], problem, reasoning and answer languages agree.
      scored: bool [N], the sample has a verdict (False: missed the batch deadline or
        lost to a crashed scoring worker).
    """

    correctness: np.ndarray
    format_ok: np.ndarray
    language_ok: np.ndarray
    scored: np.ndarray


class ComposedRewards(NamedTuple):
    """The rewards of N samples and what they were made of.

    Attributes:
      rewards: float32 [N], r above.
      correct: bool [N], graded and c >= 1.
      length_penalty: float32 [N], the R_len added to the reward (0 where not graded).
      truncated: bool [N], stopped at the generation limit.
      sample_mask: float32 [N], 0 for samples to leave out of the loss.
    """

    rewards: np.ndarray
    correct: np.ndarray
    length_penalty: np.ndarray
    truncated: np.ndarray
    sample_mask: np.ndarray


def compose_rewards(
    verdicts: Verdicts,
    lengths: Sequence[int] | np.ndarray,
    spec,
    *,
    truncated: Sequence[bool] | np.ndarray | None = None,
) -> ComposedRewards:
    """Rewards of N samples from their verdicts and lengths (the module docstring's r).

    Args:
      verdicts: the N samples' ``Verdicts``.
      lengths: int [N], generated tokens |y| (overlong shaping, default truncation).
      spec: the recipe, a ``policyopt.rewards.RewardSpec``; read here: format_reward,
        format_value, correct_value, plain_correct_value, incorrect_value, overlong,
        max_len, cache_len, penalty_scale, overlong_filter, language_bonus.
      truncated: bool [N], "stopped at the generation limit without EOS"; default
        ``lengths >= spec.max_len`` (all False when max_len is None).

    Returns:
      ``ComposedRewards``, every field [N].

    Raises:
      ValueError: an argument with a number of samples other than ``verdicts``'.
    """
    correctness = np.asarray(verdicts.correctness, np.float32).reshape(-1)
    n = correctness.size
    named = dict(
        format_ok=verdicts.format_ok,
        language_ok=verdicts.language_ok,
        scored=verdicts.scored,
        lengths=lengths,
        truncated=truncated,
    )
    for name, values in named.items():
        if values is not None and np.size(values) != n:
            raise ValueError(
                f"compose_rewards: {name} has {np.size(values)} entries, "
                f"verdicts.correctness has {n}"
            )
    format_ok = np.asarray(verdicts.format_ok, bool).reshape(n)
    language_ok = np.asarray(verdicts.language_ok, bool).reshape(n)
    scored = np.asarray(verdicts.scored, bool).reshape(n)
    lengths = np.asarray(lengths, np.int64).reshape(n)

    if spec.overlong != "none":
        penalty = length_lib.overlong_penalties(
            lengths, spec.max_len, spec.cache_len, scale=spec.penalty_scale
        )
    else:
        penalty = np.zeros(n, np.float32)
    if spec.format_reward:
        graded = format_ok & scored
        base = np.where(graded, spec.format_value + spec.correct_value * correctness, 0.0)
    else:
        graded = scored
        plain = (
            spec.incorrect_value + (spec.plain_correct_value - spec.incorrect_value) * correctness
        )
        base = np.where(graded, plain, spec.incorrect_value)
    penalty = np.where(graded, penalty, 0.0).astype(np.float32)
    bonus = np.where(graded & language_ok, spec.language_bonus, 0.0)
    rewards = (base + penalty + bonus).astype(np.float32)
    correct = graded & (correctness >= 1.0)

    if truncated is not None:
        is_truncated = np.asarray(truncated, bool).reshape(n)
    elif spec.max_len is not None:
        is_truncated = length_lib.truncated(lengths, spec.max_len)
    else:
        is_truncated = np.zeros(n, bool)
    dropped = (spec.overlong_filter & is_truncated) | ~scored
    sample_mask = np.where(dropped, 0.0, 1.0).astype(np.float32)
    return ComposedRewards(rewards, correct, penalty, is_truncated, sample_mask)
