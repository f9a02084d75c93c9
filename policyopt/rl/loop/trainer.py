"""An RL run: built from a config, iterated, logged, evaluated, checkpointed, resumed.

    summary = run_rl(config, workdir)        # resumes from workdir/checkpoints if present

One iteration is ``policyopt.rl.loop.iteration.rl_iteration`` (``sample`` -> ``prepare`` ->
``update_epochs``, stages that see a frozen ``RunSpec`` and a ``RunState`` pytree). This
module builds them (``build_run``), holds them between iterations with the host side of a
run (``RLRun``: run directory, data position, checkpoints, evaluation) and drives the loop
(``run_rl``, ``RunLoop``). Determinism and resume, the critic's phases and several
processes: docs/design.md, "The run around the iterations"; routing replay and the
sampler-trainer corrections: docs/algorithms.md; meshes and packing: docs/scale.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from policyopt import sharding
from policyopt.checkpoint import Checkpointer, lock_workdir
from policyopt.config import typed
from policyopt.data.pipeline import make_pipeline
from policyopt.engine import Engine, GenerationStopped
from policyopt.loggers import config_json, open_loggers, parse_loggers
from policyopt.metrics import MetricsWriter, Progress, read_last_value, read_step_record
from policyopt.rl.loop import build, iteration
from policyopt.rl.loop.iteration import Prepared, RunSpec, RunState, Sampled
from policyopt.rl.reporting import report
from policyopt.rl.reporting.evaluate import evaluate
from policyopt.rl.update import adapters, methods
from policyopt.rl.update.critic import CriticSettings, critic_optim, get_critic
from policyopt.rl.update.learner import LossSettings, get_learner, place_state
from policyopt.runtime import GracefulStop, compile_counts
from policyopt.sampling import SamplingConfig, sampling_method


@dataclasses.dataclass
class RLRun:
    """A run between iterations (built by ``build_run``): the stages' ``RunSpec`` and
    ``RunState`` (``policyopt.rl.loop.iteration``) and the host side of the loop around them
    (the run directory, checkpoints, evaluation, what the last iteration saw).
    """

    spec: RunSpec
    run_state: RunState
    workdir: str
    eval_records: list
    checkpointer: Checkpointer
    # The last iteration's sampled batch (host Round) and update Batch, for inspection.
    last_round: Any = None
    last_batch: Any = None
    # The last evaluation's metrics and the iteration it was at: run here or, when the
    # run resumed, read back from eval.jsonl at the checkpoint's iteration (RunLoop), so
    # a resumed run neither repeats an evaluation nor loses it.
    last_eval: dict = dataclasses.field(default_factory=dict)
    last_eval_iteration: int | None = None
    # The config the restored checkpoint was saved under (build.config_record), or None.
    resumed_config: dict | None = None
    # The first sampling round's prompts, completions, references and verdicts of the last
    # iteration (``report.sample_rows`` fields, as lists), for samples.jsonl; or None.
    last_samples: dict | None = None

    def step(self) -> dict[str, float]:
        """Runs one iteration (``iteration.rl_iteration``): the run's state replaced, what
        it sampled and trained on kept (``keep``); returns its metrics."""
        self.run_state, metrics, sampled, prepared = iteration.rl_iteration(
            self.spec, self.run_state
        )
        self.keep(sampled, prepared)
        return metrics

    def keep(self, sampled: Sampled, prepared: Prepared) -> None:
        """Keeps an iteration's samples, round and update batch for inspection (``last_*``)."""
        self.last_samples = sampled.samples
        self.last_round, self.last_batch = prepared.round, prepared.batch


def make_prompt_iterator(config, records, *, seed: int):
    """The grain iterator of RL prompt batches (n_prompts prompts, bucketed, shuffled) over
    ``records`` (a random-access sequence: ``build.task_source``). Every prompt is
    tokenised once when it is built: prompts longer than the largest prompt bucket raise
    there, naming the record, or are dropped or truncated (``task.overlong_prompt``)."""
    buckets = tuple(config.batch.prompt_buckets)
    policy = config.task.overlong_prompt
    pipeline = make_pipeline(
        records,
        batch_size=config.batch.n_prompts,
        seed=seed,
        tokenizer=build.make_tokenizer(config),
        length_buckets=buckets,
        max_prompt_length=max(buckets),
        overlong_prompt=policy,
    )
    return iter(pipeline)


