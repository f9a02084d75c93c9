"""experiments/reproduce.py and configs/claims.py: each check's per-pair quantity and its
missing pairs from hand-built runs; verdict tables from hand-built summaries (a check that
did not run, a pair dropped as non-finite, runs of different learning rates refused, the
per-start figures, exploratory runs labelled); claims defined with a regime and >= 2 SFT
starts, their arms in one regime in each of their settings, unknown claims, arms and
settings refused with the known ones; exploratory variants and their directories; the SFT
starts' caches and seeds; and a tiny claim run end to end over 2 SFT starts (cached, not
retrained when rerun)."""

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import pytest

from configs import claims
from configs.ablations import ABLATIONS, SETTINGS
from configs.claims import CLAIMS, Check, Claim, get_claim
from experiments import ablate, reproduce, verdicts
from experiments.ledger import Ledger, start_id
from policyopt.checkpoint import Checkpointer
from tests.flags import ROOT, subprocess_env

REGIME = {
    "optim.lr": 1e-3,
    "train.num_iterations": 20,
    "batch.n_prompts": 16,
    "batch.group_size": 8,
    "batch.n_minibatches": 4,
    "batch.epochs": 1,
    "sampling.max_new_tokens": 20,
}


#: The routing claim before its dose-response (4 arms at lr 1e-3, 20 iterations): the verdict
#: machinery's tests use it as a claim of several checks of every kind.
FOUR_ARMS = Claim(
    name="routing_replay",
    source="GSPO (2507.18071): GRPO needs routing replay on an MoE policy, GSPO does not.",
    ablation=ABLATIONS["routing_replay"],
    setting="testbed",
    regime="optim.lr=1e-3,train.num_iterations=20",
    checks=(
        Check("GRPO with R2 ends above GRPO without replay", "diff", "grpo_R2", "grpo"),
        Check("GRPO with R3 ends above GRPO without replay", "diff", "grpo_R3", "grpo"),
        Check("GSPO without replay learns (pass@1 end - start > 0)", "gain", "gspo"),
        Check("GSPO without replay ends above GRPO without replay", "diff", "gspo", "grpo"),
        Check(
            "GSPO clips >= 10^1.5 x GRPO's fraction (paper: ~10^2)",
            "log10_ratio",
            "gspo",
            "grpo",
            metric="loss/clip_frac",
            threshold=1.5,
        ),
    ),
)


#: SAPO's temperature ordering at lr 1e-3 (the claim before its grid): 3 arms, 2 checks.
THREE_ARMS = Claim(
    name="sapo_tau",
    source="SAPO (2511.20347): tau_neg > tau_pos is the most stable choice.",
    ablation=ABLATIONS["sapo_tau"],
    setting="testbed",
    regime="optim.lr=1e-3,train.num_iterations=20",
    checks=(
        Check("tau_neg > tau_pos ends above equal temperatures", "diff", "neg_gt_pos", "equal"),
        Check("equal temperatures end above tau_neg < tau_pos", "diff", "equal", "neg_lt_pos"),
    ),
)


def _run(end, start=0.5, clip=0.01):
    return {"pass@1_end": end, "pass@1_start": start, "loss/clip_frac": clip}


def test_check_values_per_pair_and_the_pairs_without_one():
    runs = {
        "a": {(0, 0): _run(0.7, clip=0.2), (0, 1): _run(0.6, clip=0.1), (1, 0): _run(0.5, clip=0)},
        "b": {(0, 0): _run(0.5, clip=0.002), (0, 1): _run(0.65, clip=0.001), (1, 0): _run(0.5)},
    }
    pairs = [(0, 0), (0, 1), (1, 0)]
    values, starts, missing = Check("", "diff", "a", "b").values(runs, pairs)
    assert values == pytest.approx([0.2, -0.05, 0.0]) and starts == [0, 0, 1] and missing == 0
    assert Check("", "gain", "a").values(runs, pairs)[0] == pytest.approx([0.2, 0.1, 0.0])
    value = Check("", "value", "b", metric="loss/clip_frac")
    assert value.values(runs, pairs) == ([0.002, 0.001, 0.01], [0, 0, 1], 0)
    # A zero clip fraction has no log ratio: that pair is counted, not dropped silently.
    ratio = Check("", "log10_ratio", "a", "b", metric="loss/clip_frac")
    values, starts, missing = ratio.values(runs, pairs)
    assert values == pytest.approx([2.0, 2.0]) and starts == [0, 0] and missing == 1
    # A pair an arm did not run, or a metric it did not log, is missing too.
    assert Check("", "diff", "a", "b").values(runs, [*pairs, (1, 1)])[2] == 1
    assert Check("", "value", "a", metric="routing/volatility").values(runs, pairs) == ([], [], 3)
    assert Check("", "diff", "a", "c").values(runs, pairs) == ([], [], 3)


def test_checks_and_claims_refuse_bad_definitions():
    with pytest.raises(ValueError, match="Check.kind must be one of diff, gain"):
        Check("", "ratio", "a", "b")
    with pytest.raises(ValueError, match="'diff' check takes a second arm"):
        Check("", "diff", "a")
    with pytest.raises(ValueError, match="'gain' check takes no second arm"):
        Check("", "gain", "a", "b")
    with pytest.raises(ValueError, match="margin must be > 0"):
        Check("", "diff", "a", "b", margin=-0.05)
    with pytest.raises(ValueError, match="margin must be > 0 and finite"):
        Check("", "diff", "a", "b", margin=float("inf"))
    own = THREE_ARMS
    kwargs = dict(name="x", source="", ablation=own.ablation, setting="testbed", checks=own.checks)
    with pytest.raises(ValueError, match="claim 'x': its regime must fix train.num_iterations"):
        Claim(regime="optim.lr=1e-3", **kwargs)
    with pytest.raises(ValueError, match=r">= 2 SFT starts, got \(0, 0\)"):
        Claim(regime=own.regime, starts=(0, 0), **kwargs)
    with pytest.raises(ValueError, match="check 'c' names arm 'nope', not one of neg_gt_pos"):
        Claim(**{**kwargs, "checks": (Check("c", "gain", "nope"),)}, regime=own.regime)


def test_unknown_claim_arm_and_setting_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown claim 'nope'; known: routing_volatility, "):
        get_claim("nope")
    claim = get_claim("routing_replay")
    with pytest.raises(
        ValueError, match=r"no arm 'grpo_R4'; known: grpo_low, grpo_R2_low, grpo_async_low, "
    ):
        reproduce.select_arms(claim, ["grpo_low", "grpo_R4"])
    assert reproduce.select_arms(claim, ["gspo_mid"]) == ("gspo_mid",)
    assert reproduce.select_arms(get_claim("vapo_length_adaptive"), None) == (
        "vapo",
        "fixed_matched",
        "vapo_rescaled",
        "fixed_matched_rescaled",
    )
    with pytest.raises(ValueError, match="claim 'routing_replay' has no setting 'demo'; its "):
        reproduce.select_setting(claim, "demo")
    with pytest.raises(ValueError, match="has no setting 'nope'; its settings: testbed_long, "):
        reproduce.run_claim(get_claim("vc_ppo"), "unused", setting="nope")
    assert reproduce.select_setting(get_claim("vc_ppo"), "testbed_long32") == "testbed_long32"
    assert reproduce.select_setting(get_claim("vc_ppo"), None) == "testbed_long"
    assert reproduce._integers("starts", ["0", "2"]) == [0, 2]
    assert reproduce._integers("seeds", None) is None
    with pytest.raises(ValueError, match="--starts takes integers, e.g. 0,1; got 0,x"):
        reproduce._integers("starts", ["0", "x"])


@pytest.mark.parametrize("name", list(CLAIMS))
def test_every_claim_runs_its_arms_in_one_regime_in_each_setting(name):
    claim = CLAIMS[name]
    assert (len(set(claim.starts)) >= 2 or claim.diagnostic) and claim.regime and claim.budget
    regime_items = dict(item.split("=") for item in claim.regime.split(","))
    for setting in claim.settings():
        regimes = []
        for label in claim.arm_labels():
            config = ablate.arm_config(
                claim.ablation, label, 0, claim.regime, lambda c: SETTINGS[setting](c, "ckpt")
            )
            # The routing claim's dense control; lora_rl in the demo's setting (its MoE).
            preset = {
                "testbed_dense": "tiny_dense",
                "testbed_long_dense": "tiny_dense",
                "demo": "tiny_moe",
            }.get(setting)
            assert config.model.preset == (preset or "moe_volatile")
            assert config.init_checkpoint == "ckpt"
            assert config.train.routing_metrics
            regimes.append((label, ablate.regime_of(config)))
            if setting.startswith("testbed_long"):
                assert config.task.operators == "mod"
                if config.algo.advantage == "gae":  # the critic starts as a reward model
                    assert (config.critic.lr, config.critic.reward_model_iterations) == (3e-3, 10)
            else:
                assert (config.task.operators, config.sampling.max_new_tokens) == ("+", 20)
        shared = reproduce.one_regime(regimes, claim.per_arm_fields())
        if claim.own_lr:  # each arm at its own (lora_rl: the arms' sweep optima)
            assert "optim.lr" not in shared
            arm_lrs = {label: regime["optim.lr"] for label, regime in regimes}
            assert arm_lrs == {
                "full": 1e-3,
                "r1_all": 1e-3,
                "r8_all": 3e-4,
                "r32_all": 1e-3,
                "r8_attention": 3e-3,
            }
        else:
            assert shared["optim.lr"] == float(regime_items["optim.lr"])
        assert shared["train.num_iterations"] == int(regime_items["train.num_iterations"])


