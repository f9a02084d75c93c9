"""Reproduces the papers' MoE and stability claims where a 2-core CPU can test them: one
command per claim trains its arms over seeds (through `experiments.ablate`, resumable),
then prints and writes a table of the measured figures (mean +- std over seeds) and a
verdict per claim.

    python -m experiments.reproduce --list
    python -m experiments.reproduce --claim routing_volatility --seeds 0
    python -m experiments.reproduce --claim routing_replay --seeds 0,1,2 [--arms grpo,gspo]
    python -m experiments.reproduce --claim vc_ppo --setting testbed_long32 --seeds 0

Settings (`configs/ablations.py` SETTINGS): "testbed" (`configs/testbed.py`: the demo's
wrong-carry addition on `moe_volatile`, 4 layers of 32 experts top-4, whose routing
changes by >= 5% per update) and "testbed_long" (`configs/testbed_long.py`: the same MoE
on remainders by repeated subtraction, responses of ~11 to ~195 tokens); ``--setting``
runs a claim in another, e.g. "testbed_long32" (`configs/testbed_long32.py`: twice the
chain, responses of up to ~403 tokens, whose SFT start continues testbed_long's). Each
setting's SFT start is trained once and cached under ``--sft_root``
(``runs/<setting>/sft``, like the demo's ``runs/demo/sft``). A claim's runs go to
``--workdir/<claim>/<arm>/seed<N>`` (``--workdir/<claim>-<setting>/...`` in another setting);
rerunning the command resumes an interrupted sweep where it stopped (finished runs are
not trained again). ``--workdir/<claim>`` then holds the ablation's ``summary.json`` /
``summary.md``, ``curves.png`` and ``verdict.md``.

**Verdicts.** Each claim is a list of checks, each a per-seed quantity compared with a
threshold: a paired difference between two arms at the same seed (threshold 0), an arm's
gain in held-out pass@1 over its start, or a measured figure against the paper's regime.
Over n seeds with mean m and sample std s, the half-width of the 95% interval is
h = t_{0.975, n-1} s / sqrt(n) (Student's t); a check is *supported* when m - h >
threshold, *contradicted* when m + h < threshold, and *inconclusive at this seed count*
otherwise (always with one seed: no spread). The effect size is m - threshold, reported
with s. A claim is supported when all its checks are, contradicted when any is, and
inconclusive otherwise.

Budgets on the 2-core machine (benchmarks/RESULTS.md "Fourteenth session" to
"Twenty-second session"; the SFT starts once per setting on top): ``Claim.budget``
(``--list`` prints it), measured on a machine shared with other jobs (load 2-14) unless
it says idle. The testbed's claims fit the target of 30 minutes per claim at 3 seeds with
``--variant train.num_iterations=20``: ~3 min for a 3- or 4-arm claim idle (9-18 s per
arm and seed, ~15-token responses), 2-6 min per arm and seed under load. The long task's
claims take 3.5-4.5 min per arm and seed idle (10 reward-model iterations, value
pretraining, 20 of PPO, ~7 s each): vapo_length_adaptive's 2 arms fit, vc_ppo's 4 take
~45 min at 3 seeds, its two checks ~21-24 min each when run apart (``--arms
ppo,ppo_pretrained``, ``--arms vc_ppo,vc_ppo_lambda_1``).

Claim 3 needs a policy that RL improves: from an SFT start of the right procedure alone
(greedy pass@1 0.72) no method improved in 20 iterations at any step size ("Eighteenth
session" to "Twenty-first session", also on responses of up to ~400 tokens, ``--setting
testbed_long32``). The long task's SFT solutions now follow, half of them, a wrong
procedure that stops one subtraction early; from that start (0.39) every PPO-family arm
learns (0.54-0.61 at 3 seeds, "Twenty-second session"), so the collapse VC-PPO describes
would show beside a learning baseline. It does not: plain PPO ends level with the best
arm in held-out pass@1, though its training batches score lowest at every seed.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import statistics
from typing import Callable, Sequence

from absl import app, flags

from configs import base
from configs.ablations import ABLATIONS, SETTINGS, Ablation, Arm
from experiments import ablate
from policyopt.metrics import quiet_library_logging
from policyopt.rl.sft import run_sft
from policyopt.runtime import keep_freed_host_memory

#: Student's t quantile t_{0.975, df} for df = 1..30 (two-sided 95%); 1.96 beyond.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)

#: The routing-volatility measurement: one update (one iteration, one minibatch) of the
#: testbed's own recipe (SAPO; at the first update r = 1 and every objective gives the
#: same policy gradient) from its SFT start, without evaluation.
ONE_UPDATE = Ablation(
    "routing_volatility",
    "GSPO (2507.18071 §5.3): on Qwen3-30B-A3B about 10% of the experts activated for the "
    "same rollout change after one gradient update; the testbed's target is >= 5%.",
    (Arm("one_update", "testbed"),),
    "train.num_iterations=1,batch.n_minibatches=1,train.routing_metrics=True,eval.num_prompts=0",
)


@dataclasses.dataclass(frozen=True)
class Check:
    """One measured comparison of a claim.

    ``kind``: "diff" (arm ``a`` minus arm ``b``, same seed, of ``metric``), "gain" (arm
    ``a``'s pass@1 at the end minus at the start), "value" (arm ``a``'s ``metric``) or
    "log10_ratio" (log10 of arm ``a``'s ``metric`` over arm ``b``'s, same seed).
    Supported when the per-seed quantity exceeds ``threshold`` (see the module doc).
    """

    text: str
    kind: str
    a: str
    b: str | None = None
    metric: str = "pass@1_end"
    threshold: float = 0.0

    def arms(self) -> tuple[str, ...]:
        return (self.a,) if self.b is None else (self.a, self.b)

    def values(self, per_arm: dict[str, dict[int, dict]], seeds: Sequence[int]) -> list[float]:
        """The per-seed quantity over the seeds where every arm it needs logged it."""
        out = []
        for seed in seeds:
            runs = [per_arm.get(arm, {}).get(seed) for arm in self.arms()]
            if any(r is None for r in runs):
                continue
            if self.kind == "gain":
                if "pass@1_end" in runs[0] and "pass@1_start" in runs[0]:
                    out.append(runs[0]["pass@1_end"] - runs[0]["pass@1_start"])
                continue
            if any(self.metric not in r for r in runs):
                continue
            if self.kind == "value":
                out.append(runs[0][self.metric])
            elif self.kind == "diff":
                out.append(runs[0][self.metric] - runs[1][self.metric])
            elif self.kind == "log10_ratio":
                a, b = runs[0][self.metric], runs[1][self.metric]
                out.append(math.log10(a / b) if a > 0 and b > 0 else math.nan)
            else:
                raise ValueError(
                    f"Check.kind must be diff, gain, value or log10_ratio, got {self.kind!r}"
                )
        return [v for v in out if math.isfinite(v)]


@dataclasses.dataclass(frozen=True)
class Claim:
    name: str
    source: str  # the paper and what it reports
    ablation: Ablation
    setting: str  # a name of configs.ablations.SETTINGS
    checks: tuple[Check, ...]
    arms: tuple[str, ...] | None = None  # the ablation's arms run (None: all)
    budget: str = ""  # measured or estimated wall time on the 2-core machine

    def arm_labels(self) -> tuple[str, ...]:
        return self.arms or tuple(a.label for a in self.ablation.arms)


CLAIMS: dict[str, Claim] = {
    c.name: c
    for c in (
        Claim(
            "routing_volatility",
            "GSPO (2507.18071 §5.3): ~10% of the experts activated for the same rollout change "
            "after one gradient update (Qwen3-30B-A3B, 48 layers x 128 experts, top-8).",
            ONE_UPDATE,
            "testbed",
            (
                Check(
                    "routing volatility after one update >= 0.05 (the paper's regime)",
                    "value",
                    "one_update",
                    metric="routing/volatility",
                    threshold=0.05,
                ),
            ),
            budget="measured under load (8 jobs on 2 cores): SFT start 18 min once (7.5 min "
            "at load 3-11), then 4 min "
            "for the first seed (compilation), 7 s per further seed",
        ),
        Claim(
            "routing_replay",
            "GSPO (2507.18071): on an MoE policy GRPO without routing replay fails to converge; "
            "R2 (GSPO) and R3 (2510.11370) restore it; GSPO converges without replay; GSPO's "
            "clip acts on two orders of magnitude more tokens than GRPO's and still learns "
            "more efficiently.",
            ABLATIONS["routing_replay"],
            "testbed",
            (
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
            budget="measured idle (twenty-second session): 4 arms x 3 seeds x 20 iterations "
            "in ~3 min after the SFT start (2 min, once; 9-16 s per arm and seed); under "
            "load (fifteenth session) 1-2.5 min per arm and seed at load ~2-5, 16 min at "
            "load ~10",
        ),
        Claim(
            "sapo_tau",
            "SAPO (2511.20347): tau_neg > tau_pos is the most stable choice, equal temperatures "
            "in between, tau_neg < tau_pos the least.",
            ABLATIONS["sapo_tau"],
            "testbed",
            (
                Check(
                    "tau_neg > tau_pos ends above equal temperatures", "diff", "neg_gt_pos", "equal"
                ),
                Check(
                    "equal temperatures end above tau_neg < tau_pos", "diff", "equal", "neg_lt_pos"
                ),
            ),
            budget="measured idle (twenty-second session, lr 1e-3): 3 arms x 3 seeds x 20 "
            "iterations in ~3 min after the SFT start; under load 11-14 (fifteenth session) "
            "8.4 min at one seed",
        ),
        Claim(
            "sapo_stability",
            "SAPO (2511.20347): SAPO is more stable than GRPO and GSPO at the same step size "
            "(each with its paper's method settings, 4 updates per batch).",
            ABLATIONS["objectives"],
            "testbed",
            (
                Check("SAPO ends above GRPO", "diff", "sapo", "grpo"),
                Check("SAPO ends above GSPO", "diff", "sapo", "gspo"),
            ),
            arms=("grpo", "gspo", "sapo"),
            budget="measured idle (twenty-second session, lr 1e-3): 3 arms x 3 seeds x 20 "
            "iterations in ~3 min after the SFT start; under load 12-13 (fifteenth session) "
            "12 min at one seed",
        ),
        Claim(
            "vc_ppo",
            "VC-PPO (2503.01491): value pretraining removes PPO's early collapse on long "
            "responses; lambda_actor 1.0 is worse than 0.95.",
            ABLATIONS["vc_ppo"],
            "testbed_long",
            (
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
            budget="measured idle (twenty-second session): 4 arms x 20 iterations (+10 of "
            "the critic as a reward model, +5 of value pretraining in 3 arms), 207-268 s per "
            "arm and seed, 15 min at one seed, ~45 min at 3 seeds, over the 30-min target; "
            "each check apart (--arms ppo,ppo_pretrained or --arms vc_ppo,vc_ppo_lambda_1) "
            "~21-24 min at 3 seeds; the SFT start (1000 steps, once) 28 min; --setting "
            "testbed_long32: 45 min at one seed (twenty-first session)",
        ),
        Claim(
            "vapo_length_adaptive",
            "VAPO (2504.05118): the length-adaptive lambda_policy = 1 - 1/(alpha |y|) beats a "
            "fixed lambda when response lengths vary widely.",
            ABLATIONS["vapo"],
            "testbed_long",
            (
                Check(
                    "length-adaptive lambda ends above a fixed 0.95",
                    "diff",
                    "vapo",
                    "no_length_adaptive",
                ),
            ),
            arms=("vapo", "no_length_adaptive"),
            budget="measured idle (twenty-second session): 2 arms x 3 seeds x 20 "
            "iterations (+10 of the critic as a reward model, +5 of value pretraining), "
            "198-258 s per arm and seed, 23 min at 3 seeds (the SFT start of vc_ppo's "
            "setting, once, on top)",
        ),
        Claim(
            "magistral_async",
            "Magistral (2506.10910): asynchronous generation with in-flight weight updates and "
            "no off-policy correction keeps learning at Magistral's step sizes.",
            ABLATIONS["magistral_async"],
            "testbed",
            (
                Check("asynchronous Magistral learns (pass@1 end - start > 0)", "gain", "async"),
                Check(
                    "asynchronous Magistral ends within 0.05 of the synchronous loop "
                    "(async - sync > -0.05)",
                    "diff",
                    "async",
                    "sync",
                    threshold=-0.05,
                ),
            ),
            arms=("sync", "async"),
            budget="measured (load 9-12): 2 arms x 1 seed x 20 iterations, 6.2 min after the "
            "SFT start (3.9 / 2.3 min, compilation 98 / 26 s; both collapse at lr 5e-3, "
            "2-20 s per iteration); at lr 1e-3 (learning) 3 seeds 15.5 min",
        ),
        Claim(
            "lora_rl",
            "LoRA Without Regret (Schulman et al., Thinking Machines 2025): in RL with "
            "verifiable rewards LoRA, even at rank 1, matches full fine-tuning when applied to "
            "every layer (MLP and MoE included) at a ~10x larger learning rate; attention-only "
            "LoRA falls behind.",
            ABLATIONS["lora_rl"],
            "demo",
            (
                Check(
                    "LoRA rank 1 on every layer learns (pass@1 end - start > 0)", "gain", "r1_all"
                ),
                *(
                    Check(
                        f"LoRA rank {r} on every layer ends within 0.05 of full fine-tuning "
                        f"(r{r} - full > -0.05)",
                        "diff",
                        f"r{r}_all",
                        "full",
                        threshold=-0.05,
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
            budget="see docs/lora.md (the step-size sweep, one seed)",
        ),
    )
}


def get_claim(name: str) -> Claim:
    if name not in CLAIMS:
        raise ValueError(f"unknown claim {name!r}; known: {', '.join(CLAIMS)}")
    return CLAIMS[name]


def select_arms(claim: Claim, arms: Sequence[str] | None) -> tuple[str, ...]:
    """The claim's arms, or those of ``arms`` (each must be one of the claim's)."""
    known = claim.arm_labels()
    if not arms:
        return known
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise ValueError(
            f"claim {claim.name!r} has no arm {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(known)}"
        )
    return tuple(arms)


def select_setting(claim: Claim, setting: str | None) -> str:
    """``setting`` (one of ``configs.ablations.SETTINGS``), or the claim's own when None."""
    name = setting or claim.setting
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}")
    return name


