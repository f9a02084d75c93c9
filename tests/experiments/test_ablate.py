"""The papers' ablations (configs/ablations.py, experiments/ablate.py) and checkpoint
evaluation (experiments/eval.py): every arm builds and, at the CPU defaults, in the demo
setting and at paper scale, differs from its ablation's first arm only in the fields its
variant names and, across recipes, those the ablation declares it compares (geometry and
generation budget shared); a tiny sweep trains, summarises what its runs logged, and is
not retrained when rerun; a checkpoint evaluated afterwards gives the figures of the
training-time evaluation at that step."""

import json
import math
import os

import numpy as np
import pytest

from configs import ablations
from configs import demo as demo_recipe
from configs.ablations import (
    ABLATIONS,
    Ablation,
    Arm,
    demo_setting,
    get_ablation,
    shared_field,
)
from configs.base import load_run_config
from experiments import ablate
from experiments.eval import evaluate_checkpoint
from experiments.ledger import Ledger
from policyopt.config import typed
from policyopt.data.tasks import TASKS
from policyopt.metrics import read_jsonl
from policyopt.rl.update.learner import LossSettings
from tests.rl.test_trainer import tiny


def _named_fields(variant):
    return {item.split("=")[0] for item in variant.split(",") if item}


# The scales an ablation is built at: (common variant, setting). "paper" alone is refused
# where the reference recipe's paper records no generation budget; "paper_budget" names one.
SCALES = {
    "default": ("", None),
    "demo": ("", demo_setting),
    "paper": ("scale=paper", None),
    "paper_budget": ("scale=paper,sampling.max_new_tokens=20480", None),
}
# The reference recipes whose papers record no generation budget (docs/algorithms.md).
NO_PAPER_BUDGET = ("gspo", "gspo_token", "sapo", "ppo", "vc_ppo")


def _compared(field, compares):
    return any(field == c or (c.endswith(".") and field.startswith(c)) for c in compares)


@pytest.mark.parametrize("scale", sorted(SCALES))
@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_arms_differ_only_in_the_methods_they_compare(name, scale):
    """At every scale an ablation accepts, each arm's resolved config differs from the
    first arm's only in the fields the two arms' variants name and, for an arm of another
    recipe, those ``Ablation.compares`` declares (never geometry, budget, model, task or
    loop: SHARED_SECTIONS); ``train.num_iterations`` only by the value-pretraining
    iterations that come on top. Dr. GRPO's constant is the shared budget."""
    ablation = get_ablation(name)
    variant, setting = SCALES[scale]
    if scale == "paper" and ablation.reference_recipe in NO_PAPER_BUDGET:
        with pytest.raises(ValueError, match=f"ablation {name!r}.*sampling.max_new_tokens"):
            ablate.arm_config(ablation, ablation.arms[0].label, 0, variant, setting)
        return
    first = ablation.arms[0]
    configs = {
        arm.label: ablate.arm_config(ablation, arm.label, 0, variant, setting)
        for arm in ablation.arms
    }
    for arm in ablation.arms:
        assert not {f for f in _named_fields(arm.variant) if shared_field(f)}, arm
        diff = ablate.config_diff(configs[first.label], configs[arm.label])
        named = _named_fields(arm.variant) | _named_fields(first.variant)
        compares = ablation.compares if arm.recipe != first.recipe else ()
        warmups = [
            diff[f]
            for f in ("critic.pretrain_iterations", "critic.reward_model_iterations")
            if f in diff
        ]
        if warmups:  # the critic's warm-up comes on top of the policy's iterations
            it_a, it_b = diff["train.num_iterations"]
            assert it_b - it_a == sum(b - a for a, b in warmups), (arm, diff)
            del diff["train.num_iterations"]
        stray = {k: v for k, v in diff.items() if k not in named and not _compared(k, compares)}
        assert not stray, (name, scale, arm.label, stray)
        if arm is not first:
            assert diff, f"arm {arm.label} of {name} equals the first arm"
        config = configs[arm.label]
        # Dr. GRPO's normalising constant follows the shared generation budget.
        if config.algo.aggregation == "seq_mean_token_sum_norm":
            assert LossSettings.of(typed(config)).max_len == config.sampling.max_new_tokens


