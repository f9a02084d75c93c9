"""Asynchronous RL (policyopt.rl.loop.async_rl): the config's defaults and errors, the group
batcher, short run_async_rl runs with resume (a critic recipe too), prompt widths and
buckets, mixed tasks. The tiny policy, prompts and slot config here are shared with
test_async_generation.py (the generator itself) and test_async_engine.py."""

import dataclasses
import functools
import itertools
import json
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import base, magistral, magistral_async, vapo
from policyopt.config import AsyncMode, typed
from policyopt.metrics import read_jsonl
from policyopt.rewards import score_batch
from policyopt.rl.batch import merge_rounds, round_from_rollout
from policyopt.rl.loop import build
from policyopt.rl.loop.async_rl import (
    GroupBatcher,
    PromptStream,
    assemble,
    async_enabled,
    make_generator,
    make_scorer,
    run_async_rl,
)
from policyopt.rl.loop.trainer import build_run
from policyopt.rl.rollouts.async_generation import (
    GroupCompletion,
    SlotConfig,
    staleness_bound,
)
from policyopt.rl.update.learner import forward_log_probs, split_params
from policyopt.sampling import SamplingConfig, sampling_method

PROMPT_WIDTH, NUM_NEW, GROUP, N_ASYNC, SEGMENT = 16, 6, 2, 8, 2
THREAD_NAMES = ("policyopt-async-generator", "policyopt-async-scorer")


def tiny(extra="", recipe=magistral_async):
    """magistral_async (or another recipe, asynchronous) shrunk to seconds: 1-layer MoE,
    2 prompts x 2 samples, 6 tokens, 8 completions in flight, weights picked up every 2
    decode steps."""
    variant = (
        f"model=tiny_moe,model.num_layers=1,batch.n_prompts=2,batch.group_size={GROUP},"
        f"sampling.max_new_tokens={NUM_NEW},task.num_train=64,task.num_test=8,"
        "eval.num_prompts=0,train.num_iterations=3,train.eval_every=0,"
        "train.checkpoint_every=1,train.loggers=jsonl,train.routing_metrics=False,"
        "dynamic_sampling.max_rounds=2,"
        f"optim.lr=0.01,async_mode.n_async={N_ASYNC},async_mode.segment_steps={SEGMENT}"
    )
    if recipe is not magistral_async:
        variant = "async_mode.enabled=True," + variant
    config = recipe.get_config(variant + ("," + extra if extra else ""))
    config.unlock()
    config.batch.prompt_buckets = (PROMPT_WIDTH,)
    config.batch.response_buckets = (NUM_NEW,)
    config.lock()
    return config


@functools.lru_cache(maxsize=None)
def policy(extra=""):
    """(graphdef, params, tokenizer) of the tiny config (with ``extra`` overrides), as
    run_async_rl builds them."""
    config = tiny(extra)
    tokenizer = build.make_tokenizer(config)
    graphdef, params = split_params(build.make_model(config, tokenizer.vocab_size))
    return graphdef, params, tokenizer


def slot_config(method=None, num_groups=N_ASYNC // GROUP, segment=SEGMENT):
    """The SlotConfig run_async_rl uses for tiny() (same jit cache entry), or a variant."""
    _, _, tokenizer = policy()
    sampling = SamplingConfig(
        max_new_tokens=NUM_NEW,
        method=method or sampling_method(1.0, 0, 1.0),
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        num_samples=GROUP,
    )
    return SlotConfig(
        sampling=sampling, num_groups=num_groups, prompt_width=PROMPT_WIDTH, segment_steps=segment
    )


def perturbed(params, seed, scale=0.05):
    """Other parameters of the same structure (numpy noise: no compilation per shape)."""
    rs = np.random.RandomState(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) + scale * rs.standard_normal(x.shape).astype(x.dtype)),
        params,
    )


