"""Tests of policyopt.engine: continuous batching on the paged cache against
policyopt.sampling.generate (greedy) and a full forward pass (behaviour log-probs)."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt import sampling
from policyopt.engine import (
    Engine,
    EngineConfig,
    GenerationStopped,
    compact,
    empty_state,
    expand,
    group_pages,
)
from policyopt.models import ModelConfig, Transformer
from policyopt.sampling import Greedy, SamplingConfig, Temperature
from tests.flags import run_script
from tests.settings import TINY_MODEL, TINY_MOE

_BASE = {**TINY_MODEL, "vocab_size": 64, "initializer_range": 0.3}
MOE = ModelConfig(**_BASE, **TINY_MOE)
PROMPTS = np.array(
    [[5, 17, 3, 9, 22, 41, 0], [7, 2, 0, 0, 0, 0, 0], [11, 30, 8, 60, 0, 0, 0]], np.int32
)
LENGTHS = np.array([6, 2, 4], np.int32)
NEW = 9
GROUP = 2


@pytest.fixture(scope="module")
def model():
    return Transformer(MOE, rngs=nnx.Rngs(0))


def _greedy_generate(model, **options):
    """generate's greedy rollout of the prompts (``options``: an end token, stop sequences)."""
    return sampling.generate(
        model,
        PROMPTS,
        LENGTHS,
        max_new_tokens=NEW,
        rng=jax.random.key(0),
        temperature=0.0,
        num_samples=GROUP,
        **options,
    )


@pytest.fixture(scope="module")
def greedy_free(model):
    """generate's greedy rollout without an end token."""
    return _greedy_generate(model)


@pytest.fixture(scope="module")
def greedy_reference(model, greedy_free):
    """generate's greedy rollout, with an end token that some rows draw early."""
    eos = int(np.asarray(greedy_free.tokens)[2, 3])
    rollout = _greedy_generate(model, eos_id=eos)
    return eos, rollout


def _engine_rollout(model, eos, **engine):
    config = SamplingConfig(max_new_tokens=NEW, method=Greedy(), eos_id=eos, num_samples=GROUP)
    engine = Engine(model, EngineConfig(**engine), config)
    return engine.generate(PROMPTS, LENGTHS, jax.random.key(0)), engine.stats


def _check_equal(rollout, reference):
    lengths = np.asarray(reference.lengths)
    assert lengths.min() < NEW, "the end token must end some rows early"
    np.testing.assert_array_equal(rollout.tokens, reference.tokens)
    np.testing.assert_array_equal(rollout.mask, reference.mask)
    np.testing.assert_array_equal(rollout.prompt_tokens, reference.prompt_tokens)
    np.testing.assert_allclose(rollout.log_probs, reference.log_probs, atol=1e-5)
    np.testing.assert_allclose(rollout.raw_log_probs, reference.raw_log_probs, atol=1e-4)
    # R3: the experts of every real prompt token and every generated token, in
    # Rollout.sequences()' layout. Past a row's end generate keeps routing its fill tokens
    # while other rows run; the engine leaves k distinct experts there (never replayed).
    assert rollout.routing.shape == reference.routing.shape == (2, 6, 7 + NEW, 2)
    real = rollout.sequences()[2] > 0
    assert real.sum() == np.asarray(LENGTHS).sum() * GROUP + rollout.mask.sum()
    np.testing.assert_array_equal(rollout.routing[:, real], np.asarray(reference.routing)[:, real])
    past_end = np.concatenate([np.zeros_like(rollout.prompt_tokens, bool), rollout.mask == 0], 1)
    assert past_end.any()
    np.testing.assert_array_equal(
        rollout.routing[:, past_end], np.broadcast_to(np.arange(2), (2, past_end.sum(), 2))
    )


