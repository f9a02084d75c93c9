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
    CRITIC_PRETRAIN_ITERATIONS,
    GSPO_GRPO_BASELINE,
    GSPO_VS_GRPO,
    OFF_POLICY,
    ROUTING_LEVELS,
    SAPO_UPDATES,
    VAPO_MATCHED_LAMBDA,
    VAPO_RESCALED_ALPHA,
    VAPO_RESCALED_MATCHED_LAMBDA,
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
    equivalent when within threshold -+ margin (`experiments.verdicts.judge`), by the
    exact test ``test`` names.
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
    # A finding the claim reports but does not rest on (a dose-response's lower levels): its
    # own Holm family, outside the claim's verdict (`experiments.verdicts.claim_verdict`).
    reported: bool = False

    def __post_init__(self):
        if self.kind not in CHECK_KINDS:
            raise ValueError(
                f"Check.kind must be one of {', '.join(CHECK_KINDS)}, got {self.kind!r}"
            )
        if (self.b is None) != (self.kind in ("gain", "value")):
            raise ValueError(f"a {self.kind!r} check takes {'no' if self.b else 'a'} second arm b")
        if (self.c is None or self.d is None) == (self.kind == "diff_of_diffs"):
            raise ValueError(f"arms c and d go with a 'diff_of_diffs' check, got {self.kind!r}")
        if self.margin is not None and not (math.isfinite(self.margin) and self.margin > 0):
            raise ValueError(f"Check.margin must be > 0 and finite (or None), got {self.margin}")

    def arms(self) -> tuple[str, ...]:
        return tuple(arm for arm in (self.a, self.b, self.c, self.d) if arm is not None)

    @property
    def test(self) -> str:
        """The exact test that decides the check (`experiments.verdicts.judge`): the
        sign-flip test where the null makes the quantity symmetric about the threshold by
        design, a comparison of two arms run at the same (start, seed) against 0 with no
        margin (under "no effect" the arms, or for "diff_of_diffs" the two gaps, are
        interchangeable); otherwise the sign test of the median. A "value" or "gain" is
        one arm's figure against a fixed threshold, skewed as it may be, and TOST's nulls
        sit at threshold -+ margin, where the arms differ: neither has the symmetry."""
        symmetric = self.kind in ("diff", "log10_ratio", "diff_of_diffs")
        return "sign-flip" if symmetric and self.threshold == 0 and self.margin is None else "sign"

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


#: A premise's mean within this relative distance of its bound is at the bound (met): the
#: float rounding of a mean, not the runs (`experiments.verdicts.TIE_RTOL` for a check).
PREMISE_RTOL = 1e-12


def at_bound(value: float, bound: float) -> bool:
    """Whether a premise's ``value`` is its ``bound``, to ``PREMISE_RTOL``."""
    return abs(value - bound) <= PREMISE_RTOL * max(abs(bound), abs(value), 1.0)


def bound_figure(value: float, bound: float, kind: str = "g", digits: int = 3) -> str:
    """A figure judged against ``bound``, with ``digits`` digits (``kind`` "g":
    significant, "f": decimals) or as many more as keep it off the bound: 0.9504 against
    0.95 reads 0.9504, not 0.95 (beyond it, it would read as at it); a figure at the bound
    (``at_bound``) reads as the bound; "-" when not finite."""
    if not math.isfinite(value):
        return "-"
    if at_bound(value, bound):
        value = bound
    for more in range(digits, 18):
        text = f"{value:.{more}{kind}}"
        if value == bound or (float(text) - bound) * (value - bound) > 0:
            return text
    return repr(value)


def _headline_figure(value: float, bound: float, digits: int = 3) -> str:
    """A premise's figure in a claim's last line: ``digits`` decimals, more where those
    would put it on its bound (``bound_figure``); "nan" when there is none."""
    return bound_figure(value, bound, "f", digits) if math.isfinite(value) else "nan"


