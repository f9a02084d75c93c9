"""PNG curves of one or more runs side by side (reads each run's metrics.jsonl and eval.jsonl).

RL and SFT runs alike: a panel is drawn when at least one run logged its metric (an SFT
run logs ``sft/nll`` and its evaluations in metrics.jsonl), and runs whose curves
coincide stay visible (each run its own line style and marker, lines slightly
transparent). One legend below the panels names every run. SFT steps and RL iterations
never share an x axis: in a panel holding both, the SFT curves take a second x axis on
top. Rewards on different scales (the run's ``config.json``: format gate, incorrect
value, length shaping, language bonus) get a panel each. A run directory that does not
exist or holds no metrics is an error.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from policyopt.metrics import read_jsonl

#: (title, metrics key, file) of each panel.
PANELS = (
    ("reward (mean)", "reward/mean", "metrics.jsonl"),
    ("accuracy (train samples)", "reward/accuracy", "metrics.jsonl"),
    ("held-out pass@1 (greedy)", "eval/pass@1", "eval.jsonl"),
    ("clip fraction", "loss/clip_frac", "metrics.jsonl"),
    ("mean gate weight", "loss/gate_mean", "metrics.jsonl"),
    ("routing volatility", "routing/volatility", "metrics.jsonl"),
    ("routing share of the log-ratio", "routing/ratio_share", "metrics.jsonl"),
    ("response length", "response/length_mean", "metrics.jsonl"),
    ("entropy", "policy/entropy", "metrics.jsonl"),
    ("SFT loss (NLL)", "sft/nll", "metrics.jsonl"),
)
#: Line styles and markers cycled over the runs of a panel, so that equal curves stay
#: visible on top of each other.
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x", "+", "*")


def load_curve(run_dir: str, key: str, filename: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of ``key`` in ``run_dir/filename``, else in the run's other
    metrics file (SFT runs log their evaluations in metrics.jsonl); empty when absent."""
    for name in (filename, *(f for f in ("metrics.jsonl", "eval.jsonl") if f != filename)):
        path = os.path.join(run_dir, name)
        if os.path.exists(path):
            records = [r for r in read_jsonl(path) if key in r]
            if records:
                return [r["step"] for r in records], [r[key] for r in records]
    return [], []


def is_sft_run(run_dir: str) -> bool:
    """Whether ``run_dir`` is an SFT run (it logged ``sft/nll``): its steps are SFT
    updates, not RL iterations."""
    return bool(load_curve(run_dir, "sft/nll", "metrics.jsonl")[0])