def test_a_claim_of_arms_at_their_own_learning_rates():
    claim = get_claim("lora_rl")
    regime = {"optim.lr": 1e-3, "train.num_iterations": 40}
    runs = [("full/seed0", regime), ("r8_all/seed0", dict(regime, **{"optim.lr": 3e-4}))]
    assert reproduce.one_regime(runs, claim.per_arm_fields()) == {"train.num_iterations": 40}
    # Still one lr within an arm, and one budget across arms.
    with pytest.raises(ValueError, match="optim.lr is 0.0003 in r8_all/seed0 but 0.001 in "):
        reproduce.one_regime(runs + [("r8_all/seed1", regime)], claim.per_arm_fields())
    longer = dict(regime, **{"train.num_iterations": 20})
    with pytest.raises(ValueError, match="train.num_iterations is 40 in full/seed0 but 20"):
        reproduce.one_regime(runs + [("r32_all/seed0", longer)], claim.per_arm_fields())
    # Without own_lr the arms must share it (every other claim).
    with pytest.raises(ValueError, match="must share one learning rate and budget"):
        reproduce.one_regime(runs)
    with pytest.raises(ValueError, match="its regime must not fix one"):
        dataclasses.replace(claim, regime="optim.lr=1e-3,train.num_iterations=40")


def test_no_diary_ordinals_in_what_users_read(capsys):
    reproduce._list()
    listed = capsys.readouterr().out
    for claim in CLAIMS.values():
        starts, seeds = (",".join(map(str, n)) for n in (claim.starts, claim.seeds))
        assert f"    regime: {claim.regime}\n" in listed
        assert f"    runs: SFT starts {starts} x seeds {seeds}\n" in listed
        # A paper's claim runs over >= 2 SFT starts x 5 seeds; a regime diagnostic may not.
        assert claim.diagnostic or (len(claim.starts), seeds) == (2, "0,1,2,3,4")
    ordinal = re.compile(r"(?i)\b(?:[a-z]+-)?(?:first|second|third|[a-z]+th)\s+session\b")
    assert not ordinal.search(listed)
    for module in (reproduce, ablate, claims, importlib.import_module("configs.ablations")):
        with open(module.__file__) as f:
            assert not ordinal.search(f.read()), module.__name__


def _summary(arms, starts=(0, 1), seeds=(0, 1, 2), regime=REGIME, setting="testbed"):
    """An ablate.run_ablation summary of hand-made runs: ``{arm: {(start, seed): run}}``."""
    return {
        "ablation": "hand",
        "claim": "hand-made runs",
        "starts": list(starts),
        "seeds": list(seeds),
        "ablation_variant": "",
        "variant": "",
        "setting": setting,
        "tail": 5,
        "date": "2026-12-06 00:00 UTC",
        "arms": [
            {
                "arm": arm,
                "recipe": "grpo",
                "variant": "",
                "runs": [
                    {
                        "start": start,
                        "seed": seed,
                        "run_dir": "unused",
                        "wall_s": 1.0,
                        "regime": dict(regime),
                        **run,
                    }
                    for (start, seed), run in runs.items()
                ],
            }
            for arm, runs in arms.items()
        ],
    }


PAIRS = [(start, seed) for start in (0, 1) for seed in (0, 1, 2, 3, 4)]


def test_a_verdict_over_starts_and_seeds_with_every_pair():
    claim = get_claim("routing_volatility")
    volatility = [0.06, 0.07, 0.08, 0.065, 0.075, 0.055, 0.06, 0.09, 0.07, 0.062]
    runs = {"one_update": {p: {"routing/volatility": v} for p, v in zip(PAIRS, volatility)}}
    text, verdict, (check,) = reproduce.verdict_table(
        claim, _summary(runs, seeds=range(5)), variant=""
    )
    # 10 pairs all above 0.05: two-sided p = 2 / 1024, one hypothesis.
    assert verdict == "supported" and check["verdict"] == "supported"
    assert check["p"] == pytest.approx(2 / 1024) and check["n"] == 10 and check["missing"] == 0
    # Start 0: mean 0.07 - 0.05; start 1: 0.0674 - 0.05. A value is decided by the sign
    # test of its median (0.07 and 0.062), which the table shows.
    assert check["start_means"] == pytest.approx({0: 0.02, 1: 0.0174})
    assert check["test"] == "sign" and check["start_effects"] == pytest.approx({0: 0.02, 1: 0.012})
    assert check["effect"] == pytest.approx(0.0675 - 0.05)  # the median of the 10
    assert text.startswith("# Claim `routing_volatility`: supported at 2 SFT start(s) x 5 seed(s)")
    assert "| 0.05 | sign (median) | 10 | +0.0175 |" in text
    assert "| +0.0200 / +0.0120 | 0.00195 | supported |" in text
    assert "--starts 0,1 --seeds 0,1,2,3,4" in text and "lr 0.001, 20 policy iterations" in text
    assert "exploratory" not in text.lower()
    assert "\nCompute: not recorded for its 10 runs.\n" in text
    # The runs' CPU seconds: 10 x 720 s = 2 CPU-hours; a run without them is counted apart.
    for run in runs["one_update"].values():
        run["cpu_s"] = 720.0
    text, _, _ = reproduce.verdict_table(claim, _summary(runs, seeds=range(5)))
    assert "\nCompute: 2.00 CPU-hours, the trainer's threads" in text
    assert "| 720 |\n" in text  # the summary table's CPU s column (mean over the runs)
    del runs["one_update"][PAIRS[0]]["cpu_s"]
    text, _, _ = reproduce.verdict_table(claim, _summary(runs, seeds=range(5)))
    assert "Compute: 1.80 CPU-hours (recorded for 9 of 10 runs)" in text


def test_a_check_not_run_or_missing_a_pair_leaves_the_claim_inconclusive():
    claim = FOUR_ARMS
    up = {p: _run(0.6 + 0.01 * i, clip=0.3) for i, p in enumerate(PAIRS)}
    down = {p: _run(0.4 - 0.01 * i, clip=0.003) for i, p in enumerate(PAIRS)}
    # grpo_R3 was not run (--arms): its check is "not run"; every other check holds.
    summary = _summary({"grpo": down, "grpo_R2": up, "gspo": up}, seeds=range(5))
    text, verdict, checks = reproduce.verdict_table(claim, summary)
    assert [c["verdict"] for c in checks] == [
        "supported",
        "not run",
        "supported",
        "supported",
        "supported",
    ]
    assert verdict == "inconclusive"
    assert (
        "| GRPO with R3 ends above GRPO without replay | 0 | sign-flip (mean) | 0 of 10 | - |"
        in (text)
    )
    # GRPO's clip fraction 0 at one pair: the log ratio has no value there.
    down[(1, 3)] = _run(0.3, clip=0.0)
    summary = _summary({"grpo": down, "grpo_R2": up, "grpo_R3": up, "gspo": up}, seeds=range(5))
    text, verdict, checks = reproduce.verdict_table(claim, summary)
    assert verdict == "inconclusive" and checks[-1]["verdict"] == "inconclusive"
    assert checks[-1]["note"] == "1 of 10 pairs missing; the test alone: supported"
    assert "| 9 of 10 |" in text and "1 of 10 pairs missing" in text


def test_a_check_not_run_shows_its_own_threshold():
    """routing_share's "GSPO learns" check (gain > 0.10) without pass@1 in the run: its
    row is "not run" at threshold 0.1 (it read 0: judge gave no threshold without values)."""
    claim = get_claim("routing_share")
    runs = {"gspo": {(1, 0): {"routing/ratio_share_pooled": 0.6}}}
    text, _, checks = reproduce.verdict_table(claim, _summary(runs, starts=(1,), seeds=(0,)))
    assert checks[1]["verdict"] == "not run" and checks[1]["threshold"] == 0.10
    assert (
        "| GSPO learns: held-out pass@1 +0.10 over its start | 0.1 | sign (median) | 0 of 1 |"
        in text
    )
    # A margin check not run shows its margin.
    assert verdicts.judge([], 0.0, 0.05, missing=2)["margin"] == 0.05
    row = reproduce.check_threshold(verdicts.judge([], 0.0, 0.05, missing=2))
    assert row == "0 ± 0.05"


def test_a_verdict_table_over_different_learning_rates_is_refused():
    claim = THREE_ARMS
    runs = {p: _run(0.5) for p in PAIRS[:3]}
    summary = _summary({"neg_gt_pos": runs, "equal": runs, "neg_lt_pos": runs}, seeds=range(3))
    summary["arms"][2]["runs"][1]["regime"]["optim.lr"] = 5e-3
    with pytest.raises(
        ValueError,
        match=r"^verdict table refused: optim.lr is 0.001 in neg_gt_pos/seed0 but 0.005 in "
        r"neg_lt_pos/seed1; a claim's arms, starts and seeds must share one learning rate",
    ):
        reproduce.verdict_table(claim, summary)
    summary = _summary({"neg_gt_pos": runs, "equal": runs}, seeds=range(3))
    summary["arms"][1]["runs"][0]["regime"]["train.num_iterations"] = 40
    with pytest.raises(ValueError, match="train.num_iterations is 20 in neg_gt_pos/seed0 but 40"):
        reproduce.verdict_table(claim, summary)


def test_magistral_no_harm_check_is_an_equivalence_test():
    claim = get_claim("magistral_async")
    pairs = [(start, seed) for start in (0, 1) for seed in range(6)]
    sync = {p: _run(0.70 + 0.01 * (i % 3), start=0.4) for i, p in enumerate(pairs)}
    near = {
        p: _run(r["pass@1_end"] + (-0.01, 0.0, 0.01)[i % 3], start=0.4)
        for i, (p, r) in enumerate(sync.items())
    }
    text, verdict, (learns, same) = reproduce.verdict_table(
        claim, _summary({"sync": sync, "async": near}, seeds=range(6))
    )
    assert (learns["verdict"], same["verdict"], verdict) == ("supported", "equivalent", "supported")
    assert "| 0 ± 0.05 | sign (median) | 12 |" in text and "equivalent" in text
    far = {p: _run(r["pass@1_end"] - 0.2, start=0.4) for p, r in sync.items()}
    _, verdict, (_, same) = reproduce.verdict_table(
        claim, _summary({"sync": sync, "async": far}, seeds=range(6))
    )
    assert same["verdict"] == "contradicted" and verdict == "contradicted"


