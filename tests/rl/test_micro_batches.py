"""Micro-batches (``policyopt.rl.update.micro_batches``): an update run as micro-batches equals
one pass over the minibatch.

The learner and critic cases compare ``update`` with ``micro_batch_tokens`` set (several
micro-batches; groups split between them; filler rows where they do not divide the
minibatch) against the same update in one pass: every metric, the parameters after the
step and the step itself. Adam's first step is ``lr g / (|g| + eps)``; the tests use
``eps = 1`` so that the step is close to linear in the gradient and compares tightly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import base
from policyopt import losses
from policyopt.config import typed
from policyopt.models import Transformer, preset
from policyopt.rl.batch import Batch, layout
from policyopt.rl.update import micro_batches
from policyopt.rl.update.critic import get_critic, init_critic_params
from policyopt.rl.update.learner import LossSettings, TrainState, get_learner, split_params
from policyopt.rl.update.methods import minibatch_advantages
from tests.flags import run_script
from tests.settings import critic_settings, loss_settings, optim_settings, replace

VOCAB = 16
GROUP = 2
ROWS, PROMPT, RESPONSE = 6, 4, 5
WIDTH = PROMPT + RESPONSE
# 4 rows of 9 tokens per micro-batch: 2 micro-batches (rows 0, 2, 4 and 1, 3, 5: every
# group split between them) and 2 filler rows. 2 rows (+ 3 spare tokens): 3, no filler.
MICRO_4_ROWS, MICRO_2_ROWS = 4 * WIDTH, 2 * WIDTH + 3
OPTIM = optim_settings(lr=1e-2, eps=1.0, weight_decay=0.01, max_grad_norm=None)
# PPO with the KL penalty, the entropy bonus and VAPO's NLL term (with an aggregation).
PPO_EVERY_TERM = dict(
    method="ppo", group_size=GROUP, max_len=7, kl_beta=0.05, entropy_coef=0.01, nll_coef=0.1
)


@pytest.fixture(scope="module")
def dense():
    model = Transformer(preset("tiny_dense", vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(0))
    return split_params(model)


@pytest.fixture(scope="module")
def moe():
    model = Transformer(preset("tiny_moe", vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(1))
    return model, *split_params(model)


def _batch(seed=0, rows=ROWS, prompt=PROMPT, response=RESPONSE, *, full=False):
    """A random minibatch; ``full``: with importance weights, reference log-probs, NLL
    weights and a rejection loss mask (one row wholly rejected, some tokens of others)."""
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, VOCAB, rng.integers(1, prompt + 1))) for _ in range(rows)]
    responses = [list(rng.integers(3, VOCAB, rng.integers(1, response + 1))) for _ in range(rows)]
    arrays = layout(prompts, responses, 0, prompt, response)
    mask = arrays["mask"]
    noisy = lambda mean: jnp.asarray((mean + 0.3 * rng.normal(size=mask.shape)) * mask, jnp.float32)
    batch = Batch(
        tokens=jnp.asarray(arrays["tokens"]),
        positions=jnp.asarray(arrays["positions"]),
        attention_mask=jnp.asarray(arrays["attention_mask"]),
        mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
        old_log_probs=noisy(-2.5),
    )
    if not full:
        return batch
    loss_mask = mask * (rng.random(mask.shape) > 0.2)
    loss_mask[1] = 0
    return batch._replace(
        importance_weights=jnp.asarray(
            np.minimum(np.exp(0.3 * rng.normal(size=mask.shape)), 2.0) * mask, jnp.float32
        ),
        ref_log_probs=noisy(-2.7),
        loss_mask=jnp.asarray(loss_mask, jnp.float32),
        nll_weights=jnp.asarray(rng.random(rows) > 0.4, jnp.float32),
    )


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _both(make, settings, params, batch, micro_batch_tokens):
    """``(state, metrics)`` of one update in one pass and with micro-batches."""
    out = []
    for tokens in (None, micro_batch_tokens):
        stepper = make(replace(settings, micro_batch_tokens=tokens))
        out.append(stepper.update(TrainState.create(_copy(params), stepper.optimizer), batch))
    return out


def _assert_same(one, micro, params, metric_rtol=1e-5):
    (state_one, metrics_one), (state_micro, metrics_micro) = one, micro
    assert int(state_micro.step) == int(state_one.step) == 1
    assert metrics_micro.keys() == metrics_one.keys()
    for key in metrics_one:
        np.testing.assert_allclose(
            float(metrics_micro[key]),
            float(metrics_one[key]),
            rtol=metric_rtol,
            atol=1e-7,
            err_msg=key,
        )
    _assert_same_step(state_micro.params, state_one.params, params)


def _assert_same_step(got_params, want_params, before_params):
    """Per tensor, the parameters equal to 1e-6 relative (``|got - want| <= 1e-6 |want|``,
    Euclidean norms) and, since the parameters alone barely move, the steps ``new - old``
    to 1e-4 relative."""
    moved = 0.0
    for got, want, before in zip(
        jax.tree.leaves(got_params), jax.tree.leaves(want_params), jax.tree.leaves(before_params)
    ):
        got, want, before = (np.asarray(x, np.float64) for x in (got, want, before))
        error = np.linalg.norm(got - want)
        assert error <= 1e-6 * np.linalg.norm(want), (error, np.linalg.norm(want))
        step = np.linalg.norm(want - before)
        assert error <= 1e-4 * step + 1e-12, (error, step)
        moved += step
    assert moved > 0


# ---- Row weights: every aggregation is a weighted sum of row sums ---------------------


def test_aggregation_weights_hand_worked():
    # Row lengths 2, 0, 3, 1; groups (0, 1) and (2, 3).
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0]], np.float32)
    want = {
        "token_mean": [1 / 6, 0, 1 / 6, 1 / 6],  # 6 tokens
        "group_token_mean": [1 / 4, 0, 1 / 8, 1 / 8],  # 1 / (T_g * 2 groups): T = 2, 4
        "seq_mean_token_mean": [1 / 6, 0, 1 / 9, 1 / 3],  # 1 / (|y_i| * 3 rows)
        "seq_mean_token_sum": [1 / 3, 0, 1 / 3, 1 / 3],
        "seq_mean_token_sum_norm": [1 / 12, 0, 1 / 12, 1 / 12],  # 1 / (max_len 4 * 3 rows)
    }
    weights_of = jax.jit(  # one program per rule, not one eager op at a time
        losses.aggregation_weights, static_argnames=("aggregation", "group_size", "max_len")
    )
    for aggregation, weights in want.items():
        got = weights_of(mask, aggregation=aggregation, group_size=2, max_len=4)
        np.testing.assert_allclose(np.asarray(got), weights, rtol=1e-6, err_msg=aggregation)
    assert float(losses.aggregation_weights(np.zeros((2, 3)), "token_mean").sum()) == 0.0


def _micro_shares(fn, arrays, count):
    """``sum_j fn(micro-batch j)`` with rows dealt out as ``micro_batches.split_rows`` does
    (``fn`` mapped over the micro-batches: traced and compiled once, not ``count`` times)."""
    rows = arrays[0].shape[0]
    per = -(-rows // count)
    split = [micro_batches.split_rows(a, per, count) for a in arrays]
    return jnp.sum(jax.vmap(fn)(*split))


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_policy_loss_shares_sum_to_the_minibatch_loss(aggregation):
    """Loss and gradient (w.r.t. log-probs) of the micro-batches' shares, with KL,
    importance weights and a rejection mask, equal the minibatch's, for 3 micro-batches
    of 3 rows (one of them filler) over groups of 2, for every method's gate."""
    rng = np.random.default_rng(0)
    rows, width = 8, 7
    mask = (np.arange(width)[None] < rng.integers(0, width + 1, rows)[:, None]).astype(np.float32)
    mask[3] = 0
    mask *= rng.random(mask.shape) > 0.1  # rejected tokens
    mask = jnp.asarray(mask)
    arrays = [jnp.asarray(rng.normal(size=(rows, width)) * 0.2 - 2, jnp.float32) for _ in range(3)]
    log_probs, old_log_probs, ref_log_probs = arrays
    advantages = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
    weights = jnp.asarray(rng.random((rows, width)) + 0.5, jnp.float32)
    row_weights = losses.aggregation_weights(mask, aggregation, group_size=2, max_len=9)
    methods = sorted(losses.OBJECTIVES)
    kwargs = dict(
        aggregation=aggregation, group_size=2, max_len=9, clip_low=0.1, clip_high=0.15, kl_coef=0.05
    )

    def one_pass(log_probs, method):
        return losses.policy_loss(
            log_probs,
            old_log_probs,
            advantages,
            mask,
            method=method,
            importance_weights=weights,
            ref_log_probs=ref_log_probs,
            **kwargs,
        )[0]

    def micro(log_probs, method):
        share = lambda lp, old, adv, m, iw, ref, w: losses.policy_loss(
            lp,
            old,
            adv,
            m,
            method=method,
            importance_weights=iw,
            ref_log_probs=ref,
            row_weights=w,
            metrics="none",
            **kwargs,
        )[0]
        return _micro_shares(
            share,
            (log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, row_weights),
            count=3,
        )

    def own(log_probs):
        """The mean of each micro-batch's own PPO loss (its own token mean)."""
        split = [
            micro_batches.split_rows(a, 3, 3) for a in (log_probs, old_log_probs, advantages, mask)
        ]
        return (
            sum(
                losses.policy_loss(*(a[j] for a in split), method="ppo", **kwargs)[0]
                for j in range(3)
            )
            / 3
        )

    # One compiled program for every method (and the own-token-mean counterexample).
    both = jax.jit(
        lambda lp: (
            [
                (jax.value_and_grad(one_pass)(lp, method), jax.value_and_grad(micro)(lp, method))
                for method in methods
            ],
            own(lp) if aggregation == "token_mean" else None,
        )
    )
    results, own_loss = both(log_probs)
    for method, ((want_loss, want_grad), (got_loss, got_grad)) in zip(methods, results):
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6, err_msg=method)
        np.testing.assert_allclose(
            np.asarray(got_grad), np.asarray(want_grad), rtol=1e-5, atol=1e-8, err_msg=method
        )
        assert np.abs(np.asarray(want_grad)).max() > 0
    if aggregation == "token_mean":  # each micro-batch's own token mean would differ
        ppo_loss = results[methods.index("ppo")][0][0]
        assert abs(float(own_loss) - float(ppo_loss)) > 1e-4