def test_paper_scale_arms_take_the_reference_paper_geometry():
    """Hand-checked against the recipes' paper values (docs/algorithms.md): every arm of a
    cross-recipe ablation takes its reference paper's geometry and budget at scale=paper,
    not its own paper's (the GRPO arms used to keep GRPO's 64 x 16 and 1024 tokens)."""
    expected = {  # (group_size, n_prompts, n_minibatches, max_new_tokens)
        # Dr. GRPO's 8 x 128 prompts and 3000 tokens, one update per batch.
        "dr_grpo": ("scale=paper", (8, 128, 1, 3000)),
        # GSPO records no batch size (the CPU 8 x 8) nor budget; 4 minibatches (GSPO §5.1).
        "gspo": ("scale=paper,sampling.max_new_tokens=16384", (8, 8, 4, 16384)),
        "routing_replay": ("scale=paper,sampling.max_new_tokens=16384", (8, 8, 4, 16384)),
        # DAPO's 512 x 16 and 20480 tokens; 4 minibatches for the clips (OFF_POLICY).
        "objectives": ("scale=paper", (16, 512, 4, 20480)),
    }
    for name, (variant, geometry) in expected.items():
        ablation = get_ablation(name)
        for arm in ablation.arms:
            config = ablate.arm_config(ablation, arm.label, 0, variant)
            b = config.batch
            assert (
                b.group_size,
                b.n_prompts,
                b.n_minibatches,
                config.sampling.max_new_tokens,
            ) == geometry, (name, arm.label)
            assert (config.model.preset, config.optim.lr) == ("qwen3_30b_a3b", 1e-6), (
                name,
                arm.label,
            )
    dr = ablate.arm_config(get_ablation("dr_grpo"), "dr_grpo", 0, "scale=paper")
    assert (dr.algo.max_len, LossSettings.of(typed(dr)).max_len) == (None, 3000)
    # A budget in the common variant beats the reference's paper, for every arm, and moves
    # Dr. GRPO's constant with it; in the objectives ablation too (DAPO's geometry).
    for label in ("grpo", "dr_grpo"):
        config = ablate.arm_config(
            get_ablation("dr_grpo"), label, 0, "scale=paper,sampling.max_new_tokens=2048"
        )
        assert (config.sampling.max_new_tokens, config.batch.n_prompts) == (2048, 128)
    assert LossSettings.of(typed(config)).max_len == 2048
    dr = ablate.arm_config(get_ablation("objectives"), "dr_grpo", 0, "scale=paper")
    assert LossSettings.of(typed(dr)).max_len == 20480 and dr.batch.n_prompts == 512
    # Magistral's own 32768 tokens and buckets give way to the reference's.
    magistral = ablate.arm_config(get_ablation("objectives"), "magistral", 0, "scale=paper")
    assert max(magistral.batch.response_buckets) == 20480 and magistral.reward.language_bonus
    # The reference's paper refuses the variant: the error names the ablation and the recipe.
    with pytest.raises(ValueError, match="ablation 'objectives'.*configs/dapo.py.*reward.max_len"):
        ablate.arm_config(
            get_ablation("objectives"), "sapo", 0, "scale=paper,sampling.max_new_tokens=4096"
        )


def test_compares_may_not_name_shared_fields():
    with pytest.raises(ValueError, match="'bad'.*batch.group_size"):
        Ablation(
            "bad", "claim", (Arm("a", "grpo"), Arm("b", "gspo")), compares=("batch.group_size",)
        )


@pytest.mark.parametrize("scale", sorted(SCALES))
def test_routing_replay_grpo_arms_are_the_gspo_papers_baseline(scale):
    """GSPO (2507.18071; docs/algorithms.md): its GRPO baseline clips at 0.2 / 0.27, without KL."""
    ablation = get_ablation("routing_replay")
    variant, setting = SCALES[scale]
    if scale == "paper":
        variant += ",sampling.max_new_tokens=16384"
    for label in ("grpo", "grpo_R2", "grpo_R3"):
        algo = ablate.arm_config(ablation, label, 0, variant, setting).algo
        assert (algo.method, algo.clip_low, algo.clip_high, algo.kl_beta) == ("ppo", 0.2, 0.27, 0.0)
    gspo = get_ablation("gspo")
    assert (
        ablate.arm_config(gspo, "grpo", 0).algo.to_dict()
        == ablate.arm_config(ablation, "grpo", 0).algo.to_dict()
    )


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_every_arm_builds_with_the_shared_variant_and_common_variants(name):
    ablation = get_ablation(name)
    labels = [arm.label for arm in ablation.arms]
    assert len(set(labels)) == len(labels)
    assert all(label.replace("_", "").replace("-", "").isalnum() for label in labels)
    for arm in ablation.arms:
        config = ablate.arm_config(ablation, arm.label, 1, "model=tiny_dense")
        assert config.seed == 1 and config.model.preset == "tiny_dense"
        # Every arm builds in the demo setting (a field named *_scale is not scale=paper).
        in_demo = ablate.arm_config(ablation, arm.label, 0, "", demo_setting)
        if "n_minibatches=4" in ablation.variant:  # shared by every arm, setting or not
            assert config.batch.n_minibatches == 4
            assert in_demo.batch.n_minibatches == 4
        if "n_minibatches=4" in ablation.variant:  # the paper geometry does not undo it
            paper = "scale=paper,sampling.max_new_tokens=20480"  # not every paper records one
            assert ablate.arm_config(ablation, arm.label, 0, paper).batch.n_minibatches == 4
    with pytest.raises(ValueError, match="no arm"):
        ablate.arm_config(ablation, "no-such-arm", 0)