@pytest.mark.parametrize("attention", ["gather", "online", "pool"])
def test_greedy_equals_generate(model, greedy_reference, attention):
    """Two groups of rows for three prompts: the third is admitted when a group is
    handed out. ("pool": the second row of a group shares its prompt's full page.)"""
    eos, reference = greedy_reference
    rollout, stats = _engine_rollout(
        model,
        eos,
        kv_tokens=256,
        rows=4,
        page_size=4,
        steps_per_call=4,
        attention=attention,
        # "pool": compacted decodes as rows end (buckets of 2 and 1 rows); the compaction
        # moves rows of the state, whatever the attention (test_batched_admissions...).
        decode_bucket=1 if attention == "pool" else 0,
        # "pool": attention over the held pages only, gathered in buckets of 8 or 16 of
        # the pool's 64 pages (the greedy rows hold at most 16 + 4 in a call).
        held_page_bucket=8,
    )
    _check_equal(rollout, reference)
    assert stats["waits"] == stats["preempted_groups"] == stats["preempted_rows"] == 0
    # Pages follow the tokens held: at most 4 rows of ceil((6 + 9) / 4) = 4 pages.
    assert 0 < stats["peak_pages"] <= 16 and stats["pages_held_at_end"] == 0
    assert (stats["held_page_calls"] > 0) == (attention == "pool"), stats


def test_small_budget_waits_not_truncates(model, greedy_reference):
    """A pool of 10 pages of 2 slots for 6 rows of up to 15 tokens: rows wait for pages,
    groups are preempted and recomputed, and the rollout is the same. ("pool", the
    default: over the held pages, 4 or 8 at a time, or the whole pool when it can be full.
    Waits and preemption are the engine's, whatever the attention: the other attentions'
    outputs are checked in test_greedy_equals_generate.)"""
    eos, reference = greedy_reference
    rollout, stats = _engine_rollout(
        model,
        eos,
        kv_tokens=20,
        rows=6,
        page_size=2,
        steps_per_call=2,
        attention="pool",
        held_page_bucket=4,
    )
    _check_equal(rollout, reference)
    assert stats["waits"] > 0
    assert stats["preempted_groups"] + stats["preempted_rows"] > 0
    assert stats["peak_pages"] == 10 and stats["pages_held_at_end"] == 0
    assert stats["held_page_calls"] > 0, stats


@pytest.fixture(scope="module")
def sampled_runs(model):
    """Temperature 1, 6 prompts (3 groups of rows) through a pool small enough that rows
    wait and groups are preempted: {admit_prompts: (rollout, stats)} for one prompt per
    admission call decoding every row, and up to 3 per call decoding compacted batches of
    the running rows (buckets of 2 and 4 rows; 1 row: test_greedy_equals_generate["pool"]).
    Shared by the two tests below."""
    config = SamplingConfig(max_new_tokens=NEW, method=Temperature(1.0), num_samples=GROUP)
    prompts = np.concatenate([PROMPTS, PROMPTS[::-1]])
    lengths = np.concatenate([LENGTHS, LENGTHS[::-1]])
    runs = {}
    for admit, bucket in ((1, 0), (3, 2)):
        engine = Engine(
            model,
            EngineConfig(
                kv_tokens=24,
                rows=6,
                page_size=2,
                steps_per_call=2,
                attention="pool",
                admit_prompts=admit,
                decode_bucket=bucket,
            ),
            config,
        )
        runs[admit] = engine.generate(prompts, lengths, jax.random.key(5)), dict(engine.stats)
    return runs


def test_batched_admissions_give_the_same_rollout(sampled_runs):
    """Admitting up to 3 prompts per prefill call (padding places included) and decoding
    compacted batches gives the tokens and log-probs of admitting them one at a time and
    decoding every row, in fewer admit_rows calls; on the "pool" attention, whose
    per-layer pools the admissions write (the gather reads the same state:
    test_greedy_equals_generate). (Before a shard that preempted a group stopped admitting
    new ones, this geometry looped for ever: the preempted group, admitted again at once,
    was preempted again.)"""
    (one, one_stats), (batched, stats) = sampled_runs[1], sampled_runs[3]
    assert stats["waits"] > 0 and stats["preempted_groups"] > 0, stats
    assert stats["pages_held_at_end"] == 0, stats
    assert stats["admit_calls"] < one_stats["admit_calls"], (stats, one_stats)
    np.testing.assert_array_equal(batched.tokens, one.tokens)
    np.testing.assert_array_equal(batched.mask, one.mask)
    np.testing.assert_allclose(batched.log_probs, one.log_probs, atol=1e-5)
    real = batched.sequences()[2] > 0
    np.testing.assert_array_equal(batched.routing[:, real], one.routing[:, real])
    # Different keys for the two samples of a prompt; every row ran (no truncation).
    assert not np.array_equal(batched.tokens[0], batched.tokens[1])
    assert batched.mask.sum() == 6 * GROUP * NEW


