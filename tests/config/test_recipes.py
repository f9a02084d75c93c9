"""Recipe configs: paper values, variants, command-line overrides, errors naming the field."""

import importlib
import json

import pytest
from absl import flags
from ml_collections import config_flags

from configs import base
from policyopt.config import typed
from policyopt.rl.loop import build
from policyopt.sharding import MESH_AXES
from tests.settings import RL_RECIPES

RECIPES = RL_RECIPES + ("demo",)


def load(name, arg=None):
    return importlib.import_module(f"configs.{name}").get_config(arg)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_builds_locked_and_valid(name):
    config = load(name)
    base.check(config)
    with pytest.raises(AttributeError, match="tau_ng"):
        config.algo.tau_ng = 1.0  # locked: a typo cannot add a field


def test_paper_values():
    grpo, dapo, dr, gspo, gspo_t, sapo, mag = (load(n) for n in RECIPES[:7])
    assert (grpo.algo.method, grpo.algo.kl_beta, grpo.algo.kl_estimator) == ("ppo", 0.04, "k3")
    assert grpo.algo.aggregation == "seq_mean_token_mean"
    assert (dapo.algo.clip_low, dapo.algo.clip_high) == (0.2, 0.28)
    assert dapo.algo.aggregation == "group_token_mean"
    assert (
        dapo.dynamic_sampling.enabled and dapo.reward.overlong == "dapo" and dapo.algo.kl_beta == 0
    )
    assert (dr.algo.adv_scale, dr.algo.aggregation) == ("none", "seq_mean_token_sum_norm")
    assert (gspo.algo.method, gspo.algo.clip_low, gspo.algo.clip_high) == ("gspo", 3e-4, 4e-4)
    assert gspo_t.algo.method == "gspo_token" and gspo_t.algo.clip_high == 4e-4
    assert (sapo.algo.method, sapo.algo.tau_pos, sapo.algo.tau_neg) == ("sapo", 1.0, 1.05)
    assert (mag.algo.clip_high, mag.algo.adv_scale) == (0.28, "minibatch")
    assert mag.algo.aggregation == "group_token_mean"
    assert mag.reward.format and mag.reward.overlong == "magistral" and mag.dynamic_sampling.enabled


def test_critic_paper_values():
    ppo, vc, vapo = (load(n) for n in ("ppo", "vc_ppo", "vapo"))
    for c in (ppo, vc, vapo):
        assert (c.algo.advantage, c.algo.gae_gamma, c.algo.method) == ("gae", 1.0, "ppo")
        assert c.algo.kl_beta == 0 and not c.dynamic_sampling.enabled
    assert (ppo.algo.aggregation, vc.algo.aggregation, vapo.algo.aggregation) == (
        "token_mean",
        "token_mean",
        "group_token_mean",
    )
    assert (ppo.algo.gae_lambda, ppo.algo.gae_lambda_critic, ppo.algo.nll_coef) == (0.95, None, 0.0)
    # PPO's one lambda: the critic's follows gae_lambda, also when only gae_lambda is overridden.
    assert typed(ppo).algo.critic_lambda == 0.95
    settings = typed(load("ppo", "algo.gae_lambda=0.9")).algo
    assert (settings.gae_lambda, settings.critic_lambda) == (0.9, 0.9)
    settings = typed(load("ppo", "algo.gae_lambda=0.9,algo.gae_lambda_critic=1.0")).algo
    assert (settings.gae_lambda, settings.critic_lambda) == (0.9, 1.0)
    assert typed(vc).algo.critic_lambda == 1.0
    assert (vc.algo.gae_lambda, vc.algo.gae_lambda_critic, vc.algo.gae_length_adaptive) == (
        0.95,
        1.0,
        False,
    )
    assert vc.critic.pretrain_iterations > 0
    assert (vapo.algo.gae_length_adaptive, vapo.algo.gae_alpha, vapo.algo.gae_lambda_critic) == (
        True,
        0.05,
        1.0,
    )
    assert (vapo.algo.clip_low, vapo.algo.clip_high, vapo.algo.nll_coef) == (0.2, 0.28, 0.1)
    assert load("grpo").algo.advantage == "outcome"
    paper = load("vapo", "scale=paper")
    assert (paper.optim.lr, paper.critic.lr, paper.critic.pretrain_iterations) == (1e-6, 2e-6, 50)
    assert (paper.batch.n_prompts, paper.batch.group_size, paper.batch.n_minibatches) == (
        512,
        16,
        16,
    )
    assert paper.sampling.max_new_tokens == 20480  # DAPO's, not the CPU's 24 (lambda ~ 0.999)
    assert load("dapo", "algo.aggregation=token_mean").algo.aggregation == "token_mean"  # verl's
    assert load("dapo").dynamic_sampling.criterion == "accuracy"
    assert load("magistral").dynamic_sampling.criterion == "reward"
    with pytest.raises(ValueError, match="pretrain_iterations > 0 needs a critic"):
        load("grpo", "critic.pretrain_iterations=3")
    with pytest.raises(ValueError, match="reward_model_iterations > 0 needs a critic"):
        load("grpo", "critic.reward_model_iterations=3")
    with pytest.raises(ValueError, match="reward_model_iterations must be >= 0"):
        load("ppo", "critic.reward_model_iterations=-1")
    with pytest.raises(ValueError, match="gae_lambda_critic"):
        load("vc_ppo", "algo.gae_lambda_critic=1.5")
    with pytest.raises(ValueError, match="algo.advantage"):
        load("ppo", "algo.advantage=td")


