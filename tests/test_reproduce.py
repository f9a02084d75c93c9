"""experiments/reproduce.py: the verdict rule against hand-worked cases and scipy's
Student t, each check's per-seed quantity from a hand-built summary, unknown claims and
arms refused with the known ones, the SFT start's share of a variant, every claim's arms
built in their settings, and a tiny claim run end to end (SFT start cached, one update,
verdict.md and curves.png written, not retrained when rerun)."""

import importlib
import json
import math
import os

import pytest
from scipy import stats

from configs.ablations import SETTINGS
from experiments import ablate, reproduce
from policyopt.checkpoint import Checkpointer


def test_t_quantiles_match_scipy():
    for df, t in enumerate(reproduce._T975, start=1):
        assert t == pytest.approx(stats.t.ppf(0.975, df), abs=1e-3), df


def test_judge_hand_worked():
    # mean 0.6, std 0.1, h = 4.303 * 0.1 / sqrt(3) = 0.2484: 0.6 - 0.2484 > 0.
    got = reproduce.judge([0.5, 0.6, 0.7], 0.0)
    assert got["verdict"] == "supported"
    assert got["mean"] == pytest.approx(0.6) and got["std"] == pytest.approx(0.1)
    assert got["half_width"] == pytest.approx(4.303 * 0.1 / math.sqrt(3), rel=1e-6)
    assert got["effect"] == pytest.approx(0.6)
    assert reproduce.judge([-0.5, -0.6, -0.7], 0.0)["verdict"] == "contradicted"
    # mean 0.2 < h 0.2484: neither.
    assert reproduce.judge([0.1, 0.2, 0.3], 0.0)["verdict"] == "inconclusive"
    # Against a threshold: 0.08 +- 0.0124 (std 0.005) clears 0.05; 0.052 +- 0.0124 does not.
    assert reproduce.judge([0.075, 0.08, 0.085], 0.05)["verdict"] == "supported"
    assert reproduce.judge([0.047, 0.052, 0.057], 0.05)["verdict"] == "inconclusive"
    one = reproduce.judge([0.9], 0.0)
    assert one["verdict"] == "inconclusive" and one["half_width"] == math.inf
    assert reproduce.judge([], 0.0) == {"n": 0, "verdict": "not run"}
    assert reproduce.claim_verdict(["supported", "supported"]) == "supported"
    assert reproduce.claim_verdict(["supported", "inconclusive"]) == "inconclusive"
    assert reproduce.claim_verdict(["supported", "contradicted"]) == "contradicted"
    assert reproduce.claim_verdict([]) == "inconclusive"


def _run(end, start=0.5, clip=0.01):
    return {"pass@1_end": end, "pass@1_start": start, "loss/clip_frac": clip}


def test_check_values_per_seed():
    runs = {
        "a": {0: _run(0.7, clip=0.2), 1: _run(0.6, clip=0.1)},
        "b": {0: _run(0.5, clip=0.002), 1: _run(0.65, clip=0.001)},
    }
    Check = reproduce.Check
    assert Check("", "diff", "a", "b").values(runs, [0, 1]) == pytest.approx([0.2, -0.05])
    assert Check("", "gain", "a").values(runs, [0, 1]) == pytest.approx([0.2, 0.1])
    assert Check("", "value", "b", metric="loss/clip_frac").values(runs, [0, 1]) == [0.002, 0.001]
    assert Check("", "log10_ratio", "a", "b", metric="loss/clip_frac").values(
        runs, [0, 1]
    ) == pytest.approx([2.0, 2.0])
    # A seed an arm did not run, or a metric it did not log, is left out.
    assert Check("", "diff", "a", "b").values(runs, [0, 1, 2]) == pytest.approx([0.2, -0.05])
    assert Check("", "value", "a", metric="routing/volatility").values(runs, [0]) == []
    with pytest.raises(ValueError, match="Check.kind"):
        Check("", "ratio", "a", "b").values(runs, [0])


def test_unknown_claim_and_arm_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown claim 'nope'; known: routing_volatility, "):
        reproduce.get_claim("nope")
    claim = reproduce.get_claim("routing_replay")
    with pytest.raises(ValueError, match=r"no arm 'grpo_R4'; known: grpo, grpo_R2, grpo_R3, gspo"):
        reproduce.select_arms(claim, ["grpo", "grpo_R4"])
    assert reproduce.select_arms(claim, ["gspo"]) == ("gspo",)
    assert reproduce.select_arms(reproduce.get_claim("vapo_length_adaptive"), None) == (
        "vapo",
        "no_length_adaptive",
    )


@pytest.mark.parametrize("name", list(reproduce.CLAIMS))
def test_every_claim_builds_its_arms_in_its_setting(name):
    claim = reproduce.CLAIMS[name]
    for check in claim.checks:
        assert set(check.arms()) <= set(claim.arm_labels()), check.text
    for label in claim.arm_labels():
        config = ablate.arm_config(
            claim.ablation, label, 0, "", lambda c: SETTINGS[claim.setting](c, "ckpt")
        )
        assert config.model.preset == "moe_volatile" and config.init_checkpoint == "ckpt"
        assert config.train.routing_metrics
        if claim.setting == "testbed_long":
            assert (config.task.operators, config.sampling.max_new_tokens) == ("mod", 208)
            assert (config.task.min_steps, config.task.max_steps) == (1, 16)
            if config.algo.advantage == "gae":  # the critic starts as a reward model
                assert (config.critic.lr, config.critic.reward_model_iterations) == (3e-3, 10)
        else:
            assert (config.task.operators, config.sampling.max_new_tokens) == ("+", 20)


