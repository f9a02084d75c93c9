"""Runs one of the papers' ablations (`configs/ablations.py`): every arm over every seed,
then a table, a JSON summary and curves side by side.

    make demo    # once: the SFT checkpoint the "demo" setting starts from
    python -m experiments.ablate --ablation sapo_tau --setting demo --seeds 0,1,2 \
        --workdir runs/ablate/sapo_tau [--variant train.num_iterations=60]
    python -m experiments.ablate --list

Each run goes to `workdir/<arm>/seed<N>` (`start<K>_seed<N>` from the K-th of several SFT
starts, `run_name`; a normal `experiments/train.py` run directory, asynchronous when the
arm's config asks for it). A run counts as finished only when its logs reach the last
iteration (and its final evaluation); any other resumes from its checkpoint, so rerunning
the command completes a sweep (a run directory trained with another config, the loop's
cadence aside, or for more iterations, is an error). The workdir then holds `summary.json`
(per arm and run: held-out pass@1 at the start and the end, the last iterations' training
metrics, wall time, the learning rate and budget, and the config fields in which the arm
differs from the first arm), `summary.md` (the table) and `curves.png`. Every arm gets the
same number of policy iterations: a critic's value pretraining comes on top.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import time
from typing import Callable, Collection, Mapping, Sequence

from absl import flags

from configs import base
from configs.ablations import ABLATIONS, SETTINGS, Ablation, get_ablation, share_sections
from experiments import cli
from experiments.ledger import Ledger, config_key
from policyopt.advantages import uses_critic
from policyopt.metrics import quiet_library_logging, read_jsonl
from policyopt.rl.loop.async_rl import async_enabled, run_async_rl
from policyopt.rl.loop.build import resolved_record
from policyopt.rl.loop.trainer import run_rl
from policyopt.rl.reporting.plots import plot_runs
from policyopt.rl.reporting.report import wrap
from policyopt.runtime import keep_freed_host_memory

#: Training metrics summarised (mean over the last ``tail`` iterations), when a run logs them.
TAIL_METRICS = (
    "reward/mean",
    "reward/accuracy",
    "loss/clip_frac",
    "loss/gate_mean",
    "routing/volatility",
    "routing/ratio_share",
    "routing/log_ratio_ms",
    "response/length_mean",
    "policy/entropy",
    "critic/explained_variance",
    "critic/rollout_mc_explained_variance",
    "async/staleness_mean",
    "offpolicy/kl_k3",
)
#: Training metrics averaged over all the policy's iterations (a critic's warm-up left out),
#: ``{logged name: summary name}``. SAPO's gate weight over the run is its regime's
#: diagnostic (docs/claims.md "sapo_grid"): it drifts towards 1 as RL sharpens the policy,
#: so the last iterations' mean (``loss/gate_mean``) understates where it acted.
POLICY_MEAN_METRICS = {
    "advantages/lambda_policy_token_mean": "advantages/lambda_policy_token_mean",
    "loss/gate_mean": "loss/gate_mean_run",
}
#: A critic's explained variance of Monte-Carlo returns on the rollout of the policy's
#: first iteration: fresh samples it has not trained on, scored after its warm-up (reward
#: model, value pretraining), before any PPO update. Summarised under this name.
WARMUP_EXPLAINED_VARIANCE = "critic/warmup_explained_variance"
#: A run has collapsed at iteration i when the mean training accuracy of iterations i-2..i
#: falls below this fraction of that of its first 3 iterations (``collapse_iteration``).
COLLAPSE_FRACTION = 0.5
DONE_FILE = "ablation_run.json"
#: In a run directory trained with a ledger: the identity of the SFT start it was trained
#: from (``experiments.ledger.start_id``), written before its first iteration.
START_FILE = "sft_start.json"
#: The fields that make a run's learning rate and budget (``regime_of``): a verdict over
#: runs that differ in one compares settings, not methods (`experiments/reproduce.py`).
REGIME_FIELDS = (
    "optim.lr",
    "train.num_iterations",
    "batch.n_prompts",
    "batch.group_size",
    "batch.n_minibatches",
    "batch.epochs",
    "sampling.max_new_tokens",
)


def run_name(start: int, seed: int) -> str:
    """A run's directory under its arm: ``seed<N>`` from SFT start 0 (the layout of a
    single-start sweep, whose runs so resume), ``start<K>_seed<N>`` from start K >= 1."""
    return f"seed{seed}" if start == 0 else f"start{start}_seed{seed}"


def regime_of(config) -> dict:
    """``{field: value}`` of ``REGIME_FIELDS``; ``train.num_iterations`` counts the policy's
    iterations (a critic's reward-model and value-pretraining iterations come on top)."""
    out = {}
    for path in REGIME_FIELDS:
        section, name = path.split(".")
        out[path] = config[section][name]
    if uses_critic(config.algo.advantage):
        out["train.num_iterations"] -= (
            config.critic.reward_model_iterations + config.critic.pretrain_iterations
        )
    return out


def arm_config(
    ablation: Ablation, label: str, seed: int, variant: str = "", setting: Callable | None = None
):
    """The locked config of arm ``label`` at ``seed``.

    Order, later winning: the recipe; ``scale=paper`` when the common ``variant`` asks for
    it; the ablation's shared variant (e.g. 4 minibatches per batch, which the paper
    geometry must not undo); the arm's variant; the rest of the common ``variant``;
    ``seed=N``. Then the ``SHARED_SECTIONS`` (geometry, generation budget, model, task,
    loop) of the ablation's reference recipe (``Ablation.reference_recipe``) built at the
    same scale with the shared and the common variants
    (``configs.ablations.share_sections``): at ``scale=paper`` every arm takes that
    paper's geometry, not its own paper's. With a ``setting`` (``config -> config``, e.g.
    ``configs.ablations.demo_setting``), the setting is applied to that config. The
    variants are then applied once more, so that they win. Finally every arm gets
    ``train.num_iterations`` *policy* iterations: a critic's reward-model and
    value-pretraining iterations (``critic.reward_model_iterations``,
    ``critic.pretrain_iterations``, which update the critic only) come on top.
    """
    arm = next((a for a in ablation.arms if a.label == label), None)
    if arm is None:
        raise ValueError(f"ablation {ablation.name!r} has no arm {label!r}")
    common = base.split_variant(variant) if variant else []
    for item in common:
        if item.split("=", 1)[0].strip() == "seed":
            raise ValueError(
                f"a common variant may not set seed (got {item.strip()!r}); the runs' seeds "
                "are --seeds (one run per seed: a common seed would make every run the same)"
            )
    scale = [item for item in common if item.split("=", 1)[0].strip() == "scale"]
    rest = [item for item in common if item not in scale]
    if setting is not None and scale:
        raise ValueError(
            "a setting and scale=paper do not mix: the setting replaces the paper's geometry"
        )
    variants = ",".join(p for p in (ablation.variant, arm.variant, *rest) if p)
    try:
        reference = importlib.import_module(f"configs.{ablation.reference_recipe}").get_config(
            ",".join(p for p in (*scale, ablation.variant, *rest) if p)
        )
    except ValueError as error:
        raise ValueError(
            f"ablation {ablation.name!r}: every arm takes the geometry and "
            f"generation budget of configs/{ablation.reference_recipe}.py, which "
            f"refuses this variant: {error}"
        ) from error
    # The arm's own paper may record no budget, which scale=paper requires: the reference's.
    budget = []
    if scale:
        for path in (*base.PAPER_SCALE_REQUIRED, "batch.response_buckets"):
            section, name = path.split(".")
            budget.append(f"{path}={reference[section][name]!r}")
    config = importlib.import_module(f"configs.{arm.recipe}").get_config(
        ",".join(p for p in (*scale, *budget, variants, f"seed={seed}") if p)
    )
    config = share_sections(config, reference)
    if setting is not None:
        config = setting(config)
    config.unlock()
    base.apply_variant(config, variants)
    if uses_critic(config.algo.advantage):
        config.train.num_iterations += (
            config.critic.reward_model_iterations + config.critic.pretrain_iterations
        )
    base.check(config)
    config.lock()
    return config


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


#: The version of ``summarise_run``'s figures that a ledger record holds: bump it when what
#: a figure means changes, and the records of the old version no longer count (their runs
#: train again). tests/experiments/test_ledger.py trips when the summary's code changes.
SUMMARY_VERSION = 1


def run_config_key(config, tail: int = 5) -> str:
    """The ledger's digest of the run an arm's ``config`` trains (``ledger.config_key`` of
    its resolved record), with the summary's version and ``tail``: how a record is found,
    and whose records a claim judges."""
    record = resolved_record(_flat(config.to_dict()))
    return config_key({**record, "summary.version": SUMMARY_VERSION, "summary.tail": tail})


def config_diff(base, other) -> dict:
    """``{field: [base value, other value]}`` for every leaf field where two configs differ."""
    a, b = _flat(base.to_dict()), _flat(other.to_dict())
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _finished(run_dir: str, config) -> dict | None:
    """The run's DONE_FILE record if it finished ``config.train.num_iterations``, else None
    (train it: a run with fewer iterations resumes). Finished means the record says so and
    the logs agree: ``metrics.jsonl`` reaches the last iteration and, when the run
    evaluates, ``eval.jsonl`` holds the final evaluation; a record over shorter logs is a
    partial run, resumed, never summarised. Raises a ValueError when the run directory
    holds a run of another config (its ``config.json``; the ``train`` section, iterations,
    logging and checkpoint cadence, aside; compared as ``build.resolved_record`` settings):
    it would be summarised, or resumed, as this arm's."""
    logged_path = os.path.join(run_dir, "config.json")
    if os.path.exists(logged_path):
        logged = resolved_record(_flat(base.load_run_config(logged_path).to_dict()))
        now = resolved_record(_flat(config.to_dict()))
        diff = {
            k: [logged.get(k), now.get(k)]
            for k in sorted(set(logged) | set(now))
            if logged.get(k) != now.get(k) and not k.startswith("train.")
        }
        if diff:
            raise ValueError(
                f"{run_dir} holds a run of another config ({{field: [logged, now]}}: "
                f"{diff}); use another --workdir, or remove that run"
            )
    wanted = config.train.num_iterations
    path = os.path.join(run_dir, DONE_FILE)
    done = None
    if os.path.exists(path):
        with open(path) as f:
            done = json.load(f)
    logged = _last_step(run_dir)
    trained = max(done["iterations"] if done else 0, logged)
    if trained > wanted:
        raise ValueError(
            f"{run_dir} was trained for {trained} iterations, more than this sweep's "
            f"{wanted}: its summary would describe the longer run; use another "
            "--workdir, or as many iterations"
        )
    if not done or done.get("iterations") != wanted or logged != wanted:
        return None
    if config.eval.num_prompts > 0 and _last_step(run_dir, "eval.jsonl") != wanted:
        return None  # stopped before its final evaluation: resuming evaluates it
    return done


def _last_step(run_dir: str, name: str = "metrics.jsonl") -> int:
    """The last iteration a run directory's ``name`` (metrics.jsonl, eval.jsonl) records
    (0 if none)."""
    path = os.path.join(run_dir, name)
    return max((int(r["step"]) for r in read_jsonl(path)), default=0) if os.path.exists(path) else 0


def _other_start(run_dir: str, identity: str, aliases: Collection[str] = ()) -> str | None:
    """The identity of the SFT start that ``run_dir`` was begun from (its START_FILE) when
    it is another than ``identity`` (the start trained again since) or its ``aliases``
    (the names ``start_id`` gave it before: ``Ledger.alias``), else None (a directory
    without the file, from before the ledger, is taken as this start's)."""
    path = os.path.join(run_dir, START_FILE)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)["start_id"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not JSON naming a start_id ({error}); remove it") from None
    return None if saved == identity or saved in aliases else saved


def _train(config, run_dir: str, what: str, quiet: bool, start_id: str | None = None) -> dict:
    """Trains (or resumes) one run to ``config.train.num_iterations`` and writes its
    DONE_FILE record; a run that stops before (a signal, or a trainer returning early) is
    an exit that asks for a rerun, and gets no record. ``start_id``: the identity of its
    SFT start, written to START_FILE before it trains."""
    if not quiet:
        print(f"== {what} -> {run_dir}", flush=True)
    if start_id is not None and not os.path.exists(os.path.join(run_dir, START_FILE)):
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, START_FILE + ".tmp"), "w") as f:
            json.dump({"start_id": start_id}, f)
        os.replace(f.name, os.path.join(run_dir, START_FILE))  # whole, or not there
    record = os.path.join(run_dir, DONE_FILE)
    if os.path.exists(record):  # an earlier, shorter run's: this one is not finished yet
        os.remove(record)
    train = run_async_rl if async_enabled(config) else run_rl
    start, cpu = time.perf_counter(), time.process_time()
    summary = train(config, run_dir, quiet=quiet)
    wanted = config.train.num_iterations
    if summary.get("interrupted") or summary["iteration"] != wanted:
        how = f"interrupted ({summary['interrupted']})" if summary.get("interrupted") else "stopped"
        raise SystemExit(
            f"{what}: {how} at iteration {summary['iteration']} of {wanted}; rerun to resume"
        )
    # cpu_s: this process's threads (the verifiers' processes are not counted).
    done = {
        "iterations": wanted,
        "wall_s": time.perf_counter() - start,
        "cpu_s": time.process_time() - cpu,
    }
    with open(record, "w") as f:
        json.dump(done, f)
    return done


