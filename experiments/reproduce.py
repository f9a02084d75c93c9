"""Reproduces the papers' claims where a 2-core CPU can test them: one command per claim
trains its arms in the claim's own regime (learning rate, budget) over SFT starts x seeds,
resumably (`experiments.ablate`), then writes ``verdict.md``: the figures and a verdict per
check by the rule of `experiments.verdicts`. docs/claims.md has the rule and the claims.

    python -m experiments.reproduce --list
    python -m experiments.reproduce --claim routing_volatility --seeds 0
    python -m experiments.reproduce --claim routing_replay [--starts 0,1] [--seeds 0,1,2]
    python -m experiments.reproduce --claim vc_ppo --setting testbed_long32
    python -m experiments.reproduce --claim magistral_async --rejudge   # trains nothing

A ``--variant`` that changes what an arm trains is exploratory: its runs go to
``<workdir>/<claim>-exploratory/<variant>``, never among the claim's own. The claim's own
finished runs are kept in ``docs/claims/runs/<claim>.jsonl`` (`experiments.ledger`), where
a sweep on another machine, or ``--rejudge`` in a fresh clone, finds them; the SFT starts
they name are kept in ``docs/claims/starts`` (`experiments.starts`) and restored where the
cache lacks them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import math
import os
import re
import shlex
from typing import Callable, Collection, Mapping, Sequence

from absl import flags

from configs import base
from configs.ablations import ABLATIONS, SETTINGS
from configs.claims import CLAIMS, Claim, bound_figure, get_claim
from experiments import ablate, cli
from experiments.ledger import LEDGER_DIR, Ledger, ledger_path, legacy_start_id, start_id
from experiments.starts import is_kept, kept_identity, kept_start_id, use_kept_start
from experiments.verdicts import claim_verdict, judge
from policyopt.checkpoint import unlock_workdir
from policyopt.metrics import quiet_library_logging
from policyopt.rl.reporting.report import wrap
from policyopt.rl.sft import run_sft
from policyopt.runtime import keep_freed_host_memory


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
    """``setting`` (one of the claim's ``settings()``), or the claim's own when None."""
    name = setting or claim.setting
    if name not in claim.settings():
        raise ValueError(
            f"claim {claim.name!r} has no setting {name!r}; its settings: "
            f"{', '.join(claim.settings())}"
        )
    return name


def _join(*variants: str) -> str:
    return ",".join(v for v in variants if v)


def departures(claim: Claim, setting: str, variant: str) -> list[str]:
    """The config fields in which ``variant`` changes an arm of ``claim`` from the claim's
    definition (its regime in ``setting``), the loop's cadence and logging (``train.*``
    but ``train.num_iterations``) aside: a run with any is exploratory. A variant that
    sets ``init_checkpoint`` (every start's runs from one checkpoint) is a ValueError."""
    if not variant:
        return []
    for item in base.split_variant(variant):
        if item.split("=", 1)[0].strip() == "init_checkpoint":
            raise ValueError(
                f"--variant may not set init_checkpoint (got {item.strip()!r}); a claim's "
                "runs start from its SFT starts (--starts, --sft_root)"
            )

    def own(config):
        return SETTINGS[setting](config, "sft")

    fields = set()
    for label in claim.arm_labels():
        defined = ablate.arm_config(claim.ablation, label, 0, claim.regime, own)
        varied = ablate.arm_config(claim.ablation, label, 0, _join(claim.regime, variant), own)
        fields |= {
            field
            for field in ablate.config_diff(defined, varied)
            if not field.startswith("train.") or field == "train.num_iterations"
        }
    return sorted(fields)


def claim_dir(root: str, claim: Claim, setting: str | None = None, variant: str = "") -> str:
    """A claim's directory under ``root``: ``<claim>`` (``<claim>-<setting>`` in another of
    its settings); an exploratory variant's runs go to ``<that>-exploratory/<variant>``
    (the variant's characters outside ``[A-Za-z0-9._=,+-]`` as ``_``, a long one cut and
    hashed)."""
    name = select_setting(claim, setting)
    directory = claim.name if name == claim.setting else f"{claim.name}-{name}"
    if not departures(claim, name, variant):
        return os.path.join(root, directory)
    slug = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", variant)
    if len(slug) > 80:
        slug = f"{slug[:64]}-{hashlib.sha1(variant.encode()).hexdigest()[:8]}"
    return os.path.join(root, f"{directory}-exploratory", slug)


def per_arm_runs(summary: dict) -> dict[str, dict[tuple[int, int], dict]]:
    """``{arm: {(start, seed): that run's summary}}`` from an ``ablate.run_ablation``
    summary."""
    return {
        entry["arm"]: {(r["start"], r["seed"]): r for r in entry["runs"]}
        for entry in summary["arms"]
    }


def one_regime(runs: Sequence[tuple[str, dict]], per_arm: Sequence[str] = ()) -> dict:
    """The regime (``ablate.regime_of``) that labelled runs ``[(label, regime)]`` share;
    a ValueError naming the first field in which two differ, and the two runs. Fields in
    ``per_arm`` (``Claim.per_arm_fields``) may differ between arms (labels ``arm/run``),
    not between one arm's runs; they are left out of the shared regime."""
    if not runs:
        raise ValueError("verdict table refused: the summary holds no runs")
    first_label, first = runs[0]
    arm_of = {}
    for label, regime in runs:
        arm = label.split("/", 1)[0]
        for field in per_arm:
            seen = arm_of.setdefault((arm, field), (label, regime.get(field)))
            if seen[1] != regime.get(field):
                raise ValueError(
                    f"verdict table refused: {field} is {seen[1]!r} in {seen[0]} but "
                    f"{regime.get(field)!r} in {label}; one arm's starts and seeds must "
                    "share it"
                )
    first = {k: v for k, v in first.items() if k not in per_arm}
    for label, regime in runs[1:]:
        for field, value in first.items():
            if regime.get(field) != value:
                raise ValueError(
                    f"verdict table refused: {field} is {value!r} in {first_label} but "
                    f"{regime.get(field)!r} in {label}; a claim's arms, starts and seeds "
                    "must share one learning rate and budget"
                )
    return first


def _fmt(x, sign: str = "+") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:{sign}.4f}"