def test_compact_and_expand_hand_worked():
    """Two shards of 4 rows: each shard's running rows first, in order, then its others;
    written back, a compacted row lands where it came from and the rest stay."""
    config = SamplingConfig(max_new_tokens=3, method=Greedy(), num_samples=1)
    s = empty_state(MOE, EngineConfig(kv_tokens=16, rows=4, page_size=2), config, 4, shards=2)
    s = s.replace(
        active=jnp.array([False, True, False, True, True, False, False, False]),
        count=jnp.arange(8, dtype=jnp.int32),
        tokens=jnp.arange(24, dtype=jnp.int32).reshape(8, 3),
        routing=jnp.arange(s.routing.size, dtype=jnp.int32).reshape(s.routing.shape),
    )
    # Jitted: op by op, every primitive of compact and expand compiles on its own.
    part, rows = jax.jit(compact, static_argnums=1)(s, 2)
    np.testing.assert_array_equal(rows, [[1, 3], [0, 1]])
    np.testing.assert_array_equal(part.count, [1, 3, 4, 5])
    np.testing.assert_array_equal(part.active, [True, True, True, False])
    np.testing.assert_array_equal(part.tokens, np.asarray(s.tokens)[[1, 3, 4, 5]])
    np.testing.assert_array_equal(part.routing, np.asarray(s.routing)[:, [1, 3, 4, 5]])
    assert part.cache.page_table.shape == (4, s.cache.max_pages)
    back = jax.jit(expand)(s, part.replace(count=part.count + 100, routing=-part.routing), rows)
    np.testing.assert_array_equal(back.count, [0, 101, 2, 103, 104, 105, 6, 7])
    routing, expected = np.asarray(back.routing), np.asarray(s.routing).copy()
    expected[:, [1, 3, 4, 5]] *= -1
    np.testing.assert_array_equal(routing, expected)


def test_stop_sequences_and_no_routing_capture(model, greedy_free):
    """A two-token stop sequence drawn by some rows ends them as in generate; with
    capture_routing=False the rollout holds no routing."""
    stop = tuple(int(t) for t in np.asarray(greedy_free.tokens)[0, 2:4])
    reference = _greedy_generate(model, stop_sequences=(stop,))
    assert np.asarray(reference.lengths).min() < NEW
    config = SamplingConfig(
        max_new_tokens=NEW, method=Greedy(), num_samples=GROUP, stop_sequences=(stop,)
    )
    engine = Engine(
        model, EngineConfig(kv_tokens=128, rows=4, page_size=4, capture_routing=False), config
    )
    rollout = engine.generate(PROMPTS, LENGTHS, jax.random.key(0))
    np.testing.assert_array_equal(rollout.tokens, reference.tokens)
    np.testing.assert_array_equal(rollout.mask, reference.mask)
    assert rollout.routing is None


def test_log_probs_equal_full_forward(model, sampled_runs):
    """Temperature 1: the behaviour log-probs are log softmax of a full forward pass over
    prompt + response (no cache) at each sampled token; of the batched admissions' run,
    whose rows waited for pages and whose preempted groups were recomputed."""
    rollout, _ = sampled_runs[3]
    tokens, positions, attention_mask = rollout.sequences()
    graphdef, params = nnx.split(model)
    forward = jax.jit(
        lambda params, *args: (
            nnx.merge(graphdef, params)(args[0], positions=args[1], attention_mask=args[2]).logits
        )
    )
    logits = forward(
        params, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(attention_mask)
    )
    prompt_len = PROMPTS.shape[1]
    logits = np.asarray(logits, np.float64)[:, prompt_len - 1 : -1]  # NumPy log softmax
    top = logits.max(-1, keepdims=True)
    log_softmax = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    expected = np.take_along_axis(log_softmax, rollout.tokens[..., None], -1)[..., 0]
    mask = rollout.mask > 0
    assert mask.sum() == GROUP * 6 * NEW
    np.testing.assert_allclose(rollout.log_probs[mask], expected[mask], atol=1e-4, rtol=1e-4)


