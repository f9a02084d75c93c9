"""experiments/plot.py's library function: curves of several runs side by side."""

import json
import os

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402

from policyopt.metrics import MetricsWriter  # noqa: E402
from policyopt.rl.reporting import plots  # noqa: E402


def _fake_run(path, reward_slope):
    writer = MetricsWriter(str(path), tensorboard=False)
    for step in range(1, 6):
        writer.write(
            step,
            {
                "reward/mean": reward_slope * step,
                "reward/accuracy": 0.5,
                "routing/volatility": 0.1,
                "routing/ratio_share": 0.25,
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
    assert drawn["routing share of the log-ratio"]["b/rl"] == [0.25] * 5
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
        seen["legend"] = [text.get_text() for text in fig.legends[0].get_texts()]
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


def _record(monkeypatch):
    """What ``plot_runs`` draws: each axis as (title, x label, {line label: y values}) and
    the figure's legends (their texts), taken when the figure is saved."""
    drawn = {"axes": [], "legends": [], "axis_legends": 0}
    savefig = plt.Figure.savefig

    def record(fig, path, **kwargs):
        for ax in fig.axes:
            lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
            drawn["axes"].append((ax.get_title(), ax.get_xlabel(), lines))
            drawn["axis_legends"] += ax.get_legend() is not None
        drawn["legends"] = [[t.get_text() for t in legend.get_texts()] for legend in fig.legends]
        return savefig(fig, path, **kwargs)

    monkeypatch.setattr(plt.Figure, "savefig", record)
    return drawn


def test_one_legend_for_every_run_and_sft_steps_on_their_own_axis(tmp_path, monkeypatch):
    _fake_run(tmp_path / "rl", 0.1)
    sft = MetricsWriter(str(tmp_path / "sft"), tensorboard=False)
    sft.write(400, {"sft/nll": 2.0})
    sft.write(800, {"sft/nll": 1.0, "eval/pass@1": 0.25})  # SFT logs its evaluation here
    sft.close()
    drawn = _record(monkeypatch)
    plots.plot_runs([str(tmp_path / "rl"), str(tmp_path / "sft")], str(tmp_path / "c.png"))
    # One legend for the figure, naming every run (the SFT run logs no reward: a legend in
    # the first panel, the reward's, left it out).
    assert drawn["legends"] == [["rl", "sft"]] and drawn["axis_legends"] == 0
    axes = {(title, xlabel): lines for title, xlabel, lines in drawn["axes"] if lines}
    # SFT steps (800) and RL iterations (5) never share an x axis.
    assert axes[("held-out pass@1 (greedy)", "RL iteration")] == {"rl": [0.3, 0.4]}
    assert axes[("", "SFT step")] == {"sft": [0.25]}  # the panel's second x axis, on top
    assert axes[("SFT loss (NLL)", "SFT step")] == {"sft": [2.0, 1.0]}
    assert axes[("reward (mean)", "RL iteration")] == {"rl": [0.1 * s for s in range(1, 6)]}


def test_reward_panels_per_reward_scale(tmp_path, monkeypatch):
    scales = {"grpo": {"format": False, "incorrect_value": 0.0, "overlong": "none"}}
    scales["dapo"] = {"format": False, "incorrect_value": -1.0, "overlong": "dapo"}
    scales["magistral"] = {
        "format": True,
        "format_value": 0.1,
        "correct_value": 0.9,
        "overlong": "magistral",
        "language_bonus": 0.1,
    }
    for name, reward in scales.items():
        _fake_run(tmp_path / name, 0.1)
        (tmp_path / name / "config.json").write_text(json.dumps({"reward": reward}))
    _fake_run(tmp_path / "grpo2", 0.2)
    (tmp_path / "grpo2" / "config.json").write_text(json.dumps({"reward": scales["grpo"]}))
    drawn = _record(monkeypatch)
    runs = [str(tmp_path / name) for name in ("grpo", "dapo", "magistral", "grpo2")]
    plots.plot_runs(runs, str(tmp_path / "c.png"))
    rewards = {title: sorted(lines) for title, _, lines in drawn["axes"] if "reward (" in title}
    assert rewards == {
        "reward (mean)\ncorrect 1, incorrect 0": ["grpo", "grpo2"],
        "reward (mean)\ncorrect 1, incorrect -1, dapo length penalty": ["dapo"],
        "reward (mean)\nformat 0.1 + correct 0.9, magistral length penalty, language +0.1": [
            "magistral"
        ],
    }
    accuracy = next(lines for title, _, lines in drawn["axes"] if title.startswith("accuracy"))
    assert sorted(accuracy) == ["dapo", "grpo", "grpo2", "magistral"]  # one scale: [0, 1]
    assert drawn["legends"] == [["grpo", "dapo", "magistral", "grpo2"]]
