"""Critic methods (PPO, VC-PPO, VAPO): the value head's alignment, GAE targets against a
NumPy loop on a real rollout, decoupled / length-adaptive lambdas, the reward-model
initialisation, value pretraining, VAPO's NLL term, checkpoint resume of the critic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import vapo
from policyopt.config import typed
from policyopt.losses import nll_loss
from policyopt.models import Transformer, preset
from policyopt.rl.batch import Batch, layout
from policyopt.rl.loop import trainer
from policyopt.rl.reporting import dry_run, report
from policyopt.rl.update import forwards, methods
from policyopt.rl.update.critic import (
    Critic,
    CriticSettings,
    critic_loss,
    critic_optim,
    forward_values,
    gae_targets,
    get_critic,
    init_critic_params,
    reward_model_targets,
    token_rewards,
)
from policyopt.rl.update.learner import TrainState, split_params
from tests.rl.test_trainer import CRITIC_METRICS, tiny
from tests.settings import critic_settings, gae_settings, optim_settings, replace

VOCAB = 16


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _random_head(params, seed=0, scale=0.5):
    """Critic parameters with a random (non-zero) head, so values are not all 0."""
    rng = np.random.default_rng(seed)
    kernel = params["head"]["kernel"]
    head = {
        "kernel": np.asarray(scale * rng.standard_normal(kernel.shape), np.float32),
        "bias": np.asarray(0.3, np.float32),
    }
    # Placed like the other parameters (committed to their device when they are).
    head = {
        k: jax.device_put(v, kernel.sharding) if kernel.committed else jnp.asarray(v)
        for k, v in head.items()
    }
    return {"backbone": params["backbone"], "head": head}


def numpy_gae(rewards, values, mask, gamma, lam):
    """Reference GAE: a plain backwards loop over each row's valid tokens (lam per row)."""
    rows, width = rewards.shape
    lam = np.broadcast_to(np.asarray(lam, np.float64), (rows,))
    advantages = np.zeros((rows, width))
    for r in range(rows):
        next_value, running = 0.0, 0.0
        for t in reversed(range(width)):
            if mask[r, t] == 0:
                continue
            delta = rewards[r, t] + gamma * next_value - values[r, t]
            running = delta + gamma * lam[r] * running
            advantages[r, t] = running
            next_value = values[r, t]
    return advantages, np.where(mask > 0, advantages + values, 0.0)


# ---- The value model ------------------------------------------------------------------


