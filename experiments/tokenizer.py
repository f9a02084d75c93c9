"""Trains a byte-level BPE `tokenizer.json` on a task's training file, for any preset.

    python -m experiments.tokenizer --config configs/quickstart.py --out runs/qs/tokenizer.json
    python -m experiments.tokenizer --config configs/grpo.py --config.task.name=math_jsonl \
        --config.task.train_file=train.jsonl --config.task.test_file=test.jsonl \
        --out runs/own/tokenizer.json --vocab_size 1024

The text is the training split's prompts (`task.prompt_template` applied) and worked
solutions, read as a run reads them (a row without the named fields stops it, naming the
file and line, before anything is written). Runs then use it with
`--config.model.tokenizer=<out>`: the preset's vocabulary becomes the tokenizer's size. It
prints the longest prompt (chat template included) and worked solution (EOS included) in
tokens, which `batch.prompt_buckets`, `batch.response_buckets` and
`sampling.max_new_tokens` must hold. An existing file is kept when the training gives the
same tokenizer, and replaced only with `--overwrite` (a checkpoint trained with the old one
would read other ids). docs/quickstart.md walks the whole path.
"""

from __future__ import annotations

import os

import numpy as np
from absl import flags

from experiments import cli

cli.define_config_flag("Recipe whose task.* fields name the data.", dry_run=False)
_OUT = flags.DEFINE_string("out", None, "Where the tokenizer.json goes.")
_VOCAB = flags.DEFINE_integer(
    "vocab_size", 1024, "Most tokens (>= 259: the 256 bytes and ChatML's specials)."
)
_MIN_FREQUENCY = flags.DEFINE_integer("min_frequency", 2, "Least count of a pair that merges.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace --out if it holds another tokenizer.")
flags.adopt_module_key_flags(cli)


def main(argv):
    del argv
    if not cli.config_given():
        raise cli.UsageError("--config is required (the recipe whose task.* names the data)")
    config = cli.final_config()
    if _OUT.value is None:
        raise cli.UsageError("--out is required (where tokenizer.json goes)")
    if config.task.name == "arithmetic":
        raise cli.UsageError(
            "config.task.name='arithmetic' has its own character tokenizer; name a file task "
            "(task.name=math_jsonl, code_jsonl or mixed_jsonl, with task.train_file)"
        )
    from policyopt.data.tokenizer import train_bpe  # noqa: PLC0415 - after the config is checked
    from policyopt.rl.loop import build  # noqa: PLC0415

    records = build.task_records(config, "train")  # a bad row or field raises here
    texts = [text for record in records for text in (record["prompt"], record["solution"])]
    tokenizer = train_bpe(
        (text for text in texts if text),
        vocab_size=_VOCAB.value,
        min_frequency=_MIN_FREQUENCY.value,
    )
    text = tokenizer.tokenizer.to_str(pretty=True)
    out = _OUT.value
    if os.path.exists(out):
        with open(out, encoding="utf-8") as f:
            same = f.read() == text
        if not same and not _OVERWRITE.value:
            raise cli.UsageError(
                f"--out={out!r} holds another tokenizer (runs trained with it would read other "
                "ids); pass --overwrite to replace it, or choose another path"
            )
    else:
        same = False
    if not same:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(out + ".tmp", out)
    prompts = np.array([len(tokenizer.encode_prompt(r["prompt"])) for r in records])
    solutions = np.array([len(tokenizer.encode_response(r["solution"])) for r in records])
    print(
        f"{'kept' if same else 'wrote'} {out}: {tokenizer.vocab_size} tokens, trained on "
        f"{len(records)} rows of {config.task.train_file}"
    )
    print(
        f"  prompts (chat template included): mean {prompts.mean():.1f}, longest "
        f"{prompts.max()} tokens: batch.prompt_buckets needs a bucket >= {prompts.max()}"
    )
    if solutions.max() > 1:
        print(
            f"  worked solutions (EOS included): mean {solutions.mean():.1f}, longest "
            f"{solutions.max()} tokens: sampling.max_new_tokens and the largest of "
            f"batch.response_buckets >= {solutions.max()} for SFT and RL"
        )
    print(f"use it with --config.model.tokenizer={out}")
    return 0


if __name__ == "__main__":
    cli.run(main)
