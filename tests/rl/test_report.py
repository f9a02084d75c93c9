"""What a run prints about itself (`policyopt.rl.reporting.report`): the method the banner
names, the warnings a recipe's own defaults do not raise and a user's change does, a length-adaptive
lambda held near 0, and the critic's warm-up phases as a run goes through them."""

import importlib
import pathlib

import jax
import numpy as np
import pytest

from configs import base
from policyopt.rl.loop import trainer
from policyopt.rl.reporting import report

RECIPES = {
    "grpo": "grpo",
    "dapo": "dapo",
    "dr_grpo": "dr_grpo",
    "gspo": "gspo",
    "gspo_token": "gspo_token",
    "sapo": "sapo",
    "magistral": "magistral",
    "magistral_async": "magistral",
    "ppo": "ppo",
    "vc_ppo": "vc_ppo",
    "vapo": "vapo",
    "demo": "sapo",
    "testbed": "sapo",
    "testbed_long": "sapo",
}
# A one-layer dense model on a few short prompts: what a run needs to go through its phases.
TINY = (
    "model=tiny_dense,model.num_layers=1,batch.n_prompts=2,batch.group_size=4,"
    "sampling.max_new_tokens=6,task.num_train=64,task.num_test=8,eval.num_prompts=0,"
    "train.checkpoint_every=100,train.loggers=jsonl,train.routing_metrics=False,"
    "batch.prompt_buckets=(16,),batch.response_buckets=(6,)"
)


def load(name, arg=None):
    return importlib.import_module(f"configs.{name}").get_config(arg)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_banner_names_each_recipes_method(recipe):
    config = load(recipe)
    assert report.method_name(config) == RECIPES[recipe]


def test_method_name_follows_the_settings_that_define_a_method():
    # VAPO without its length-adaptive lambda keeps its NLL term: still VAPO.
    assert report.method_name(load("vapo", "algo.gae_length_adaptive=False")) == "vapo"
    # PPO with decoupled lambdas is VC-PPO's; GRPO with clip-higher is DAPO's first technique.
    assert report.method_name(load("ppo", "algo.gae_lambda_critic=1.0")) == "vc_ppo"
    assert report.method_name(load("grpo", "algo.clip_high=0.28")) == "dapo"
    assert report.method_name(load("dr_grpo", "algo.aggregation='token_mean'")) == "grpo"


def test_user_fields_reads_the_variant_and_the_overrides():
    recipe = (
        "configs/sapo.py:model=tiny_dense,batch.response_buckets=(16,32),seed=1,scale=paper "
        "--config.algo.tau_neg=1.1 --config.train.num_iterations=3"
    )
    assert report.user_fields(recipe) == {
        "model.preset",
        "batch.response_buckets",
        "seed",
        "algo.tau_neg",
        "train.num_iterations",
    }
    assert report.user_fields("configs/grpo.py") == frozenset()
    assert report.user_fields("configs/demo.py:seed=0,init_checkpoint=runs/demo/sft (SAPO)") == {
        "seed",
        "init_checkpoint",
    }
    assert report.user_fields(None) is None


# Every recipe file in configs/ (base, claims and ablations are not recipes).
RECIPE_FILES = sorted(
    p.stem
    for p in pathlib.Path(base.__file__).parent.glob("*.py")
    if p.stem not in ("__init__", "base", "claims", "ablations")
)


@pytest.mark.parametrize("recipe", RECIPE_FILES)
def test_no_recipe_warns_about_its_own_defaults(recipe):
    """A recipe's defaults raise no warning at all (the one-update warning, VAPO's lambda
    held near 0 by the CPU's short responses): the banner states those facts instead."""
    assert report.advisories(load(recipe), report.user_fields(f"configs/{recipe}.py")) == []
    variant = f"configs/{recipe}.py:seed=1 --config.train.num_iterations=1"
    assert report.advisories(load(recipe, "seed=1"), report.user_fields(variant)) == []


def _ratio_warnings(config, recipe):
    return [w for w in report.advisories(config, report.user_fields(recipe)) if "ratio is 1" in w]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_defaults_do_not_warn_about_themselves(recipe):
    """No recipe's own geometry raises the one-update warning; recipes that make one update
    per batch (GRPO's exploration stage, Magistral's n_batch = n_minibatch, the demo) say
    so in the banner instead."""
    config = load(recipe)
    assert _ratio_warnings(config, f"configs/{recipe}.py") == []
    assert _ratio_warnings(config, f"configs/{recipe}.py:seed=1,scale=paper") == []