def random_prompts(count, seed=0, min_length=3):
    _, _, tokenizer = policy()
    rs = np.random.RandomState(seed)
    prompts = []
    for i in range(count):
        length = int(rs.randint(min_length, PROMPT_WIDTH + 1))
        tokens = np.full((PROMPT_WIDTH,), tokenizer.pad_id, np.int32)
        tokens[:length] = rs.randint(5, tokenizer.vocab_size, size=length)
        prompts.append(dict(prompt_tokens=tokens, prompt_length=length, index=i))
    return prompts


def generator_threads():
    """The generator's threads still alive (its decode and scoring threads)."""
    return [t for t in threading.enumerate() if t.name in THREAD_NAMES and t.is_alive()]


def test_async_config_takes_every_default_from_configs_base(monkeypatch):
    """The schema is the one place of ``async_mode``'s defaults: a default changed in
    ``base_config()`` reaches the typed section through a recipe."""
    assert typed(vapo.get_config()).async_mode == AsyncMode(
        enabled=False,
        n_async=None,
        num_slots=None,
        segment_steps=8,
        prompt_width=None,
        join_timeout_s=60.0,
    )
    changed = dict(
        enabled=True, n_async=32, num_slots=16, segment_steps=3, prompt_width=24, join_timeout_s=7.5
    )
    base_config = base.base_config

    def patched():
        c = base_config()
        c.async_mode.update(changed)
        return c

    monkeypatch.setattr(base, "base_config", patched)
    config = vapo.get_config()  # group_size 8: n_async and num_slots are multiples of it
    assert typed(config).async_mode == AsyncMode(**changed)
    assert async_enabled(config)


