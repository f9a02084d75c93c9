r"""VAPO's length-adaptive lambda over a setting's response lengths: the figures that fix the
fixed-lambda controls of the ``vapo_length_adaptive`` claim (docs/claims.md).

The lengths are those of the task's worked solutions in tokens with EOS (what the SFT start
imitates; no model needed). The policy's lambda ``1 - 1 / (alpha |y|)`` (clamped at 0,
``policyopt.advantages.length_adaptive_lambda``) is averaged over the tokens, as the trainer
logs it (``advantages/lambda_policy_token_mean``): a fixed lambda of that value gives the
tokens the same mean lambda. The rescaled alpha puts the paper's lambda at
``reference_length`` tokens (alpha 0.05) at the task's median length.

    python -m experiments.vapo_lambda --setting testbed_long
"""

from __future__ import annotations

import importlib
import json
from typing import Sequence

import numpy as np
from absl import app, flags

from policyopt.advantages import length_adaptive_lambda
from policyopt.data.pipeline import as_record
from policyopt.rl.loop import build

#: VAPO's alpha (2504.05118, length-adaptive GAE).
PAPER_ALPHA = 0.05


def lambda_summary(lengths: Sequence[int], alpha: float) -> dict:
    """The length-adaptive lambda over responses of ``lengths`` tokens: its mean over the
    tokens (each response weighted by its length), the share of tokens whose lambda is 0,
    and its value at the median length."""
    lengths = np.asarray(lengths, np.float64)
    if lengths.ndim != 1 or lengths.size == 0 or np.any(lengths < 1):
        raise ValueError(f"lengths must be a non-empty list of lengths >= 1, got {lengths!r}")
    lam = np.asarray(length_adaptive_lambda(lengths.astype(np.float32), alpha), np.float64)
    median = float(np.median(lengths))
    return {
        "alpha": alpha,
        "lambda_token_mean": float(np.sum(lam * lengths) / np.sum(lengths)),
        "lambda_zero_token_frac": float(np.sum(lengths[lam == 0]) / np.sum(lengths)),
        "lambda_at_median": float(
            np.asarray(length_adaptive_lambda(np.float32([median]), alpha))[0]
        ),
    }


def rescaled_alpha(median_length: float, reference_length: float = 500.0) -> float:
    """The alpha at which ``median_length`` gets the lambda the paper's alpha gives
    ``reference_length`` tokens: ``alpha |y|`` is what the lambda depends on."""
    if not median_length > 0 or not reference_length > 0:
        raise ValueError(f"lengths must be > 0, got {median_length} and {reference_length}")
    return PAPER_ALPHA * reference_length / median_length


def setting_lengths(setting: str, split: str = "train") -> np.ndarray:
    """The response lengths (tokens with EOS) of ``configs/<setting>.py``'s worked solutions."""
    config = importlib.import_module(f"configs.{setting}").get_config()
    tokenizer = build.make_tokenizer(config)
    return np.array(
        [
            len(tokenizer.encode_response(as_record(r)["solution"]))
            for r in build.task_source(config, split)
        ]
    )


def measure(setting: str, split: str = "train", reference_length: float = 500.0) -> dict:
    """Length quantiles and ``lambda_summary`` at the paper's alpha and the rescaled one."""
    lengths = setting_lengths(setting, split)
    median = float(np.median(lengths))
    alpha = round(rescaled_alpha(median, reference_length), 3)
    return {
        "setting": setting,
        "split": split,
        "responses": int(lengths.size),
        "length_min_median_mean_max": [
            int(lengths.min()),
            median,
            round(float(lengths.mean()), 1),
            int(lengths.max()),
        ],
        "reference_length": reference_length,
        "paper": lambda_summary(lengths, PAPER_ALPHA),
        "rescaled": lambda_summary(lengths, alpha),
    }


def main(argv):
    del argv
    result = measure(flags.FLAGS.setting, flags.FLAGS.split, flags.FLAGS.reference_length)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    flags.DEFINE_string("setting", "testbed_long", "configs/<setting>.py whose task is read.")
    flags.DEFINE_string("split", "train", "The task's split.")
    flags.DEFINE_float(
        "reference_length", 500.0, "The paper's response length matched at the task's median."
    )
    app.run(main)
