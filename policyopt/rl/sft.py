"""Supervised fine-tuning on worked solutions: the cold start that gives RL its base policy.

Next-token training on (prompt, solution) pairs, loss on the response tokens only:

    L = - sum_{i,t} m_{i,t} log pi(y_{i,t} | x_i, y_{i,<t}) / sum_{i,t} m_{i,t},

with ``m`` the response mask (solution tokens and EOS; prompt and padding excluded).
It shares the RL code: the training layout and forward (``policyopt.rl.batch`` /
``learner.forward_log_probs``), the guarded optimiser step, the grain pipeline (whose
iterator state is checkpointed) and the orbax checkpoint format, so
``config.init_checkpoint = <sft workdir>/checkpoints`` starts RL from the result.

    summary = run_sft(config, workdir)                       # config.sft.* settings
    summary = run_sft(config, workdir2, steps=100, init_checkpoint=workdir + "/checkpoints")

Devices as in RL (``policyopt.rl.loop.trainer``): one mesh from ``config.mesh``, the training
state placed by the parameters' logical axes, batch rows split over ``data`` x ``fsdp``
when their number divides, every jitted call under ``jax.set_mesh``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from policyopt import sharding
from policyopt.checkpoint import Checkpointer, lock_workdir
from policyopt.config import Optim, typed
from policyopt.data.pipeline import as_record, make_pipeline
from policyopt.loggers import config_json, open_loggers, parse_loggers
from policyopt.losses import aggregate
from policyopt.metrics import MetricsWriter, Progress, read_step_record
from policyopt.rl.loop import build
from policyopt.rl.reporting import report
from policyopt.rl.reporting.evaluate import evaluate
from policyopt.rl.update.learner import (
    TrainState,
    forward_log_probs,
    guarded_update,
    optimizer_of,
    place_state,
)
from policyopt.runtime import GracefulStop


def sft_layout(
    prompt_tokens: np.ndarray,
    prompt_lengths: np.ndarray,
    response_tokens: np.ndarray,
    response_lengths: np.ndarray,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Right-padded prompts and responses (the pipeline's batches) -> training layout.

    Returns:
      ``tokens``, ``positions``, ``attention_mask`` ``[B, P + R]`` (prompt right-aligned)
      and ``mask`` ``[B, R]`` (1 on the response tokens).
    """
    batch, width = prompt_tokens.shape
    index = np.arange(width)[None, :]
    shift = width - prompt_lengths[:, None]
    aligned = np.take_along_axis(prompt_tokens, (index - shift) % width, axis=1)
    prompt_real = index >= shift
    aligned = np.where(prompt_real, aligned, pad_id)
    response_width = response_tokens.shape[1]
    mask = np.arange(response_width)[None, :] < response_lengths[:, None]
    tokens = np.concatenate([aligned, np.where(mask, response_tokens, pad_id)], axis=1)
    positions = np.concatenate(
        [
            np.where(prompt_real, index - shift, 0),
            prompt_lengths[:, None] + np.arange(response_width)[None, :],
        ],
        axis=1,
    )
    attention_mask = np.concatenate([prompt_real, mask], axis=1)
    return dict(
        tokens=tokens.astype(np.int32),
        positions=positions.astype(np.int32),
        attention_mask=attention_mask.astype(np.int32),
        mask=mask.astype(np.float32),
    )


def sft_loss(graphdef, params, batch: dict) -> tuple[jax.Array, dict]:
    """Mean negative log-likelihood of the response tokens (token mean over the batch)."""
    fwd = forward_log_probs(
        graphdef,
        params,
        batch["tokens"],
        batch["positions"],
        batch["attention_mask"],
        batch["mask"].shape[1],
    )
    nll = aggregate(-fwd.log_probs, batch["mask"], "token_mean")
    return nll, {"sft/nll": jax.lax.stop_gradient(nll), "sft/tokens": jnp.sum(batch["mask"])}


_SFT_UPDATES: dict = {}


def sft_update_fn(graphdef, optim: Optim, *, decay_steps: int = 0, min_lr_ratio: float = 0.0):
    """``(update, optimizer)``: the jitted SFT step ``update(state, batch) -> (state,
    metrics)`` (state donated, non-finite guard), cached per (model structure, optimiser)
    so that a continued-SFT control run reuses the compiled step. ``optim``: SFT's optimiser
    settings (``sft_optim``), ``decay_steps`` and ``min_lr_ratio`` its cosine decay."""
    key = (graphdef, optim, decay_steps, min_lr_ratio)
    if key not in _SFT_UPDATES:
        optimizer, schedule = optimizer_of(
            optim, decay_steps=decay_steps, min_lr_ratio=min_lr_ratio
        )
        loss_fn = lambda p, b: sft_loss(graphdef, p, b)
        update = jax.jit(
            lambda st, b: guarded_update(loss_fn, optimizer, schedule, st, b), donate_argnums=0
        )
        _SFT_UPDATES[key] = (update, optimizer)
    return _SFT_UPDATES[key]