def judge(values: Sequence[float], threshold: float) -> dict:
    """The verdict of one check from its per-seed quantity (module doc: Student's t).

    Returns:
      ``{"n", "mean", "std", "half_width", "effect", "verdict"}``; ``effect`` = mean -
      threshold; ``verdict`` one of "supported", "contradicted", "inconclusive", or
      "not run" when no seed measured it.
    """
    n = len(values)
    if n == 0:
        return {"n": 0, "verdict": "not run"}
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if n > 1 else math.nan
    if n > 1:
        half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * std / math.sqrt(n)
    else:
        half = math.inf
    if mean - half > threshold:
        verdict = "supported"
    elif mean + half < threshold:
        verdict = "contradicted"
    else:
        verdict = "inconclusive"
    return {
        "n": n,
        "mean": mean,
        "std": std,
        "half_width": half,
        "effect": mean - threshold,
        "verdict": verdict,
    }


def claim_verdict(verdicts: Sequence[str]) -> str:
    """Supported when every check is, contradicted when any is, else inconclusive."""
    if any(v == "contradicted" for v in verdicts):
        return "contradicted"
    if verdicts and all(v == "supported" for v in verdicts):
        return "supported"
    return "inconclusive"


def per_arm_runs(summary: dict) -> dict[str, dict[int, dict]]:
    """``{arm: {seed: that run's summary}}`` from an ``ablate.run_ablation`` summary."""
    return {entry["arm"]: {s["seed"]: s for s in entry["seeds"]} for entry in summary["arms"]}