def test_run_async_rl_trains_checkpoints_and_resumes(tmp_path):
    # Without dynamic sampling: the tiny random policy earns no reward, and Magistral's
    # dynamic sampling would leave only fillers, so no update (update/empty).
    config = tiny(
        "train.routing_metrics=True,dynamic_sampling.enabled=False,train.sample_every=3,"
        "train.sample_prompts=1"
    )
    assert async_enabled(config) and not async_enabled(magistral.get_config())
    summary = run_async_rl(config, str(tmp_path), quiet=True)
    run, metrics = summary["run"], summary["metrics"]
    # The sampler's routing is from older versions: named as staleness, not numerics.
    assert "routing/stale_sampler_disagreement/layer_0" in metrics
    assert not any(k.startswith("routing/sampler_trainer_disagreement") for k in metrics)
    assert "logprob/stale_sampler_trainer_abs_diff" in metrics
    assert "logprob/sampler_trainer_abs_diff" not in metrics
    assert metrics["async/score_s"] > 0
    assert (
        metrics["reward/verifier_errors"] == 0 and 0 <= metrics["reward/format_failure_rate"] <= 1
    )
    assert (
        summary["iteration"] == 3
        and int(run.run_state.policy.step) + int(run.run_state.policy.skipped) == 3
    )
    for key in (
        "reward/mean",
        "loss/loss",
        "update/grad_norm",
        "policy/entropy",
        "async/staleness_min",
        "async/staleness_mean",
        "async/staleness_max",
        "async/start_version_min",
        "async/finish_version_max",
        "time/wait_for_generator_s",
    ):
        assert key in metrics and np.isfinite(metrics[key]), key
    assert summary["staleness_bound"] == staleness_bound(N_ASYNC, 4, GROUP, NUM_NEW, SEGMENT) == 5
    rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert (
            0 <= r["async/staleness_min"] <= r["async/staleness_max"] <= summary["staleness_bound"]
        )
    # The last batch: whole groups (one prompt per G rows), versions consistent.
    merged, info = run.last_round, summary["async"]
    prompt_part = merged.tokens[:, : merged.prompt_width].reshape(-1, GROUP, merged.prompt_width)
    assert np.all(prompt_part == prompt_part[:, :1])
    assert info["versions"].shape == merged.mask.shape and np.all(info["start_version"] <= 2)
    # samples.jsonl at iterations 1 and 3: each batch's first group, as trained on.
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "samples.jsonl"))]
    assert [r["step"] for r in rows] == [1] * GROUP + [3] * GROUP
    samples = [r for r in rows if r["step"] == 3]
    assert [r["reward"] for r in samples] == [float(x) for x in merged.rewards[:GROUP]]
    assert {r["prompt"] for r in samples} == {info["groups"][0].meta["prompt"]}
    assert run.checkpointer.latest_step() == 3
    resumed = run_async_rl(config, str(tmp_path), num_iterations=4, quiet=True)
    assert resumed["iteration"] == 4 and np.isfinite(resumed["metrics"]["loss/loss"])
    assert resumed["metrics"]["async/start_version_min"] >= 3  # generation restarted at v3
    assert not generator_threads()


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_run_async_rl_trains_a_critic_recipe_with_value_pretraining_nll_and_resume(tmp_path):
    """VAPO, asynchronous: iteration 1 is value pretraining (critic updated, policy
    bit-identical, nothing new to publish), iteration 2 (after a resume, which restores the
    critic) updates both, with GAE advantages and the NLL term on the correct samples."""
    # -1 for wrong answers and DAPO's overlong penalty make the rewards differ between rows.
    config = tiny(
        "critic.pretrain_iterations=1,reward.incorrect_value=-1.0,reward.overlong=dapo,"
        "optim.lr=0.01,critic.lr=0.01",
        recipe=vapo,
    )
    assert config.algo.advantage == "gae" and config.algo.nll_coef > 0 and async_enabled(config)
    initial = _leaves(build_run(config, str(tmp_path / "initial")).run_state.policy.params)

    summary = run_async_rl(config, str(tmp_path), num_iterations=1, quiet=True)
    run, metrics = summary["run"], summary["metrics"]
    assert metrics["critic/pretraining"] == 1.0 and "loss/loss" not in metrics
    assert int(run.run_state.policy.step) == 0 and int(run.run_state.critic.step) == 1
    for got, want in zip(_leaves(run.run_state.policy.params), initial):
        np.testing.assert_array_equal(got, want)
    assert np.isfinite(metrics["critic/value_loss"]) and metrics["critic/value_loss"] > 0
    batch, merged = run.last_batch, run.last_round
    assert batch.returns is not None and batch.old_values is not None
    assert batch.advantages.shape == batch.mask.shape  # per-token GAE advantages
    np.testing.assert_array_equal(np.asarray(batch.nll_weights), merged.correct.astype(np.float32))
    assert run.checkpointer.latest_step() == 1

    resumed = run_async_rl(config, str(tmp_path), num_iterations=2, quiet=True)
    run, metrics = resumed["run"], resumed["metrics"]
    assert resumed["iteration"] == 2 and metrics["critic/pretraining"] == 0.0
    assert (
        int(run.run_state.policy.step) + int(run.run_state.policy.skipped) == 1
        and int(run.run_state.critic.step) == 2
    )
    for key in (
        "loss/loss",
        "loss/nll",
        "critic/value_loss",
        "critic/explained_variance",
        "advantages/mean",
        "async/staleness_max",
        "update/grad_norm",
    ):
        assert key in metrics and np.isfinite(metrics[key]), key
    assert not all(
        np.array_equal(a, b) for a, b in zip(_leaves(run.run_state.policy.params), initial)
    )
    assert not generator_threads()


