"""Asynchronous generation (policyopt.rl.rollouts.async_generation): behaviour log-probs
across weight pushes against a token-by-token recomputation, greedy equality with the synchronous
sampler, compiled once, bounded staleness, whole groups, slow scoring, and errors raised in
the caller with no thread left behind."""

import dataclasses
import functools
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.rl.rollouts.async_generation import (
    AsyncGenerator,
    GeneratorExhausted,
    SlotConfig,
    SlotGenerator,
    _group_rows_fn,
    _refill_fn,
    _segment_fn,
    staleness_bound,
)
from policyopt.sampling import Greedy, generate_fn
from tests.rl.test_async_rl import (
    GROUP,
    N_ASYNC,
    NUM_NEW,
    PROMPT_WIDTH,
    SEGMENT,
    generator_threads,
    perturbed,
    policy,
    random_prompts,
    slot_config,
)


@functools.partial(jax.jit, static_argnums=0)
def _feed(graphdef, params, token, position, cache):
    """One token through the model with a KV cache: its own logits (the model's
    projection, not the sampler's) as log-probs [V], the cache, the routing [L, k]."""
    out = nnx.merge(graphdef, params)(
        jnp.reshape(token, (1, 1)), positions=jnp.reshape(position, (1, 1)), cache=cache
    )
    return jax.nn.log_softmax(out.logits[0, 0]), out.cache, out.routing[:, 0, 0]


def recompute(graphdef, params_by_version, prompt, tokens, versions):
    """Token by token (prompt included, no padding), each forward under the parameters
    of the version recorded for it: the prompt and token 0's logits under versions[0],
    token n's logits from feeding token n-1 under versions[n].

    Returns (log_probs [n], routing [L, len(prompt) + n - 1, k] of every token fed)."""
    cache = nnx.merge(graphdef, params_by_version[versions[0]]).init_cache(
        1, PROMPT_WIDTH + NUM_NEW
    )
    fed = [(token, versions[0]) for token in prompt] + list(zip(tokens[:-1], versions[1:]))
    log_probs, routing = [], []
    for position, (token, version) in enumerate(fed):
        out, cache, used = _feed(graphdef, params_by_version[version], token, position, cache)
        routing.append(np.asarray(used))
        if position >= len(prompt) - 1:
            log_probs.append(float(out[tokens[position - len(prompt) + 1]]))
    return np.asarray(log_probs), np.stack(routing, axis=1)


def check_recomputed(graphdef, params_by_version, completion, row: int, spanning: int) -> int:
    """Asserts that row `row` of `completion` has the behaviour log-probs (raw, and sampled
    at temperature 1 without truncation: the same) and routing of :func:`recompute` under
    the versions it records. Of the first two rows (`spanning` counts them) that span
    versions, also that the all-version-0 recomputation differs (the push changed the
    log-probs); returns the new count."""
    length = int(completion.lengths[row])
    versions = completion.versions[row, :length]
    length_p = int(completion.prompt_lengths[row])
    prompt = completion.prompt_tokens[row, PROMPT_WIDTH - length_p :]  # right-aligned
    tokens = completion.tokens[row, :length]
    want, routing = recompute(graphdef, params_by_version, prompt, tokens, versions)
    np.testing.assert_allclose(completion.raw_log_probs[row, :length], want, atol=2e-5)
    np.testing.assert_allclose(completion.log_probs[row, :length], want, atol=2e-5)
    # Routing of the prompt and of every fed token (the last token's forward ran under a
    # version the token versions do not record).
    start = PROMPT_WIDTH - length_p
    np.testing.assert_array_equal(
        completion.routing[:, row, start : PROMPT_WIDTH + length - 1], routing
    )
    if len(set(versions.tolist())) > 1 and spanning < 2:
        stale, _ = recompute(graphdef, params_by_version, prompt, tokens, [0] * length)
        assert np.max(np.abs(stale - want)) > 1e-4
        return spanning + 1
    return spanning


def check_equals_reference(done, reference):
    """Asserts that the completions `done` (by prompt index, under version 0 throughout)
    equal their rows of the synchronous `reference` rollout: tokens, mask, lengths, prompt,
    raw log-probs, and the routing of every position before the end; token versions 0
    (-1 after the end)."""
    _, _, attention_mask = reference.sequences()
    for index, completion in done.items():
        rows = slice(index * GROUP, (index + 1) * GROUP)
        np.testing.assert_array_equal(completion.tokens, np.asarray(reference.tokens[rows]))
        np.testing.assert_array_equal(completion.mask, np.asarray(reference.mask[rows]))
        np.testing.assert_array_equal(completion.lengths, np.asarray(reference.lengths[rows]))
        np.testing.assert_array_equal(
            completion.prompt_tokens, np.asarray(reference.prompt_tokens[rows])
        )
        np.testing.assert_allclose(
            completion.raw_log_probs, np.asarray(reference.raw_log_probs[rows]), atol=2e-5
        )
        valid = np.asarray(attention_mask[rows]) > 0  # routing after the end is never used
        same = np.all(completion.routing == np.asarray(reference.routing[:, rows]), axis=-1)
        assert np.all(same[:, valid])
        assert np.all(completion.versions[completion.mask > 0] == 0)
        assert np.all(completion.versions[completion.mask == 0] == -1)


