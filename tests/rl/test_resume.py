"""Resuming an RL run after any single corruption of its latest checkpoint: the run falls
back to the previous checkpoint with a warning naming both, moves the corrupt one aside,
saves that step again and finishes with the parameters of an uninterrupted run; resume equals
an uninterrupted run, writes each record once, refuses another config and compiles nothing
new in the same process."""

import glob
import os
import shutil

import jax
import numpy as np
import pytest

from policyopt.metrics import read_jsonl
from policyopt.rl.loop import trainer
from tests.rl.test_trainer import _params, tiny


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A tiny grpo run stopped after 2 of its 3 iterations (checkpoints 1 and 2) and the
    parameters of the same run uninterrupted; every case compiles nothing new."""
    config = tiny("grpo", extra="eval.num_prompts=0,train.num_iterations=3")
    root = tmp_path_factory.mktemp("resume")
    trainer.run_rl(config, str(root / "saved"), num_iterations=2, quiet=True)
    straight = trainer.run_rl(config, str(root / "straight"), quiet=True)["run"]
    params = [np.asarray(x) for x in jax.tree.leaves(straight.run_state.policy.params)]
    return config, str(root / "saved"), params


def _largest_array_file(step_dir):
    return max(glob.glob(f"{step_dir}/state/**/d/*", recursive=True), key=os.path.getsize)


def _truncate(path, fraction=0.5):
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * fraction)])


def _flip(path, old, new):
    """``old`` -> ``new`` in a file: one bit apart (a digit d -> d ^ 1)."""
    data = open(path, "rb").read()
    assert data.count(old.encode()) == 1
    open(path, "wb").write(data.replace(old.encode(), new.encode()))


def _flip_array_bit(step_dir):
    path = _largest_array_file(step_dir)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


def _empty(step_dir):
    for name in os.listdir(step_dir):
        path = os.path.join(step_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


CORRUPTIONS = {
    # kind: (damage to the step directory, what the warning says of it)
    "truncated_array": (lambda d: _truncate(_largest_array_file(d)), "cannot restore its state"),
    "zero_length_array": (
        lambda d: _truncate(_largest_array_file(d), 0),
        "cannot restore its state",
    ),
    "deleted_array": (lambda d: os.remove(_largest_array_file(d)), "cannot restore its state"),
    "deleted_state": (
        lambda d: shutil.rmtree(f"{d}/state"),
        "its item(s) ['state'] are missing",
    ),
    "emptied_step": (_empty, "its item(s) ['meta'] are missing"),
    "truncated_state_metadata": (
        lambda d: _truncate(f"{d}/state/_METADATA"),
        "its state's metadata",
    ),
    "iteration_bit": (
        lambda d: _flip(f"{d}/meta/metadata", '"iteration": 2', '"iteration": 3'),
        "its meta record (iteration, data position, config) differs",
    ),
    "next_index_bit": (
        lambda d: _flip(f"{d}/meta/metadata", '"next_index": 2', '"next_index": 3'),
        "its meta record (iteration, data position, config) differs",
    ),
    "config_bit": (
        lambda d: _flip(f"{d}/meta/metadata", '"algo.clip_high": 0.2', '"algo.clip_high": 0.3'),
        "its meta record (iteration, data position, config) differs",
    ),
    "array_bit_and_deleted_checksums": (
        lambda d: (_flip_array_bit(d), shutil.rmtree(f"{d}/checksums")),
        "its item 'checksums' is missing",
    ),
    "array_bit": (_flip_array_bit, "the checksums of train/"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_rerun_after_any_single_corruption_finishes(saved_run, kind, tmp_path, caplog):
    """The issue's faults: array files truncated, emptied or deleted ended the run; a
    deleted ``state/``, an emptied step or a truncated ``state/_METADATA`` printed
    ``unknown config field 'NoneType'``; flipped bits in the meta record loaded as they
    were; and after a fallback the run died saving the corrupt step again."""
    config, saved, straight = saved_run
    workdir = str(tmp_path / "run")
    shutil.copytree(saved, workdir)
    checkpoints = os.path.join(workdir, "checkpoints")
    damage, message = CORRUPTIONS[kind]
    damage(os.path.join(checkpoints, "2"))
    with caplog.at_level("WARNING"):
        summary = trainer.run_rl(config, workdir, quiet=True)
    assert f"checkpoint {checkpoints}/2 is corrupt: {message}" in caplog.text
    assert f"falling back to the previous checkpoint {checkpoints}/1" in caplog.text
    assert summary["iteration"] == 3
    assert sorted(os.listdir(checkpoints)) == ["2", "2.corrupt", "3"]
    params = [np.asarray(x) for x in jax.tree.leaves(summary["run"].run_state.policy.params)]
    for got, want in zip(params, straight):
        np.testing.assert_array_equal(got, want)


def test_resume_gives_the_parameters_of_an_uninterrupted_run(tmp_path):
    # DAPO: dynamic sampling draws a variable number of prompt batches per iteration,
    # so the data iterator's state must be restored exactly too. (Dropping groups whose
    # rewards are equal: the tiny random policy is never right, but its overlong penalties
    # differ, so iterations 3 and 4 update; 1 and 2 hold only fillers.)
    config = tiny(
        "dapo",
        extra="eval.num_prompts=0,train.checkpoint_every=100,dynamic_sampling.criterion=reward",
    )
    first = trainer.run_rl(config, str(tmp_path / "a"), num_iterations=2, quiet=True)
    resumed = trainer.run_rl(config, str(tmp_path / "a"), num_iterations=4, quiet=True)
    assert resumed["iteration"] == 4
    straight = trainer.run_rl(config, str(tmp_path / "b"), num_iterations=4, quiet=True)
    for got, want in zip(_params(resumed["run"]), _params(straight["run"])):
        np.testing.assert_array_equal(got, want)
    assert not all(
        np.array_equal(a, b) for a, b in zip(_params(first["run"]), _params(straight["run"]))
    )
    assert resumed["run"].spec.prompts.get_state() == straight["run"].spec.prompts.get_state()
    opt_resumed = jax.tree.leaves(resumed["run"].run_state.policy.opt_state)
    opt_straight = jax.tree.leaves(straight["run"].run_state.policy.opt_state)
    for got, want in zip(opt_resumed, opt_straight):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_resume_after_a_crash_writes_each_record_once_and_refuses_another_config(tmp_path):
    """Records written after the last checkpoint (lost in a crash) are removed on resume
    and written again, once; a finished run resumed is not evaluated again (eval.jsonl
    holds the evaluation of its step); a checkpoint refuses a config that changes the
    experiment, and accepts one that changes only the cadence."""
    config = tiny("grpo", extra="train.num_iterations=3,train.checkpoint_every=2")
    trainer.run_rl(config, str(tmp_path), quiet=True)  # checkpoints 2 and 3; evaluations 0, 3
    shutil.rmtree(tmp_path / "checkpoints" / "3")  # as if the run died after iteration 3's logs
    resumed = trainer.run_rl(config, str(tmp_path), quiet=True)
    assert resumed["iteration"] == 3 and [e["iteration"] for e in resumed["eval_history"]] == [3]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss/loss" in r] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [0, 3]
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 3]
    again = trainer.run_rl(config, str(tmp_path), quiet=True)
    assert again["eval_history"] == [] and again["eval"] == resumed["eval"]
    assert read_jsonl(tmp_path / "eval.jsonl") == evals
    changed = tiny(
        "grpo", extra="train.num_iterations=3,train.checkpoint_every=2,algo.clip_high=0.28"
    )
    with pytest.raises(ValueError, match=r"another config \(algo.clip_high: 0.2 -> 0.28\)"):
        trainer.run_rl(changed, str(tmp_path), quiet=True)
    allowed = tiny(
        "grpo", extra="train.num_iterations=3,algo.clip_high=0.28,train.allow_config_change=True"
    )
    assert trainer.run_rl(allowed, str(tmp_path), quiet=True)["iteration"] == 3
    # The config is checked before the arrays are read: a changed shape is named too.
    with pytest.raises(ValueError, match=r"another config \(model.hidden_size"):
        trainer.run_rl(
            tiny("grpo", extra="train.num_iterations=3,model.hidden_size=48"),
            str(tmp_path),
            quiet=True,
        )
    cadence = tiny(
        "grpo", extra="train.num_iterations=3,train.checkpoint_every=5,eval.num_prompts=4"
    )
    assert trainer.run_rl(cadence, str(tmp_path), quiet=True)["iteration"] == 3
    # Another evaluation setting: the logged evaluation is not this one, so it runs.
    assert [(e["step"], e["eval/num_prompts"]) for e in read_jsonl(tmp_path / "eval.jsonl")] == [
        (0, 8),
        (3, 8),
        (3, 4),
    ]
    # Resumed at an earlier checkpoint and stopped there (num_iterations is free to change):
    # evaluated there once, however many times it is rerun.
    shutil.rmtree(tmp_path / "checkpoints" / "3")
    shorter = tiny("grpo", extra="train.num_iterations=2,train.checkpoint_every=2")
    for _ in range(2):
        assert trainer.run_rl(shorter, str(tmp_path), quiet=True)["iteration"] == 2
    assert [e["step"] for e in read_jsonl(tmp_path / "eval.jsonl")] == [0, 2]


def test_resume_in_the_same_process_compiles_nothing_new(tmp_path):
    # Restored arrays come back with the shardings of the target they are restored onto,
    # the initial state placed on the run's mesh (learner.place_state), so the jitted
    # steps compiled before the save serve after restore.
    config = tiny("grpo", extra="eval.num_prompts=0,train.checkpoint_every=100")
    first = trainer.run_rl(config, str(tmp_path), num_iterations=1, quiet=True)
    learner = first["run"].spec.learner
    compiled = (learner.update._cache_size(), learner.log_probs._cache_size())
    resumed = trainer.run_rl(config, str(tmp_path), num_iterations=2, quiet=True)
    assert resumed["run"].spec.learner is learner and resumed["iteration"] == 2
    assert resumed["run"].last_batch.tokens.shape == first["run"].last_batch.tokens.shape
    assert (learner.update._cache_size(), learner.log_probs._cache_size()) == compiled