def test_values_are_the_states_before_each_response_token():
    model = Transformer(preset("tiny_dense", vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(0))
    graphdef, policy_params = split_params(model)
    params = init_critic_params(policy_params, model.config.hidden_size)
    # Zero head: every value is exactly 0; the backbone is a copy, not the same buffers.
    assert (
        float(jnp.abs(params["head"]["kernel"]).max()) == 0 and float(params["head"]["bias"]) == 0
    )
    for got, want in zip(jax.tree.leaves(params["backbone"]), jax.tree.leaves(policy_params)):
        assert got is not want
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    params = _random_head(params)

    prompts = [[3, 4, 5], [6], [7, 8]]
    responses = [[9, 10, 11, 12], [13, 14], [15]]
    arrays = {k: jnp.asarray(v) for k, v in layout(prompts, responses, 0, 4, 4).items()}
    critic = get_critic(graphdef, critic_settings(), optim_settings(lr=1e-3, weight_decay=0.0))
    values = critic.values(
        params, arrays["tokens"], arrays["positions"], arrays["attention_mask"], arrays["mask"]
    )
    assert values.shape == (3, 4)
    np.testing.assert_array_equal(np.asarray(values)[np.asarray(arrays["mask"]) == 0], 0)

    # By hand: V(s_t) is the head applied to the hidden state of the *unpadded* sequence at
    # the position of the last token before t (prompt + response[:t]; causal attention).
    hidden_of = jax.jit(lambda t: model(t, return_logits=False).hidden)
    kernel, bias = np.asarray(params["head"]["kernel"]), float(params["head"]["bias"])
    for r, (prompt, response) in enumerate(zip(prompts, responses)):
        hidden = np.asarray(hidden_of(jnp.asarray([prompt + response], jnp.int32)))[0]
        for t in range(len(response)):
            want = float(hidden[len(prompt) - 1 + t] @ kernel + bias)
            assert float(values[r, t]) == pytest.approx(want, abs=1e-5), (r, t)
    # V(s_t) never sees token t: changing response token 1 changes V(s_2) onwards only.
    tokens = arrays["tokens"].at[0, 4 + 1].set(2)
    changed = critic.values(
        params, tokens, arrays["positions"], arrays["attention_mask"], arrays["mask"]
    )
    np.testing.assert_array_equal(np.asarray(changed[0, :2]), np.asarray(values[0, :2]))
    assert np.all(np.abs(np.asarray(changed[0, 2:]) - np.asarray(values[0, 2:])) > 1e-6)


def test_moe_critic_adds_its_load_balancing_loss():
    """On an MoE backbone the critic's loss is the value loss plus load_balancing_coef times
    the backbone's load-balancing loss (reported either way); the term reaches the router."""
    model = Transformer(preset("tiny_moe", vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(0))
    graphdef, policy_params = split_params(model)
    params = _random_head(init_critic_params(policy_params, model.config.hidden_size))
    arrays = {
        k: jnp.asarray(v)
        for k, v in layout(
            [[3, 4, 5], [6], [7, 8]], [[9, 10, 11, 12], [13, 14], [15]], 0, 4, 4
        ).items()
    }
    rng = np.random.default_rng(0)
    batch = Batch(
        tokens=arrays["tokens"],
        positions=arrays["positions"],
        attention_mask=arrays["attention_mask"],
        mask=arrays["mask"],
        advantages=jnp.zeros((3, 4)),
        old_log_probs=jnp.zeros((3, 4)),
        old_values=jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
        returns=jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
    )
    # Rollout rejection sampling's loss mask is the policy's: the critic still fits every token.
    rejected = batch._replace(loss_mask=jnp.zeros_like(batch.mask))

    def loss_and_grads(params, coef):
        settings = critic_settings(load_balancing_coef=coef)
        return jax.value_and_grad(
            lambda p: critic_loss(graphdef, p, batch, settings), has_aux=True
        )(params)

    @jax.jit  # one program for every loss below, not one eager op (and compile) at a time
    def losses(params):
        _, aux = forward_values(
            graphdef,
            params,
            batch.tokens,
            batch.positions,
            batch.attention_mask,
            4,
            return_aux=True,
        )
        rejected_loss = critic_loss(graphdef, params, rejected, critic_settings())[0]
        return (
            aux["load_balancing_loss"],
            loss_and_grads(params, 0.0),
            rejected_loss,
            loss_and_grads(params, 0.5),
        )

    balance, ((plain, metrics), plain_grads), rejected_loss, term = losses(params)
    (with_term, metrics_term), term_grads = term
    balance = float(balance)
    assert balance > 0
    assert float(rejected_loss) == float(plain)
    assert float(metrics["critic/moe_load_balancing_loss"]) == pytest.approx(balance, rel=1e-6)
    assert float(plain) == pytest.approx(float(metrics["critic/value_loss"]), rel=1e-6)
    assert float(with_term) == pytest.approx(float(plain) + 0.5 * balance, rel=1e-6)
    router = [
        (path, a, b)
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(plain_grads), jax.tree.leaves(term_grads)
        )
        if "router" in jax.tree_util.keystr(path)
    ]
    assert router and any(not np.allclose(a, b) for _, a, b in router)
    assert (
        CriticSettings.of(
            typed(vapo.get_config("algo.load_balancing_coef=0.01"))
        ).load_balancing_coef
        == 0.01
    )
    # A minibatch without a valid token does not move the critic (AdamW's decay and momentum).
    critic = Critic(graphdef, critic_settings(), critic_optim(vapo.get_config()))
    state = TrainState.create(jax.tree.map(jnp.copy, params), critic.optimizer)
    state, _ = critic.update(state, batch)
    before = jax.tree.map(jnp.copy, state)
    state, metrics = critic.update(state, batch._replace(mask=jnp.zeros_like(batch.mask)))
    assert float(metrics["critic/empty"]) == 1.0 and int(state.step) == 1
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # A learning rate of inf: finite loss and gradient, non-finite new parameters; skipped.
    critic = Critic(graphdef, critic_settings(), optim_settings(lr=float("inf"), weight_decay=0.0))
    state = TrainState.create(jax.tree.map(jnp.copy, params), critic.optimizer)
    state, metrics = critic.update(state, batch)
    assert float(metrics["critic/skipped"]) == 1.0 and np.isfinite(
        float(metrics["critic/grad_norm"])
    )
    assert int(state.step) == 0 and int(state.skipped) == 1
    assert all(np.isfinite(leaf).all() for leaf in _leaves(state))


def test_token_rewards_and_gae_targets_hand_worked():
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], jnp.float32)
    rewards = jnp.asarray([1.0, -1.0, 5.0])
    np.testing.assert_array_equal(
        np.asarray(token_rewards(rewards, mask)), [[0, 0, 1, 0], [0, -1, 0, 0], [0, 0, 0, 0]]
    )
    values = jnp.asarray([[0.5, 0.25, 0.5, 9.0], [0.0, -0.5, 9.0, 9.0], [1.0, 1.0, 1.0, 1.0]])
    settings = gae_settings(gamma=1.0, lam_actor=0.5, lam_critic=1.0, whiten=False)
    advantages, returns, metrics = gae_targets(rewards, values, mask, settings)
    # Row 0: deltas (0.25 - 0.5, 0.5 - 0.25, 1 - 0.5) = (-0.25, 0.25, 0.5);
    # A_2 = 0.5, A_1 = 0.25 + 0.5 * 0.5 = 0.5, A_0 = -0.25 + 0.5 * 0.5 = 0.
    # Row 1: deltas (-0.5 - 0, -1 + 0.5) = (-0.5, -0.5); A_1 = -0.5, A_0 = -0.75.
    np.testing.assert_allclose(
        np.asarray(advantages), [[0, 0.5, 0.5, 0], [-0.75, -0.5, 0, 0], [0] * 4], atol=1e-6
    )
    # lambda_critic = 1, gamma = 1: the value targets are the Monte-Carlo returns.
    np.testing.assert_allclose(
        np.asarray(returns), [[1, 1, 1, 0], [-1, -1, 0, 0], [0] * 4], atol=1e-6
    )
    assert float(metrics["critic/returns_mean"]) == pytest.approx(0.2)
    assert float(metrics["advantages/mean"]) == pytest.approx((0 + 0.5 + 0.5 - 0.75 - 0.5) / 5)
    whitened, _, _ = gae_targets(rewards, values, mask, gae_settings(lam_actor=0.5, lam_critic=1.0))
    valid = np.asarray(mask) > 0
    assert float(np.mean(np.asarray(whitened)[valid])) == pytest.approx(0, abs=1e-6)
    assert float(np.std(np.asarray(whitened)[valid])) == pytest.approx(1, abs=1e-4)