def test_recipes_state_the_papers_rewards_aggregation_and_kl():
    """The papers' forms (docs/algorithms.md): +-1 rewards for the critic recipes (VC-PPO,
    VAPO and the PPO baseline of VC-PPO), as DAPO; the per-group token mean for DAPO,
    Magistral and VAPO (verl's minibatch token mean stays selectable); k3 unclamped."""
    names = ("grpo", "dapo", "dr_grpo", "gspo", "sapo", "magistral", "ppo", "vc_ppo", "vapo")
    configs = {name: load(name) for name in names}
    incorrect = {name: c.reward.incorrect_value for name, c in configs.items()}
    assert incorrect == {
        "grpo": 0.0,
        "dapo": -1.0,
        "dr_grpo": 0.0,
        "gspo": 0.0,
        "sapo": 0.0,
        "magistral": 0.0,
        "ppo": -1.0,
        "vc_ppo": -1.0,
        "vapo": -1.0,
    }
    group_mean = sorted(n for n, c in configs.items() if c.algo.aggregation == "group_token_mean")
    assert group_mean == ["dapo", "magistral", "vapo"]
    assert all(not c.algo.kl_clamp for c in configs.values())
    for name in group_mean:
        assert load(name, "algo.aggregation=token_mean").algo.aggregation == "token_mean"
    assert load("grpo", "algo.kl_clamp=True").algo.kl_clamp is True
    # The critic sees +-1 outcomes; the loss settings carry the clamp and the aggregation.
    from policyopt.rl.update.learner import LossSettings

    settings = LossSettings.of(typed(load("vapo", "algo.kl_clamp=True,algo.kl_beta=0.04")))
    assert (settings.algo.kl_clamp, settings.algo.aggregation) == (True, "group_token_mean")
    assert settings.group_size == 8
    spec = build.reward_spec(configs["vapo"])
    assert (spec.incorrect_value, spec.plain_correct_value) == (-1.0, 1.0)
    assert not spec.format_reward
    # pass@1 counts correct answers, whatever the training reward of a wrong one.
    assert build.correctness_spec(configs["vapo"]).incorrect_value == 0.0