def summarise_run(run_dir: str, tail: int) -> dict:
    """Held-out pass@1 at the first and last evaluation, the mean of ``TAIL_METRICS``
    over the last ``tail`` iterations, of ``POLICY_MEAN_METRICS`` over the policy's
    iterations, and a critic's ``WARMUP_EXPLAINED_VARIANCE``, from a run directory's JSONL
    files."""
    evals = read_jsonl(os.path.join(run_dir, "eval.jsonl"))
    # metrics.jsonl also holds the evaluations' records: keep the iterations' own.
    rows = [
        r
        for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        if any(k != "step" and not k.startswith("eval/") for k in r)
    ]
    out = {"iterations": int(rows[-1]["step"]) if rows else 0}
    if evals:
        out["pass@1_start"], out["pass@1_end"] = evals[0]["eval/pass@1"], evals[-1]["eval/pass@1"]
        out["eval_steps"] = [int(evals[0]["step"]), int(evals[-1]["step"])]
    routing = [
        (r["routing/log_ratio_ms_routing"], r["routing/log_ratio_ms_params"])
        for r in rows
        if "routing/log_ratio_ms_routing" in r
    ]
    if routing:  # pooled over the run: the per-iteration share is heavy-tailed
        total = sum(a + b for a, b in routing)
        # No log-ratio at all (a policy that never moved): the share is undefined, not 0.
        out["routing/ratio_share_pooled"] = (
            sum(a for a, _ in routing) / total if total else math.nan
        )
    out["collapse_iteration"] = collapse_iteration(rows)
    out["collapsed"] = float(out["collapse_iteration"] <= out["iterations"])
    last = rows[-tail:]
    for key in TAIL_METRICS:
        # NaN: an iteration without a value (e.g. no update: only dynamic sampling's fillers).
        values = [r[key] for r in last if key in r and math.isfinite(r[key])]
        if values:
            out[key] = statistics.fmean(values)
    policy_rows = [r for r in rows if not r.get("critic/pretraining")]
    for key, name in POLICY_MEAN_METRICS.items():
        values = [r[key] for r in policy_rows if key in r and math.isfinite(r[key])]
        if values:
            out[name] = statistics.fmean(values)
    if policy_rows and "critic/pretraining" in policy_rows[0]:
        value = policy_rows[0].get("critic/rollout_mc_explained_variance", math.nan)
        if math.isfinite(value):
            out[WARMUP_EXPLAINED_VARIANCE] = value
    return out


