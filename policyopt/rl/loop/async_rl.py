"""Asynchronous RL (Magistral, arXiv 2506.10910): generation and training overlap.

    # config.async_mode.enabled (configs/magistral_async.py)
    summary = run_async_rl(config, workdir)

A generator thread (``async_generation.AsyncGenerator``) decodes prompts in slot groups
and hands each finished group to a scoring thread; this thread takes scored groups in
finish order until a batch holds ``n_prompts`` groups (``async_sample``, in place of
``iteration.sample``), runs the synchronous trainer's ``prepare`` and ``update_epochs`` on
it, and publishes the new weights, which the generator picks up mid-generation. Every token
records the version that produced it (``async/staleness_*``). How it behaves, what it
resumes and what it does not reproduce: docs/algorithms.md, "Asynchronous generation".
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from policyopt.config import typed
from policyopt.data.pipeline import as_record
from policyopt.engine import GenerationStopped
from policyopt.rewards.scoring import kill_pool, score_batch
from policyopt.rl.batch import (
    DYNAMIC_SAMPLING_CRITERIA,
    bucket,
    mask_fillers,
    merge_rounds,
    round_from_rollout,
    trim_prompt,
    truncated_rows,
    uninformative_groups,
)
from policyopt.rl.loop import build, iteration
from policyopt.rl.loop.iteration import RunSpec, Sampled, prepare, update_epochs
from policyopt.rl.loop.trainer import RLRun, RunLoop, build_run, checkpoint_meta, checkpoint_state
from policyopt.rl.reporting.evaluate import decode, task_accuracies
from policyopt.rl.reporting.report import batch_metrics, scoring_metrics
from policyopt.rl.rollouts.async_generation import (
    AsyncGenerator,
    EngineSlots,
    GroupCompletion,
    SlotConfig,
    SlotGenerator,
    staleness_bound,
)

__all__ = [
    "resolved_n_async",
    "async_enabled",
    "PromptStream",
    "GroupBatcher",
    "make_scorer",
    "make_generator",
    "async_sample",
    "async_iteration",
    "run_async_rl",
]


def resolved_n_async(config) -> int:
    """``async_mode.n_async``, its default (2 * n_batch) resolved; checked, with its name, with
    the config (and again by ``AsyncGenerator`` and ``SlotConfig``)."""
    n_async = config.async_mode.n_async
    return 2 * config.batch.n_prompts * config.batch.group_size if n_async is None else int(n_async)


def async_enabled(config) -> bool:
    """Whether ``config.async_mode.enabled`` asks for ``run_async_rl``."""
    return bool(config.async_mode.enabled)


class PromptStream:
    """Single prompts out of the RL pipeline's batches, thread-safe.

    ``get_state()`` is the pipeline's state at the last batch the generator read (prompts
    of that batch not yet started are skipped on resume).
    """

    def __init__(self, batches):
        self._batches, self._lock, self._buffer = batches, threading.Lock(), []

    def _fill(self) -> None:
        batch = next(self._batches)
        for i, length in enumerate(np.asarray(batch["prompt_lengths"])):
            self._buffer.append(
                dict(
                    prompt_tokens=np.asarray(batch["prompt_tokens"][i]),
                    prompt_length=int(length),
                    prompt=batch["prompt"][i],
                    answer=batch["answer"][i],
                    task=batch["task"][i] if "task" in batch else None,
                )
            )

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        with self._lock:
            if not self._buffer:
                self._fill()
            return self._buffer.pop(0)

    def get_state(self):
        with self._lock:
            return self._batches.get_state()


# The scoring thread's worker pool, apart from the one evaluation uses in the trainer's
# thread at the same time (``score_batch(pool=...)``).
SCORING_POOL = "async"


def _interrupt_scoring(num_workers: int):
    """``close``'s way to cut the scorer's current group short: kill its worker pool (None
    for in-process scoring, which cannot be interrupted; its math verification still runs
    in the scoring thread's own killable verifier process, ``policyopt.rewards.math``, so
    a group ends within its samples' time limits, never hangs)."""
    if not num_workers:
        return None
    return lambda: kill_pool(num_workers, SCORING_POOL)


def make_scorer(run: RLRun):
    """``GroupCompletion -> GroupCompletion`` with rewards, as the synchronous trainer
    scores (``policyopt.rewards.scoring.score_batch``; truncated: ``truncated_rows``)."""
    cfg, tokenizer = run.spec.config, run.spec.tokenizer
    num_new = cfg.sampling.max_new_tokens

    def score(completion: GroupCompletion) -> GroupCompletion:
        group = completion.tokens.shape[0]
        texts = decode(completion.tokens, completion.lengths, tokenizer)
        truncated = truncated_rows(
            completion.tokens, completion.lengths, num_new, run.spec.sampling_config.end_ids
        )
        scores = score_batch(
            texts,
            [completion.meta["answer"]] * group,
            completion.lengths,
            run.spec.reward_spec,
            prompts=[completion.meta["prompt"]] * group,
            num_workers=cfg.reward.num_workers,
            truncated=truncated,
            deadline_s=cfg.reward.deadline_s,
            tasks=[completion.meta.get("task")] * group,
            pool=SCORING_POOL,
        )
        return completion._replace(
            rewards=np.asarray(scores.rewards, np.float32),
            correct=np.asarray(scores.correct, bool),
            sample_mask=np.asarray(scores.sample_mask, np.float32),
            scored=np.asarray(scores.scored, bool),
            scoring=scores.metrics,
        )

    return score


def widest_prompt(config) -> int:
    """The padded width of the longest training prompt: the largest prompt bucket that a
    batch of the prompt stream can have (the slots' prompt width is fixed for the run, so
    the width of the first batch would not do: a later batch in a larger bucket would not
    fit). One tokenising pass over the training prompts, with the training pipeline's
    limit: prompts over the largest bucket are dropped (not counted) or truncated (to it)
    per ``task.overlong_prompt``, and raise with "error"."""
    tokenizer = build.make_tokenizer(config)
    buckets, policy = tuple(config.batch.prompt_buckets), config.task.overlong_prompt
    limit = max(buckets)
    longest = 0
    for record in build.task_source(config, "train"):
        length = len(tokenizer.encode_prompt(as_record(record)["prompt"]))
        if length > limit and policy == "drop":
            continue
        longest = max(longest, min(length, limit) if policy.startswith("truncate") else length)
    return bucket(longest, buckets, name="prompt length")


def make_generator(run: RLRun, stream: PromptStream) -> AsyncGenerator:
    """The generator of ``run`` (not started), at the run's current parameters and
    iteration (= version): on the engine's paged KV cache (``EngineSlots``) when
    ``sampling.engine_kv_tokens > 0``, else on dense slots (``SlotGenerator``)."""
    cfg = run.spec.config
    acfg = cfg.async_mode
    n_async = resolved_n_async(cfg)
    width = acfg.prompt_width or widest_prompt(cfg)
    rows = min(acfg.num_slots or n_async, n_async)  # rows beyond n_async would stay idle
    slot_config = SlotConfig(
        sampling=run.spec.sampling_config,
        num_groups=rows // cfg.batch.group_size,
        prompt_width=int(width),
        segment_steps=min(acfg.segment_steps, cfg.sampling.max_new_tokens),
    )
    # A copy: the update donates the policy's state.
    params = jax.tree.map(jnp.copy, run.run_state.policy.params)
    # LoRA: the trainer publishes its adapters only; the generator joins them to the
    # frozen base (or merges them into it) once per version (iteration.sampler_weights).
    with jax.set_mesh(run.spec.mesh):
        graphdef, decode = iteration.sampler_weights(run.spec, params)

    def weights(published):
        with jax.set_mesh(run.spec.mesh):
            return iteration.sampler_weights(run.spec, published)[1]

    s = cfg.sampling
    if s.engine_kv_tokens > 0:  # the paged KV cache of policyopt.engine
        slots = EngineSlots(
            graphdef,
            slot_config,
            decode,
            kv_tokens=s.engine_kv_tokens,
            page_size=s.engine_page_size,
            mesh=run.spec.mesh,
        )
    else:
        slots = SlotGenerator(graphdef, slot_config, decode, mesh=run.spec.mesh)
    rng = jax.random.fold_in(jax.random.fold_in(run.run_state.rng, 0x5EED), run.run_state.iteration)
    return AsyncGenerator(
        slots,
        stream,
        params,
        run.run_state.iteration,
        rng=rng,
        n_async=n_async,
        score_fn=make_scorer(run),
        join_timeout_s=acfg.join_timeout_s,
        interrupt_scoring=_interrupt_scoring(run.spec.config.reward.num_workers),
        weights=None if run.spec.weights is None else weights,
    )


class GroupBatcher:
    """Finished groups -> batches of ``n_prompts`` groups, in arrival order.

    Dynamic sampling as ``policyopt.rl.batch.DynamicSampler``: when enabled, uninformative
    groups (``uninformative_groups`` under ``criterion``) are dropped until ``n_prompts``
    are kept or ``max_groups`` groups were seen; a short batch is completed with the most
    recently dropped groups (``async_iteration`` masks them out, ``mask_fillers``) and the
    shortfall reported. ``last_seen``: every group the last batch drew, dropped ones
    included (the training metrics ``reward/*`` and ``response/*`` cover them, as the
    synchronous trainer's cover every sampling round).
    """

    def __init__(
        self,
        n_prompts: int,
        group_size: int,
        *,
        enabled: bool,
        max_groups: int,
        criterion: str = "reward",
    ):
        if criterion not in DYNAMIC_SAMPLING_CRITERIA:
            raise ValueError(f"criterion={criterion!r} is not one of {DYNAMIC_SAMPLING_CRITERIA}")
        self.n_prompts, self.group_size, self.criterion = n_prompts, group_size, criterion
        self.enabled, self.max_groups = enabled, max(max_groups, n_prompts)
        self.kept: list[GroupCompletion] = []
        self.dropped: list[GroupCompletion] = []
        self.seen = 0
        self.last_seen: list[GroupCompletion] = []

    def add(self, group: GroupCompletion) -> bool:
        """Adds one scored group; True when the batch is complete."""
        self.seen += 1
        if (
            self.enabled
            and uninformative_groups(
                group.rewards, group.correct, self.group_size, self.criterion, scored=group.scored
            )[0]
        ):
            self.dropped.append(group)
        else:
            self.kept.append(group)
        return len(self.kept) >= self.n_prompts or self.seen >= self.max_groups

    def batch(self) -> tuple[list[GroupCompletion], dict[str, float]]:
        """The groups of the batch (kept, then fillers) and the metrics; then resets."""
        shortfall = self.n_prompts - len(self.kept)
        groups = self.kept + self.dropped[::-1][: max(shortfall, 0)]
        metrics = {
            "dynamic_sampling/groups_seen": float(self.seen),
            "dynamic_sampling/kept_fraction": len(self.kept) / self.seen,
            "dynamic_sampling/shortfall": float(max(shortfall, 0)),
        }
        self.last_seen = self.kept + self.dropped
        self.kept, self.dropped, self.seen = [], [], 0
        return groups, metrics


def assemble(groups: list[GroupCompletion], run: RLRun):
    """The training-layout Round of ``groups`` and their versions ``[R, N_b]`` (-1 past
    each end), start and finish versions ``[R]``.

    The slots hold every prompt at the widest prompt width of the run; each group is cut
    to its own prompt bucket (only padding goes), so that the batch, like a synchronous
    one, has the prompt bucket of its longest prompt. Built on the host (no device
    round trip per group)."""
    cfg, group = run.spec.config, run.spec.config.batch.group_size
    num_new = cfg.sampling.max_new_tokens
    rounds = []
    for g in groups:
        width = min(
            bucket(int(g.lengths.max()), cfg.batch.response_buckets, name="response length"),
            num_new,
        )
        rnd = round_from_rollout(g.rollout(), g.rewards, g.correct, width, scored=g.scored)
        prompt_width = min(
            bucket(int(np.max(g.prompt_lengths)), cfg.batch.prompt_buckets, name="prompt length"),
            rnd.prompt_width,
        )
        rnd = trim_prompt(rnd, prompt_width)
        rnd = rnd._replace(mask=rnd.mask * g.sample_mask[:, None])  # see iteration.sample
        rounds.append((rnd, np.zeros((1,), np.int64)))
    merged = merge_rounds(rounds, group, run.spec.tokenizer.pad_id)
    width = merged.mask.shape[1]
    versions = np.concatenate([g.versions[:, :width] for g in groups])
    start = np.concatenate([np.full(group, g.start_version) for g in groups])
    finish = np.concatenate([np.full(group, g.finish_version) for g in groups])
    return merged, versions, start, finish


def engine_metrics(slots) -> dict[str, float]:
    """The paged engine's counters since the generator started (``EngineSlots.stats``):
    row-steps spent waiting for a page, groups preempted and recomputed, most pages one
    shard held at once; none for dense slots."""
    if not isinstance(slots, EngineSlots):
        return {}
    stats = dict(slots.stats)  # a copy: the generator thread updates it
    return {
        "async/page_waits": float(stats.get("waits", 0)),
        "async/preempted_groups": float(stats.get("preempted_groups", 0)),
        "async/peak_pages": float(stats.get("peak_pages", 0)),
    }


def staleness_metrics(
    version: int, versions: np.ndarray, start: np.ndarray, finish: np.ndarray
) -> dict[str, float]:
    """Per-batch staleness ``version - token version`` and start / finish versions."""
    valid = versions >= 0
    token_staleness = version - versions[valid]
    spans = [len(np.unique(row[row >= 0])) for row in versions]
    return {
        "async/staleness_min": float(token_staleness.min()),
        "async/staleness_mean": float(token_staleness.mean()),
        "async/staleness_max": float(token_staleness.max()),
        "async/start_version_min": float(start.min()),
        "async/start_version_max": float(start.max()),
        "async/finish_version_min": float(finish.min()),
        "async/finish_version_max": float(finish.max()),
        "async/start_staleness_max": float(version - start.min()),
        "async/pushed_mid_generation_fraction": float(np.mean(np.asarray(spans) > 1)),
    }


def group_samples(groups: list[GroupCompletion], tokenizer) -> dict:
    """The completions of ``groups`` with their prompts, references and verdicts, in
    ``RLRun.last_samples``' layout (for samples.jsonl)."""
    texts, prompts, references, rewards, correct = [], [], [], [], []
    for g in groups:
        texts += decode(g.tokens, g.lengths, tokenizer)
        prompts += [g.meta["prompt"]] * len(g.lengths)
        references += [g.meta["answer"]] * len(g.lengths)
        rewards += list(g.rewards)
        correct += list(g.correct)
    return dict(
        prompts=prompts, completions=texts, references=references, rewards=rewards, correct=correct
    )


def stale_spec(spec: RunSpec) -> RunSpec:
    """``spec`` as the asynchronous trainer's stages use it: the sampler's routing and
    log-probs here come from older (and mixed) parameter versions, so their differences
    from the trainer's measure staleness, not numerics, and their metrics are named so."""
    return dataclasses.replace(
        spec,
        logprob_diff_name="logprob/stale_sampler_trainer_abs_diff",
        routing_diff_name="routing/stale_sampler_disagreement",
    )


def async_sample(run: RLRun, generator: AsyncGenerator, batcher: GroupBatcher):
    """The asynchronous trainer's ``sample``: one batch of finished groups taken from the
    generator (dynamic sampling by ``batcher``), as ``iteration.sample`` returns it, and
    the batch's versions (``async_iteration``'s info)."""
    cfg = run.spec.config
    start = time.perf_counter()
    while not batcher.add(generator.take()):
        pass
    groups, metrics = batcher.batch()
    waited = time.perf_counter() - start
    merged, versions, start_version, finish_version = assemble(groups, run)
    merged = mask_fillers(merged, int(metrics["dynamic_sampling/shortfall"]), cfg.batch.group_size)
    # reward/* and response/* over every group drawn, as the synchronous trainer reports
    # every sampling round (dropped groups included); batch/* over the batch.
    seen = batcher.last_seen
    rewards = np.concatenate([g.rewards for g in seen])
    correct = np.concatenate([g.correct for g in seen])
    lengths = np.concatenate([g.lengths for g in seen])
    metrics.update(
        {
            "reward/mean": float(np.mean(rewards)),
            "reward/accuracy": float(np.mean(correct)),
            **batch_metrics(merged),
            "response/length_mean": float(np.mean(lengths)),
            "response/length_max": float(np.max(lengths)),
            "response/truncated_fraction": float(
                np.mean(
                    np.concatenate(
                        [
                            truncated_rows(
                                g.tokens,
                                g.lengths,
                                cfg.sampling.max_new_tokens,
                                run.spec.sampling_config.end_ids,
                            )
                            for g in seen
                        ]
                    )
                )
            ),
            "time/wait_for_generator_s": waited,
            "async/queued": float(generator.queued),
            "async/segments": float(generator.stats["segments"]),
            "async/groups_started": float(generator.stats["groups_started"]),
            **engine_metrics(generator.slots),
            # Seconds the scoring thread has spent in the verifiers (beside decoding).
            "async/score_s": float(generator.stats["score_seconds"]),
        }
    )
    metrics.update(
        staleness_metrics(run.run_state.iteration, versions, start_version, finish_version)
    )
    if all(g.scoring is not None for g in seen):
        metrics.update(scoring_metrics([g.scoring for g in seen]))
    if any(g.meta.get("task") is not None for g in seen):  # mixed math and code prompts
        tasks = [g.meta.get("task") for g in seen for _ in range(len(g.rewards))]
        metrics.update(task_accuracies(correct, tasks, "reward/accuracy"))
    samples = group_samples(groups[: cfg.train.sample_prompts], run.spec.tokenizer)
    info = dict(
        groups=groups, versions=versions, start_version=start_version, finish_version=finish_version
    )
    return Sampled(merged, samples, metrics), info


def async_iteration(
    run: RLRun, generator: AsyncGenerator, batcher: GroupBatcher
) -> tuple[dict, dict]:
    """Takes one batch of finished groups (``async_sample``), trains on it (version
    ``run.run_state.iteration``; ``iteration.prepare``, ``iteration.update_epochs``),
    publishes the new parameters as version ``run.run_state.iteration + 1``.

    Returns:
      ``(metrics, info)``; info holds the batch's ``groups`` and per-row ``versions``
      ``[R, N_b]``, ``start_version`` and ``finish_version`` ``[R]``.
    """
    start = time.perf_counter()
    spec, state = stale_spec(run.spec), run.run_state
    sampled, info = async_sample(run, generator, batcher)
    _, key_shuffle = jax.random.split(jax.random.fold_in(state.rng, state.iteration))
    with jax.set_mesh(spec.mesh):
        prepared = prepare(spec, state, sampled.round)
        state, update_metrics = update_epochs(spec, state, prepared, key_shuffle)
    run.run_state = state.replace(iteration=state.iteration + 1)
    run.keep(sampled, prepared)
    generator.publish(jax.tree.map(jnp.copy, run.run_state.policy.params), run.run_state.iteration)
    metrics = {
        **sampled.metrics,
        **prepared.metrics,
        **update_metrics,
        "time/iteration_s": time.perf_counter() - start,
    }
    return {k: float(v) for k, v in metrics.items()}, info


def save(run: RLRun, stream: PromptStream) -> None:
    """Checkpoints the run (``trainer.save`` with the prompt stream's position)."""
    run.checkpointer.save(
        run.run_state.iteration, checkpoint_state(run), checkpoint_meta(run, stream.get_state())
    )


def run_async_rl(
    config,
    workdir: str,
    *,
    num_iterations: int | None = None,
    quiet: bool = False,
    recipe: str | None = None,
) -> dict:
    """Trains with asynchronous RL for ``config.train.num_iterations`` batches (resuming
    from ``workdir/checkpoints`` when possible); the outputs of ``trainer.run_rl``.

    Returns:
      ``{"iteration", "metrics" (last), "eval", "eval_history", "run", "async" (the last
      batch's versions, see ``async_iteration``), "staleness_bound"}``.
    """
    if jax.process_count() > 1:
        raise NotImplementedError(
            "async_mode on a multi-process job: the generator thread and the trainer launch "
            "programs on the same devices in an order set by thread timing, which differs "
            "between processes, and programs that span processes must be launched in the "
            "same order on each. Run asynchronous RL on one process (any number of local "
            "devices), or the synchronous trainer on many."
        )
    config = typed(config)
    total = config.train.num_iterations if num_iterations is None else num_iterations
    with build.undo_workdir_on_failure(workdir):  # a failed build leaves nothing behind
        run = build_run(config, workdir, lock=True)
        stream = PromptStream(run.spec.prompts)
        generator = make_generator(run, stream)
    if run.run_state.iteration:
        logging.info(
            "async RL resumes at iteration %d; generation restarts from scratch "
            "(in-flight completions are not checkpointed)",
            run.run_state.iteration,
        )
    slot_config = generator.slots.config
    group = config.batch.group_size
    bound = staleness_bound(
        generator.n_async,
        config.batch.n_prompts * group,
        group,
        config.sampling.max_new_tokens,
        slot_config.segment_steps,
        rows=slot_config.rows,
    )
    ds = config.dynamic_sampling
    batcher = GroupBatcher(
        config.batch.n_prompts,
        group,
        enabled=ds.enabled,
        max_groups=ds.max_rounds * config.batch.n_prompts if ds.enabled else 0,
        criterion=ds.criterion,
    )
    loop = RunLoop(run, total, quiet=quiet, recipe=recipe)
    info = {}
    try:
        loop.begin()
        loop.attach(generator)
        with generator if run.run_state.iteration < total else contextlib.nullcontext():
            while run.run_state.iteration < total and not loop.stopping:
                try:
                    metrics, info = async_iteration(run, generator, batcher)
                except GenerationStopped:
                    loop.stopped_in_iteration(save=lambda: save(run, stream))
                    break
                metrics["async/staleness_bound"] = float(bound)
                loop.after_iteration(metrics, save=lambda: save(run, stream))
        loop.end()
    finally:
        loop.close()
    return loop.summary(**{"async": info, "staleness_bound": bound})
