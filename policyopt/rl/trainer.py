"""The RL loop, in one place: sample -> score -> dynamic sampling -> old log-probs ->
advantages -> epochs x minibatches of ``update`` -> metrics, evaluation, checkpoint.

    summary = run_rl(config, workdir)        # resumes from workdir/checkpoints if present

Each arrow is a pure jitted function (``policyopt.sampling.generate_fn``,
``Learner.log_probs``, ``Learner.update``) or host-side bookkeeping on numpy arrays
(scoring, dynamic sampling, advantages). Shapes are bucketed (``policyopt.rl.batch``)
so each jitted function compiles a bounded number of times.

Determinism and resume: the rng of iteration ``i`` is ``fold_in(run_key, i)``; the
checkpoint holds the parameters, the optimiser state, the update counters, the run key,
the iteration and the data iterator's state, so rerunning the same command continues
exactly where the last checkpoint left off (N + resume + N iterations give the
parameters of 2N uninterrupted iterations bit for bit; ``tests/test_rl_trainer.py``).

Critic methods (``config.algo.advantage = "gae"``: PPO, VC-PPO, VAPO): a value model
(``policyopt.rl.critic``) scores the rollout, GAE gives per-token advantages and value
targets, and the critic is updated on the same minibatches as the policy, with its own
optimiser; during the first ``config.critic.pretrain_iterations`` iterations only the
critic is updated (value pretraining / warm-up), on Monte-Carlo targets (lambda_critic =
1, VC-PPO; ``gae_settings``), and the policy stays bit-identical (its old-log-prob,
reference and routing forward passes are skipped then). The critic's parameters
and optimiser state are part of the checkpoint.

Routing replay (MoE): ``"R2"`` replays, in every update forward, the routing recorded by
the old-log-prob forward; ``"R3"`` replays the sampler's routing in the old-log-prob
forward and in every update forward (docs/algorithms.md). Only the expert selection is
replayed; the model recomputes the gate weights from the current router, as its own
routing does: renormalised over the replayed k experts when the model has
``norm_topk_prob`` (Qwen3-30B-A3B; docs/algorithms.md "Routing replay"), the full-softmax
probabilities of those experts otherwise, so that a replay of the model's own choice
reproduces its forward exactly.

Sequence packing (``config.batch.pack``): the old-log-prob, reference and value passes
(per row chunk) and every update (per minibatch) run the model on packed rows, the real
tokens of the chunk's rows first-fit-decreasing into rows of ``batch.pack_tokens`` slots
with segment ids (``policyopt.rl.packing``, ``pack_rows``); their per-token results come
back to the padded rows, so advantages, losses and routing replay see the padded layout
and give the same update. ``batch/padding_fraction`` (padded rows) and
``batch/packed_padding_fraction`` (the updates' packed rows) are logged. The routing
metrics' extra forwards stay padded.

Sampler-trainer mismatch: with ``algo.old_log_probs = "trainer"`` every iteration logs
``offpolicy/*`` (``rollout_correction``) and applies the configured corrections:
truncated importance weights (``algo.tis_cap``, ``tis_level``) and rejection sampling
(``algo.rs_level``, ``rs_upper``, ``rs_lower``, ``rs_veto``), whose kept tokens become
``Batch.loss_mask``, the policy loss's mask (the critic keeps ``Batch.mask``).

Devices: a run lives on one mesh (``config.mesh``, ``policyopt.sharding``; the default
puts every device on ``data``, which on one CPU is today's single device). The policy is
built on the mesh (``build.make_model``: each device receives only its shards), and
parameters, optimiser states and the critic are sharded by the parameters' logical axes
(``learner.place_state``), the run key is replicated, and the rows of every batch are
split over ``data`` x ``fsdp`` when their number divides, else replicated
(``sharding.shard_rows``). Every jitted call runs under ``jax.set_mesh(run.mesh)``, so
the model's activation constraints apply. On several processes (hosts) each runs this
same loop: rollouts come back gathered from all of them (``sharding.to_host``), each process
scores its share of the rows and receives the others' scores (``score_batch(...,
across_processes=True)``), every process builds the same batch, and process 0 writes the logs
(``policyopt.sharding``; ``tests/test_multihost.py``). Asynchronous RL is single-process.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from policyopt import sharding
from policyopt.advantages import outcome_advantages
from policyopt.checkpoint import Checkpointer, lock_workdir
from policyopt.data.pipeline import make_pipeline
from policyopt.losses import offpolicy_metrics, rejection_mask, truncated_importance_weights
from policyopt.metrics import MetricsWriter, Progress, read_last_value, read_step_record
from policyopt.rewards.batch import merge_metrics, score_batch
from policyopt.rl import build, report
from policyopt.rl.batch import (Batch, DynamicSampler, bucket, minibatch_indices, round_from_rollout,
                                shard_batch, take_rows, truncated_rows)
from policyopt.rl.critic import Critic, CriticConfig, GAEConfig, critic_optim, gae_targets, get_critic
from policyopt.rl.evaluate import decode, evaluate, task_accuracies
from policyopt.rl.learner import Learner, LossConfig, OptimConfig, TrainState, get_learner, place_state
from policyopt.rl.packing import PackedLayout, pack_layout
from policyopt.rl.routing import routing_metrics
from policyopt.runtime import GracefulStop
from policyopt.sampling import SamplingConfig, generate_fn, sampling_method


@dataclasses.dataclass
class RLRun:
    """The state of an RL run between iterations (built by ``build_run``)."""

    config: Any
    workdir: str
    tokenizer: Any
    graphdef: Any
    learner: Learner
    state: TrainState
    ref_params: Any  # frozen initial parameters (KL), or None
    rng: jax.Array  # run key; iteration i uses fold_in(rng, i)
    data: Any  # grain iterator over prompt batches (get_state / set_state)
    eval_records: list
    sampling_config: SamplingConfig
    reward_spec: Any
    checkpointer: Checkpointer
    mesh: jax.sharding.Mesh  # every array of the run lives on it (config.mesh)
    iteration: int = 0  # iterations completed
    # The last iteration's sampled batch (host Round) and update Batch, for inspection.
    last_round: Any = None
    last_batch: Any = None
    # Critic methods (algo.advantage = "gae"): the value model's jitted steps and its
    # TrainState (parameters, optimiser state, counters); None otherwise.
    critic: Critic | None = None
    critic_state: TrainState | None = None
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
    # Continuous-batching engine (config.sampling.engine_kv_tokens > 0), or None.
    engine: Any = None


def make_prompt_iterator(config, records, *, seed: int):
    """The grain iterator of RL prompt batches (n_prompts prompts, bucketed, shuffled) over
    ``records`` (a random-access sequence: ``build.task_source``). Every prompt is
    tokenised once when it is built: prompts longer than the largest prompt bucket raise
    there, naming the record, or are dropped or truncated (``task.overlong_prompt``)."""
    buckets = tuple(config.batch.prompt_buckets)
    policy = config.task.overlong_prompt
    pipeline = make_pipeline(records, batch_size=config.batch.n_prompts, seed=seed,
                             tokenizer=build.make_tokenizer(config), length_buckets=buckets,
                             max_prompt_length=max(buckets),
                             overlong_prompt=policy)
    return iter(pipeline)


def build_run(config, workdir: str, *, check_config: bool = True) -> RLRun:
    """Builds the mesh, model, learner, data and the initial state (placed on the mesh);
    restores the latest checkpoint of ``workdir/checkpoints`` when there is one, onto the
    same shardings (refusing one saved under another config unless ``check_config`` is
    False: see ``restore``)."""
    os.makedirs(workdir, exist_ok=True)
    mesh = build.make_mesh(config)
    tokenizer = build.make_tokenizer(config)
    model = build.make_model(config, tokenizer.vocab_size, mesh)
    dispatches = (model.config.moe_dispatch, model.config.moe_decode_dispatch)
    if model.config.is_moe and "capacity" in dispatches:
        raise ValueError(
            "config.model.moe_dispatch (or moe_decode_dispatch) 'capacity' drops token copies "
            "by their position in the whole forward call, so a response's log-probs depend on "
            "the rows it is batched with: the sampler (R rows per step), the old-log-prob "
            "pass and each minibatch would compute different policies (ratio != 1 at the "
            "first update) and routing replay does not replay the drops. RL needs a dropless "
            "dispatch ('ragged' or 'blocked').")
    graphdef, params = build.init_params(config, model, mesh)
    learner = get_learner(graphdef, LossConfig.from_config(config), OptimConfig.from_config(config.optim))
    ref_params = jax.tree.map(jnp.copy, params) if config.algo.kl_beta > 0 else None
    state = place_state(learner.init_state(params), learner.optimizer, mesh)
    rng = sharding.put(jax.random.PRNGKey(config.seed), sharding.replicated(mesh))
    data = make_prompt_iterator(config, build.task_source(config, "train"), seed=config.seed)
    eval_records = build.eval_records(config, tokenizer)
    s = config.sampling
    sampling_config = SamplingConfig(
        max_new_tokens=s.max_new_tokens, method=sampling_method(s.temperature, s.top_k, s.top_p),
        eos_id=tokenizer.eos_id, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
        num_samples=config.batch.group_size,
        decode_segments=s.decode_segments)
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"),
                                max_to_keep=config.train.keep_checkpoints)
    run = RLRun(config=config, workdir=workdir, tokenizer=tokenizer, graphdef=graphdef,
                learner=learner, state=state, ref_params=ref_params, rng=rng, data=data,
                eval_records=eval_records, sampling_config=sampling_config,
                reward_spec=build.reward_spec(config), checkpointer=checkpointer, mesh=mesh)
    if s.engine_kv_tokens > 0:
        run.engine = _make_engine(config, model, graphdef, sampling_config, mesh)
    if config.algo.advantage == "gae":
        run.critic = get_critic(graphdef, CriticConfig.from_config(config), critic_optim(config))
        critic_state = run.critic.init_state(params, model.config.hidden_size)
        run.critic_state = place_state(critic_state, run.critic.optimizer, mesh)
    if checkpointer.latest_step() is not None:
        restore(run, check_config=check_config)
    return run


def _make_engine(config, model, graphdef, sampling_config: SamplingConfig, mesh):
    """The continuous-batching engine of config.sampling (one device only for now)."""
    from policyopt.engine import Engine, EngineConfig

    if mesh.size > 1:
        raise ValueError(f"config.sampling.engine_kv_tokens > 0 decodes on one device; the "
                         f"mesh has {mesh.size}: set it 0 (decoding a sharded model: issue 23)")
    s = config.sampling
    rows = s.engine_rows or config.batch.n_prompts * config.batch.group_size
    return Engine(model, EngineConfig(kv_tokens=s.engine_kv_tokens, rows=rows,
                                      page_size=s.engine_page_size), sampling_config,
                  graphdef=graphdef)


def _checkpoint_state(run: RLRun) -> dict:
    state = {"train": run.state, "rng": run.rng}
    if run.critic_state is not None:
        state["critic"] = run.critic_state
    return state


def checkpoint_meta(run: RLRun, data_state) -> dict:
    """The JSON record saved beside the arrays: iteration, data position and the config
    (checked on resume, ``build.check_resume_config``)."""
    return {"iteration": run.iteration, "data": data_state, "config": build.config_record(run.config)}


def save(run: RLRun) -> None:
    """Checkpoints the run at its current iteration."""
    run.checkpointer.save(run.iteration, _checkpoint_state(run), checkpoint_meta(run, run.data.get_state()))


def restore(run: RLRun, step: int | None = None, *, check_config: bool = True) -> None:
    """Restores parameters, optimiser, counters, run key, iteration and data position (and
    the critic's parameters, optimiser and counters); refuses a checkpoint saved under
    another config (``build.check_resume_config``) unless ``check_config`` is False
    (``experiments/eval.py``, which only reads the parameters)."""
    if check_config:  # before the arrays: a changed shape would fail there, unnamed
        meta = run.checkpointer.meta(step)
        build.check_resume_config(meta.get("config"), run.config, run.checkpointer.directory)
    build.check_checkpoint_shapes(run.checkpointer, _checkpoint_state(run), run.config, step=step,
                                  field="resume")
    restored, meta = run.checkpointer.restore(_checkpoint_state(run), step)
    run.state, run.rng = restored["train"], restored["rng"]
    if run.critic_state is not None:
        run.critic_state = restored["critic"]
    run.iteration = int(meta["iteration"])
    run.data.set_state(meta["data"])
    run.last_eval, run.last_eval_iteration, run.resumed_config = {}, None, meta.get("config")


def _sample_batch(run: RLRun, key: jax.Array) -> tuple[Any, dict]:
    """Sampling rounds until the batch is full; returns the merged Round and metrics."""
    cfg = run.config
    group = cfg.batch.group_size
    sampler = DynamicSampler(cfg.batch.n_prompts, group, enabled=cfg.dynamic_sampling.enabled,
                             max_rounds=cfg.dynamic_sampling.max_rounds if cfg.dynamic_sampling.enabled else 1,
                             criterion=cfg.dynamic_sampling.criterion)
    gen_time = score_time = 0.0
    all_rewards, all_correct, all_lengths, all_truncated, all_scoring, all_tasks = [], [], [], [], [], []
    done, round_index = False, 0
    while not done:
        prompts = next(run.data)
        t0 = time.perf_counter()
        if run.engine is not None:
            rollout = run.engine.generate(prompts["prompt_tokens"], prompts["prompt_lengths"],
                                          jax.random.fold_in(key, round_index),
                                          params=run.state.params)
        else:
            rollout = generate_fn(run.graphdef, run.state.params, sharding.shard_rows(prompts["prompt_tokens"]),
                                  sharding.shard_rows(prompts["prompt_lengths"]),
                                  jax.random.fold_in(key, round_index), config=run.sampling_config)
        tokens, lengths = sharding.to_host((rollout.tokens, rollout.lengths))
        truncated = truncated_rows(tokens, lengths, cfg.sampling.max_new_tokens,
                                   run.sampling_config.end_ids)
        t1 = time.perf_counter()
        texts = decode(tokens, lengths, run.tokenizer)
        references = [a for a in prompts["answer"] for _ in range(group)]
        texts_prompts = [p for p in prompts["prompt"] for _ in range(group)]
        # Mixed math and code prompts: each sample is checked by its own task's verifier.
        tasks = [t for t in prompts["task"] for _ in range(group)] if "task" in prompts else None
        scores = score_batch(texts, references, lengths, run.reward_spec, prompts=texts_prompts,
                             num_workers=cfg.reward.num_workers, truncated=truncated,
                             deadline_s=cfg.reward.deadline_s, across_processes=True, tasks=tasks)
        t2 = time.perf_counter()
        gen_time, score_time = gen_time + t1 - t0, score_time + t2 - t1
        width = min(bucket(int(lengths.max()), cfg.batch.response_buckets, name="response length"),
                    cfg.sampling.max_new_tokens)
        rnd = round_from_rollout(rollout, scores.rewards, scores.correct, width, scored=scores.scored)
        # 0 on samples to leave out of the loss (overlong filtering, scoring deadline).
        rnd = rnd._replace(mask=rnd.mask * np.asarray(scores.sample_mask)[:, None])
        all_scoring.append(scores.metrics)
        all_rewards.append(scores.rewards)
        all_correct.append(scores.correct)
        all_lengths.append(lengths)
        all_truncated.append(truncated)
        all_tasks.extend(tasks or ())
        if round_index == 0:
            run.last_samples = dict(prompts=texts_prompts, completions=texts, references=references,
                                    rewards=scores.rewards, correct=scores.correct,
                                    status=getattr(scores, "status", None),
                                    format_ok=getattr(scores, "format_ok", None))
        done = sampler.add(rnd)
        round_index += 1
    merged, metrics = sampler.batch(run.tokenizer.pad_id)
    lengths = np.concatenate(all_lengths)
    metrics.update({
        "reward/mean": float(np.mean(np.concatenate(all_rewards))),
        "reward/accuracy": float(np.mean(np.concatenate(all_correct))),
        **batch_metrics(merged),
        "response/length_mean": float(np.mean(lengths)),
        "response/length_max": float(np.max(lengths)),
        "response/truncated_fraction": float(np.mean(np.concatenate(all_truncated))),
        "time/generate_s": gen_time, "time/score_s": score_time,
    })
    metrics.update(scoring_metrics(all_scoring))
    metrics.update(task_accuracies(np.concatenate(all_correct), all_tasks or None, "reward/accuracy"))
    return merged, metrics


def batch_metrics(merged) -> dict[str, float]:
    """``batch/reward_mean`` and ``batch/accuracy`` over the batch's scored samples: the
    rows that train (dynamic sampling's fillers and missed samples left out; NaN if none)."""
    scored = merged.scored_rows()
    if not scored.any():
        return {"batch/reward_mean": float("nan"), "batch/accuracy": float("nan")}
    return {"batch/reward_mean": float(np.mean(merged.rewards[scored])),
            "batch/accuracy": float(np.mean(merged.correct[scored]))}


def scoring_metrics(batches: list[dict]) -> dict[str, float]:
    """``reward/*`` verifier-health metrics of the iteration's ``score_batch`` calls (every
    sample scored, dynamic sampling's dropped groups included): format failures,
    verifier timeouts and errors, missed deadlines, crashed workers (counts), mean length
    penalty, language consistency."""
    return {f"reward/{key}": value for key, value in merge_metrics(batches).items()
            if key != "truncated_fraction"}  # reported as response/truncated_fraction


def _chunked_log_probs(learner: Learner, params, tokens, positions, attention_mask, mask,
                       routing, num_chunks: int, packings=None):
    """``learner.log_probs`` over ``num_chunks`` equal row chunks (one compiled shape, the
    minibatch's, rows placed as a minibatch's), concatenated: ``(log_probs [R, N], routing
    [L, R, S, k] or None)``. ``packings``: each chunk's ``PackedLayout`` (``pack_chunks``),
    or None (padded rows)."""
    per = tokens.shape[0] // num_chunks
    log_probs, routings = [], []
    for c in range(num_chunks):
        chunk = lambda x, axis=0: _rows(x, c * per, (c + 1) * per, axis)
        lp, _, used = learner.log_probs(params, chunk(tokens), chunk(positions), chunk(attention_mask),
                                        chunk(mask), chunk(routing, axis=1),
                                        _place_packing(packings and packings[c]))
        log_probs.append(lp)
        routings.append(used)
    routing_out = None if routings[0] is None else jnp.concatenate(routings, axis=1)
    return jnp.concatenate(log_probs, axis=0), routing_out


def _chunked_routing(learner: Learner, params, tokens, positions, attention_mask, num_chunks: int):
    """``learner.routing`` over ``num_chunks`` equal row chunks (the minibatch's shape, as
    the old log-probs: the same compiled shape and memory, and the same numerics, so that
    routing volatility has no batch-shape noise floor), concatenated: ``[L, R, S, k]``."""
    per = tokens.shape[0] // num_chunks
    return jnp.concatenate([learner.routing(params, *(_rows(x, c * per, (c + 1) * per)
                                                      for x in (tokens, positions, attention_mask)))
                            for c in range(num_chunks)], axis=1)


def _chunked_values(critic: Critic, params, tokens, positions, attention_mask, mask,
                    num_chunks: int, packings=None) -> jax.Array:
    """``critic.values`` over ``num_chunks`` equal row chunks (the minibatch's shape),
    packed as ``_chunked_log_probs``."""
    per = tokens.shape[0] // num_chunks
    chunks = []
    for c in range(num_chunks):
        chunk = lambda x: _rows(x, c * per, (c + 1) * per)
        chunks.append(critic.values(params, chunk(tokens), chunk(positions), chunk(attention_mask),
                                    chunk(mask), _place_packing(packings and packings[c])))
    return jnp.concatenate(chunks, axis=0)


def pack_rows(config, attention_mask: np.ndarray, rows=None) -> PackedLayout | None:
    """The packed layout of a minibatch's rows (host ``[R, S]`` attention mask) with
    ``config.batch.pack`` on, else None: rows of ``batch.pack_tokens`` slots (None: the
    padded width ``S``), their number a multiple of the mesh's row shards (``data`` x
    ``fsdp``, so they split like a batch's rows). A row longer than the packed row is a
    ValueError naming it (``packing.pack_layout``; ``rows``: the rows' numbers in the
    batch, for that message)."""
    if not config.batch.pack:
        return None
    mesh = jax.sharding.get_mesh()
    shards = 1 if mesh.empty else int(np.prod([mesh.shape.get(a, 1) for a in ("data", "fsdp")]))
    row_length = config.batch.pack_tokens or attention_mask.shape[1]
    return pack_layout(attention_mask, row_length, row_multiple=shards, row_ids=rows)


def pack_chunks(config, attention_mask: np.ndarray, num_chunks: int) -> list | None:
    """``pack_rows`` of each of ``num_chunks`` equal row chunks (the old-log-prob, reference
    and value passes), or None with packing off."""
    if not config.batch.pack:
        return None
    per = attention_mask.shape[0] // num_chunks
    chunks = [np.arange(c * per, (c + 1) * per) for c in range(num_chunks)]
    return [pack_rows(config, attention_mask[rows], rows) for rows in chunks]


def _place_packing(packing: PackedLayout | None) -> PackedLayout | None:
    """A host ``PackedLayout`` on the mesh, each array's rows split as a batch's."""
    return None if packing is None else PackedLayout(*(sharding.shard_rows(x) for x in packing))


def _rows(x, start: int, stop: int, axis: int = 0):
    """Rows ``[start, stop)`` of ``x`` (along ``axis``), placed as a batch's rows
    (``sharding.shard_rows``); None stays None."""
    if x is None:
        return None
    return sharding.shard_rows(jax.lax.slice_in_dim(x, start, stop, axis=axis), axis=axis)


# Jitted once per response bucket (GAEConfig is static and hashable).
_gae_targets = jax.jit(gae_targets, static_argnames="settings")


def gae_settings(config, *, pretraining: bool) -> GAEConfig:
    """The GAE settings of an iteration: ``config.algo``'s, except that value pretraining
    trains the critic on Monte-Carlo returns, ``lambda_critic = 1`` (VC-PPO 2503.01491,
    docs/algorithms.md), whatever ``algo.gae_lambda_critic`` the later PPO updates use."""
    settings = GAEConfig.from_config(config.algo)
    return dataclasses.replace(settings, lam_critic=1.0) if pretraining else settings


@dataclasses.dataclass(frozen=True)
class CorrectionConfig:
    """Rollout correction between the sampler (behaviour log-probs, mu) and the trainer's
    pi_old: ``config.algo``'s ``tis_*`` and ``rs_*`` fields (``configs/base.py``)."""

    tis_cap: float | None = None
    tis_level: str = "token"
    rs_level: str | None = None
    rs_upper: float | None = None
    rs_lower: float | None = None
    rs_veto: float | None = None

    @classmethod
    def from_config(cls, algo) -> "CorrectionConfig":
        return cls(**{f.name: algo.get(f.name, f.default) for f in dataclasses.fields(cls)})


@functools.partial(jax.jit, static_argnames="settings")
def rollout_correction(old_log_probs, behaviour_log_probs, mask, settings: CorrectionConfig):
    """Importance weights, the loss mask of rejection sampling, and metrics.

    Returns:
      ``(weights, loss_mask, metrics)``: truncated importance weights ``[R, N]`` (None
      without ``tis_cap``), the tokens rejection sampling keeps ``[R, N]`` (None without
      ``rs_level`` and ``rs_veto``), and ``offpolicy/*`` metrics: ``losses.offpolicy_metrics``
      (KL, PPL ratio, chi-square between mu and pi_old), ``is_truncated_frac`` (valid tokens
      whose weight the cap set), ``rs_rejected_token_frac`` and ``rs_rejected_seq_frac``
      (valid tokens, and non-empty sequences wholly, left out of the policy loss).
    """
    metrics = {f"offpolicy/{k}": v for k, v in offpolicy_metrics(old_log_probs, behaviour_log_probs, mask).items()}
    valid = mask > 0
    n_tokens = jnp.maximum(jnp.sum(valid), 1)
    weights = loss_mask = None
    if settings.tis_cap is not None:
        weights = truncated_importance_weights(old_log_probs, behaviour_log_probs, mask,
                                               cap=settings.tis_cap, level=settings.tis_level)
        metrics["offpolicy/is_truncated_frac"] = jnp.sum(valid & (weights >= settings.tis_cap)) / n_tokens
    if settings.rs_level is not None or settings.rs_veto is not None:
        loss_mask = rejection_mask(old_log_probs, behaviour_log_probs, mask, level=settings.rs_level,
                                   upper=settings.rs_upper, lower=settings.rs_lower, veto=settings.rs_veto)
        kept = loss_mask > 0
        metrics["offpolicy/rs_rejected_token_frac"] = 1 - jnp.sum(kept) / n_tokens
        non_empty = jnp.any(valid, axis=-1)
        metrics["offpolicy/rs_rejected_seq_frac"] = (
            jnp.sum(non_empty & ~jnp.any(kept, axis=-1)) / jnp.maximum(jnp.sum(non_empty), 1))
    return weights, loss_mask, metrics


def minibatch_advantages(rewards, group_size: int, *, center: str = "group", eps: float = 1e-6,
                         valid=None):
    """Magistral's advantages (2506.10910 §2.1): ``A = R - mean(R_group)``, then
    ``(A - mean_mb(A)) / std_mb(A)`` over the sequences of one minibatch.

    Magistral drops groups whose rewards are all equal before forming the batch, so their
    rows (advantage 0 either way) count in neither ``mean_mb`` nor ``std_mb``: computed
    from the minibatch's rewards with ``outcome_advantages(scale="batch")``, which leaves
    zero-variance groups out of the batch statistics. Minibatches hold whole groups.

    Args:
      rewards: ``[R]`` rewards of the minibatch's rows, group after group.
      group_size: G.
      center: ``"group"`` (Magistral) or ``"none"``.
      eps: added to the minibatch std.
      valid: optional ``[R]`` bool, False for samples left out of every statistic (a
        missed scoring deadline; ``outcome_advantages``).

    Returns:
      ``[R]`` advantages.
    """
    return outcome_advantages(rewards, group_size, center=center, scale="batch", eps=eps, valid=valid)


def rl_iteration(run: RLRun) -> dict[str, float]:
    """Runs one RL iteration on ``run`` (state updated in place) and returns its metrics."""
    start = time.perf_counter()
    with jax.set_mesh(run.mesh):
        key_sample, key_shuffle = jax.random.split(jax.random.fold_in(run.rng, run.iteration))
        merged, metrics = _sample_batch(run, key_sample)
        metrics = train_on_batch(run, merged, metrics, key_shuffle)
    run.iteration += 1
    metrics["time/iteration_s"] = time.perf_counter() - start
    return {k: float(v) for k, v in metrics.items()}


def train_on_batch(run: RLRun, merged, metrics: dict, key_shuffle: jax.Array) -> dict:
    """The training half of an iteration on a sampled batch (host ``Round``): old /
    reference log-probs, advantages (critic: values and GAE targets), TIS weights, routing
    replay, epochs x minibatches of updates, routing metrics. Updates ``run.state`` (and
    ``run.critic_state``), not ``run.iteration``; shared by ``rl_iteration`` and
    ``async_rl.async_iteration``. Returns ``metrics`` with this step's added."""
    with jax.set_mesh(run.mesh):
        return _train_on_batch(run, merged, metrics, key_shuffle)


def _train_on_batch(run: RLRun, merged, metrics: dict, key_shuffle: jax.Array) -> dict:
    cfg, learner = run.config, run.learner
    algo, group = cfg.algo, cfg.batch.group_size
    # Value pretraining / warm-up updates the critic only: the policy's forward passes
    # (old and reference log-probs, routing) would be computed for nothing, and are not.
    pretraining = run.critic is not None and run.iteration < cfg.critic.pretrain_iterations
    policy_step = not pretraining

    # Old (and reference) log-probs from the trainer's forward pass.
    t0 = time.perf_counter()
    tokens, positions = sharding.shard_rows(merged.tokens), sharding.shard_rows(merged.positions)
    attention_mask, mask = sharding.shard_rows(merged.attention_mask), sharding.shard_rows(merged.mask)
    sampler_routing = sharding.shard_rows(merged.routing, axis=1)
    behaviour = sharding.shard_rows(merged.behaviour_log_probs)
    n_chunks = cfg.batch.n_minibatches
    is_moe = sampler_routing is not None
    replay_old = sampler_routing if (is_moe and algo.routing_replay == "R3") else None
    # Packed rows for the forwards (config.batch.pack; None: padded), one layout per chunk.
    chunk_packings = pack_chunks(cfg, merged.attention_mask, n_chunks)
    if algo.old_log_probs == "trainer" and policy_step:
        old_log_probs, old_routing = _chunked_log_probs(
            learner, run.state.params, tokens, positions, attention_mask, mask, replay_old,
            n_chunks, chunk_packings)
    else:
        old_log_probs, old_routing = behaviour, None
    ref_log_probs = None
    if run.ref_params is not None and policy_step:
        ref_log_probs, _ = _chunked_log_probs(
            learner, run.ref_params, tokens, positions, attention_mask, mask, None, n_chunks,
            chunk_packings)
    # The old policy's own (not replayed) routing, for the routing metrics.
    routing_metrics_on = is_moe and cfg.train.routing_metrics and policy_step
    natural_old = old_routing if (is_moe and replay_old is None) else None
    if routing_metrics_on and natural_old is None:
        natural_old = _chunked_routing(learner, run.state.params, tokens, positions, attention_mask, n_chunks)
    if policy_step:
        metrics["time/old_log_probs_s"] = _block(old_log_probs, t0)
        metrics["logprob/sampler_trainer_abs_diff"] = float(
            jnp.sum(jnp.abs(old_log_probs - behaviour) * mask) / jnp.maximum(jnp.sum(mask), 1))

    # Advantages (and, for critic methods, the rollout's values and the value targets),
    # importance weights, the replayed routing.
    rewards = sharding.shard_rows(merged.rewards)
    scored = merged.scored_rows()

    def valid(rows=slice(None)):
        """Samples that missed the scoring deadline count in no group statistic (None:
        every sample was scored; the statistics then keep their static group size)."""
        return None if scored[rows].all() else scored[rows]

    old_values = returns = None
    if run.critic is not None:
        t0 = time.perf_counter()
        old_values = _chunked_values(run.critic, run.critic_state.params, tokens, positions,
                                     attention_mask, mask, n_chunks, chunk_packings)
        advantages, returns, gae_metrics = _gae_targets(
            rewards, old_values, mask, settings=gae_settings(cfg, pretraining=pretraining))
        metrics.update(jax.device_get(gae_metrics))
        metrics["time/values_s"] = _block(advantages, t0)
    else:
        scale = "none" if algo.adv_scale == "minibatch" else algo.adv_scale
        advantages = outcome_advantages(rewards, group, center=algo.adv_center, scale=scale,
                                        eps=algo.adv_eps, valid=valid())
    # VAPO's NLL term covers the correct samples.
    nll_weights = sharding.shard_rows(merged.correct.astype(np.float32)) if algo.nll_coef > 0 else None
    # Rollout correction (sampler vs trainer): importance weights, rejection sampling.
    weights = loss_mask = None
    if algo.old_log_probs == "trainer" and policy_step:
        weights, loss_mask, correction_metrics = rollout_correction(
            old_log_probs, behaviour, mask, CorrectionConfig.from_config(algo))
        metrics.update(jax.device_get(correction_metrics))
    replay = {"none": None, "R2": old_routing, "R3": sampler_routing}[algo.routing_replay] if is_moe else None
    batch = Batch(tokens=tokens, positions=positions, attention_mask=attention_mask, mask=mask,
                  advantages=advantages, old_log_probs=old_log_probs, importance_weights=weights,
                  ref_log_probs=ref_log_probs, routing=replay, old_values=old_values,
                  returns=returns, nll_weights=nll_weights, loss_mask=loss_mask)

    run.last_round, run.last_batch = merged, batch

    # Epochs x minibatches of updates: the policy (unless the critic is pretraining) and
    # the critic, on the same minibatches.
    t0 = time.perf_counter()
    num_groups = tokens.shape[0] // group
    sums: dict[str, jax.Array] = {}
    updates: dict[str, jax.Array] = {}  # per metric: how many minibatches were updates
    packed_slots = packed_real = 0  # over the update minibatches' packed rows
    for epoch in range(cfg.batch.epochs):
        shuffle = jax.random.fold_in(key_shuffle, epoch) if cfg.batch.n_minibatches > 1 else None
        for rows in minibatch_indices(num_groups, group, cfg.batch.n_minibatches, shuffle):
            minibatch = take_rows(batch, rows)
            if algo.adv_scale == "minibatch" and run.critic is None:
                minibatch = minibatch._replace(advantages=minibatch_advantages(
                    rewards[rows], group, center=algo.adv_center, eps=algo.adv_eps, valid=valid(rows)))
            packing = pack_rows(cfg, merged.attention_mask[rows], rows)
            if packing is not None:
                minibatch = minibatch._replace(packing=packing)
                packed_slots += packing.segment_ids.size
                packed_real += packing.num_real
            minibatch = shard_batch(minibatch)
            update_metrics = {}
            if not pretraining:
                run.state, update_metrics = learner.update(run.state, minibatch)
            if run.critic is not None:
                run.critic_state, critic_metrics = run.critic.update(run.critic_state, minibatch)
                update_metrics = {**update_metrics, **critic_metrics}
            for k, v in update_metrics.items():
                if k in _UPDATE_COUNTS:
                    sums[k] = sums.get(k, 0.0) + v
                    continue
                # Means over the minibatches that were updates: an empty one (fillers only,
                # or every token rejected) reports zeros, which would dilute them.
                w = 1.0 - update_metrics["critic/empty" if k.startswith("critic/") else "update/empty"]
                sums[k] = sums.get(k, 0.0) + w * v
                updates[k] = updates.get(k, 0.0) + w
    # NaN when every minibatch was empty: no update, no value.
    update_metrics = {k: v if k in _UPDATE_COUNTS else v / jnp.where(updates[k] > 0, updates[k], jnp.nan)
                      for k, v in sums.items()}
    metrics.update(jax.device_get(update_metrics))
    if run.critic is not None:
        metrics["critic/pretraining"] = float(pretraining)
        metrics["critic/step"] = float(run.critic_state.step)
    metrics["time/update_s"] = _block((run.state.params, run.critic_state), t0)

    # Routing metrics (MoE).
    if routing_metrics_on:
        new_routing = _chunked_routing(learner, run.state.params, tokens, positions, attention_mask, n_chunks)
        metrics.update(jax.device_get(routing_metrics("routing/volatility", natural_old, new_routing, attention_mask)))
        metrics.update(jax.device_get(routing_metrics(
            "routing/sampler_trainer_disagreement", natural_old, sampler_routing, attention_mask)))
    metrics["batch/prompt_width"] = float(merged.prompt_width)
    metrics["batch/response_width"] = float(merged.mask.shape[1])
    # Padding: of the padded rows' slots, and (config.batch.pack) of the packed rows'.
    metrics["batch/padding_fraction"] = 1.0 - float(np.mean(merged.attention_mask > 0))
    if packed_slots:
        metrics["batch/packed_padding_fraction"] = 1.0 - packed_real / packed_slots
    metrics["update/step"] = float(run.state.step)
    metrics["update/skipped_total"] = float(run.state.skipped)
    return metrics


# Update metrics that are counts over the minibatches (summed), not means.
_UPDATE_COUNTS = ("update/skipped", "critic/skipped", "update/empty", "critic/empty")


class UpdatesSkipped(RuntimeError):
    """Raised when ``train.max_skipped_updates`` updates in a row were skipped."""


def _guarded_states(run: RLRun) -> dict:
    """The states whose updates the non-finite guard may skip: the policy's and the critic's."""
    return {"update": run.state, "critic": run.critic_state}


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
        return {name: (int(state.step), int(state.skipped))
                for name, state in states.items() if state is not None}

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
                    f"(config.train.max_skipped_updates={self.limit})")


def _block(tree, t0: float) -> float:
    jax.block_until_ready(tree)
    return time.perf_counter() - t0


# Completions of each evaluation written to eval_samples.jsonl (the first held-out prompts).
EVAL_SAMPLES_LOGGED = 16


def evaluate_run(run: RLRun, samples: list | None = None) -> dict[str, float]:
    """Held-out evaluation of the current policy (``policyopt.rl.evaluate``); ``samples``,
    when given, receives one record per held-out completion (``evaluate``)."""
    cfg = run.config
    with jax.set_mesh(run.mesh):
        return evaluate(run.graphdef, run.state.params, run.eval_records, run.tokenizer,
                        max_new_tokens=cfg.sampling.max_new_tokens, batch_size=cfg.eval.batch_size,
                        prompt_buckets=tuple(cfg.batch.prompt_buckets), k=cfg.eval.k,
                        temperature=cfg.eval.temperature, decode_segments=cfg.sampling.decode_segments,
                        rng=jax.random.fold_in(run.rng, 10**9 + run.iteration),
                        spec=build.correctness_spec(cfg), num_workers=cfg.reward.num_workers,
                        samples=samples)


def run_rl(config, workdir: str, *, num_iterations: int | None = None, quiet: bool = False,
           recipe: str | None = None) -> dict:
    """Trains with RL for ``config.train.num_iterations`` iterations (resuming if possible).

    Writes to ``workdir``: ``config.json`` (resolved config), ``metrics.jsonl`` and
    ``tensorboard/`` (one record per iteration), ``eval.jsonl`` (evaluations),
    ``checkpoints/`` (orbax).

    Args:
      config: a locked recipe config (``configs/*.py``).
      workdir: the run directory.
      num_iterations: stop after this many iterations in total (default from config).
      quiet: no console output (banner, progress line, samples).
      recipe: what the banner names as the run's recipe (the command line's ``--config``).

    SIGINT / SIGTERM stop the run at the next iteration boundary with a checkpoint
    (``RunLoop``); the summary's ``"interrupted"`` then names the signal.

    Returns:
      ``{"iteration", "metrics" (last iteration), "eval" (last evaluation),
      "eval_history" (list), "run" (the RLRun), "interrupted" (signal name or None)}``.
    """
    total = config.train.num_iterations if num_iterations is None else num_iterations
    lock_workdir(workdir)  # one process per workdir: a second is refused in one line
    run = build_run(config, workdir)
    loop = RunLoop(run, total, quiet=quiet, recipe=recipe)
    try:
        loop.begin()
        while run.iteration < total and not loop.stopping:
            loop.after_iteration(rl_iteration(run), save=lambda: save(run))
        loop.end()
    finally:
        loop.close()
    return loop.summary()


class RunLoop:
    """The bookkeeping around the iterations of a run, shared by ``run_rl`` and
    ``async_rl.run_async_rl``: ``config.json``, metrics (JSONL, TensorBoard, console),
    evaluation and checkpoint cadence, and the summary the two return.

    Use: ``begin()`` (evaluates at iteration 0), ``after_iteration(metrics, save)`` after
    each iteration (``run.iteration`` already advanced), ``end()`` (evaluates the final
    iteration if nothing has), ``close()`` in a ``finally``, then ``summary()``.

    A resumed run continues its files: records of ``metrics.jsonl`` and ``eval.jsonl``
    after the checkpoint's iteration (written before a crash, about to be written again)
    are removed, as are TensorBoard's; a run that starts at iteration 0 starts them
    afresh. An evaluation that ``eval.jsonl`` holds at the checkpoint's iteration (the
    parameters it evaluated are the checkpoint's) is the run's last one and is not run
    again: a finished run resumed is evaluated once, ever. Checkpoints are saved before
    the evaluation of their iteration, so a failed evaluation loses no training.
    """

    def __init__(self, run: RLRun, total: int, *, quiet: bool = False, recipe: str | None = None):
        config, workdir = run.config, run.workdir
        self.run, self.total, self.config = run, total, config
        # Process 0 writes the files and the console line (every process computes the same
        # records: multi-process jobs run the host side identically on each).
        primary = sharding.is_primary()
        self.console = primary and not quiet
        if self.console:
            resumed = run.checkpointer.latest_step() is not None
            start = report.starting_point(config, run.checkpointer.directory,
                                          run.iteration if resumed else None)
            print(report.banner(config, workdir, recipe=recipe, mesh=run.mesh, start=start,
                                num_params=report.parameter_count(run.state.params), total=total),
                  flush=True)
        for warning in report.advisories(config):
            self._warn(warning)
        if primary:
            with open(os.path.join(workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2, sort_keys=True))
        resume_step = run.iteration if run.iteration else -1
        self.writer = MetricsWriter(workdir, tensorboard=config.train.tensorboard, enabled=primary,
                                    resume_step=resume_step)
        self.eval_writer = MetricsWriter(workdir, filename="eval.jsonl", tensorboard=False,
                                         enabled=primary, resume_step=resume_step)
        self.progress = None if (quiet or not primary) else Progress(total, start_step=run.iteration)
        self.skipped_updates = SkippedUpdates(config.train.max_skipped_updates,
                                              _guarded_states(run))
        self.history: list[dict] = []
        self.metrics: dict = {}
        self.evaluating = config.eval.num_prompts > 0
        self.samples = MetricsWriter(workdir, filename="samples.jsonl", tensorboard=False,
                                     enabled=primary, resume_step=resume_step)
        self.eval_samples = MetricsWriter(workdir, filename="eval_samples.jsonl", tensorboard=False,
                                          enabled=primary, resume_step=resume_step)
        # The pass@1 the console shows, with the iteration it was measured at: after a
        # resume, the last one eval.jsonl holds (at or before the checkpoint's iteration).
        self.shown_eval = read_last_value(self.eval_writer.path, "eval/pass@1") if primary else None
        self.stop = GracefulStop()
        self.stopped_by: str | None = None  # the signal that stopped the run (process 0's)
        self.uninformative_streak, self.first_iteration = 0, True
        self._first_start = time.perf_counter()
        if (run.iteration and run.last_eval_iteration != run.iteration
                and build.same_evaluation(run.resumed_config, config)):
            # Process 0's log decides for every process (evaluating is a collective).
            logged = None
            if primary:
                logged = read_step_record(self.eval_writer.path, run.iteration, prefix="eval/")
            logged = sharding.broadcast_json(logged)
            if logged is not None:
                run.last_eval, run.last_eval_iteration = logged, run.iteration

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

    def _poll_stop(self) -> None:
        """Every process takes process 0's answer (a collective on several processes), so
        that all of them stop after the same iteration."""
        self.stopped_by = sharding.broadcast_json(self.stop.signal_name)

    def evaluate(self) -> dict:
        run = self.run
        if self.console and not self.history:
            print(f"evaluating {len(run.eval_records)} held-out prompts at iteration "
                  f"{run.iteration} (compiling the sampler first) ...", flush=True)
        samples: list[dict] = []
        result = evaluate_run(run, samples=samples)
        self.eval_writer.write(run.iteration, result)
        self.writer.write(run.iteration, result)
        self.eval_samples.write_rows(run.iteration, samples[:EVAL_SAMPLES_LOGGED])
        self.history.append({"iteration": run.iteration, **result})
        if self.progress:
            print(f"eval @ {run.iteration}: " + " ".join(f"{k} {v:.4f}" for k, v in result.items()),
                  flush=True)
        run.last_eval, run.last_eval_iteration = result, run.iteration
        if "eval/pass@1" in result:
            self.shown_eval = (run.iteration, result["eval/pass@1"])
        return result

    def _log_samples(self) -> None:
        """Every ``train.sample_every`` iterations, the first ``train.sample_prompts``
        prompts' completions with rewards and verdicts: samples.jsonl, TensorBoard text,
        and one of them on the console."""
        run, train = self.run, self.config.train
        due = train.sample_every and run.iteration % train.sample_every == 0
        if not (due and run.last_samples):
            return
        rows = report.sample_rows(**run.last_samples, step=run.iteration,
                                  limit=train.sample_prompts * self.config.batch.group_size)
        self.samples.write_rows(run.iteration, rows)
        self.writer.write_text(run.iteration, "samples/train", rows)
        if self.progress and rows:
            row = rows[0]
            verdict = row.get("status", "correct" if row["correct"] else "wrong")
            print(f"sample @ {run.iteration}: {row['prompt'][-60:]!r} -> "
                  f"{row['completion'][:120]!r} reward {row['reward']:.3g} ({verdict})", flush=True)

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
                "run) or a denser reward.")

    @property
    def last_eval(self) -> dict:
        return self.run.last_eval

    def begin(self) -> None:
        """Evaluates at iteration 0, and at a resumed iteration on the evaluation cadence
        whose evaluation is not in the log (the run stopped during it)."""
        run, every = self.run, self.config.train.eval_every
        due = run.iteration == 0 or (every and run.iteration % every == 0 and run.iteration < self.total)
        self.stop.__enter__()
        if self.evaluating and due and run.last_eval_iteration != run.iteration:
            self.evaluate()
        self._poll_stop()
        if self.console and run.iteration < self.total and not self.stopping:
            print(f"iteration {run.iteration + 1}: compiling the sampler and the update steps "
                  "(the first iteration's time includes compilation) ...", flush=True)
            self._first_start = time.perf_counter()

    def after_iteration(self, metrics: dict, save) -> None:
        """Writes ``metrics``, then evaluates and checkpoints (``save()``) when due."""
        run, train = self.run, self.config.train
        if run.last_round is not None and not np.isnan(metrics.get("batch/reward_mean", 0.0)):
            metrics["batch/informative_groups"] = report.informative_fraction(
                run.last_round.rewards, self.config.batch.group_size, run.last_round.scored_rows())
        self.metrics = metrics
        self.writer.write(run.iteration, metrics)
        self.skipped_updates.update(run.iteration, _guarded_states(run))
        if self.console and self.first_iteration:
            seconds = time.perf_counter() - self._first_start
            print(f"first iteration: {seconds:.1f}s with compilation", flush=True)
        if self.progress and self.first_iteration and run.iteration % train.log_every:
            self.progress.start_steady(run.iteration)  # the ETA leaves the compiling one out
        self.first_iteration = False
        if self.progress and run.iteration % train.log_every == 0:
            shown = {k: v for k, v in metrics.items() if not k.startswith("eval/")}
            suffix = ""
            if self.shown_eval is not None:  # the last evaluation, with its iteration
                suffix = f"pass@1 {self.shown_eval[1]:.3f} (it {self.shown_eval[0]})"
            self.progress.update(run.iteration, shown, suffix=suffix)
        self._log_samples()
        self._watch_informative(metrics)
        self._poll_stop()
        final = run.iteration == self.total
        every = train.eval_every
        if final or run.iteration % train.checkpoint_every == 0 or self.stopping:
            save()
        if self.stopping:  # the evaluation too waits for the resumed run (``end``)
            if self.console:
                path = os.path.join(run.checkpointer.directory, str(run.iteration))
                print(f"{self.stopped_by}: stopped at iteration {run.iteration}; checkpoint "
                      f"{path}; rerun the same command to resume", flush=True)
            return
        if self.evaluating and ((every and run.iteration % every == 0) or final):
            self.evaluate()

    def end(self) -> None:
        # A resumed run that was not evaluated at its iteration (a finished run whose
        # final evaluation failed, or that ran with eval.num_prompts=0) is evaluated here.
        # A stopped run is not: it resumes where it stopped.
        unevaluated = self.run.last_eval_iteration != self.run.iteration
        if self.evaluating and unevaluated and not self.stopping:
            self.evaluate()

    def close(self) -> None:
        self.stop.__exit__()
        for writer in (self.writer, self.eval_writer, self.samples, self.eval_samples):
            writer.close()

    def summary(self, **extra) -> dict:
        return {"iteration": self.run.iteration, "metrics": self.metrics, "eval": self.last_eval,
                "eval_history": self.history, "run": self.run, "interrupted": self.stopped_by,
                **extra}

