"""Tasks by name (``config.task.name``): how a task's records are read, which verifier scores
its samples and the answer format its references are written in.

Built in: ``"arithmetic"`` (``policyopt.data.synthetic``) and the local JSONL files
``"math_jsonl"``, ``"code_jsonl"``, ``"mixed_jsonl"`` (``policyopt.data.jsonl``). A user's
module registers more with ``register_task`` (named in ``config.imports``); the verifier it
names is one of ``policyopt.rewards.verifiers.VERIFIERS``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Sequence

from policyopt.data.jsonl import JsonlConfig, read_math_jsonl
from policyopt.data.synthetic import ArithmeticConfig, generate_arithmetic
from policyopt.registry import Registry, caller

# read(task, split) -> the records of "train" or "test" (a random-access sequence of dicts
# with "prompt", "answer" and, for SFT, "solution"); ``task`` is the config's task section.
ReadFn = Callable[[Any, str], Sequence]
# prepare(task, directory, download) -> a tfds builder holding both splits (task.tfds_dir).
PrepareFn = Callable[[Any, str, bool], Any]


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A registered task.

    Attributes:
      read: ``(task section, split) -> records``.
      verifier: the verifier of its samples (a key of ``policyopt.rewards.verifiers.VERIFIERS``),
        or None when each record names its own in ``record["task"]`` (mixed files).
      answer_format: the answer format its references are written in, the default of
        ``reward.answer_format`` (``policyopt.rewards.math.ANSWER_FORMATS``).
      prepare: writes the task as tfds array_record files (``task.tfds_dir``), or None when
        the task has no tfds form.
      where: ``file:line`` of the registration.
    """

    name: str
    read: ReadFn
    verifier: str | None
    answer_format: str
    prepare: PrepareFn | None
    where: str


TASKS: Registry = Registry("task")


def register_task(
    name: str,
    read: ReadFn,
    *,
    verifier: str | None = "math",
    answer_format: str = "boxed",
    prepare: PrepareFn | None = None,
) -> ReadFn:
    """Registers task ``name``: ``read(task, split)`` gives its records, ``verifier`` names
    the verifier of its samples (None: each record's ``"task"`` field), ``answer_format`` the
    format of its references (the default of ``reward.answer_format``), ``prepare`` its tfds
    form. A name registered twice is an error naming both places."""
    TASKS.add(name, TaskSpec(name, read, verifier, answer_format, prepare, caller()))
    return read


# ---- The synthetic arithmetic task -------------------------------------------------------


def arithmetic_config(task) -> ArithmeticConfig:
    """The synthetic task's knobs (``task.name = "arithmetic"``)."""
    return ArithmeticConfig(
        num_operands=task.num_operands,
        max_operands=task.max_operands,
        min_digits=task.min_digits,
        max_digits=task.max_digits,
        operators=task.operators,
        wrong_procedure_fraction=task.wrong_procedure_fraction,
        min_steps=task.min_steps,
        max_steps=task.max_steps,
    )


@functools.lru_cache(maxsize=8)
def _arithmetic_records(arith: ArithmeticConfig, split: str, seed: int, num: int) -> tuple:
    return tuple(generate_arithmetic(arith, split=split, seed=seed, num_examples=num))


def read_arithmetic(task, split: str) -> Sequence:
    """``task.num_train`` / ``num_test`` synthetic problems from ``task.seed`` (cached)."""
    num = task.num_train if split == "train" else task.num_test
    return _arithmetic_records(arithmetic_config(task), split, int(task.seed), int(num))


def prepare_arithmetic(task, directory: str, download: bool = True):
    from policyopt.data import tfds_builders  # imports tensorflow_datasets: only when used

    return tfds_builders.build_arithmetic(
        directory,
        arithmetic_config(task),
        seed=int(task.seed),
        train_size=int(task.num_train),
        test_size=int(task.num_test),
        download=download,
    )


# ---- Local JSONL files ---------------------------------------------------------------------

# What each JSONL task's rows are (``JsonlConfig.task``).
_JSONL_KINDS = {"math_jsonl": "math", "code_jsonl": "code", "mixed_jsonl": "mixed"}
# The tasks that read `task.train_file` and `task.test_file` (required with them).
FILE_TASKS = tuple(_JSONL_KINDS)


def _names(value) -> tuple[str, ...]:
    """``"question,problem"`` (a config string) or a sequence -> ``("question", "problem")``."""
    parts = value.split(",") if isinstance(value, str) else list(value)
    return tuple(p.strip() for p in parts if p.strip())


def jsonl_reader(task) -> JsonlConfig:
    """How ``task.name = "math_jsonl"``, ``"code_jsonl"`` or ``"mixed_jsonl"`` reads its
    files (``policyopt.data.jsonl``)."""
    return JsonlConfig(
        question_fields=_names(task.question_fields),
        answer_fields=_names(task.answer_fields),
        solution_field=task.solution_field or None,
        extract=task.extract,
        answer_marker=task.answer_marker,
        prompt_template=task.prompt_template,
        skip_malformed=bool(task.skip_malformed),
        task=_JSONL_KINDS.get(task.name, "math"),
        tests_fields=_names(task.tests_fields),
        task_field=(task.task_field or None) if task.name == "mixed_jsonl" else None,
        code_prompt_template=task.code_prompt_template or None,
    )


def jsonl_files(task) -> dict[str, str]:
    """``{"train": task.train_file, "test": task.test_file}``, each checked to be a file."""
    files = {"train": task.train_file, "test": task.test_file}
    for split, path in files.items():
        if not path:
            raise ValueError(f"config.task.{split}_file is required with task.name={task.name!r}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config.task.{split}_file={path!r} is not a file")
    return files


@functools.lru_cache(maxsize=8)
def _jsonl_records(path: str, reader: JsonlConfig, stamp: tuple) -> tuple:
    del stamp  # part of the cache key: the file's size and modification time
    records, _ = read_math_jsonl(path, reader)
    return tuple(records)


def read_jsonl(task, split: str) -> Sequence:
    """Every row of ``task.train_file`` / ``test_file``, read per the ``task`` fields
    (``jsonl_reader``; cached while the file is unchanged). Code problems' ``answer`` is
    their tests as JSON text; mixed files give each record its ``task``."""
    path = jsonl_files(task)[split]
    stat = os.stat(path)
    return _jsonl_records(
        os.path.abspath(path), jsonl_reader(task), (stat.st_size, stat.st_mtime_ns)
    )


def prepare_jsonl(task, directory: str, download: bool = True):
    from policyopt.data import tfds_builders  # imports tensorflow_datasets: only when used

    return tfds_builders.build_math_jsonl(
        directory, jsonl_files(task), jsonl_reader(task), download=download
    )


register_task("arithmetic", read_arithmetic, verifier="math", prepare=prepare_arithmetic)
register_task("math_jsonl", read_jsonl, verifier="math", prepare=prepare_jsonl)
register_task("code_jsonl", read_jsonl, verifier="code", prepare=prepare_jsonl)
register_task("mixed_jsonl", read_jsonl, verifier=None, prepare=prepare_jsonl)
