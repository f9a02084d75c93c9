"""PNG curves of one or more runs side by side (reads each run's metrics.jsonl and eval.jsonl)."""

from __future__ import annotations

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
    ("response length", "response/length_mean", "metrics.jsonl"),
    ("entropy", "policy/entropy", "metrics.jsonl"),
)


def load_curve(run_dir: str, key: str, filename: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of ``key`` in ``run_dir/filename`` (empty when absent)."""
    path = os.path.join(run_dir, filename)
    if not os.path.exists(path):
        return [], []
    records = [r for r in read_jsonl(path) if key in r]
    return [r["step"] for r in records], [r[key] for r in records]


def _default_labels(run_dirs: Sequence[str]) -> list[str]:
    """The shortest trailing path parts that tell the runs apart (``a/rl``, ``b/rl``)."""
    parts = [os.path.normpath(d).split(os.sep) for d in run_dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [os.path.normpath(d) for d in run_dirs]


def plot_runs(run_dirs: Sequence[str], out_path: str, *, labels: Sequence[str] | None = None,
              groups: Sequence[str] | None = None, panels=PANELS) -> str:
    """Draws one panel per metric, one line per run, and writes a PNG.

    Args:
      run_dirs: work directories of ``experiments/train.py`` runs.
      out_path: the PNG file to write.
      labels: line names (default: the shortest trailing parts of the directory paths
        that differ between runs); the legend when there are no ``groups``.
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

    labels = list(labels) if labels else _default_labels(run_dirs)
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    styles = [{} for _ in run_dirs]
    if groups is not None:
        if len(groups) != len(run_dirs):
            raise ValueError(f"{len(groups)} groups for {len(run_dirs)} runs")
        colours, members = {}, {}
        for i, group in enumerate(groups):
            colours.setdefault(group, f"C{len(colours) % 10}")
            members[group] = members.get(group, -1) + 1
            styles[i] = {"color": colours[group],
                         "linestyle": ("-", "--", ":", "-.")[members[group] % 4]}
    cols = 4
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (title, key, filename) in zip(axes.flat, panels):
        for run_dir, label, style in zip(run_dirs, labels, styles):
            steps, values = load_curve(run_dir, key, filename)
            if steps:
                ax.plot(steps, values, label=label, marker="." if len(steps) < 30 else None,
                        linewidth=1.2, **style)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if groups is None:
        axes.flat[0].legend(fontsize=8)
    else:
        from matplotlib.lines import Line2D  # noqa: PLC0415

        handles = [Line2D([], [], color=colour, label=group) for group, colour in colours.items()]
        axes.flat[0].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