def test_budget_errors(model):
    config = SamplingConfig(max_new_tokens=NEW, method=Greedy(), num_samples=GROUP)
    with pytest.raises(
        ValueError,
        match=r"prompt 0 has 6 tokens, more than the KV budget "
        r"EngineConfig.kv_tokens = 5",
    ):
        Engine(model, EngineConfig(kv_tokens=5, rows=2, page_size=1), config).generate(
            PROMPTS, LENGTHS, jax.random.key(0)
        )
    # The whole group's need: prompt 0 (6 tokens) takes 2 pages of 4, its partly filled last
    # page is copied for the other row (1), and each of the 2 rows gets a page to decode
    # into: 5 pages, 20 slots. (16 slots, 4 pages, spun for ever in the host loop: the
    # group was never admitted and nothing else could happen.)
    for kv_tokens in (8, 16, 19):
        with pytest.raises(
            ValueError,
            match=rf"EngineConfig.kv_tokens = {kv_tokens} cannot admit the group of 2 rows of "
            r"prompt 0 \(6 tokens\): that takes 5 free pages of 4 slots \(.*\): needs "
            r"kv_tokens >= 20$",
        ):
            Engine(model, EngineConfig(kv_tokens=kv_tokens, rows=2, page_size=4), config).generate(
                PROMPTS, LENGTHS, jax.random.key(0)
            )
    with pytest.raises(ValueError, match=r"prompt_lengths must be \[B=3\] in \[1, P=7\]"):
        Engine(model, EngineConfig(kv_tokens=64, rows=2), config).generate(
            PROMPTS, np.array([6, 0, 4]), jax.random.key(0)
        )
    with pytest.raises(ValueError, match=r"EngineConfig.rows = 3 must be a multiple"):
        Engine(model, EngineConfig(kv_tokens=64, rows=3), config)
    with pytest.raises(ValueError, match=r"EngineConfig.page_size must be >= 1, got 0"):
        EngineConfig(kv_tokens=64, rows=2, page_size=0)


def test_group_pages_by_hand():
    # ceil(L / ps) + (G - 1) [L % ps > 0] + G
    assert group_pages(6, 2, 4) == 2 + 1 + 2
    assert group_pages(8, 2, 4) == 2 + 0 + 2
    assert group_pages(15, 8, 16) == 1 + 7 + 8
    assert group_pages(1, 1, 16) == 1 + 0 + 1


def test_a_host_loop_without_progress_raises(model, monkeypatch):
    """With the up-front check out of the way, the pool of 4 pages above never admits a
    group: the host loop raises at its first pass that changes nothing, naming what it
    saw, instead of spinning."""
    config = SamplingConfig(max_new_tokens=NEW, method=Greedy(), num_samples=GROUP)
    engine = Engine(model, EngineConfig(kv_tokens=16, rows=2, page_size=4), config)
    monkeypatch.setattr(engine, "_check_budget", lambda lengths: None)
    with pytest.raises(
        RuntimeError,
        match=r"the engine made no progress in 1 decode call\(s\) in a row \(no token, no "
        r"group handed out, nothing admitted or preempted\): 3 prompts queued, groups running "
        r"per shard \[0\], rows running 0, rows waiting to be recomputed 0, free pages per "
        r"shard \[4\] of 4, blocked shards \[\] \(EngineConfig.kv_tokens = 16",
    ):
        engine.generate(PROMPTS, LENGTHS, jax.random.key(0))


def test_should_stop_ends_a_generation_in_progress(model, greedy_reference):
    """``should_stop`` is polled before every decode call: the third poll stops the call
    with ``GenerationStopped``; the next generate starts afresh and gives generate's
    rollout."""
    eos, reference = greedy_reference
    config = SamplingConfig(max_new_tokens=NEW, method=Greedy(), eos_id=eos, num_samples=GROUP)
    polls = []
    engine = Engine(
        model,
        EngineConfig(kv_tokens=256, rows=4, page_size=4, steps_per_call=1),
        config,
        should_stop=lambda: polls.append(1) or len(polls) >= 3,
    )
    with pytest.raises(GenerationStopped, match=r"generation stopped on request with 1 of 3"):
        engine.generate(PROMPTS, LENGTHS, jax.random.key(0))
    assert len(polls) == 3 and engine.stats["admit_calls"] == 1  # two prompts, one call
    engine.should_stop = None
    _check_equal(engine.generate(PROMPTS, LENGTHS, jax.random.key(0)), reference)


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """grpo with R3 on a tiny MoE, 2 prompts x 4 samples through 4 engine rows, one
    iteration: (run, its parameters before the iteration, the iteration's metrics).
    Shared by the two trainer tests below (one compilation of the engine and the steps)."""
    from policyopt.rl.loop import trainer
    from tests.rl.test_trainer import tiny

    extra = (
        "sampling.engine_kv_tokens=256,sampling.engine_rows=4,sampling.engine_page_size=4,"
        "algo.routing_replay=R3,train.num_iterations=1,eval.num_prompts=0"
    )
    run = trainer.build_run(tiny("grpo", extra=extra), str(tmp_path_factory.mktemp("engine")))
    old_params = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))(run.run_state.policy.params)
    metrics = run.step()
    return run, old_params, metrics