def test_value_and_nll_shares_sum_to_the_minibatch_loss():
    rng = np.random.default_rng(1)
    rows, width = 6, 5
    lengths = rng.integers(0, width + 1, rows)
    mask = jnp.asarray(np.arange(width)[None] < lengths[:, None], jnp.float32)
    values, old_values, returns, log_probs = (
        jnp.asarray(rng.normal(size=(rows, width)), jnp.float32) for _ in range(4)
    )
    seq_weights = jnp.asarray([1, 0, 1, 1, 0, 1], jnp.float32)

    @jax.jit
    def both():
        out = []
        for aggregation in ("token_mean", "seq_mean_token_mean"):
            w = losses.aggregation_weights(mask, aggregation)
            share = lambda v, o, r, m, w: losses.value_loss(v, o, r, m, row_weights=w)[0]
            out.append(
                (
                    _micro_shares(share, (values, old_values, returns, mask, w), count=4),
                    losses.value_loss(values, old_values, returns, mask, aggregation=aggregation)[
                        0
                    ],
                )
            )
        total = jnp.sum(mask * seq_weights[:, None])
        share = lambda lp, m, s: losses.nll_loss(lp, m, s, denominator=total)
        out.append(
            (
                _micro_shares(share, (log_probs, mask, seq_weights), count=4),
                losses.nll_loss(log_probs, mask, seq_weights),
            )
        )
        return out

    for got, want in both():
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)


