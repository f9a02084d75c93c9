"""Writes the project's own GSM8K-style data (`policyopt.data.word_problems`): the file the
quickstart trains on (docs/quickstart.md).

    python -m experiments.word_problems                     # data/gsm8k_tiny/{train,test}.jsonl
    python -m experiments.word_problems --out my_data --num_train 2000 --seed 1

The shipped files are this command's output at its defaults; `tests/experiments/test_own_data.py`
checks that they still are.
"""

from absl import app, flags

from policyopt.data.word_problems import word_problem_splits, write_splits

_OUT = flags.DEFINE_string("out", "data/gsm8k_tiny", "Folder of train.jsonl and test.jsonl.")
_NUM_TRAIN = flags.DEFINE_integer("num_train", 3000, "Training rows.")
_NUM_TEST = flags.DEFINE_integer("num_test", 150, "Held-out rows (none a training question).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the draw.")


def main(argv):
    del argv
    splits = word_problem_splits(_NUM_TRAIN.value, _NUM_TEST.value, _SEED.value)
    for path, problems in zip(write_splits(_OUT.value, splits), splits.values()):
        print(f"wrote {path}: {len(problems)} rows")


if __name__ == "__main__":
    app.run(main)
