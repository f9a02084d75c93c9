"""`experiments.eval` on the runs users make: an SFT run (no config.json; its checkpoints
hold the policy's training state alone) evaluates as an RL run does, from its checkpoint's
own config or the recipe given, and reproduces the SFT run's final evaluation; a directory
that is no run says what it expected in one line."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from experiments.eval import evaluate_checkpoint, run_config
from policyopt.rl import sft
from tests.flags import ROOT, subprocess_env

TINY = (
    "model=tiny_dense,model.num_layers=1,batch.prompt_buckets=(16,),batch.response_buckets=(24,),"
    "sampling.max_new_tokens=8,task.num_train=64,task.num_test=8,eval.num_prompts=6,"
    "eval.batch_size=6,train.loggers=jsonl,sft.steps=2,sft.batch_size=4,sft.checkpoint_every=1"
)


def load(variant=TINY):
    return importlib.import_module("configs.sapo").get_config(variant)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("sft") / "run")
    summary = sft.run_sft(load(), workdir, quiet=True)
    return workdir, summary


def test_an_sft_run_evaluates_from_its_checkpoint_or_the_recipe(sft_run):
    workdir, summary = sft_run
    assert not os.path.exists(os.path.join(workdir, "config.json"))
    # Without --config: the config the checkpoint was saved under.
    config = run_config(workdir)
    assert config.sft.steps == 2 and config.model.preset == "tiny_dense"
    samples = []
    result = evaluate_checkpoint(config, workdir, samples=samples)
    assert result["step"] == 2
    for key in ("eval/pass@1", "eval/length_mean", "eval/num_prompts"):
        assert result[key] == summary["eval"][key], key  # the SFT run's own final figures
    assert len(samples) == 6 and {"prompt", "completion", "correct"} <= set(samples[0])
    # The recipe given (as `--config`), an earlier step, more samples.
    earlier = evaluate_checkpoint(load(), workdir, step=1, num_prompts=4, k=2)
    assert earlier["step"] == 1 and earlier["eval/num_prompts"] == 4
    assert 0 <= earlier["eval/mean@2"] <= earlier["eval/pass@2"] <= 1
    with pytest.raises(ValueError, match=r"no checkpoint at step 7 in .* \(steps: \[1, 2\]\)"):
        evaluate_checkpoint(config, workdir, step=7)
    # A recipe of another model is refused naming the shapes (not "corrupt").
    with pytest.raises(ValueError, match="holds another model than this run's"):
        evaluate_checkpoint(load(TINY.replace("num_layers=1", "num_layers=2")), workdir)


def test_the_eval_command_on_an_sft_run_and_on_no_run(sft_run, tmp_path):
    workdir, summary = sft_run

    def command(*args):
        return subprocess.run(
            [sys.executable, "-m", "experiments.eval", *args],
            env=subprocess_env(PYTHONPATH=ROOT),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    out = command("--workdir", workdir)
    assert out.returncode == 0, out.stderr[-2000:]
    with open(os.path.join(workdir, "eval_step2.json")) as f:
        assert json.load(f)["eval/pass@1"] == summary["eval"]["eval/pass@1"]
    assert os.path.getsize(os.path.join(workdir, "eval_step2_samples.jsonl")) > 0
    empty = tmp_path / "empty"
    empty.mkdir()
    out = command("--workdir", str(empty))
    assert out.returncode == 1
    assert out.stderr.splitlines()[0] == (
        f"error: no checkpoint in {empty}/checkpoints (no such directory; --workdir names the "
        "directory of a run of experiments.train or experiments.sft)"
    )
    assert os.listdir(empty) == []