def test_nll_loss_hand_worked():
    log_probs = jnp.asarray([[-1.0, -2.0, -7.0], [-3.0, -4.0, -5.0], [-0.5, -0.5, -0.5]])
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    # Rows 0 and 2 correct: -(-1 - 2 - 0.5) / 3 tokens.
    assert float(nll_loss(log_probs, mask, jnp.asarray([1.0, 0.0, 1.0]))) == pytest.approx(3.5 / 3)
    assert float(nll_loss(log_probs, mask, jnp.zeros(3))) == 0.0


# ---- The trainer ------------------------------------------------------------------------


def test_length_adaptive_gae_against_loops():
    settings = typed(vapo.get_config()).algo
    assert (
        settings.gae_gamma,
        settings.gae_lambda,
        settings.critic_lambda,
        settings.gae_length_adaptive,
        settings.gae_alpha,
        settings.adv_whiten,
    ) == (1.0, 0.95, 1.0, True, 0.05, True)
    rng = np.random.default_rng(0)
    lengths = np.array([1, 10, 21, 40, 64, 0])
    mask = (np.arange(64)[None, :] < lengths[:, None]).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    rewards = rng.normal(size=len(lengths)).astype(np.float32)
    advantages, returns, _ = gae_targets(
        jnp.asarray(rewards),
        jnp.asarray(values),
        jnp.asarray(mask),
        replace(settings, whiten=False),
    )
    per_token = np.zeros(mask.shape)
    for r, length in enumerate(lengths):
        if length:
            per_token[r, length - 1] = rewards[r]
    # lambda = 1 - 1/(0.05 |y|), clamped at 0 for |y| <= 20 (and for the empty row).
    lam = np.where(lengths > 0, np.maximum(1 - 1 / (0.05 * np.maximum(lengths, 1)), 0), 0)
    want_adv, _ = numpy_gae(per_token, values, mask, 1.0, lam)
    _, want_returns = numpy_gae(per_token, values, mask, 1.0, 1.0)
    np.testing.assert_allclose(np.asarray(advantages), want_adv, atol=1e-5)
    np.testing.assert_allclose(np.asarray(returns), want_returns, atol=1e-5)


