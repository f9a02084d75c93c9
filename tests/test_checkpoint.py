"""Checkpointer (orbax) round trips and the metrics sinks."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.checkpoint import Checkpointer
from policyopt.metrics import (MetricsWriter, console_line, read_jsonl, read_step_record, to_scalars,
                               truncate_jsonl)
from policyopt.rl.learner import TrainState, make_optimizer


def _state(seed):
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(seed))
    _, params = nnx.split(model, nnx.Param)
    optimizer, _ = make_optimizer(lr=1e-2, warmup_steps=2, weight_decay=0.1)
    state = TrainState.create(params, optimizer)
    # One real optimiser step so that the moments are non-trivial.
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    return TrainState(step=jnp.int32(1), skipped=jnp.int32(0),
                      params=jax.tree.map(lambda p, u: p + u, params, updates), opt_state=opt_state)


def _equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def test_save_restore_is_exact_and_keeps_latest(tmp_path):
    state = {"train": _state(0), "rng": jax.random.PRNGKey(3)}
    meta = {"iteration": 7, "data": {"next_index": 12, "nested": [1, 2]}}
    ckpt = Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2)
    assert ckpt.latest_step() is None
    for step in (5, 6, 7):
        ckpt.save(step, state, dict(meta, iteration=step))
    assert ckpt.latest_step() == 7 and ckpt.all_steps() == [6, 7]
    target = {"train": _state(1), "rng": jax.random.PRNGKey(0)}
    assert not _equal(target, state)
    restored, restored_meta = Checkpointer(str(tmp_path / "ckpt")).restore(target)
    assert _equal(restored, state)
    assert restored_meta == dict(meta, iteration=7)
    older, older_meta = ckpt.restore(target, step=6)
    assert older_meta["iteration"] == 6 and _equal(older, state)


def test_restore_subtree_reads_only_the_parameters(tmp_path):
    state = {"train": _state(0)}
    Checkpointer(str(tmp_path)).save(1, state, {})
    template = _state(2).params
    params = Checkpointer(str(tmp_path)).restore_subtree(("train", "params"), template)
    assert _equal(params, state["train"].params)


def test_missing_checkpoint_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="empty"):
        Checkpointer(str(tmp_path / "empty")).restore({"x": jnp.zeros(2)})


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        writer.write(1, {"reward/mean": jnp.float32(0.5), "loss/clip_frac": np.float64(0.25)})
        writer.write(2, {"reward/mean": 0.75, "bad": float("nan")})
    records = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert records[0] == {"step": 1.0, "reward/mean": 0.5, "loss/clip_frac": 0.25}
    assert records[1]["reward/mean"] == 0.75 and np.isnan(records[1]["bad"])
    assert os.listdir(tmp_path / "tensorboard")
    with open(tmp_path / "metrics.jsonl") as f:
        assert json.loads(f.readline())["step"] == 1
    with pytest.raises(ValueError, match="'vec'"):
        to_scalars({"vec": np.zeros(3)})
    assert console_line(3, 10, {"reward/mean": 0.5, "reward/accuracy": 0.25}) == "[ 3/10] reward 0.5 acc 0.25"


def test_metrics_writer_resuming_removes_the_records_after_the_checkpoint(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        for step in (0, 1, 2, 3):
            writer.write(step, {"x": step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x"')  # a last line cut short by a crash
    with MetricsWriter(str(tmp_path), tensorboard=False, resume_step=1) as writer:
        writer.write(2, {"x": 20})
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(0, 0), (1, 1), (2, 20)]
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:  # no resume_step: appends
        writer.write(3, {"x": 30})
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 4
    with MetricsWriter(str(tmp_path), resume_step=-1) as writer:  # a fresh start
        writer.write(0, {"x": 5})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0.0, "x": 5.0}]
    assert truncate_jsonl(str(tmp_path / "metrics.jsonl"), 0) == 0
    # A last record without its newline (a crash between the two) does not swallow the next.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 0, "y": 1}')
    with MetricsWriter(str(tmp_path), tensorboard=False, resume_step=0) as writer:
        writer.write(1, {"x": 6})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 0, 1]
    assert read_step_record(str(tmp_path / "metrics.jsonl"), 0, prefix="y") == {"y": 1.0}
    assert read_step_record(str(tmp_path / "missing.jsonl"), 0) is None


def test_disabled_metrics_writer_writes_nothing(tmp_path):
    # The processes other than 0 of a multi-process job: records converted, nothing written.
    run_dir = tmp_path / "run"
    with MetricsWriter(str(run_dir), enabled=False) as writer:
        assert writer.write(1, {"reward/mean": jnp.float32(0.5)}) == {"reward/mean": 0.5}
        writer.flush()
        with pytest.raises(ValueError, match="'vec'"):
            writer.write(2, {"vec": np.zeros(3)})
    assert not run_dir.exists()
