"""The ``reward`` section: how a verdict becomes a reward (`policyopt.rewards.RewardSpec`)."""

from __future__ import annotations

import dataclasses

from policyopt.schema import choice, integer, number, positive, setting


@dataclasses.dataclass(frozen=True)
class Reward:
    """Correct and incorrect values, Magistral's format gate and language bonus, length
    shaping, the verifier and the code sandbox's limits (docs/rewards.md)."""

    format: bool = setting(
        False,
        "Magistral's format reward: format failure 0, format ok `format_value`, correct + "
        "`correct_value`.",
        paper="Magistral 2506.10910 §2.2",
        note="Off: 1.0 for a correct answer, else `incorrect_value`.",
    )
    format_value: float = setting(
        0.1,
        "Reward of a well-formatted response.",
        paper="Magistral 2506.10910 §2.2: 0.1",
        check=number(),
    )
    correct_value: float = setting(
        0.9,
        "Reward added for a correct, well-formatted response.",
        paper="Magistral 2506.10910 §2.2: 0.9",
        check=number(),
    )
    incorrect_value: float = setting(
        0.0,
        "Without the format gate: reward of an incorrect response (correct is 1).",
        paper="DAPO 2503.14476 §2.4, VC-PPO and VAPO use -1",
        note="0: this project's choice.",
        check=number(),
    )
    overlong: str = setting(
        "none",
        'Length shaping: "none", "dapo" (overlong penalty) or "magistral" (-0.1 scale).',
        paper="DAPO 2503.14476; Magistral 2506.10910",
        check=choice("none", "dapo", "magistral"),
    )
    max_len: int | None = setting(
        None,
        "L_max of the length shaping; None: sampling.max_new_tokens.",
        paper="DAPO 2503.14476",
    )
    cache_len: int | None = setting(
        None,
        "L_cache of the length shaping; None: a quarter of max_len.",
        note="The quarter is this project's choice: DAPO's 4096 of 20480 is a fifth; this "
        "project records no Magistral value.",
    )
    overlong_filter: bool = setting(
        False,
        "DAPO's overlong filtering: responses cut at max_new_tokens are masked out of the loss.",
        paper="DAPO 2503.14476",
    )
    language_bonus: float = setting(
        0.0,
        "Added to the reward of a graded response whose problem, reasoning and answer "
        "languages agree (0 = off).",
        paper="Magistral 2506.10910 §2.2: 0.1",
        check=number(0.0),
    )
    num_workers: int = setting(
        0,
        "Worker processes for scoring (0 = in-process; the synthetic task is fast).",
        check=integer(0),
    )
    verifier: str | None = setting(
        None,
        'Your own correctness function in place of the task\'s, "package.module:function"; '
        "None: the task's.",
        note="For rewards and for the evaluation's pass@1, called as function(completion, "
        "reference) -> c in [0, 1] (`RewardSpec.verifier`). The task's: math, or code for "
        '"code_jsonl" and the code rows of "mixed_jsonl", whose reference is then the tests '
        "as JSON text, read by `policyopt.rewards.parse_tests`.",
    )
    verifier_timeout_s: float = setting(
        5.0, "Per-sample time limit of `verifier`, in seconds.", check=positive()
    )
    code_timeout_s: float = setting(
        4.0,
        "Code problems: per-test time limit of the sandbox, in seconds.",
        paper="Magistral 2506.10910: 4 s",
        check=positive(),
    )
    code_memory_mb: int = setting(
        300,
        "Code problems: per-test memory limit of the sandbox, in MB.",
        paper="Magistral 2506.10910: 300 MB",
        check=positive(),
    )
    code_disk_mb: int = setting(
        64,
        "Size (MB) of each test process's working directory, /tmp and /dev/shm.",
        note="tmpfs where the sandbox has a root of its own (memory, on top of code_memory_mb), "
        "else the working directory on disk, watched and killed past it (docs/rewards.md, "
        '"The sandbox").',
        check=positive(),
    )
    code_partial: bool = setting(
        False,
        "Code problems: partial credit, the pass rate (off: all or nothing).",
        paper="Magistral 2506.10910 found all-or-nothing better",
    )
    code_max_tests: int | None = setting(
        None,
        "Run only a problem's first N tests in the training reward; None: all of them.",
        paper="Magistral 2506.10910: 20",
        note="Stdin / stdout cases or top-level asserts. The evaluation runs all.",
        check=positive(optional=True),
    )
    code_isolation: str = setting(
        "process",
        'Where assert tests run: "process" (a process of their own) or "none" (after the '
        "program, in its process).",
        note='"process" sees only plain values from the program\'s (an object equal to '
        "everything, a redefined built-in or a program that finds the harness's marker "
        'cannot pass them); "none" runs one interpreter per test instead of two. The module '
        'docstring of policyopt/rewards/isolation.py lists what "process" changes.',
        check=choice("process", "none"),
    )
    answer_format: str | None = setting(
        None,
        'Where the math answer is: "boxed", "answer_line" or "gsm8k"; None: the task\'s format.',
        note='"boxed": the last \\boxed{}; "answer_line": the last "Answer: ..." line, as '
        'DAPO-Math-17k\'s prompts ask; "gsm8k": the text after the last "####", the form of '
        "GSM8K's solutions, so that SFT on them and the RL reward agree. For the verifier, the "
        "format gate and the evaluation (with `verifier` set, for the format gate only). The "
        "task's format is the one it registered (`policyopt.data.tasks`; the built-in tasks: "
        '"boxed").',
        check=choice(None, "boxed", "answer_line", "gsm8k"),
    )
    deadline_s: float | None = setting(
        None,
        "Wall-clock budget (s) for scoring one round of samples (synchronous) or one group "
        "(async); None: none.",
        note="Samples not scored by then are left out of the loss and of their group's "
        "statistics (mean, std, dynamic sampling's test; advantage 0), and are counted in "
        "`reward/deadline_missed` (`score_batch`'s deadline_s).",
        check=positive(optional=True),
    )

    def validate(self, label: str) -> None:
        module, colon, function = (self.verifier or "").partition(":")
        if self.verifier and not (module.strip() and colon and function.strip()):
            raise ValueError(
                f"{label}.verifier must be 'package.module:function', got {self.verifier!r}"
            )
