"""Curves of RL runs side by side: reward, accuracy, held-out pass@1, clip fraction, gate
weight, routing volatility, response length, entropy.

    python -m experiments.plot --runs runs/sapo,runs/grpo --out runs/compare.png
"""

from absl import app, flags

from policyopt.rl.plots import plot_runs

_RUNS = flags.DEFINE_list("runs", None, "Comma-separated run directories.")
_LABELS = flags.DEFINE_list("labels", None, "Legend names (default: directory names).")
_OUT = flags.DEFINE_string("out", "curves.png", "PNG file to write.")
flags.mark_flags_as_required(["runs"])


def main(argv):
    del argv
    print(plot_runs(_RUNS.value, _OUT.value, labels=_LABELS.value))


if __name__ == "__main__":
    app.run(main)