def test_the_demo_setting_sits_under_the_variants():
    """--setting demo: the demo's task, geometry and SFT start; the recipe's algorithm; the
    arm's and the common variants still win; scale=paper is refused with it."""
    ablation = get_ablation("vapo")
    config = ablate.arm_config(
        ablation, "no_nll", 2, "train.num_iterations=30,batch.n_prompts=4", demo_setting
    )
    demo = demo_recipe.get_config()
    assert config.init_checkpoint == "runs/demo/sft/checkpoints" and config.seed == 2
    assert (config.sampling.max_new_tokens, config.batch.response_buckets) == (
        demo.sampling.max_new_tokens,
        demo.batch.response_buckets,
    )
    assert config.task.wrong_procedure_fraction == demo.task.wrong_procedure_fraction
    assert (config.algo.advantage, config.algo.gae_length_adaptive) == ("gae", True)
    # The critic keeps VAPO's 2:1 ratio to the actor's learning rate (the demo's 1e-3).
    assert (config.optim.lr, config.critic.lr) == (demo.optim.lr, pytest.approx(2 * demo.optim.lr))
    assert config.algo.nll_coef == 0.0  # the arm's variant
    # The common variant; the value warm-up iterations come on top of 30 policy iterations.
    warmup = ablations.CRITIC_PRETRAIN_ITERATIONS
    assert (config.train.num_iterations, config.batch.n_prompts) == (30 + warmup, 4)
    no_warmup = ablate.arm_config(ablation, "no_warmup", 2, "train.num_iterations=30", demo_setting)
    assert (no_warmup.critic.pretrain_iterations, no_warmup.train.num_iterations) == (0, 30)
    # A reward-model initialisation's iterations come on top too.
    with_rm = ablate.arm_config(
        ablation,
        "vapo",
        2,
        "train.num_iterations=30,critic.reward_model_iterations=3",
        demo_setting,
    )
    assert with_rm.train.num_iterations == 30 + 3 + warmup
    # The demo turns routing metrics off for speed; the summary's volatility column needs them.
    assert config.train.routing_metrics
    # It saves only at its end (1000); a sweep's run killed outright resumes from its last
    # 10 iterations, in every setting (the cadence is not in the ledger's key).
    assert demo.train.checkpoint_every == 1000
    assert config.train.checkpoint_every == ablations.SWEEP_CHECKPOINT_EVERY == 10
    for name, setting in ablations.SETTINGS.items():
        arm = ablate.arm_config(get_ablation("routing_replay"), "grpo", 0, "", setting)
        assert arm.train.checkpoint_every <= ablations.SWEEP_CHECKPOINT_EVERY, name
    with pytest.raises(ValueError, match="scale=paper"):
        ablate.arm_config(ablation, "vapo", 0, "scale=paper", demo_setting)