def test_the_sft_start_takes_the_variant_items_it_reads():
    """A longer task needs longer SFT buckets: the SFT start reads the task, model, sft and
    eval items and the sequence limits, not the RL ones."""
    variant = (
        "task.max_steps=32,sampling.max_new_tokens=416,batch.response_buckets=(128, 256, 416),"
        "batch.n_prompts=4,critic.lr=3e-3,sft.steps=5,sampling.temperature=0.7,model=moe_volatile"
    )
    assert reproduce.sft_variant(variant) == (
        "task.max_steps=32,sampling.max_new_tokens=416,batch.response_buckets=(128, 256, 416),"
        "sft.steps=5,model=moe_volatile"
    )
    assert reproduce.sft_variant("") == "" and reproduce.sft_variant("critic.lr=1") == ""
    config = importlib.import_module("configs.testbed_long").get_config(
        reproduce.sft_variant(variant)
    )
    assert (config.task.max_steps, config.batch.response_buckets) == (32, (128, 256, 416))
    assert config.batch.n_prompts != 4


def test_a_continued_sft_start_trains_its_parent_first(tmp_path, monkeypatch):
    """testbed_long32's start continues testbed_long's (``SFT_PARENT``): the parent is
    trained first, then the child resumes its step count on its own, longer task."""
    parent_config = importlib.import_module("configs.testbed_long").get_config

    def parent_two_steps(arg=None):  # ensure_sft's call; testbed_long32 calls it bare
        config = parent_config(arg)
        if arg:
            config.unlock()
            config.sft.steps = 2
            config.lock()
        return config

    monkeypatch.setattr(
        importlib.import_module("configs.testbed_long"), "get_config", parent_two_steps
    )
    variant = (
        "model.num_layers=1,sft.steps=3,sft.batch_size=4,task.num_train=64,task.num_test=8,"
        "eval.num_prompts=0,train.loggers=jsonl"
    )
    checkpoint = reproduce.ensure_sft("testbed_long32", str(tmp_path), variant)
    parent = tmp_path / "testbed_long" / "sft"
    child = tmp_path / "testbed_long32" / "sft"
    assert checkpoint == str(child / "checkpoints")
    assert "2" in os.listdir(parent / "checkpoints") and "3" in os.listdir(child / "checkpoints")
    # The child made one update (step 3) from the parent's step 2, at its own bucket.
    records = [json.loads(line) for line in (child / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3]
    with Checkpointer(checkpoint) as saved:
        logged = saved.meta()["config"]
    assert (logged["task.max_steps"], logged["sampling.max_new_tokens"]) == (32, 416)
    # Rerun: both are reused (finished), nothing is trained again.
    assert reproduce.ensure_sft("testbed_long32", str(tmp_path), variant) == checkpoint
    assert len((child / "metrics.jsonl").read_text().splitlines()) == 1


def test_another_setting_is_taken_and_an_unknown_one_refused(tmp_path):
    claim = reproduce.get_claim("vc_ppo")
    with pytest.raises(ValueError, match="unknown setting 'nope'; known: demo, testbed, "):
        reproduce.run_claim(claim, str(tmp_path), setting="nope")
    for label in claim.arm_labels():
        config = ablate.arm_config(
            claim.ablation, label, 0, "", lambda c: SETTINGS["testbed_long32"](c, "ckpt")
        )
        assert (config.task.max_steps, config.sampling.max_new_tokens) == (32, 416)
        assert config.batch.response_buckets == (128, 256, 416)
        assert config.init_checkpoint == "ckpt"
        assert (config.critic.lr, config.critic.reward_model_iterations) == (3e-3, 10)
        # The setting's policy iterations, after 10 of the reward model and the arm's value
        # pretraining.
        policy = importlib.import_module("configs.testbed_long32").get_config().train.num_iterations
        assert config.train.num_iterations == policy + 10 + config.critic.pretrain_iterations


def _shrink(config):
    config.unlock()
    config.batch.response_buckets = (8,)
    config.sampling.max_new_tokens = 8
    config.lock()
    return config


TINY = (
    "model.num_layers=1,sft.steps=2,sft.batch_size=4,task.num_train=64,task.num_test=8,"
    "eval.num_prompts=8,eval.batch_size=8,batch.n_prompts=2,batch.group_size=2,"
    "train.loggers=jsonl"
)


def test_a_tiny_claim_runs_end_to_end_and_resumes(tmp_path, monkeypatch):
    claim = reproduce.get_claim("routing_volatility")
    workdir = str(tmp_path / "claim")
    result = reproduce.run_claim(
        claim, workdir, seeds=(0,), variant=TINY, sft_root=str(tmp_path / "sft"), configure=_shrink
    )
    assert os.path.isdir(tmp_path / "sft" / "testbed" / "sft" / "checkpoints")
    (check,) = result["checks"]
    assert check["n"] == 1 and 0.0 <= check["values"][0] <= 1.0
    assert check["verdict"] == "inconclusive" and result["verdict"] == "inconclusive"
    run = result["summary"]["arms"][0]["seeds"][0]
    assert run["iterations"] == 1 and run["routing/volatility"] == check["values"][0]
    text = (tmp_path / "claim" / "verdict.md").read_text()
    assert text.startswith("# Claim `routing_volatility`: inconclusive at 1 seed(s)")
    assert os.path.getsize(tmp_path / "claim" / "curves.png") > 0

    # Rerun: the SFT start and the finished run are reused, not trained again.
    def refuse(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(ablate, "run_rl", refuse)
    again = reproduce.run_claim(
        claim, workdir, seeds=(0,), variant=TINY, sft_root=str(tmp_path / "sft"), configure=_shrink
    )
    assert again["checks"][0]["values"] == check["values"]