def test_default_prompt_width_fits_every_prompt_of_the_stream(tmp_path):
    """Prompts of 5 to 10 tokens in buckets (8, 16): with seed 1 the first batch is in
    bucket 8 and the third in 16. The slots are as wide as the widest bucket, not as the
    first batch, so every prompt of the stream can be refilled."""
    config = tiny("task.min_digits=1,task.max_digits=4,seed=1")
    config.unlock()
    config.batch.prompt_buckets = (8, PROMPT_WIDTH)
    config.lock()
    run = build_run(config, str(tmp_path))
    stream = PromptStream(run.spec.prompts)
    generator = make_generator(run, stream)
    slots = generator.slots
    assert slots.config.prompt_width == PROMPT_WIDTH
    widths = []
    for segment, prompt in enumerate(itertools.islice(stream, 16)):  # 8 batches of 2
        widths.append(prompt["prompt_tokens"].shape[0])  # the width of its batch
        while not slots.free_groups():
            slots.segment(run.run_state.policy.params, 0, jax.random.PRNGKey(segment))
        slots.refill(slots.free_groups()[0], prompt, run.run_state.policy.params, 0)  # fits
    assert widths[0] == 8 and max(widths) == PROMPT_WIDTH  # the case the default must cover


def test_batches_take_the_prompt_bucket_of_their_longest_prompt(tmp_path):
    """Slots 16 tokens wide, prompts of at most 8 (one- and two-digit sums): each batch is
    cut to the 8-token bucket, as a synchronous batch would be, and trains with R3
    (the replayed routing is cut with it) to the same log-probs."""
    config = tiny(
        "task.min_digits=1,task.max_digits=2,async_mode.prompt_width=16,"
        "algo.routing_replay='R3',train.num_iterations=2"
    )
    config.unlock()
    config.batch.prompt_buckets = (8, PROMPT_WIDTH)
    config.lock()
    summary = run_async_rl(config, str(tmp_path), quiet=True)
    run = summary["run"]
    merged, batch = run.last_round, run.last_batch
    assert merged.prompt_width == 8 and batch.tokens.shape[1] == 8 + merged.mask.shape[1]
    assert batch.routing.shape[2] == batch.tokens.shape[1]
    assert np.all(merged.attention_mask[:, : merged.prompt_width].sum(1) >= 1)
    assert summary["metrics"]["update/skipped"] == 0

    # The cut layout gives the log-probs and routing of the uncut one (R3 replay).
    with make_generator(run, PromptStream(run.spec.prompts)) as generator:
        groups = [generator.take() for _ in range(2)]
    cut, *_ = assemble(groups, run)
    # The scorer's per-sample "scored" flags reach the batch (a sample that missed the
    # scoring deadline counts in no group statistic).
    assert all(g.scored.tolist() == [True] * GROUP for g in groups) and cut.scored.all()
    flagged, *_ = assemble([groups[0]._replace(scored=np.array([True, False])), groups[1]], run)
    assert flagged.scored.tolist() == [True, False, True, True]
    late = dataclasses.replace(
        run.spec.config, reward=dataclasses.replace(run.spec.config.reward, deadline_s=1e-9)
    )
    rescored = make_scorer(
        dataclasses.replace(run, spec=dataclasses.replace(run.spec, config=late))
    )(groups[0])
    assert not rescored.scored.any() and not rescored.sample_mask.any()
    whole = merge_rounds(
        [
            (
                round_from_rollout(g.rollout(), g.rewards, g.correct, NUM_NEW),
                np.zeros((1,), np.int64),
            )
            for g in groups
        ],
        GROUP,
        run.spec.tokenizer.pad_id,
    )
    assert whole.prompt_width == PROMPT_WIDTH and cut.prompt_width == 8
    # Jitted: run op by op, the two forwards compile each primitive of the model apart.
    forward = jax.jit(forward_log_probs, static_argnums=(0, 5))
    outs = [
        forward(
            run.spec.graphdef,
            run.run_state.policy.params,
            jnp.asarray(r.tokens),
            jnp.asarray(r.positions),
            jnp.asarray(r.attention_mask),
            NUM_NEW,
            routing=jnp.asarray(r.routing),
        )
        for r in (cut, whole)
    ]
    np.testing.assert_allclose(
        np.asarray(outs[0].log_probs) * cut.mask,
        np.asarray(outs[1].log_probs) * whole.mask,
        atol=1e-5,
    )
    real = whole.attention_mask[:, PROMPT_WIDTH - 8 :] > 0
    np.testing.assert_array_equal(
        np.asarray(outs[0].routing)[:, real],
        np.asarray(outs[1].routing)[:, :, PROMPT_WIDTH - 8 :][:, real],
    )