def test_a_users_change_that_cannot_act_is_warned():
    grpo = load("grpo", "algo.clip_high=0.28")
    assert _ratio_warnings(grpo, "configs/grpo.py:algo.clip_high=0.28")
    assert _ratio_warnings(load("grpo"), "configs/grpo.py --config.algo.clip_low=0.1")
    sapo = load("sapo", "batch.n_minibatches=1")  # the user made SAPO's gate inert
    (warning,) = _ratio_warnings(sapo, "configs/sapo.py:batch.n_minibatches=1")
    assert "tau_pos / tau_neg" in warning
    # A change that leaves the ratio-dependent part alone raises nothing.
    assert _ratio_warnings(load("grpo"), "configs/grpo.py --config.optim.lr=3e-4") == []
    # Several updates per batch: the clip acts, nothing to say.
    off = load("grpo", "batch.n_minibatches=2")
    assert _ratio_warnings(off, "configs/grpo.py:batch.n_minibatches=2,algo.clip_high=0.3") == []
    # A config built in code: its origin is unknown, so every advisory applies.
    assert _ratio_warnings(load("grpo"), None)


def test_banner_says_when_updates_are_on_policy():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    kwargs = dict(num_params=10, mesh=mesh, start="random", total=3)
    text = report.banner(load("vapo"), "runs/x", recipe="configs/vapo.py", **kwargs)
    assert (
        "  method    vapo: objective ppo, GAE with a critic (length-adaptive lambda <= 0.17 at "
        "sampling.max_new_tokens=24: close to one-step TD advantages)\n"
    ) in text
    assert "1 minibatch(es) x 1 epoch(s) (one update per batch, on-policy: the ratio is 1)" in text
    paper = load("vapo", "scale=paper")  # lambda reaches 0.999: nothing to say of it
    text = report.banner(paper, "runs/x", recipe="configs/vapo.py:scale=paper", **kwargs)
    assert "  method    vapo: objective ppo, GAE with a critic\n" in text
    text = report.banner(load("sapo"), "runs/x", recipe="configs/sapo.py", **kwargs)
    assert "method    sapo: objective sapo, outcome advantages" in text
    assert "4 minibatch(es) x 1 epoch(s), 3 iterations" in text
    text = report.banner(load("magistral_async"), "runs/x", recipe=None, **kwargs)
    assert "method    magistral: objective ppo, outcome advantages, asynchronous" in text
    assert "  critic  " not in text
    own = load("vapo", "critic.init_checkpoint='runs/big/checkpoints'")
    text = report.banner(own, "runs/x", recipe=None, critic_params=1_367_616, **kwargs)
    assert (
        "GAE with a critic (length-adaptive lambda <= 0.17 at sampling.max_new_tokens=24: "
        "close to one-step TD advantages)\n  critic    its own model, 1.37M parameters "
        "(1,367,616), from runs/big/checkpoints\n  batch  "
    ) in text


def test_length_adaptive_lambda_near_zero_is_warned():
    # VAPO on the CPU task: at most 24 tokens, lambda <= 1 - 1/(0.05 * 24) = 1/6.
    (warning,) = [w for w in report.advisories(load("vapo")) if "gae_length_adaptive" in w]
    assert "at most sampling.max_new_tokens=24 tokens" in warning
    assert "is at most 0.17 (0 under 20 tokens)" in warning
    # Said for a user's change to the fields that bound lambda; the recipe's own CPU
    # budget is stated in the banner instead (test_no_recipe_warns_about_its_own_defaults).
    changed = report.user_fields("configs/vapo.py --config.sampling.max_new_tokens=22")
    assert len(report.advisories(load("vapo"), changed)) == 1
    changed = report.user_fields("configs/vapo.py:algo.gae_alpha=0.2,sampling.max_new_tokens=8")
    (warning,) = report.advisories(
        load("vapo", "algo.gae_alpha=0.2,sampling.max_new_tokens=8"), changed
    )
    assert "is at most 0.38 (0 under 5 tokens)" in warning
    assert report.advisories(load("vapo"), report.user_fields("configs/vapo.py:seed=2")) == []
    # The papers' budget: lambda can reach 0.999; nothing to say before a rollout.
    paper = load("vapo", "scale=paper")
    assert not [w for w in report.advisories(paper) if "gae_length_adaptive" in w]
    # A budget that allows long responses, and a batch of short ones: 10, 20, 40, 80
    # tokens give lambdas 0, 0, 0.5, 0.75 (alpha 0.05), mean 0.3125.
    long = load("vapo", "sampling.max_new_tokens=208,batch.response_buckets=(208,)")
    assert report.short_lambda_warning(long, [80, 80, 80, 80]) is None  # 0.75 each
    warning = report.short_lambda_warning(long, np.array([10.0, 20.0, 40.0, 80.0]))
    assert "average 37.5 tokens" in warning and "averages 0.31 and is 0 for 50% of them" in warning
    assert report.short_lambda_warning(load("vapo"), [10, 10]) is None  # said at the start
    assert report.short_lambda_warning(load("vc_ppo"), [10, 10]) is None  # a fixed lambda