def _describe(regime: dict) -> str:
    lr = f"lr {regime['optim.lr']:g}" if "optim.lr" in regime else "each arm at its own lr"
    return (
        f"{lr}, {regime['train.num_iterations']} policy iteration"
        f"{'' if regime['train.num_iterations'] == 1 else 's'}, "
        f"{regime['batch.n_prompts']} prompts x {regime['batch.group_size']} samples, "
        f"{regime['batch.n_minibatches']} minibatch(es) x {regime['batch.epochs']} epoch(s), "
        f"<= {regime['sampling.max_new_tokens']} new tokens"
    )


#: How the verdict table names a check's test and the centre it is about.
TEST_LABELS = {"sign-flip": "sign-flip (mean)", "sign": "sign (median)"}


def check_threshold(result: dict) -> str:
    """A check's threshold as the table shows it: ``0``, or ``0 ± 0.05`` with a margin."""
    text = f"{result.get('threshold', 0):g}"
    return text + (f" ± {result['margin']:g}" if result.get("margin") else "")


def pairs_beyond(claim: Claim, starts: Sequence[int], seeds: Sequence[int]) -> list[str]:
    """The SFT starts and seeds outside the claim's definition, as text ("seeds 5, 6"):
    a verdict over them is exploratory, since adding seeds until a check passes (optional
    stopping) reaches any verdict."""
    return [
        f"{kind} {', '.join(map(str, extra))}"
        for kind, extra in (
            ("starts", sorted(set(starts) - set(claim.starts))),
            ("seeds", sorted(set(seeds) - set(claim.seeds))),
        )
        if extra
    ]


def pairs_left_out(
    claim: Claim,
    workdir: str,
    arms: Sequence[str],
    starts: Sequence[int],
    seeds: Sequence[int],
    ledger: Ledger | None = None,
    start_ids: Mapping[int, str] | None = None,
    config_key_of: Callable[[str, int, int], str] | None = None,
) -> list[tuple[int, int]]:
    """The claim's own (start, seed) pairs outside ``starts`` x ``seeds`` whose run of one
    of ``arms`` finished in ``workdir`` (its ``ablate.DONE_FILE``) or is recorded in
    ``ledger`` (from the start of ``start_ids`` where it names one, and of the config
    ``config_key_of(arm, start, seed)`` gives: a record of an older config of the arm is
    no run of this sweep's): a verdict that leaves them out judges chosen pairs (drop the
    seed that fails), not a sweep's progress."""
    judged = {(start, seed) for start in starts for seed in seeds}
    ids = start_ids or {}
    key_of = functools.cache(config_key_of) if config_key_of else None

    def finished(arm, start, seed):
        if os.path.exists(
            os.path.join(workdir, arm, ablate.run_name(start, seed), ablate.DONE_FILE)
        ):
            return True
        return ledger is not None and any(
            (r["arm"], int(r["start"]), int(r["seed"])) == (arm, start, seed)
            and r["start_id"] == ids.get(start, r["start_id"])
            and (key_of is None or r["config"] == key_of(arm, start, seed))
            for r in ledger.records
        )

    return [
        (start, seed)
        for start in claim.starts
        for seed in claim.seeds
        if (start, seed) not in judged and any(finished(arm, start, seed) for arm in arms)
    ]


