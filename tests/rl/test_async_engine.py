"""Asynchronous generation on the engine's paged KV cache (``async_generation.EngineSlots``,
``sampling.engine_kv_tokens > 0``): greedy outputs equal ``generate_fn``'s with rows
waiting for pages, per-token versions and behaviour log-probs across weight pushes equal
a token-by-token recomputation, the budget is checked, and ``run_async_rl`` trains."""

import dataclasses
import textwrap

import jax
import numpy as np
import pytest
from flax import nnx

from policyopt.engine import admit_rows
from policyopt.rl.loop.async_rl import PromptStream, make_generator, run_async_rl
from policyopt.rl.rollouts.async_generation import EngineSlots, SlotConfig, engine_pages_needed
from policyopt.sampling import Greedy, generate_fn
from tests.flags import run_script
from tests.rl.test_async_generation import _feed, check_equals_reference, check_recomputed
from tests.rl.test_async_rl import (
    GROUP,
    N_ASYNC,
    NUM_NEW,
    PROMPT_WIDTH,
    generator_threads,
    perturbed,
    policy,
    random_prompts,
    slot_config,
    tiny,
)

PAGE = 4
# One group alone, any prompt length: 9 pages of 4 (engine_pages_needed(16, 6, 2, 4)).
ONE_GROUP = engine_pages_needed(PROMPT_WIDTH, NUM_NEW, GROUP, PAGE) * PAGE


def run_slots(slots, prompts, params_by_segment, refill_version=None):
    """Refills free slots (oldest prompt first) and runs segments until every prompt is
    done; segment i under ``params_by_segment(i)`` = (params, version). Returns the
    completions by prompt index."""
    queue, done = list(prompts), {}
    for segment in range(100):  # a livelock fails here
        params, version = params_by_segment(segment)
        for group in slots.free_groups():
            if queue:
                slots.refill(group, queue.pop(0), params, version)
        for completion in slots.segment(params, version, jax.random.PRNGKey(segment)):
            done[completion.meta["index"]] = completion
        if not queue and slots.num_active == 0:
            return done
    raise AssertionError(f"{len(done)} of {len(prompts)} prompts done in 100 segments")


def test_pages_needed_by_one_group_by_hand():
    # P = 16, N = 6, G = 2, pages of 4: the worst prompt has 15 tokens, 3 full pages
    # shared, then each row 15 + 6 = 21 tokens = 6 pages, 3 of them its own: 3 + 2 * 3.
    assert engine_pages_needed(16, 6, 2, 4) == 9
    # One token of prompt, one new: admission wants the prompt page, a copy for the
    # second row and a page per row (4); the end needs 2 pages.
    assert engine_pages_needed(1, 1, 2, 4) == 4


@pytest.fixture(scope="module")
def greedy_case():
    """Six prompts of 1 to 16 tokens and generate_fn's greedy rollouts of them: ``free``
    without an end token, ``reference`` with the end token the greedy first token of
    prompt 2 (``sampling``), so that lengths differ and slots are refilled while other
    groups are mid-way (as test_async_rl's dense test). Shared by the greedy tests and the
    two-device script, which compile generate_fn once for them all."""
    graphdef, params, _ = policy()
    prompts = random_prompts(6, seed=3, min_length=1)
    tokens = np.stack([p["prompt_tokens"] for p in prompts])
    lengths = np.asarray([p["prompt_length"] for p in prompts], np.int32)
    base = slot_config(Greedy(), num_groups=3, segment=3).sampling
    free = generate_fn(graphdef, params, tokens, lengths, jax.random.PRNGKey(0), config=base)
    # The greedy first token of prompt 2 is the argmax of a token-by-token forward of it.
    cache = nnx.merge(graphdef, params).init_cache(1, PROMPT_WIDTH + NUM_NEW)
    for position, token in enumerate(tokens[2, : lengths[2]]):
        log_probs, cache, _ = _feed(graphdef, params, token, position, cache)
    eos = int(np.asarray(free.tokens)[2 * GROUP, 0])
    assert eos == int(np.argmax(np.asarray(log_probs)))
    sampling = dataclasses.replace(base, eos_id=eos)
    reference = generate_fn(
        graphdef, params, tokens, lengths, jax.random.PRNGKey(0), config=sampling
    )
    assert len(set(np.asarray(reference.lengths).tolist())) > 1
    # On the host: the tests slice them row by row (op by op on device arrays).
    host = lambda rollout: jax.tree.map(np.asarray, rollout)
    return prompts, tokens, lengths, host(free), sampling, host(reference)