def test_critic_phases_hand_worked():
    config = load("vc_ppo", "critic.reward_model_iterations=2,critic.pretrain_iterations=3")
    assert report.critic_phase(config, 0) == (
        "critic warm-up: the critic trains alone as an outcome reward model in iterations 1-2 "
        "(critic.reward_model_iterations=2), then pretrains its values in iterations 3-5; the "
        "policy is frozen until iteration 6"
    )
    assert report.critic_phase(config, 3) == (  # resumed during value pretraining
        "critic warm-up: the critic pretrains its values on Monte-Carlo returns in iterations "
        "4-5 (critic.pretrain_iterations=3); the policy is frozen until iteration 6"
    )
    figures = {"critic/value_loss": 0.4, "critic/explained_variance": -0.25}
    assert report.critic_phase(config, 1, figures) is None
    assert report.critic_phase(config, 2, figures) == (
        "critic warm-up: reward model done at iteration 2 (value loss 0.4, explained variance "
        "-0.25); the critic pretrains its values in iterations 3-5 "
        "(critic.pretrain_iterations=3); the policy is frozen until iteration 6"
    )
    assert report.critic_phase(config, 5, figures) == (
        "critic warm-up: value pretraining done at iteration 5 (value loss 0.4, explained "
        "variance -0.25); the policy trains from iteration 6"
    )
    assert report.critic_phase(config, 5) is None and report.critic_phase(config, 6, {}) is None
    # A reward model alone, one iteration; value pretraining alone.
    rm_only = load("ppo", "critic.reward_model_iterations=1")
    assert report.critic_phase(rm_only, 0) == (
        "critic warm-up: the critic trains alone as an outcome reward model in iteration 1 "
        "(critic.reward_model_iterations=1); the policy is frozen until iteration 2"
    )
    assert report.critic_phase(rm_only, 1, {}) == (
        "critic warm-up: reward model done at iteration 1; the policy trains from iteration 2"
    )
    assert report.critic_phase(load("vc_ppo"), 0).startswith(
        "critic warm-up: the critic pretrains its values on Monte-Carlo returns in iterations 1-5"
    )
    assert report.critic_phase(load("ppo"), 0) is None  # no warm-up
    assert report.critic_phase(load("grpo"), 0) is None  # no critic


def test_a_vapo_run_prints_its_method_and_warm_up_phases(tmp_path, capsys):
    """A VAPO run with one reward-model iteration, one of value pretraining and one of the
    policy: the banner names VAPO, each phase's start and end is printed in order, and the
    length-adaptive lambda of 6-token responses is warned about once, before anything runs."""
    variant = (
        TINY + ",critic.reward_model_iterations=1,critic.pretrain_iterations=1,"
        "train.num_iterations=3"
    )
    config = load("vapo", variant)
    base.check(config)
    recipe = f"configs/vapo.py:{variant}"  # sampling.max_new_tokens is the user's
    summary = trainer.run_rl(config, str(tmp_path / "run"), recipe=recipe)
    assert summary["iteration"] == 3
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert (
        "  method    vapo: objective ppo, GAE with a critic (length-adaptive lambda <= 0.00 at "
        "sampling.max_new_tokens=6: close to one-step TD advantages)"
    ) in out
    phases = [line for line in out if line.startswith("critic warm-up")]
    assert phases == [
        "critic warm-up: the critic trains alone as an outcome reward model in iteration 1 "
        "(critic.reward_model_iterations=1), then pretrains its values in iteration 2; the "
        "policy is frozen until iteration 3",
        phases[1],
        phases[2],
    ]
    assert phases[1].startswith("critic warm-up: reward model done at iteration 1 (value loss")
    assert phases[1].endswith(
        "the critic pretrains its values in iteration 2 (critic.pretrain_iterations=1); the "
        "policy is frozen until iteration 3"
    )
    assert phases[2].startswith("critic warm-up: value pretraining done at iteration 2 (value")
    assert phases[2].endswith("the policy trains from iteration 3")
    assert out.index(phases[0]) < out.index(phases[1]) < out.index(phases[2])
    assert captured.err.count("warning: algo.gae_length_adaptive") == 1
    assert "ratio is 1" not in captured.err  # the recipe's own one-update geometry
    metrics = summary["metrics"]
    assert metrics["critic/pretraining"] == 0.0 and metrics["update/step"] == 1.0