@dataclasses.dataclass
class SFTRun:
    config: Any
    tokenizer: Any
    graphdef: Any
    state: TrainState
    data: Any
    update: Any
    checkpointer: Checkpointer
    mesh: jax.sharding.Mesh  # every array of the run lives on it (config.mesh)
    step: int = 0
    # The config the restored checkpoint was saved under (build.config_record), or None.
    resumed_config: dict | None = None


# The config fields an SFT run reads (build.check_resume_config compares only these; SFT
# trains full weights, model.lora.* is RL's).
SFT_FIELDS = ("seed", "model.", "task.", "batch.", "sft.", "optim.b1", "optim.b2", "optim.eps")
SFT_IGNORED = ("model.lora.",)


def sft_optim(config) -> Optim:
    """SFT's optimiser settings: ``config.sft``'s learning rate, warm-up, weight decay and
    clipping, Adam's betas and eps of ``config.optim`` (the policy's ``router_lr_scale`` is
    the RL policy's lever only)."""
    s = config.sft
    return dataclasses.replace(
        config.optim,
        lr=float(s.lr),
        warmup_steps=int(s.warmup_steps),
        weight_decay=float(s.weight_decay),
        max_grad_norm=s.max_grad_norm,
        router_lr_scale=1.0,
    )


def make_sft_iterator(config, tokenizer, *, seed: int):
    """Batches of (prompt, worked solution) pairs of the task's training split."""
    records = build.task_source(config, "train")
    if not all(as_record(r).get("solution") for r in records):
        t = config.task
        where = repr(t.train_file) if t.train_file else f"task {t.name!r}"
        raise ValueError(
            f"SFT needs a worked solution for every training record; {where} has records "
            "without one (see task.solution_field)"
        )
    buckets = tuple(sorted(set(config.batch.prompt_buckets) | set(config.batch.response_buckets)))
    try:
        pipeline = make_pipeline(
            records,
            batch_size=config.sft.batch_size,
            seed=seed,
            tokenizer=tokenizer,
            include_solution=True,
            length_buckets=buckets,
            max_prompt_length=max(config.batch.prompt_buckets),
            overlong_prompt=config.task.overlong_prompt,
            max_response_length=max(buckets),
            overlong_response=config.sft.overlong_response,
        )
    except ValueError as error:
        raise ValueError(
            f"SFT data: {error} (config.task.overlong_prompt, config.sft.overlong_response; "
            "the solution limit is the largest of batch.prompt_buckets and "
            "batch.response_buckets)"
        ) from None
    return iter(pipeline)


