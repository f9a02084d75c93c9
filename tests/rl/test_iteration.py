"""The iteration's stages: the row-chunked map against one call, the method-specific steps
each recipe chooses, and sample -> prepare -> update_epochs called one by one against
rl_iteration (the same parameters bit for bit, the same metrics)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from policyopt.rl.loop import iteration, trainer
from policyopt.rl.update import forwards, methods
from tests.rl.test_trainer import tiny


def test_map_row_chunks_equals_one_call_over_all_rows():
    """Chunks along each array's row axis, outputs concatenated along theirs, None kept."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    routing = jnp.asarray(rng.integers(0, 9, size=(2, 6, 5, 3)), jnp.int32)
    calls = []

    def fn(x, r, missing, packing):
        calls.append((x.shape, r.shape, missing, packing))
        return x * 2 + 1, r + 1, None

    out, out_routing, out_none = forwards.map_row_chunks(
        fn, 3, (tokens, routing, None), axes=(0, 1, 0), out_axes=(0, 1, 0)
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tokens) * 2 + 1)
    np.testing.assert_array_equal(np.asarray(out_routing), np.asarray(routing) + 1)
    assert out_none is None
    assert calls == [((2, 5), (2, 2, 5, 3), None, None)] * 3
    # One output, the rows of chunk c in order: a NumPy loop.
    sums = forwards.map_row_chunks(lambda x, packing: x.sum(axis=1), 2, (tokens,))
    want = [float(np.asarray(tokens)[r].sum()) for r in range(6)]
    np.testing.assert_allclose(np.asarray(sums), want, rtol=1e-6)


@pytest.mark.parametrize(
    "recipe,trainer_log_probs,critic,per_minibatch,nll",
    [
        ("grpo", True, False, False, False),
        ("magistral", True, False, True, False),
        ("vapo", True, True, False, True),
    ],
)
def test_methods_are_chosen_from_the_config(recipe, trainer_log_probs, critic, per_minibatch, nll):
    config = tiny(recipe)
    chosen = methods.choose(config, is_moe=True)
    assert (chosen.old_log_probs is methods.trainer_old_log_probs) == trainer_log_probs
    assert (chosen.correction is not None) == trainer_log_probs
    assert (chosen.advantages.func is methods.gae_advantages) == critic
    assert (chosen.minibatch_advantages is not None) == per_minibatch
    assert (chosen.nll_weights is not None) == nll
    chosen = methods.choose(tiny(recipe, extra="algo.old_log_probs=sampler"), is_moe=True)
    assert chosen.old_log_probs is methods.sampler_old_log_probs and chosen.correction is None
    chosen = methods.choose(tiny(recipe, extra="algo.routing_replay=R3"), is_moe=True)
    assert chosen.old_replay("sampler") == "sampler"
    assert chosen.update_replay("sampler", "old") == "sampler"
    r2 = methods.choose(tiny(recipe, extra="algo.routing_replay=R2"), is_moe=True)
    assert r2.old_replay("sampler") is None and r2.update_replay("sampler", "old") == "old"
    dense = methods.choose(tiny(recipe, extra="algo.routing_replay=R2"), is_moe=False)
    assert dense.update_replay("sampler", "old") is None


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("recipe", ["vapo"])
def test_the_stages_compose_to_rl_iteration(recipe, tmp_path):
    """Two runs of one config: one by ``RLRun.step``, one stage by stage; the
    same parameters (policy and critic) bit for bit and the same metrics (times aside)."""
    config = tiny(
        recipe,
        extra="eval.num_prompts=0,algo.routing_replay=R2"
        + (",critic.pretrain_iterations=1" if recipe == "vapo" else ""),
    )
    whole = trainer.build_run(config, str(tmp_path / "whole"))
    staged = trainer.build_run(config, str(tmp_path / "staged"))
    for _ in range(2):  # vapo: the critic's warm-up, then both models
        want = whole.step()
        spec, state = staged.spec, staged.run_state
        with jax.set_mesh(spec.mesh):
            key_sample, key_shuffle = jax.random.split(
                jax.random.fold_in(state.rng, state.iteration)
            )
            sampled = iteration.sample(spec, state, key_sample)
            prepared = iteration.prepare(spec, state, sampled.round)
            state, update_metrics = iteration.update_epochs(spec, state, prepared, key_shuffle)
        staged.run_state = state.replace(iteration=state.iteration + 1)
        got = {**sampled.metrics, **prepared.metrics, **update_metrics}
        assert staged.run_state.iteration == whole.run_state.iteration
        for got_leaf, want_leaf in zip(
            _leaves((staged.run_state.policy, staged.run_state.critic)),
            _leaves((whole.run_state.policy, whole.run_state.critic)),
        ):
            np.testing.assert_array_equal(got_leaf, want_leaf)
        untimed = lambda metrics: {
            k: float(v) for k, v in metrics.items() if not k.startswith("time/")
        }
        assert untimed(got) == pytest.approx(untimed(want), nan_ok=True)
    assert (
        int(whole.run_state.policy.step)
        + int(whole.run_state.policy.skipped)
        + want["update/empty"]
        >= 1
    )
    assert prepared.batch.routing is not None  # R2: the old forward's routing is replayed