def collapse_iteration(rows: Sequence[dict], key: str = "reward/accuracy") -> int:
    """The first iteration at which a run has collapsed (``COLLAPSE_FRACTION``: the mean of
    ``key`` over the last 3 iterations below that fraction of the first 3 iterations'), or
    the number of iterations + 1 when it never does (a censored time to collapse).

    Args:
      rows: the run's iteration records in order (``step`` and ``key``).
    """
    values = [(int(r["step"]), r[key]) for r in rows if key in r and math.isfinite(r[key])]
    if len(values) < 3:
        return (int(rows[-1]["step"]) if rows else 0) + 1
    first = statistics.fmean(v for _, v in values[:3])
    for i in range(3, len(values) + 1):
        if statistics.fmean(v for _, v in values[i - 3 : i]) < COLLAPSE_FRACTION * first:
            return values[i - 1][0]
    return int(rows[-1]["step"]) + 1


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def run_ablation(
    ablation: Ablation,
    workdir: str,
    *,
    seeds: Sequence[int] = (0,),
    variant: str = "",
    setting: Callable | None = None,
    starts: Mapping[int, Callable] | None = None,
    tail: int = 5,
    arms: Sequence[str] | None = None,
    plot: bool = True,
    configure: Callable | None = None,
    quiet: bool = True,
    train: bool = True,
    ledger: Ledger | None = None,
    start_ids: Mapping[int, str] | None = None,
) -> dict:
    """Trains every arm (or those in ``arms``) at every seed, then writes the summary.

    Args:
      ablation: from ``configs.ablations``.
      workdir: the sweep's directory.
      seeds: one run per arm and seed (and start).
      variant: appended to every arm's variant (model, init checkpoint, iterations, ...).
      setting: ``config -> config`` applied under the variants (see ``arm_config``).
      starts: in place of ``setting``, one per SFT start: ``{start: config -> config}``;
        every arm and seed then runs from each start (``run_name``).
      tail: iterations averaged for the training metrics.
      arms: labels of the arms to run (default all).
      plot: write ``curves.png`` (of the runs whose logs are on this machine).
      configure: ``config -> config`` applied to each arm's config before training (for
        fields a variant string cannot set, e.g. tuples; the summary records its diff too).
      quiet: no per-iteration console line.
      train: False to summarise finished runs only: a run that is not finished is a
        ValueError naming it, and nothing trains.
      ledger: the claim's runs kept in the repository (``experiments.ledger``): a run
        recorded there for the same start and config is not trained again (its figures
        are the record's; it has no ``run_dir``), and every finished run is recorded.
      start_ids: with ``ledger``, each start's identity (``ledger.start_id``).

    Returns:
      The summary (also in ``workdir/summary.json``): per arm, its ``runs`` (each with
      ``start``, ``seed``, ``run_dir``, ``regime`` and ``summarise_run``'s figures) and the
      figures' mean and std over them.
    """
    twice = next((s for i, s in enumerate(seeds) if s in list(seeds)[:i]), None)
    if twice is not None:
        raise ValueError(f"run_ablation: seed {twice} is named twice (seeds {list(seeds)})")
    selected = [a for a in ablation.arms if arms is None or a.label in arms]
    if not selected:
        raise ValueError(
            f"none of arms={list(arms)} is an arm of {ablation.name!r}: "
            f"{[a.label for a in ablation.arms]}"
        )
    if starts is not None and setting is not None:
        raise ValueError("run_ablation: give a setting or the starts' settings, not both")
    plan = dict(starts) if starts is not None else {0: setting}
    if ledger is not None and set(start_ids or ()) != set(plan):
        raise ValueError(
            f"run_ablation: a ledger needs the identity of every start {sorted(plan)}, "
            f"got {sorted(start_ids or ())}"
        )
    os.makedirs(workdir, exist_ok=True)
    reference = None
    results = []
    for arm in selected:
        runs, first = [], None
        for start, start_setting in plan.items():
            for seed in seeds:
                config = arm_config(ablation, arm.label, seed, variant, start_setting)
                if configure is not None:
                    config = configure(config)
                first = config if first is None else first
                reference = config if reference is None else reference
                name = run_name(start, seed)
                run_dir = os.path.join(workdir, arm.label, name)
                done = _finished(run_dir, config)
                identity = (arm.label, start, seed)
                if ledger is not None:
                    key = run_config_key(config, tail)
                    identity += (start_ids[start], key)
                    aliases = ledger.aliases.get((start, start_ids[start]), ())
                    other = _other_start(run_dir, start_ids[start], aliases)
                    recorded = ledger.find(*identity) if done is None or other else None
                    if recorded is not None:
                        runs.append(Ledger.run_of(recorded))
                        continue
                    if other is not None:  # neither judged nor trained on as this start's
                        raise ValueError(
                            f"{run_dir} was trained from SFT start {start} as {other}, not "
                            f"as it is now ({start_ids[start]}): its figures are not this "
                            "start's; use another --workdir, or remove that run"
                        )
                if done is None and not train:
                    elsewhere = ledger is not None and [
                        r["start_id"]
                        for r in ledger.records
                        if (r["arm"], int(r["start"]), int(r["seed"]), r["config"])
                        == (arm.label, start, seed, identity[-1])
                    ]
                    raise ValueError(
                        f"{run_dir} is not finished ({ablation.name}: {arm.label}, {name})"
                        + (
                            f"; {ledger.path} records it from SFT start {start} as "
                            f"{', '.join(elsewhere)}, not as it is here ({start_ids[start]})"
                            if elsewhere
                            else ""
                        )
                        + "; judging finished runs only, nothing trains"
                    )
                if done is None:
                    done = _train(
                        config,
                        run_dir,
                        f"{ablation.name}: {arm.label}, {name}",
                        quiet,
                        start_ids[start] if ledger is not None else None,
                    )
                # wall_s, cpu_s: the attempt that finished the run (a resumed run's last
                # attempt; cpu_s None in a record written before it was kept).
                run = {
                    "start": start,
                    "seed": seed,
                    "run_dir": run_dir,
                    "wall_s": done["wall_s"],
                    "cpu_s": done.get("cpu_s"),
                    "regime": regime_of(config),
                    **summarise_run(run_dir, tail),
                }
                if ledger is not None:
                    ledger.add(*identity, run)
                runs.append(run)
        entry = {
            "arm": arm.label,
            "recipe": arm.recipe,
            "variant": arm.variant,
            "differs_from_first_arm": config_diff(reference, first),  # at the first run
            "runs": runs,
        }
        for key in (
            "pass@1_start",
            "pass@1_end",
            "collapse_iteration",
            "collapsed",
            "routing/ratio_share_pooled",
            *TAIL_METRICS,
            *POLICY_MEAN_METRICS.values(),
            WARMUP_EXPLAINED_VARIANCE,
        ):
            # Over the runs where it is defined (an undefined routing share is NaN).
            values = [r[key] for r in runs if key in r and math.isfinite(r[key])]
            if values:
                entry[key] = dict(zip(("mean", "std"), _mean_std(values)))
        results.append(entry)
    named = [getattr(fn, "__name__", None) for fn in plan.values() if fn is not None]
    summary = {
        "ablation": ablation.name,
        "claim": ablation.claim,
        "starts": list(plan),
        "seeds": list(seeds),
        "ablation_variant": ablation.variant,
        "variant": variant,
        "setting": named[0] if named else None,
        "tail": tail,
        "arms": results,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(workdir, "summary.md"), "w") as f:
        f.write(format_table(summary))
    # The runs with logs here (a recorded run's are on the machine that trained it).
    every = [(e["arm"], r) for e in results for r in e["runs"] if r["run_dir"] is not None]
    if plot and every:
        summary["curves"] = plot_runs(
            [r["run_dir"] for _, r in every],
            os.path.join(workdir, "curves.png"),
            labels=[f"{arm}/{run_name(r['start'], r['seed'])}" for arm, r in every],
            groups=[arm for arm, _ in every],
        )
    return summary