def build_sft(
    config, workdir: str, *, init_checkpoint: str | None = None, lock: bool = False
) -> SFTRun:
    """Mesh, model, optimiser, data; restores ``workdir/checkpoints`` if it holds a
    checkpoint, else starts from ``init_checkpoint`` (full training state: params and
    optimiser), onto the shardings of the initial state. Nothing is written before
    everything that can be checked has been (devices, files, model, data, evaluation
    prompts): only then is ``workdir`` created (and, with ``lock``, locked). ``config``: the
    typed config, or a recipe's ConfigDict (built and checked first)."""
    config = typed(config)
    if init_checkpoint:
        build.check_init_directory(init_checkpoint, "init_checkpoint")
    mesh = build.make_mesh(config)
    tokenizer = build.make_tokenizer(config)
    model = build.make_model(config, tokenizer.vocab_size, mesh, with_lora=False)
    graphdef, params = build.init_params(config, model, mesh)
    s = config.sft
    update, optimizer = sft_update_fn(
        graphdef,
        sft_optim(config),
        decay_steps=int(s.steps) if s.lr_decay == "cosine" else 0,
        min_lr_ratio=float(s.min_lr_ratio),
    )
    state = place_state(TrainState.create(params, optimizer), optimizer, mesh)
    data = make_sft_iterator(config, tokenizer, seed=config.seed)
    if config.eval.num_prompts > 0:  # what the final evaluation reads, before training
        build.eval_records(config, tokenizer)
        build.correctness_spec(config)
    if lock:
        lock_workdir(workdir)  # one process per workdir: a second is refused in one line
    os.makedirs(workdir, exist_ok=True)
    checkpointer = Checkpointer(
        os.path.join(workdir, "checkpoints"), max_to_keep=config.train.keep_checkpoints, owner=True
    )
    run = SFTRun(
        config=config,
        tokenizer=tokenizer,
        graphdef=graphdef,
        state=state,
        data=data,
        update=update,
        checkpointer=checkpointer,
        mesh=mesh,
    )
    target = {"train": run.state}
    if checkpointer.latest_step() is not None:

        def check(step: int, meta: dict) -> None:
            # The config first (a changed shape would fail in the arrays, unnamed), and only
            # what SFT reads: a recipe's RL settings may change under a cached SFT start.
            build.check_resume_config(
                meta.get("config"),
                config,
                checkpointer.directory,
                sections=SFT_FIELDS,
                ignore=SFT_IGNORED,
            )
            build.check_checkpoint_shapes(checkpointer, target, config, step=step, field="resume")

        restored, meta = checkpointer.restore(target, check=check)
        run.state, run.step = restored["train"], int(meta["iteration"])
        run.data.set_state(meta["data"])
        run.resumed_config = meta.get("config")
    elif init_checkpoint:
        with Checkpointer(init_checkpoint) as source:
            restored, meta = source.restore(
                target,
                check=lambda step, _: build.check_checkpoint_shapes(
                    source, target, config, step=step, field="init_checkpoint"
                ),
            )
        run.state, run.step = restored["train"], int(meta["iteration"])
        run.data.set_state(meta["data"])
    return run


def sft_step(run: SFTRun) -> dict[str, float]:
    """One SFT update on the next batch."""
    raw = next(run.data)
    arrays = sft_layout(
        raw["prompt_tokens"],
        raw["prompt_lengths"],
        raw["response_tokens"],
        raw["response_lengths"],
        run.tokenizer.pad_id,
    )
    with jax.set_mesh(run.mesh):
        run.state, metrics = run.update(
            run.state, {k: sharding.shard_rows(v) for k, v in arrays.items()}
        )
    run.step += 1
    return metrics


def save_sft(run: SFTRun) -> None:
    """Checkpoints the run at its current step; a no-op when that step is already saved
    (a run resumed at its last step, e.g. a second ``make demo``)."""
    if run.checkpointer.latest_step() == run.step:
        return
    run.checkpointer.save(
        run.step,
        {"train": run.state},
        {
            "iteration": run.step,
            "data": run.data.get_state(),
            "config": build.config_record(run.config),
        },
    )


def evaluate_policy(
    config, graphdef, params, tokenizer, mesh, *, samples: list | None = None
) -> dict[str, float]:
    """Greedy pass@1 (and mean@k if ``config.eval.k``) on the held-out split, on ``mesh``;
    ``samples``, when given, receives one record per greedy completion (``evaluate``)."""
    records = build.eval_records(config, tokenizer)
    with jax.set_mesh(mesh):
        return evaluate(
            graphdef,
            params,
            records,
            tokenizer,
            max_new_tokens=config.sampling.max_new_tokens,
            batch_size=config.eval.batch_size,
            prompt_buckets=tuple(config.batch.prompt_buckets),
            k=config.eval.k,
            temperature=config.eval.temperature,
            decode_segments=config.sampling.decode_segments,
            rng=jax.random.PRNGKey(config.seed + 1),
            spec=build.correctness_spec(config),
            num_workers=config.reward.num_workers,
            samples=samples,
        )