def verdict_table(claim: Claim, summary: dict) -> tuple[str, list[dict]]:
    """The Markdown of ``verdict.md`` (the claim, the arms' figures, a verdict per check)
    and the checks' results."""
    seeds = summary["seeds"]
    runs = per_arm_runs(summary)
    results = []
    for check in claim.checks:
        values = check.values(runs, seeds)
        results.append({"check": check.text, "values": values, **judge(values, check.threshold)})
    overall = claim_verdict([r["verdict"] for r in results if r["verdict"] != "not run"])

    def fmt(x):
        return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:+.4f}"

    setting = summary.get("setting") or claim.setting
    command = (
        f"python -m experiments.reproduce --claim {claim.name} --seeds {','.join(map(str, seeds))}"
    )
    if setting != claim.setting:
        command += f" --setting {setting}"
    if summary["variant"]:
        command += f" --variant {summary['variant']}"
    lines = [
        f"# Claim `{claim.name}`: {overall} at {len(seeds)} seed(s)",
        "",
        claim.source,
        "",
        f"Setting `{setting}`; seeds {seeds}; `{command}`; {summary['date']}.",
        "",
        "| check | n | effect (mean - threshold) | std | 95% half-width | verdict |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['check']} | {r['n']} | {fmt(r.get('effect'))} | "
            f"{fmt(r.get('std'))} | {fmt(r.get('half_width'))} | {r['verdict']} |"
        )
    lines += [
        "",
        "Verdict rule: supported when mean - h > threshold, contradicted when mean + "
        "h < threshold, h = t(0.975, n-1) std / sqrt(n); inconclusive otherwise (always "
        "at one seed).",
        "",
        ablate.format_table(summary).replace("# Ablation", "## Ablation"),
    ]
    return "\n".join(lines) + "\n", results