def build_run(
    config, workdir: str, *, check_config: bool = True, lock: bool = False, owner: bool = True
) -> RLRun:
    """Builds the mesh, model, learner, data and the initial state (placed on the mesh);
    restores the latest readable checkpoint of ``workdir/checkpoints`` when there is one,
    onto the same shardings (refusing one saved under another config unless
    ``check_config`` is False: see ``restore``). ``owner``: the run will save there (its
    ``Checkpointer``'s ``owner``: corrupt checkpoints skipped are moved aside); False for a
    reader such as ``experiments/eval.py``.

    Nothing is written until everything that can be checked has been (the mesh's devices,
    files, model, data, evaluation prompts, verifier): only then is ``workdir`` created
    (and, with ``lock``, locked: ``lock_workdir``) and ``checkpoints/`` opened.

    ``config``: the typed config (``policyopt.config.RunConfig``), or a recipe's ConfigDict,
    built into one and checked first."""
    config = typed(config)
    mesh = build.make_mesh(config)
    tokenizer = build.make_tokenizer(config)
    model = build.make_model(config, tokenizer.vocab_size, mesh)
    build.check_dropless(model, "config.model.moe_dispatch (or moe_decode_dispatch)")
    policy = build.init_policy(config, model, mesh)
    weights, params = policy.weights, policy.trainable
    settings = LossSettings.of(config)
    learner = get_learner(weights.graphdef, settings, config.optim)
    ref_params = ref_learner = None
    if config.algo.kl_beta > 0 and weights.lora:
        # The reference policy is the base: its own parameters, no copy, the adapters off.
        ref_params, ref_learner = (
            weights.frozen,
            get_learner(weights.base_graphdef, settings, config.optim),
        )
    elif config.algo.kl_beta > 0:
        ref_params = jax.tree.map(jnp.copy, params)
    state = place_state(learner.init_state(params), learner.optimizer, mesh)
    rng = sharding.put(jax.random.PRNGKey(config.seed), sharding.replicated(mesh))
    data = make_prompt_iterator(config, build.task_source(config, "train"), seed=config.seed)
    eval_records = build.eval_records(config, tokenizer)
    s = config.sampling
    sampling_config = SamplingConfig(
        max_new_tokens=s.max_new_tokens,
        method=sampling_method(s.temperature, s.top_k, s.top_p),
        eos_id=tokenizer.eos_id,
        stop_ids=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id,
        num_samples=config.batch.group_size,
        decode_segments=s.decode_segments,
    )
    engine = None
    if s.engine_kv_tokens > 0:
        merged = weights.lora and weights.sampler == "merged"
        sampler_graphdef = weights.base_graphdef if merged else weights.graphdef
        engine = Engine.from_config(config, model, sampler_graphdef, mesh, sampling_config)
    critic = critic_state = critic_frozen = critic_model = None
    if config.algo.uses_critic:  # a "gae" estimator (advantages.register_estimator)
        critic_graphdef, critic_init = weights.graphdef, params
        critic_width = model.config.hidden_size
        if config.critic.init_checkpoint:  # a value model of its own (full weights)
            critic_graphdef, critic_init, critic_width, critic_model = build.critic_model(
                config, tokenizer, mesh, build.saved_critic_model(workdir)
            )
        elif weights.lora and config.model.lora.critic == "adapters":
            critic_frozen = weights.frozen  # its own adapters (a copy), the policy's base
        elif weights.lora:  # full weights: a copy of the base, in the adapters' dtype
            dtype = model.config.lora.dtype
            critic_graphdef = weights.base_graphdef
            critic_init = jax.tree.map(lambda x: x.astype(dtype), weights.frozen)
        critic = get_critic(critic_graphdef, CriticSettings.of(config), critic_optim(config))
        critic_state = critic.init_state(critic_init, critic_width)
        critic_state = place_state(critic_state, critic.optimizer, mesh)
    spec = RunSpec(
        config=config,
        graphdef=weights.graphdef,
        learner=learner,
        critic=critic,
        mesh=mesh,
        methods=methods.choose(config, is_moe=model.config.is_moe),
        tokenizer=tokenizer,
        sampling_config=sampling_config,
        reward_spec=build.reward_spec(config),
        prompts=data,
        ref_params=ref_params,
        ref_learner=ref_learner,
        engine=engine,
        weights=weights if weights.lora else None,
        critic_frozen=critic_frozen,
        lora_record=policy.record,
        warmup_iterations=(
            config.critic.reward_model_iterations + config.critic.pretrain_iterations
            if critic
            else 0
        ),
        reward_model_iterations=config.critic.reward_model_iterations if critic else 0,
        critic_model=critic_model,
    )
    if lock:
        lock_workdir(workdir)  # one process per workdir: a second is refused in one line
    os.makedirs(workdir, exist_ok=True)
    checkpointer = Checkpointer(
        os.path.join(workdir, "checkpoints"),
        max_to_keep=config.train.keep_checkpoints,
        owner=owner,
    )
    run = RLRun(
        spec=spec,
        run_state=RunState(policy=state, critic=critic_state, rng=rng),
        workdir=workdir,
        eval_records=eval_records,
        checkpointer=checkpointer,
    )
    if checkpointer.latest_step() is not None:
        restore(run, check_config=check_config)
    return run