def test_split_and_merge_rows():
    x = jnp.arange(7 * 2).reshape(7, 2)
    split = micro_batches.split_rows(x, 3, 3, fill=-1)  # 3 micro-batches of 3 rows, 2 fillers
    assert split.shape == (3, 3, 2)
    np.testing.assert_array_equal(
        np.asarray(split[:, :, 0]) // 2, [[0, 3, 6], [1, 4, -1], [2, 5, -1]]
    )
    np.testing.assert_array_equal(np.asarray(micro_batches.merge_rows(split, 7)), np.asarray(x))
    assert micro_batches.plan(6, 9, 36) == (4, 2) and micro_batches.plan(6, 9, 1000) == (6, 1)
    with pytest.raises(ValueError, match=r"micro_batch_tokens \(8\) is below the row length 9"):
        micro_batches.plan(6, 9, 8)


# ---- The policy update ------------------------------------------------------------------


# The aggregation reaches a micro-batch only as its rows' slice of the minibatch's row
# weights (``learner.Normalisers``), whose shares every aggregation's loss and gradient sum
# to (test_policy_loss_shares_sum_to_the_minibatch_loss, every method's gate): the update
# is compared for the token mean and for the group rule whose groups the micro-batches split.
@pytest.mark.parametrize("aggregation", ("token_mean", "group_token_mean"))
def test_update_equals_one_pass_for_every_aggregation(dense, aggregation):
    """PPO with the KL penalty, truncated importance weights, a rejection loss mask, the
    entropy bonus and VAPO's NLL term: 2 micro-batches, 2 filler rows, groups split."""
    graphdef, params = dense
    settings = loss_settings(**PPO_EVERY_TERM, aggregation=aggregation)
    batch = _batch(1, full=True)
    one, micro = _both(
        lambda s: get_learner(graphdef, s, OPTIM), settings, params, batch, MICRO_4_ROWS
    )
    _assert_same(one, micro, params)
    assert float(one[1]["loss/nll"]) != 0 and float(one[1]["loss/kl_ref"]) != 0