def test_a_run_directory_of_another_config_is_refused(tmp_path):
    """A finished run is skipped only if it was trained with the arm's config: a sweep
    rerun with another setting or variant in the same workdir must not summarise (or
    resume) the old runs as its own. More iterations extend a run."""
    ablation = get_ablation("sapo_tau")
    config = ablate.arm_config(ablation, "equal", 0)
    run_dir = tmp_path / "equal" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
    (run_dir / ablate.DONE_FILE).write_text(
        json.dumps({"iterations": config.train.num_iterations, "wall_s": 1.0})
    )
    # The logs of a finished run: every iteration, and the final evaluation.
    last = config.train.num_iterations
    (run_dir / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": step, "reward/mean": 0.5}) + "\n" for step in range(1, last + 1)
        )
    )
    (run_dir / "eval.jsonl").write_text(
        "".join(json.dumps({"step": step, "eval/pass@1": 0.5}) + "\n" for step in (0, last))
    )
    assert ablate._finished(str(run_dir), config)["wall_s"] == 1.0
    assert (
        ablate._finished(
            str(run_dir),
            ablate.arm_config(
                ablation, "equal", 0, f"train.num_iterations={config.train.num_iterations + 10}"
            ),
        )
        is None
    )
    # The loop's cadence and metrics (train.*) do not change what is trained.
    assert (
        ablate._finished(
            str(run_dir),
            ablate.arm_config(
                ablation, "equal", 0, "train.routing_metrics=False,train.eval_every=3"
            ),
        )["wall_s"]
        == 1.0
    )
    with pytest.raises(ValueError, match="optim.lr"):
        ablate._finished(str(run_dir), ablate.arm_config(ablation, "equal", 0, "optim.lr=0.5"))
    with pytest.raises(ValueError, match="init_checkpoint"):
        ablate._finished(str(run_dir), ablate.arm_config(ablation, "equal", 0, "", demo_setting))
    # A record written by an older library (the derived value where today's default is None)
    # and another spelling of the same path are the same settings; another format is not.
    logged = json.loads((run_dir / "config.json").read_text())
    assert logged["reward"]["answer_format"] is None
    logged["reward"]["answer_format"] = TASKS[config.task.name].answer_format
    if logged.get("init_checkpoint"):
        os.symlink(os.path.dirname(logged["init_checkpoint"]), tmp_path / "start")
        logged["init_checkpoint"] = str(
            tmp_path / "start" / os.path.basename(logged["init_checkpoint"])
        )
    (run_dir / "config.json").write_text(json.dumps(logged))
    assert ablate._finished(str(run_dir), config)["wall_s"] == 1.0
    logged["reward"]["answer_format"] = "gsm8k"
    (run_dir / "config.json").write_text(json.dumps(logged))
    with pytest.raises(ValueError, match="answer_format"):
        ablate._finished(str(run_dir), config)
    (run_dir / "config.json").write_text(config.to_json_best_effort(indent=2, sort_keys=True))
    # A run trained longer than the sweep asks would be summarised as the shorter one.
    with pytest.raises(ValueError, match="more than"):
        ablate._finished(
            str(run_dir),
            ablate.arm_config(
                ablation, "equal", 0, f"train.num_iterations={config.train.num_iterations - 1}"
            ),
        )


def test_unknown_ablation_names_the_known_ones():
    with pytest.raises(ValueError, match="sapo_tau"):
        get_ablation("sapo_tau_typo")


def _shrink(config):
    """tests.rl.test_trainer.tiny's settings on an ablation arm's config."""
    small = tiny("sapo", model="tiny_dense")
    config.unlock()
    for section in ("batch", "sampling", "task", "eval", "train", "dynamic_sampling"):
        for key, value in small[section].items():
            config[section][key] = value
    config.model.preset, config.model.num_layers = small.model.preset, small.model.num_layers
    config.optim.lr = small.optim.lr
    config.lock()
    return config