def checkpoint_state(run: RLRun) -> dict:
    """The arrays a checkpoint holds: the policy's ``TrainState``, the run key and (critic
    methods) the critic's ``TrainState``."""
    state = {"train": run.run_state.policy, "rng": run.run_state.rng}
    if run.run_state.critic is not None:
        state["critic"] = run.run_state.critic
    return state


def checkpoint_meta(run: RLRun, data_state) -> dict:
    """The JSON record saved beside the arrays: iteration, data position and the config
    (checked on resume, ``build.check_resume_config``); with LoRA the adapters' record
    and their base's identity (``adapters.lora_record``: the base is not saved); with a
    critic of its own, its model (``build.critic_model_record``)."""
    meta = {
        "iteration": run.run_state.iteration,
        "data": data_state,
        "config": build.config_record(run.spec.config),
    }
    if run.spec.lora_record is not None:
        meta["lora"] = run.spec.lora_record
    if run.spec.critic_model is not None:
        meta["critic_model"] = run.spec.critic_model
    return meta


def save(run: RLRun, data_state=None) -> None:
    """Checkpoints the run at its current iteration, with the data position ``data_state``
    (default: the iterator's now)."""
    data_state = run.spec.prompts.get_state() if data_state is None else data_state
    run.checkpointer.save(
        run.run_state.iteration, checkpoint_state(run), checkpoint_meta(run, data_state)
    )


def restore(run: RLRun, step: int | None = None, *, check_config: bool = True) -> None:
    """Restores parameters, optimiser, counters, run key, iteration and data position (and
    the critic's parameters, optimiser and counters) from ``step`` (default: the latest
    readable one, ``Checkpointer.restore``'s fallback); refuses a checkpoint saved under
    another config (``build.check_resume_config``) unless ``check_config`` is False
    (``experiments/eval.py``, which only reads the parameters)."""
    target = checkpoint_state(run)
    where = run.checkpointer.directory

    def check(candidate: int, meta: dict) -> None:
        # Adapters against full weights, and adapters on another base: one line each, first.
        adapters.check_kind(meta.get("lora"), run.spec.config, where, "resume")
        if meta.get("lora") is not None:
            adapters.check_base(meta["lora"], run.spec.weights.frozen, f"resume: {where}")
        # Before the arrays: a changed config or shape would fail there, unnamed.
        if check_config:
            # The critic's source is read once: its model is in the meta, its parameters in
            # the arrays, so it may have moved since.
            build.check_resume_config(
                meta.get("config"), run.spec.config, where, ignore=("critic.init_checkpoint",)
            )
        build.check_checkpoint_shapes(
            run.checkpointer, target, run.spec.config, step=candidate, field="resume"
        )

    restored, meta = run.checkpointer.restore(target, step, check=check)
    run.run_state = run.run_state.replace(
        policy=restored["train"],
        rng=restored["rng"],
        critic=restored.get("critic"),
        iteration=int(meta["iteration"]),
    )
    run.spec.prompts.set_state(meta["data"])
    run.last_eval, run.last_eval_iteration, run.resumed_config = {}, None, meta.get("config")