def run_sft(
    config,
    workdir: str,
    *,
    steps: int | None = None,
    init_checkpoint: str | None = None,
    evaluate_every: int = 0,
    quiet: bool = False,
    recipe: str | None = None,
) -> dict:
    """Trains with SFT until ``steps`` updates in total (default ``config.sft.steps``).

    Resumes from ``workdir/checkpoints`` when possible; otherwise starts from
    ``init_checkpoint`` (another SFT run's checkpoint directory: parameters, optimiser
    state, step and data position all continue, which makes "more SFT" the control of an
    RL run) or from ``config.init_checkpoint`` / a fresh initialisation. Writes
    ``metrics.jsonl``, a checkpoint every ``config.sft.checkpoint_every`` updates and a
    final one, then the final evaluation, under ``workdir``. A finished run resumed
    returns the final evaluation its ``metrics.jsonl`` holds instead of evaluating again
    (records after the checkpoint's step are removed on resume, as in the RL trainer).

    SIGINT / SIGTERM stop it after the current update with a checkpoint (no evaluation);
    ``"interrupted"`` then names the signal. ``recipe``: what the start-up banner names.

    Returns:
      ``{"step", "metrics", "eval" (final greedy pass@1 etc., if config.eval.num_prompts),
      "graphdef", "params", "checkpoint_dir", "interrupted"}``.
    """
    config = typed(config)
    total = config.sft.steps if steps is None else steps
    if config.sft.lr_decay == "cosine" and total > config.sft.steps and not config.sft.min_lr_ratio:
        raise ValueError(
            f"{total} SFT updates with sft.lr_decay='cosine' to 0 at sft.steps="
            f"{config.sft.steps}: the updates past it would train at learning rate 0; set "
            "sft.min_lr_ratio > 0 to continue at lr * min_lr_ratio"
        )
    with build.undo_workdir_on_failure(workdir):  # a failed build leaves nothing behind
        run = build_sft(config, workdir, init_checkpoint=init_checkpoint, lock=True)
    primary = sharding.is_primary()  # process 0 writes (multi-process jobs)
    # Records after the checkpoint's step are written again (see trainer.RunLoop).
    writer = MetricsWriter(
        workdir,
        tensorboard="tensorboard" in parse_loggers(config.train.loggers),
        enabled=primary,
        resume_step=run.step if run.step else -1,
        loggers=open_loggers(config.train.loggers, workdir, config_json(config), kind="sft")
        if primary
        else (),
    )
    progress = (
        None
        if (quiet or not primary)
        else Progress(total, start_step=run.step, keys=(("sft/nll", "nll"),))
    )
    if progress:
        resumed = run.checkpointer.latest_step() is not None
        start_text = report.starting_point(
            config, run.checkpointer.directory, run.step if resumed else None
        )
        if not resumed and init_checkpoint:
            start_text = f"continuing SFT checkpoint {init_checkpoint} (step {run.step})"
        print(
            report.banner(
                config,
                workdir,
                recipe=recipe,
                mesh=run.mesh,
                start=start_text,
                num_params=report.parameter_count(run.state.params),
                total=total,
                kind="SFT",
            ),
            flush=True,
        )
        if run.step < total:
            print(
                "compiling the SFT step, or loading it from the compilation cache (the first "
                "update's time includes it) ...",
                flush=True,
            )
    metrics, stop, result = {}, GracefulStop(), {}
    try:
        stop.__enter__()
        start = time.perf_counter()
        while run.step < total and not stop.requested:
            metrics = sft_step(run)
            if run.step % config.train.log_every == 0 or run.step == total:
                metrics = writer.write(
                    run.step, {**metrics, "time/elapsed_s": time.perf_counter() - start}
                )
                if progress and (run.step % max(1, total // 20) == 0 or run.step == total):
                    progress.update(run.step, metrics)
            if evaluate_every and run.step % evaluate_every == 0 and run.step < total:
                result = evaluate_policy(
                    config, run.graphdef, run.state.params, run.tokenizer, run.mesh
                )
                writer.write(run.step, result)
            every = config.sft.checkpoint_every
            if every and run.step % every == 0 and run.step < total:
                save_sft(run)
        save_sft(run)  # before the evaluation: a failed one loses no training
        if stop.requested and progress:
            print(
                f"{stop.signal_name}: stopped at step {run.step}; checkpoint "
                f"{os.path.join(run.checkpointer.directory, str(run.step))}; rerun the same "
                "command to resume",
                flush=True,
            )
        if (
            config.eval.num_prompts > 0
            and not stop.requested
            and build.same_evaluation(run.resumed_config, config)
        ):
            # Process 0's log decides for every process (evaluating is a collective).
            logged = read_step_record(writer.path, run.step, prefix="eval/") if primary else None
            result = sharding.broadcast_json(logged) or {}
        if config.eval.num_prompts > 0 and not result and not stop.requested:
            result = evaluate_policy(
                config, run.graphdef, run.state.params, run.tokenizer, run.mesh
            )
            writer.write(run.step, result)
            if progress:
                print(
                    f"sft eval @ {run.step}: "
                    + " ".join(f"{k} {v:.4f}" for k, v in result.items()),
                    flush=True,
                )
    finally:
        stop.__exit__()
        writer.close()
    return {
        "step": run.step,
        "metrics": metrics,
        "eval": result,
        "graphdef": run.graphdef,
        "params": run.state.params,
        "checkpoint_dir": run.checkpointer.directory,
        "interrupted": stop.signal_name,
    }