def test_gspo_sequence_ratios_equal_one_pass(dense):
    graphdef, params = dense
    settings = loss_settings(
        method="gspo",
        aggregation="seq_mean_token_mean",
        clip_low=3e-2,
        clip_high=4e-2,
        group_size=GROUP,
    )
    batch = _batch(2)
    batch = batch._replace(old_log_probs=batch.old_log_probs * 0.99)  # some sequences clipped
    one, micro = _both(
        lambda s: get_learner(graphdef, s, OPTIM), settings, params, batch, MICRO_2_ROWS
    )
    _assert_same(one, micro, params)


def test_magistral_minibatch_advantages_reach_every_micro_batch(dense):
    """Magistral normalises advantages over the minibatch (``minibatch_advantages``, in
    the trainer, before the update): the micro-batches get the minibatch's statistics,
    not their own, and the update equals one pass."""
    graphdef, params = dense
    rewards = jnp.asarray([1, 0, 0.2, 0, 1, 1], jnp.float32)  # the last group is all equal
    advantages_of = jax.jit(minibatch_advantages, static_argnums=1)  # not op by op
    advantages = advantages_of(rewards, GROUP)
    # Statistics over fewer rows would be different (the test can fail).
    own = advantages_of(rewards[np.array([0, 1, 4, 5])], GROUP)
    assert abs(float(own[0]) - float(advantages[0])) > 1e-3
    settings = loss_settings(**PPO_EVERY_TERM, aggregation="token_mean")
    batch = _batch(3, full=True)._replace(advantages=advantages)
    one, micro = _both(
        lambda s: get_learner(graphdef, s, OPTIM), settings, params, batch, MICRO_4_ROWS
    )
    _assert_same(one, micro, params)