def test_policy_lambda_token_mean_hand_worked():
    # Lengths 10, 40, 100 and an empty row: alpha 0.05 gives lambda 0 (clamped), 0.5, 0.8;
    # over the 150 valid tokens the token mean is (10 * 0 + 40 * 0.5 + 100 * 0.8) / 150.
    lengths = np.array([10, 40, 100, 0])
    mask = jnp.asarray((np.arange(128)[None, :] < lengths[:, None]).astype(np.float32))
    rewards, values = jnp.ones(4), jnp.zeros(mask.shape)
    adaptive = gae_settings(length_adaptive=True, alpha=0.05, whiten=False)
    _, _, metrics = gae_targets(rewards, values, mask, adaptive)
    assert float(metrics["advantages/lambda_policy_token_mean"]) == pytest.approx(100 / 150)
    assert float(metrics["advantages/lambda_policy_zero_token_frac"]) == pytest.approx(10 / 150)
    # A fixed lambda is its own token mean; a batch without tokens gives 0, not NaN.
    _, _, metrics = gae_targets(rewards, values, mask, gae_settings(lam_actor=0.9))
    assert float(metrics["advantages/lambda_policy_token_mean"]) == pytest.approx(0.9)
    assert float(metrics["advantages/lambda_policy_zero_token_frac"]) == 0.0
    _, _, metrics = gae_targets(rewards, values, jnp.zeros_like(mask), adaptive)
    assert float(metrics["advantages/lambda_policy_token_mean"]) == 0.0


def test_rollout_explained_variance_against_monte_carlo_returns():
    # lambda_critic 0.5: the value targets contain V; the Monte-Carlo figure compares V with
    # each token's outcome (gamma 1), whatever lambda_critic is.
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0]], jnp.float32)
    rewards = jnp.asarray([1.0, -1.0])
    values = jnp.asarray([[0.5, 0.25, 0.5, 9.0], [0.0, -0.5, 9.0, 9.0]])
    settings = gae_settings(gamma=1.0, lam_actor=0.5, lam_critic=0.5, whiten=False)
    _, returns, metrics = gae_targets(rewards, values, mask, settings)
    valid = np.asarray(mask) > 0
    outcome = np.array([[1.0] * 4, [-1.0] * 4])[valid]
    v = np.asarray(values)[valid]
    want = 1 - np.var(outcome - v) / np.var(outcome)
    assert float(metrics["critic/rollout_mc_explained_variance"]) == pytest.approx(want, abs=1e-6)
    r = np.asarray(returns)[valid]
    assert float(metrics["critic/rollout_explained_variance"]) == pytest.approx(
        1 - np.var(r - v) / np.var(r), abs=1e-6
    )
    assert abs(want - float(metrics["critic/rollout_explained_variance"])) > 0.05


def _check_gae(run, critic_before, lam_actor, lam_critic):
    """The iteration's values, advantages and returns against an independent recomputation."""
    batch, sampled = run.last_batch, run.last_round
    mask = np.asarray(batch.mask)
    with jax.set_mesh(run.spec.mesh):  # as the trainer calls it: its compiled program serves
        values = run.spec.critic.values(
            critic_before, batch.tokens, batch.positions, batch.attention_mask, batch.mask
        )
    np.testing.assert_array_equal(np.asarray(batch.old_values), np.asarray(values))
    values = np.asarray(values, np.float64)
    rewards = np.zeros(mask.shape)
    for r, length in enumerate(mask.sum(axis=1).astype(int)):
        rewards[r, length - 1] = sampled.rewards[r]  # right-padded rows: last valid token
    want_adv, _ = numpy_gae(rewards, values, mask, 1.0, lam_actor)
    _, want_returns = numpy_gae(rewards, values, mask, 1.0, lam_critic)
    np.testing.assert_allclose(np.asarray(batch.advantages), want_adv, atol=2e-5)
    np.testing.assert_allclose(np.asarray(batch.returns), want_returns, atol=2e-5)
    return rewards


def _tiny_vapo(extra=""):
    """The VAPO recipe, one dense layer, no evaluation: one iteration of value pretraining,
    GAE at a fixed lambda 0.95 without whitening, rewards -1 for wrong (-2 with DAPO's
    overlong penalty); ``extra`` appends overrides."""
    return tiny(
        "vapo",
        model="tiny_dense",
        extra=(
            "model.num_layers=1,eval.num_prompts=0,reward.incorrect_value=-1.0,reward.overlong=dapo,"
            "critic.pretrain_iterations=1,algo.gae_length_adaptive=False,algo.gae_lambda=0.95,"
            "algo.adv_whiten=False,train.checkpoint_every=100" + extra
        ),
    )