#: The fields of a claim's variant that its SFT start is trained with: besides the sft,
#: task, model and eval sections, the sequence limits SFT pads to and evaluates with (a
#: longer task, e.g. ``task.max_steps=32`` on testbed_long, needs longer buckets).
SFT_VARIANT_SECTIONS = ("sft", "task", "model", "eval")
SFT_VARIANT_FIELDS = ("batch.prompt_buckets", "batch.response_buckets", "sampling.max_new_tokens")


def sft_variant(variant: str) -> str:
    """The items of ``variant`` that the SFT start reads (``SFT_VARIANT_SECTIONS``,
    ``SFT_VARIANT_FIELDS``), in order; "" when none."""
    items = []
    for item in base.split_variant(variant) if variant else []:
        key = item.split("=", 1)[0].strip()
        if key.split(".")[0] in SFT_VARIANT_SECTIONS or key in SFT_VARIANT_FIELDS:
            items.append(item)
    return ",".join(items)


def ensure_sft(setting: str, sft_root: str, variant: str = "") -> str:
    """The checkpoint directory of ``setting``'s SFT start, trained once into
    ``sft_root/<setting>/sft`` (resumed if interrupted, reused once finished) with
    ``configs/<setting>.py`` and the items of ``variant`` it reads (``sft_variant``).
    A variant that changes those items needs its own ``sft_root``: the cached start
    refuses to resume under a different task or geometry.

    A recipe module that names an ``SFT_PARENT`` setting (`configs/testbed_long32.py`)
    continues that setting's start, made first the same way (the variant's items apply
    to both), to its own ``sft.steps`` in all."""
    module = importlib.import_module(f"configs.{setting}")
    parent = getattr(module, "SFT_PARENT", None)
    init = ensure_sft(parent, sft_root, variant) if parent else None
    config = module.get_config(sft_variant(variant) or None)
    workdir = os.path.join(sft_root, setting, "sft")
    summary = run_sft(
        config,
        workdir,
        init_checkpoint=init,
        recipe=f"configs/{setting}.py (SFT start"
        + (f", continuing {parent}'s)" if parent else ")"),
    )
    if summary.get("interrupted"):
        raise SystemExit(
            f"SFT start of {setting!r} interrupted ({summary['interrupted']}); rerun to resume"
        )
    return summary["checkpoint_dir"]


