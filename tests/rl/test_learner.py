"""The jitted RL steps: forward layout, the update against a reference built from full
logits and plain optax, routing replay reaching the update forward, the non-finite guard."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import grpo
from policyopt import losses
from policyopt.config import Algo, typed
from policyopt.losses import policy_loss
from policyopt.models import Transformer, preset
from policyopt.rl.batch import Batch, layout
from policyopt.rl.update.learner import (
    LossSettings,
    TrainState,
    get_learner,
    guarded_update,
    make_optimizer,
    split_params,
    warmup_constant_schedule,
    warmup_cosine_schedule,
)
from tests.settings import gae_settings, loss_settings, optim_settings, replace

VOCAB = 16
SETTINGS = loss_settings(
    method="sapo", aggregation="seq_mean_token_mean", temperature=0.7, group_size=2
)
OPTIM = optim_settings(lr=1e-2, warmup_steps=3, weight_decay=0.01, max_grad_norm=1.0)


@pytest.fixture(scope="module")
def policy():
    # One MoE layer keeps compilation short; the layout and replay logic do not depend on depth.
    model = Transformer(preset("tiny_moe", vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(0))
    graphdef, params = split_params(model)
    return model, graphdef, params


def _batch(seed=0, rows=4, prompt_width=4, response_width=5):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, VOCAB, rng.integers(1, prompt_width + 1))) for _ in range(rows)]
    responses = [
        list(rng.integers(3, VOCAB, rng.integers(1, response_width + 1))) for _ in range(rows)
    ]
    arrays = layout(prompts, responses, 0, prompt_width, response_width)
    return (
        Batch(
            tokens=jnp.asarray(arrays["tokens"]),
            positions=jnp.asarray(arrays["positions"]),
            attention_mask=jnp.asarray(arrays["attention_mask"]),
            mask=jnp.asarray(arrays["mask"]),
            advantages=jnp.asarray(rng.normal(size=rows), jnp.float32),
            old_log_probs=jnp.asarray(
                -rng.random((rows, response_width)) * arrays["mask"], jnp.float32
            ),
        ),
        prompts,
        responses,
    )


def _gather_index(prompts, responses, prompt_width, response_width):
    """Where each response log-prob sits in full ``[R, S, V]`` log-softmaxes, row by row:
    response token n of row r sits at column P + n and is predicted at column P - 1 + n.
    Returns int ``[R, N]`` (row, column, token) indices and the 0/1 ``[R, N]`` valid mask."""
    index = np.zeros((3, len(responses), response_width), np.int32)
    valid = np.zeros((len(responses), response_width), np.float32)
    for r, response in enumerate(responses):
        for n, token in enumerate(response):
            index[:, r, n] = (r, prompt_width - 1 + n, token)
            valid[r, n] = 1
    return index, valid


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def _reference_forward(params, batch, routing, index, valid, *, graphdef, temperature):
    logits = nnx.merge(graphdef, params)(
        batch.tokens,
        positions=batch.positions,
        attention_mask=batch.attention_mask,
        routing=routing,
    ).logits
    log_softmax = jax.nn.log_softmax(logits / temperature, -1)
    return jnp.where(valid > 0, log_softmax[index[0], index[1], index[2]], 0.0)


def _reference_log_probs(graphdef, params, batch, prompts, responses, temperature, routing=None):
    """Full float32 logits of the whole padded batch, log-softmax, gathered at the places a
    loop over the rows finds (one jitted program, the indices its arguments: batches of one
    shape share it)."""
    index, valid = _gather_index(prompts, responses, batch.num_prompt, batch.num_response)
    return _reference_forward(
        params, batch, routing, index, valid, graphdef=graphdef, temperature=temperature
    )


def test_forward_layout_matches_unpadded_full_logits(policy):
    model, graphdef, params = policy
    learner = get_learner(graphdef, SETTINGS, OPTIM)
    batch, prompts, responses = _batch()
    log_probs, entropy, routing = learner.log_probs(
        params, batch.tokens, batch.positions, batch.attention_mask, batch.mask
    )
    want = _reference_log_probs(graphdef, params, batch, prompts, responses, SETTINGS.temperature)
    np.testing.assert_allclose(np.asarray(log_probs), np.asarray(want), atol=2e-5)
    # The padded layout computes what the unpadded sequence computes (first row); the
    # log-softmax in NumPy (float64).
    logits = jax.jit(lambda t: model(t).logits)(jnp.asarray([prompts[0] + responses[0]]))[0]
    logits = np.asarray(logits, np.float64) / SETTINGS.temperature
    shifted = logits - logits.max(-1, keepdims=True)
    unpadded = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    log_probs = np.asarray(log_probs)
    for n, token in enumerate(responses[0]):
        assert float(log_probs[0, n]) == pytest.approx(
            float(unpadded[len(prompts[0]) - 1 + n, token]), abs=2e-5
        )
    assert routing.shape == (1, 4, 9, 2) and entropy.shape == (4, 5)


def _reference_loss(graphdef, params, batch, prompts, responses, routing=None):
    """The SAPO loss (seq_mean_token_mean) computed without the Learner (full logits)."""
    log_probs = _reference_log_probs(
        graphdef, params, batch, prompts, responses, SETTINGS.temperature, routing
    )
    adv = jnp.broadcast_to(batch.advantages[:, None], log_probs.shape)
    return policy_loss(
        log_probs,
        batch.old_log_probs,
        adv,
        batch.mask,
        method="sapo",
        aggregation="seq_mean_token_mean",
    )[0]


def _reference_step(model, graphdef, params, batch, prompts, responses, routing=None):
    """Loss and one AdamW step computed without the Learner (full logits, plain optax)."""

    def loss_fn(p):
        return _reference_loss(graphdef, p, batch, prompts, responses, routing)

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(lambda c: 1e-2 * jnp.minimum(1.0, (c + 1.0) / 3), weight_decay=0.01),
    )

    @jax.jit  # one program, not one eager op (and compile) per parameter
    def step(params):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, _ = tx.update(grads, tx.init(params), params)
        return loss, optax.apply_updates(params, updates), optax.global_norm(grads)

    return step(params)


# Adam's first step is lr * g / (|g| + eps) per element: ill-conditioned where |g| is near
# eps, so parameters are compared to a small fraction (1.5%) of the step size lr / 3.
PARAM_ATOL = 5e-5


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def test_update_matches_reference_step(policy):
    model, graphdef, params = policy
    learner = get_learner(graphdef, SETTINGS, OPTIM)
    batch, prompts, responses = _batch(seed=1)
    want_loss, want_params, want_norm = _reference_step(
        model, graphdef, params, batch, prompts, responses
    )
    state, metrics = learner.update(learner.init_state(_copy(params)), batch)
    assert float(metrics["loss/loss"]) == pytest.approx(float(want_loss), rel=1e-5)
    assert float(metrics["update/grad_norm"]) == pytest.approx(float(want_norm), rel=1e-4)
    assert float(metrics["update/lr"]) == pytest.approx(1e-2 / 3)
    assert int(state.step) == 1 and int(state.skipped) == 0
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=PARAM_ATOL)


def test_an_objective_registered_by_a_user_runs_from_a_recipe(policy):
    """``register_objective`` is all a new method needs: the recipe's config accepts its
    name, and an update runs it; the loss against a NumPy evaluation of its formula."""
    model, graphdef, params = policy
    name = "test_learner_vanilla_pg"

    @losses.register_objective(name)
    def vanilla_pg(inputs):  # f(r) A = r A: no clip, gradient weight 1 everywhere
        ratio = jnp.exp(inputs.log_ratio)
        return losses.Surrogate(ratio * inputs.advantages, jnp.ones_like(ratio), None, None, None)

    try:
        config = grpo.get_config(
            f"algo.method={name},algo.kl_beta=0.0,batch.group_size=2,sampling.temperature=0.7"
        )
        settings = LossSettings.of(typed(config))
        assert (settings.algo.method, settings.algo.aggregation) == (name, "seq_mean_token_mean")
        learner = get_learner(graphdef, settings, OPTIM)
        batch, prompts, responses = _batch(seed=3)
        state, metrics = learner.update(learner.init_state(_copy(params)), batch)
    finally:
        del losses.OBJECTIVES[name]
    log_probs = _reference_log_probs(graphdef, params, batch, prompts, responses, 0.7)
    log_probs = np.asarray(log_probs, np.float64)
    mask = np.asarray(batch.mask, np.float64)
    ratio = np.exp(log_probs - np.asarray(batch.old_log_probs, np.float64)) * mask
    # seq_mean_token_mean: -mean_i A_i (1 / |y_i|) sum_t r_{i,t}
    want = -np.mean(np.asarray(batch.advantages) * ratio.sum(1) / mask.sum(1))
    assert float(metrics["loss/loss"]) == pytest.approx(want, rel=1e-5)
    assert float(metrics["loss/gate_mean"]) == 1.0 and float(metrics["loss/clip_frac"]) == 0.0
    assert int(state.step) == 1 and int(state.skipped) == 0
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params))
    ]
    assert any(moved)
    # Unregistered again, the name is refused by the config, naming the field.
    with pytest.raises(ValueError, match=r"config\.algo\.method must be one of \('ppo'"):
        grpo.get_config(f"algo.method={name}")


def test_settings_are_checked_where_they_are_built():
    # Each error names the config field the setting comes from.
    cases = [
        (dict(nll_coef=-0.1), r"config\.algo\.nll_coef must be a finite number >= 0\.0, got -0\.1"),
        (
            dict(method="sapo", dual_clip=3.0),
            r"config\.algo\.dual_clip=3\.0 needs config\.algo\.method='ppo', got 'sapo'",
        ),
        (dict(dual_clip=1.0), r"config\.algo\.dual_clip must be > 1 \(or None: off\), got 1\.0"),
        (
            dict(kl_estimator="k2", kl_clamp=True),
            r"config\.algo\.kl_clamp=True is defined for config\.algo\.kl_estimator='k3' only",
        ),
        (dict(aggregation="sum"), r"config\.algo\.aggregation must be one of \('token_mean'"),
        (dict(clip_low=-0.1), r"config\.algo\.clip_low must be a finite number >= 0\.0 and <= 1"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            loss_settings(**fields)
    with pytest.raises(ValueError, match=r"config\.algo\.gae_lambda must be a finite number"):
        gae_settings(lam_actor=1.5)
    with pytest.raises(ValueError, match=r"config\.algo\.gae_alpha must be a finite number > 0"):
        gae_settings(alpha=0.0)
    # policy_loss makes the same checks, naming its own arguments.
    ones = jnp.ones((2, 3))
    with pytest.raises(ValueError, match=r"^dual_clip=3\.0 needs method='ppo', got 'sapo'"):
        policy_loss(ones, ones, ones, ones, method="sapo", dual_clip=3.0)
    assert isinstance(gae_settings(), Algo)


def test_replayed_routing_reaches_the_update_forward(policy):
    """R2 / R3 put a routing in the batch; the update must use exactly those experts."""
    model, graphdef, params = policy
    learner = get_learner(graphdef, SETTINGS, OPTIM)
    batch, prompts, responses = _batch(seed=2)
    natural = learner.log_probs(
        params, batch.tokens, batch.positions, batch.attention_mask, batch.mask
    )[2]
    # A forced routing: every token uses the two experts it would *not* pick.
    natural_np = np.asarray(natural)
    forced = np.zeros_like(natural_np)
    for index in np.ndindex(natural_np.shape[:-1]):
        forced[index] = sorted(set(range(4)) - set(natural_np[index].tolist()))
    forced = jnp.asarray(forced, jnp.int32)
    assert not np.any(np.asarray(forced)[..., None] == np.asarray(natural)[..., None, :])
    replayed = batch._replace(routing=forced)
    _, used_routing = learner.log_probs(
        params, batch.tokens, batch.positions, batch.attention_mask, batch.mask, forced
    )[1:]
    np.testing.assert_array_equal(np.asarray(used_routing), np.asarray(forced))

    def reference_loss(p, routing):  # forward only: full logits with the forced experts
        return _reference_loss(graphdef, p, batch, prompts, responses, routing)

    want_loss = jax.jit(reference_loss)(params, forced)
    state, metrics = learner.update(learner.init_state(_copy(params)), replayed)
    free_state, free_metrics = learner.update(learner.init_state(_copy(params)), batch)
    assert float(metrics["loss/loss"]) == pytest.approx(float(want_loss), rel=1e-5)
    assert abs(float(metrics["loss/loss"]) - float(free_metrics["loss/loss"])) > 1e-4
    changed = [
        not np.allclose(np.asarray(a), np.asarray(b), atol=PARAM_ATOL)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(free_state.params))
    ]
    assert any(changed)  # the replayed experts change the update itself


def test_loss_mask_restricts_the_policy_terms(policy):
    """Rollout rejection sampling's ``loss_mask``: the policy loss, its denominators and the
    entropy cover the kept tokens only (the reference: full logits, the kept mask)."""
    model, graphdef, params = policy
    learner = get_learner(graphdef, SETTINGS, OPTIM)
    batch, prompts, responses = _batch(seed=4)
    keep = np.asarray(batch.mask).copy()
    keep[0] = 0  # a whole sequence rejected
    keep[1, 0] = 0  # and one token
    assert keep.sum() < np.asarray(batch.mask).sum()
    log_probs = _reference_log_probs(
        graphdef, params, batch, prompts, responses, SETTINGS.temperature
    )
    adv = jnp.broadcast_to(batch.advantages[:, None], log_probs.shape)
    want = jax.jit(
        functools.partial(policy_loss, method="sapo", aggregation="seq_mean_token_mean")
    )(log_probs, batch.old_log_probs, adv, jnp.asarray(keep))[0]
    # The update's metrics hold the loss at the parameters it starts from (its programs are
    # the ones test_a_minibatch_without_tokens_is_not_an_update compiles too).
    _, metrics = learner.update(
        learner.init_state(_copy(params)), batch._replace(loss_mask=jnp.asarray(keep))
    )
    _, full_metrics = learner.update(learner.init_state(_copy(params)), batch)
    loss, full_loss = metrics["loss/total"], full_metrics["loss/total"]
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert abs(float(loss) - float(full_loss)) > 1e-4
    assert float(metrics["loss/num_tokens"]) == keep.sum()


@pytest.mark.parametrize("field", ["advantages", "old_log_probs"])
def test_non_finite_step_is_skipped_and_leaves_state_untouched(policy, field):
    _, graphdef, params = policy
    learner = get_learner(graphdef, SETTINGS, OPTIM)
    batch, _, _ = _batch(seed=3)
    state, _ = learner.update(learner.init_state(_copy(params)), batch)  # a real first step
    before = _copy(state)
    poisoned = getattr(batch, field).at[0].set(jnp.nan if field == "advantages" else -jnp.inf)
    state, metrics = learner.update(state, batch._replace(**{field: poisoned}))
    assert float(metrics["update/skipped"]) == 1.0
    assert int(state.step) == 1 and int(state.skipped) == 1
    for got, want in zip(
        jax.tree.leaves((state.params, state.opt_state)),
        jax.tree.leaves((before.params, before.opt_state)),
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    state, metrics = learner.update(state, batch)  # training continues
    assert float(metrics["update/skipped"]) == 0.0 and int(state.step) == 2


@pytest.mark.parametrize(
    "optim", [dict(lr=float("inf")), dict(lr=float("nan")), dict(lr=1.0, eps=0.0)]
)
def test_a_step_that_would_save_non_finite_values_is_skipped(optim):
    """Finite loss and gradient, but the new state is not: lr inf / NaN makes the new
    parameters non-finite; eps = 0 gives 0 / 0 in Adam where a gradient is 0 (here w[1]),
    NaN in the parameters. By hand, loss = w0^2 at w = [1, 0]: grad [2, 0]."""
    params = {"w": jnp.asarray([1.0, 0.0])}
    optimizer, schedule = make_optimizer(**optim, max_grad_norm=None)
    state = TrainState.create(params, optimizer)
    state, metrics = jax.jit(
        lambda s: guarded_update(lambda p, b: (p["w"][0] ** 2, {}), optimizer, schedule, s, None)
    )(state)
    assert float(metrics["update/grad_norm"]) == 2.0  # the inputs were finite
    assert (
        float(metrics["update/skipped"]) == 1.0 and int(state.skipped) == 1 and int(state.step) == 0
    )
    np.testing.assert_array_equal(np.asarray(state.params["w"]), [1.0, 0.0])
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
    # The same step with sane settings is applied (w0 moves against its gradient).
    optimizer, schedule = make_optimizer(lr=0.1, max_grad_norm=None)
    state, metrics = jax.jit(  # one program, not one eager op (and compile) at a time
        lambda s: guarded_update(lambda p, b: (p["w"][0] ** 2, {}), optimizer, schedule, s, None)
    )(TrainState.create(params, optimizer))
    assert float(metrics["update/skipped"]) == 0.0 and float(state.params["w"][0]) == pytest.approx(
        0.9
    )


def test_router_lr_scale_multiplies_the_routers_updates_only():
    """``router_lr_scale`` multiplies the update of every leaf named ``router`` (AdamW's
    step and its weight decay: the learning rate) and leaves the other leaves' alone."""
    params = {
        "layers": {"0": {"moe": {"router": jnp.asarray([1.0, -2.0]), "w": jnp.asarray([3.0])}}},
        "embed": jnp.asarray([0.5, 0.25]),
    }
    grads = jax.tree.map(lambda x: 0.1 * x + 0.3, params)
    updates = {}
    for scale in (1.0, 8.0):
        optimizer, _ = make_optimizer(lr=1e-2, weight_decay=0.1, router_lr_scale=scale)
        updates[scale], _ = optimizer.update(grads, optimizer.init(params), params)
    router = lambda u: u["layers"]["0"]["moe"]["router"]
    np.testing.assert_allclose(router(updates[8.0]), 8.0 * router(updates[1.0]), rtol=1e-6)
    rest = lambda u: (u["layers"]["0"]["moe"]["w"], u["embed"])
    for a, b in zip(rest(updates[8.0]), rest(updates[1.0])):
        np.testing.assert_array_equal(a, b)
    assert float(jnp.abs(router(updates[1.0])).min()) > 0


