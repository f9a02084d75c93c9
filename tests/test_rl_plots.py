"""experiments/plot.py's library function: curves of several runs side by side."""

import os

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402

from policyopt.metrics import MetricsWriter  # noqa: E402
from policyopt.rl import plots  # noqa: E402


def _fake_run(path, reward_slope):
    writer = MetricsWriter(str(path), tensorboard=False)
    for step in range(1, 6):
        writer.write(
            step,
            {
                "reward/mean": reward_slope * step,
                "routing/volatility": 0.1,
                "response/length_mean": 10.0 + step,
            },
        )
    writer.close()
    evals = MetricsWriter(str(path), filename="eval.jsonl", tensorboard=False)
    evals.write(0, {"eval/pass@1": 0.3})
    evals.write(5, {"eval/pass@1": 0.3 + reward_slope})
    evals.close()


def test_plot_runs_draws_every_run_with_distinct_labels(tmp_path, monkeypatch):
    for name, slope in (("a", 0.1), ("b", 0.05)):
        _fake_run(tmp_path / name / "rl", slope)
    drawn = {}
    savefig = plt.Figure.savefig

    def record(fig, path, **kwargs):
        for ax in fig.axes:
            drawn[ax.get_title()] = {
                line.get_label(): list(line.get_ydata()) for line in ax.get_lines()
            }
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    out = plots.plot_runs(
        [str(tmp_path / "a" / "rl"), str(tmp_path / "b" / "rl")],
        str(tmp_path / "out" / "curves.png"),
    )
    assert os.path.getsize(out) > 1000
    assert drawn["reward (mean)"]["a/rl"] == [0.1 * s for s in range(1, 6)]
    assert drawn["reward (mean)"]["b/rl"] == [0.05 * s for s in range(1, 6)]
    assert drawn["held-out pass@1 (greedy)"]["b/rl"] == [0.3, 0.35]
    assert drawn["routing volatility"]["a/rl"] == [0.1] * 5
    assert "clip fraction" not in drawn  # a metric no run logged: no panel, no error


def test_groups_share_a_colour_and_one_legend_entry(tmp_path, monkeypatch):
    runs = []
    for name, slope in (("a0", 0.1), ("a1", 0.2), ("b0", 0.05)):
        _fake_run(tmp_path / name, slope)
        runs.append(str(tmp_path / name))
    seen = {}
    savefig = plt.Figure.savefig

    def record(fig, path, **kwargs):
        ax = fig.axes[0]
        seen["lines"] = {
            line.get_label(): (line.get_color(), line.get_linestyle()) for line in ax.get_lines()
        }
        seen["legend"] = [text.get_text() for text in ax.get_legend().get_texts()]
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    plots.plot_runs(
        runs, str(tmp_path / "curves.png"), labels=["a/s0", "a/s1", "b/s0"], groups=["a", "a", "b"]
    )
    lines = seen["lines"]
    assert lines["a/s0"][0] == lines["a/s1"][0] != lines["b/s0"][0]
    assert lines["a/s0"][1] != lines["a/s1"][1]
    assert seen["legend"] == ["a", "b"]


def test_default_labels_use_the_shortest_distinguishing_suffix():
    assert plots._default_labels(["runs/sapo", "runs/grpo"]) == ["sapo", "grpo"]
    assert plots._default_labels(["runs/s0/rl", "runs/s1/rl"]) == ["s0/rl", "s1/rl"]