def test_a_tiny_sweep_trains_summarises_resumes_and_evaluates(tmp_path, monkeypatch):
    ablation = Ablation(
        "tiny_tau",
        "SAPO temperatures, shrunk",
        (
            Arm("neg_gt_pos", "sapo", "algo.tau_pos=1.0,algo.tau_neg=1.05"),
            Arm("neg_lt_pos", "sapo", "algo.tau_pos=1.05,algo.tau_neg=1.0"),
        ),
    )
    workdir = str(tmp_path / "sweep")
    summary = ablate.run_ablation(ablation, workdir, seeds=(0,), configure=_shrink, tail=2)
    assert [a["arm"] for a in summary["arms"]] == ["neg_gt_pos", "neg_lt_pos"]
    first, second = summary["arms"]
    assert first["differs_from_first_arm"] == {}
    assert second["differs_from_first_arm"] == {
        "algo.tau_neg": [1.05, 1.0],
        "algo.tau_pos": [1.0, 1.05],
    }
    for entry in summary["arms"]:
        (run,) = entry["runs"]
        run_dir = os.path.join(workdir, entry["arm"], "seed0")
        assert run["run_dir"] == run_dir and run["iterations"] == 2
        with open(os.path.join(run_dir, "config.json")) as f:
            logged = json.load(f)["algo"]
        assert (
            [logged["tau_pos"], logged["tau_neg"]] == [1.0, 1.05] if entry is first else [1.05, 1.0]
        )
        evals = read_jsonl(os.path.join(run_dir, "eval.jsonl"))
        rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        assert (
            run["pass@1_start"] == evals[0]["eval/pass@1"]
            and run["pass@1_end"] == evals[-1]["eval/pass@1"]
        )
        assert run["eval_steps"] == [0, 2] and (run["start"], run["seed"]) == (0, 0)
        assert 0 < run["cpu_s"] and 0 < run["wall_s"]  # the trainer's CPU seconds, its time
        assert run["regime"] == {  # tests.rl.test_trainer.tiny's
            "optim.lr": 0.01,
            "train.num_iterations": 2,
            "batch.n_prompts": 2,
            "batch.group_size": 4,
            "batch.n_minibatches": 1,
            "batch.epochs": 1,
            "sampling.max_new_tokens": 6,
        }
        train_rows = [r for r in rows if "reward/mean" in r]
        assert [r["step"] for r in train_rows] == [1, 2]
        assert run["reward/mean"] == pytest.approx(np.mean([r["reward/mean"] for r in train_rows]))
        assert entry["pass@1_end"] == {"mean": run["pass@1_end"], "std": 0.0}
    table = (tmp_path / "sweep" / "summary.md").read_text()
    assert "| neg_lt_pos | sapo |" in table and summary["claim"] in table
    assert "| wall s | CPU s |" in table
    assert json.loads((tmp_path / "sweep" / "summary.json").read_text())["ablation"] == "tiny_tau"
    assert os.path.getsize(summary["curves"]) > 0

    # Rerun: finished runs are summarised, not trained again.
    def fail(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(ablate, "run_rl", fail)
    again = ablate.run_ablation(
        ablation, workdir, seeds=(0,), configure=_shrink, tail=2, plot=False
    )
    assert [a["runs"][0]["pass@1_end"] for a in again["arms"]] == [
        a["runs"][0]["pass@1_end"] for a in summary["arms"]
    ]
    with pytest.raises(ValueError, match="none of arms"):
        ablate.run_ablation(ablation, workdir, arms=["typo"], configure=_shrink)
    # A seed named twice would summarise its runs twice (means, and pairs in a verdict).
    with pytest.raises(ValueError, match=r"run_ablation: seed 0 is named twice \(seeds \[0, 0\]\)"):
        ablate.run_ablation(ablation, workdir, seeds=(0, 0), configure=_shrink)

    # experiments/eval.py on the final checkpoint reproduces the training-time evaluation.
    run_dir = os.path.join(workdir, "neg_lt_pos", "seed0")
    config = _shrink(ablate.arm_config(ablation, "neg_lt_pos", 0))
    result = evaluate_checkpoint(config, run_dir)
    logged = read_jsonl(os.path.join(run_dir, "eval.jsonl"))[-1]
    assert result["step"] == 2
    for key in ("eval/pass@1", "eval/length_mean", "eval/num_prompts"):
        assert result[key] == logged[key], key
    earlier = evaluate_checkpoint(config, run_dir, step=1, num_prompts=4, k=2)
    assert earlier["step"] == 1 and earlier["eval/num_prompts"] == 4
    assert 0 <= earlier["eval/mean@2"] <= earlier["eval/pass@2"] <= 1
    with pytest.raises(ValueError, match="no checkpoint at step 7"):
        evaluate_checkpoint(config, run_dir, step=7)
    with pytest.raises(ValueError, match="num_prompts"):
        evaluate_checkpoint(config, run_dir, num_prompts=0)
    # No recipe string rebuilds a configured arm: the run's own config.json does.
    rebuilt = load_run_config(os.path.join(run_dir, "config.json"))
    assert ablate.config_diff(config, rebuilt) == {}
    assert evaluate_checkpoint(rebuilt, run_dir)["eval/pass@1"] == logged["eval/pass@1"]
    # Evaluation may change what training may not (another held-out set, budget, dispatch).
    rebuilt.unlock()
    rebuilt.task.num_test, rebuilt.sampling.max_new_tokens = 16, rebuilt.sampling.max_new_tokens - 1
    assert evaluate_checkpoint(rebuilt, run_dir)["step"] == 2


def test_a_partial_run_is_resumed_never_counted(tmp_path, monkeypatch):
    """A sweep stopped mid-arm (here the second SFT start's run, whose trainer returns after
    1 of its 2 iterations without naming a signal) exits without a finished record; a
    record over shorter logs is not trusted; the rerun resumes that run alone and trains
    its missing iteration."""
    ablation = Ablation("tiny", "one arm", (Arm("only", "sapo"),))
    workdir = tmp_path / "sweep"
    real_run_rl = ablate.run_rl
    trained = []

    def stops_early(config, run_dir, **kwargs):
        trained.append(os.path.basename(run_dir))
        if os.path.basename(run_dir) == "start1_seed0":
            return real_run_rl(config, run_dir, num_iterations=1, **kwargs)
        return real_run_rl(config, run_dir, **kwargs)

    monkeypatch.setattr(ablate, "run_rl", stops_early)
    sweep = dict(seeds=(0,), starts={0: None, 1: None}, configure=_shrink, plot=False)
    with pytest.raises(SystemExit, match=r"only, start1_seed0: stopped at iteration 1 of 2"):
        ablate.run_ablation(ablation, str(workdir), **sweep)
    assert trained == ["seed0", "start1_seed0"]
    partial = workdir / "only" / "start1_seed0"
    assert (workdir / "only" / "seed0" / ablate.DONE_FILE).exists()
    assert not (partial / ablate.DONE_FILE).exists() and not (workdir / "summary.json").exists()
    assert [r["step"] for r in read_jsonl(partial / "metrics.jsonl") if "reward/mean" in r] == [1]
    # A finished record over a run whose logs stop at iteration 1 is a partial run.
    config = _shrink(ablate.arm_config(ablation, "only", 0))
    (partial / ablate.DONE_FILE).write_text(json.dumps({"iterations": 2, "wall_s": 1.0}))
    assert ablate._finished(str(partial), config) is None

    trained.clear()
    monkeypatch.setattr(
        ablate, "run_rl", lambda *a, **k: trained.append(a[1]) or real_run_rl(*a, **k)
    )
    summary = ablate.run_ablation(ablation, str(workdir), **sweep)
    assert trained == [str(partial)]  # the finished start-0 run is not trained again
    assert summary["starts"] == [0, 1]
    runs = summary["arms"][0]["runs"]
    assert [(r["start"], r["seed"], r["iterations"]) for r in runs] == [(0, 0, 2), (1, 0, 2)]
    rows = [r["step"] for r in read_jsonl(partial / "metrics.jsonl") if "reward/mean" in r]
    assert rows == [1, 2] and runs[1]["eval_steps"] == [0, 2]
    assert ablate._finished(str(partial), config)["iterations"] == 2
    # Its evaluation at the last iteration lost: not finished either.
    evals = read_jsonl(partial / "eval.jsonl")
    (partial / "eval.jsonl").write_text(json.dumps(evals[0]) + "\n")
    assert ablate._finished(str(partial), config) is None


def test_run_names_and_the_regime_of_a_critic_arm():
    assert [ablate.run_name(k, n) for k, n in ((0, 0), (0, 3), (1, 0), (2, 4))] == [
        "seed0",
        "seed3",
        "start1_seed0",
        "start2_seed4",
    ]
    # VC-PPO's critic iterations (of value pretraining) come on top of the policy's.
    config = ablate.arm_config(get_ablation("vc_ppo"), "vc_ppo", 0, "train.num_iterations=20")
    assert config.train.num_iterations == 20 + ablations.CRITIC_PRETRAIN_ITERATIONS
    assert ablate.regime_of(config)["train.num_iterations"] == 20
    with pytest.raises(ValueError, match="not both"):
        ablate.run_ablation(get_ablation("vc_ppo"), "unused", setting=demo_setting, starts={})


def test_a_critic_runs_warmup_figures_are_summarised(tmp_path):
    """A critic's explained variance after its warm-up is read from the policy's first
    iteration; the policy's lambda is averaged over the policy's iterations only."""
    rows = [
        {"step": 1, "critic/pretraining": 1.0, "critic/rollout_mc_explained_variance": -0.8},
        {"step": 2, "critic/pretraining": 1.0, "critic/rollout_mc_explained_variance": 0.1},
        {
            "step": 3,
            "critic/pretraining": 0.0,
            "critic/rollout_mc_explained_variance": 0.4,
            "advantages/lambda_policy_token_mean": 0.7,
        },
        {"step": 3, "eval/pass@1": 0.5},  # an evaluation's record, not an iteration's
        {
            "step": 4,
            "critic/pretraining": 0.0,
            "critic/rollout_mc_explained_variance": 0.6,
            "advantages/lambda_policy_token_mean": 0.8,
        },
    ]
    rows[0]["advantages/lambda_policy_token_mean"] = 0.1  # warm-up: left out of the mean
    with open(tmp_path / "eval.jsonl", "w") as f:
        f.write(json.dumps(rows[3]) + "\n")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    summary = ablate.summarise_run(str(tmp_path), tail=2)
    assert summary[ablate.WARMUP_EXPLAINED_VARIANCE] == 0.4
    assert summary["advantages/lambda_policy_token_mean"] == pytest.approx(0.75)
    assert summary["critic/rollout_mc_explained_variance"] == pytest.approx(0.5)
    # A run without a critic has neither figure.
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    summary = ablate.summarise_run(str(tmp_path), tail=2)
    assert ablate.WARMUP_EXPLAINED_VARIANCE not in summary
    assert "advantages/lambda_policy_token_mean" not in summary


def test_the_gate_weight_is_summarised_over_the_run_and_its_last_iterations(tmp_path):
    """SAPO's gate weight: ``loss/gate_mean_run`` over every iteration (its regime's
    diagnostic), ``loss/gate_mean`` over the last ``tail``."""
    gates = [0.9, 0.96, 0.99, 1.0]
    (tmp_path / "eval.jsonl").write_text("")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(
            json.dumps({"step": i + 1, "loss/gate_mean": g}) + "\n" for i, g in enumerate(gates)
        )
    summary = ablate.summarise_run(str(tmp_path), tail=2)
    assert summary["loss/gate_mean_run"] == pytest.approx(0.9625)
    assert summary["loss/gate_mean"] == pytest.approx(0.995)


def test_collapse_iteration_by_hand():
    """The first iteration whose 3-iteration mean training accuracy falls below half the
    first 3 iterations' mean; iterations + 1 (censored) when none does."""
    rows = [{"step": i + 1, "reward/accuracy": a} for i, a in enumerate([0.4, 0.5, 0.6, 0.5])]
    assert ablate.collapse_iteration(rows) == 5  # 0.5 mean at the start, never below 0.25
    rows += [{"step": 5, "reward/accuracy": 0.1}, {"step": 6, "reward/accuracy": 0.0}]
    # Means of 3: 0.5 (1-3), 0.533 (2-4), 0.4 (3-5), 0.2 (4-6) < 0.25 at iteration 6.
    assert ablate.collapse_iteration(rows) == 6
    # An iteration without the metric (no update) is skipped; too few values: censored.
    assert ablate.collapse_iteration([{"step": 1}, {"step": 2, "reward/accuracy": 0.0}]) == 3
    assert ablate.collapse_iteration([]) == 1


def test_sapo_grid_arms():
    labels = [a.label for a in get_ablation("sapo_grid").arms]
    assert labels == [
        "neg0p8", "neg1", "neg1p05", "neg1p25", "neg2",
        "pos0p8", "pos1p05", "pos1p25", "pos2", "grpo",
    ]  # fmt: skip
    config = ablate.arm_config(get_ablation("sapo_grid"), "pos1p25", 0)
    assert (config.algo.tau_pos, config.algo.tau_neg) == (1.25, 1.0)
    assert (config.batch.n_minibatches, config.batch.epochs) == (8, 2)
    grpo = ablate.arm_config(get_ablation("sapo_grid"), "grpo", 0)
    assert grpo.algo.method == "ppo" and grpo.algo.kl_beta == 0.0


def test_the_routing_share_is_pooled_over_a_run(tmp_path):
    """The sum of the routing parts over the sum of both parts, every iteration; by hand
    (0.01 + 0.03 + 0) / (0.1 + 0.1 + 0.8) = 0.04, where the mean of the per-iteration
    shares (0.1, 0.3, 0) would be 0.133."""
    rows = [
        {"step": 1, "routing/log_ratio_ms_routing": 0.01, "routing/log_ratio_ms_params": 0.09},
        {"step": 2, "routing/log_ratio_ms_routing": 0.03, "routing/log_ratio_ms_params": 0.07},
        {"step": 3, "routing/log_ratio_ms_routing": 0.0, "routing/log_ratio_ms_params": 0.8},
    ]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "eval.jsonl").write_text("")
    summary = ablate.summarise_run(str(tmp_path), tail=5)
    assert summary["routing/ratio_share_pooled"] == pytest.approx(0.04 / 1.0)
    # A run whose log-ratio never moved: the share is undefined (a missing value), not 0.
    still = [
        {**r, "routing/log_ratio_ms_routing": 0.0, "routing/log_ratio_ms_params": 0.0} for r in rows
    ]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in still)
    assert math.isnan(ablate.summarise_run(str(tmp_path), tail=5)["routing/ratio_share_pooled"])