def format_table(summary: dict) -> str:
    """The summary as a Markdown table (means over runs, +- the std when several)."""

    def cell(entry, key, digits=3):
        stat = entry.get(key)
        if stat is None:
            return ""
        text = f"{stat['mean']:.{digits}f}"
        return text + (f" ± {stat['std']:.{digits}f}" if len(entry["runs"]) > 1 else "")

    lines = [
        f"# Ablation `{summary['ablation']}`",
        "",
        summary["claim"],
        "",
        f"SFT starts {summary['starts']} x seeds {summary['seeds']}; "
        f"every arm `{summary['ablation_variant'] or '(recipe)'}`; "
        f"setting `{summary['setting'] or '(none)'}`; "
        f"common variant `{summary['variant'] or '(none)'}`; "
        f"training metrics are means over the last {summary['tail']} iterations.",
        "",
        "| arm | recipe | variant | pass@1 start | pass@1 end | reward | clip frac | gate "
        "| volatility | routing share | length | wall s | CPU s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for entry in summary["arms"]:
        wall = statistics.fmean(r["wall_s"] for r in entry["runs"])
        cpus = [r["cpu_s"] for r in entry["runs"] if r.get("cpu_s") is not None]
        cpu = f"{statistics.fmean(cpus):.0f}" if cpus else "-"
        lines.append(
            f"| {entry['arm']} | {entry['recipe']} | `{entry['variant'] or '-'}` | "
            f"{cell(entry, 'pass@1_start')} | {cell(entry, 'pass@1_end')} | "
            f"{cell(entry, 'reward/mean')} | {cell(entry, 'loss/clip_frac')} | "
            f"{cell(entry, 'loss/gate_mean')} | {cell(entry, 'routing/volatility')} | "
            f"{cell(entry, 'routing/ratio_share_pooled')} | "
            f"{cell(entry, 'response/length_mean', 1)} | {wall:.0f} | {cpu} |"
        )
    return "\n".join(lines) + "\n"


def define_flags() -> None:
    """The command line (defined when run as a script, so that importing this module for
    ``run_ablation`` defines no flags)."""
    flags.DEFINE_string("ablation", None, "A name of configs/ablations.py.")
    flags.DEFINE_string("workdir", None, "Directory of the sweep (resumed if it exists).")
    flags.DEFINE_list("seeds", ["0"], "Seeds, one run per arm and seed.")
    flags.DEFINE_string("variant", "", "Variant appended to every arm, key=value,...")
    flags.DEFINE_enum(
        "setting",
        None,
        sorted(SETTINGS),
        "A named setting under every arm "
        "(configs/ablations.py SETTINGS; 'demo': the demo's task and SFT start).",
    )
    flags.DEFINE_list("arms", None, "Only these arms (labels).")
    flags.DEFINE_integer("tail", 5, "Iterations averaged for the training metrics.")
    flags.DEFINE_bool("list", False, "List the ablations and their arms, then exit.")


def main(argv):
    del argv
    args = flags.FLAGS
    if args.list:
        for ablation in ABLATIONS.values():  # 100 columns
            print(wrap(f"{ablation.name}: {ablation.claim}"))
            if ablation.variant:
                print(wrap(f"(every arm: {ablation.variant})", first="    ", rest="     "))
            for arm in ablation.arms:
                suffix = f":{arm.variant}" if arm.variant else ""
                print(
                    wrap(
                        f"configs/{arm.recipe}.py{suffix}",
                        first=f"    {arm.label:22s} ",
                        rest=" " * 27,
                    )
                )
            print()
        return
    if not args.ablation or not args.workdir:
        raise cli.UsageError("--ablation and --workdir are required (or --list)")
    try:
        seeds = [int(s) for s in args.seeds]
    except ValueError:
        raise cli.UsageError(
            f"--seeds takes integers, e.g. 0,1; got {','.join(args.seeds)}"
        ) from None
    ablation = get_ablation(args.ablation)
    quiet_library_logging()
    keep_freed_host_memory()  # reuse XLA:CPU's freed buffers (policyopt.runtime)
    summary = run_ablation(
        ablation,
        args.workdir,
        seeds=seeds,
        variant=args.variant,
        setting=SETTINGS[args.setting] if args.setting else None,
        tail=args.tail,
        arms=args.arms,
        quiet=False,
    )
    print(format_table(summary))


if __name__ == "__main__":
    define_flags()
    cli.run(main)  # one-line errors; the compilation cache (docs/runs.md)
