"""The ``task`` section: where the prompts and their references come from."""

from __future__ import annotations

import dataclasses

from policyopt.checks import check_prompt_template
from policyopt.schema import choice, integer, setting


def _tasks():
    from policyopt.data.tasks import TASKS

    return TASKS


@dataclasses.dataclass(frozen=True)
class Task:
    """The prompts and references: the synthetic arithmetic task or local JSONL files
    (docs/quickstart.md, docs/rewards.md)."""

    name: str = setting(
        "arithmetic",
        'The task: "arithmetic", "math_jsonl", "code_jsonl", "mixed_jsonl" or a registered one.',
        note='"arithmetic" is the synthetic task of `policyopt.data.synthetic`; "math_jsonl" '
        'local GSM8K / MATH style JSONL files (`policyopt.data.jsonl`); "code_jsonl" local '
        "code problems with tests (MBPP / HumanEval / APPS style), scored by running the "
        "response's first Python block against them in the sandbox of "
        "`policyopt.rewards.code` (the format gate then asks for a fenced block); "
        '"mixed_jsonl" both in the same files (Magistral\'s mixture: a row with one of '
        "`tests_fields` is code, any other math; each sample is checked by its own task's "
        "verifier). The file tasks need a tokenizer for their text: `model.tokenizer` (one "
        "trained on the files, docs/quickstart.md) or a pretrained model's, `model.pretrained`. "
        "A user's module registers more with "
        "`policyopt.data.tasks.register_task` (`imports`).",
        check=choice(source=_tasks, rule="a registered task (policyopt.data.tasks.TASKS)"),
    )
    num_operands: int = setting(2, 'Operands per problem (task "arithmetic").')
    max_operands: int | None = setting(
        None,
        "None, or the most operands: each problem draws its number in [num_operands, "
        "max_operands].",
        note="Responses of varied length; configs/testbed_long.py.",
    )
    min_digits: int = setting(3, 'Fewest digits of an operand (task "arithmetic").')
    max_digits: int = setting(3, 'Most digits of an operand (task "arithmetic").')
    operators: str = setting(
        "+",
        'A subset of "+-*", or "mod" (task "arithmetic").',
        note='"mod": remainders by repeated subtraction (`152mod9=`, one step per '
        "subtraction), whose quotient is uniform in [min_steps, max_steps].",
    )
    min_steps: int = setting(1, 'Fewest subtractions of a "mod" problem.')
    max_steps: int = setting(16, 'Most subtractions of a "mod" problem.')
    wrong_procedure_fraction: float = setting(
        0.0,
        "Share of SFT solutions that follow the wrong procedure (forgotten carry).",
        note="The RL prompts and the held-out split only use the prompt and the reference answer.",
    )
    num_train: int = setting(
        20_000,
        "Training prompts generated; the RL loop cycles through them, reshuffled each epoch.",
        check=integer(1),
    )
    num_test: int = setting(512, "Held-out prompts generated for evaluation.", check=integer(0))
    seed: int = setting(0, "Seed of the task generator (independent of `seed`).")
    train_file: str | None = setting(
        None,
        "JSONL file of the training split (the file tasks; every row used).",
        note="Malformed rows raise with file:line unless `skip_malformed`.",
    )
    test_file: str | None = setting(None, "JSONL file of the held-out split (the file tasks).")
    question_fields: str = setting(
        "question,problem,prompt",
        "The problem is the first of these fields a row holds.",
        note="A list of chat messages gives its last user message. Dotted names reach into "
        'nested objects ("reward_model.ground_truth"), in every field list.',
    )
    answer_fields: str = setting(
        "answer,solution",
        "The reference is extracted from the first of these fields a row holds.",
    )
    solution_field: str | None = setting(
        None,
        'The SFT target\'s field; None: "solution", else "answer" (code: "code").',
        note="Code tasks put it in a ```python fence when it has none.",
    )
    extract: str = setting(
        "auto",
        "How the reference is read from its field.",
        note='"auto" (last \\boxed{}, else the text after `answer_marker`, else the whole '
        'field), "boxed", "marker" or "none".',
        check=choice("auto", "boxed", "marker", "none"),
    )
    answer_marker: str = setting("####", "The marker that `extract` reads the answer after.")
    prompt_template: str = setting(
        "{question}",
        "The prompt, a Python format string with `{question}`.",
        note="Write literal braces twice, `\\\\boxed{{}}`; the tokenizer's chat template goes "
        "on top.",
    )
    skip_malformed: bool = setting(
        False, "Skip malformed rows (logged) instead of raising with file:line."
    )
    tests_fields: str = setting(
        "tests,test_list,test,input_output,public_tests",
        "Code rows: the tests come from the first of these fields a row holds.",
        note="In any encoding `policyopt.rewards.parse_tests` reads (asserts, MBPP's list "
        "of asserts, HumanEval's check() with the row's `entry_point`, stdin / stdout cases, "
        "APPS / CodeContests parallel lists, or JSON text of these; an empty field gives way "
        "to the next). Call-based tests (APPS's fn_name) make a row malformed (see "
        "`skip_malformed`).",
    )
    task_field: str | None = setting(
        None,
        'Task "mixed_jsonl": a field naming each row\'s task; None: a row is code when one '
        "of `tests_fields` holds something.",
        note="For files whose math answers and code tests share a field (verl-style rows: "
        '"ability", with "math" / "coding" values).',
    )
    code_prompt_template: str | None = setting(
        None,
        "The prompt of code rows; None: `prompt_template`.",
        note='"code_jsonl", and the code rows of "mixed_jsonl", which then need not share the '
        "math rows' template.",
    )
    overlong_prompt: str = setting(
        "error",
        "Prompts longer than the largest of batch.prompt_buckets (chat template included).",
        note='"error" (raise, naming the record), "drop", "truncate_left" or "truncate_right" '
        "(keep the text's end / start). Every prompt is tokenised once when the run is "
        'built. Held-out prompts over the limit raise with "error", else are left out of the '
        "evaluation (a truncated problem is not the problem).",
        check=choice("error", "drop", "truncate_left", "truncate_right"),
    )
    tfds_dir: str | None = setting(
        None,
        "A directory to write the task to as tfds array_record files and read it back by "
        "random access; None: in memory.",
        note="`policyopt.data.tfds_builders`, prepared once, named by content.",
    )

    def validate(self, label: str) -> None:
        from policyopt.data.tasks import FILE_TASKS
        from policyopt.rewards.verifiers import VERIFIERS

        task = _tasks()[self.name]
        if task.verifier is not None and task.verifier not in VERIFIERS:
            raise ValueError(
                f"{label}.name={self.name!r}: its verifier {task.verifier!r} ({task.where}) is "
                f"not registered; verifiers: {tuple(VERIFIERS)}"
            )
        if self.name not in FILE_TASKS:
            return
        missing = [
            f"{split}_file" for split in ("train", "test") if not getattr(self, f"{split}_file")
        ]
        if missing:
            raise ValueError(f"{label}.{missing[0]} is required with task.name={self.name!r}")
        for name in ("prompt_template", "code_prompt_template"):
            check_prompt_template(f"{label}.{name}", getattr(self, name))
