"""Supervised fine-tuning (policyopt.rl.sft) end to end on a tiny model: a rerun in a finished
workdir reuses it; the cosine learning-rate schedule."""

import os
import shutil

import jax
import numpy as np
import pytest

from policyopt.metrics import read_jsonl
from tests.rl.test_trainer import tiny


def test_sft_rerun_in_a_finished_workdir_reuses_it(tmp_path):
    """A second run_sft in a workdir that already holds its last step restores it and
    returns the same parameters and evaluation (it used to fail saving that step again,
    then to evaluate again); sft.checkpoint_every saves along the way."""
    from policyopt.rl.sft import run_sft

    config = tiny(
        "grpo",
        extra="eval.num_prompts=4,sft.steps=3,sft.batch_size=4,sft.checkpoint_every=1,"
        "sft.overlong_response=drop",
    )
    first = run_sft(config, str(tmp_path / "sft"), quiet=True)
    assert first["checkpoint_dir"] and sorted(os.listdir(first["checkpoint_dir"])) == ["2", "3"]
    again = run_sft(config, str(tmp_path / "sft"), quiet=True)
    assert first["step"] == again["step"] == 3
    for got, want in zip(jax.tree.leaves(again["params"]), jax.tree.leaves(first["params"])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # The final evaluation is read back from the log, not run (and logged) again.
    assert again["eval"] == first["eval"] and "eval/pass@1" in again["eval"]
    rows = read_jsonl(tmp_path / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [3]
    assert [r["step"] for r in rows if "sft/nll" in r] == [1, 2, 3]
    # Resumed at an earlier checkpoint and stopped there: evaluated there once, ever.
    shutil.rmtree(tmp_path / "sft" / "checkpoints" / "3")
    for _ in range(2):
        assert run_sft(config, str(tmp_path / "sft"), steps=2, quiet=True)["step"] == 2
    rows = read_jsonl(tmp_path / "sft" / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [2]
    # SFT compares only what it reads: another RL setting reuses the SFT run.
    other_rl = tiny(
        "grpo",
        extra="eval.num_prompts=4,sft.steps=3,sft.batch_size=4,sft.checkpoint_every=1,"
        "sft.overlong_response=drop,algo.clip_high=0.3",
    )
    assert run_sft(other_rl, str(tmp_path / "sft"), steps=2, quiet=True)["step"] == 2
    with pytest.raises(ValueError, match=r"another config \(sft.lr"):
        run_sft(
            tiny(
                "grpo",
                extra="eval.num_prompts=4,sft.batch_size=4,sft.lr=0.5,sft.overlong_response=drop",
            ),
            str(tmp_path / "sft"),
            steps=2,
            quiet=True,
        )


def test_sft_cosine_learning_rate(tmp_path):
    """sft.lr_decay="cosine": update k (1-based) logs lr * (r + (1 - r) (1 + cos(pi (k - 1
    - w) / (steps - w))) / 2) after w warm-up updates; extending such a run past sft.steps
    with min_lr_ratio 0 (learning rate 0) is refused before anything is built."""
    from policyopt.rl.sft import run_sft

    extra = (
        "eval.num_prompts=0,sft.steps=4,sft.batch_size=4,sft.overlong_response=drop,"
        "sft.lr=0.01,sft.warmup_steps=1,sft.lr_decay=cosine,train.log_every=1"
    )
    run_sft(tiny("grpo", extra=extra + ",sft.min_lr_ratio=0.2"), str(tmp_path / "a"), quiet=True)
    rows = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    got = [r["update/lr"] for r in rows if "update/lr" in r]
    cosine = [0.2 + 0.8 * (1 + np.cos(np.pi * p)) / 2 for p in (0, 1 / 3, 2 / 3)]
    np.testing.assert_allclose(got, 0.01 * np.asarray([1.0, *cosine]), rtol=1e-5)
    with pytest.raises(ValueError, match="learning rate 0"):
        run_sft(tiny("grpo", extra=extra), str(tmp_path / "b"), steps=6, quiet=True)
    assert not os.path.exists(tmp_path / "b" / "checkpoints")