def test_a_nan_in_the_optimiser_state_is_caught(policy):
    """A NaN already in Adam's first moment (e.g. restored from a corrupt checkpoint): the
    step's new parameters and moments are NaN, so it is skipped, and so is every later one."""
    _, graphdef, params = policy
    learner = get_learner(graphdef, SETTINGS, OPTIM)
    batch, _, _ = _batch(seed=3)
    state, _ = learner.update(learner.init_state(_copy(params)), batch)
    leaves, treedef = jax.tree.flatten(state.opt_state)
    index = next(i for i, leaf in enumerate(leaves) if leaf.ndim >= 2)
    leaves[index] = leaves[index].at[(0,) * leaves[index].ndim].set(jnp.nan)
    state = state.replace(opt_state=jax.tree.unflatten(treedef, leaves))
    before = _copy(state)
    for _ in range(2):
        state, metrics = learner.update(state, batch)
        assert float(metrics["update/skipped"]) == 1.0 and np.isfinite(float(metrics["loss/total"]))
    assert int(state.step) == 1 and int(state.skipped) == 2
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(before.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_router_z_loss_enters_the_update_with_its_coefficient(policy):

    _, graphdef, params = policy
    batch, _, _ = _batch(seed=6)
    (plain, metrics), (with_z, _) = jax.jit(
        lambda p: (
            get_learner(graphdef, SETTINGS, OPTIM).loss(p, batch),
            get_learner(graphdef, replace(SETTINGS, router_z_coef=0.5), OPTIM).loss(p, batch),
        )
    )(params)
    assert float(metrics["moe/router_z_loss"]) > 0
    assert float(with_z) == pytest.approx(
        float(plain) + 0.5 * float(metrics["moe/router_z_loss"]), rel=1e-6
    )


@pytest.mark.parametrize("field", ["mask", "loss_mask"])
def test_a_minibatch_without_tokens_is_not_an_update(policy, field):
    """Only masked rows (dynamic sampling's fillers) or every token rejected: the gradient is
    0, but AdamW's weight decay and momentum would still move the parameters (and the
    schedule would advance). The step is skipped and reported as empty, not as a failure."""
    _, graphdef, params = policy
    learner = get_learner(graphdef, SETTINGS, OPTIM)
    batch, _, _ = _batch(seed=5)
    state, _ = learner.update(learner.init_state(_copy(params)), batch)  # momentum is now non-zero
    before = _copy(state)
    empty = batch._replace(**{field: jnp.zeros_like(batch.mask)})
    state, metrics = learner.update(state, empty)
    assert float(metrics["update/empty"]) == 1.0 and float(metrics["update/skipped"]) == 0.0
    assert float(metrics["update/grad_norm"]) == 0.0
    assert int(state.step) == 1 and int(state.skipped) == 0
    for got, want in zip(
        jax.tree.leaves((state.params, state.opt_state)),
        jax.tree.leaves((before.params, before.opt_state)),
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    state, metrics = learner.update(state, batch)
    assert float(metrics["update/empty"]) == 0.0 and int(state.step) == 2


def test_warmup_cosine_schedule_by_hand():
    """lr 1, 2 warm-up updates, cosine to 0.1 at update 6: counts 0-1 warm up (1/2, 2/2),
    then p = (count - 2) / 4 and lr = 0.1 + 0.9 (1 + cos(pi p)) / 2, held at 0.1 after."""
    got = [float(warmup_cosine_schedule(1.0, 2, 6, 0.1)(c)) for c in range(8)]
    c45 = np.sqrt(0.5)  # cos(pi / 4)
    want = [0.5, 1.0, 1.0, 0.1 + 0.45 * (1 + c45), 0.55, 0.1 + 0.45 * (1 - c45), 0.1, 0.1]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # No decay span: the constant schedule; no warm-up: the cosine starts at update 0.
    assert float(warmup_cosine_schedule(0.5, 4, 4)(10)) == 0.5
    np.testing.assert_allclose(
        [float(warmup_cosine_schedule(2.0, 0, 2)(c)) for c in range(3)], [2.0, 1.0, 0.0], atol=1e-6
    )
    # make_optimizer's schedule is this one.
    _, schedule = make_optimizer(lr=1.0, warmup_steps=2, decay_steps=6, min_lr_ratio=0.1)
    np.testing.assert_allclose([float(schedule(c)) for c in range(8)], want, rtol=1e-6)


def test_warmup_schedule_and_trace_counts(policy):
    schedule = warmup_constant_schedule(1.0, 4)
    np.testing.assert_allclose([float(schedule(c)) for c in range(6)], [0.25, 0.5, 0.75, 1, 1, 1])
    assert float(warmup_constant_schedule(0.5, 0)(10)) == 0.5
    _, graphdef, params = policy
    learner = get_learner(graphdef, SETTINGS, OPTIM)
    assert learner is get_learner(graphdef, SETTINGS, OPTIM)  # shared across runs
    state = learner.init_state(_copy(params))
    for seed in range(3):
        state, _ = learner.update(state, _batch(seed=seed)[0])
    traces = learner.trace_counts["update"]
    for seed in range(3, 6):
        state, _ = learner.update(state, _batch(seed=seed)[0])
    assert learner.trace_counts["update"] == traces
    assert isinstance(state, TrainState)