@dataclasses.dataclass(frozen=True)
class Premise:
    """The regime a claim's mechanism needs, measured on the claim's own runs: the mean of
    ``metric`` over the runs of ``arms`` from each SFT start at least ``bound``
    (``at_most``: at most). A claim whose premise is not met, or not measured, is
    inconclusive whatever its checks find: they ran outside the regime the paper's finding
    is about, or may have (docs/claims.md, "Premises")."""

    text: str
    metric: str
    arms: tuple[str, ...]
    bound: float
    at_most: bool = False

    def __post_init__(self):
        if not self.metric:
            raise ValueError(f"Premise {self.text!r}: metric must name a run summary's key")
        if not self.arms:
            raise ValueError(f"Premise {self.text!r}: arms must name at least one arm")
        twice = next((a for i, a in enumerate(self.arms) if a in self.arms[:i]), None)
        if twice is not None:  # its runs would count twice in the mean
            raise ValueError(f"Premise {self.text!r}: arm {twice!r} is named twice")
        if not math.isfinite(self.bound):
            raise ValueError(f"Premise {self.text!r}: bound must be finite, got {self.bound}")

    @property
    def bound_text(self) -> str:
        """``>= 0.5`` or ``<= 0.95``."""
        return f"{'<=' if self.at_most else '>='} {self.bound:g}"

    def within(self, value: float) -> bool:
        """Whether ``value`` is within the bound (the bound itself included)."""
        beyond = value > self.bound if self.at_most else value < self.bound
        return not beyond or at_bound(value, self.bound)

    def measure(
        self, per_arm: dict[str, dict[tuple[int, int], dict]], pairs: Sequence[tuple[int, int]]
    ) -> dict:
        """``{"premise", "bound", "threshold", "value", "start_values", "start_runs",
        "start_missing", "runs", "missing", "first_missing", "met"}``: the mean of
        ``metric`` over the runs of ``arms`` at ``pairs``, and per SFT start (with the runs
        it has and lacks). Met when every start's mean is within the bound (``within``:
        each start's pairs ran in the regime, as a check's direction must hold at each
        start); unmet when the mean of a start that has all its runs is not; else None (not
        measured) when a run lacks a finite value (an arm not run at a pair, a metric not
        logged), ``first_missing`` ``(arm, start, seed)`` the first such run."""
        by_start: dict[int, list[float]] = {}
        start_missing: dict[int, int] = {}
        first_missing = None
        for arm in self.arms:
            for pair in pairs:
                value = per_arm.get(arm, {}).get(pair, {}).get(self.metric, math.nan)
                if math.isfinite(value):
                    by_start.setdefault(pair[0], []).append(value)
                else:
                    start_missing[pair[0]] = start_missing.get(pair[0], 0) + 1
                    first_missing = first_missing or (arm, *pair)
        values = [v for start in sorted(by_start) for v in by_start[start]]
        start_values = {s: statistics.fmean(by_start[s]) for s in sorted(by_start)}
        missing = sum(start_missing.values())
        outside = [
            s for s, v in start_values.items() if s not in start_missing and not self.within(v)
        ]
        met = False if outside else None if missing or not values else True
        return {
            "premise": self.text,
            "bound": self.bound_text,
            "threshold": self.bound,
            "value": statistics.fmean(values) if values else math.nan,
            "start_values": start_values,
            "start_runs": {s: len(by_start[s]) for s in sorted(by_start)},
            "start_missing": start_missing,
            "runs": len(values),
            "missing": missing,
            "first_missing": first_missing,
            "met": met,
        }


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
    # Each arm at its own learning rate (its arm variant's optim.lr, the best of a sweep):
    # a claim about step sizes (LoRA's ~10x); the regime then fixes the budget, not the lr.
    own_lr: bool = False
    # The regime its mechanism needs, measured on its runs (routing share, gate weight,
    # the critic's fit): unmet or unmeasured, the claim is inconclusive.
    premises: tuple[Premise, ...] = ()

    def __post_init__(self):
        named = {item.split("=", 1)[0].strip() for item in base.split_variant(self.regime)}
        if self.own_lr and "optim.lr" in named:
            raise ValueError(
                f"claim {self.name!r}: its arms run at their own optim.lr (own_lr); its "
                f"regime must not fix one, got {self.regime!r}"
            )
        required = [f for f in REGIME_REQUIRED if not (self.own_lr and f == "optim.lr")]
        missing = [field for field in required if field not in named]
        if missing:
            raise ValueError(
                f"claim {self.name!r}: its regime must fix {', '.join(missing)}, "
                f"got {self.regime!r}"
            )
        if len(set(self.starts)) < 2 and not self.diagnostic:
            raise ValueError(f"claim {self.name!r}: >= 2 SFT starts, got {self.starts}")
        for what, arms in [(f"check {c.text!r}", c.arms()) for c in self.checks] + [
            (f"premise {p.text!r}", p.arms) for p in self.premises
        ]:
            stray = [arm for arm in arms if arm not in self.arm_labels()]
            if stray:
                raise ValueError(
                    f"claim {self.name!r}: {what} names arm {stray[0]!r}, not "
                    f"one of {', '.join(self.arm_labels())}"
                )

    def arm_labels(self) -> tuple[str, ...]:
        return self.arms or tuple(a.label for a in self.ablation.arms)

    def per_arm_fields(self) -> tuple[str, ...]:
        """Regime fields in which the claim's arms may differ (``own_lr``: optim.lr)."""
        return ("optim.lr",) if self.own_lr else ()

    def settings(self) -> tuple[str, ...]:
        return (self.setting, *self.other_settings)