def test_synchronous_trainer_streams_its_rows_through_the_engine(engine_run):
    """grpo on a tiny MoE with 2 prompts x 4 samples through 4 engine rows: one group at a
    time, the second admitted when the first is handed out; the run trains."""
    run, _, metrics = engine_run
    assert run.spec.engine is not None and run.spec.engine.engine.rows == 4
    assert run.spec.engine.stats["peak_pages"] > 0
    assert np.isfinite(metrics["reward/mean"])
    assert run.last_batch.tokens.shape[0] == 2 * 4


def test_trainer_replays_the_engines_routing_r3(engine_run):
    """R3 through the engine: the round carries the routing the engine recorded, the batch
    replays it, and the old log-probs are a forward of the old parameters with it."""
    run, old_params, _ = engine_run
    batch, sampled = run.last_batch, run.last_round
    assert sampled.routing is not None and batch.routing is not None
    np.testing.assert_array_equal(np.asarray(batch.routing), sampled.routing)
    replayed, _, _ = run.spec.learner.log_probs(
        old_params, batch.tokens, batch.positions, batch.attention_mask, batch.mask, batch.routing
    )
    np.testing.assert_allclose(np.asarray(batch.old_log_probs), np.asarray(replayed), atol=1e-6)


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            "sampling.engine_kv_tokens=256,sampling.engine_rows=6",
            r"engine_rows \(6\) must be a multiple",
        ),
        # Prompts up to 16 tokens, 6 new, groups of 4: a prompt of 15 tokens takes 1 page of
        # 16, 3 copies of it and 4 pages to decode into: 8 pages.
        (
            "sampling.engine_kv_tokens=20,sampling.engine_page_size=16",
            r"^config.sampling.engine_kv_tokens \(20\) is too small for batch.group_size=4: "
            r"admitting the group of a prompt of up to 16 tokens \(the largest of "
            r"batch.prompt_buckets, 16\) and taking one row to sampling.max_new_tokens=6 "
            r"takes 8 pages of engine_page_size=16; the smallest budget that works is "
            r"engine_kv_tokens=128$",
        ),
        # The reproducer (groups of 8, 128 slots), which spun at iteration 1: 1 + 7
        # + 8 pages.
        (
            "batch.group_size=8,sampling.engine_kv_tokens=128",
            r"too small for batch.group_size=8: .* takes 16 pages .* works is "
            r"engine_kv_tokens=256$",
        ),
        # Groups of 2 in pages of 4 (16 slots spun): a prompt of 15 tokens takes 4 + 1 + 2.
        (
            "batch.group_size=2,sampling.engine_kv_tokens=16,sampling.engine_page_size=4",
            r"takes 7 pages of engine_page_size=4; the smallest budget that works is "
            r"engine_kv_tokens=28$",
        ),
        # One row to its end: 16 + 64 tokens are 5 pages of 16, more than 1 + 1 + 2.
        (
            "batch.group_size=2,sampling.max_new_tokens=64,batch.response_buckets=(64,),"
            "sampling.engine_kv_tokens=64",
            r"takes 5 pages of engine_page_size=16; .* works is engine_kv_tokens=80$",
        ),
        # Asynchronous: the whole group to its end alone (engine_pages_needed(16, 6, 4, 4)).
        (
            "async_mode.enabled=True,sampling.engine_kv_tokens=56,sampling.engine_page_size=4",
            r"taking all 4 rows to sampling.max_new_tokens=6 takes 15 pages of "
            r"engine_page_size=4; the smallest budget that works is engine_kv_tokens=60$",
        ),
    ],
)
def test_engine_config_errors(extra, message):
    """The engine's budget is checked against a whole group's need when the config is
    checked (``configs/base._check_engine_budget``), with the smallest budget that works;
    that budget passes."""
    from tests.rl.test_trainer import tiny

    with pytest.raises(ValueError, match=message):
        tiny("grpo", extra=extra)
    smallest = message.rsplit("=", 1)[-1].rstrip("$")
    if smallest.isdigit():
        tiny("grpo", extra=f"{extra},sampling.engine_kv_tokens={smallest}")