def test_mixed_math_and_code_prompts_are_scored_by_their_task(tmp_path, monkeypatch):
    """Async mode on task.name=mixed_jsonl: every group carries its record's task to
    ``score_batch`` (recorded on its way through; the real function scores), which checks
    it with that task's verifier; per-task accuracies are logged."""
    from policyopt.rl.loop import async_rl
    from tests.rl.test_tasks import _mixed_files

    seen = []

    def recording(*args, **kwargs):
        seen.append((kwargs["prompts"], kwargs["tasks"]))
        return score_batch(*args, **kwargs)

    monkeypatch.setattr(async_rl, "score_batch", recording)
    config = _mixed_files(tiny("train.num_iterations=1"), tmp_path)
    summary = run_async_rl(config, str(tmp_path / "train"), quiet=True)
    assert seen  # one call per group; code problems' prompts start with "py: "
    for prompts, tasks in seen:
        assert tasks == ["code" if p.startswith("py: ") else "math" for p in prompts]
    assert any(k.startswith("reward/accuracy_") for k in summary["metrics"])


def test_config_fields_and_errors():
    config = magistral_async.get_config(
        "model=tiny_dense,async_mode.n_async=32,async_mode.segment_steps=4"
    )
    assert config.model.preset == "tiny_dense" and config.async_mode.enabled
    assert (config.async_mode.n_async, config.async_mode.segment_steps) == (32, 4)
    # Worked by hand: n_async 32 leaves 24 others in flight at a group's start; over its 4
    # segments (16 tokens, 4 per segment) each other row finishes at most 3 more; batches
    # of 64: 1 + (24 + 24 * 3) // 64 = 2 (with 16 rows: 8 other rows).
    assert staleness_bound(32, 64, 8, 16, 4) == 2
    assert staleness_bound(32, 64, 8, 16, 4, rows=16) == 1 + (24 + 8 * 3) // 64 == 1
    assert config.algo.adv_scale == magistral.get_config().algo.adv_scale == "minibatch"
    with pytest.raises(ValueError, match="async_mode.n_async"):
        magistral_async.get_config("async_mode.n_async=12")  # group_size 8
    with pytest.raises(ValueError, match="async_mode.num_slots"):
        magistral_async.get_config("async_mode.num_slots=4")
    with pytest.raises(KeyError, match="async_mode.n_asink"):
        magistral_async.get_config("async_mode.n_asink=16")
    with pytest.raises(AttributeError):
        config.async_mode.typo = 1
    assert not async_enabled(vapo.get_config())
    assert async_enabled(vapo.get_config("async_mode.enabled=True"))
    with pytest.raises(ValueError, match="async_mode.segment_steps"):
        vapo.get_config("async_mode.enabled=True,async_mode.segment_steps=0")


