"""Curves of RL or SFT runs side by side: reward, accuracy, held-out pass@1, clip fraction,
gate weight, routing volatility, response length, entropy, SFT loss (the panels some run
logged; a run directory without metrics is an error).

    python -m experiments.plot --runs runs/sapo,runs/grpo --out runs/compare.png
    python -m experiments.plot --runs runs/demo/rl,runs/demo/control --out runs/demo/curves.png
"""

from absl import flags

from experiments import cli
from policyopt.rl.reporting.plots import plot_runs

_RUNS = flags.DEFINE_list("runs", None, "Comma-separated run directories.")
_LABELS = flags.DEFINE_list("labels", None, "Legend names (default: directory names).")
_OUT = flags.DEFINE_string("out", "curves.png", "PNG file to write.")
flags.adopt_module_key_flags(cli)


def main(argv):
    del argv
    if not _RUNS.value:
        raise cli.UsageError("--runs is required (comma-separated run directories)")
    print(plot_runs(_RUNS.value, _OUT.value, labels=_LABELS.value))


if __name__ == "__main__":
    cli.run(main)
