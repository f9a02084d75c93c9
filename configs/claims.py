"""The papers' claims that `experiments/reproduce.py` tests: each names the ablation that
tests it (`configs/ablations.py`), its setting, the regime it is judged at (learning rate,
budget), the SFT starts and seeds, and its checks. docs/claims.md describes each claim and
the verdict rule (`experiments/verdicts.py`); the budgets cite benchmarks/HISTORY.md by date.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Sequence

from configs import base
from configs.ablations import (
    ABLATIONS,
    GSPO_GRPO_BASELINE,
    GSPO_VS_GRPO,
    OFF_POLICY,
    ROUTING_LEVELS,
    SAPO_UPDATES,
    Ablation,
    Arm,
)

#: The routing-volatility measurement: one update (one iteration, one minibatch: the
#: claim's regime) of the testbed's own recipe (SAPO; at the first update r = 1 and every
#: objective gives the same policy gradient) from its SFT start, without evaluation.
ONE_UPDATE = Ablation(
    "routing_volatility",
    "GSPO (2507.18071 §5.3): on Qwen3-30B-A3B about 10% of the experts activated for the "
    "same rollout change after one gradient update; the testbed's target is >= 5%.",
    (Arm("one_update", "testbed"),),
    "train.routing_metrics=True,eval.num_prompts=0",
)

#: What a claim's regime must fix, so that no two of its runs differ in them.
REGIME_REQUIRED = ("optim.lr", "train.num_iterations")
CHECK_KINDS = ("diff", "gain", "value", "log10_ratio", "diff_of_diffs")


@dataclasses.dataclass(frozen=True)
class Check:
    """One measured comparison of a claim, a quantity per (SFT start, seed) pair.

    ``kind``: "diff" (arm ``a`` minus arm ``b``, same pair, of ``metric``), "gain" (arm
    ``a``'s pass@1 at the end minus at the start), "value" (arm ``a``'s ``metric``),
    "log10_ratio" (log10 of arm ``a``'s ``metric`` over arm ``b``'s, same pair) or
    "diff_of_diffs" ((a - b) - (c - d), same pair: a gap that grows). Supported
    when the quantity lies above ``threshold``; with a ``margin``, a "no harm" check,
    equivalent when within threshold -+ margin (`experiments.verdicts.judge`).
    """

    text: str
    kind: str
    a: str
    b: str | None = None
    metric: str = "pass@1_end"
    threshold: float = 0.0
    margin: float | None = None
    c: str | None = None  # "diff_of_diffs" only
    d: str | None = None

    def __post_init__(self):
        if self.kind not in CHECK_KINDS:
            raise ValueError(
                f"Check.kind must be one of {', '.join(CHECK_KINDS)}, got {self.kind!r}"
            )
        if (self.b is None) != (self.kind in ("gain", "value")):
            raise ValueError(f"a {self.kind!r} check takes {'no' if self.b else 'a'} second arm b")
        if (self.c is None or self.d is None) == (self.kind == "diff_of_diffs"):
            raise ValueError(f"arms c and d go with a 'diff_of_diffs' check, got {self.kind!r}")
        if self.margin is not None and not self.margin > 0:
            raise ValueError(f"Check.margin must be > 0 (or None), got {self.margin}")

    def arms(self) -> tuple[str, ...]:
        return tuple(arm for arm in (self.a, self.b, self.c, self.d) if arm is not None)

    def value(self, runs: Sequence[dict]) -> float:
        """The quantity from the runs of ``arms()`` at one pair (NaN when one lacks it)."""
        if self.kind == "gain":
            keys = ("pass@1_end", "pass@1_start")
            return (
                runs[0][keys[0]] - runs[0][keys[1]] if all(k in runs[0] for k in keys) else math.nan
            )
        if any(self.metric not in r for r in runs):
            return math.nan
        if self.kind == "value":
            return runs[0][self.metric]
        if self.kind == "diff":
            return runs[0][self.metric] - runs[1][self.metric]
        if self.kind == "diff_of_diffs":
            a, b, c, d = (r[self.metric] for r in runs)
            return (a - b) - (c - d)
        a, b = runs[0][self.metric], runs[1][self.metric]
        return math.log10(a / b) if a > 0 and b > 0 else math.nan

    def values(
        self, per_arm: dict[str, dict[tuple[int, int], dict]], pairs: Sequence[tuple[int, int]]
    ) -> tuple[list[float], list[int], int]:
        """The quantity over the (start, seed) ``pairs`` where it is finite, the start of each
        value, and how many pairs have none (an arm not run there, a metric not logged, or a
        value that is not finite, e.g. the log ratio of a zero clip fraction)."""
        values, starts, missing = [], [], 0
        for start, seed in pairs:
            runs = [per_arm.get(arm, {}).get((start, seed)) for arm in self.arms()]
            value = math.nan if any(r is None for r in runs) else self.value(runs)
            if math.isfinite(value):
                values.append(value)
                starts.append(start)
            else:
                missing += 1
        return values, starts, missing


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's claim: the ablation that tests it, where, in which regime, and its checks."""

    name: str
    source: str  # the paper and what it reports
    ablation: Ablation
    setting: str  # its own setting, a name of configs.ablations.SETTINGS
    # A variant every arm gets after its own: the learning rate and budget the claim is
    # judged at (at least REGIME_REQUIRED; minibatches, epochs, ... where the claim needs).
    regime: str
    checks: tuple[Check, ...]
    arms: tuple[str, ...] | None = None  # the ablation's arms run (None: all)
    other_settings: tuple[str, ...] = ()  # where else it may run (its own directory)
    starts: tuple[int, ...] = (0, 1)  # SFT starts (>= 2; --starts)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # RL seeds from each start (--seeds)
    budget: str = ""  # measured or estimated wall time on the 2-core machine
    headline: Callable[[dict], str] | None = None  # run_claim's result -> a last line
    # A regime diagnostic (a figure the other claims need, not a paper's finding): may run
    # from one SFT start.
    diagnostic: bool = False

    def __post_init__(self):
        named = {item.split("=", 1)[0].strip() for item in base.split_variant(self.regime)}
        missing = [field for field in REGIME_REQUIRED if field not in named]
        if missing:
            raise ValueError(
                f"claim {self.name!r}: its regime must fix {', '.join(missing)}, "
                f"got {self.regime!r}"
            )
        if len(set(self.starts)) < 2 and not self.diagnostic:
            raise ValueError(f"claim {self.name!r}: >= 2 SFT starts, got {self.starts}")
        for check in self.checks:
            stray = [arm for arm in check.arms() if arm not in self.arm_labels()]
            if stray:
                raise ValueError(
                    f"claim {self.name!r}: check {check.text!r} names arm {stray[0]!r}, not "
                    f"one of {', '.join(self.arm_labels())}"
                )

    def arm_labels(self) -> tuple[str, ...]:
        return self.arms or tuple(a.label for a in self.ablation.arms)

    def settings(self) -> tuple[str, ...]:
        return (self.setting, *self.other_settings)