def reward_scale(run_dir: str) -> str | None:
    """The scale of the run's ``reward/mean`` as its ``config.json`` sets it (``"correct
    1, incorrect -1, dapo length penalty"``); None without a config."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        reward = json.load(f).get("reward", {})
    if reward.get("format"):
        text = f"format {reward.get('format_value', 0.1):g} + correct "
        text += f"{reward.get('correct_value', 0.9):g}"
    else:
        text = f"correct 1, incorrect {reward.get('incorrect_value', 0.0):g}"
    if reward.get("overlong", "none") != "none":
        text += f", {reward['overlong']} length penalty"
    if reward.get("language_bonus"):
        text += f", language +{reward['language_bonus']:g}"
    return text


def check_runs(run_dirs: Sequence[str]) -> None:
    """Raises FileNotFoundError naming every run directory that does not exist or holds
    neither metrics.jsonl nor eval.jsonl."""
    if not run_dirs:
        raise ValueError("no run directory given")
    bad = [
        d
        for d in run_dirs
        if not any(os.path.isfile(os.path.join(d, f)) for f in ("metrics.jsonl", "eval.jsonl"))
    ]
    if bad:
        raise FileNotFoundError(
            "no run (metrics.jsonl or eval.jsonl) in " + ", ".join(map(repr, bad))
        )


def line_styles(num_runs: int, groups: Sequence[str] | None = None) -> list[dict]:
    """matplotlib line keywords per run: without groups each run gets a colour, a line
    style and a marker of its own; with groups the runs of a group share a colour and
    differ in line style and marker."""
    styles = []
    if groups is None:
        for i in range(num_runs):
            styles.append(
                {
                    "color": f"C{i % 10}",
                    "linestyle": LINESTYLES[i % len(LINESTYLES)],
                    "marker": MARKERS[i % len(MARKERS)],
                }
            )
        return styles
    colours, members = {}, {}
    for group in groups:
        colours.setdefault(group, f"C{len(colours) % 10}")
        members[group] = members.get(group, -1) + 1
        member = members[group]
        styles.append(
            {
                "color": colours[group],
                "linestyle": LINESTYLES[member % len(LINESTYLES)],
                "marker": MARKERS[member % len(MARKERS)],
            }
        )
    return styles


def _default_labels(run_dirs: Sequence[str]) -> list[str]:
    """The shortest trailing path parts that tell the runs apart (``a/rl``, ``b/rl``)."""
    parts = [os.path.normpath(d).split(os.sep) for d in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [os.path.normpath(d) for d in run_dirs]


def plot_runs(
    run_dirs: Sequence[str],
    out_path: str,
    *,
    labels: Sequence[str] | None = None,
    groups: Sequence[str] | None = None,
    panels=PANELS,
) -> str:
    """Draws one panel per metric (the reward's per reward scale), one line per run, one
    legend below the panels, and writes a PNG. SFT runs (``is_sft_run``) are drawn against
    their steps on an x axis of their own.

    Args:
      run_dirs: work directories of ``experiments/train.py`` runs.
      out_path: the PNG file to write.
      labels: line names (default: the shortest trailing parts of the directory paths
        that differ between runs); the legend's entries when there are no ``groups``.
      groups: one group name per run (e.g. an ablation's arm, its runs the seeds): a
        group's runs share a colour, each with its own line style, and the legend has one
        entry per group.
      panels: ``(title, key, file)`` triples.

    Returns:
      ``out_path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_runs(run_dirs)
    labels = list(labels) if labels else _default_labels(run_dirs)
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    if groups is not None and len(groups) != len(run_dirs):
        raise ValueError(f"{len(groups)} groups for {len(run_dirs)} runs")
    styles = line_styles(len(run_dirs), groups)
    colours = {group: style["color"] for group, style in zip(groups or (), styles)}
    sft = [is_sft_run(d) for d in run_dirs]
    curves = {
        (key, filename): [load_curve(d, key, filename) for d in run_dirs]
        for _, key, filename in panels
    }
    drawn = []  # (title, key, filename, the runs it holds)
    for title, key, filename in panels:
        present = [i for i, (steps, _) in enumerate(curves[(key, filename)]) if steps]
        if key != "reward/mean":
            drawn += [(title, key, filename, present)] if present else []
            continue
        scales: dict = {}  # one panel per reward scale
        for i in present:
            scales.setdefault(reward_scale(run_dirs[i]), []).append(i)
        for scale, members in scales.items():
            drawn.append((f"{title}\n{scale}" if scale else title, key, filename, members))
    if not drawn:
        raise ValueError(f"none of the runs {list(run_dirs)} logged a metric of the panels")
    cols = min(4, len(drawn))
    rows = -(-len(drawn) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows + 0.6), squeeze=False)
    for ax, (title, key, filename, members) in zip(axes.flat, drawn):
        rl_runs = [i for i in members if not sft[i]]
        sft_runs = [i for i in members if sft[i]]
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        for runs, axis, xlabel in (
            (rl_runs, ax, "RL iteration"),
            (sft_runs, ax.twiny() if rl_runs and sft_runs else ax, "SFT step"),
        ):
            if not runs:
                continue
            axis.set_xlabel(xlabel)
            for i in runs:
                steps, values = curves[(key, filename)][i]
                axis.plot(
                    steps,
                    values,
                    label=labels[i],
                    linewidth=1.2,
                    alpha=0.8,
                    markersize=4,
                    markevery=max(1, len(steps) // 12),
                    **styles[i],
                )
    for ax in list(axes.flat)[len(drawn) :]:
        ax.axis("off")
    from matplotlib.lines import Line2D  # noqa: PLC0415

    if groups is None:
        handles = [Line2D([], [], label=label, **style) for label, style in zip(labels, styles)]
    else:
        handles = [Line2D([], [], color=colour, label=group) for group, colour in colours.items()]
    ncol = min(len(handles), 4)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    legend_inches = 0.25 * -(-len(handles) // ncol) + 0.15
    fig.tight_layout(rect=(0, legend_inches / fig.get_figheight(), 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
