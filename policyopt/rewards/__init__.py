"""Verifiable rewards: math and code correctness, format, length and language shaping.

Public API::

    math_correctness(completion, reference, *, timeout_s=5.0, answer_format="boxed") -> float
        # 1.0 / 0.0; the answer: "boxed" (last \\boxed{}), "answer_line" (last "Answer: ...")
        # or "gsm8k" (after the last "####")
    code_correctness(completion, tests, *, timeout_s=4.0, memory_mb=300, partial=False,
                     max_tests=None) -> float
    parse_tests(tests, *, entry_point=None)  # a dataset's tests, as code_correctness runs them
    run_sandboxed(program, *, stdin="", timeout_s=4.0, memory_mb=300, ...) -> SandboxResult
    format_ok(completion, task, answer_format="boxed") -> bool           # Magistral format gate
    overlong_penalty(length, max_len, cache_len, *, scale=1.0) -> float  # DAPO / Magistral
    languages_consistent(problem, reasoning, answer) -> bool             # Magistral language bonus
    RewardSpec(...)                                                      # the reward recipe
        # RewardSpec(verifier="package.module:function") puts your own correctness function
        # (completion, reference) -> c in [0, 1] in place of the math / code verifier
    score_batch(completions, references, lengths, spec, *, prompts=None, num_workers=0,
                deadline_s=None, truncated=None, across_processes=False,
                tasks=None) -> BatchScores  # tasks: per-sample "math" / "code" (mixtures)
        # unpacks as (rewards float32 [N], correct bool [N], metrics); also .sample_mask,
        # .truncated, .format_ok, .correctness, .length_penalty, .language_ok, .status
    compose_rewards(Verdicts(correctness, format_ok, language_ok, scored), lengths, spec,
                    *, truncated=None) -> ComposedRewards
        # score_batch's reward arithmetic on the verifiers' verdicts, in NumPy (rewards,
        # correct, length_penalty, truncated, sample_mask; all [N])

Each function of model output returns a value and never raises on what the model wrote.
"""

from policyopt.rewards.code import CodeResult, code_correctness, run_code_tests
from policyopt.rewards.compose import ComposedRewards, Verdicts, compose_rewards
from policyopt.rewards.format import first_code_block, format_ok, split_think
from policyopt.rewards.language import identify_language, languages_consistent, strip_latex_and_code
from policyopt.rewards.length import overlong_penalties, overlong_penalty, truncated
from policyopt.rewards.math import (
    MathVerdict,
    answer_region,
    extract_answer_line,
    extract_boxed,
    extract_gsm8k,
    math_correctness,
    verify_math,
)
from policyopt.rewards.sandbox import SandboxResult, run_sandboxed
from policyopt.rewards.scoring import (
    BatchScores,
    RewardSpec,
    SampleScore,
    kill_pool,
    score_batch,
    score_sample,
    shutdown_pools,
    start_workers,
)
from policyopt.rewards.testcases import parse_tests
from policyopt.rewards.timelimit import VerifierTimeout, time_limit

__all__ = [
    "BatchScores",
    "CodeResult",
    "ComposedRewards",
    "MathVerdict",
    "RewardSpec",
    "SampleScore",
    "SandboxResult",
    "Verdicts",
    "VerifierTimeout",
    "answer_region",
    "code_correctness",
    "compose_rewards",
    "extract_answer_line",
    "extract_boxed",
    "extract_gsm8k",
    "first_code_block",
    "format_ok",
    "identify_language",
    "languages_consistent",
    "math_correctness",
    "overlong_penalties",
    "overlong_penalty",
    "parse_tests",
    "run_code_tests",
    "run_sandboxed",
    "score_batch",
    "score_sample",
    "kill_pool",
    "shutdown_pools",
    "split_think",
    "start_workers",
    "strip_latex_and_code",
    "time_limit",
    "truncated",
    "verify_math",
]