def test_variant_string_and_paper_scale():
    config = load(
        "sapo", "model=tiny_dense,algo.tau_neg=1.2,batch.group_size=4,algo.routing_replay=R2"
    )
    assert config.model.preset == "tiny_dense"
    assert config.algo.tau_neg == 1.2 and config.batch.group_size == 4
    assert config.algo.routing_replay == "R2"
    paper = load("dapo", "scale=paper")
    assert paper.model.preset == "qwen3_30b_a3b"
    assert (paper.batch.n_prompts, paper.batch.group_size, paper.batch.n_minibatches) == (
        512,
        16,
        16,
    )
    assert paper.optim.lr == 1e-6 and paper.reward.cache_len == 4096
    # Magistral's language-consistency bonus (§2.2) is the config's value, 0 by default.
    assert build.reward_spec(load("magistral", "scale=paper")).language_bonus == 0.1
    assert build.reward_spec(load("magistral")).language_bonus == 0.0
    assert build.reward_spec(load("magistral", "reward.language_bonus=0.2")).language_bonus == 0.2


@pytest.mark.parametrize("name", [*RL_RECIPES, "magistral_async"])
def test_every_recipe_builds_at_paper_scale(name):
    """scale=paper is documented for every recipe (and for every ablation arm via
    experiments/ablate.py --variant scale=paper): it must pass base.check."""
    variant = "scale=paper"
    if name in ("gspo", "gspo_token", "sapo", "ppo", "vc_ppo"):  # no budget recorded (docs/)
        with pytest.raises(ValueError, match="scale=paper: .*sampling.max_new_tokens"):
            load(name, variant)
        variant += ",sampling.max_new_tokens=16384"
    config = load(name, variant)
    assert max(config.batch.response_buckets) >= config.sampling.max_new_tokens
    assert config.sampling.max_new_tokens >= 1024
    # The long-context model settings (base.PAPER_SCALE_MODEL), which a variant may override.
    assert (config.model.dtype, config.model.scan_layers, config.model.remat) == (
        "bfloat16",
        True,
        "full",
    )
    assert config.model.attention == "auto"
    # MoE: the blocked dispatch in blocks of 4,096 copies for training, ragged decoding.
    assert (
        config.model.moe_dispatch,
        config.model.moe_block_size,
        config.model.moe_decode_dispatch,
    ) == ("blocked", 4096, "ragged")
    assert load(name, variant + ",model.remat=save_dots").model.remat == "save_dots"


def test_variant_values_may_be_tuples():
    assert base.split_variant("a=1,b=(16, 32),c=[1,2],,d={'x': 1}") == [
        "a=1",
        "b=(16, 32)",
        "c=[1,2]",
        "d={'x': 1}",
    ]
    config = load(
        "sapo",
        "batch.response_buckets=(8,24),batch.prompt_buckets=(16,),sampling.max_new_tokens=24",
    )
    assert config.batch.response_buckets == (8, 24) and config.batch.prompt_buckets == (16,)
    assert config.sampling.max_new_tokens == 24
    assert base.split_variant("a='x,y',b=\"(,\",c=1") == ["a='x,y'", 'b="(,"', "c=1"]
    for bad in ("a=(1,2", "a=1)", "a='x", "a=[1,2)"):
        with pytest.raises(ValueError, match="config variant"):
            base.split_variant(bad)


def test_a_run_config_json_loads_back_with_its_types(tmp_path):
    config = load(
        "vapo", "batch.response_buckets=(8,24),sampling.max_new_tokens=24,algo.tis_cap=2.0"
    )
    path = tmp_path / "config.json"
    path.write_text(config.to_json_best_effort(indent=2, sort_keys=True))
    loaded = base.load_run_config(str(path))
    assert loaded.to_dict() == config.to_dict()
    assert loaded.batch.response_buckets == (8, 24) and loaded.algo.gae_lambda_critic == 1.0
    with pytest.raises(AttributeError):
        loaded.algo.tau_nge = 1.0  # locked: no new fields
    path.write_text(json.dumps({"algo": {"tau_nge": 1.0}}))
    with pytest.raises(KeyError, match="algo.tau_nge"):
        base.load_run_config(str(path))