def test_pretraining_decoupled_gae_nll_and_resume(tmp_path, monkeypatch):
    """One run of the VAPO recipe with VC-PPO's decoupled GAE (lambda_actor 0.95, lambda_critic
    1.0) and no whitening, so that the trainer's advantages are the raw GAE. Iteration 1 is
    value pretraining; a checkpoint after it, resumed, gives iteration 2 bit for bit."""
    # A random policy is never correct: -1 for wrong and DAPO's overlong penalty give
    # rewards that differ between rows (-1 or -2), so advantages and returns are not trivial.
    config = _tiny_vapo()
    run = trainer.build_run(config, str(tmp_path))
    # Start from a checkpoint of iteration 0, like the resumed run below: both start from
    # restored state (placed on the run's mesh with the same shardings) and share
    # compiled functions.
    trainer.save(run)
    run = trainer.build_run(config, str(tmp_path))
    run.run_state = run.run_state.replace(
        critic=run.run_state.critic.replace(params=_random_head(run.run_state.critic.params))
    )
    policy_before = _copy(run.run_state.policy.params)
    critic_before = _copy(run.run_state.critic.params)

    # Iteration 1: value pretraining. The policy is bit-identical; the critic moved; no
    # policy forward pass (old log-probs) was run for it.
    policy_forwards = []
    real_log_probs = forwards.policy_log_probs
    monkeypatch.setattr(
        forwards,
        "policy_log_probs",
        lambda *args: policy_forwards.append(1) or real_log_probs(*args),
    )
    metrics = run.step()
    assert not policy_forwards and "time/old_log_probs_s" not in metrics
    assert metrics["critic/pretraining"] == 1.0 and "loss/loss" not in metrics
    assert int(run.run_state.policy.step) == 0 and int(run.run_state.critic.step) == 1
    for got, want in zip(_leaves(run.run_state.policy.params), _leaves(policy_before)):
        np.testing.assert_array_equal(got, want)
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(_leaves(run.run_state.critic.params), _leaves(critic_before))
    )
    # Decoupled GAE: advantages with lambda_actor = 0.95, targets with lambda_critic = 1.0,
    # which with gamma = 1 are the Monte-Carlo returns: the outcome reward on every token.
    rewards = _check_gae(run, critic_before, 0.95, 1.0)
    assert len(set(run.last_round.rewards.tolist())) > 1  # the rewards do differ
    mc = np.where(np.asarray(run.last_batch.mask) > 0, rewards.sum(axis=1, keepdims=True), 0)
    np.testing.assert_allclose(np.asarray(run.last_batch.returns), mc, atol=1e-5)
    with pytest.raises(AssertionError):  # lambda_actor did reach the advantages
        _check_gae(run, critic_before, 1.0, 1.0)
    trainer.save(run)

    # Iteration 2: policy and critic both update.
    critic_before = _copy(run.run_state.critic.params)
    metrics = run.step()
    assert policy_forwards and "time/old_log_probs_s" in metrics
    assert metrics["critic/pretraining"] == 0.0 and int(run.run_state.policy.step) == 1
    assert int(run.run_state.critic.step) == 2
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(_leaves(run.run_state.policy.params), _leaves(policy_before))
    )
    _check_gae(run, critic_before, 0.95, 1.0)
    for key in (
        "loss/loss",
        "loss/nll",
        *CRITIC_METRICS,
        "critic/rollout_explained_variance",
        "critic/rollout_mc_explained_variance",
        "advantages/lambda_policy_token_mean",
        "update/grad_norm",
    ):
        assert np.isfinite(metrics[key]), key
    assert metrics["critic/value_loss"] > 0 and metrics["critic/skipped"] == 0

    # VAPO's NLL: the trainer selects the correct rows; loss = policy loss + 0.1 * NLL with
    # NLL = -mean log pi over the selected rows' tokens (log pi from the trainer's forward).
    batch = run.last_batch
    np.testing.assert_array_equal(
        np.asarray(batch.nll_weights), run.last_round.correct.astype(np.float32)
    )
    # Placed as the trainer's weights, so that its compiled update serves.
    weights = jax.device_put(
        np.asarray(np.arange(batch.mask.shape[0]) % 3 == 0, np.float32), batch.nll_weights.sharding
    )
    # (The update's metrics are those of the loss at the parameters it starts from; the
    # update is already compiled for this shape, a separate jit of the loss is not. Under
    # the run's mesh, as the trainer calls them, the trainer's compiled programs serve.)
    with jax.set_mesh(run.spec.mesh):
        log_probs, _, _ = run.spec.learner.log_probs(
            run.run_state.policy.params,
            batch.tokens,
            batch.positions,
            batch.attention_mask,
            batch.mask,
            None,
            None,
        )
        _, loss_metrics = run.spec.learner.update(
            _copy(run.run_state.policy), batch._replace(nll_weights=weights)
        )
    log_probs, mask, rows = (
        np.asarray(log_probs, np.float64),
        np.asarray(batch.mask),
        np.asarray(weights) > 0,
    )
    want_nll = -(log_probs[rows] * mask[rows]).sum() / mask[rows].sum()
    assert float(loss_metrics["loss/nll"]) == pytest.approx(want_nll, rel=1e-5)
    assert float(loss_metrics["loss/total"]) == pytest.approx(
        float(loss_metrics["loss/loss"]) + 0.1 * want_nll, rel=1e-5
    )

    # Resume from the checkpoint after iteration 1: the same iteration 2, critic included.
    resumed = trainer.build_run(config, str(tmp_path))
    assert resumed.run_state.iteration == 1 and int(resumed.run_state.critic.step) == 1
    resumed.step()
    for got, want in zip(
        _leaves((resumed.run_state.policy, resumed.run_state.critic)),
        _leaves((run.run_state.policy, run.run_state.critic)),
    ):
        np.testing.assert_array_equal(got, want)