class UpdatesSkipped(RuntimeError):
    """Raised when ``train.max_skipped_updates`` updates in a row were skipped."""


def _guarded_states(run: RLRun) -> dict:
    """The states whose updates the non-finite guard may skip: the policy's and the critic's."""
    return {"update": run.run_state.policy, "critic": run.run_state.critic}


class SkippedUpdates:
    """Stops a run once ``limit`` updates in a row were skipped by the non-finite guard
    (``learner.guarded_update``: loss, gradient, new parameters or optimiser state not
    finite), counted apart for the policy and the critic from their states' ``step``
    (applied) and ``skipped`` counters. An iteration that applied any update resets its
    model's count; one that applied none adds its skipped updates to it. Such a run learns
    nothing more (a NaN in Adam's moments, or a learning rate that blew the parameters up,
    makes every later update non-finite) and would otherwise go on to exit 0.
    """

    def __init__(self, limit: int, states: dict):
        self.limit = limit
        self.last = self._counts(states)
        self.streak = dict.fromkeys(self.last, 0)

    @staticmethod
    def _counts(states: dict) -> dict[str, tuple[int, int]]:
        return {
            name: (int(state.step), int(state.skipped))
            for name, state in states.items()
            if state is not None
        }

    def update(self, iteration: int, states: dict) -> None:
        """Counts the iteration's updates; raises ``UpdatesSkipped`` (one line) at the limit."""
        for name, (step, skipped) in self._counts(states).items():
            last_step, last_skipped = self.last.get(name, (step, skipped))
            streak = self.streak.get(name, 0) + skipped - last_skipped
            self.streak[name] = 0 if step > last_step else streak
            self.last[name] = (step, skipped)
            if self.streak[name] >= self.limit:
                model = "critic" if name == "critic" else "policy"
                raise UpdatesSkipped(
                    f"stopping at iteration {iteration}: the last {self.streak[name]} {model} "
                    f"updates were skipped (non-finite loss, gradient, parameters or optimiser "
                    f"state; {name}/skipped in metrics.jsonl) and the run cannot learn; lower "
                    f"optim.lr, check optim.eps, or restart from an earlier checkpoint "
                    f"(config.train.max_skipped_updates={self.limit})"
                )


# Completions of each evaluation written to eval_samples.jsonl (the first held-out prompts).
EVAL_SAMPLES_LOGGED = 16


def evaluate_run(run: RLRun, samples: list | None = None) -> dict[str, float]:
    """Held-out evaluation of the current policy (``policyopt.rl.reporting.evaluate``); ``samples``,
    when given, receives one record per held-out completion (``evaluate``)."""
    cfg = run.spec.config
    with jax.set_mesh(run.spec.mesh):
        graphdef, params = iteration.sampler_weights(run.spec, run.run_state.policy.params)
        return evaluate(
            graphdef,
            params,
            run.eval_records,
            run.spec.tokenizer,
            max_new_tokens=cfg.sampling.max_new_tokens,
            batch_size=cfg.eval.batch_size,
            prompt_buckets=tuple(cfg.batch.prompt_buckets),
            k=cfg.eval.k,
            temperature=cfg.eval.temperature,
            decode_segments=cfg.sampling.decode_segments,
            rng=jax.random.fold_in(run.run_state.rng, 10**9 + run.run_state.iteration),
            spec=build.correctness_spec(cfg),
            num_workers=cfg.reward.num_workers,
            samples=samples,
        )