def verdict_table(
    claim: Claim,
    summary: dict,
    *,
    variant: str = "",
    exploratory: bool = False,
    left_out: Sequence[tuple[int, int]] = (),
) -> tuple[str, str, list[dict]]:
    """The Markdown of ``verdict.md`` (the claim, a verdict per check, the arms' figures),
    the claim's verdict and its checks' results (`experiments.verdicts.claim_verdict`;
    a paper's claim at one SFT start is inconclusive). ``left_out``: the claim's pairs
    with finished runs that the summary leaves out (``pairs_left_out``; exploratory).
    Refuses (ValueError) runs that differ in their learning rate or budget."""
    starts, seeds = summary["starts"], summary["seeds"]
    for kind, named in (("start", starts), ("seed", seeds)):
        twice = next((x for i, x in enumerate(named) if x in named[:i]), None)
        if twice is not None:  # its runs would count as two pairs each
            raise ValueError(
                f"verdict table refused: {kind} {twice} is named twice ({kind}s {list(named)}); "
                "each (start, seed) pair counts once"
            )
    pairs = [(start, seed) for start in starts for seed in seeds]
    runs = per_arm_runs(summary)
    regime = one_regime(
        [
            (f"{arm}/{ablate.run_name(*pair)}", run["regime"])
            for arm, by_pair in runs.items()
            for pair, run in by_pair.items()
        ],
        claim.per_arm_fields(),
    )
    judged = []
    for check in claim.checks:
        values, value_starts, missing = check.values(runs, pairs)
        judged.append(
            {
                "check": check.text + (" (reported)" if check.reported else ""),
                "reported": check.reported,
                "values": values,
                **judge(
                    values,
                    check.threshold,
                    check.margin,
                    test=check.test,
                    starts=value_starts,
                    missing=missing,
                ),
            }
        )
    alone, results = claim_verdict(judged)
    # A paper's claim is defined over >= 2 SFT starts: at one, neither the spread between
    # starts nor a start that disagrees can show, so the claim is not decided; nor is it
    # where a premise (the regime its mechanism needs) is unmet or unmeasured.
    one_start = len(set(starts)) < 2 and not claim.diagnostic
    premises = premise_results(claim, summary)
    outside = [p for p in premises if not p["met"]]
    verdict = "inconclusive" if one_start or outside else alone

    setting = summary.get("setting") or claim.setting
    command = (
        f"python -m experiments.reproduce --claim {claim.name} "
        f"--starts {','.join(map(str, starts))} --seeds {','.join(map(str, seeds))}"
    )
    run_arms = [entry["arm"] for entry in summary["arms"]]
    if set(run_arms) != set(claim.arm_labels()):
        command += f" --arms {','.join(run_arms)}"
    if setting != claim.setting:
        command += f" --setting {setting}"
    if variant:
        command += f" --variant {shlex.quote(variant)}"
    beyond = pairs_beyond(claim, starts, seeds)
    exploratory = exploratory or bool(beyond) or bool(left_out)
    label = " (exploratory)" if exploratory else ""
    lines = [
        f"# Claim `{claim.name}`{label}: {verdict} at {len(starts)} SFT start(s) x "
        f"{len(seeds)} seed(s)",
        "",
    ]
    if exploratory and (variant or not (beyond or left_out)):
        how = f"`--variant {variant}`" if variant else "A changed arm config"
        lines += [
            f"**Exploratory**: {how} departs from the claim's definition; "
            "this verdict is not the claim's.",
            "",
        ]
    if beyond:
        lines += [
            f"**Exploratory**: {' and '.join(beyond)} beyond the claim's (SFT starts "
            f"{list(claim.starts)} x seeds {list(claim.seeds)}); a verdict over pairs added "
            "after the definition can be reached by adding them until a check passes; "
            "this verdict is not the claim's.",
            "",
        ]
    if left_out:
        pairs = ", ".join(f"(start {start}, seed {seed})" for start, seed in left_out)
        lines += [
            f"**Exploratory**: the finished runs of {pairs} are left out; a verdict over "
            "chosen pairs can be any, this verdict is not the claim's.",
            "",
        ]
    unmet = [p for p in premises if p["met"] is False]
    unknown = [p for p in premises if p["met"] is None]
    if unmet:
        figures = "; ".join(
            f"{p['premise']}: "
            + " / ".join(
                f"start {s} {bound_figure(v, p['threshold'])}{_partial(p, s)}"
                for s, v in p["start_values"].items()
            )
            + f" ({p['bound']} at each start)"
            for p in unmet
        )
        lines += [
            f"**Outside its regime**: {figures}. The checks ran where the mechanism does not "
            f"act as the paper's finding needs; the claim is not decided (its checks alone: "
            f"{alone}).",
            "",
        ]
    if unknown:
        counts = "; ".join(
            f"{p['premise']}: not measured at {p['missing']} of {p['runs'] + p['missing']} "
            "runs ({} at start {}, seed {} the first)".format(*p["first_missing"])
            for p in unknown
        )
        lines += [
            f"**Regime not measured**: {counts}. Whether the checks ran where the mechanism "
            f"acts is not known; the claim is not decided (its checks alone: {alone}).",
            "",
        ]
    if one_start:
        lines += [
            "One SFT start: the spread between starts is not sampled; the claim is decided "
            f"over >= 2 (its checks alone: {alone}).",
            "",
        ]
    elif len(set(starts)) < 2:
        lines += ["One SFT start: the spread between starts is not sampled.", ""]
    lines += [
        claim.source,
        "",
        f"Setting `{setting}`; regime `{claim.regime}` ({_describe(regime)}); SFT starts "
        f"{starts} x seeds {seeds}; `{command}`; {summary['date']}.",
        "",
        _compute_line(summary),
        "",
        *_premise_table(premises, starts),
        "| check | threshold | test | pairs | effect (centre - threshold) | std "
        f"| 95% t half-width | per-start effect ({_starts_label(starts)}) | p (Holm) | verdict "
        "| pairs for 80% power |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|---|---:|",
    ]
    for r in results:
        count = f"{r['n']}" if not r["missing"] else f"{r['n']} of {r['n'] + r['missing']}"
        effects = r.get("start_effects", {})
        per_start = " / ".join(_fmt(effects.get(s)) for s in starts)
        p = f"{r['p']:.3g}" if "p" in r else "-"
        lines.append(
            f"| {r['check']} | {check_threshold(r)} | {TEST_LABELS[r['test']]} | {count} | "
            f"{_fmt(r.get('effect'))} | "
            f"{_fmt(r.get('std'), '')} | {_fmt(r.get('half_width'), '')} | {per_start} | {p} | "
            f"{r['verdict']} | {r.get('pairs_needed', '-')} |"
        )
    notes = [f"- {r['check']}: {r['note']}." for r in results if r.get("note")]
    lines += ["", *notes, *([""] if notes else [])]
    lines += [
        "Verdict rule (docs/claims.md): an exact test over the (start, seed) pairs, "
        "two-sided, and with a margin two one-sided tests for equivalence: the sign-flip "
        "test of the mean where the check compares two arms against 0 (interchangeable "
        "under no effect), the sign test of the median otherwise (a value or gain against "
        "a fixed threshold, a margin; the centre is then the median); Holm's "
        "correction across the claim's checks at family-wise alpha 0.05; a check missing a "
        "pair, or whose direction a start's centre does not share, decides nothing. Supported "
        "when every check is supported or equivalent, contradicted when one is "
        "contradicted; inconclusive at one SFT start, or where a premise (the regime the "
        "mechanism needs, measured on the claim's runs) is unmet or unmeasured. A check "
        "marked (reported) is a finding the claim does not rest on, corrected in a family "
        "of its own. The t half-width and the power line (at alpha / "
        "hypotheses) are figures, not the test.",
        "",
        ablate.format_table(summary).replace("# Ablation", "## Ablation"),
    ]
    return "\n".join(lines) + "\n", verdict, results