def run_claim(
    claim: Claim,
    workdir: str,
    *,
    seeds: Sequence[int] = (0,),
    variant: str = "",
    arms: Sequence[str] | None = None,
    sft_root: str = "runs",
    setting: str | None = None,
    configure: Callable | None = None,
    quiet: bool = True,
) -> dict:
    """Trains (or resumes) the claim's arms over ``seeds`` and judges it.

    Args:
      claim: from ``CLAIMS``.
      workdir: the claim's directory (its runs, summary, curves.png and verdict.md).
      seeds: one run per arm and seed.
      variant: appended to every arm (and its ``sft.``/``task.``/``model.``/``eval.``
        items to the SFT start's config).
      arms: a subset of the claim's arms (default all).
      sft_root: where the settings' SFT starts are cached (``<sft_root>/<setting>/sft``).
      setting: another of ``configs.ablations.SETTINGS`` than the claim's own (e.g.
        "testbed_long32" for claim 3 on responses of up to ~400 tokens).
      configure: ``config -> config`` applied to each arm's config (``ablate.run_ablation``).
      quiet: no per-iteration console line.

    Returns:
      ``{"claim", "verdict", "checks", "summary", "verdict_md"}``.
    """
    labels = select_arms(claim, arms)
    name = select_setting(claim, setting)
    checkpoint = ensure_sft(name, sft_root, variant)
    base_setting = SETTINGS[name]

    def apply_setting(config):
        return base_setting(config, checkpoint)

    apply_setting.__name__ = name
    summary = ablate.run_ablation(
        claim.ablation,
        workdir,
        seeds=seeds,
        variant=variant,
        setting=apply_setting,
        arms=labels,
        configure=configure,
        quiet=quiet,
    )
    text, results = verdict_table(claim, summary)
    with open(os.path.join(workdir, "verdict.md"), "w") as f:
        f.write(text)
    overall = claim_verdict([r["verdict"] for r in results if r["verdict"] != "not run"])
    return {
        "claim": claim.name,
        "verdict": overall,
        "checks": results,
        "summary": summary,
        "verdict_md": text,
    }


