"""Resuming an RL run after any single corruption of its latest checkpoint: the run falls
back to the previous checkpoint with a warning naming both, moves the corrupt one aside,
saves that step again and finishes with the parameters of an uninterrupted run."""

import glob
import os
import shutil

import jax
import numpy as np
import pytest

from policyopt.rl.loop import trainer
from tests.rl.test_trainer import tiny


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