def test_group_batcher_drops_by_criterion_and_reports_the_fillers():
    def group(rewards, correct, scored=None):
        g = len(rewards)
        return GroupCompletion(
            tokens=np.zeros((g, 2), np.int32),
            mask=np.ones((g, 2), np.float32),
            log_probs=np.zeros((g, 2), np.float32),
            raw_log_probs=np.zeros((g, 2), np.float32),
            lengths=np.full(g, 2, np.int32),
            prompt_tokens=np.zeros((g, 1), np.int32),
            prompt_lengths=np.ones(g, np.int32),
            routing=None,
            versions=np.zeros((g, 2), np.int32),
            start_version=0,
            finish_version=0,
            meta={},
            rewards=np.asarray(rewards, np.float32),
            correct=np.asarray(correct, bool),
            scored=scored,
        )

    all_correct = group([1.0, 0.5], [True, True])  # unequal rewards (length penalty)
    mixed = group([1.0, -1.0], [True, False])
    by_reward = GroupBatcher(2, 2, enabled=True, max_groups=4)
    assert not by_reward.add(all_correct) and by_reward.add(mixed)
    by_accuracy = GroupBatcher(2, 2, enabled=True, max_groups=3, criterion="accuracy")
    assert not by_accuracy.add(all_correct) and not by_accuracy.add(mixed)
    assert by_accuracy.add(group([-1.0, -1.0], [False, False]))  # max_groups reached
    groups, metrics = by_accuracy.batch()
    # The kept group, then the latest dropped one as a filler, which async_iteration masks.
    assert groups[0] is mixed and metrics["dynamic_sampling/shortfall"] == 1
    assert metrics["dynamic_sampling/kept_fraction"] == 1 / 3
    # Every group drawn, for reward/* and response/* (as the synchronous trainer's rounds).
    assert len(by_accuracy.last_seen) == 3 and any(g is all_correct for g in by_accuracy.last_seen)
    with pytest.raises(ValueError, match="criterion"):
        GroupBatcher(2, 2, enabled=True, max_groups=4, criterion="std")
    # A sample that missed the scoring deadline makes no group informative.
    half_missed = group([1.0, -1.0], [True, False], scored=np.array([True, False]))
    for criterion in ("reward", "accuracy"):
        batcher = GroupBatcher(1, 2, enabled=True, max_groups=2, criterion=criterion)
        assert not batcher.add(half_missed) and batcher.add(mixed)
        kept, _ = batcher.batch()
        assert len(kept) == 1 and kept[0] is mixed


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_routing_replay_in_the_asynchronous_loop(mode, tmp_path, monkeypatch):
    """GRPO in the asynchronous loop (the routing claim's grpo_R2_async / grpo_R3_async
    arms), with a sampler that routes differently (each round's expert ids shifted by one
    on their way into the update, as a stale or lower-precision sampler's would differ):
    R2 replays pi_old's own routing, recomputed here from the parameters the batch was
    prepared with; R3 replays the sampler's. Either way the update's ratio at those
    parameters is 1."""
    from configs import grpo
    from policyopt.rl.loop import async_rl, iteration

    prepared_with, sampled_routing = [], []
    original = async_rl.prepare

    def shifted(spec, state, rnd):
        rnd = rnd._replace(routing=(rnd.routing + 1) % spec.config.model.num_experts)
        prepared_with.append(
            jax.tree.map(jnp.copy, iteration.policy_params(spec, state.policy.params))
        )
        sampled_routing.append(np.asarray(rnd.routing))
        return original(spec, state, rnd)

    monkeypatch.setattr(async_rl, "prepare", shifted)
    config = tiny(
        f"algo.routing_replay={mode},model.num_experts=4,dynamic_sampling.enabled=False,"
        "train.num_iterations=2",
        recipe=grpo,
    )
    assert async_enabled(config) and config.algo.old_log_probs == "trainer"
    run = run_async_rl(config, str(tmp_path), quiet=True)["run"]
    batch, old_params = run.last_batch, prepared_with[-1]
    natural = np.asarray(
        run.spec.learner.log_probs(
            old_params, batch.tokens, batch.positions, batch.attention_mask, batch.mask
        )[2]
    )
    assert np.any(natural != sampled_routing[-1])  # the two arms replay different routing
    expected = natural if mode == "R2" else sampled_routing[-1]
    np.testing.assert_array_equal(np.asarray(batch.routing), expected)
    _, metrics = jax.jit(run.spec.learner.loss)(old_params, batch)
    assert float(metrics["loss/ratio_max"]) == pytest.approx(1.0, abs=1e-5)