def define_flags() -> None:
    flags.DEFINE_string("claim", None, f"One of: {', '.join(CLAIMS)}.")
    flags.DEFINE_list("seeds", ["0"], "Seeds, one run per arm and seed.")
    flags.DEFINE_string("workdir", "runs/reproduce", "Claims' directories go under it.")
    flags.DEFINE_string("sft_root", "runs", "Cache of the settings' SFT starts.")
    flags.DEFINE_string("variant", "", "Variant appended to every arm, key=value,...")
    flags.DEFINE_list("arms", None, "Only these arms of the claim (labels).")
    flags.DEFINE_string(
        "setting",
        None,
        "Run the claim in another setting than its own (configs/ablations.py SETTINGS, e.g. "
        "testbed_long32: claim 3 on responses of up to ~400 tokens).",
    )
    flags.DEFINE_bool("list", False, "List the claims, their sources, arms and budgets.")


def main(argv):
    del argv
    args = flags.FLAGS
    if args.list:
        for claim in CLAIMS.values():
            print(f"{claim.name} ({claim.setting}): {claim.source}")
            where = (
                "configs/ablations.py"
                if claim.ablation.name in ABLATIONS
                else "experiments/reproduce.py"
            )
            print(f"    arms: {', '.join(claim.arm_labels())} ({where} {claim.ablation.name!r})")
            print(f"    budget on 2 cores: {claim.budget}")
        return
    if not args.claim:
        raise app.UsageError(f"--claim is required (or --list); known: {', '.join(CLAIMS)}")
    try:
        claim = get_claim(args.claim)
        select_arms(claim, args.arms)
        select_setting(claim, args.setting)
    except ValueError as error:
        raise app.UsageError(str(error)) from error
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    result = run_claim(
        claim,
        # Another setting's runs go beside the claim's own, not over them.
        os.path.join(
            args.workdir,
            claim.name if args.setting in (None, claim.setting) else f"{claim.name}-{args.setting}",
        ),
        seeds=[int(s) for s in args.seeds],
        variant=args.variant,
        arms=args.arms,
        sft_root=args.sft_root,
        setting=args.setting,
        quiet=False,
    )
    print(result["verdict_md"])
    if claim.name == "routing_volatility":
        values = result["checks"][0]["values"]
        print(f"routing volatility after one update: {statistics.fmean(values):.4f}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