def premise_results(claim: Claim, summary: dict) -> list[dict]:
    """Each of the claim's premises measured on the summary's runs (``Premise.measure``)."""
    pairs = [(start, seed) for start in summary["starts"] for seed in summary["seeds"]]
    runs = per_arm_runs(summary)
    return [premise.measure(runs, pairs) for premise in claim.premises]


def _partial(premise: dict, start: int) -> str:
    """`` (k of n runs)`` after the mean of a start that lacks some of its runs."""
    lacks = premise["start_missing"].get(start, 0)
    has = premise["start_runs"][start]
    return f" ({has} of {has + lacks} runs)" if lacks else ""


def _starts_label(starts: Sequence[int]) -> str:
    """``"starts 1 / 2"``: the order of a table's per-start cells."""
    return f"start{'s' if len(starts) > 1 else ''} {' / '.join(map(str, starts))}"


def _premise_table(premises: Sequence[dict], starts: Sequence[int]) -> list[str]:
    """The premises' Markdown table (none: no lines), a cell per start in ``starts``."""
    if not premises:
        return []
    lines = [
        "| premise (the regime) | bound (at each start) | measured | "
        f"per start ({_starts_label(starts)}) | runs | met |",
        "|---|---|---:|---|---:|---|",
    ]
    for p in premises:
        figure = functools.partial(bound_figure, bound=p["threshold"])
        values = p["start_values"]
        per_start = " / ".join(figure(values[s]) if s in values else "-" for s in starts)
        met = {True: "yes", False: "no", None: "not measured"}[p["met"]]
        runs = f"{p['runs']}" if not p["missing"] else f"{p['runs']} of {p['runs'] + p['missing']}"
        lines.append(
            f"| {p['premise']} | {p['bound']} | {figure(p['value'])} | {per_start} | "
            f"{runs} | {met} |"
        )
    return lines + [""]


