"""Reward recipes (:class:`RewardSpec`) and batch scoring (:func:`score_batch`), serially
or in a pool of worker processes.

The verifiers judge each sample (format, correctness c in [0, 1], language); the reward
arithmetic on their verdicts (Magistral, arXiv 2506.10910; DAPO, arXiv 2503.14476) is
:func:`policyopt.rewards.compose.compose_rewards`. The pool (processes forked from the
library's verifier server, :mod:`policyopt.rewards.worker`), the batch deadline and what a
missed or lost sample gets: ``docs/rewards.md``, "Batch scoring".
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import importlib
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from policyopt.rewards import custom as custom_lib
from policyopt.rewards import format as format_lib
from policyopt.rewards import language as language_lib
from policyopt.rewards import length as length_lib
from policyopt.rewards import math as math_lib
from policyopt.rewards import worker as worker_lib
from policyopt.rewards.compose import Verdicts, compose_rewards
from policyopt.rewards.verifiers import VERIFIERS

# The parent waits this long past the deadline for chunks that workers are finishing.
_DEADLINE_GRACE_S = 0.5
# Chunks per worker: small enough to balance load, large enough to amortise IPC.
_CHUNKS_PER_WORKER = 4


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """How a completion's reward is composed (the formula: ``policyopt.rewards.compose``).

    Attributes:
      task: the verifier (``policyopt.rewards.verifiers.VERIFIERS``): "math" (last
        ``\\boxed{}`` vs the reference), "code" (first fenced block run against the reference
        tests), or one a user's module registered (``register_verifier``).
      format_reward: apply Magistral's format gate (fail: reward 0, grading stops).
      format_value: reward of a well-formatted response (Magistral: 0.1).
      correct_value: added for a correct, well-formatted response (Magistral: 0.9).
      plain_correct_value: reward of a correct response when the format gate is off.
      incorrect_value: reward of an incorrect response when the format gate is off
        (DAPO's rule-based reward uses -1).
      overlong: "none", "dapo" (penalty down to -1) or "magistral" (down to -0.1).
      max_len: L_max, in tokens (needed by overlong shaping and overlong filtering).
      cache_len: L_cache, the length of the penalty ramp, in tokens.
      overlong_scale: override of the penalty scale (None: 1.0 for dapo, 0.1 for magistral).
      overlong_filter: mask samples truncated at max_len out of the loss (DAPO).
      language_bonus: added when problem, reasoning and answer languages agree
        (Magistral: 0.1; 0 disables language identification).
      language_min_letters: segments with fewer letters are "undetermined".
      math_timeout_s: per-sample limit of the math verifier.
      code_timeout_s: per-test wall-clock limit of the code sandbox (Magistral: 4 s).
      code_memory_mb: per-test memory limit (Magistral: 300 MB): each process's address
        space, and all the test's processes together where control groups can be made.
      code_disk_mb: per-test size of the sandbox's working directory (and ``/tmp``), MB.
      code_partial: reward the pass rate instead of all-or-nothing (Magistral: off).
      code_max_tests: run only a problem's first this many tests (Magistral: 20): stdin /
        stdout cases, or top-level asserts (asserts inside a function, as in HumanEval's
        ``check``, are not counted); None: all of them.
      code_isolation: where assert tests run (``policyopt.rewards.code.run_code_tests``):
        ``"process"``, in a process of their own that sees only plain values from the
        program's (``policyopt.rewards.sandbox.isolation``; closes the reward hacks one process
        cannot), or ``"none"``, after the program in its process (half the interpreters).
      verifier: a correctness function of your own in place of the task's verifier, as
        ``"package.module:function"`` (importable by the scoring workers too):
        ``function(completion: str, reference) -> float | bool``, the correctness c in
        [0, 1] of the whole completion (``<think>`` part included; see
        ``policyopt.rewards.extract_boxed`` / ``answer_region``). The format gate (the
        task's rule), length shaping and language bonus apply as with the built-in
        verifiers. It runs in the scoring thread's verifier process
        (``policyopt.rewards.custom``) under ``verifier_timeout_s``: past it, a timeout
        (c = 0), the process killed if it blocks in C. An exception (``SystemExit`` and
        ``KeyboardInterrupt`` included), the process's death or a value outside [0, 1]
        scores c = 0 (the format check and shaping still count) with status
        "verifier_error", counted in ``metrics["verifier_errors"]`` and logged once per
        process. A path the scoring workers cannot import raises from ``score_batch``.
      imports: modules to import before scoring, in the scoring workers too (a run's
        ``config.imports``: where ``task``'s verifier may be registered).
      verifier_timeout_s: per-sample limit of ``verifier``.
      answer_format: math: where the answer is, ``"boxed"`` (the last ``\\boxed{}``),
        ``"answer_line"`` (the last ``Answer: ...`` line, DAPO-Math-17k's format) or
        ``"gsm8k"`` (the text after the last ``####``), for
        the verifier and the format gate; with ``verifier`` set, only for the gate.
    """

    task: str = "math"
    format_reward: bool = True
    format_value: float = 0.1
    correct_value: float = 0.9
    plain_correct_value: float = 1.0
    incorrect_value: float = 0.0
    overlong: str = "none"
    max_len: int | None = None
    cache_len: int | None = None
    overlong_scale: float | None = None
    overlong_filter: bool = False
    language_bonus: float = 0.0
    language_min_letters: int = language_lib.DEFAULT_MIN_LETTERS
    math_timeout_s: float = math_lib.DEFAULT_TIMEOUT_S
    code_timeout_s: float = 4.0
    code_memory_mb: int = 300
    code_disk_mb: int = 64
    code_partial: bool = False
    code_max_tests: int | None = None
    code_isolation: str = "process"
    verifier: str | None = None
    verifier_timeout_s: float = 5.0
    answer_format: str = "boxed"
    imports: tuple[str, ...] = ()

    def __post_init__(self):
        _import_modules(self.imports)
        if self.task not in VERIFIERS:
            raise ValueError(
                f"RewardSpec.task must be one of {tuple(VERIFIERS)}, got {self.task!r}"
            )
        if self.answer_format not in math_lib.ANSWER_FORMATS:
            raise ValueError(
                f"RewardSpec.answer_format must be one of {math_lib.ANSWER_FORMATS}, "
                f"got {self.answer_format!r}"
            )
        if self.overlong not in length_lib.OVERLONG_MODES:
            raise ValueError(
                f"RewardSpec.overlong must be one of {length_lib.OVERLONG_MODES}, "
                f"got {self.overlong!r}"
            )
        if self.overlong != "none":
            if self.max_len is None or self.cache_len is None:
                raise ValueError(
                    f"RewardSpec.overlong={self.overlong!r} needs max_len and cache_len, got "
                    f"max_len={self.max_len}, cache_len={self.cache_len}"
                )
            if not 0 < self.cache_len <= self.max_len:
                raise ValueError(
                    f"RewardSpec.cache_len must be in (0, max_len={self.max_len}], "
                    f"got {self.cache_len}"
                )
        if self.overlong_filter and self.max_len is None:
            raise ValueError("RewardSpec.overlong_filter=True needs max_len (the generation limit)")
        if self.math_timeout_s <= 0 or self.code_timeout_s <= 0 or self.verifier_timeout_s <= 0:
            raise ValueError(
                f"RewardSpec timeouts must be > 0, got math_timeout_s={self.math_timeout_s}, "
                f"code_timeout_s={self.code_timeout_s}, "
                f"verifier_timeout_s={self.verifier_timeout_s}"
            )
        if self.code_max_tests is not None and self.code_max_tests < 1:
            raise ValueError(
                f"RewardSpec.code_max_tests must be >= 1 or None, got {self.code_max_tests}"
            )
        from policyopt.rewards.code import ISOLATIONS  # deferred: only code tasks need the module

        if self.code_isolation not in ISOLATIONS:
            raise ValueError(
                f"RewardSpec.code_isolation must be one of {ISOLATIONS}, "
                f"got {self.code_isolation!r}"
            )
        if self.verifier is not None:
            custom_lib.load_verifier(self.verifier)  # fails here, naming the path, not in a worker

    @property
    def penalty_scale(self) -> float:
        """Scale of the overlong penalty (0 when shaping is off)."""
        if self.overlong_scale is not None and self.overlong != "none":
            return self.overlong_scale
        return length_lib.DEFAULT_SCALE[self.overlong]


@dataclasses.dataclass(frozen=True)
class SampleScore:
    """What a worker computes for one completion (length terms are added by the parent).

    Attributes:
      format_ok: passed the format check; True where the spec asks for no format
        (``format_reward=False``: a response with its answer where ``answer_format`` says
        has no format to fail).
      correctness: c in [0, 1].
      status: verifier outcome (``STATUSES``: "correct", "incorrect", "no_answer",
        "rejected", "timeout", "format", "deadline", "error", "verifier_error"; code:
        "no_code", "no_tests"; "worker_error": lost to a scoring worker that crashed).
      language_ok: the language-consistency condition holds (False when not computed).
    """

    format_ok: bool
    correctness: float
    status: str
    language_ok: bool = False


_MISSED = SampleScore(False, 0.0, "deadline")
_LOST = SampleScore(False, 0.0, "worker_error")
# Statuses with no verdict: the sample gets a stand-in reward and is left out of the loss
# and of its group's statistics (``BatchScores.scored`` False).
UNSCORED = ("deadline", "worker_error")


def _import_modules(names: Sequence[str]) -> None:
    """Imports each of ``names`` (a run's ``config.imports``, checked with the config)."""
    for name in names:
        if name not in sys.modules:
            importlib.import_module(name)


def _split_for_language(completion: str) -> tuple[str, str]:
    parts = format_lib.split_think(completion)
    if parts is not None:
        return parts
    cut = completion.rfind(math_lib.THINK_CLOSE)
    if cut < 0:
        return completion, ""
    return completion[:cut], completion[cut + len(math_lib.THINK_CLOSE) :]


def score_sample(
    completion: str,
    reference: Any,
    prompt: str | None,
    spec: RewardSpec,
    *,
    time_left_s: float | None = None,
) -> SampleScore:
    """Format, correctness and language of one completion; never raises on model output.

    Args:
      completion: the generated text.
      reference: math: the reference answer (str); code: tests (assert string or list of
        {"input", "output"} dicts).
      prompt: the problem text (for the language check), or None.
      spec: the reward recipe.
      time_left_s: cap on the math verifier's time limit (what is left of the batch
        deadline). Code tests keep their own per-test limit; the parent's deadline bounds
        them.
    """
    completion = str(completion)
    verifier = VERIFIERS[spec.task]
    # The format check applies only where the recipe asks for a format (Magistral's gate).
    is_formatted = (
        verifier.format_ok(completion, spec.answer_format) if spec.format_reward else True
    )
    if not is_formatted:
        return SampleScore(False, 0.0, "format")
    if spec.verifier is not None:
        limit = (
            spec.verifier_timeout_s
            if time_left_s is None
            else min(spec.verifier_timeout_s, time_left_s)
        )
        correctness, status = custom_lib.custom_correctness(
            spec.verifier, completion, reference, max(limit, 1e-3)
        )
    else:
        correctness, status = verifier.score(completion, reference, spec, time_left_s)
    language_ok = False
    if spec.language_bonus:
        reasoning, answer = _split_for_language(completion)
        language_ok = language_lib.languages_consistent(
            prompt, reasoning, answer, min_letters=spec.language_min_letters
        )
    return SampleScore(is_formatted, float(correctness), status, language_ok)


def _score_chunk(
    items: list[tuple[str, Any, str | None, str | None]], spec: RewardSpec, deadline: float | None
) -> list[SampleScore]:
    """Scores items ``(completion, reference, prompt, task)`` in order (a task other than
    None overrides ``spec.task`` for its item); once ``deadline`` (time.time()) has
    passed, the rest are missed."""
    _import_modules(spec.imports)  # in a worker: where the verifiers are registered
    if spec.verifier is not None:
        custom_lib.load_verifier(
            spec.verifier
        )  # an unimportable verifier raises (not: every sample "error")
    specs = {None: spec, spec.task: spec}
    scores = []
    for completion, reference, prompt, task in items:
        time_left = None if deadline is None else deadline - time.time()
        if time_left is not None and time_left <= 0:
            scores.append(_MISSED)
            continue
        try:
            if task not in specs:
                specs[task] = dataclasses.replace(spec, task=task)
            scores.append(
                score_sample(completion, reference, prompt, specs[task], time_left_s=time_left)
            )
        except Exception:  # noqa: BLE001 - a reference/test malformed beyond repair scores 0
            scores.append(SampleScore(False, 0.0, "error"))
    return scores


def _score_chunk_in_worker(items, spec: RewardSpec, deadline: float | None):
    """``_score_chunk`` in a scoring worker: a verifier the worker cannot import comes back
    as the error (a value; not a crash, which would kill the pool)."""
    try:
        return _score_chunk(items, spec, deadline)
    except custom_lib.VerifierImportError as error:
        return error


# Worker pools by (name, size). Callers that score at the same time from different threads
# use different names (the asynchronous trainer's scoring thread: "async"; evaluation and
# the synchronous trainer: "default"): a pool killed after a missed deadline fails the
# calls of everyone using it.
_POOLS: dict[tuple[str, int], worker_lib.WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def _get_pool(num_workers: int, name: str = "default") -> worker_lib.WorkerPool:
    with _POOLS_LOCK:
        pool = _POOLS.get((name, num_workers))
        if pool is None or pool.closed:
            # The server preloads this module too: the workers unpickle its functions.
            preload = (*worker_lib.POOL_PRELOAD, __name__)
            pool = worker_lib.WorkerPool(num_workers, name=f"score-{name}", preload=preload)
            _POOLS[(name, num_workers)] = pool
        return pool


def start_workers(num_workers: int, pool: str = "default") -> None:
    """Starts the scoring pool of ``num_workers`` processes now and waits until all are up;
    with 0 (serial scoring), the calling thread's math verifier process.

    The first :func:`score_batch` call otherwise pays this (the verifier server's start,
    SymPy imported and warmed: seconds) in its wall time, though not in any sample's
    limit; call this once at set-up. Idempotent. ``pool``: see :func:`score_batch`.
    """
    if num_workers == 0:
        math_lib.start_verifier()
        return
    _get_pool(num_workers, pool)


def kill_pool(num_workers: int, name: str = "default", only=None) -> None:
    """Kills the workers of a pool (some may be stuck in C code) and forgets the pool: its
    callers' pending work is lost (scored as lost to a crashed worker), the sandboxes of
    code tests it was running removed. The next call that needs the pool starts a new one
    (forks: milliseconds). ``only``: kill the pool registered under the name only if it
    is this one (a call cleaning up the pool it used must not kill a newer one that
    another caller of the same name has started since)."""
    with _POOLS_LOCK:
        key = (name, num_workers)
        if only is not None and _POOLS.get(key) is not only:
            return
        pool = _POOLS.pop(key, None)
    if pool is not None:
        pool.kill()


def shutdown_pools() -> None:
    """Stops every worker pool started by :func:`score_batch`, letting running chunks
    finish."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown()


@atexit.register
def _kill_pools() -> None:
    """At exit nobody waits for scores: every pool is killed, its sandboxes removed."""
    # Not waiting long for the lock: a daemon thread may hold it while it starts a pool
    # (seconds); that pool's workers die with the verifier server, closed after this.
    locked = _POOLS_LOCK.acquire(timeout=1.0)
    try:
        pools = list(_POOLS.values())
        _POOLS.clear()
    finally:
        if locked:
            _POOLS_LOCK.release()
    for pool in pools:
        pool.kill()


def _wait(futures, deadline):
    """``concurrent.futures.wait`` until every future is done or the deadline (+ grace)
    passes, polling: a future cancelled by ``kill_pool`` (another caller of the same
    pool) never counts as done for ``wait``, and would otherwise block it for ever."""
    end = None if deadline is None else deadline + _DEADLINE_GRACE_S
    while True:
        timeout = _WAIT_POLL_S if end is None else min(_WAIT_POLL_S, max(end - time.time(), 0.0))
        done, not_done = concurrent.futures.wait(futures, timeout=timeout)
        if (
            not not_done
            or all(f.cancelled() for f in not_done)
            or (end is not None and time.time() >= end)
        ):
            return done, not_done


_WAIT_POLL_S = 1.0


def _score_parallel(
    items, spec, deadline, num_workers, name="default"
) -> tuple[list[SampleScore], int]:
    """Returns the scores and the number of samples lost to crashed workers."""
    chunk_size = max(1, -(-len(items) // (num_workers * _CHUNKS_PER_WORKER)))
    chunks = [items[start : start + chunk_size] for start in range(0, len(items), chunk_size)]
    pool = _get_pool(num_workers, name)
    try:
        futures = [pool.submit(_score_chunk_in_worker, chunk, spec, deadline) for chunk in chunks]
    except worker_lib.PoolClosed:  # another caller's deadline or crash stopped it: afresh
        kill_pool(num_workers, name, only=pool)
        pool = _get_pool(num_workers, name)
        futures = [pool.submit(_score_chunk_in_worker, chunk, spec, deadline) for chunk in chunks]
    done, not_done = _wait(futures, deadline)
    scores: list[SampleScore] = []
    errors, broken = 0, any(not f.cancelled() for f in not_done)
    for future, chunk in zip(futures, chunks):
        if future.cancelled():  # the pool was killed under this call: lost, like a crash
            errors += len(chunk)
            scores.extend([_LOST] * len(chunk))
            continue
        if future in done:
            try:
                result = future.result()
            except Exception:  # noqa: BLE001 - WorkerCrashed (a worker died, e.g. OOM)
                errors += len(chunk)
                broken = True
                scores.extend([_LOST] * len(chunk))
                continue
            if isinstance(result, custom_lib.VerifierImportError):
                raise result  # the workers cannot import RewardSpec.verifier: no crash, no 0
            scores.extend(result)
            continue
        scores.extend([_MISSED] * len(chunk))
    if broken:
        kill_pool(num_workers, name, only=pool)
    return scores, errors


# score_batch metrics that count samples (summed over batches) and that are per-sample
# means (averaged over batches, weighted by their samples): see `merge_metrics`.
COUNT_METRICS = ("verifier_timeouts", "verifier_errors", "deadline_missed", "worker_errors")
MEAN_METRICS = (
    "format_failure_rate",
    "length_penalty_mean",
    "truncated_fraction",
    "language_consistent_rate",
)


def merge_metrics(batches: Sequence[dict]) -> dict[str, float]:
    """The verifier-health metrics of several ``score_batch`` calls as one batch's: counts
    summed, rates averaged over all their samples."""
    total = sum(m["num_samples"] for m in batches)
    merged = {key: float(sum(m[key] for m in batches)) for key in COUNT_METRICS}
    for key in MEAN_METRICS:
        merged[key] = (
            float(sum(m[key] * m["num_samples"] for m in batches) / total) if total else 0.0
        )
    return merged


class BatchScores(tuple):
    """``(rewards, correct, metrics)``, with per-sample details as attributes.

    Unpacks as the 3-tuple of the interface (``rewards, correct, metrics = score_batch(...)``);
    like ``os.stat_result`` it carries more fields by name:

    Attributes:
      rewards: float32 [N] total rewards.
      correct: bool [N] fully correct (accuracy metrics; VAPO's NLL on correct samples).
      metrics: flat dict of float scalars.
      correctness: float32 [N] correctness c in [0, 1] (pass rate for partial code credit).
      format_ok: bool [N] passed the format check (True without a format gate).
      truncated: bool [N] hit the generation limit.
      sample_mask: float32 [N] 0 for samples to drop from the loss (overlong filtering,
        missed deadline, lost to a crashed worker).
      scored: bool [N] the reward is a verdict; False for a sample that missed the
        deadline or was lost to a crashed scoring worker (its reward is a stand-in, to
        leave out of its group's statistics: ``outcome_advantages(valid=...)``). An
        overlong-filtered sample is scored: DAPO masks its loss, its reward still counts
        in its group.
      length_penalty: float32 [N] overlong penalty added to the reward (0 where gated).
      language_ok: bool [N] language consistency held.
      status: list[str] [N] verifier outcome per sample.
    """

    def __new__(cls, rewards, correct, metrics, **details):
        self = super().__new__(cls, (rewards, correct, metrics))
        self.__dict__.update(details)
        return self

    rewards = property(lambda self: self[0])
    correct = property(lambda self: self[1])
    metrics = property(lambda self: self[2])


def _score_items(
    items, spec, deadline, num_workers, pool="default"
) -> tuple[list[SampleScore], int]:
    """Scores ``items`` here: serially (``num_workers`` 0) or in the worker pool."""
    if not items:
        return [], 0
    if num_workers and num_workers > 0:
        return _score_parallel(items, spec, deadline, num_workers, pool)
    return _score_chunk(items, spec, deadline), 0


def _process_count() -> int:
    """``jax.process_count()``; 1 when JAX is not imported (e.g. in a worker process)."""
    jax = sys.modules.get("jax")
    return 1 if jax is None else jax.process_count()


#: Every ``SampleScore.status`` (math and code verifiers, the batch's own), by the code
#: sent between processes; a status not listed travels as "error".
STATUSES = (
    "correct",
    "incorrect",
    "no_answer",
    "rejected",
    "timeout",
    "format",
    "deadline",
    "error",
    "no_code",
    "no_tests",
    "verifier_error",
    "worker_error",
)


def _score_across_processes(
    items, spec, deadline, num_workers, pool="default"
) -> tuple[list[SampleScore], int]:
    """Each process of a multi-process job scores its slice of ``items`` (contiguous,
    ``ceil(N / P)`` each), then every process receives every slice's scores
    (``multihost_utils.process_allgather``, a collective: every process calls this with
    the same items). Returns what ``_score_items`` would on all of them. If scoring raises
    in any process, every process raises after the exchange (none is left waiting in it).
    """
    import jax
    from jax.experimental import multihost_utils

    count, index = jax.process_count(), jax.process_index()
    per = -(-len(items) // count)
    fields = np.zeros((per, 4), np.float32)  # correctness, format_ok, language_ok, status
    failure, errors = None, 0
    try:
        mine, errors = _score_items(
            items[index * per : (index + 1) * per], spec, deadline, num_workers, pool
        )
        error_code = STATUSES.index("error")
        for row, score in enumerate(mine):
            code = STATUSES.index(score.status) if score.status in STATUSES else error_code
            fields[row] = (score.correctness, score.format_ok, score.language_ok, code)
    except Exception as error:  # noqa: BLE001 - re-raised below, after the collective
        failure = error
    local = np.concatenate([fields.reshape(-1), [errors, failure is not None]]).astype(np.float32)
    gathered = np.asarray(multihost_utils.process_allgather(local)).reshape(count, -1)
    if failure is not None:
        raise failure
    failed = np.flatnonzero(gathered[:, -1])
    if failed.size:
        raise RuntimeError(f"score_batch: scoring failed in process(es) {failed.tolist()}")
    rows = gathered[:, :-2].reshape(count * per, 4)[: len(items)]
    scores = [
        SampleScore(bool(f), float(c), STATUSES[int(code)], bool(lang)) for c, f, lang, code in rows
    ]
    return scores, int(gathered[:, -2].sum())


def score_batch(
    completions: Sequence[str],
    references: Sequence[Any],
    lengths: Sequence[int],
    spec: RewardSpec,
    *,
    prompts: Sequence[str] | None = None,
    num_workers: int = 0,
    deadline_s: float | None = None,
    truncated: Sequence[bool] | None = None,
    across_processes: bool = False,
    tasks: Sequence[str | None] | None = None,
    pool: str = "default",
) -> BatchScores:
    """Scores a batch of completions per ``spec``; never raises on model output.

    Args:
      completions: N generated texts.
      references: N references (math answers, or code tests).
      lengths: N generated-token counts |y| (for overlong shaping and filtering).
      spec: the reward recipe.
      prompts: N problem texts (for the language bonus), or None.
      num_workers: worker processes; 0 scores serially in this process (with the same
        per-sample time limits and deadline). The pool persists across calls; the first
        call starts it (seconds) unless :func:`start_workers` already did.
      deadline_s: wall-clock budget for the whole batch, from this call. Samples not
        scored by then are left out of the loss (``sample_mask`` 0), get the reward of a
        failed sample without length penalty or bonus (0 with ``format_reward``, else
        ``incorrect_value``; a reward of 0 would rank them above DAPO's wrong answers in
        their group), ``scored`` False, and are counted in ``metrics["deadline_missed"]``.
        Their stand-in reward counts in ``reward_mean``; the trainers leave it out of its
        group's statistics (``outcome_advantages(valid=scored)``, dynamic sampling).
      truncated: N flags "stopped at the generation limit without EOS"; default
        ``lengths >= spec.max_len`` (all False when max_len is None).
      across_processes: on a multi-process job (``jax.process_count() > 1``) every process
        calls this with the same batch, scores its own ``1 / P`` of it and receives the
        others' scores (a collective), so each returns the whole batch's scores for
        ``1 / P`` of the verifier work. Ignored on one process.
      tasks: N tasks (``"math"`` / ``"code"``, None: ``spec.task``) for a batch that
        mixes them (Magistral trains on math and code at once): each sample is checked,
        format gate included, by its task's verifier with ``spec``'s other settings.
      pool: the name of the worker pool (with ``num_workers`` > 0). Callers that score at
        the same time from different threads must use different pools (the asynchronous
        trainer's scoring thread uses ``"async"``): a missed deadline or a crashed worker
        kills the pool, and with it the other caller's pending work.

    Returns:
      :class:`BatchScores`: ``(rewards float32 [N], correct bool [N], metrics)`` plus
      per-sample details. Metrics: reward_mean, accuracy, format_failure_rate,
      verifier_timeouts, verifier_errors, deadline_missed, worker_errors, length_penalty_mean,
      truncated_fraction, language_consistent_rate, num_samples.
    """
    n = len(completions)
    named = (
        ("references", references),
        ("lengths", lengths),
        ("prompts", prompts),
        ("truncated", truncated),
        ("tasks", tasks),
    )
    for name, values in named:
        if values is not None and len(values) != n:
            raise ValueError(f"score_batch: {name} has {len(values)} entries, completions has {n}")
    start = time.time()
    deadline = None if deadline_s is None else start + deadline_s
    tasks = None if tasks is None else [None if t is None else str(t) for t in tasks]
    for task in set(tasks or ()) - {None}:
        if task not in VERIFIERS:
            raise ValueError(f"score_batch: task {task!r} is not one of {tuple(VERIFIERS)}")
    items = [
        (
            completions[i],
            references[i],
            None if prompts is None else prompts[i],
            None if tasks is None else tasks[i],
        )
        for i in range(n)
    ]
    if across_processes and _process_count() > 1:
        scores, errors = _score_across_processes(items, spec, deadline, num_workers, pool)
    else:
        scores, errors = _score_items(items, spec, deadline, num_workers, pool)

    status = [s.status for s in scores]
    unscored = np.array([s in UNSCORED for s in status], dtype=bool).reshape(n)
    verdicts = Verdicts(
        correctness=np.array([s.correctness for s in scores], dtype=np.float32).reshape(n),
        format_ok=np.array([s.format_ok for s in scores], dtype=bool).reshape(n),
        language_ok=np.array([s.language_ok for s in scores], dtype=bool).reshape(n),
        scored=~unscored,
    )
    composed = compose_rewards(verdicts, lengths, spec, truncated=truncated)
    rewards, correct, penalty = composed.rewards, composed.correct, composed.length_penalty
    is_truncated = composed.truncated
    format_ok, language_ok = verdicts.format_ok, verdicts.language_ok

    def mean(x) -> float:
        return float(np.mean(x)) if n else 0.0

    metrics = {
        "reward_mean": mean(rewards),
        "accuracy": mean(correct),
        "format_failure_rate": mean(~format_ok & ~unscored),
        "verifier_timeouts": float(sum(s == "timeout" for s in status)),
        "verifier_errors": float(sum(s == "verifier_error" for s in status)),
        "deadline_missed": float(sum(s == "deadline" for s in status)),
        "worker_errors": float(errors),
        "length_penalty_mean": mean(penalty),
        "truncated_fraction": mean(is_truncated),
        "language_consistent_rate": mean(language_ok) if spec.language_bonus else 0.0,
        "num_samples": float(n),
        "scoring_seconds": time.time() - start,
    }
    return BatchScores(
        rewards,
        correct,
        metrics,
        correctness=verdicts.correctness,
        format_ok=format_ok,
        truncated=is_truncated,
        sample_mask=composed.sample_mask,
        scored=~unscored,
        length_penalty=penalty,
        language_ok=language_ok,
        status=status,
    )