def test_value_pretraining_targets_are_monte_carlo_returns(tmp_path):
    """VC-PPO's value pretraining fits Monte-Carlo returns (lambda = 1) even in a recipe
    whose PPO updates use lambda_critic < 1 (PPO's 0.95); afterwards, lambda_critic again."""
    config = _tiny_vapo(",algo.gae_lambda_critic=0.95")
    assert methods.gae_settings(typed(config), pretraining=True).critic_lambda == 1.0
    assert methods.gae_settings(typed(config), pretraining=False) == typed(config).algo
    assert typed(config).algo.critic_lambda == 0.95
    run = trainer.build_run(config, str(tmp_path))
    run.run_state = run.run_state.replace(
        critic=run.run_state.critic.replace(params=_random_head(run.run_state.critic.params))
    )
    critic_before = _copy(run.run_state.critic.params)
    assert run.step()["critic/pretraining"] == 1.0
    rewards = _check_gae(run, critic_before, 0.95, 1.0)
    mc = np.where(np.asarray(run.last_batch.mask) > 0, rewards.sum(axis=1, keepdims=True), 0)
    np.testing.assert_allclose(np.asarray(run.last_batch.returns), mc, atol=1e-5)


def test_reward_model_targets_hand_worked():
    """The reward model's batch: the last valid token of each row, the reward there, and
    old values equal to the targets, under which PPO's clipped value loss is the plain
    squared error for any values (the clip 0.2 is far narrower than these errors)."""
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], jnp.float32)
    rewards = jnp.array([1.0, -1.0, 1.0])
    last, returns, old_values = reward_model_targets(rewards, mask)
    np.testing.assert_array_equal(last, [[0, 0, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(returns, [[0, 0, 1, 0], [-1, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(old_values, returns)
    from policyopt.losses import value_loss

    values = jnp.array([[5.0, 5.0, -0.3, 5.0], [0.9, 5.0, 5.0, 5.0], [5.0, 5.0, 5.0, 5.0]])
    loss, _ = value_loss(values, old_values, returns, last, clip=0.2)
    # Two tokens: 0.5 * ((-0.3 - 1)^2 + (0.9 + 1)^2) / 2.
    np.testing.assert_allclose(float(loss), 0.5 * (1.3**2 + 1.9**2) / 2, rtol=1e-6)


def test_reward_model_then_value_pretraining_then_ppo(tmp_path):
    """``critic.reward_model_iterations=1, critic.pretrain_iterations=1``: iteration 1 fits
    the critic's last-token value to the reward (the policy bit-identical), iteration 2
    is value pretraining on Monte-Carlo returns, iteration 3 updates the policy too; the
    ablation counts both warm-up phases on top of the policy's iterations."""
    config = tiny(
        "vapo",
        model="tiny_dense",
        extra=(
            "model.num_layers=1,eval.num_prompts=0,reward.incorrect_value=-1.0,reward.overlong=dapo,"
            "critic.reward_model_iterations=1,critic.pretrain_iterations=1,"
            "algo.gae_length_adaptive=False,algo.gae_lambda=0.95,algo.adv_whiten=False,"
            "train.checkpoint_every=100"
        ),
    )
    run = trainer.build_run(config, str(tmp_path))
    assert (run.spec.reward_model_iterations, run.spec.warmup_iterations) == (1, 2)
    run.run_state = run.run_state.replace(
        critic=run.run_state.critic.replace(params=_random_head(run.run_state.critic.params))
    )
    policy_before = _copy(run.run_state.policy.params)
    critic_before = _copy(run.run_state.critic.params)

    metrics = run.step()
    assert metrics["critic/reward_model"] == 1.0 and metrics["critic/pretraining"] == 1.0
    assert "loss/loss" not in metrics and int(run.run_state.policy.step) == 0
    for got, want in zip(_leaves(run.run_state.policy.params), _leaves(policy_before)):
        np.testing.assert_array_equal(got, want)
    rnd, batch = run.last_round, run.last_batch
    rewards = np.asarray(rnd.rewards)
    assert len(set(rewards.tolist())) > 1  # -1 or -2 (the overlong penalty)
    response_mask = np.asarray(rnd.mask)
    lengths = response_mask.sum(axis=1).astype(int)
    want_mask = np.zeros_like(response_mask)
    want_mask[np.arange(len(lengths)), lengths - 1] = 1.0
    np.testing.assert_array_equal(np.asarray(batch.mask), want_mask)
    np.testing.assert_allclose(np.asarray(batch.returns), want_mask * rewards[:, None])
    np.testing.assert_array_equal(np.asarray(batch.old_values), np.asarray(batch.returns))

    # The critic's update fitted the last token's value: its squared error there fell.
    def last_token_error(params):
        with jax.set_mesh(run.spec.mesh):
            values = run.spec.critic.values(
                params, batch.tokens, batch.positions, batch.attention_mask, rnd.mask
            )
        return np.sum(want_mask * (np.asarray(values) - rewards[:, None]) ** 2)

    mse_before, mse_after = (
        last_token_error(critic_before),
        last_token_error(run.run_state.critic.params),
    )
    assert mse_after < mse_before

    metrics = run.step()
    assert metrics["critic/reward_model"] == 0.0 and metrics["critic/pretraining"] == 1.0
    assert int(run.run_state.policy.step) == 0
    mask = np.asarray(run.last_batch.mask)
    np.testing.assert_array_equal(mask, np.asarray(run.last_round.mask))
    mc = np.where(mask > 0, np.asarray(run.last_round.rewards)[:, None], 0)
    np.testing.assert_allclose(np.asarray(run.last_batch.returns), mc, atol=1e-5)

    metrics = run.step()
    assert metrics["critic/reward_model"] == 0.0 and metrics["critic/pretraining"] == 0.0
    assert int(run.run_state.policy.step) == 1 and int(run.run_state.critic.step) == 3


def test_a_critic_of_its_own_model_starts_from_its_checkpoint(tmp_path):
    """``critic.init_checkpoint``: the critic's backbone is the model that checkpoint records
    (here wider and deeper than the policy: D = 96, 2 layers against D = 64, 1 layer), its
    parameters those saved, a zero head of its width; value pretraining then trains it
    and leaves the policy as it was; resumed, the critic is its own again."""
    big = trainer.build_run(
        _tiny_vapo(",model.hidden_size=96,model.num_layers=2"), str(tmp_path / "big")
    )
    trainer.save(big)
    saved = _leaves(big.run_state.policy.params)
    config = _tiny_vapo(f",critic.init_checkpoint={tmp_path / 'big' / 'checkpoints'}")
    run = trainer.build_run(config, str(tmp_path / "run"))
    critic = run.run_state.critic.params
    assert [x.shape for x in _leaves(critic["backbone"])] == [x.shape for x in saved]
    for got, want in zip(_leaves(critic["backbone"]), saved):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(critic["head"]["kernel"]), np.zeros(96))
    policy = _leaves(run.run_state.policy.params)
    assert {x.shape for x in policy} != {x.shape for x in saved}  # the policy's own model

    # A random head, so that the first update reaches the backbone (a zero head passes
    # no gradient to it).
    run.run_state = run.run_state.replace(
        critic=run.run_state.critic.replace(params=_random_head(run.run_state.critic.params))
    )
    metrics = run.step()  # value pretraining: the critic alone moves
    assert metrics["critic/pretraining"] == 1.0 and np.isfinite(metrics["critic/value_loss"])
    for got, want in zip(_leaves(run.run_state.policy.params), policy):
        np.testing.assert_array_equal(got, want)
    trained = _leaves(run.run_state.critic.params["backbone"])
    assert not all(np.array_equal(a, b) for a, b in zip(trained, saved))
    moved = _leaves(run.run_state.critic.params)
    trainer.save(run)
    # Resumed after the source moved (the old path gone, or the config naming the new one):
    # the critic's model is in the run's checkpoint meta, its parameters in its arrays.
    (tmp_path / "big").rename(tmp_path / "moved")
    moved_config = _tiny_vapo(f",critic.init_checkpoint={tmp_path / 'moved' / 'checkpoints'}")
    for resumed in (config, moved_config):
        again = trainer.build_run(resumed, str(tmp_path / "run"))
        for got, want in zip(_leaves(again.run_state.critic.params), moved):
            np.testing.assert_array_equal(got, want)


def test_a_critic_of_its_own_model_is_refused_where_it_cannot_be(tmp_path):
    """One-line errors: without a critic; with LoRA's adapters critic (they share the
    policy's base); a directory that is not there."""
    with pytest.raises(ValueError, match="critic.init_checkpoint needs a critic"):
        typed(tiny("grpo", extra=f"critic.init_checkpoint={tmp_path}"))
    with pytest.raises(ValueError, match="set model.lora.critic='full'"):
        typed(_tiny_vapo(f",model.lora.rank=2,critic.init_checkpoint={tmp_path}"))
    missing = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.critic.init_checkpoint=.*nowhere"):
        trainer.build_run(_tiny_vapo(f",critic.init_checkpoint={missing}"), str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()  # nothing written before the checks
    # An MoE critic beside a dense policy: the capacity dispatch, which the dense policy
    # never uses, drops the critic's token copies by batch position.
    moe = trainer.build_run(_tiny_vapo(",model=tiny_moe"), str(tmp_path / "moe"))
    trainer.save(moe)
    capacity = _tiny_vapo(
        f",model.moe_dispatch=capacity,critic.init_checkpoint={tmp_path / 'moe' / 'checkpoints'}"
    )
    with pytest.raises(ValueError, match="critic.init_checkpoint's model: its moe_dispatch"):
        trainer.build_run(capacity, str(tmp_path / "r"))


def test_a_critic_of_its_own_model_reads_the_runs_tokens(tmp_path):
    """A critic checkpoint trained with another tokenizer (a BPE beside the policy's
    character tokenizer) is refused by name, not read with the policy's token ids."""
    from tests.data.test_synthetic import _tiny_bpe

    _tiny_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]).save(
        str(tmp_path / "tokenizer.json")
    )
    other = trainer.build_run(
        _tiny_vapo(f",model.tokenizer={tmp_path / 'tokenizer.json'}"), str(tmp_path / "bpe")
    )
    trainer.save(other)
    config = _tiny_vapo(f",critic.init_checkpoint={tmp_path / 'bpe' / 'checkpoints'}")
    with pytest.raises(ValueError, match="was trained with another tokenizer .*tokenizer.json"):
        trainer.build_run(config, str(tmp_path / "run"))
    with pytest.raises(ValueError, match="was trained with another tokenizer"):
        dry_run.plan_run(typed(config), str(tmp_path / "run"))  # the dry run checks it too


def test_the_dry_run_names_a_critic_of_its_own(tmp_path):
    """The dry run counts a critic of its own as the run does (its model's parameters and
    its head) and refuses one whose source is missing."""
    big = trainer.build_run(_tiny_vapo(",model.hidden_size=96"), str(tmp_path / "big"))
    trainer.save(big)
    config = typed(_tiny_vapo(f",critic.init_checkpoint={tmp_path / 'big' / 'checkpoints'}"))
    run = trainer.build_run(config, str(tmp_path / "run"))
    count = report.parameter_count(run.run_state.critic.params)
    text = dry_run.plan_run(config, str(tmp_path / "plan"))
    assert f"  critic    its own model, {report._human(count)} parameters ({count:,})" in text
    missing = typed(_tiny_vapo(f",critic.init_checkpoint={tmp_path / 'nowhere'}"))
    with pytest.raises(FileNotFoundError, match="config.critic.init_checkpoint="):
        dry_run.plan_run(missing, str(tmp_path / "plan"))