def _compute_line(summary: dict) -> str:
    """The claim's compute: the CPU seconds its runs' finishing attempts recorded."""
    runs = [r for entry in summary["arms"] for r in entry["runs"]]
    cpus = [r["cpu_s"] for r in runs if r.get("cpu_s") is not None]
    if not cpus:
        return f"Compute: not recorded for its {len(runs)} runs."
    some = "" if len(cpus) == len(runs) else f" (recorded for {len(cpus)} of {len(runs)} runs)"
    return (
        f"Compute: {sum(cpus) / 3600:.2f} CPU-hours{some}, the trainer's threads in the "
        "attempt that finished each run (SFT starts and verifier processes not included)."
    )


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


def sft_dir(sft_root: str, setting: str, start: int = 0) -> str:
    """Where SFT start ``start`` of ``setting`` is cached: ``<sft_root>/<setting>/sft`` for
    start 0, ``.../sft_start<K>`` for K >= 1."""
    return os.path.join(sft_root, setting, "sft" if start == 0 else f"sft_start{start}")


def finished_sft(setting: str, sft_root: str, variant: str = "", start: int = 0) -> str:
    """The checkpoint directory of ``setting``'s SFT start ``start`` when it is finished
    (its last checkpoint at the config's ``sft.steps``), without building or training
    anything; a ValueError naming the directory otherwise."""
    config = importlib.import_module(f"configs.{setting}").get_config(sft_variant(variant) or None)
    directory = os.path.join(sft_dir(sft_root, setting, start), "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    steps = [int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n))]
    if max(steps, default=0) != config.sft.steps:
        raise ValueError(
            f"SFT start {start} of {setting!r} is not finished ({directory}: step "
            f"{max(steps, default=0)} of {config.sft.steps}); judging finished runs only, "
            "nothing trains"
        )
    return directory


def _judged_start(
    ledger: Ledger,
    setting: str,
    sft_root: str,
    variant: str,
    start: int,
    configs: Collection[str] | None = None,
) -> tuple[str, str]:
    """``(checkpoint directory, identity)`` of SFT start ``start`` for judging: the
    finished start on this machine, or without it the one start its ledger records (of
    a config in ``configs``: the judged runs'; older configs' records judge nothing) name
    (a ValueError when they name none, or several)."""
    try:
        checkpoint = finished_sft(setting, sft_root, variant, start)
    except ValueError:
        directory = os.path.join(sft_dir(sft_root, setting, start), "checkpoints")
        kept = kept_identity(setting, start, sft_config(setting, variant, start))
        if kept is not None:  # the start a sweep would restore, where its records are
            ledger.alias(start, kept[1], kept[0])
            if kept[0] in ledger.start_ids(start, configs):
                return directory, kept[0]
        ids = ledger.start_ids(start, configs)
        if len(ids) != 1:
            recorded = f"records of {len(ids)} ({', '.join(ids)})" if ids else "no record"
            raise ValueError(
                f"SFT start {start} of {setting!r} is not on this machine and {ledger.path} "
                f"holds {recorded} of it; judging needs the start or one recorded identity"
            ) from None
        return directory, ids[0]
    return checkpoint, _identity(ledger, start, checkpoint)


def _identity(ledger: Ledger | None, start: int, checkpoint: str) -> str:
    """``start_id`` of SFT start ``start`` at ``checkpoint``; ``ledger``'s records that
    name it as ``start_id`` did before (``legacy_start_id``) are read as its own."""
    identity = start_id(checkpoint)
    if ledger is not None:
        ledger.alias(start, legacy_start_id(checkpoint), identity)
    return identity


def sft_config(setting: str, variant: str = "", start: int = 0):
    """The config SFT start ``start`` of ``setting`` trains with: ``configs/<setting>.py``,
    the items of ``variant`` it reads (``sft_variant``) and the recipe's seed + ``start``."""
    config = importlib.import_module(f"configs.{setting}").get_config(sft_variant(variant) or None)
    if start:
        config.unlock()
        config.seed += start
        config.lock()
    return config


def ensure_sft(
    setting: str, sft_root: str, variant: str = "", start: int = 0, *, kept: bool = True
) -> str:
    """The checkpoint directory of ``setting``'s SFT start number ``start``, trained once
    into ``sft_dir(sft_root, setting, start)`` (resumed if interrupted, reused once
    finished) with ``configs/<setting>.py``, the items of ``variant`` it reads
    (``sft_variant``) and the recipe's seed + ``start`` (another initialisation and data
    order; the task, its held-out set included, stays). A variant that changes those
    items needs its own ``sft_root``: the cached start refuses to resume under a
    different task or geometry.

    A recipe module that names an ``SFT_PARENT`` setting (`configs/testbed_long32.py`)
    continues that setting's start of the same number, made first the same way (the
    variant's items apply to both), to its own ``sft.steps`` in all.

    With ``kept``, a start the repository keeps (``experiments.starts``:
    ``docs/claims/starts/<setting>/start<K>.npz``) of the same SFT config is restored
    instead of trained where the cache lacks the start; a parent continued by more SFT is
    always trained (a kept start holds no optimiser state)."""
    parent = getattr(importlib.import_module(f"configs.{setting}"), "SFT_PARENT", None)
    config = sft_config(setting, variant, start)
    workdir = sft_dir(sft_root, setting, start)
    if kept and (restored := use_kept_start(setting, start, config, workdir)):
        return restored
    if is_kept(workdir):
        raise ValueError(
            f"{workdir} holds the SFT start kept in the repository (parameters only), which "
            "more SFT cannot continue; remove it to train the start here"
        )
    init = ensure_sft(parent, sft_root, variant, start, kept=False) if parent else None
    summary = run_sft(
        config,
        workdir,
        init_checkpoint=init,
        recipe=f"configs/{setting}.py (SFT start {start}, seed {config.seed}"
        + (f", continuing {parent}'s)" if parent else ")"),
    )
    if summary.get("interrupted"):
        raise SystemExit(
            f"SFT start {start} of {setting!r} interrupted ({summary['interrupted']}); "
            "rerun to resume"
        )
    # Finished, the start is only read from now on: other claims' processes may share it.
    unlock_workdir(workdir)
    return summary["checkpoint_dir"]


def claim_run_key(
    claim: Claim,
    setting: str,
    variant: str,
    label: str,
    start: int,
    seed: int,
    sft_root: str = "runs",
    configure: Callable | None = None,
) -> str:
    """The config key (``ablate.run_config_key``) of the run of arm ``label`` at SFT start
    ``start`` and ``seed`` in ``setting`` under ``variant`` (the claim's regime and the
    common variant): which of the ledger's records are of the run a sweep would train."""
    checkpoint = os.path.join(sft_dir(sft_root, setting, start), "checkpoints")
    config = ablate.arm_config(
        claim.ablation, label, seed, variant, lambda c: SETTINGS[setting](c, checkpoint)
    )
    return ablate.run_config_key(configure(config) if configure else config)


def run_claim(
    claim: Claim,
    workdir: str,
    *,
    starts: Sequence[int] | None = None,
    seeds: Sequence[int] | None = None,
    variant: str = "",
    arms: Sequence[str] | None = None,
    sft_root: str = "runs",
    setting: str | None = None,
    configure: Callable | None = None,
    quiet: bool = True,
    train: bool = True,
    ledger: str | None = None,
) -> dict:
    """Trains (or resumes) the claim's arms over SFT starts x seeds and judges it.

    Args:
      claim: from ``CLAIMS``.
      workdir: the claim's directory (its runs, summary, curves.png and verdict.md;
        ``claim_dir`` gives it).
      starts: SFT starts (default the claim's), each trained once (``ensure_sft``).
      seeds: one run per arm, start and seed (default the claim's).
      variant: appended to every arm after the claim's regime (and its ``sft.``/``task.``/
        ``model.``/``eval.`` items to the SFT starts' config); one that changes an arm
        (``departures``) makes the run exploratory.
      arms: a subset of the claim's arms (default all; a check without its arms is
        "not run").
      sft_root: where the settings' SFT starts are cached (``sft_dir``).
      setting: another of the claim's settings than its own.
      configure: ``config -> config`` applied to each arm's config
        (``ablate.run_ablation``); the run is then exploratory.
      quiet: no per-iteration console line.
      train: False to re-judge the finished runs under the current rule (``--rejudge``):
        an SFT start or run that is not finished is a ValueError naming it, and nothing
        trains; the summary, curves and verdict.md are written again.
      ledger: the claim's ledger file (``experiments.ledger``): its recorded runs count as
        finished (from the same SFT start, bit for bit, and the same config), and each run
        finished here is added. Judging with ``train=False``, a start that is not on this
        machine is the one its records name.

    Returns:
      ``{"claim", "setting", "variant", "verdict", "checks", "summary", "verdict_md",
      "premises", "exploratory"}`` (``premises``: ``premise_results``).
    """
    labels = select_arms(claim, arms)
    name = select_setting(claim, setting)
    starts = tuple(claim.starts if starts is None else starts)
    seeds = tuple(claim.seeds if seeds is None else seeds)
    exploratory = bool(departures(claim, name, variant)) or configure is not None
    every_arm = _join(claim.regime, variant)

    def arm_regime(label, start_setting):
        config = ablate.arm_config(claim.ablation, label, seeds[0], every_arm, start_setting)
        return ablate.regime_of(configure(config) if configure else config)

    # Refused before anything trains: arms of different learning rates or budgets.
    one_regime(
        [(label, arm_regime(label, lambda c: SETTINGS[name](c, "sft"))) for label in labels],
        claim.per_arm_fields(),
    )
    book = Ledger(ledger) if ledger else None

    def key_of(label, start, seed):  # the config a run of that pair would train
        return claim_run_key(claim, name, every_arm, label, start, seed, sft_root, configure)

    plan, start_ids = {}, {}
    for start in starts:
        if book is not None and not train:
            configs = {key_of(label, start, seed) for label in labels for seed in seeds}
            checkpoint, start_ids[start] = _judged_start(
                book, name, sft_root, variant, start, configs
            )
        else:
            checkpoint = (ensure_sft if train else finished_sft)(name, sft_root, variant, start)
            if book is not None:
                start_ids[start] = _identity(book, start, checkpoint)

        def apply_setting(config, checkpoint=checkpoint):
            return SETTINGS[name](config, checkpoint)

        apply_setting.__name__ = name
        plan[start] = apply_setting
        twin = next((s for s in start_ids if s != start and start_ids[s] == start_ids[start]), None)
        if twin is not None:  # a verdict over them would count one start twice
            raise ValueError(
                f"SFT starts {twin} and {start} are one start ({start_ids[start]}: the same "
                "saved bits); a claim's starts are trained from different seeds"
            )
    summary = ablate.run_ablation(
        claim.ablation,
        workdir,
        seeds=seeds,
        variant=every_arm,
        starts=plan,
        arms=labels,
        configure=configure,
        quiet=quiet,
        train=train,
        ledger=book,
        start_ids=start_ids if book is not None else None,
    )
    left_out = pairs_left_out(
        claim, workdir, labels, summary["starts"], summary["seeds"], book, start_ids, key_of
    )
    text, verdict, results = verdict_table(
        claim, summary, variant=variant, exploratory=exploratory, left_out=left_out
    )
    with open(os.path.join(workdir, "verdict.md"), "w") as f:
        f.write(text)
    return {
        "claim": claim.name,
        "setting": name,
        "variant": variant,
        "verdict": verdict,
        "checks": results,
        "summary": summary,
        "verdict_md": text,
        "premises": premise_results(claim, summary),
        "exploratory": exploratory
        or bool(left_out)
        or bool(pairs_beyond(claim, summary["starts"], summary["seeds"])),
    }


def define_flags() -> None:
    flags.DEFINE_string("claim", None, f"One of: {', '.join(CLAIMS)}.")
    flags.DEFINE_list("starts", None, "SFT starts (default: the claim's, >= 2).")
    flags.DEFINE_list(
        "seeds", None, "Seeds, one run per arm, start and seed (default: the claim's)."
    )
    flags.DEFINE_string("workdir", "runs/reproduce", "Claims' directories go under it.")
    flags.DEFINE_string("sft_root", "runs", "Cache of the settings' SFT starts.")
    flags.DEFINE_string(
        "variant",
        "",
        "Variant appended to every arm after the claim's regime, key=value,...; one that "
        "changes what an arm trains makes the run exploratory (its own directory).",
    )
    flags.DEFINE_list("arms", None, "Only these arms of the claim (labels).")
    flags.DEFINE_string(
        "setting",
        None,
        "Run the claim in another of its settings (--list names them, e.g. "
        "testbed_long32: claim 3 on responses of up to ~400 tokens).",
    )
    flags.DEFINE_bool("list", False, "List the claims, their sources, arms and budgets.")
    flags.DEFINE_bool(
        "rejudge",
        False,
        "Judge the claim from its finished runs under the current verdict rule, training "
        "nothing: an SFT start or run that is not finished is an error naming it.",
    )
    flags.DEFINE_bool(
        "ledger",
        True,
        "Keep the claim's finished runs in docs/claims/runs/<claim>.jsonl and count those "
        "recorded there (the same SFT start and config) as finished; exploratory runs are "
        "never recorded.",
    )


def _list() -> None:
    def field(text: str) -> None:  # 100 columns, continued under the field
        print(wrap(text, first="    ", rest="        "))

    for claim in CLAIMS.values():
        others = f"; also {', '.join(claim.other_settings)}" if claim.other_settings else ""
        print(wrap(f"{claim.name} ({claim.setting}{others}): {claim.source}"))
        where = "configs/ablations.py" if claim.ablation.name in ABLATIONS else "configs/claims.py"
        field(f"arms: {', '.join(claim.arm_labels())} ({where} {claim.ablation.name!r})")
        field(f"regime: {claim.regime}")
        field(
            f"runs: SFT starts {','.join(map(str, claim.starts))} x seeds "
            f"{','.join(map(str, claim.seeds))}"
        )
        for premise in claim.premises:
            field(
                f"premise: {premise.text} ({premise.metric} {premise.bound_text} at each SFT "
                f"start, the mean over the runs of {', '.join(premise.arms)})"
            )
        for check in claim.checks:
            margin = f" ± {check.margin:g}" if check.margin else ""
            role = "; reported" if check.reported else ""
            field(
                f"check: {check.text} (threshold {check.threshold:g}{margin}; {check.test} test"
                f"{role})"
            )
        field(f"budget on 2 cores: {claim.budget}")
        key_of = functools.partial(claim_run_key, claim, claim.setting, claim.regime)
        field(f"recorded: {recorded_runs(claim, Ledger(ledger_path(claim.name)), key_of)}")
        print()


def recorded_runs(
    claim: Claim, ledger: Ledger, config_key_of: Callable[[str, int, int], str] | None = None
) -> str:
    """How many of the claim's own runs (arm x start x seed) its ledger records, per
    start, with their CPU-hours: a sweep's progress, read from the repository. With
    ``config_key_of(arm, start, seed)``, only records of that config count (a record of
    an arm's older config is a run the sweep has to train again). Where the repository
    keeps a start (``experiments.starts``), only the records of that start count; those
    of another are shown apart, and a start not kept is named (its records cannot be
    extended elsewhere)."""
    starts = {start: set() for start in claim.starts}
    others = {start: set() for start in claim.starts}
    kept = {start: kept_start_id(claim.setting, start) for start in claim.starts}
    key_of = functools.cache(config_key_of) if config_key_of else None
    cpu = 0.0
    for r in ledger.records:
        start, run = int(r["start"]), (r["arm"], int(r["seed"]))
        if start in starts and run[0] in claim.arm_labels() and run[1] in claim.seeds:
            if key_of is not None and r["config"] != key_of(run[0], start, run[1]):
                continue
            if kept[start] is not None and r["start_id"] != kept[start]:
                others[start].add(run)
                continue
            if run not in starts[start]:
                cpu += r.get("cpu_s") or 0.0
            starts[start].add(run)
    total = len(claim.arm_labels()) * len(claim.seeds)
    done = sum(len(runs) for runs in starts.values())

    def shown(start, runs):
        text = f"start {start}: {len(runs)}"
        if others[start]:
            return text + f" (+{len(others[start])} of another start)"
        return text + (" (start not kept)" if runs and kept[start] is None else "")

    per_start = ", ".join(shown(s, runs) for s, runs in starts.items())
    repository = os.path.dirname(os.path.dirname(os.path.dirname(LEDGER_DIR)))
    return (
        f"{done} of {total * len(starts)} runs ({per_start}; of {total} each), "
        f"{cpu / 3600:.1f} CPU-hours, in {os.path.relpath(ledger.path, repository)}"
    )


def _integers(flag: str, values: list[str] | None) -> list[int] | None:
    try:
        numbers = [int(v) for v in values] if values else None
    except ValueError:
        raise ValueError(f"--{flag} takes integers, e.g. 0,1; got {','.join(values)}") from None
    twice = next((x for i, x in enumerate(numbers or []) if x in numbers[:i]), None)
    if twice is not None:
        raise ValueError(f"--{flag} names {twice} twice; got {','.join(values)}")
    return numbers


def main(argv):
    del argv
    args = flags.FLAGS
    if args.list:
        _list()
        return
    if not args.claim:
        raise cli.UsageError(f"--claim is required (or --list); known: {', '.join(CLAIMS)}")
    try:
        claim = get_claim(args.claim)
        select_arms(claim, args.arms)
        setting = select_setting(claim, args.setting)
        starts, seeds = _integers("starts", args.starts), _integers("seeds", args.seeds)
        departed = departures(claim, setting, args.variant)
        workdir = claim_dir(args.workdir, claim, setting, args.variant)
    except ValueError as error:
        raise cli.UsageError(str(error)) from error
    if departed:
        print(
            f"exploratory: --variant changes {', '.join(departed)} from the claim's "
            f"definition; runs under {workdir}; the verdict is not the claim's",
            flush=True,
        )
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    result = run_claim(
        claim,
        workdir,
        starts=starts,
        seeds=seeds,
        variant=args.variant,
        arms=args.arms,
        sft_root=args.sft_root,
        setting=setting,
        quiet=False,
        train=not args.rejudge,
        ledger=ledger_path(workdir) if args.ledger and not departed else None,
    )
    print(result["verdict_md"])
    if claim.headline is not None:
        print(claim.headline(result))
    if result["exploratory"]:
        print(f"exploratory: {workdir}/verdict.md is not the claim's verdict")


if __name__ == "__main__":
    define_flags()
    cli.run(main)  # one-line errors; the compilation cache (docs/runs.md)