def test_one_compile_per_shape(dense):
    graphdef, params = dense
    settings = loss_settings(
        **PPO_EVERY_TERM, aggregation="token_mean", micro_batch_tokens=MICRO_4_ROWS
    )
    learner = get_learner(graphdef, settings, OPTIM)
    state = learner.init_state(_copy(params))
    state, _ = learner.update(state, _batch(4, full=True))
    traces = learner.trace_counts["update"]
    for seed in (5, 6):
        state, _ = learner.update(state, _batch(seed, full=True))
    assert learner.trace_counts["update"] == traces
    assert int(state.step) == 3
    with pytest.raises(ValueError, match=r"micro_batch_tokens \(36\) is below the row length 41"):
        learner.update(state, _batch(4, prompt=36, full=True))


@pytest.mark.parametrize("replay", (False, True))
def test_moe_aux_losses_equal_one_pass(moe, replay):
    """The load-balancing loss ``E sum_e f_e P_e`` is not a sum over tokens: micro-batched,
    its load fractions ``f`` are the whole minibatch's (counted by a forward pass before the
    gradient's, or from the replayed routing), so the update, the loss and its metric
    equal one pass (with each micro-batch's own fractions, the router's gradient moved by
    up to 120% of its largest element). The router z-loss is a token mean over the
    minibatch."""
    _, graphdef, params = moe
    settings = loss_settings(
        method="ppo",
        aggregation="seq_mean_token_mean",
        group_size=GROUP,
        load_balancing_coef=0.3,
        router_z_coef=0.2,
    )
    batch = _batch(7)
    if replay:  # R2 / R3: the update forward replays the routing
        learner = get_learner(graphdef, settings, OPTIM)
        routing = learner.log_probs(
            params, batch.tokens, batch.positions, batch.attention_mask, batch.mask
        )[2]
        batch = batch._replace(routing=routing)
    one, micro = _both(
        lambda s: get_learner(graphdef, s, OPTIM), settings, params, batch, MICRO_4_ROWS
    )
    _assert_same(one, micro, params)
    assert float(one[1]["moe/load_balancing_loss"]) > 1 and float(one[1]["moe/router_z_loss"]) > 0
    if replay:
        return  # the same terms; checked to move the router once, below
    # The load-balancing term alone moves the router: the comparison covers it.
    policy_only = get_learner(
        graphdef, replace(settings, load_balancing_coef=0.0, router_z_coef=0.0), OPTIM
    )  # one pass only
    without = policy_only.update(TrainState.create(_copy(params), policy_only.optimizer), batch)[0]
    router = lambda state: np.concatenate(
        [
            np.ravel(x)
            for path, x in jax.tree.leaves_with_path(state.params)
            if "router" in str(path)
        ]
    )
    assert np.abs(router(one[0]) - router(without)).max() > 1e-4


def test_moe_critic_load_balancing_equals_one_pass(moe):
    """The critic's update (value clipping, the MoE backbone's load-balancing term) run as
    micro-batches equals one pass; on a dense backbone it is the same update less that term."""
    _, graphdef, policy_params = moe
    rng = np.random.default_rng(9)
    params = init_critic_params(policy_params, 64)
    params["head"] = {
        "kernel": jnp.asarray(0.5 * rng.normal(size=64), jnp.float32),
        "bias": jnp.asarray(0.3, jnp.float32),
    }
    batch = _batch(9)
    mask = np.asarray(batch.mask)
    batch = batch._replace(
        old_values=jnp.asarray(rng.normal(size=mask.shape) * mask, jnp.float32),
        returns=jnp.asarray(rng.normal(size=mask.shape) * mask, jnp.float32),
    )
    settings = critic_settings(value_clip=0.2, load_balancing_coef=0.3)
    one, micro = _both(
        lambda s: get_critic(graphdef, s, OPTIM), settings, params, batch, MICRO_4_ROWS
    )
    _assert_same(one, micro, params)
    assert float(one[1]["critic/moe_load_balancing_loss"]) > 1
    assert 0 < float(one[1]["critic/value_clip_frac"]) < 1