def test_behaviour_log_probs_follow_the_version_of_every_token():
    graphdef, params0, _ = policy()
    # Versions 0..5 (labels increase as a trainer's do); three distinct parameter sets.
    distinct = [params0, perturbed(params0, 1), perturbed(params0, 2)]
    params = {version: distinct[version % 3] for version in range(6)}
    slots = SlotGenerator(graphdef, slot_config(), params0)
    prompts = iter(random_prompts(12))
    for group in slots.free_groups():
        slots.refill(group, next(prompts), params[0], 0)
    finished = []
    # One push before every segment; the KV cache is kept.
    for segment, version in enumerate(range(6)):
        finished += slots.segment(params[version], version, jax.random.PRNGKey(segment))
        for group in slots.free_groups():  # refilled under the newest weights
            slots.refill(group, next(prompts), params[version], version)
    initial = [c for c in finished if c.meta["index"] < N_ASYNC // GROUP]
    later = [c for c in finished if c.meta["index"] >= N_ASYNC // GROUP]
    assert len(initial) == N_ASYNC // GROUP and later
    spanning = 0
    for completion in initial + later[:1]:
        for row in range(GROUP):
            length = int(completion.lengths[row])
            versions = completion.versions[row, :length]
            assert versions[0] == completion.start_version
            assert np.all(np.diff(versions) >= 0) and np.all(
                completion.versions[row, length:] == -1
            )
            if length == NUM_NEW:
                # Token n's logits come from feeding token n-1 (the prompt for n = 0), in
                # segments of 2 steps. The first groups were prefilled under the version of
                # the first segment, later ones under that of the segment before theirs.
                first = completion.start_version
                steps = [0, 0, 0, 1, 1, 2] if first == 0 else [0, 1, 1, 2, 2, 3]
                np.testing.assert_array_equal(versions, first + np.asarray(steps))
            spanning = check_recomputed(graphdef, params, completion, row, spanning)
    assert spanning == 2


def test_slot_generator_refuses_token_ids_outside_the_vocabulary():
    graphdef, params, tokenizer = policy()
    config = slot_config()
    vocab = nnx.merge(graphdef, params).config.vocab_size
    bad = SlotConfig(
        dataclasses.replace(config.sampling, pad_id=vocab),
        config.num_groups,
        config.prompt_width,
        config.segment_steps,
    )
    with pytest.raises(ValueError, match=rf"SamplingConfig.pad_id = {vocab} is outside"):
        SlotGenerator(graphdef, bad, params)


@pytest.mark.parametrize("extra", ["", "model.scan_layers=True"], ids=["loop", "scan"])
def test_greedy_without_updates_equals_the_synchronous_sampler(extra):
    graphdef, params, tokenizer = policy(extra)
    assert nnx.merge(graphdef, params).config.scan_layers == bool(extra)  # stacked cache
    prompts = random_prompts(5, seed=3, min_length=1)
    tokens = np.stack([p["prompt_tokens"] for p in prompts])
    lengths = np.asarray([p["prompt_length"] for p in prompts], np.int32)
    # The end token: the greedy first token of prompt 2, so that lengths differ and slots
    # are refilled while other groups are mid-way. (recompute's cache length: one _feed
    # compilation for both.)
    cache = nnx.merge(graphdef, params).init_cache(1, PROMPT_WIDTH + NUM_NEW)
    for position, token in enumerate(tokens[2, : lengths[2]]):
        log_probs, cache, _ = _feed(graphdef, params, token, position, cache)
    greedy = slot_config(Greedy(), num_groups=2, segment=3)
    greedy = SlotConfig(
        dataclasses.replace(greedy.sampling, eos_id=int(jnp.argmax(log_probs))), 2, PROMPT_WIDTH, 3
    )
    reference = generate_fn(
        graphdef, params, tokens, lengths, jax.random.PRNGKey(0), config=greedy.sampling
    )
    assert len(set(np.asarray(reference.lengths).tolist())) > 1
    slots = SlotGenerator(graphdef, greedy, params)
    queue, done = list(prompts), {}
    for segment in itertools.count():
        for group in slots.free_groups():
            if queue:
                slots.refill(group, queue.pop(0), params, 0)
        for completion in slots.segment(params, 0, jax.random.PRNGKey(segment)):
            done[completion.meta["index"]] = completion
        if not queue and slots.num_active == 0:
            break
    check_equals_reference(done, reference)
    assert sorted(done) == list(range(len(prompts)))


def test_refill_and_segment_compile_once():
    """The slot state stays committed to the device (the initial one and the host-made
    `active` flags too): jit keys its cache on committedness, so a mix would compile the
    prefill and the decode segment again mid-run."""
    graphdef, params, _ = policy()
    params = jax.device_put(params, jax.devices()[0])  # as run_async_rl's (committed) copies
    config = slot_config(num_groups=3, segment=3)  # a geometry no other test uses
    fns = (_refill_fn, _segment_fn, _group_rows_fn)  # prefill, decode, a finished group's rows
    before = [fn._cache_size() for fn in fns]
    slots = SlotGenerator(graphdef, config, params)
    prompts = iter(random_prompts(6, seed=11))
    finished = 0
    for segment in range(6):  # refills after finished groups, then segments without refills
        for group in slots.free_groups():
            prompt = next(prompts, None)
            if prompt is not None:
                slots.refill(group, prompt, params, segment)
        finished += len(slots.segment(params, segment, jax.random.PRNGKey(segment)))
    assert finished == 6 and slots.num_active == 0
    assert [fn._cache_size() - b for fn, b in zip(fns, before)] == [1, 1, 1]


def test_threaded_generation_keeps_groups_whole_and_staleness_bounded():
    """A trainer that publishes a new version after every batch of n_batch completions,
    as fast as it can: tokens are never staler than the bound, groups stay whole, every
    prompt comes back exactly once, then the generator reports exhaustion."""
    graphdef, params0, tokenizer = policy()
    versions = [params0, perturbed(params0, 1)]
    prompts = random_prompts(24, seed=5)
    n_batch = 4
    bound = staleness_bound(N_ASYNC, n_batch, GROUP, NUM_NEW, SEGMENT)
    slots = SlotGenerator(graphdef, slot_config(), params0)
    seen, worst, version = [], 0, 0
    with AsyncGenerator(
        slots, iter(prompts), params0, 0, rng=jax.random.PRNGKey(0), n_async=N_ASYNC
    ) as generator:
        while True:
            batch = []
            try:
                while len(batch) < n_batch // GROUP:
                    batch.append(generator.take())
            except GeneratorExhausted:
                break
            for completion in batch:
                assert completion.tokens.shape == (GROUP, NUM_NEW)
                prompt = prompts[completion.meta["index"]]
                expect = np.roll(
                    np.where(
                        np.arange(PROMPT_WIDTH) < prompt["prompt_length"],
                        prompt["prompt_tokens"],
                        tokenizer.pad_id,
                    ),
                    PROMPT_WIDTH - prompt["prompt_length"],
                )
                assert np.all(completion.prompt_tokens == expect[None])  # all G rows: this prompt
                valid = completion.versions[completion.mask > 0]
                assert valid.min() >= completion.start_version and valid.max() <= version
                assert completion.start_version <= completion.finish_version <= version
                worst = max(worst, version - completion.start_version)
                seen.append(completion.meta["index"])
            version += 1
            generator.publish(versions[version % 2], version)
        thread = generator._thread
    assert not thread.is_alive() and not generator_threads()
    assert sorted(seen) == list(range(len(prompts)))
    assert 0 < worst <= bound


def test_slow_scoring_neither_stops_decoding_nor_delays_close():
    """Groups are scored in a thread of their own: decoding goes on while a slow verifier
    scores, groups come back in finish order with their scores, the stream ends after the
    last scored group, and close() stops the scorer after its current group instead of
    scoring every finished group first."""
    graphdef, params, _ = policy()
    events, lock = [], threading.Lock()

    def slow_score(completion):
        with lock:
            events.append(("score", completion.meta["index"]))
        time.sleep(0.3)
        with lock:
            events.append(("scored", completion.meta["index"]))
        return completion._replace(rewards=np.full(GROUP, completion.meta["index"], np.float32))

    slots = SlotGenerator(graphdef, slot_config(), params)
    segment = slots.segment

    def counted_segment(*args, **kwargs):
        with lock:
            events.append(("segment", None))
        return segment(*args, **kwargs)

    slots.segment = counted_segment
    prompts = random_prompts(6, seed=3)
    generator = AsyncGenerator(
        slots,
        iter(prompts),
        params,
        0,
        rng=jax.random.PRNGKey(0),
        n_async=N_ASYNC,
        score_fn=slow_score,
        join_timeout_s=5.0,
    )
    taken = []
    with generator:
        with pytest.raises(GeneratorExhausted):
            while True:
                taken.append(generator.take())
    assert not generator_threads()
    scored = [index for kind, index in events if kind == "score"]
    assert [c.meta["index"] for c in taken] == scored and sorted(scored) == list(range(6))
    assert all(np.all(c.rewards == c.meta["index"]) for c in taken)
    during = [events[events.index(("score", i)) : events.index(("scored", i))] for i in scored]
    assert any(("segment", None) in span for span in during)  # decoded while a group was scored
    assert generator.stats["groups_scored"] == 6 and generator.stats["score_seconds"] >= 1.5

    # Leaving early: several finished groups wait for the scorer; close() does not score them.
    generator = AsyncGenerator(
        SlotGenerator(graphdef, slot_config(), params),
        iter(random_prompts(40, seed=4)),
        params,
        0,
        rng=jax.random.PRNGKey(0),
        n_async=N_ASYNC,
        score_fn=slow_score,
        join_timeout_s=5.0,
    )
    with generator:
        generator.take()
        time.sleep(0.5)  # every started group (at most n_async / G = 4 in flight) finishes
        start = time.perf_counter()
    assert time.perf_counter() - start < 1.5 and not generator_threads()
    assert generator.stats["groups_scored"] < generator.stats["groups_started"]


def test_close_cuts_a_busy_scorer_short_and_never_hangs():
    """A scorer blocked in a group: close() calls ``interrupt_scoring`` (async_rl kills the
    scorer's worker pool) and returns at once; without one it waits ``join_timeout_s``,
    warns and leaves the thread to finish, never raising over the caller."""
    graphdef, params, _ = policy()
    for interrupt in (True, False):
        release, busy = threading.Event(), threading.Event()

        def blocked_score(completion):
            busy.set()
            release.wait(30)
            return completion._replace(rewards=np.zeros(GROUP, np.float32))

        generator = AsyncGenerator(
            SlotGenerator(graphdef, slot_config(), params),
            iter(random_prompts(8, seed=11)),
            params,
            0,
            rng=jax.random.PRNGKey(0),
            n_async=N_ASYNC,
            score_fn=blocked_score,
            join_timeout_s=1.0,
            interrupt_scoring=release.set if interrupt else None,
        )
        generator.start()
        assert busy.wait(60)
        start = time.perf_counter()
        generator.close()
        elapsed = time.perf_counter() - start
        if interrupt:
            assert elapsed < 1.0 and not generator_threads()
        else:
            assert 1.0 <= elapsed < 3.0 and [t.name for t in generator_threads()] == [
                "policyopt-async-scorer"
            ]
            release.set()
            generator._threads[1].join(5)
            assert not generator_threads()


class _Boom(Exception):
    pass


def test_errors_in_the_generator_surface_in_the_caller_and_no_thread_survives():
    graphdef, params, _ = policy()
    # A prompt longer than the slots' prompt width: the generator thread raises.
    prompts = random_prompts(3, seed=7)
    prompts.append(
        dict(
            prompt_tokens=np.ones(PROMPT_WIDTH + 4, np.int32),
            prompt_length=PROMPT_WIDTH + 4,
            index=3,
        )
    )
    generator = AsyncGenerator(
        SlotGenerator(graphdef, slot_config(), params),
        iter(prompts),
        params,
        0,
        rng=jax.random.PRNGKey(0),
        n_async=N_ASYNC,
    )
    with pytest.raises(RuntimeError, match="generator thread failed") as info:
        with generator:
            for _ in range(10):
                generator.take()
    assert isinstance(info.value.__cause__, ValueError)
    assert "async_mode.prompt_width" in str(info.value.__cause__)
    assert not generator._thread.is_alive()

    # A prompt source that fails, and an error in the trainer while generating.
    def failing():
        yield from random_prompts(2, seed=8)
        raise _Boom("malformed row 2")

    generator = AsyncGenerator(
        SlotGenerator(graphdef, slot_config(), params),
        failing(),
        params,
        0,
        rng=jax.random.PRNGKey(0),
    )
    with pytest.raises(RuntimeError) as info:
        with generator:
            while True:
                generator.take()
    assert isinstance(info.value.__cause__, _Boom)
    generator = AsyncGenerator(
        SlotGenerator(graphdef, slot_config(), params),
        iter(random_prompts(50, seed=9)),
        params,
        0,
        rng=jax.random.PRNGKey(0),
    )
    with pytest.raises(KeyError):
        with generator:
            generator.take()
            raise KeyError("trainer failed")
    assert not generator._thread.is_alive() and not generator_threads()