def test_exploratory_variants_and_their_directories():
    claim = FOUR_ARMS
    # The regime already says lr 1e-3 and 20 iterations; logging is not what is trained.
    assert reproduce.departures(claim, "testbed", "") == []
    assert reproduce.departures(claim, "testbed", "optim.lr=1e-3,train.num_iterations=20") == []
    assert reproduce.departures(claim, "testbed", "train.loggers=jsonl") == []
    assert reproduce.departures(claim, "testbed", "optim.lr=5e-4") == ["optim.lr"]
    assert reproduce.departures(claim, "testbed", "train.num_iterations=40,sft.steps=10") == [
        "sft.steps",
        "train.num_iterations",
    ]
    assert reproduce.claim_dir("root", claim) == os.path.join("root", "routing_replay")
    assert reproduce.claim_dir("root", claim, None, "optim.lr=1e-3") == os.path.join(
        "root", "routing_replay"
    )
    assert reproduce.claim_dir("root", claim, None, "optim.lr=5e-4") == os.path.join(
        "root", "routing_replay-exploratory", "optim.lr=5e-4"
    )
    vc = get_claim("vc_ppo")
    assert reproduce.claim_dir("root", vc, "testbed_long32") == os.path.join(
        "root", "vc_ppo-testbed_long32"
    )
    tuple_variant = "batch.response_buckets=(128, 256, 416),optim.lr=3e-4"
    assert reproduce.claim_dir("root", vc, "testbed_long32", tuple_variant) == os.path.join(
        "root",
        "vc_ppo-testbed_long32-exploratory",
        "batch.response_buckets=_128,_256,_416_,optim.lr=3e-4",
    )
    long = ",".join(f"optim.lr={x}e-4" for x in range(1, 10)) + ",critic.lr=3e-3"
    directory = os.path.basename(reproduce.claim_dir("root", vc, None, long))
    assert len(directory) == 64 + 9 and directory.startswith("optim.lr=1e-4,optim.lr=2e-4")
    runs = {p: _run(0.5) for p in PAIRS[:2]}
    text, _, _ = reproduce.verdict_table(
        THREE_ARMS,
        _summary({"neg_gt_pos": runs, "equal": runs}, seeds=range(2), starts=(0,)),
        variant="optim.lr=5e-4",
        exploratory=True,
    )
    assert text.startswith("# Claim `sapo_tau` (exploratory): inconclusive at 1 SFT start(s)")
    assert "**Exploratory**: `--variant optim.lr=5e-4`" in text
    assert (
        "One SFT start: the spread between starts is not sampled; the claim is decided over "
        ">= 2 (its checks alone: inconclusive)." in text
    )


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


def test_sft_starts_beyond_the_first_change_the_seed_and_continue_their_parents_own(
    tmp_path, monkeypatch
):
    """Start K is cached in sft_start<K> with the recipe's seed + K; a continued start
    (testbed_long32) continues its parent's start of the same number."""
    assert reproduce.sft_dir("r", "testbed") == os.path.join("r", "testbed", "sft")
    assert reproduce.sft_dir("r", "testbed", 2) == os.path.join("r", "testbed", "sft_start2")
    calls = []

    def record(config, workdir, *, init_checkpoint=None, recipe=None):
        calls.append((workdir, config.seed, config.task.seed, init_checkpoint, recipe))
        return {"checkpoint_dir": os.path.join(workdir, "checkpoints")}

    monkeypatch.setattr(reproduce, "run_sft", record)
    root = str(tmp_path)
    got = reproduce.ensure_sft("testbed_long32", root, start=1)
    parent = os.path.join(root, "testbed_long", "sft_start1")
    child = os.path.join(root, "testbed_long32", "sft_start1")
    assert got == os.path.join(child, "checkpoints")
    assert calls == [
        (parent, 1, 0, None, "configs/testbed_long.py (SFT start 1, seed 1)"),
        (
            child,
            1,
            0,
            os.path.join(parent, "checkpoints"),
            "configs/testbed_long32.py (SFT start 1, seed 1, continuing testbed_long's)",
        ),
    ]


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
    # Finished starts are not held: another claim's process may use them meanwhile.
    taken = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from policyopt.checkpoint import lock_workdir; "
            "[lock_workdir(d) for d in sys.argv[1:]]",
            str(parent),
            str(child),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=ROOT,
    )
    assert taken.returncode == 0, taken.stderr


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