@pytest.mark.parametrize("kv_tokens", [ONE_GROUP, 4 * ONE_GROUP], ids=["tight", "ample"])
def test_greedy_equals_the_synchronous_sampler_and_rows_wait_for_pages(greedy_case, kv_tokens):
    graphdef, params, _ = policy()
    prompts, _, _, _, sampling, reference = greedy_case
    greedy = SlotConfig(sampling, 3, PROMPT_WIDTH, 3)
    slots = EngineSlots(graphdef, greedy, params, kv_tokens=kv_tokens, page_size=PAGE)
    done = run_slots(slots, prompts, lambda segment: (params, 0))
    assert sorted(done) == list(range(len(prompts)))
    check_equals_reference(done, reference)
    # Every page came back; with the tight budget rows waited for pages, with the ample one
    # never.
    assert int(np.sum(np.asarray(slots.state.cache.pages_in_use()))) == 0
    if kv_tokens == ONE_GROUP:
        assert slots.stats["waits"] > 0
    else:
        assert slots.stats["waits"] == slots.stats["preempted_groups"] == 0


@pytest.mark.parametrize("kv_tokens", [ONE_GROUP, 4 * ONE_GROUP], ids=["tight", "ample"])
def test_behaviour_log_probs_follow_the_version_of_every_token(kv_tokens):
    graphdef, params0, _ = policy()
    distinct = [params0, perturbed(params0, 1), perturbed(params0, 2)]
    params = {version: distinct[version % 3] for version in range(40)}
    slots = EngineSlots(graphdef, slot_config(), params0, kv_tokens=kv_tokens, page_size=PAGE)
    # One push before every segment (version = segment); the KV cache is kept.
    done = run_slots(slots, random_prompts(8, seed=7), lambda i: (params[i], i))
    assert len(done) == 8
    spanning = 0
    for completion in done.values():
        for row in range(GROUP):
            length = int(completion.lengths[row])
            versions = completion.versions[row, :length]
            assert versions[0] == completion.start_version <= completion.finish_version
            assert np.all(np.diff(versions) >= 0) and np.all(
                completion.versions[row, length:] == -1
            )
            if length == NUM_NEW and kv_tokens > ONE_GROUP and completion.meta["index"] < 4:
                # No waits, admitted before segment `first`: segments of 2 steps, the
                # first token's logits from the prefill.
                first = completion.start_version
                np.testing.assert_array_equal(versions, first + np.asarray([0, 0, 0, 1, 1, 2]))
            spanning = check_recomputed(graphdef, params, completion, row, spanning)
    assert spanning == 2
    if kv_tokens == ONE_GROUP:  # versions stay exact through waits and recomputation
        assert slots.stats["waits"] > 0 and slots.stats["preempted_groups"] > 0


def test_a_budget_below_one_group_is_refused():
    graphdef, params, _ = policy()
    with pytest.raises(ValueError, match=rf"engine_kv_tokens = {ONE_GROUP - PAGE} cannot hold"):
        EngineSlots(graphdef, slot_config(), params, kv_tokens=ONE_GROUP - PAGE, page_size=PAGE)


def test_a_shard_that_cannot_admit_and_runs_nothing_raises(monkeypatch):
    """With the pool check out of the way (``engine_pages_needed``), a pool of 2 pages
    never admits a group of 2 rows: the segment raises, naming what it saw, where the
    generator thread would run empty segments for ever."""
    from policyopt.rl.rollouts import async_generation

    graphdef, params, _ = policy()
    monkeypatch.setattr(async_generation, "engine_pages_needed", lambda *args: 0)
    slots = EngineSlots(graphdef, slot_config(), params, kv_tokens=2 * PAGE, page_size=PAGE)
    slots.refill(0, random_prompts(1)[0], params, 0)
    with pytest.raises(
        RuntimeError,
        match=r"the paged engine cannot admit a queued group on shard\(s\) \[0\] and runs none "
        r"there \(groups queued \[0\], free pages per shard \[2\] of 2, blocked shards \[\]\)",
    ):
        slots.segment(params, 0, jax.random.PRNGKey(0))