def test_the_critic_ablations_arms():
    """vc_ppo: plain PPO without value pretraining, every other arm with the measured count,
    lambda_actor over the grid; vapo: the adaptive lambdas and their matched fixed controls."""
    vc = get_ablation("vc_ppo")
    pretrain = {
        a.label: ablate.arm_config(vc, a.label, 0).critic.pretrain_iterations for a in vc.arms
    }
    assert pretrain.pop("ppo") == 0
    assert set(pretrain.values()) == {ablations.CRITIC_PRETRAIN_ITERATIONS}
    lambdas = {
        label: ablate.arm_config(vc, label, 0).algo.gae_lambda
        for label in ("vc_ppo_lambda_090", "vc_ppo", "vc_ppo_lambda_099", "vc_ppo_lambda_1")
    }
    assert list(lambdas.values()) == [0.9, 0.95, 0.99, 1.0]
    vapo = {
        a.label: ablate.arm_config(get_ablation("vapo"), a.label, 0).algo
        for a in get_ablation("vapo").arms
    }
    assert (vapo["vapo"].gae_length_adaptive, vapo["vapo"].gae_alpha) == (True, 0.05)
    assert (vapo["vapo_rescaled"].gae_length_adaptive, vapo["vapo_rescaled"].gae_alpha) == (
        True,
        ablations.VAPO_RESCALED_ALPHA,
    )
    assert not vapo["fixed_matched"].gae_length_adaptive
    assert vapo["fixed_matched"].gae_lambda == ablations.VAPO_MATCHED_LAMBDA
    assert not vapo["fixed_matched_rescaled"].gae_length_adaptive
    assert vapo["fixed_matched_rescaled"].gae_lambda == ablations.VAPO_RESCALED_MATCHED_LAMBDA
    # The rescaled alpha puts the paper's lambda at 500 tokens (0.96) at the task's median (91).
    assert 1 - 1 / (ablations.VAPO_RESCALED_ALPHA * 91) == pytest.approx(0.96, abs=1e-3)