def test_a_tiny_claim_runs_over_two_starts_end_to_end_and_resumes(tmp_path, monkeypatch):
    claim = get_claim("routing_volatility")
    workdir = str(tmp_path / "claim")
    sft_root = str(tmp_path / "sft")
    book = str(tmp_path / "repo" / "docs" / "claims" / "runs" / "routing_volatility.jsonl")
    run = dict(starts=(0, 1), seeds=(0,), variant=TINY, sft_root=sft_root, configure=_shrink)
    result = reproduce.run_claim(claim, workdir, **run, ledger=book)
    for start, name in ((0, "sft"), (1, "sft_start1")):
        with Checkpointer(os.path.join(sft_root, "testbed", name, "checkpoints")) as saved:
            assert saved.meta()["config"]["seed"] == start
    (check,) = result["checks"]
    assert check["n"] == 2 and all(0.0 <= v <= 1.0 for v in check["values"])
    assert check["verdict"] == "inconclusive" and result["verdict"] == "inconclusive"
    assert result["exploratory"]  # a variant that shrinks the model departs from the claim
    runs = result["summary"]["arms"][0]["runs"]
    assert [(r["start"], r["iterations"]) for r in runs] == [(0, 1), (1, 1)]
    assert [os.path.basename(r["run_dir"]) for r in runs] == ["seed0", "start1_seed0"]
    assert [r["routing/volatility"] for r in runs] == check["values"]
    text = (tmp_path / "claim" / "verdict.md").read_text()
    assert text.startswith(
        "# Claim `routing_volatility` (exploratory): inconclusive at 2 SFT start(s) x 1 seed(s)"
    )
    assert os.path.getsize(tmp_path / "claim" / "curves.png") > 0
    assert claim.headline(result).startswith("routing volatility after one update: 0.")

    # Rerun: the SFT starts and the finished runs are reused, not trained again.
    def refuse(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(ablate, "run_rl", refuse)
    sft_log = tmp_path / "sft" / "testbed" / "sft_start1" / "metrics.jsonl"
    before = sft_log.read_text()
    again = reproduce.run_claim(claim, workdir, **run)
    assert again["checks"][0]["values"] == check["values"] and sft_log.read_text() == before

    # Re-judged (--rejudge): the finished runs only; no SFT start is built, nothing trains,
    # and a start or run that is not finished is an error naming it.
    real_ensure_sft = reproduce.ensure_sft
    monkeypatch.setattr(reproduce, "ensure_sft", refuse)
    rejudged = reproduce.run_claim(claim, workdir, **run, train=False)
    assert rejudged["checks"][0]["values"] == check["values"]
    assert rejudged["verdict_md"] == (tmp_path / "claim" / "verdict.md").read_text()
    with pytest.raises(ValueError, match=r"one_update/seed1 is not finished \(routing_vol"):
        reproduce.run_claim(claim, workdir, **{**run, "seeds": (0, 1)}, train=False)
    with pytest.raises(
        ValueError, match=r"SFT start 2 of 'testbed' is not finished \(.*sft_start2"
    ):
        reproduce.run_claim(claim, workdir, **{**run, "starts": (0, 2)}, train=False)

    # The ledger (docs/claims/runs/<claim>.jsonl in the repository) holds both runs, each
    # with its start's identity: another machine judges them with no run or start of its
    # own, and resumes the sweep without training them again.
    records = Ledger(book).records
    assert [(r["arm"], r["start"], r["seed"]) for r in records] == [
        ("one_update", 0, 0),
        ("one_update", 1, 0),
    ]
    ids = [
        start_id(os.path.join(sft_root, "testbed", name, "checkpoints"))
        for name in ("sft", "sft_start1")
    ]
    assert [r["start_id"] for r in records] == ids and ids[0] != ids[1]
    assert [r["figures"]["routing/volatility"] for r in records] == check["values"]
    elsewhere = dict(run, sft_root=str(tmp_path / "sft_elsewhere"))
    moved = str(tmp_path / "claim_elsewhere")
    judged = reproduce.run_claim(claim, moved, **elsewhere, train=False, ledger=book)
    assert judged["checks"][0]["values"] == check["values"]
    assert [r["run_dir"] for r in judged["summary"]["arms"][0]["runs"]] == [None, None]
    assert "curves" not in judged["summary"]  # the runs' logs stayed on their machine
    monkeypatch.setattr(reproduce, "ensure_sft", real_ensure_sft)
    resumed = reproduce.run_claim(claim, moved, **elsewhere, ledger=book)  # starts retrained
    assert resumed["checks"][0]["values"] == check["values"] and len(Ledger(book).records) == 2
    # A start trained to other bits (here one more SFT step) is another start: its runs
    # train anew.
    longer = dict(elsewhere, variant=TINY.replace("sft.steps=2", "sft.steps=3"))
    longer["sft_root"] = str(tmp_path / "sft_longer")
    with pytest.raises(AssertionError, match="trained again"):
        reproduce.run_claim(claim, moved, **longer, ledger=book)
    # Judged without the start, the records must name one identity of it.
    with open(book, "a") as f:
        f.write(json.dumps({**records[1], "start_id": "2-other"}) + "\n")
    with pytest.raises(ValueError, match=r"SFT start 1 of 'testbed' is not on this machine"):
        reproduce.run_claim(
            claim, moved, **dict(run, sft_root=str(tmp_path / "none")), train=False, ledger=book
        )


def test_diff_of_diffs_checks_and_the_routing_claims():
    """(a - b) - (c - d) at each pair, by hand; the routing claim's dose-response has its
    per-level checks and the two growth checks; its diagnostic may run from one start."""
    check = Check("gap grows", "diff_of_diffs", "a", "b", c="c", d="d")
    runs = {
        "a": {(0, 0): _run(0.9)},
        "b": {(0, 0): _run(0.5)},
        "c": {(0, 0): _run(0.6)},
        "d": {(0, 0): _run(0.55)},
    }
    values, starts, missing = check.values(runs, [(0, 0), (0, 1)])
    assert values == [pytest.approx(0.35)] and starts == [0] and missing == 1
    with pytest.raises(ValueError, match="arms c and d go with a 'diff_of_diffs' check"):
        Check("x", "diff_of_diffs", "a", "b")
    with pytest.raises(ValueError, match="arms c and d go with a 'diff_of_diffs' check"):
        Check("x", "diff", "a", "b", c="c", d="d")
    dose = get_claim("routing_replay")
    # The high level and the growth decide; the lower levels are reported.
    rests_on = [c.text for c in dose.checks if not c.reported]
    assert all(text.startswith("high:") or "grows" in text for text in rests_on)
    assert len(rests_on) == 5 + 2 and sum(c.reported for c in dose.checks) == 10
    assert len(dose.checks) == 5 * 3 + 2 and len(dose.arm_labels()) == 6 * 3
    assert {c.kind for c in dose.checks} == {"diff", "gain", "diff_of_diffs"}
    # Per level, R3 against R2 like for like (both in the asynchronous loop): no harm
    # within Magistral's margin, by the sign test.
    for level in claims.ROUTING_LEVELS:
        (r3_vs_r2,) = [c for c in dose.checks if c.a == f"grpo_R3_async_{level}" and c.margin]
        assert (r3_vs_r2.b, r3_vs_r2.margin, r3_vs_r2.test) == (
            f"grpo_R2_async_{level}",
            0.05,
            "sign",
        )
        configs = {
            arm: ablate.arm_config(dose.ablation, arm, 0, dose.regime)
            for arm in (f"grpo_R2_async_{level}", f"grpo_R3_async_{level}")
        }
        r2, r3 = configs.values()
        assert (r2.algo.routing_replay, r3.algo.routing_replay) == ("R2", "R3")
        assert r2.async_mode.enabled and r3.async_mode.enabled
        assert ablate.config_diff(r2, r3) == {"algo.routing_replay": ["R2", "R3"]}
    share = get_claim("routing_share")
    assert share.diagnostic and len(share.starts) == 1 and share.regime == dose.regime
    assert share.setting == dose.setting == "testbed_long" and set(share.starts) < set(dose.starts)
    result = {
        "summary": {
            "arms": [
                {
                    "runs": [
                        {
                            "regime": {**REGIME, "optim.lr": 1e-4},
                            "routing/ratio_share_pooled": 0.625,
                            "routing/volatility": 0.04,
                            "pass@1_start": 0.457,
                            "pass@1_end": 0.6,
                        }
                    ]
                }
            ]
        }
    }
    assert share.headline(result) == (
        "routing share 0.625 (volatility 0.0400 over the batch's 4 updates) at lr 0.0001; "
        "GSPO pass@1 0.457 -> 0.600"
    )


def test_routing_replay_reports_its_share_by_level_against_the_floor():
    """routing_replay's last line, from a hand-made result: each level's pooled routing
    share and volatility over the MoE arms' runs (means by hand), and whether the high
    level reaches the premise."""
    claim = get_claim("routing_replay")

    def result(high_share):
        def arm(name, share, vol):
            return {
                "arm": name,
                "runs": [{"routing/ratio_share_pooled": share, "routing/volatility": vol}],
            }

        return {
            "summary": {
                "arms": [
                    arm("grpo_low", 0.02, 0.001),
                    arm("gspo_low", 0.04, 0.003),
                    arm("grpo_mid", 0.10, 0.010),
                    {"arm": "grpo_R2_mid", "runs": [{}]},  # no metric: left out
                    arm("grpo_high", high_share, 0.020),
                    arm("gspo_high", high_share + 0.2, 0.030),
                ]
            }
        }

    assert claim.headline(result(0.1)) == (
        "routing share by level (pooled over the MoE arms' runs): low 0.030, mid 0.100, "
        "high 0.200; volatility low 0.0020, mid 0.0100, high 0.0250"
    )
    assert "high 0.600; volatility" in claim.headline(result(0.5))


def test_sapo_grid_reports_its_gate_weight_against_the_floor():
    """sapo_grid's last line, from a hand-made result: the SAPO arms' gate weight over the
    run (GRPO's left out), whether it reaches the floor, the recipe's arm's pass@1 and the
    SAPO runs that collapsed."""
    regime = {**REGIME, "optim.lr": 1e-4, "batch.n_minibatches": 8, "batch.epochs": 2}

    def run(gate, start, end, collapsed=0.0):
        return {
            "regime": regime,
            "loss/gate_mean_run": gate,
            "pass@1_start": start,
            "pass@1_end": end,
            "collapsed": collapsed,
        }

    def result(**arms):
        return {"summary": {"arms": [{"arm": a, "runs": runs} for a, runs in arms.items()]}}

    grid = get_claim("sapo_grid")
    line = grid.headline(
        result(
            neg1p05=[run(0.998, 0.457, 0.8), run(0.996, 0.375, 0.7)],
            pos2=[run(0.99, 0.457, 0.01, collapsed=1.0)],
            grpo=[run(0.5, 0.457, 0.9)],  # GRPO's gate (1 - clip fraction) is not SAPO's
        )
    )
    assert line == (
        "SAPO's mean gate weight over the run 0.9947 with 8 x 2 updates per batch at lr "
        "0.0001; tau 1.0 / 1.05 pass@1 0.416 -> 0.750; 1 of 3 SAPO runs collapsed"
    )
    line = grid.headline(result(neg1p05=[run(0.95, 0.457, 0.8)]))
    assert "run 0.9500 with" in line and "0 of 1 SAPO runs" in line


def test_the_critic_claims_report_their_regime_diagnostics():
    """vc_ppo's, vapo_length_adaptive's and critic_warmup's last lines, from a hand-made
    result: means over each arm's runs, NaN for an arm or figure that did not run."""
    warm, lam = ablate.WARMUP_EXPLAINED_VARIANCE, "advantages/lambda_policy_token_mean"

    def result(**arms):
        return {"summary": {"arms": [{"arm": a, "runs": runs} for a, runs in arms.items()]}}

    vc = get_claim("vc_ppo").headline(
        result(
            ppo=[{warm: -0.8}, {warm: -0.6}],
            vc_ppo=[{warm: 0.5}, {warm: 0.2}],
            vc_ppo_lambda_1=[{warm: 0.2}],
        )
    )
    # The pretrained arms' runs pooled, as the claim's premise: (0.5 + 0.2 + 0.2) / 3 (the
    # mean of the arms' means would be 0.275).
    assert vc.startswith(
        "critic explained variance at PPO's first rollout: plain PPO (reward-model start) "
        f"-0.700, after {claims.CRITIC_PRETRAIN_ITERATIONS} iterations of value pretraining 0.300 "
        "(a perfect critic's: start 0 "
    )
    missing = get_claim("vc_ppo").headline(result(ppo=[{warm: 0.1}]))
    assert "pretraining nan (a perfect" in missing
    vapo = get_claim("vapo_length_adaptive").headline(
        result(vapo=[{lam: 0.78, warm: 0.2}, {lam: 0.8}], fixed_matched=[{lam: 0.79, warm: 0.4}])
    )
    assert vapo == (
        "length-adaptive lambda's token mean over the policy's iterations: 0.790 at alpha 0.05 "
        f"(control {claims.VAPO_MATCHED_LAMBDA:g}), nan at alpha {claims.VAPO_RESCALED_ALPHA:g} "
        f"(control {claims.VAPO_RESCALED_MATCHED_LAMBDA:g}); critic explained variance after "
        "its warm-up 0.300"
    )
    assert "0.450 on a fresh rollout (Monte-Carlo returns; floor >= 0.5: not reached)" in (
        get_claim("critic_warmup").headline(result(vc_ppo=[{warm: 0.45}]))
    )


def test_a_premise_holds_at_each_start_over_every_run():
    """Premise.measure by hand: the mean over its arms' runs at the pairs judged (a pair
    outside them and another arm left out), per start; met only when every start's mean is
    within the bound, "at most" or "at least"; a run without a finite value: not measured."""
    gate = claims.Premise("gate acts", "g", ("a", "b"), 0.95, at_most=True)
    runs = {
        "a": {(1, 0): {"g": 0.90}, (1, 1): {"g": 0.94}, (2, 0): {"g": 0.93}, (2, 1): {"g": 0.91}},
        "b": {(1, 0): {"g": 0.92}, (1, 1): {"g": 0.96}, (2, 0): {"g": 0.95}, (2, 1): {"g": 0.97}},
        "c": {(1, 0): {"g": 0.0}},  # not the premise's arm
    }
    runs["b"][(3, 0)] = {"g": 0.0}  # not a pair judged
    pairs = [(s, d) for s in (1, 2) for d in (0, 1)]
    result = gate.measure(runs, pairs)
    assert result["start_values"] == pytest.approx({1: 0.93, 2: 0.94})
    assert result["value"] == pytest.approx(0.935) and (result["runs"], result["missing"]) == (8, 0)
    assert result["met"] is True and result["bound"] == "<= 0.95"
    # Start 2 at (0.93 + 0.91 + 0.95 + 1.03) / 4 = 0.955: outside, though the mean of all
    # eight runs, 0.9425, is within.
    runs["b"][(2, 1)]["g"] = 1.03
    result = gate.measure(runs, pairs)
    assert result["value"] == pytest.approx(0.9425) and result["met"] is False
    floor = dataclasses.replace(gate, bound=0.9, at_most=False)  # at least 0.9 at each start
    assert floor.measure(runs, pairs)["met"] is True and floor.bound_text == ">= 0.9"
    runs["a"][(2, 0)]["g"] = float("nan")  # a run without a value
    result = floor.measure(runs, pairs)
    assert (result["met"], result["runs"], result["missing"]) == (None, 7, 1)
    del runs["b"][(1, 1)]  # an arm not run at a pair
    assert floor.measure(runs, pairs)["missing"] == 2
    nothing = gate.measure(runs, [(4, 0)])
    assert nothing["met"] is None and nothing["runs"] == 0 and nothing["start_values"] == {}
    own = THREE_ARMS
    with pytest.raises(ValueError, match="premise 'p' names arm 'nope', not one of neg_gt_pos"):
        dataclasses.replace(own, premises=(claims.Premise("p", "m", ("nope",), 0.5),))


def test_a_claim_outside_its_regime_decides_nothing():
    """vc_ppo from hand-made runs whose every check holds at every pair: supported when its
    critic explains >= 0.5 of the returns' variance; inconclusive, its checks' own verdict
    shown, when the critic's fit is below the floor or was not measured."""
    claim = get_claim("vc_ppo")
    pairs = [(start, seed) for start in claim.starts for seed in claim.seeds]
    ends = {
        "ppo": 0.40,
        "vc_ppo_lambda_1": 0.45,
        "vc_ppo_lambda_090": 0.50,
        "ppo_pretrained": 0.55,
        "vc_ppo": 0.55,
        "vc_ppo_lambda_099": 0.56,
    }
    warm = ablate.WARMUP_EXPLAINED_VARIANCE

    def summary(fit):
        arms = {
            arm: {
                p: {**_run(end + 0.001 * i), **({} if fit is None else {warm: fit})}
                for i, p in enumerate(pairs)
            }
            for arm, end in ends.items()
        }
        return _summary(arms, starts=claim.starts, seeds=claim.seeds)

    text, verdict, checks = reproduce.verdict_table(claim, summary(0.6))
    # Each check: 10 of 10 pairs above 0, two-sided sign-flip p 2/1024, Holm over 6.
    assert {c["verdict"] for c in checks} == {"supported"} and verdict == "supported"
    assert (
        "| the critic's held-out explained variance after its warm-up | >= 0.5 | 0.6 | "
        "0.6 / 0.6 | 50 | yes |" in text
    )
    assert "Outside its regime" not in text
    text, verdict, checks = reproduce.verdict_table(claim, summary(0.3))
    assert {c["verdict"] for c in checks} == {"supported"} and verdict == "inconclusive"
    assert text.startswith("# Claim `vc_ppo`: inconclusive at 2 SFT start(s) x 5 seed(s)")
    assert (
        "**Outside its regime**: the critic's held-out explained variance after its "
        "warm-up: start 1 0.3 / start 2 0.3 (>= 0.5 at each start). The checks ran where "
        "the mechanism does not act as the paper's finding needs; the claim is not decided "
        "(its checks alone: supported)." in text
    )
    assert "| 0.3 | 0.3 / 0.3 | 50 | no |" in text
    text, verdict, _ = reproduce.verdict_table(claim, summary(None))
    assert verdict == "inconclusive" and (
        "**Regime not measured**: the critic's held-out explained variance after its warm-up: "
        "not measured at 50 of 50 runs (ppo_pretrained at start 1, seed 0 the first)." in text
    )
    assert "| >= 0.5 | - | - / - | 0 of 50 | not measured |" in text
    # The per-start cells follow the starts their headers name.
    assert "| measured | per start (starts 1 / 2) | runs | met |" in text
    assert "| per-start effect (starts 1 / 2) | p (Holm) |" in text


def test_the_claims_premises_are_the_issues_floors():
    """Which claims rest on a measured regime, and on which arms: routing_replay on its
    high level's MoE arms (share >= 0.5), sapo_grid on its SAPO arms (gate <= 0.95), the
    lambda claims on every arm whose critic warms up (fit >= 0.5); the others on none."""
    premises = {name: claim.premises for name, claim in CLAIMS.items() if claim.premises}
    assert set(premises) == {"routing_replay", "sapo_grid", "vc_ppo", "vapo_length_adaptive"}
    (share,) = premises["routing_replay"]
    assert (share.metric, share.bound, share.at_most) == ("routing/ratio_share_pooled", 0.5, False)
    assert len(share.arms) == 6 and all(arm.endswith("_high") for arm in share.arms)
    (gate,) = premises["sapo_grid"]
    assert (gate.metric, gate.bound, gate.at_most) == ("loss/gate_mean_run", 0.95, True)
    assert "grpo" not in gate.arms and len(gate.arms) == 9
    for name in ("vc_ppo", "vapo_length_adaptive"):
        (fit,) = premises[name]
        assert (fit.metric, fit.bound) == (ablate.WARMUP_EXPLAINED_VARIANCE, 0.5)
    assert "ppo" not in premises["vc_ppo"][0].arms  # plain PPO's critic does not pretrain
    assert set(premises["vapo_length_adaptive"][0].arms) == set(
        CLAIMS["vapo_length_adaptive"].arm_labels()
    )


def test_a_papers_claim_at_one_sft_start_decides_nothing():
    """--starts 0: the disagreeing-start guard cannot act and the between-start spread is
    not sampled; a paper's claim (>= 2 starts by definition) is then inconclusive, a regime
    diagnostic (one start by definition) is not."""
    # Defined at 8 seeds: 5 pairs cannot decide a two-sided sign test (p >= 2 / 32).
    claim = dataclasses.replace(get_claim("magistral_async"), seeds=tuple(range(8)))
    pairs = [(0, seed) for seed in range(8)]
    sync = {p: _run(0.70 + 0.01 * (i % 3), start=0.4) for i, p in enumerate(pairs)}
    near = {
        p: _run(r["pass@1_end"] + (-0.01, 0.0, 0.01)[i % 3], start=0.4)
        for i, (p, r) in enumerate(sync.items())
    }
    summary = _summary({"sync": sync, "async": near}, starts=(0,), seeds=range(8))
    text, verdict, (learns, same) = reproduce.verdict_table(claim, summary)
    assert (learns["verdict"], same["verdict"]) == ("supported", "equivalent")  # the tests
    assert verdict == "inconclusive"
    assert text.startswith("# Claim `magistral_async`: inconclusive at 1 SFT start(s) x 8")
    assert (
        "One SFT start: the spread between starts is not sampled; the claim is decided over "
        ">= 2 (its checks alone: supported)." in text
    )
    # A regime diagnostic defined at one start keeps its verdict.
    share = dataclasses.replace(get_claim("routing_share"), seeds=tuple(range(8)))
    assert share.diagnostic and len(share.starts) == 1
    runs = {
        (share.starts[0], seed): {
            "routing/ratio_share_pooled": 0.6,
            "pass@1_start": 0.3,
            "pass@1_end": 0.5,
        }
        for seed in range(8)
    }
    summary = _summary({"gspo": runs}, starts=share.starts, seeds=range(8))
    text, verdict, _ = reproduce.verdict_table(share, summary)
    assert verdict == "supported" and "the claim is decided over" not in text


def test_pairs_beyond_the_claims_definition_make_its_verdict_exploratory():
    """Seeds added after the definition (optional stopping: add seeds until a check passes):
    the verdict is labelled exploratory, never the claim's; within the definition it is not."""
    claim = get_claim("routing_volatility")  # starts (0, 1) x seeds 0-4
    more = [(start, seed) for start in (0, 1) for seed in range(7)]
    runs = {"one_update": {pair: {"routing/volatility": 0.07} for pair in more}}
    text, verdict, _ = reproduce.verdict_table(claim, _summary(runs, seeds=range(7)))
    assert verdict == "supported"  # 14 pairs all above 0.05: p 2 / 2^14
    assert text.startswith("# Claim `routing_volatility` (exploratory): supported")
    assert "**Exploratory**: seeds 5, 6 beyond the claim's (SFT starts [0, 1] x seeds " in text
    assert reproduce.pairs_beyond(claim, (0, 1, 2), range(5)) == ["starts 2"]
    assert reproduce.pairs_beyond(claim, (1,), (0, 3)) == []  # a subset: not beyond
    text, verdict, _ = reproduce.verdict_table(claim, _summary(runs, seeds=range(5)))
    assert verdict == "supported" and "xploratory" not in text


def test_a_subset_that_leaves_out_finished_runs_is_a_selection(tmp_path):
    """Seed 2 ran to the end and collapsed (no value: the check has a missing pair, the
    claim inconclusive); judging seeds 0, 1, 3, 4 dropped it and read "supported" as the
    claim's verdict. A subset that leaves out finished runs of the claim's own pairs is a
    selection (judge the pairs that pass), not a sweep's progress: exploratory."""
    claim = get_claim("routing_volatility")  # starts (0, 1) x seeds 0-4
    workdir = str(tmp_path / "claim")
    for start in (0, 1):
        for seed in (0, 1, 2):  # seeds 3 and 4 not run yet; seed 2 finished
            run_dir = os.path.join(workdir, "one_update", ablate.run_name(start, seed))
            os.makedirs(run_dir)
            if seed < 2 or start == 1:
                with open(os.path.join(run_dir, ablate.DONE_FILE), "w") as f:
                    f.write("{}")
    os.makedirs(os.path.join(workdir, "one_update", "start1_seed3"))  # begun, not finished
    left = reproduce.pairs_left_out(claim, workdir, ("one_update",), (0, 1), (0, 1, 3, 4))
    assert left == [(1, 2)]  # start 0's seed 2 never finished; start 1's seed 3 neither
    assert reproduce.pairs_left_out(claim, workdir, ("one_update",), (0, 1), range(5)) == []
    # A prefix of a sweep in progress leaves nothing finished out: not exploratory.
    assert reproduce.pairs_left_out(claim, workdir, ("one_update",), (0, 1), (0, 1, 2)) == []
    assert (
        reproduce.pairs_left_out(claim, str(tmp_path / "none"), ("one_update",), (0,), (0,)) == []
    )
    pairs = [(start, seed) for start in (0, 1) for seed in (0, 1, 3, 4)]
    runs = {"one_update": {pair: {"routing/volatility": 0.07} for pair in pairs}}
    text, verdict, _ = reproduce.verdict_table(
        claim, _summary(runs, seeds=(0, 1, 3, 4)), left_out=left
    )
    assert text.startswith("# Claim `routing_volatility` (exploratory): supported")
    assert (
        "**Exploratory**: the finished runs of (start 1, seed 2) are left out; a verdict "
        "over chosen pairs can be any, this verdict is not the claim's." in text
    )


def test_a_seed_or_start_named_twice_is_refused_not_counted_twice():
    """Seeds 0,1,0,1 from 2 starts: 4 runs judged as 8 pairs, each value twice (two-sided
    p 2/256, "supported", where the 4 pairs give 2/16)."""
    claim = get_claim("routing_volatility")
    runs = {"one_update": {(start, seed): {"routing/volatility": 0.07} for start, seed in PAIRS}}
    summary = _summary(runs, seeds=[0, 1, 0, 1])
    with pytest.raises(
        ValueError, match=r"^verdict table refused: seed 0 is named twice \(seeds \[0, 1, 0, 1\]"
    ):
        reproduce.verdict_table(claim, summary)
    with pytest.raises(ValueError, match=r"^verdict table refused: start 1 is named twice"):
        reproduce.verdict_table(claim, _summary(runs, starts=[0, 1, 1], seeds=range(5)))
    with pytest.raises(ValueError, match="--seeds names 2 twice; got 0,2,2"):
        reproduce._integers("seeds", ["0", "2", "2"])


def test_a_variant_that_sets_the_seed_is_refused():
    """--variant seed=5 ran every "seed" at seed 5: N copies of one run per start, judged
    as N pairs (exploratory, but a verdict over one seed)."""
    claim = get_claim("magistral_async")
    message = r"a common variant may not set seed \(got 'seed=5'\); the runs' seeds are --seeds"
    with pytest.raises(ValueError, match=message):
        reproduce.departures(claim, "testbed", "seed=5")
    with pytest.raises(ValueError, match=message):
        ablate.arm_config(claim.ablation, "sync", 3, "seed=5")
    assert ablate.arm_config(claim.ablation, "sync", 3, claim.regime).seed == 3


def test_a_variant_that_replaces_the_sft_starts_is_refused():
    """--variant init_checkpoint=X ran every SFT start from X: the "starts" one start, so
    the between-start spread and the disagreeing-start guard meant nothing."""
    claim = get_claim("magistral_async")
    with pytest.raises(
        ValueError,
        match=r"--variant may not set init_checkpoint \(got 'init_checkpoint=/tmp/x'\); a "
        r"claim's runs start from its SFT starts",
    ):
        reproduce.departures(claim, "testbed", "optim.lr=1e-4,init_checkpoint=/tmp/x")


def test_the_verdict_tables_command_names_the_arms_run():
    """A run of some of the claim's arms (--arms): its command reproduces it (the
    command left --arms out, so it named a run of every arm)."""
    claim = get_claim("magistral_async")
    pairs = [(start, seed) for start in (0, 1) for seed in range(3)]
    runs = {"sync": {p: _run(0.7, start=0.4) for p in pairs}}
    text, _, _ = reproduce.verdict_table(claim, _summary(runs, seeds=range(3)))
    assert "`python -m experiments.reproduce --claim magistral_async --starts 0,1 " in text
    assert "--seeds 0,1,2 --arms sync`" in text
    runs["async"] = runs["sync"]
    text, _, _ = reproduce.verdict_table(claim, _summary(runs, seeds=range(3)))
    assert "--arms" not in text


def test_the_verdict_tables_command_quotes_a_variant_for_the_shell():
    """A tuple variant has spaces and parentheses: unquoted, the command was not one a shell
    runs."""
    claim = get_claim("magistral_async")
    pairs = [(start, seed) for start in (0, 1) for seed in range(3)]
    runs = {arm: {p: _run(0.7, start=0.4) for p in pairs} for arm in ("sync", "async")}
    variant = "batch.response_buckets=(128, 256),optim.lr=3e-4"
    text, _, _ = reproduce.verdict_table(
        claim, _summary(runs, seeds=range(3)), variant=variant, exploratory=True
    )
    assert f"--seeds 0,1,2 --variant '{variant}'`" in text
    text, _, _ = reproduce.verdict_table(
        claim, _summary(runs, seeds=range(3)), variant="optim.lr=3e-4", exploratory=True
    )
    assert "--seeds 0,1,2 --variant optim.lr=3e-4`" in text


def test_a_premise_at_its_bound_is_met_through_float_rounding():
    """A start's mean that equals the bound but for the float rounding of the mean (0.409 +
    0.077 + 0.564 + 0.95 = 2.0 over 4, 0.936 + 0.93 + 0.984 = 2.85 over 3) meets it: the
    bound is inclusive, and 1 ulp off it is the arithmetic's, not the runs'."""
    floor = claims.Premise("share", "s", ("a", "b", "c", "d"), 0.5)
    runs = {arm: {(1, 0): {"s": v}} for arm, v in zip("abcd", (0.409, 0.077, 0.564, 0.95))}
    result = floor.measure(runs, [(1, 0)])
    assert result["start_values"][1] < 0.5  # 0.49999999999999994
    assert result["met"] is True
    gate = claims.Premise("gate", "g", ("a", "b", "c"), 0.95, at_most=True)
    runs = {arm: {(1, 0): {"g": v}} for arm, v in zip("abc", (0.936, 0.93, 0.984))}
    result = gate.measure(runs, [(1, 0)])
    assert result["start_values"][1] > 0.95 and result["met"] is True
    # A real departure, however small against the figures' 3 digits, is not.
    runs["a"][(1, 0)]["g"] = 0.9363
    assert gate.measure(runs, [(1, 0)])["met"] is False


def test_a_premise_refuses_a_bad_definition():
    """No arm, an arm named twice (its runs would count twice in the mean), a bound that
    is not finite, and no metric: each a one-line error naming the field."""
    with pytest.raises(ValueError, match="Premise 'p': arms must name at least one arm"):
        claims.Premise("p", "m", (), 0.5)
    with pytest.raises(ValueError, match="Premise 'p': arm 'a' is named twice"):
        claims.Premise("p", "m", ("a", "b", "a"), 0.5)
    with pytest.raises(ValueError, match="Premise 'p': bound must be finite, got nan"):
        claims.Premise("p", "m", ("a",), float("nan"))
    with pytest.raises(ValueError, match="Premise 'p': metric must name a run summary's key"):
        claims.Premise("p", "", ("a",), 0.5)


def _gate_summary(gates, fit=True):
    """sapo_grid's claim runs from hand: every SAPO arm at each (start, seed) with the gate
    of its start (``gates[start]``; None: not logged), GRPO beside it."""
    claim = get_claim("sapo_grid")
    pairs = [(start, seed) for start in claim.starts for seed in claim.seeds]
    arms = {
        arm: {
            p: {
                **_run(0.5, start=0.4),
                "collapse_iteration": 61,
                **({} if gates[p[0]] is None else {"loss/gate_mean_run": gates[p[0]]}),
            }
            for p in pairs
        }
        for arm in claim.arm_labels()
    }
    return claim, _summary(arms, starts=claim.starts, seeds=claim.seeds)


def test_a_premise_figure_never_rounds_onto_its_bound():
    """verdict.md shows a premise's figures with 3 significant digits, more where those
    would land on the bound (or past it) while the figure is not there: a gate of 0.9504
    against <= 0.95, unmet, reads 0.9504, not 0.95."""
    claim, summary = _gate_summary({0: 0.9504, 1: 0.9504})
    text, verdict, _ = reproduce.verdict_table(claim, summary)
    assert verdict == "inconclusive"
    assert "| <= 0.95 | 0.9504 | 0.9504 / 0.9504 | 90 | no |" in text
    assert "start 0 0.9504 / start 1 0.9504 (<= 0.95 at each start)" in text
    claim, summary = _gate_summary({0: 0.93, 1: 0.9504})
    text, _, _ = reproduce.verdict_table(claim, summary)
    assert "| <= 0.95 | 0.94 | 0.93 / 0.9504 | 90 | no |" in text
    claim, summary = _gate_summary({0: 0.93, 1: 0.94})  # met, 3 digits
    text, _, _ = reproduce.verdict_table(claim, summary)
    assert "| <= 0.95 | 0.935 | 0.93 / 0.94 | 90 | yes |" in text


def test_a_premise_not_measured_is_not_said_to_be_unmet():
    """A premise without its figure (a metric not logged, its arms not run) leaves the claim
    undecided, but verdict.md must not say the checks ran outside the regime: that is not
    known. It names the first run without the figure."""
    claim, summary = _gate_summary({0: 0.9, 1: None})
    text, verdict, _ = reproduce.verdict_table(claim, summary)
    assert verdict == "inconclusive"
    assert "Outside its regime" not in text and "does not act" not in text
    assert (
        "**Regime not measured**: SAPO's mean gate weight over a run (mean over the SAPO "
        "arms): not measured at 45 of 90 runs (neg0p8 at start 1, seed 0 the first). "
        "Whether the checks ran where the mechanism acts is not known; the claim is not "
        "decided (its checks alone: " in text
    )
    # Unmet at one start and not measured at none: outside its regime, as before.
    claim, summary = _gate_summary({0: 0.9, 1: 0.99})
    text, _, _ = reproduce.verdict_table(claim, summary)
    assert "**Outside its regime**: SAPO's mean gate weight" in text
    assert "Regime not measured" not in text


def test_every_premise_arm_logs_its_figure_in_each_of_the_claims_settings():
    """Each premise's metric is a key `experiments.ablate` summarises, and every arm the
    premise names is configured to log it in each of the claim's settings: the routing
    share on an MoE policy with routing metrics and a sampler that records its routing
    (the paged engine records it under R3 only), SAPO's gate on SAPO arms, the critic's
    fit after a warm-up on arms whose critic pretrains."""
    from policyopt.advantages import uses_critic
    from policyopt.models.presets import preset

    logged = {
        "routing/ratio_share_pooled",
        *ablate.POLICY_MEAN_METRICS.values(),
        ablate.WARMUP_EXPLAINED_VARIANCE,
    }
    for claim in CLAIMS.values():
        for premise in claim.premises:
            assert premise.metric in logged, (claim.name, premise.metric)
            for setting in claim.settings():
                for arm in premise.arms:
                    config = ablate.arm_config(
                        claim.ablation,
                        arm,
                        0,
                        claim.regime,
                        lambda c, setting=setting: SETTINGS[setting](c, "sft"),
                    )
                    where = (claim.name, setting, arm)
                    if premise.metric == "routing/ratio_share_pooled":
                        experts = config.model.num_experts or preset(config.model.preset)
                        experts = getattr(experts, "num_experts", experts)
                        assert config.train.routing_metrics and experts > 0, where
                        assert (
                            config.sampling.engine_kv_tokens == 0
                            or config.algo.routing_replay == "R3"
                        ), where
                    elif premise.metric == "loss/gate_mean_run":
                        assert config.algo.method == "sapo", where
                    else:
                        assert uses_critic(config.algo.advantage), where
                        assert config.critic.pretrain_iterations > 0, where


def test_the_docs_premise_table_is_the_code():
    """docs/claims.md's premise table names the claims that have premises, each premise's
    bound and its number of arms ("the 9 SAPO arms", "its 4 arms"), and its metric where it
    names one."""
    with open(os.path.join(ROOT, "docs", "claims.md")) as f:
        docs = f.read()
    table = docs[docs.index("| claim | premise | arms | bound |") :].split("\n\n", 1)[0]
    rows = [row.strip("|").split(" | ") for row in table.splitlines()[2:]]
    numbers = {"4": 4, "5": 5, "6": 6, "9": 9}
    documented = {}
    for claim_cell, premise_cell, arms_cell, bound_cell in rows:
        name = re.match(r"\[(\w+)\]", claim_cell.strip()).group(1)
        (count,) = [numbers[w] for w in arms_cell.split() if w in numbers]
        metric = re.search(r"`([^`]+)`", premise_cell)
        documented[name] = (count, bound_cell.strip(), metric and metric.group(1))
    code = {name: claim.premises for name, claim in CLAIMS.items() if claim.premises}
    assert set(documented) == set(code)
    for name, (premise,) in code.items():
        count, bound, metric = documented[name]
        assert (count, bound) == (len(premise.arms), premise.bound_text), name
        assert metric in (None, premise.metric), name


def test_the_headlines_report_the_premises_figure():
    """On one hand-made summary, each claim's last line gives its premise's figure as
    verdict.md measures it: one mean over the premise arms' runs (uneven values, a run of
    another arm beside them)."""
    for name, figure in (
        ("routing_replay", "high {:.3f};"),
        ("sapo_grid", "over the run {:.4f} with"),
        ("vc_ppo", "value pretraining {:.3f} (a perfect"),
        ("vapo_length_adaptive", "after its warm-up {:.3f}"),
    ):
        claim = get_claim(name)
        (premise,) = claim.premises
        pairs = [(start, seed) for start in claim.starts for seed in claim.seeds[:2]]
        arms = {
            arm: {
                p: {
                    **_run(0.5, start=0.4),
                    "collapsed": 0.0,
                    premise.metric: 0.3 + 0.01 * i + 0.001 * j,
                }
                for j, p in enumerate(pairs)
            }
            for i, arm in enumerate(claim.arm_labels())
        }
        summary = _summary(arms, starts=claim.starts, seeds=claim.seeds[:2])
        (measured,) = reproduce.premise_results(claim, summary)
        line = claim.headline({"summary": summary})
        assert figure.format(measured["value"]) in line, (name, line, measured["value"])


def test_the_list_names_each_premises_arms_and_bound(capsys):
    """--list gives a premise as verdict.md judges it: its metric, its bound at each SFT
    start, and the arms whose runs it is measured on."""
    reproduce._list()
    listed = " ".join(capsys.readouterr().out.split())  # the lines wrap at 100 columns
    (gate,) = get_claim("sapo_grid").premises
    assert (
        f"premise: {gate.text} (loss/gate_mean_run <= 0.95 at each SFT start, the mean over "
        f"the runs of {', '.join(gate.arms)})" in listed
    )
    for claim in CLAIMS.values():
        for premise in claim.premises:
            assert f"the runs of {', '.join(premise.arms)})" in listed, claim.name


def test_the_critic_warmup_line_never_rounds_onto_its_floor():
    """critic_warmup's last line judges the floor: a fit of 0.4996, not reached, reads
    0.4996 (not 0.500); a fit at the floor but for the mean's float rounding reaches it
    and reads 0.500."""
    warm = ablate.WARMUP_EXPLAINED_VARIANCE

    def line(*fits):
        runs = [{warm: fit} for fit in fits]
        return get_claim("critic_warmup").headline(
            {"summary": {"arms": [{"arm": "vc_ppo", "runs": runs}]}}
        )

    assert "0.4996 on a fresh rollout (Monte-Carlo returns; floor >= 0.5: not reached)" in (
        line(0.4996)
    )
    assert "0.500 on a fresh rollout (Monte-Carlo returns; floor >= 0.5: reached)" in (
        line(0.409, 0.077, 0.564, 0.95)
    )
    assert "0.612 on a fresh rollout (Monte-Carlo returns; floor >= 0.5: reached)" in line(0.612)


def test_the_critic_lines_name_the_runs_pretraining_and_their_settings_ceiling():
    """The critic claims' last lines give the value-pretraining count the runs had (a
    --variant's, else the claims' own) and a perfect critic's fit on the runs' setting,
    never the long task's figures for another task."""
    warm = ablate.WARMUP_EXPLAINED_VARIANCE
    runs = [{warm: 0.2}]

    def line(name, **result):
        arms = [{"arm": arm, "runs": runs} for arm in get_claim(name).arm_labels()]
        return get_claim(name).headline({"summary": {"arms": arms}, **result})

    own = claims.CRITIC_PRETRAIN_ITERATIONS
    assert f"after {own} iterations of value pretraining: 0.200" in line("critic_warmup")
    assert "start 0 -1.050, start 1 0.336, start 2 0.432" in line("critic_warmup")
    varied = line(
        "critic_warmup", setting="testbed", variant="critic.lr=1e-3,critic.pretrain_iterations=40"
    )
    assert "after 40 iterations of value pretraining: 0.200" in varied
    assert varied.endswith("a perfect critic's: start 0 0.741")
    assert line("critic_warmup", setting="testbed_long32").endswith(
        "a perfect critic's: not measured on testbed_long32"
    )
    vc = line("vc_ppo", setting="testbed_long32", variant="critic.pretrain_iterations=25")
    assert "after 25 iterations of value pretraining 0.200" in vc
    assert vc.endswith("(a perfect critic's: not measured on testbed_long32)")


def test_a_premise_unmet_at_a_complete_start_is_unmet_though_another_lacks_a_run():
    """Start 0's runs all have the gate and its mean is outside the bound: the premise is
    unmet whatever start 1's missing run holds (every start must be within), and verdict.md
    says so, giving start 1's mean over the runs it has as such."""
    claim, summary = _gate_summary({0: 0.99, 1: 0.9})
    for entry in summary["arms"]:
        if entry["arm"] == "neg1":
            for run in entry["runs"]:
                if (run["start"], run["seed"]) == (1, 4):
                    del run["loss/gate_mean_run"]
    (result,) = reproduce.premise_results(claim, summary)
    assert result["met"] is False and result["missing"] == 1
    text, verdict, _ = reproduce.verdict_table(claim, summary)
    assert verdict == "inconclusive" and "Regime not measured" not in text
    assert (
        "**Outside its regime**: SAPO's mean gate weight over a run (mean over the SAPO arms): "
        "start 0 0.99 / start 1 0.9 (44 of 45 runs) (<= 0.95 at each start)." in text
    )
    assert "| 89 of 90 | no |" in text
    # Start 0 within and start 1 missing a run: not measured, as before.
    claim, summary = _gate_summary({0: 0.9, 1: 0.9})
    summary["arms"][0]["runs"][-1].pop("loss/gate_mean_run")
    assert reproduce.premise_results(claim, summary)[0]["met"] is None


def test_a_contradicted_claim_outside_its_regime_reads_inconclusive():
    """sapo_grid whose every check is contradicted at every pair (GRPO ends above SAPO,
    the orderings reversed) but whose gate never acts: inconclusive, its checks' own
    verdict shown; with the gate acting, contradicted."""
    claim = get_claim("sapo_grid")
    pairs = [(start, seed) for start in claim.starts for seed in claim.seeds]
    collapse = {"neg1p25": 10, "neg1": 20, "pos1p25": 30, "neg1p05": 10, "grpo": 40}

    def summary(gate):
        arms = {
            arm: {
                p: {
                    **_run((0.9 if arm == "grpo" else 0.5) + 0.001 * i, start=0.4),
                    "collapse_iteration": collapse.get(arm, 25) + i,
                    "loss/gate_mean_run": gate,
                }
                for i, p in enumerate(pairs)
            }
            for arm in claim.arm_labels()
        }
        return _summary(arms, starts=claim.starts, seeds=claim.seeds)

    _, verdict, checks = reproduce.verdict_table(claim, summary(0.9))
    assert {c["verdict"] for c in checks} == {"contradicted"} and verdict == "contradicted"
    text, verdict, _ = reproduce.verdict_table(claim, summary(0.999))
    assert verdict == "inconclusive"
    assert text.startswith("# Claim `sapo_grid`: inconclusive at 2 SFT start(s) x 5 seed(s)")
    assert "the claim is not decided (its checks alone: contradicted)." in text


def test_the_headlines_never_round_a_premise_figure_onto_its_bound():
    """The last lines give the premises' figures with their usual digits, or more where
    those would put a figure beyond its bound on it: an unmet gate of 0.95004 reads
    0.95004, not 0.9500; a share or a fit of 0.4996 reads 0.4996, not 0.500."""
    for name, value, figure in (
        ("routing_replay", 0.4996, "high 0.4996;"),
        ("sapo_grid", 0.95004, "over the run 0.95004 with"),
        ("vc_ppo", 0.4996, "value pretraining 0.4996 (a perfect"),
        ("vapo_length_adaptive", 0.4996, "after its warm-up 0.4996"),
        ("sapo_grid", 0.9, "over the run 0.9000 with"),  # off the bound: the usual digits
        ("vc_ppo", 0.5, "value pretraining 0.500 (a perfect"),
    ):
        claim = get_claim(name)
        (premise,) = claim.premises
        runs = {(1, 0): {**_run(0.5, start=0.4), "collapsed": 0.0, premise.metric: value}}
        summary = _summary({arm: runs for arm in premise.arms}, starts=(1,), seeds=(0,))
        line = claim.headline({"summary": summary})
        assert figure in line, (name, line)
    # routing_share's check judges the same floor.
    run = {**_run(0.5, start=0.4), "routing/ratio_share_pooled": 0.4996, "routing/volatility": 0.01}
    summary = _summary({"gspo": {(1, 0): run}}, starts=(1,), seeds=(0,))
    assert (
        get_claim("routing_share")
        .headline({"summary": summary})
        .startswith("routing share 0.4996 (volatility")
    )


def _record_claim(claim, book, pairs, *, variant="", start_ids=None, value=0.07):
    """Records in ``book`` (a Ledger) the runs of ``claim``'s arms at ``pairs`` as a sweep
    on another machine would: its config key, a start's identity, hand-made figures."""
    for label in claim.arm_labels():
        for start, seed in pairs:

            def setting(config, start=start):
                checkpoint = os.path.join(reproduce.sft_dir("runs", claim.setting, start), "ck")
                return SETTINGS[claim.setting](config, checkpoint)

            config = ablate.arm_config(
                claim.ablation, label, seed, reproduce._join(claim.regime, variant), setting
            )
            key = ablate.run_config_key(config)
            run = {"regime": ablate.regime_of(config), "wall_s": 1.0, "iterations": 1}
            run["routing/volatility"] = value
            book.add(label, start, seed, (start_ids or {}).get(start, f"9-start{start}"), key, run)


def test_a_record_of_another_config_is_no_finished_run_left_out(tmp_path):
    """Judged from a fresh clone (no start, no run of its own), seeds 0-3 of a claim whose
    ledger also holds seed 4's runs of an older config of its arm (recorded beside the new
    ones, docs/claims.md): those are not finished runs of this sweep, so judging seeds
    0-3 leaves none out and is a sweep's progress, not a selection. A record of this
    config is left out."""
    claim = get_claim("routing_volatility")
    book = Ledger(str(tmp_path / "routing_volatility.jsonl"))
    _record_claim(claim, book, [(start, seed) for start in (0, 1) for seed in range(4)])
    _record_claim(claim, book, [(0, 4), (1, 4)], variant="optim.lr=4e-3")  # an older arm
    run = dict(seeds=(0, 1, 2, 3), sft_root=str(tmp_path / "none"), train=False)
    judged = reproduce.run_claim(claim, str(tmp_path / "claim"), **run, ledger=book.path)
    assert not judged["exploratory"], judged["verdict_md"][:300]
    assert "left out" not in judged["verdict_md"]
    _record_claim(claim, book, [(1, 4)])  # seed 4 of this config, finished at start 1
    judged = reproduce.run_claim(claim, str(tmp_path / "claim"), **run, ledger=book.path)
    assert judged["exploratory"]
    assert "the finished runs of (start 1, seed 4) are left out" in judged["verdict_md"]


def test_judged_from_a_fresh_clone_a_start_is_the_one_its_current_records_name(tmp_path):
    """The ledger holds start 0's runs of the arm's older config from the start as first
    trained ("9-old") and the current config's from the start trained again elsewhere
    ("9-new", recorded beside them, docs/claims.md). Judged without the start, only the
    records a run of this config can use name it: "9-new". Two identities with records of
    this config are still refused (choosing one would choose the verdict)."""
    claim = get_claim("routing_volatility")
    book = Ledger(str(tmp_path / "routing_volatility.jsonl"))
    pairs = [(start, seed) for start in (0, 1) for seed in range(5)]
    _record_claim(claim, book, pairs, variant="optim.lr=4e-3", start_ids={0: "9-old"})
    _record_claim(claim, book, pairs, start_ids={0: "9-new"})
    run = dict(sft_root=str(tmp_path / "none"), train=False, ledger=book.path)
    judged = reproduce.run_claim(claim, str(tmp_path / "claim"), **run)
    assert judged["checks"][0]["n"] == 10 and not judged["exploratory"]
    _record_claim(claim, book, [(0, 0)], start_ids={0: "9-other"})
    with pytest.raises(ValueError, match=r"holds records of 2 \(9-new, 9-other\) of it"):
        reproduce.run_claim(claim, str(tmp_path / "claim"), **run)


def test_two_sft_starts_of_one_identity_are_refused(tmp_path):
    """SFT starts 0 and 1 with the same saved bits (a start directory copied or linked to
    the other's, a setting whose SFT ignores the seed): a verdict over them would count
    one start twice, the spread between starts unsampled though the table says 2 starts."""
    claim = get_claim("routing_volatility")
    book = Ledger(str(tmp_path / "routing_volatility.jsonl"))
    pairs = [(start, seed) for start in (0, 1) for seed in range(5)]
    _record_claim(claim, book, pairs, start_ids={0: "9-same", 1: "9-same"})
    run = dict(sft_root=str(tmp_path / "none"), train=False, ledger=book.path)
    with pytest.raises(
        ValueError, match=r"SFT starts 0 and 1 are one start \(9-same: the same saved bits\)"
    ):
        reproduce.run_claim(claim, str(tmp_path / "claim"), **run)


def test_records_naming_a_start_as_start_id_did_before_are_that_starts_own(tmp_path):
    """start_id leaves out the optimiser state since the starts were kept in the repository
    (8d752f2): records and run directories written before name a start trained here by a
    digest of all its checksums (docs/claims/runs/routing_replay.jsonl). They are this
    start's runs (judged from the ledger, not refused as another start's), and only this
    start's: start 1's old identity does not stand for start 0."""
    import hashlib

    import numpy as np

    claim = get_claim("routing_volatility")
    sft_root = str(tmp_path / "sft")
    legacy = {}
    for start in (0, 1):
        directory = os.path.join(reproduce.sft_dir(sft_root, "testbed", start), "checkpoints")
        params = {"w": np.full(3, start, np.float32)}
        state = {"train": {"params": params, "opt_state": {"mu": np.ones(3, np.float32)}}}
        with Checkpointer(directory) as saved:
            saved.save(800, state, {"config": {}})  # testbed's sft.steps: finished
            sums = saved.checksums(800)
        text = json.dumps(sums, sort_keys=True, separators=(",", ":"))  # the old start_id
        legacy[start] = f"800-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        assert legacy[start] != start_id(directory)
    book = Ledger(str(tmp_path / "routing_volatility.jsonl"))
    _record_claim(claim, book, [(s, seed) for s in (0, 1) for seed in range(5)], start_ids=legacy)
    workdir = tmp_path / "claim"
    (workdir / "one_update" / "seed0").mkdir(parents=True)  # begun before, named the old way
    (workdir / "one_update" / "seed0" / ablate.START_FILE).write_text(
        json.dumps({"start_id": legacy[0]})
    )
    run = dict(sft_root=sft_root, train=False, ledger=book.path)
    judged = reproduce.run_claim(claim, str(workdir), **run)
    assert judged["checks"][0]["n"] == 10 and not judged["exploratory"]
    wrong = Ledger(str(tmp_path / "wrong.jsonl"))
    _record_claim(claim, wrong, [(0, 0)], start_ids={0: legacy[1]})
    _record_claim(claim, wrong, [(1, 0)], start_ids={1: legacy[1]})
    with pytest.raises(ValueError, match="one_update/seed0 is not finished"):
        reproduce.run_claim(claim, str(tmp_path / "other"), **dict(run, ledger=wrong.path))


def test_judged_from_a_fresh_clone_the_kept_start_names_its_records(tmp_path, monkeypatch):
    """The ledger holds runs of start 0 from two identities (two machines' starts, both
    recorded). Judged without the start, the one kept in the repository
    (docs/claims/starts, experiments.starts) is the start, as a sweep would restore it:
    its records are judged, not refused as a choice between two."""
    import numpy as np

    from configs import testbed
    from experiments import starts
    from policyopt.rl.loop import build

    claim = get_claim("routing_volatility")
    checkpoint = str(tmp_path / "trained" / "checkpoints")
    state = {"train": {"params": {"w": np.arange(3, dtype=np.float32)}}}
    with Checkpointer(checkpoint) as saved:
        saved.save(800, state, {"config": build.config_record(testbed.get_config())})
    kept = str(tmp_path / "kept")
    identity = starts.save_start(checkpoint, starts.start_path("testbed", 0, kept))
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    book = Ledger(str(tmp_path / "routing_volatility.jsonl"))
    pairs = [(start, seed) for start in (0, 1) for seed in range(5)]
    _record_claim(claim, book, pairs, start_ids={0: identity}, value=0.07)
    _record_claim(claim, book, [(0, 0)], start_ids={0: "9-other"}, value=0.01)
    run = dict(sft_root=str(tmp_path / "none"), train=False, ledger=book.path)
    judged = reproduce.run_claim(claim, str(tmp_path / "claim"), **run)
    assert judged["checks"][0]["n"] == 10
    assert not os.path.exists(tmp_path / "none")  # judging restores nothing either