def _volatility_line(result: dict) -> str:
    values = result["checks"][0].get("values") or [math.nan]
    return f"routing volatility after one update: {statistics.fmean(values):.4f}"


#: The routing claims' learning rate and budget: lr 1e-4 (the testbed's GSPO learns there;
#: at 1e-3 the parameters' own drift swamps routing), the routers' rate set per arm.
ROUTING_REGIME = "optim.lr=1e-4,train.num_iterations=100"
#: The regime diagnostic: the GSPO arm at the routing claim's "mid" level.
ROUTING_SHARE = Ablation(
    "routing_share",
    "The share of the log-ratio's noise that routing causes (routing/ratio_share), GSPO on "
    "the testbed with the routers at the routing claim's mid level.",
    (
        Arm(
            "gspo",
            "gspo",
            f"algo.routing_replay=none,optim.router_lr_scale={ROUTING_LEVELS['mid']:g}",
        ),
    ),
    OFF_POLICY + ",train.routing_metrics=True",
)
#: The dense control: GRPO (the GSPO paper's baseline) on `configs/testbed_dense.py`.
DENSE_CONTROL = Ablation(
    "routing_dense_control",
    "GRPO without replay on a dense policy (the routing claim's control).",
    (Arm("grpo", "grpo", GSPO_GRPO_BASELINE),),
    OFF_POLICY,
    reference="gspo",
    compares=GSPO_VS_GRPO,
)
ROUTING_SHARE_BUDGET = "to be measured"
SAPO_GRID_BUDGET = "to be measured"
MAGISTRAL_BUDGET = "to be measured"
ROUTING_REPLAY_BUDGET = "to be measured"
DENSE_CONTROL_BUDGET = "to be measured"


def _routing_share_line(result: dict) -> str:
    """``routing share X (volatility V over the batch's K updates) at lr L; GSPO pass@1
    A -> B``, means over the runs; X pooled over each run's iterations (sum of the routing
    parts' mean squares over the sum of both parts'), V over its last iterations."""
    (entry,) = result["summary"]["arms"]

    def mean(key):
        values = [r[key] for r in entry["runs"] if key in r]
        return statistics.fmean(values) if values else math.nan

    regime = entry["runs"][0]["regime"]
    updates = regime["batch.n_minibatches"] * regime["batch.epochs"]
    return (
        f"routing share {mean('routing/ratio_share_pooled'):.3f} (volatility "
        f"{mean('routing/volatility'):.4f} over the batch's {updates} updates) at lr "
        f"{regime['optim.lr']:g}; GSPO pass@1 {mean('pass@1_start'):.3f} -> "
        f"{mean('pass@1_end'):.3f}"
    )