def test_take_stops_on_request_and_the_generator_closes():
    """``should_stop`` reaches a trainer waiting in ``take``: ``GenerationStopped`` within
    its 0.5 s poll, and leaving the ``with`` block stops and joins the threads."""
    import threading
    import time

    from policyopt.engine import GenerationStopped
    from policyopt.rl.rollouts.async_generation import AsyncGenerator

    graphdef, params, _ = policy()
    slots = EngineSlots(graphdef, slot_config(), params, kv_tokens=ONE_GROUP, page_size=PAGE)
    requested, release = threading.Event(), threading.Event()
    generator = AsyncGenerator(
        slots,
        iter(random_prompts(64)),
        params,
        0,
        rng=jax.random.PRNGKey(0),
        n_async=N_ASYNC,
        score_fn=lambda completion: release.wait() and completion,  # hands none out
        join_timeout_s=0.1,
        should_stop=requested.is_set,
    )
    with generator:
        threading.Timer(1.0, requested.set).start()
        start = time.perf_counter()
        with pytest.raises(GenerationStopped, match="asynchronous generation stopped on request"):
            generator.take()
        assert time.perf_counter() - start < 1.0 + 2.0
    assert not generator._thread.is_alive()  # joined; the scorer was left waiting
    release.set()
    generator._threads[1].join(timeout=60)
    assert not generator_threads()


def test_run_async_rl_on_the_paged_engine_trains(tmp_path):
    config = tiny(
        f"dynamic_sampling.enabled=False,train.num_iterations=2,train.checkpoint_every=2,"
        f"sampling.engine_kv_tokens={2 * ONE_GROUP},sampling.engine_page_size={PAGE},"
        f"batch.prompt_buckets=({PROMPT_WIDTH},)"
    )
    compiled = admit_rows._cache_size()
    summary = run_async_rl(config, str(tmp_path), quiet=True)
    # One compilation of the admission: the slot state starts placed as admit_rows returns
    # it with the trainer's parameters (on a one-device mesh).
    assert admit_rows._cache_size() - compiled <= 1
    run, metrics = summary["run"], summary["metrics"]
    assert (
        summary["iteration"] == 2
        and int(run.run_state.policy.step) + int(run.run_state.policy.skipped) == 2
    )
    for key in (
        "loss/loss",
        "update/grad_norm",
        "async/staleness_max",
        "reward/mean",
        "async/page_waits",
        "async/preempted_groups",
    ):
        assert key in metrics and np.isfinite(metrics[key]), key
    merged = run.last_round
    prompt_part = merged.tokens[:, : merged.prompt_width].reshape(-1, GROUP, merged.prompt_width)
    assert np.all(prompt_part == prompt_part[:, :1])  # whole groups
    assert 0 < metrics["async/peak_pages"] <= 2 * ONE_GROUP // PAGE
    assert not generator_threads()
    generator = make_generator(run, PromptStream(run.spec.prompts))
    assert isinstance(generator.slots, EngineSlots)
    assert generator.slots.config.rows == N_ASYNC