def run_rl(
    config,
    workdir: str,
    *,
    num_iterations: int | None = None,
    quiet: bool = False,
    recipe: str | None = None,
) -> dict:
    """Trains with RL for ``config.train.num_iterations`` iterations (resuming if possible).

    Writes to ``workdir``: ``config.json`` (resolved config), ``metrics.jsonl`` and
    ``tensorboard/`` (one record per iteration), ``eval.jsonl`` (evaluations),
    ``checkpoints/`` (orbax).

    Args:
      config: the typed config, or a locked recipe config (``configs/*.py``).
      workdir: the run directory.
      num_iterations: stop after this many iterations in total (default from config).
      quiet: no console output (banner, progress line, samples).
      recipe: what the banner names as the run's recipe (the command line's ``--config``).

    SIGINT / SIGTERM stop the run with a checkpoint (``RunLoop``): at the next iteration
    boundary, or (engine, one process) at the engine's next decode call, the iteration
    in progress dropped; the summary's ``"interrupted"`` then names the signal.

    Returns:
      ``{"iteration", "metrics" (last iteration), "eval" (last evaluation),
      "eval_history" (list), "run" (the RLRun), "interrupted" (signal name or None)}``.
    """
    config = typed(config)
    total = config.train.num_iterations if num_iterations is None else num_iterations
    with build.undo_workdir_on_failure(workdir):  # a failed build leaves nothing behind
        run = build_run(config, workdir, lock=True)
    loop = RunLoop(run, total, quiet=quiet, recipe=recipe)
    try:
        loop.begin()
        loop.attach(run.spec.engine)
        while run.run_state.iteration < total and not loop.stopping:
            data_state = run.spec.prompts.get_state()  # the iteration's start, if it is cut short
            try:
                metrics = run.step()
            except GenerationStopped:
                loop.stopped_in_iteration(save=lambda: save(run, data_state))
                break
            loop.after_iteration(metrics, save=lambda: save(run))
        loop.end()
    finally:
        loop.close()
    return loop.summary()