def test_unknown_or_bad_fields_are_named():
    with pytest.raises(KeyError, match="algo.tau_ng"):
        load("sapo", "algo.tau_ng=1.1")
    with pytest.raises(KeyError, match="algoo"):
        load("sapo", "algoo.tau_neg=1.1")
    with pytest.raises(ValueError, match="algo.method"):
        load("sapo", "algo.method=sappo")
    with pytest.raises(ValueError, match="routing_replay"):
        load("grpo", "algo.routing_replay=R4")
    with pytest.raises(ValueError, match="n_minibatches"):
        load("grpo", "batch.n_minibatches=3")
    with pytest.raises(ValueError, match="scale"):
        load("grpo", "scale=huge")
    with pytest.raises(TypeError):
        load("sapo").algo.tau_neg = "high"
    with pytest.raises(ValueError, match="reward.max_len .* must be <= sampling.max_new_tokens"):
        load("dapo", "reward.max_len=32,sampling.max_new_tokens=24")
    with pytest.raises(ValueError, match="decode_segments"):
        load("grpo", "sampling.decode_segments=25")
    assert load("grpo", "sampling.decode_segments=4").sampling.decode_segments == 4
    with pytest.raises(ValueError, match="sampling.temperature must be > 0"):
        load("grpo", "sampling.temperature=0.0")
    # Two corrections that cannot combine: the TIS weight against pi_old = behaviour is 1.
    with pytest.raises(ValueError, match="tis_cap .* old_log_probs='sampler'"):
        load("magistral_async", "algo.tis_cap=2.0,algo.old_log_probs='sampler'")
    with pytest.raises(ValueError, match="routing_replay='R2' needs"):
        load("grpo", "algo.routing_replay='R2',algo.old_log_probs='sampler'")
    # Rollout correction: levels, bounds, and pi_old from the trainer.
    with pytest.raises(ValueError, match="algo.tis_level"):
        load("grpo", "algo.tis_cap=2.0,algo.tis_level=seq")
    with pytest.raises(ValueError, match="algo.rs_level"):
        load("grpo", "algo.rs_level=geo,algo.rs_upper=1.001")
    with pytest.raises(ValueError, match="rs_level='token' needs algo.rs_upper"):
        load("grpo", "algo.rs_level=token")
    with pytest.raises(ValueError, match="rs_upper / rs_lower are set but algo.rs_level is None"):
        load("grpo", "algo.rs_upper=2.0")
    with pytest.raises(ValueError, match="rs_lower"):
        load("grpo", "algo.rs_level=sequence,algo.rs_upper=2.0,algo.rs_lower=3.0")
    with pytest.raises(ValueError, match="rs_veto must be > 0"):
        load("grpo", "algo.rs_veto=0.0")
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        load("grpo", "algo.tis_cap=-1.0")
    with pytest.raises(ValueError, match="rs_level / rs_veto .*old_log_probs='trainer'"):
        load("grpo", "algo.rs_veto=1e-4,algo.old_log_probs=sampler")
    # The loop's cadences: a zero would divide by zero mid-run.
    for field, value in (
        ("train.checkpoint_every", 0),
        ("train.log_every", 0),
        ("train.eval_every", -1),
        ("eval.batch_size", 0),
        ("sft.checkpoint_every", -5),
        ("eval.num_prompts", -1),
    ):
        with pytest.raises(ValueError, match=f"config.{field} must be an int >= "):
            load("grpo", f"{field}={value}")
    with pytest.raises(ValueError, match="keep_checkpoints must be an int >= 1"):
        load("grpo", "train.keep_checkpoints=0")
    with pytest.raises(ValueError, match="sft.overlong_response"):
        load("grpo", "sft.overlong_response=cut")
    config = load("grpo", "algo.rs_level=geometric,algo.rs_upper=1.001,algo.rs_veto=1e-4")
    assert (config.algo.rs_level, config.algo.rs_upper, config.algo.rs_lower) == (
        "geometric",
        1.001,
        None,
    )