def _fake_run_rl(trained):
    """A trainer that logs a finished run (every iteration, the final evaluation) without
    training: ``run_ablation``'s bookkeeping alone."""

    def run_rl(config, run_dir, **kwargs):
        trained.append(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))
        last = config.train.num_iterations
        with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
            for step in range(1, last + 1):
                f.write(json.dumps({"step": step, "reward/accuracy": 0.5}) + "\n")
        with open(os.path.join(run_dir, "eval.jsonl"), "w") as f:
            for step in (0, last):
                f.write(json.dumps({"step": step, "eval/pass@1": 0.25}) + "\n")
        return {"iteration": last}

    return run_rl


def test_a_run_of_another_sft_start_is_refused_not_recorded_as_this_ones(tmp_path, monkeypatch):
    """A run directory trained from SFT start 0 as it was (identity "1-aa"), the start then
    trained again to other bits ("1-bb": its directory removed and rebuilt, same path, so
    the run's config is the same): the finished run is not this start's, and must be
    neither judged beside its runs nor recorded in the ledger under its identity."""
    ablation = Ablation("tiny", "one arm", (Arm("only", "sapo"),))
    trained = []
    monkeypatch.setattr(ablate, "run_rl", _fake_run_rl(trained))
    book = Ledger(str(tmp_path / "tiny.jsonl"))
    sweep = dict(seeds=(0,), plot=False, ledger=book)
    workdir = str(tmp_path / "sweep")
    summary = ablate.run_ablation(ablation, workdir, **sweep, start_ids={0: "1-aa"})
    assert len(trained) == 1 and summary["arms"][0]["runs"][0]["pass@1_end"] == 0.25
    assert [r["start_id"] for r in book.records] == ["1-aa"]
    again = ablate.run_ablation(ablation, workdir, **sweep, start_ids={0: "1-aa"})
    assert len(trained) == 1 and again["arms"][0]["runs"][0]["run_dir"] is not None
    with pytest.raises(ValueError, match=r"only/seed0 was trained from SFT start 0 as 1-aa"):
        ablate.run_ablation(ablation, workdir, **sweep, start_ids={0: "1-bb"})
    assert [r["start_id"] for r in Ledger(book.path).records] == ["1-aa"]
    # A start file cut off (the process killed as it wrote it) is named, not a bare
    # JSONDecodeError.
    start_file = os.path.join(workdir, "only", "seed0", ablate.START_FILE)
    with open(start_file, "w") as f:
        f.write('{"start_')
    with pytest.raises(ValueError, match=r"only/seed0/sft_start.json is not JSON"):
        ablate.run_ablation(ablation, workdir, **sweep, start_ids={0: "1-aa"})
    with open(start_file, "w") as f:
        json.dump({"start_id": "1-aa"}, f)
    # The new start's run recorded (on another machine): its record, not the directory.
    (record,) = book.records
    book.add("only", 0, 0, "1-bb", record["config"], Ledger.run_of(record))
    summary = ablate.run_ablation(ablation, workdir, **sweep, start_ids={0: "1-bb"})
    assert len(trained) == 1 and summary["arms"][0]["runs"][0]["run_dir"] is None


def test_judging_a_run_recorded_from_another_start_says_so(tmp_path, monkeypatch):
    """Judged (train=False) on a machine whose SFT start has other bits than the start the
    ledger's run was trained from: the run is not finished here, and the error says the
    ledger records it from the other start, not only that it is not finished."""
    ablation = Ablation("tiny", "one arm", (Arm("only", "sapo"),))
    monkeypatch.setattr(ablate, "run_rl", _fake_run_rl([]))
    book = Ledger(str(tmp_path / "tiny.jsonl"))
    sweep = dict(seeds=(0,), plot=False, ledger=book)
    ablate.run_ablation(ablation, str(tmp_path / "a"), **sweep, start_ids={0: "1-aa"})
    with pytest.raises(
        ValueError,
        match=r"seed0 is not finished .*/tiny.jsonl records it from SFT start 0 as 1-aa, "
        r"not as it is here \(1-bb\)",
    ):
        ablate.run_ablation(
            ablation, str(tmp_path / "b"), **sweep, start_ids={0: "1-bb"}, train=False
        )