class RunLoop:
    """The bookkeeping around the iterations of a run, shared by ``run_rl`` and
    ``async_rl.run_async_rl``: ``config.json``, metrics (JSONL, TensorBoard, console),
    evaluation and checkpoint cadence, and the summary the two return.

    Use: ``begin()`` (evaluates at iteration 0), ``after_iteration(metrics, save)`` after
    each iteration (``run.run_state.iteration`` already advanced), ``end()`` (evaluates the
    final iteration if nothing has), ``close()`` in a ``finally``, then ``summary()``.

    A resumed run continues its files: records of ``metrics.jsonl`` and ``eval.jsonl``
    after the checkpoint's iteration (written before a crash, about to be written again)
    are removed, as are TensorBoard's; a run that starts at iteration 0 starts them
    afresh. An evaluation that ``eval.jsonl`` holds at the checkpoint's iteration (the
    parameters it evaluated are the checkpoint's) is the run's last one and is not run
    again: a finished run resumed is evaluated once, ever. Checkpoints are saved before
    the evaluation of their iteration, so a failed evaluation loses no training.
    """

    def __init__(self, run: RLRun, total: int, *, quiet: bool = False, recipe: str | None = None):
        config, workdir = run.spec.config, run.workdir
        self.run, self.total, self.config = run, total, config
        # Process 0 writes the files and the console line (every process computes the same
        # records: multi-process jobs run the host side identically on each).
        primary = sharding.is_primary()
        self.console = primary and not quiet
        if self.console:
            resumed = run.checkpointer.latest_step() is not None
            start = report.starting_point(
                config, run.checkpointer.directory, run.run_state.iteration if resumed else None
            )
            print(
                report.banner(
                    config,
                    workdir,
                    recipe=recipe,
                    mesh=run.spec.mesh,
                    start=start,
                    num_params=report.parameter_count(run.run_state.policy.params)
                    + report.parameter_count(run.spec.weights and run.spec.weights.frozen),
                    trainable=(
                        report.parameter_count(run.run_state.policy.params)
                        if run.spec.weights
                        else None
                    ),
                    critic_params=(
                        report.parameter_count(run.run_state.critic.params)
                        if config.critic.init_checkpoint
                        else None
                    ),
                    total=total,
                ),
                flush=True,
            )
        for warning in report.advisories(config, report.user_fields(recipe)):
            self._warn(warning)
        self.short_lambda_checked = False  # report.short_lambda_warning, once per run
        if primary:
            with open(os.path.join(workdir, "config.json"), "w") as f:
                f.write(config.to_json(indent=2, sort_keys=True))
        resume_step = run.run_state.iteration if run.run_state.iteration else -1
        self.writer = MetricsWriter(
            workdir,
            tensorboard="tensorboard" in parse_loggers(config.train.loggers),
            enabled=primary,
            resume_step=resume_step,
            loggers=open_loggers(config.train.loggers, workdir, config_json(config))
            if primary
            else (),
        )
        self.eval_writer = MetricsWriter(
            workdir,
            filename="eval.jsonl",
            tensorboard=False,
            enabled=primary,
            resume_step=resume_step,
        )
        self.progress = (
            None if (quiet or not primary) else Progress(total, start_step=run.run_state.iteration)
        )
        self.skipped_updates = SkippedUpdates(
            config.train.max_skipped_updates, _guarded_states(run)
        )
        self.history: list[dict] = []
        self.metrics: dict = {}
        self.evaluating = config.eval.num_prompts > 0
        self.samples = MetricsWriter(
            workdir,
            filename="samples.jsonl",
            tensorboard=False,
            enabled=primary,
            resume_step=resume_step,
        )
        self.eval_samples = MetricsWriter(
            workdir,
            filename="eval_samples.jsonl",
            tensorboard=False,
            enabled=primary,
            resume_step=resume_step,
        )
        # The pass@1 the console shows, with the iteration it was measured at: after a
        # resume, the last one eval.jsonl holds (at or before the checkpoint's iteration).
        self.shown_eval = read_last_value(self.eval_writer.path, "eval/pass@1") if primary else None
        self.stop = GracefulStop(
            "stopping after this iteration, or at the engine's next decode call (a "
            "checkpoint is saved); Ctrl-C again to stop at once"
        )
        self.stopped_by: str | None = None  # the signal that stopped the run (process 0's)
        self._attached: list = []  # objects whose should_stop is this loop's (attach)
        self.uninformative_streak, self.first_iteration = 0, True
        self._first_start, self._first_counts = time.perf_counter(), compile_counts()
        if (
            run.run_state.iteration
            and run.last_eval_iteration != run.run_state.iteration
            and build.same_evaluation(run.resumed_config, config)
        ):
            # Process 0's log decides for every process (evaluating is a collective).
            logged = None
            if primary:
                logged = read_step_record(
                    self.eval_writer.path, run.run_state.iteration, prefix="eval/"
                )
            logged = sharding.broadcast_json(logged)
            if logged is not None:
                run.last_eval, run.last_eval_iteration = logged, run.run_state.iteration

    def _warn(self, message: str) -> None:
        """A warning on the console (``warning: ...``), or in the log when quiet."""
        if self.console:
            print(f"warning: {message}", file=sys.stderr, flush=True)
        else:
            logging.warning("%s", message)

    @property
    def stopping(self) -> bool:
        """A SIGINT / SIGTERM asked the run to stop (after a checkpoint): as process 0
        received it, polled once per iteration (``_poll_stop``)."""
        return self.stopped_by is not None

    def attach(self, target) -> None:
        """Lets a SIGINT / SIGTERM reach ``target`` (an ``Engine`` or ``AsyncGenerator``;
        None: nothing) in the middle of an iteration: its ``should_stop`` becomes this
        loop's request until ``close``, and it raises ``GenerationStopped``
        (``stopped_in_iteration``). One process only: on several, every process must
        stop after the same iteration (``_poll_stop``), so the stop waits for it."""
        if target is None or jax.process_count() > 1:
            return
        target.should_stop = lambda: self.stop.requested
        self._attached.append(target)

    def stopped_in_iteration(self, save) -> None:
        """A stop that cut an iteration short (``GenerationStopped``): nothing of it is
        kept; the run is saved (``save()``) at its last complete iteration unless that
        checkpoint exists, and ends as a stop does."""
        run = self.run
        self.stopped_by = self.stop.signal_name or "stop"
        if run.run_state.iteration not in run.checkpointer.all_steps():
            save()
        if self.console:
            path = os.path.join(run.checkpointer.directory, str(run.run_state.iteration))
            print(
                f"{self.stopped_by}: stopped during iteration {run.run_state.iteration + 1} (its "
                f"generation cut short); checkpoint {path}; rerun the same command to resume",
                flush=True,
            )

    def _poll_stop(self) -> None:
        """Every process takes process 0's answer (a collective on several processes), so
        that all of them stop after the same iteration."""
        self.stopped_by = sharding.broadcast_json(self.stop.signal_name)

    def evaluate(self) -> dict:
        run = self.run
        if self.console and not self.history:
            print(
                f"evaluating {len(run.eval_records)} held-out prompts at iteration "
                f"{run.run_state.iteration} (the sampler compiles first, or loads from the "
                "compilation cache) ...",
                flush=True,
            )
        samples: list[dict] = []
        result = evaluate_run(run, samples=samples)
        self.eval_writer.write(run.run_state.iteration, result)
        self.writer.write(run.run_state.iteration, result)
        self.eval_samples.write_rows(run.run_state.iteration, samples[:EVAL_SAMPLES_LOGGED])
        self.writer.write_text(
            run.run_state.iteration, "samples/eval", samples[:EVAL_SAMPLES_LOGGED]
        )
        self.history.append({"iteration": run.run_state.iteration, **result})
        if self.progress:
            print(
                f"eval @ {run.run_state.iteration}: "
                + " ".join(f"{k} {v:.4f}" for k, v in result.items()),
                flush=True,
            )
        run.last_eval, run.last_eval_iteration = result, run.run_state.iteration
        if "eval/pass@1" in result:
            self.shown_eval = (run.run_state.iteration, result["eval/pass@1"])
        return result

    def _log_samples(self) -> None:
        """At iteration 1 and every ``train.sample_every`` iterations (K, 2K, ...), the
        first ``train.sample_prompts`` prompts' completions with rewards and verdicts:
        samples.jsonl, TensorBoard text, and one of them on the console."""
        run, train = self.run, self.config.train
        every = train.sample_every
        due = every and (run.run_state.iteration == 1 or run.run_state.iteration % every == 0)
        if not (due and run.last_samples):
            return
        rows = report.sample_rows(
            **run.last_samples,
            step=run.run_state.iteration,
            limit=train.sample_prompts * self.config.batch.group_size,
        )
        self.samples.write_rows(run.run_state.iteration, rows)
        self.writer.write_text(run.run_state.iteration, "samples/train", rows)
        if self.progress and rows:
            row = rows[0]
            verdict = row.get("status", "correct" if row["correct"] else "wrong")
            print(
                f"sample @ {run.run_state.iteration}: {row['prompt'][-60:]!r} -> "
                f"{row['completion'][:120]!r} reward {row['reward']:.3g} ({verdict})",
                flush=True,
            )

    def _watch_informative(self, metrics: dict) -> None:
        """Counts iterations in a row whose batch has no informative group and warns once a
        streak reaches ``train.zero_variance_patience``."""
        patience = self.config.train.zero_variance_patience
        if "batch/informative_groups" not in metrics:
            return
        informative = metrics["batch/informative_groups"] > 0
        self.uninformative_streak = 0 if informative else self.uninformative_streak + 1
        if patience and self.uninformative_streak == patience:
            accuracy = metrics.get("reward/accuracy", float("nan"))
            self._warn(
                f"no informative group in the last {patience} iterations: every group's rewards "
                f"are equal (accuracy {accuracy:.3g}), so every "
                "advantage is 0 and nothing trains. A policy that solves nothing (e.g. random "
                "weights) needs a start that sometimes succeeds (config.init_checkpoint of an SFT "
                "run) or a denser reward."
            )

    def _watch_lambda(self) -> None:
        """Warns once when the first batch's responses keep a length-adaptive lambda near 0
        (``report.short_lambda_warning``)."""
        if self.short_lambda_checked or self.run.last_round is None:
            return
        self.short_lambda_checked = True
        warning = report.short_lambda_warning(self.config, self.run.last_round.mask.sum(axis=1))
        if warning:
            self._warn(warning)

    @property
    def last_eval(self) -> dict:
        return self.run.last_eval

    def begin(self) -> None:
        """Evaluates at iteration 0, and at a resumed iteration on the evaluation cadence
        whose evaluation is not in the log (the run stopped during it)."""
        run, every = self.run, self.config.train.eval_every
        due = run.run_state.iteration == 0 or (
            every and run.run_state.iteration % every == 0 and run.run_state.iteration < self.total
        )
        self.stop.__enter__()
        if self.evaluating and due and run.last_eval_iteration != run.run_state.iteration:
            self.evaluate()
        self._poll_stop()
        if self.console and run.run_state.iteration < self.total and not self.stopping:
            phase = report.critic_phase(self.config, run.run_state.iteration)
            if phase:
                print(phase, flush=True)
            print(
                f"iteration {run.run_state.iteration + 1}: compiling the sampler and the update "
                "steps (or loading them from the compilation cache) ...",
                flush=True,
            )
            self._first_start = time.perf_counter()
            self._first_counts = compile_counts()

    def after_iteration(self, metrics: dict, save) -> None:
        """Writes ``metrics``, then evaluates and checkpoints (``save()``) when due."""
        run, train = self.run, self.config.train
        if run.last_round is not None and not np.isnan(metrics.get("batch/reward_mean", 0.0)):
            metrics["batch/informative_groups"] = report.informative_fraction(
                run.last_round.rewards, self.config.batch.group_size, run.last_round.scored_rows()
            )
        self.metrics = metrics
        self.writer.write(run.run_state.iteration, metrics)
        self.skipped_updates.update(run.run_state.iteration, _guarded_states(run))
        if self.console and self.first_iteration:
            seconds = time.perf_counter() - self._first_start
            (compiled, loaded), (compiled0, loaded0) = compile_counts(), self._first_counts
            line = report.first_iteration_line(seconds, compiled - compiled0, loaded - loaded0)
            print(line, flush=True)
        if self.progress and self.first_iteration and run.run_state.iteration % train.log_every:
            self.progress.start_steady(
                run.run_state.iteration
            )  # the ETA leaves the compiling one out
        self.first_iteration = False
        if self.progress and run.run_state.iteration % train.log_every == 0:
            shown = {k: v for k, v in metrics.items() if not k.startswith("eval/")}
            suffix = ""
            if self.shown_eval is not None:  # the last evaluation, with its iteration
                suffix = f"pass@1 {self.shown_eval[1]:.3f} (it {self.shown_eval[0]})"
            self.progress.update(run.run_state.iteration, shown, suffix=suffix)
        self._log_samples()
        self._watch_informative(metrics)
        self._watch_lambda()
        phase = report.critic_phase(self.config, run.run_state.iteration, metrics)
        if phase and self.console:
            print(phase, flush=True)
        self._poll_stop()
        final = run.run_state.iteration == self.total
        every = train.eval_every
        if final or run.run_state.iteration % train.checkpoint_every == 0 or self.stopping:
            save()
        if self.stopping:  # the evaluation too waits for the resumed run (``end``)
            if self.console:
                path = os.path.join(run.checkpointer.directory, str(run.run_state.iteration))
                print(
                    f"{self.stopped_by}: stopped at iteration {run.run_state.iteration}; "
                    f"checkpoint {path}; rerun the same command to resume",
                    flush=True,
                )
            return
        if self.evaluating and ((every and run.run_state.iteration % every == 0) or final):
            self.evaluate()

    def end(self) -> None:
        # A resumed run that was not evaluated at its iteration (a finished run whose
        # final evaluation failed, or that ran with eval.num_prompts=0) is evaluated here.
        # A stopped run is not: it resumes where it stopped.
        unevaluated = self.run.last_eval_iteration != self.run.run_state.iteration
        if self.evaluating and unevaluated and not self.stopping:
            self.evaluate()

    def close(self) -> None:
        self.stop.__exit__()
        for target in self._attached:
            target.should_stop = None
        self._attached = []
        for writer in (self.writer, self.eval_writer, self.samples, self.eval_samples):
            writer.close()

    def summary(self, **extra) -> dict:
        return {
            "iteration": self.run.run_state.iteration,
            "metrics": self.metrics,
            "eval": self.last_eval,
            "eval_history": self.history,
            "run": self.run,
            "interrupted": self.stopped_by,
            **extra,
        }