def test_a_field_given_twice_or_a_misspelled_section_in_a_variant_is_named():
    for variant, field in (
        ("optim.lr=1e-3,algo.tau_neg=1.1,optim.lr=2e-3", "optim.lr"),
        ("model=tiny_dense,model.preset=tiny_moe", "model.preset"),
        ("algo.tau_neg=1.1, algo.tau_neg =1.2", "algo.tau_neg"),
    ):
        with pytest.raises(ValueError) as error:
            base.check_variant_fields(variant)  # --config (tests/experiments/test_cli.py)
        assert str(error.value) == (
            f"config variant {variant!r}: {field} is given twice (name each field once)"
        )
    base.check_variant_fields("model=tiny_dense,optim.lr=1e-3,algo.tau_neg=1.1")
    # Composed variants (experiments/ablate.py: an arm's, then the command line's): the
    # later value wins.
    assert load("sapo", "optim.lr=1e-3,optim.lr=2e-3").optim.lr == 2e-3
    # A section that does not exist: named, with the closest section when there is one, or
    # the list of sections; a field of a section: its closest field.
    with pytest.raises(KeyError) as error:
        load("sapo", "optimizer.lr=1e-3")
    assert error.value.args[0] == (
        "unknown config field 'optimizer.lr': no section 'optimizer' (did you mean 'optim'?)"
    )
    with pytest.raises(KeyError) as error:
        load("sapo", "trainer.num_iterations=3")
    assert error.value.args[0] == (
        "unknown config field 'trainer.num_iterations': no section 'trainer' (did you mean "
        "'train'?)"
    )
    with pytest.raises(KeyError) as error:
        load("sapo", "xyz.lr=1e-3")
    assert error.value.args[0].startswith(
        "unknown config field 'xyz.lr': no section 'xyz' (sections: algo, async_mode, batch, "
    )
    with pytest.raises(KeyError) as error:
        load("sapo", "optim.learning_rate=1e-3")
    assert error.value.args[0] == "unknown config field 'optim.learning_rate'"
    with pytest.raises(KeyError) as error:
        load("sapo", "optim.epss=1e-3")
    assert error.value.args[0] == "unknown config field 'optim.epss' (did you mean 'optim.eps'?)"


def test_command_line_overrides_through_config_flags():
    argv = [
        "prog",
        "--config=configs/sapo.py:model=tiny_dense",
        "--config.algo.tau_neg=1.1",
        "--config.batch.n_prompts=4",
    ]
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file(
        "config", None, "recipe", flag_values=values, sys_argv=argv
    )
    values(argv)
    config = holder.value
    assert config.model.preset == "tiny_dense" and config.algo.tau_neg == 1.1
    assert config.batch.n_prompts == 4
    # A field whose default is None (a typed placeholder) takes a value too.
    argv = ["prog", "--config=configs/ppo.py", "--config.algo.gae_lambda_critic=1.0"]
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file(
        "config", None, "recipe", flag_values=values, sys_argv=argv
    )
    values(argv)
    assert holder.value.algo.gae_lambda_critic == 1.0
    argv = ["prog", "--config=configs/sapo.py", "--config.algo.tau_ng=1.1"]
    values = flags.FlagValues()
    holder = config_flags.DEFINE_config_file(
        "config", None, "recipe", flag_values=values, sys_argv=argv
    )
    with pytest.raises(Exception, match="tau_ng"):
        values(argv)
        holder.value


def test_mesh_block_has_the_mesh_axes_and_checks_its_sizes():
    config = load("grpo", "mesh.fsdp=2,mesh.tensor=2")
    assert set(config.mesh.keys()) == set(MESH_AXES)
    assert dict(config.mesh) == {"data": -1, "fsdp": 2, "tensor": 2, "expert": 1}
    assert dict(load("sapo").mesh) == {
        "data": -1,
        "fsdp": 1,
        "tensor": 1,
        "expert": 1,
    }  # one CPU: as before
    with pytest.raises(ValueError, match="config.mesh.fsdp must be a positive int"):
        load("grpo", "mesh.fsdp=0")
    with pytest.raises(ValueError, match="config.mesh.expert must be a positive int"):
        load("grpo", "mesh.expert=True")
    with pytest.raises(
        ValueError, match=r"at most one axis may be -1, got -1 for \['data', 'tensor'\]"
    ):
        load("grpo", "mesh.tensor=-1")
    with pytest.raises(KeyError, match="mesh.model"):
        load("grpo", "mesh.model=2")
    with pytest.raises(
        ValueError, match="config.mesh: .* 1 devices are not divisible by 4"
    ):  # 1 CPU
        build.make_mesh(config)