def _volatility_line(result: dict) -> str:
    values = result["checks"][0].get("values") or [math.nan]
    return f"routing volatility after one update: {statistics.fmean(values):.4f}"


#: The routing claims' learning rate and budget: lr 3e-5 on the long task, where routing's
#: share of the ratio's noise is largest while GSPO learns (0.38-0.39 at the routers' 1x-30x,
#: GSPO +0.215; at 1e-4 and 1e-3, and on the testbed, the parameters' own drift swamps it;
#: benchmarks/RESULTS.md "The routing share"), 100 iterations (the budget the share and the
#: gain floor were measured at; each long-task iteration costs ~6 testbed ones); the
#: routers' rate set per arm.
ROUTING_REGIME = "optim.lr=3e-5,train.num_iterations=100"
#: The regime diagnostic: the GSPO arm at the routing claim's "high" level.
ROUTING_SHARE = Ablation(
    "routing_share",
    "The share of the log-ratio's noise that routing causes (routing/ratio_share), GSPO on "
    "the long task with the routers at the routing claim's high level.",
    (
        Arm(
            "gspo",
            "gspo",
            f"algo.routing_replay=none,optim.router_lr_scale={ROUTING_LEVELS['high']:g}",
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
ROUTING_SHARE_BUDGET = (
    "measured 2026-12-07: 100 iterations of the long task 1,184 s beside another run (load "
    "~4 on 2 cores), 698 s (~12 min) with one other run paused; the SFT start cached"
)
SAPO_GRID_BUDGET = (
    "estimate from 188-388 s per 20-30-iteration run of the recipe's arm (2026-12-06, load "
    "12-17 on 2 cores): ~10-15 min per 60-iteration run, 10 arms x 2 starts x 5 seeds = 100 "
    "runs, ~17-25 h; both SFT starts cached"
)
MAGISTRAL_BUDGET = (
    "measured 2026-12-07 with another sweep beside it on 2 cores: 46-78 CPU s per run, "
    "~1 min, 0.29-0.34 CPU-hours per claim (20 runs); 18 min per (start, seed) at load ~25 "
    "(2026-12-06); a new SFT start ~15 min more"
)
ROUTING_REPLAY_BUDGET = (
    "measured 2026-12-07 (seed 0, 36 runs, two sweeps side by side on 2 cores): 740-1,380 "
    "CPU s per run (the asynchronous arms the longest), 12-25 min each, 10.2 CPU-hours per "
    "seed over both starts, so ~51 CPU-hours for 10 pairs, before 2026-12-08's host-memory "
    "change (the long task's iteration with routing metrics 1.34x faster since); the SFT "
    "starts are vc_ppo's"
)
DENSE_CONTROL_BUDGET = (
    "estimate (2026-12-07): one dense arm, ~8-12 min per (start, seed) pair; each SFT start "
    "of the dense long task (1000 steps, once) ~30 min idle"
)


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
    share = _headline_figure(mean("routing/ratio_share_pooled"), ROUTING_SHARE_FLOOR)
    return (
        f"routing share {share} (volatility "
        f"{mean('routing/volatility'):.4f} over the batch's {updates} updates) at lr "
        f"{regime['optim.lr']:g}; GSPO pass@1 {mean('pass@1_start'):.3f} -> "
        f"{mean('pass@1_end'):.3f}"
    )


#: Claim 3's learning rate and budget: lr 1e-4, the PPO-family recipes' own, at which
#: every arm learns from the long task's start (0.39 -> 0.52-0.61 in 20 iterations,
#: benchmarks/HISTORY.md 2026-12-04); the critic's warm-up comes on top.
CLAIM3_REGIME = "optim.lr=1e-4,train.num_iterations=20"
#: The run summary's critic fit after its warm-up (`experiments.ablate`, same name).
WARMUP_EXPLAINED_VARIANCE = "critic/warmup_explained_variance"
#: The critic's regime diagnostic: VC-PPO's arm through its warm-up (10 iterations as a
#: reward model, then value pretraining) and one PPO iteration, whose fresh rollout scores
#: the warmed-up critic; no evaluation.
CRITIC_WARMUP = Ablation(
    "critic_warmup",
    "The critic's held-out explained variance after its warm-up (VC-PPO's arm).",
    (Arm("vc_ppo", "vc_ppo"),),
    f"{OFF_POLICY},critic.pretrain_iterations={CRITIC_PRETRAIN_ITERATIONS},eval.num_prompts=0",
)
#: The explained variance a perfect critic reaches under each setting's SFT starts
#: (`python -m experiments.value_ceiling --setting S --start N`: the long task 2026-12-06,
#: the testbed's kept start 0 2026-12-07; benchmarks/RESULTS.md "The critic's regime").
VALUE_CEILINGS = {
    "testbed_long": {0: -1.05, 1: 0.336, 2: 0.432},
    "testbed": {0: 0.741},
}
#: The long task's claims run from starts 1 and 2, where the returns have variance for a
#: critic to explain (start 0 samples 0.8% correct answers: a perfect critic's ceiling -1.05).
LONG_TASK_STARTS = (1, 2)
#: Estimates from the arms' measured time on idle cores (~7 s per iteration of the long task,
#: benchmarks/HISTORY.md 2026-12-04: 207-268 s for 20 policy iterations + 15 of the
#: critic's warm-up); a loaded machine takes 3-10x.
CRITIC_WARMUP_BUDGET = (
    "estimate (2026-12-06, from 2026-12-04's arm times): 1 run of 10 + "
    "critic.pretrain_iterations + 1 iterations, ~2 min idle at 5 (~6 min at 40); the SFT "
    "start (1000 steps, once) 28 min idle"
)
VC_PPO_BUDGET = (
    "measured 2026-12-07/08 with two sweeps side by side on 2 cores: 342-382 CPU s per run, "
    "~285 since 2026-12-08's host-memory change, so ~5 CPU-hours for the 60 runs (6 arms x 2 "
    "starts x 5 seeds); SFT starts 1 and 2 once (28 min idle each)"
)
VAPO_BUDGET = (
    "estimate from 198-258 s per arm and seed (idle, 2026-12-04): 4 arms x 2 starts x 5 "
    "seeds = 40 runs of ~4 min, ~3 h idle at 10 pretraining iterations; the SFT starts are "
    "vc_ppo's"
)


def _arm_mean(result: dict, *arms: str, key: str) -> float:
    """The mean of ``key`` over the runs of ``arms`` in ``run_claim``'s result (NaN:
    none)."""
    values = [
        r[key]
        for entry in result["summary"]["arms"]
        if entry["arm"] in arms
        for r in entry["runs"]
        if key in r and math.isfinite(r[key])
    ]
    return statistics.fmean(values) if values else math.nan


#: SAPO's regime (issue floor): the mean gate weight over a run at most this, so that the
#: temperatures act on the gradient (docs/claims.md "sapo_grid", "Regime evidence").
SAPO_GATE_FLOOR = 0.95


def _sapo_gate_line(result: dict) -> str:
    """``SAPO's mean gate weight over the run G with M x E updates per batch at lr L; tau
    1.0 / 1.05 pass@1 A -> B; C of N SAPO runs collapsed``: G over the SAPO arms' runs
    (``loss/gate_mean_run``: the claim's premise, which verdict.md judges), A -> B the
    recipe's arm's means."""
    runs = [r for e in result["summary"]["arms"] if e["arm"] != "grpo" for r in e["runs"]]
    sapo_arms = [e["arm"] for e in result["summary"]["arms"] if e["arm"] != "grpo"]
    gate = _arm_mean(result, *sapo_arms, key="loss/gate_mean_run")
    regime = runs[0]["regime"] if runs else result["summary"]["arms"][0]["runs"][0]["regime"]
    updates = f"{regime['batch.n_minibatches']} x {regime['batch.epochs']}"
    collapsed = sum(r.get("collapsed", 0.0) for r in runs)
    gate_text = _headline_figure(gate, SAPO_GATE_FLOOR, 4)
    return (
        f"SAPO's mean gate weight over the run {gate_text} with {updates} updates per batch at "
        f"lr {regime['optim.lr']:g}; tau 1.0 / 1.05 pass@1 "
        f"{_arm_mean(result, 'neg1p05', key='pass@1_start'):.3f} -> "
        f"{_arm_mean(result, 'neg1p05', key='pass@1_end'):.3f}; {collapsed:g} of {len(runs)} "
        "SAPO runs collapsed"
    )


#: The routing claims' premise (issue floor): routing's pooled share of the log-ratio's
#: mean square, at least this at the high level.
ROUTING_SHARE_FLOOR = 0.5


def _routing_replay_line(result: dict) -> str:
    """``routing share by level (pooled over the MoE arms' runs): low A, mid B, high C;
    volatility low V1, mid V2, high V3`` (the high level's share is the claim's premise,
    which verdict.md judges)."""
    arms = [entry["arm"] for entry in result["summary"]["arms"]]

    def level_mean(level, key):
        return _arm_mean(result, *(a for a in arms if a.endswith(f"_{level}")), key=key)

    shares = {lv: level_mean(lv, "routing/ratio_share_pooled") for lv in ROUTING_LEVELS}
    volatility = {lv: level_mean(lv, "routing/volatility") for lv in ROUTING_LEVELS}
    return (
        "routing share by level (pooled over the MoE arms' runs): "
        + ", ".join(f"{lv} {_headline_figure(v, ROUTING_SHARE_FLOOR)}" for lv, v in shares.items())
        + "; volatility "
        + ", ".join(f"{lv} {v:.4f}" for lv, v in volatility.items())
    )


#: The critic claims' premise (issue floor): held-out explained variance after the warm-up.
CRITIC_FLOOR = 0.5


def _ceiling(result: dict) -> str:
    """A perfect critic's explained variance under each measured SFT start of the
    result's setting (the claim's own when the result does not name one)."""
    setting = result.get("setting") or "testbed_long"
    ceilings = VALUE_CEILINGS.get(setting)
    if not ceilings:
        return f"not measured on {setting}"
    return ", ".join(f"start {s} {c:.3f}" for s, c in sorted(ceilings.items()))


def _pretrain_iterations(result: dict) -> int:
    """The value-pretraining iterations the result's runs had: the ``--variant``'s
    ``critic.pretrain_iterations`` where it sets one, else the claims' own count."""
    count = CRITIC_PRETRAIN_ITERATIONS
    for item in base.split_variant(result.get("variant", "")):
        key, _, value = item.partition("=")
        if key.strip() == "critic.pretrain_iterations":
            count = int(float(value))
    return count


def _critic_warmup_line(result: dict) -> str:
    """``critic explained variance after N iterations of value pretraining: X on a fresh
    rollout (Monte-Carlo returns); a perfect critic's: start 0 C0, start 1 C1``."""
    value = _arm_mean(result, "vc_ppo", key=WARMUP_EXPLAINED_VARIANCE)
    reached = value >= CRITIC_FLOOR or at_bound(value, CRITIC_FLOOR)
    return (
        f"critic explained variance after {_pretrain_iterations(result)} iterations of value "
        f"pretraining: {_headline_figure(value, CRITIC_FLOOR)} on a fresh rollout "
        f"(Monte-Carlo returns; floor >= {CRITIC_FLOOR:g}: {'' if reached else 'not '}reached); "
        f"a perfect critic's: {_ceiling(result)}"
    )


#: vc_ppo's arms whose critic pretrains before PPO.
VC_PPO_PRETRAINED = (
    "ppo_pretrained",
    "vc_ppo_lambda_090",
    "vc_ppo",
    "vc_ppo_lambda_099",
    "vc_ppo_lambda_1",
)


def critic_premise(arms: tuple[str, ...]) -> Premise:
    """The lambda claims' premise: the critic, after its warm-up, explains at least
    ``CRITIC_FLOOR`` of the held-out returns' variance (the mean over ``arms``' runs)."""
    return Premise(
        "the critic's held-out explained variance after its warm-up",
        WARMUP_EXPLAINED_VARIANCE,
        arms,
        CRITIC_FLOOR,
    )


def _vc_ppo_line(result: dict) -> str:
    """The critic's held-out fit at PPO's first rollout, plain (its reward-model start) and
    after value pretraining (mean over the pretrained arms' runs: the claim's premise, which
    verdict.md judges), beside a perfect critic's."""
    fit = _arm_mean(result, *VC_PPO_PRETRAINED, key=WARMUP_EXPLAINED_VARIANCE)
    return (
        "critic explained variance at PPO's first rollout: plain PPO (reward-model start) "
        f"{_arm_mean(result, 'ppo', key=WARMUP_EXPLAINED_VARIANCE):.3f}, after "
        f"{_pretrain_iterations(result)} iterations of value pretraining "
        f"{_headline_figure(fit, CRITIC_FLOOR)} (a perfect "
        f"critic's: {_ceiling(result)})"
    )


def _vapo_line(result: dict) -> str:
    """The adaptive lambdas' token means over the policy's iterations beside their fixed
    controls, and the critic's fit after its warm-up (mean over the arms' runs: the claim's
    premise, which verdict.md judges)."""
    key = "advantages/lambda_policy_token_mean"
    arms = CLAIMS["vapo_length_adaptive"].arm_labels()
    fit = _arm_mean(result, *arms, key=WARMUP_EXPLAINED_VARIANCE)
    return (
        f"length-adaptive lambda's token mean over the policy's iterations: "
        f"{_arm_mean(result, 'vapo', key=key):.3f} at alpha 0.05 (control "
        f"{VAPO_MATCHED_LAMBDA:g}), {_arm_mean(result, 'vapo_rescaled', key=key):.3f} at "
        f"alpha {VAPO_RESCALED_ALPHA:g} (control {VAPO_RESCALED_MATCHED_LAMBDA:g}); critic "
        f"explained variance after its warm-up {_headline_figure(fit, CRITIC_FLOOR)}"
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
            setting="testbed_long",
            other_settings=("testbed", "testbed_long32"),
            regime=ROUTING_REGIME,
            checks=(
                Check(
                    "routing causes >= half of the log-ratio's mean square (pooled over the run)",
                    "value",
                    "gspo",
                    metric="routing/ratio_share_pooled",
                    threshold=ROUTING_SHARE_FLOOR,
                ),
                Check(
                    "GSPO learns: held-out pass@1 +0.10 over its start",
                    "gain",
                    "gspo",
                    threshold=0.10,
                ),
            ),
            starts=LONG_TASK_STARTS[:1],
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
            setting="testbed_long",
            other_settings=("testbed",),
            starts=LONG_TASK_STARTS,
            regime=ROUTING_REGIME,
            # The high level (the paper's regime) and the growth decide the claim; the lower
            # levels' checks are reported, each level's finding, in a family of their own.
            checks=tuple(
                dataclasses.replace(check, reported=level != "high")
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
                        f"{level}: R3 is no worse than R2 in the asynchronous loop (no harm: "
                        "within 0.05 pass@1, or above)",
                        "diff",
                        f"grpo_R3_async_{level}",
                        f"grpo_R2_async_{level}",
                        margin=0.05,
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
            premises=(
                Premise(
                    "the high level's routing share of the log-ratio's noise (pooled over "
                    "each run; mean over the level's MoE arms)",
                    "routing/ratio_share_pooled",
                    tuple(
                        arm.label
                        for arm in ABLATIONS["routing_dose"].arms
                        if arm.label.endswith("_high")
                    ),
                    ROUTING_SHARE_FLOOR,
                ),
            ),
            budget=ROUTING_REPLAY_BUDGET,
            headline=_routing_replay_line,
        ),
        Claim(
            name="routing_dense_control",
            source="The routing claim's control: on a dense policy of the testbed's depth and "
            "width (no routing to replay), GRPO without replay learns at the routing claim's "
            "learning rate.",
            ablation=DENSE_CONTROL,
            setting="testbed_long_dense",
            other_settings=("testbed_dense",),
            starts=LONG_TASK_STARTS,
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
            premises=(
                Premise(
                    "SAPO's mean gate weight over a run (mean over the SAPO arms)",
                    "loss/gate_mean_run",
                    tuple(a.label for a in ABLATIONS["sapo_grid"].arms if a.label != "grpo"),
                    SAPO_GATE_FLOOR,
                    at_most=True,
                ),
            ),
            budget=SAPO_GRID_BUDGET,
            headline=_sapo_gate_line,
        ),
        Claim(
            name="critic_warmup",
            source="VC-PPO (2503.01491) and VAPO (2504.05118) pretrain the value model on the "
            "SFT policy's Monte-Carlo returns until its loss and explained variance converge. "
            "Regime diagnostic of the vc_ppo and vapo_length_adaptive claims: the critic's "
            "explained variance on a fresh rollout after its warm-up, against the ceiling a "
            "perfect critic reaches under the SFT policy (experiments/value_ceiling.py).",
            ablation=CRITIC_WARMUP,
            setting="testbed_long",
            regime=CLAIM3_REGIME.replace("train.num_iterations=20", "train.num_iterations=1"),
            checks=(
                Check(
                    "the critic explains >= half of the held-out returns' variance",
                    "value",
                    "vc_ppo",
                    metric=WARMUP_EXPLAINED_VARIANCE,
                    threshold=CRITIC_FLOOR,
                ),
            ),
            other_settings=("testbed_long32", "testbed"),
            starts=(1,),
            seeds=(0,),
            diagnostic=True,
            budget=CRITIC_WARMUP_BUDGET,
            headline=_critic_warmup_line,
        ),
        Claim(
            name="vc_ppo",
            source="VC-PPO (2503.01491): value pretraining removes PPO's early collapse on "
            "long responses; lambda_actor in [0.95, 1) works best, 1.0 worst.",
            ablation=ABLATIONS["vc_ppo"],
            setting="testbed_long",
            regime=CLAIM3_REGIME,
            checks=(
                Check(
                    "PPO with value pretraining ends above plain PPO",
                    "diff",
                    "ppo_pretrained",
                    "ppo",
                ),
                *(
                    Check(
                        f"lambda_actor {lam} ends above 1.0 (1.0 worst)",
                        "diff",
                        arm,
                        "vc_ppo_lambda_1",
                    )
                    for lam, arm in (
                        ("0.9", "vc_ppo_lambda_090"),
                        ("0.95", "vc_ppo"),
                        ("0.99", "vc_ppo_lambda_099"),
                    )
                ),
                *(
                    Check(
                        f"lambda_actor {lam} ends above 0.9 ([0.95, 1) best)",
                        "diff",
                        arm,
                        "vc_ppo_lambda_090",
                    )
                    for lam, arm in (("0.95", "vc_ppo"), ("0.99", "vc_ppo_lambda_099"))
                ),
            ),
            other_settings=("testbed_long32",),
            starts=LONG_TASK_STARTS,
            premises=(critic_premise(VC_PPO_PRETRAINED),),
            budget=VC_PPO_BUDGET,
            headline=_vc_ppo_line,
        ),
        Claim(
            name="vapo_length_adaptive",
            source="VAPO (2504.05118): the length-adaptive lambda_policy = 1 - 1/(alpha |y|) "
            "beats a fixed lambda when response lengths vary widely. The control is a fixed "
            "lambda equal to the adaptive one's mean over the tokens, so that the arms differ "
            "in how lambda varies with length, not in its level.",
            ablation=ABLATIONS["vapo"],
            setting="testbed_long",
            regime=CLAIM3_REGIME,
            checks=(
                Check(
                    "length-adaptive lambda (alpha 0.05) ends above the fixed lambda of its "
                    "token mean",
                    "diff",
                    "vapo",
                    "fixed_matched",
                ),
                Check(
                    "length-adaptive lambda (alpha rescaled to the task) ends above the fixed "
                    "lambda of its token mean",
                    "diff",
                    "vapo_rescaled",
                    "fixed_matched_rescaled",
                ),
            ),
            arms=("vapo", "fixed_matched", "vapo_rescaled", "fixed_matched_rescaled"),
            # No other setting: the controls are measured on testbed_long's lengths
            # (testbed_long32's, about twice as long, give other token means).
            starts=LONG_TASK_STARTS,
            premises=(
                critic_premise(
                    ("vapo", "fixed_matched", "vapo_rescaled", "fixed_matched_rescaled")
                ),
            ),
            budget=VAPO_BUDGET,
            headline=_vapo_line,
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
        Claim(
            name="lora_rl",
            source="LoRA Without Regret (Schulman et al., Thinking Machines 2025): in RL with "
            "verifiable rewards LoRA, even at rank 1, matches full fine-tuning when applied to "
            "every layer (MLP and MoE included) at a ~10x larger learning rate; attention-only "
            "LoRA falls behind. Each arm at its own learning rate, the best of a one-seed "
            "sweep (docs/lora.md).",
            ablation=ABLATIONS["lora_rl"],
            setting="demo",
            regime="train.num_iterations=40",
            own_lr=True,
            checks=(
                Check(
                    "LoRA rank 1 on every layer learns (pass@1 end - start > 0)", "gain", "r1_all"
                ),
                *(
                    Check(
                        f"LoRA rank {r} on every layer ends within 0.05 of full fine-tuning "
                        "(no harm: equivalent within the margin)",
                        "diff",
                        f"r{r}_all",
                        "full",
                        margin=0.05,
                    )
                    for r in (1, 8, 32)
                ),
                Check(
                    "LoRA rank 8 on every layer ends above rank 8 on attention only",
                    "diff",
                    "r8_all",
                    "r8_attention",
                ),
            ),
            budget="measured 2026-12-07 with another sweep beside it on 2 cores: 40 "
            "iterations per arm and seed, 15-44 CPU s per run, 0.27 CPU-hours for the 50 runs "
            "(227-572 s per run at load 8-15 on 2026-12-06); the demo's SFT start (800 steps, "
            "~1 min) once per start on top",
        ),
    )
}


def get_claim(name: str) -> Claim:
    if name not in CLAIMS:
        raise ValueError(f"unknown claim {name!r}; known: {', '.join(CLAIMS)}")
    return CLAIMS[name]