_MESH_SCRIPT = textwrap.dedent(r"""
    import dataclasses
    import jax, jax.numpy as jnp, numpy as np
    from policyopt import sharding
    from policyopt.engine import admit_rows, decode_steps, evict_rows, group_rows
    import os
    from policyopt.rl.rollouts.async_generation import EngineSlots, SlotConfig
    from policyopt.sampling import Greedy
    from tests.rl.test_async_engine import ONE_GROUP, PAGE, run_slots
    from tests.rl.test_async_rl import GROUP, PROMPT_WIDTH, policy, random_prompts, slot_config

    graphdef, params, _ = policy()
    prompts = random_prompts(6, seed=3, min_length=1)
    # generate_fn's greedy rollout on one device (the test's greedy_case: the end token
    # the greedy first token of prompt 2, so that lengths differ).
    reference = np.load(os.environ["REFERENCE"])
    base = slot_config(Greedy(), num_groups=4, segment=3)
    config = SlotConfig(dataclasses.replace(base.sampling, eos_id=int(reference["eos"])), 4,
                        PROMPT_WIDTH, 3)
    mesh = sharding.make_mesh({"fsdp": 2})
    placed = sharding.shard_params(params, mesh)
    fns = (admit_rows, decode_steps, evict_rows, group_rows)
    before = [fn._cache_size() for fn in fns]
    # Two shards (two groups and a pool of one group's pages each, on its own device).
    slots = EngineSlots(graphdef, config, placed, kv_tokens=ONE_GROUP, page_size=PAGE, mesh=mesh)
    assert slots.shards == 2
    pool = slots.state.cache.k[0]  # layer 0's pool [Hkv, pages, ps, Dh] (per-layer form)
    assert pool.sharding.shard_shape(pool.shape)[1] == ONE_GROUP // PAGE
    done = run_slots(slots, prompts, lambda segment: (placed, 0))
    assert sorted(done) == list(range(len(prompts)))
    for index, completion in done.items():
        rows = slice(index * GROUP, (index + 1) * GROUP)
        np.testing.assert_array_equal(completion.tokens, reference["tokens"][rows])
        np.testing.assert_array_equal(completion.mask, reference["mask"][rows])
        np.testing.assert_allclose(completion.raw_log_probs, reference["raw_log_probs"][rows],
                                   atol=1e-4)
    assert slots.stats["waits"] > 0, slots.stats
    # One compilation of each call across every admission and segment (the state keeps
    # its shardings; evict_rows only runs on a preemption).
    grown = [fn._cache_size() - b for fn, b in zip(fns, before)]
    assert grown[:2] == [1, 1] and grown[2] <= 1 and grown[3] == 1, grown
    print("ok mesh", dict(slots.stats), flush=True)
    """)


def test_engine_slots_on_two_devices_equal_generate_and_compile_once(greedy_case, tmp_path):
    """Parameters on an fsdp=2 mesh, two engine shards (2 groups and a pool per device,
    rows waiting for pages): greedy completions equal generate_fn's on one device, and
    every jitted call compiles once across the run."""
    _, _, _, _, sampling, reference = greedy_case
    path = str(tmp_path / "reference.npz")
    np.savez(
        path,
        eos=sampling.eos_id,
        **{k: np.asarray(getattr(reference, k)) for k in ("tokens", "mask", "raw_log_probs")},
    )
    proc = run_script(_MESH_SCRIPT, 2, timeout=600, TF_CPP_MIN_LOG_LEVEL="1", REFERENCE=path)
    assert "ok mesh" in proc.stdout, proc.stdout[-4000:]


def test_stop_sequences_end_rows_as_in_the_synchronous_sampler(greedy_case):
    graphdef, params, _ = policy()
    prompts, tokens, lengths, free, _, _ = greedy_case  # free: greedy, no end token
    base = slot_config(Greedy(), num_groups=2, segment=3)
    stop = tuple(int(t) for t in np.asarray(free.tokens)[0, 1:3])  # ends prompt 0 at 3 tokens
    sampling = dataclasses.replace(base.sampling, stop_sequences=(stop,))
    reference = jax.tree.map(
        np.asarray,
        generate_fn(graphdef, params, tokens, lengths, jax.random.PRNGKey(0), config=sampling),
    )
    assert int(reference.lengths[0]) == 3
    config = SlotConfig(sampling, 2, PROMPT_WIDTH, 3)
    slots = EngineSlots(graphdef, config, params, kv_tokens=2 * ONE_GROUP, page_size=PAGE)
    done = run_slots(slots, prompts, lambda segment: (params, 0))
    for index, completion in done.items():
        rows = slice(index * GROUP, (index + 1) * GROUP)
        np.testing.assert_array_equal(completion.tokens, np.asarray(reference.tokens[rows]))
        np.testing.assert_array_equal(completion.lengths, np.asarray(reference.lengths[rows]))