_SHARDED_SCRIPT = textwrap.dedent(r"""
    import os, re
    import jax, numpy as np
    from flax import nnx
    from policyopt import sharding
    from policyopt.engine import Engine, EngineConfig, decode_steps
    from policyopt.models import Transformer
    from policyopt.sampling import Greedy, SamplingConfig
    from tests.test_engine import GROUP, LENGTHS, MOE, NEW, PROMPTS

    model = Transformer(MOE, rngs=nnx.Rngs(0))
    # generate's greedy rollout on one device, with its end token (the test's
    # greedy_reference fixture).
    reference = np.load(os.environ["REFERENCE"])
    eos = int(reference["eos"])
    mesh = sharding.make_mesh({"fsdp": 2})
    graphdef, params = nnx.split(model)
    params = sharding.shard_params(params, mesh)
    config = SamplingConfig(max_new_tokens=NEW, method=Greedy(), eos_id=eos, num_samples=GROUP)
    # Two shards of 4 rows and 12 pages of 2 slots: rows wait for pages; the first
    # admission call prefills two prompts on shard 0 and one (and a padding place) on 1.
    # Decodes compacted to the running rows once they fit 2 rows per shard (a bucket of 1
    # row is the same program at another size: test_greedy_equals_generate["pool"]).
    engine = Engine(model, EngineConfig(kv_tokens=24, rows=4, page_size=2, steps_per_call=3,
                                        decode_bucket=2),
                    config, graphdef=graphdef, mesh=mesh)
    assert engine.shards == 2
    rng = jax.random.key(0)  # made off the mesh, as generate's callers make it
    rollout = engine.generate(PROMPTS, LENGTHS, rng, params=params)
    np.testing.assert_array_equal(rollout.tokens, reference["tokens"])
    np.testing.assert_array_equal(rollout.mask, reference["mask"])
    np.testing.assert_allclose(rollout.raw_log_probs, reference["raw_log_probs"], atol=1e-4)
    real = rollout.sequences()[2] > 0
    np.testing.assert_array_equal(rollout.routing[:, real], reference["routing"][:, real])
    assert engine.stats["pages_held_at_end"] == 0 and engine.stats["waits"] > 0, engine.stats
    print("ok equal", engine.stats, flush=True)

    # The decode program holds each shard's pools on its own device: no collective moves a
    # pool (a layer's [Hkv, pages, ps, Dh], the unrolled model's per-layer form, or a
    # shard of it). The program generate ran first (every row, the whole pool), on the
    # arguments generate gave it: the compiled program is loaded, not compiled again.
    state = engine.init_state(PROMPTS.shape[1])
    assert state.cache.per_layer and len(state.cache.k) == MOE.num_layers
    for pool in state.cache.k + state.cache.v:
        assert pool.sharding.shard_shape(pool.shape)[1] == 12
    with jax.set_mesh(mesh):
        text = decode_steps.lower(graphdef, params, state, rng, config=config, steps=3,
                                  bucket=None, held_pages=0).compile().as_text()
    shape = state.cache.pool_shape
    pools = {f"[{','.join(map(str, shape))}]" for shape in
             [shape, shape[:1] + (12,) + shape[2:]]}
    ops = re.findall(r"=\s+(\S.*?)\s+(?:all-gather|all-reduce|all-to-all|collective-permute)"
                     r"(?:-start)?\(", text)
    assert ops, "the fsdp-split weights are gathered"
    moved = [op for op in ops if any(p in op for p in pools)]
    assert not moved, moved
    print("ok local pools", flush=True)
    """)


def test_sharded_engine_on_two_devices_equals_generate(greedy_reference, tmp_path):
    """Parameters on an fsdp=2 mesh, two engine shards (one pool and two rows per device,
    rows waiting for pages): the rollout and its routing equal generate's on one
    device, and the compiled decode moves no pool between devices."""
    eos, reference = greedy_reference
    path = str(tmp_path / "reference.npz")
    fields = ("tokens", "mask", "raw_log_probs", "routing")
    np.savez(path, eos=eos, **{k: np.asarray(getattr(reference, k)) for k in fields})
    proc = run_script(_SHARDED_SCRIPT, 2, timeout=600, TF_CPP_MIN_LOG_LEVEL="1", REFERENCE=path)
    assert proc.stdout.count("ok") == 2, proc.stdout
