"""One RL iteration as three stages, read top to bottom.

    sampled = sample(spec, state, key)              generate, score, dynamic sampling
    prepared = prepare(spec, state, sampled.round)  old / reference log-probs, advantages
                                                    (critic: values, GAE), rollout correction
    state, metrics = update_epochs(spec, state, prepared, key)
                                                 epochs x minibatches of the updates

A stage sees ``RunSpec`` (frozen: graphdef, learner, critic, mesh, the config and the
method-specific steps chosen when the run was built, ``policyopt.rl.update.methods``) and
``RunState`` (a pytree: policy and critic states, run key, iteration). It calls jitted
functions (``sampling.generate_fn``, ``Learner.log_probs`` / ``update``, ``Critic.values``
/ ``update``) and keeps host bookkeeping on NumPy arrays (scoring: ``rl.rollouts.rounds``; dynamic
sampling). The asynchronous trainer (``policyopt.rl.loop.async_rl``) has its own ``sample`` and
uses ``prepare`` and ``update_epochs`` as they are.

Determinism: iteration ``i`` draws its keys from ``fold_in(state.rng, i)``; the prompts
come from ``spec.prompts``, a host iterator whose position the run's checkpoint saves
(``policyopt.rl.loop.trainer.save``), so a resumed run repeats the iteration bit for bit.

Critic warm-up: while ``state.iteration < spec.warmup_iterations`` only the critic is
updated and the policy's forward passes are skipped: first, for
``spec.reward_model_iterations`` (``config.critic.reward_model_iterations``), as an outcome
reward model (its last response token fitted to the reward, ``critic.reward_model_targets``),
then (``config.critic.pretrain_iterations``, VC-PPO 2503.01491) on Monte-Carlo targets.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from policyopt import sharding
from policyopt.rewards.scoring import score_batch
from policyopt.rl.batch import (
    Batch,
    DynamicSampler,
    Round,
    minibatch_indices,
    round_from_rollout,
    shard_batch,
    take_rows,
)
from policyopt.rl.reporting.report import MinibatchMeans, padding_metrics
from policyopt.rl.rollouts.rounds import ScoredRound, response_width, round_texts, sampling_metrics
from policyopt.rl.update import forwards
from policyopt.rl.update.critic import Critic, reward_model_targets
from policyopt.rl.update.learner import Learner, TrainState
from policyopt.rl.update.methods import Methods
from policyopt.rl.update.routing import ratio_share_metrics, update_routing_metrics
from policyopt.sampling import SamplingConfig, generate_fn


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """What does not change during a run (``trainer.build_run`` builds it)."""

    config: Any  # the locked recipe config
    graphdef: Any
    learner: Learner
    critic: Critic | None  # critic methods (algo.advantage = "gae"), else None
    mesh: jax.sharding.Mesh  # every array of the run lives on it (config.mesh)
    methods: Methods  # the method-specific steps (policyopt.rl.update.methods.choose)
    tokenizer: Any
    sampling_config: SamplingConfig
    reward_spec: Any
    prompts: Any  # host iterator of prompt batches (grain; position saved by the checkpoint)
    # The KL reference policy's parameters (a frozen copy of the initial ones; with LoRA
    # the frozen base itself, no copy) and its learner (LoRA: the base's graph, adapters
    # off), or None.
    ref_params: Any = None
    ref_learner: Learner | None = None
    engine: Any = None  # continuous-batching engine (sampling.engine_kv_tokens > 0), or None
    # The trainable parameters -> the model's and the sampler's (LoRA: the frozen base
    # they join, merged or not; policyopt.rl.update.adapters). None: the parameters are all.
    weights: Any = None
    critic_frozen: Any = None  # the base of a LoRA critic's adapters, or None
    lora_record: dict | None = None  # the checkpoints' "lora" meta (adapters.lora_record)
    # critic.reward_model_iterations + critic.pretrain_iterations (critic methods), else 0
    warmup_iterations: int = 0
    reward_model_iterations: int = 0  # the first of those: the critic as a reward model
    critic_model: dict | None = None  # a critic of its own: its model, the checkpoints' meta
    # Names of the sampler-vs-trainer metrics: the asynchronous trainer's sampler is stale.
    logprob_diff_name: str = "logprob/sampler_trainer_abs_diff"
    routing_diff_name: str = "routing/sampler_trainer_disagreement"


def policy_params(spec: RunSpec, trainable):
    """The policy's whole state for the trainer's forwards: ``trainable`` joined to the
    frozen base (LoRA), or ``trainable`` itself."""
    return trainable if spec.weights is None else spec.weights.full(trainable)


def sampler_weights(spec: RunSpec, trainable) -> tuple[Any, Any]:
    """``(graphdef, params)`` the sampler decodes ``trainable`` with (LoRA: the adapted
    graph, or the base graph with the adapters merged in, once per call)."""
    if spec.weights is None:
        return spec.graphdef, trainable
    return spec.weights.for_sampler(trainable)


@struct.dataclass
class RunState:
    """What an iteration changes (a pytree): the policy's and the critic's parameters,
    optimiser states and counters, the run key, the iterations completed."""

    policy: TrainState
    critic: TrainState | None
    rng: jax.Array  # run key; iteration i uses fold_in(rng, i)
    iteration: int = struct.field(pytree_node=False, default=0)


class Sampled(NamedTuple):
    """``sample``'s output: the batch's rollouts, scored, and what was seen on the way."""

    round: Round  # host arrays, [R, P + N] tokens, rewards [R], routing [L, R, P + N, k]
    samples: dict | None  # the first round's texts and verdicts (report.sample_rows fields)
    metrics: dict  # reward/*, response/*, dynamic_sampling/*, batch/*, time/*


class Prepared(NamedTuple):
    """``prepare``'s output: the update's ``Batch`` on the mesh and what the epochs need."""

    batch: Batch  # advantages, old / reference log-probs, weights, routing to replay
    round: Round  # the host rollouts (rewards, packing layouts, widths)
    chunks: tuple  # the routing metrics' forwards run in these (forwards.chunk_layouts)
    natural_routing: jax.Array | None  # [L, R, S, k]: pi_old's own routing (metrics), or None
    natural_log_probs: jax.Array | None  # [R, N]: pi_old's log-probs under it (metrics)
    sampler_routing: jax.Array | None  # [L, R, S, k] on the mesh, or None (dense)
    metrics: dict  # time/*, logprob/*, offpolicy/*, advantages/*, critic/* of the rollout


def rl_iteration(spec: RunSpec, state: RunState):
    """One iteration: ``(new state, metrics, Sampled, Prepared)``."""
    start = time.perf_counter()
    with jax.set_mesh(spec.mesh):
        key_sample, key_shuffle = jax.random.split(jax.random.fold_in(state.rng, state.iteration))
        sampled = sample(spec, state, key_sample)
        prepared = prepare(spec, state, sampled.round)
        state, update_metrics = update_epochs(spec, state, prepared, key_shuffle)
    metrics = {**sampled.metrics, **prepared.metrics, **update_metrics}
    metrics["time/iteration_s"] = time.perf_counter() - start
    state = state.replace(iteration=state.iteration + 1)
    return state, {k: float(v) for k, v in metrics.items()}, sampled, prepared


def sample(spec: RunSpec, state: RunState, key: jax.Array) -> Sampled:
    """Sampling rounds of ``n_prompts`` prompts x G samples, scored, until dynamic sampling
    has a full batch (or its cap on rounds); returns the merged batch."""
    cfg = spec.config
    sampler = DynamicSampler.from_config(cfg)
    rounds, times, done = [], {"time/generate_s": 0.0, "time/score_s": 0.0}, False
    weights = sampler_weights(spec, state.policy.params)  # one weight version per batch
    while not done:
        prompts = next(spec.prompts)
        t0 = time.perf_counter()
        rollout = generate(spec, weights, prompts, jax.random.fold_in(key, len(rounds)))
        tokens, lengths = sharding.to_host((rollout.tokens, rollout.lengths))
        t1 = time.perf_counter()
        texts = round_texts(
            tokens, lengths, prompts, cfg, spec.tokenizer, spec.sampling_config.end_ids
        )
        scores = score_batch(
            texts.completions,
            texts.references,
            lengths,
            spec.reward_spec,
            prompts=texts.prompts,
            num_workers=cfg.reward.num_workers,
            truncated=texts.truncated,
            deadline_s=cfg.reward.deadline_s,
            across_processes=True,
            tasks=texts.tasks,
        )
        times["time/score_s"] += time.perf_counter() - t1
        times["time/generate_s"] += t1 - t0
        width = response_width(lengths, cfg)
        rnd = round_from_rollout(rollout, scores.rewards, scores.correct, width, scores.scored)
        # 0 on samples to leave out of the loss (overlong filtering, scoring deadline).
        rnd = rnd._replace(mask=rnd.mask * np.asarray(scores.sample_mask)[:, None])
        rounds.append(ScoredRound(rnd, texts, scores, lengths))
        done = sampler.add(rnd)
    merged, metrics = sampler.batch(spec.tokenizer.pad_id)
    metrics.update({**sampling_metrics(rounds, merged), **times})
    return Sampled(merged, rounds[0].samples(), metrics)


def generate(spec: RunSpec, weights: tuple, prompts: dict, key: jax.Array):
    """One batch of prompts x G samples under ``weights`` (``sampler_weights``: graphdef and
    parameters): the continuous-batching engine's ``generate`` (``spec.engine``, built on
    that graphdef) or ``sampling.generate_fn``."""
    graphdef, params = weights
    if spec.engine is not None:
        return spec.engine.generate(
            prompts["prompt_tokens"], prompts["prompt_lengths"], key, params=params
        )
    return generate_fn(
        graphdef,
        params,
        sharding.shard_rows(prompts["prompt_tokens"]),
        sharding.shard_rows(prompts["prompt_lengths"]),
        key,
        config=spec.sampling_config,
    )


def prepare(spec: RunSpec, state: RunState, rnd: Round) -> Prepared:
    """The update's batch of the sampled ``rnd``: pi_old (trainer or sampler), reference
    log-probs (KL), advantages (group statistics, or the critic's values and GAE), the
    rollout correction, VAPO's NLL rows, the routing the updates replay (R2, R3)."""
    cfg, methods, metrics = spec.config, spec.methods, {}
    policy_trains = state.iteration >= spec.warmup_iterations
    t0 = time.perf_counter()
    # The batch's rows on the mesh; the fields the forwards compute are filled below.
    rows = Batch(
        *map(sharding.shard_rows, (rnd.tokens, rnd.positions, rnd.attention_mask, rnd.mask)),
        advantages=None,
        old_log_probs=None,
    )
    chunks = forwards.chunk_layouts(cfg, rnd.attention_mask, cfg.batch.n_minibatches)
    sampler_routing = sharding.shard_rows(rnd.routing, axis=1)
    behaviour = sharding.shard_rows(rnd.behaviour_log_probs)
    old_log_probs, old_routing, ref_log_probs = behaviour, None, None
    natural_routing = natural_log_probs = None
    params = policy_params(spec, state.policy.params)
    if policy_trains:  # the critic's warm-up needs no forward pass of the policy
        old_log_probs, old_routing = methods.old_log_probs(
            spec.learner, params, rows, chunks, behaviour, methods.old_replay(sampler_routing)
        )
        if spec.ref_params is not None:
            ref_log_probs, _ = forwards.policy_log_probs(
                spec.ref_learner or spec.learner, spec.ref_params, rows, chunks
            )
        if sampler_routing is not None and cfg.train.routing_metrics:  # MoE, with routing
            # pi_old's own (not replayed) routing and log-probs, for the routing metrics.
            if methods.old_replay(sampler_routing) is None and old_routing is not None:
                natural_routing, natural_log_probs = old_routing, old_log_probs
            else:
                natural_log_probs, natural_routing = forwards.policy_log_probs(
                    spec.learner, params, rows, chunks
                )
        metrics["time/old_log_probs_s"] = _block(old_log_probs, t0)
        metrics[spec.logprob_diff_name] = float(
            jnp.sum(jnp.abs(old_log_probs - behaviour) * rows.mask)
            / jnp.maximum(jnp.sum(rows.mask), 1)
        )
    t0 = time.perf_counter()
    advantages, returns, old_values, advantage_metrics = methods.advantages(
        spec, state, rows, chunks, sharding.shard_rows(rnd.rewards), _valid(rnd), not policy_trains
    )
    metrics.update(advantage_metrics)
    mask = rows.mask
    if spec.critic is not None:
        metrics["time/values_s"] = _block(advantages, t0)
        if state.iteration < spec.reward_model_iterations:
            mask, returns, old_values = reward_model_targets(
                sharding.shard_rows(rnd.rewards), rows.mask
            )
    weights = loss_mask = None
    if methods.correction is not None and policy_trains:
        weights, loss_mask, correction_metrics = methods.correction(
            old_log_probs, behaviour, rows.mask
        )
        metrics.update(jax.device_get(correction_metrics))
    batch = rows._replace(
        mask=mask,
        advantages=advantages,
        old_log_probs=old_log_probs,
        importance_weights=weights,
        ref_log_probs=ref_log_probs,
        routing=methods.update_replay(sampler_routing, old_routing),
        old_values=old_values,
        returns=returns,
        loss_mask=loss_mask,
        nll_weights=methods.nll_weights and methods.nll_weights(rnd.correct),
    )
    return Prepared(
        batch, rnd, chunks, natural_routing, natural_log_probs, sampler_routing, metrics
    )


def update_epochs(spec: RunSpec, state: RunState, prepared: Prepared, key: jax.Array):
    """``config.batch.epochs`` x ``n_minibatches`` updates of the policy (not during the
    critic's warm-up) and the critic, on the same minibatches (whole groups, shuffled by
    ``key``): ``(state, metrics)``, the update metrics averaged over the minibatches that
    were updates (NaN when none was), counts summed (``report.MinibatchMeans``)."""
    cfg, group, methods = spec.config, spec.config.batch.group_size, spec.methods
    policy_trains = state.iteration >= spec.warmup_iterations
    policy, critic = state.policy, state.critic
    frozen = None if spec.weights is None else spec.weights.frozen
    t0 = time.perf_counter()
    means, packed_slots, packed_real = MinibatchMeans(), 0, 0
    rewards = sharding.shard_rows(prepared.round.rewards)
    for epoch in range(cfg.batch.epochs):
        shuffle = jax.random.fold_in(key, epoch) if cfg.batch.n_minibatches > 1 else None
        num_groups = prepared.batch.tokens.shape[0] // group
        for rows in minibatch_indices(num_groups, group, cfg.batch.n_minibatches, shuffle):
            minibatch = take_rows(prepared.batch, rows)
            if methods.minibatch_advantages is not None:  # Magistral
                minibatch = minibatch._replace(
                    advantages=methods.minibatch_advantages(
                        rewards[rows], valid=_valid(prepared.round, rows)
                    )
                )
            packing = forwards.pack_rows(cfg, prepared.round.attention_mask[rows], rows)
            if packing is not None:
                minibatch = minibatch._replace(packing=packing)
                packed_slots += packing.segment_ids.size
                packed_real += packing.num_real
            minibatch, step_metrics = shard_batch(minibatch), {}
            if policy_trains:
                policy, step_metrics = spec.learner.update(policy, minibatch, frozen)
            if critic is not None:
                critic, critic_metrics = spec.critic.update(critic, minibatch, spec.critic_frozen)
                step_metrics = {**step_metrics, **critic_metrics}
            means.add(step_metrics)
    metrics = means.result()
    if critic is not None:
        metrics["critic/pretraining"] = float(not policy_trains)
        metrics["critic/reward_model"] = float(state.iteration < spec.reward_model_iterations)
        metrics["critic/step"] = float(critic.step)
    metrics["time/update_s"] = _block((policy.params, critic), t0)
    if prepared.natural_routing is not None:  # MoE, train.routing_metrics
        rows, chunks = prepared.batch, prepared.chunks
        params = policy_params(spec, policy.params)
        new_log_probs, new_routing = forwards.policy_log_probs(spec.learner, params, rows, chunks)
        replayed_log_probs, _ = forwards.policy_log_probs(
            spec.learner, params, rows, chunks, prepared.natural_routing
        )
        metrics |= update_routing_metrics(
            prepared.natural_routing,
            new_routing,
            prepared.sampler_routing,
            rows.attention_mask,
            spec.routing_diff_name,
        )
        metrics |= jax.device_get(
            ratio_share_metrics(
                new_log_probs, replayed_log_probs, prepared.natural_log_probs, rows.mask
            )
        )
    metrics |= padding_metrics(prepared.round, packed_slots, packed_real)
    metrics["update/step"] = float(policy.step)
    metrics["update/skipped_total"] = float(policy.skipped)
    return state.replace(policy=policy, critic=critic), metrics


def _valid(rnd: Round, rows=slice(None)):
    """Samples that missed the scoring deadline count in no group statistic (None: every
    sample was scored; the statistics then keep their static group size)."""
    scored = rnd.scored_rows()[rows]
    return None if scored.all() else scored


def _block(tree, t0: float) -> float:
    jax.block_until_ready(tree)
    return time.perf_counter() - t0