CLAIMS: dict[str, Claim] = {
    c.name: c
    for c in (
        Claim(
            name="routing_volatility",
            source="GSPO (2507.18071 §5.3): ~10% of the experts activated for the same "
            "rollout change after one gradient update (Qwen3-30B-A3B, 48 layers x 128 "
            "experts, top-8).",
            ablation=ONE_UPDATE,
            setting="testbed",
            regime="optim.lr=5e-3,train.num_iterations=1,batch.n_minibatches=1",
            checks=(
                Check(
                    "routing volatility after one update >= 0.05 (the paper's regime)",
                    "value",
                    "one_update",
                    metric="routing/volatility",
                    threshold=0.05,
                ),
            ),
            budget="measured 2026-12-02 under load (8 jobs on 2 cores): each SFT start 18 "
            "min once (7.5 min at load 3-11; ~2 min idle, 2026-12-04), then 4 min for the "
            "first seed (compilation), 7 s per further seed",
            headline=_volatility_line,
        ),
        Claim(
            name="routing_share",
            source="GSPO (2507.18071 §5.3): on Qwen3-30B-A3B routing changes enough per update "
            "that GRPO needs routing replay. Regime diagnostic: the share of the ratio's noise "
            "that routing causes (routing/ratio_share) at a learning rate where GSPO learns.",
            ablation=ROUTING_SHARE,
            setting="testbed",
            regime=ROUTING_REGIME,
            checks=(
                Check(
                    "routing causes >= half of the log-ratio's mean square (pooled over the run)",
                    "value",
                    "gspo",
                    metric="routing/ratio_share_pooled",
                    threshold=0.5,
                ),
                Check(
                    "GSPO learns: held-out pass@1 +0.10 over its start",
                    "gain",
                    "gspo",
                    threshold=0.10,
                ),
            ),
            starts=(0,),
            seeds=(0,),
            diagnostic=True,
            budget=ROUTING_SHARE_BUDGET,
            headline=_routing_share_line,
        ),
        Claim(
            name="routing_replay",
            source="GSPO (2507.18071): on an MoE policy GRPO without routing replay fails to "
            "converge; R2 (GSPO) and R3 (2510.11370) restore it; GSPO converges without "
            "replay. As a dose-response: the more of the ratio's noise routing causes, the "
            "more GRPO without replay falls behind.",
            ablation=ABLATIONS["routing_dose"],
            setting="testbed",
            regime=ROUTING_REGIME,
            checks=tuple(
                check
                for level in ROUTING_LEVELS
                for check in (
                    Check(
                        f"{level}: GRPO with R2 ends above GRPO without replay",
                        "diff",
                        f"grpo_R2_{level}",
                        f"grpo_{level}",
                    ),
                    Check(
                        f"{level}: GRPO with R3 ends above GRPO without replay (asynchronous)",
                        "diff",
                        f"grpo_R3_async_{level}",
                        f"grpo_async_{level}",
                    ),
                    Check(
                        f"{level}: GSPO ends above GRPO without replay",
                        "diff",
                        f"gspo_{level}",
                        f"grpo_{level}",
                    ),
                    Check(f"{level}: GSPO without replay learns", "gain", f"gspo_{level}"),
                )
            )
            + (
                Check(
                    "R2's gain over no replay grows from the low to the high level",
                    "diff_of_diffs",
                    "grpo_R2_high",
                    "grpo_high",
                    c="grpo_R2_low",
                    d="grpo_low",
                ),
                Check(
                    "GSPO's lead over GRPO grows from the low to the high level",
                    "diff_of_diffs",
                    "gspo_high",
                    "grpo_high",
                    c="gspo_low",
                    d="grpo_low",
                ),
            ),
            budget=ROUTING_REPLAY_BUDGET,
        ),
        Claim(
            name="routing_dense_control",
            source="The routing claim's control: on a dense policy of the testbed's depth and "
            "width (no routing to replay), GRPO without replay learns at the routing claim's "
            "learning rate.",
            ablation=DENSE_CONTROL,
            setting="testbed_dense",
            regime=ROUTING_REGIME,
            checks=(Check("dense GRPO without replay learns", "gain", "grpo"),),
            budget=DENSE_CONTROL_BUDGET,
        ),
        Claim(
            name="sapo_grid",
            source="SAPO (2511.20347): tau_neg > tau_pos is the most stable choice, equal "
            "temperatures in between, tau_neg < tau_pos the least; SAPO is more stable than "
            "GRPO. Stability as the time to collapse (the training accuracy's 3-iteration "
            "mean below half its start) and the share of runs that collapse.",
            ablation=ABLATIONS["sapo_grid"],
            setting="testbed",
            regime=f"optim.lr=1e-4,train.num_iterations=60,{SAPO_UPDATES}",
            checks=(
                Check(
                    "tau_neg 1.25 > tau_pos 1.0 collapses later than equal temperatures",
                    "diff",
                    "neg1p25",
                    "neg1",
                    metric="collapse_iteration",
                ),
                Check(
                    "equal temperatures collapse later than tau_pos 1.25 > tau_neg 1.0",
                    "diff",
                    "neg1",
                    "pos1p25",
                    metric="collapse_iteration",
                ),
                Check(
                    "SAPO (tau 1.0 / 1.05) collapses later than GRPO without KL",
                    "diff",
                    "neg1p05",
                    "grpo",
                    metric="collapse_iteration",
                ),
                Check(
                    "SAPO (tau 1.0 / 1.05) ends above GRPO without KL", "diff", "neg1p05", "grpo"
                ),
            ),
            budget=SAPO_GRID_BUDGET,
        ),
        Claim(
            name="vc_ppo",
            source="VC-PPO (2503.01491): value pretraining removes PPO's early collapse on "
            "long responses; lambda_actor 1.0 is worse than 0.95.",
            ablation=ABLATIONS["vc_ppo"],
            setting="testbed_long",
            regime="optim.lr=1e-4,train.num_iterations=20",
            checks=(
                Check(
                    "PPO with value pretraining ends above plain PPO",
                    "diff",
                    "ppo_pretrained",
                    "ppo",
                ),
                Check(
                    "VC-PPO (lambda_actor 0.95) ends above lambda_actor 1.0",
                    "diff",
                    "vc_ppo",
                    "vc_ppo_lambda_1",
                ),
            ),
            other_settings=("testbed_long32",),
            budget="measured idle 2026-12-04: 4 arms x 20 policy iterations (+10 of the "
            "critic as a reward model, +5 of value pretraining in 3 arms), 207-268 s per arm "
            "and seed, ~45 min at 3 seeds, so ~2.7 h at 2 starts x 5 seeds (estimate); "
            "each check apart (--arms ppo,ppo_pretrained or --arms vc_ppo,vc_ppo_lambda_1) "
            "half of that; each SFT start (1000 steps, once) 28 min; --setting "
            "testbed_long32: 45 min at one seed (2026-12-03)",
        ),
        Claim(
            name="vapo_length_adaptive",
            source="VAPO (2504.05118): the length-adaptive lambda_policy = 1 - 1/(alpha |y|) "
            "beats a fixed lambda when response lengths vary widely.",
            ablation=ABLATIONS["vapo"],
            setting="testbed_long",
            regime="optim.lr=1e-4,train.num_iterations=20",
            checks=(
                Check(
                    "length-adaptive lambda ends above a fixed 0.95",
                    "diff",
                    "vapo",
                    "no_length_adaptive",
                ),
            ),
            arms=("vapo", "no_length_adaptive"),
            other_settings=("testbed_long32",),
            budget="measured idle 2026-12-04: 2 arms x 20 policy iterations (+10 of the "
            "critic as a reward model, +5 of value pretraining), 198-258 s per arm and "
            "seed, 23 min at 3 seeds, so ~75 min at 2 starts x 5 seeds (estimate); each "
            "SFT start (vc_ppo's) once on top",
        ),
        *(
            Claim(
                name=name,
                source="Magistral (2506.10910): asynchronous generation with in-flight weight "
                "updates and no off-policy correction keeps learning, no worse than the "
                f"synchronous loop; here at {what}.",
                ablation=ABLATIONS["magistral_async"],
                setting="testbed",
                regime=f"optim.lr={lr},train.num_iterations=60",
                checks=(
                    Check(
                        "asynchronous Magistral learns (pass@1 end - start > 0)", "gain", "async"
                    ),
                    Check(
                        "asynchronous Magistral ends within 0.05 of the synchronous loop "
                        "(no harm: equivalent within the margin)",
                        "diff",
                        "async",
                        "sync",
                        margin=0.05,
                    ),
                ),
                arms=("sync", "async"),
                budget=MAGISTRAL_BUDGET,
            )
            for name, lr, what in (
                ("magistral_async", "1e-4", "the recipe's learning rate (1e-4)"),
                ("magistral_async_lr3e-4", "3e-4", "3x the recipe's learning rate"),
                ("magistral_async_lr1e-3", "1e-3", "10x the recipe's learning rate"),
            )
        ),
    )
}


def get_claim(name: str) -> Claim:
    if name not in CLAIMS:
        raise ValueError(f"unknown claim {name!r}; known: {', '.join(CLAIMS)}")
    return CLAIMS[name]