# ---- Memory and config ------------------------------------------------------------------


def test_micro_batches_bound_the_update_memory(dense):
    """Compiled (not run) update of 16 rows of 64 tokens: micro-batches of 2 rows need a
    fraction of one pass's temporary memory (activations of 2 rows, not 16)."""
    graphdef, params = dense
    settings = loss_settings(method="ppo", aggregation="token_mean")
    batch = _batch(9, rows=16, prompt=8, response=56)
    temp = {}
    for tokens in (None, 2 * 64):
        learner = get_learner(graphdef, replace(settings, micro_batch_tokens=tokens), OPTIM)
        state = jax.eval_shape(learner.init_state, params)
        compiled = learner.update.lower(state, batch).compile()
        temp[tokens] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[128] < 0.35 * temp[None], temp


def test_config_refuses_micro_batches_shorter_than_the_longest_row():
    config = base.get_config("batch.micro_batch_tokens=4096")
    assert config.batch.micro_batch_tokens == 4096
    longest = max(config.batch.prompt_buckets) + config.sampling.max_new_tokens  # 2048 + 24
    with pytest.raises(
        ValueError,
        match=rf"micro_batch_tokens \(2000\) is below the longest row, "
        rf"{longest} tokens",
    ):
        base.get_config("batch.micro_batch_tokens=2000")
    with pytest.raises(ValueError, match="micro_batch_tokens must be an int >= 0"):
        base.get_config("batch.micro_batch_tokens=-5")
    assert base.get_config().batch.micro_batch_tokens is None
    off = base.get_config("batch.micro_batch_tokens=0")
    assert LossSettings.of(typed(off)).micro_batch_tokens is None


_MESH_SCRIPT = """
import dataclasses, jax, jax.numpy as jnp, numpy as np
from flax import nnx
from policyopt import sharding
from policyopt.models import Transformer, preset
from policyopt.rl.batch import shard_batch
from policyopt.rl.update.learner import get_learner, place_state, split_params, state_specs
from tests.settings import loss_settings, replace
from tests.rl.test_micro_batches import OPTIM, VOCAB, _assert_same, _batch

assert jax.device_count() == 4
mesh = sharding.make_mesh({"data": 2, "fsdp": 2})
with jax.set_mesh(mesh):
    model = Transformer(preset("tiny_dense", vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(0))
    graphdef, params = split_params(model)
    settings = loss_settings(method="ppo", aggregation="seq_mean_token_mean", group_size=2,
                          kl_beta=0.05, entropy_coef=0.01, nll_coef=0.1)
    batch = shard_batch(_batch(10, rows=8, full=True))
    out = []
    for tokens in (None, 4 * 9):  # 2 micro-batches of 4 rows, one row per device
        learner = get_learner(graphdef, replace(settings, micro_batch_tokens=tokens),
                              OPTIM)
        state = place_state(learner.init_state(jax.tree.map(jnp.copy, params)),
                            learner.optimizer, mesh)
        specs = [x.sharding.spec for x in jax.tree.leaves(state)]
        state, metrics = learner.update(state, batch)
        assert [x.sharding.spec for x in jax.tree.leaves(state)] == specs
        out.append((state, metrics))
    assert any("fsdp" in str(s) for s in specs), specs
    _assert_same(*out, params)
print("OK")
"""


def test_micro_batches_on_a_mesh_equal_one_pass():
    """4 simulated devices (data 2 x fsdp 2): rows sharded, parameters and the gradient
    accumulator sharded along fsdp; the micro-batched update equals one pass and returns
    the state with its shardings."""

    result = run_script(_MESH_SCRIPT, 4, "--xla_backend_optimization_level=0")
    assert "OK" in result.stdout, result.stdout[-4000:]
