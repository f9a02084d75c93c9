"""Checkpointer (orbax) round trips and the metrics sinks."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from policyopt.checkpoint import Checkpointer, tree_checksums
from policyopt.metrics import (
    MetricsWriter,
    console_line,
    read_jsonl,
    read_step_record,
    to_scalars,
    truncate_jsonl,
)
from policyopt.rl.update.learner import TrainState, make_optimizer


def _state(seed):
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(seed))
    _, params = nnx.split(model, nnx.Param)
    optimizer, _ = make_optimizer(lr=1e-2, warmup_steps=2, weight_decay=0.1)
    state = TrainState.create(params, optimizer)
    # One real optimiser step so that the moments are non-trivial.
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    return TrainState(
        step=jnp.int32(1),
        skipped=jnp.int32(0),
        params=jax.tree.map(lambda p, u: p + u, params, updates),
        opt_state=opt_state,
    )


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


def test_the_saved_checksums_are_read_without_the_arrays(tmp_path):
    state = {"train": _state(0)}
    Checkpointer(str(tmp_path)).save(1, state, {})
    Checkpointer(str(tmp_path)).save(2, {"train": _state(1)}, {})
    sums = Checkpointer(str(tmp_path)).checksums()  # the latest
    assert sums == tree_checksums({"train": _state(1)})
    assert Checkpointer(str(tmp_path)).checksums(1) == tree_checksums(state)
    assert "train/params/kernel/value" in sums and sums != tree_checksums(state)


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
    assert (
        console_line(3, 10, {"reward/mean": 0.5, "reward/accuracy": 0.25})
        == "[ 3/10] reward 0.5 acc 0.25"
    )


def test_metrics_writer_resuming_removes_the_records_after_the_checkpoint(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        for step in (0, 1, 2, 3):
            writer.write(step, {"x": step})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x"')  # a last line cut short by a crash
    with MetricsWriter(str(tmp_path), tensorboard=False, resume_step=1) as writer:
        writer.write(2, {"x": 20})
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        (0, 0),
        (1, 1),
        (2, 20),
    ]
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


# ---- Verification on restore, fallback, errors that name the path, the workdir lock -----


def test_checksums_hand_worked_and_every_single_bit_flip_changes_them():
    from policyopt.checkpoint import tree_checksums

    # sum_i bits_i * (2 i + 1) mod 2^32: 1*1 + 2*3 + 3*5 = 22; 1.0f is 0x3f800000;
    # bfloat16 1.0 is 0x3f80; True is 1 (weights 1, 3).
    sums = tree_checksums(
        {
            "u": jnp.asarray([1, 2, 3], jnp.uint32),
            "f": jnp.asarray([1.0]),
            "b": jnp.asarray([1.0], jnp.bfloat16),
            "t": jnp.asarray([False, True]),
        }
    )
    assert sums == {"u": 22, "f": 0x3F800000, "b": 0x3F80, "t": 3}
    values = np.asarray([1.5, -2.0, np.pi, 0.0], np.float32)
    reference = tree_checksums({"x": jnp.asarray(values)})["x"]
    bits = values.view(np.uint32)
    for index in range(4):
        for bit in range(32):
            flipped = bits.copy()
            flipped[index] ^= np.uint32(1 << bit)
            assert tree_checksums({"x": jnp.asarray(flipped.view(np.float32))})["x"] != reference


def _corrupt_arrays(step_dir):
    """Flips one bit in the middle of the largest array file of a checkpoint."""
    files = [
        os.path.join(root, name)
        for root, _, names in os.walk(os.path.join(step_dir, "state"))
        for name in names
        if os.sep + "d" + os.sep in os.path.join(root, name) + os.sep
    ]
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(path, "wb").write(bytes(data))


def _two_checkpoints(directory):
    states = {
        step: {
            "train": {"params": {"w": jnp.arange(4096, dtype=jnp.float32) * step}},
            "rng": jax.random.PRNGKey(step),
        }
        for step in (1, 2)
    }
    ckpt = Checkpointer(str(directory))
    for step, state in states.items():
        ckpt.save(step, state, {"iteration": step})
    return ckpt, states


def test_a_flipped_bit_is_caught_and_the_previous_checkpoint_restored(tmp_path, caplog):
    """The issue's fault: one bit flipped in an array file loaded silently."""
    ckpt, states = _two_checkpoints(tmp_path)
    _corrupt_arrays(ckpt.step_path(2))
    from policyopt.checkpoint import CorruptCheckpointError

    with pytest.raises(
        CorruptCheckpointError,
        match=f"checkpoint {tmp_path}/2 is corrupt: the checksums of train/params/w differ",
    ):
        ckpt.restore(states[1], step=2)
    with caplog.at_level("WARNING"):
        restored, meta = ckpt.restore(states[1])
    assert meta == {"iteration": 1} and _equal(restored, states[1])
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert f"{tmp_path}/2 is corrupt" in warning
    assert f"falling back to the previous checkpoint {tmp_path}/1" in warning
    # A partial restore (RL from an SFT checkpoint) is verified too; a fresh Checkpointer,
    # as build.init_params uses (orbax binds an item's handler on first use).
    params = Checkpointer(str(tmp_path)).restore_subtree(
        ("train", "params"), states[1]["train"]["params"]
    )
    assert _equal(params, states[1]["train"]["params"])
    # With no earlier checkpoint to fall back to, the error names the path.
    _corrupt_arrays(ckpt.step_path(1))
    with pytest.raises(
        CorruptCheckpointError, match=f"{tmp_path}/2 is corrupt.*no earlier checkpoint"
    ):
        ckpt.restore(states[1])


def test_restore_errors_name_the_checkpoint(tmp_path):
    """The issue's bare JSONDecodeError and KeyError('Item "state" was not found'): each
    now names the checkpoint's directory; the latest falls back to the previous one. A
    target of another shape is not corruption: no fallback, the path named."""
    import shutil

    from policyopt.checkpoint import CheckpointError, CorruptCheckpointError

    ckpt, states = _two_checkpoints(tmp_path / "json")
    with open(os.path.join(ckpt.step_path(2), "meta", "metadata"), "w") as f:
        f.write("{not json")
    with pytest.raises(
        CorruptCheckpointError,
        match=f"{tmp_path}/json/2 is corrupt: cannot read its meta " r"\(JSONDecodeError",
    ):
        ckpt.meta(2)
    assert ckpt.meta() == {"iteration": 1} and ckpt.restore(states[1])[1] == {"iteration": 1}

    ckpt, states = _two_checkpoints(tmp_path / "missing")
    shutil.rmtree(os.path.join(ckpt.step_path(2), "state"))
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"{tmp_path}/missing/2 is corrupt: its item\(s\) \['state'\] are missing",
    ):
        ckpt.restore(states[1], step=2)
    assert ckpt.restore(states[1])[1] == {"iteration": 1}

    wrong = {"train": {"params": {"w": jnp.zeros(5)}}, "rng": states[1]["rng"]}
    with pytest.raises(
        CheckpointError, match=f"checkpoint {tmp_path}/missing/1: cannot restore"
    ) as error:
        ckpt.restore(wrong, step=1)
    assert not isinstance(error.value, CorruptCheckpointError)


def test_a_target_of_other_shapes_is_refused_before_any_read(tmp_path, monkeypatch):
    """A target whose arrays have other shapes than the checkpoint's is refused from the
    metadata, naming each such array, before orbax reads anything: orbax failing
    mid-restore would close its event loop with the other arrays' reads in flight, and
    each would later print "Exception ignored ... Event loop is closed" (32 arrays: some
    always are)."""
    import gc

    # The collection below traverses this test's objects only: what the worker held before
    # (earlier tests' compiled models, millions of objects, a full collection of which took
    # seconds in the suite; and what they left, say a corrupt file's reads, which is theirs)
    # is frozen until the test ends.
    gc.freeze()
    try:
        _refuse_other_shapes(tmp_path, monkeypatch)
    finally:
        gc.unfreeze()


def _refuse_other_shapes(tmp_path, monkeypatch):
    import gc
    import sys

    from policyopt.checkpoint import CheckpointError, CorruptCheckpointError

    state = {f"p{i:02d}": jnp.arange(4096, dtype=jnp.float32) + i for i in range(32)}
    state["rng"] = jax.random.key(0)
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(1, state, {"iteration": 1})
    wrong = dict(state, p00=jnp.zeros(5), p07=jnp.zeros((64, 64)))
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    for _ in range(3):
        try:  # not pytest.raises: its record would keep the restore's frames alive
            ckpt.restore(wrong, step=1)
        except CheckpointError as error:
            assert not isinstance(error, CorruptCheckpointError)
            assert str(error) == (
                f"checkpoint {tmp_path}/1: cannot restore its state onto a target of other "
                "shapes (p00 saved (4096,), target (5,); p07 saved (4096,), target (64, 64))"
            )
        else:
            raise AssertionError("restored a target of other shapes")
    gc.collect()
    assert [str(u.exc_value) for u in unraisable] == []
    restored, meta = ckpt.restore(state)  # typed keys and matching shapes pass the check
    assert meta == {"iteration": 1} and _equal(restored["p07"], state["p07"])


def test_a_second_process_is_refused_the_workdir(tmp_path):
    import subprocess
    import sys

    from policyopt.checkpoint import lock_workdir, unlock_workdir

    workdir = str(tmp_path / "run")
    # A lock file left by a killed run holds no lock (the kernel released it): not stale.
    os.makedirs(workdir)
    with open(os.path.join(workdir, ".lock"), "w") as f:
        f.write("999999\n")
    lock_workdir(workdir)
    lock_workdir(workdir)  # the owner again: a no-op
    # One second process (each pays JAX's import): refused while this one holds the lock,
    # then, told on stdin that it was released, takes it.
    script = (
        "import sys; from policyopt.checkpoint import lock_workdir\n"
        "def attempt():\n"
        "    try:\n        lock_workdir(sys.argv[1])\n"
        "    except RuntimeError as e:\n        return str(e)\n"
        "    return 'locked'\n"
        "print(attempt(), flush=True)\n"
        "sys.stdin.readline()\n"
        "print(attempt(), flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
    second = subprocess.Popen(
        [sys.executable, "-c", script, workdir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        refused = second.stdout.readline().strip()
        assert refused == (
            f"workdir {workdir} is in use by another process (pid {os.getpid()}, "
            f"lock {workdir}/.lock); wait for it to finish or choose another workdir"
        )
        unlock_workdir(workdir)
        out, err = second.communicate("released\n", timeout=120)
    finally:
        second.kill()
    assert second.returncode == 0 and out.strip() == "locked", err


# ---- The meta record under the checksums, corruption of any file, the corrupt set aside ---


def test_meta_digest_by_hand_and_the_format_marker(tmp_path):
    """The meta record is saved with ``FORMAT_KEY`` and its SHA-256 (sorted-key JSON, as
    read back: tuples are lists) beside the arrays' checksums; restore returns it without
    the marker."""
    import hashlib

    from policyopt.checkpoint import FORMAT, FORMAT_KEY, meta_digest

    text = '{"a":[1,2],"b":{"c":0.5}}'
    assert meta_digest({"b": {"c": 0.5}, "a": (1, 2)}) == hashlib.sha256(text.encode()).hexdigest()
    ckpt, states = _two_checkpoints(tmp_path)
    with open(os.path.join(ckpt.step_path(2), "meta", "metadata")) as f:
        saved = json.load(f)
    with open(os.path.join(ckpt.step_path(2), "checksums", "metadata")) as f:
        sums = json.load(f)
    assert saved == {"iteration": 2, FORMAT_KEY: FORMAT}
    assert sums["format"] == FORMAT and sums["meta"] == meta_digest(saved)
    assert set(sums["arrays"]) == {"rng", "train/params/w"}
    assert ckpt.meta(2) == {"iteration": 2} and ckpt.restore(states[2])[1] == {"iteration": 2}


def _flip_in_file(path, old: str, new: str) -> None:
    """Replaces ``old`` by ``new`` (same length, one bit apart) in a file, in place."""
    data = open(path, "rb").read()
    assert data.count(old.encode()) == 1 and len(old) == len(new)
    diff = [a ^ b for a, b in zip(old.encode(), new.encode()) if a != b]
    assert len(diff) == 1 and bin(diff[0]).count("1") == 1
    open(path, "wb").write(data.replace(old.encode(), new.encode()))


@pytest.mark.parametrize(
    "damage,message",
    [
        # The faults: a flipped bit in "iteration" resumed "from step 3"; one in
        # the data position replayed prompts; both loaded as they were.
        ("iteration", "its meta record (iteration, data position, config) differs"),
        ("next_index", "its meta record (iteration, data position, config) differs"),
        # An array bit flip plus a deleted checksums item loaded as a pre-checksum one.
        ("checksums", "its item 'checksums' is missing (a checkpoint of format 2"),
    ],
)
def test_the_meta_record_and_the_checksums_item_are_verified(tmp_path, caplog, damage, message):
    from policyopt.checkpoint import CorruptCheckpointError

    ckpt, states = _two_checkpoints(tmp_path)
    for step in (1, 2):  # with a data position
        ckpt._manager.delete(step)
        ckpt.save(step, states[step], {"iteration": step, "data": {"next_index": 10 * step}})
    meta_file = os.path.join(ckpt.step_path(2), "meta", "metadata")
    if damage == "iteration":
        _flip_in_file(meta_file, '"iteration": 2', '"iteration": 3')
    elif damage == "next_index":
        _flip_in_file(meta_file, '"next_index": 20', '"next_index": 21')
    else:
        _corrupt_arrays(ckpt.step_path(2))
        import shutil

        shutil.rmtree(os.path.join(ckpt.step_path(2), "checksums"))
    pattern = f"checkpoint {tmp_path}/2 is corrupt: " + message.replace("(", r"\(").replace(
        ")", r"\)"
    )
    with pytest.raises(CorruptCheckpointError, match=pattern):
        ckpt.restore(states[1], step=2)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        ckpt.meta(2)
    with caplog.at_level("WARNING"):
        restored, meta = ckpt.restore(states[1])
    assert meta == {"iteration": 1, "data": {"next_index": 10}} and _equal(restored, states[1])
    assert f"falling back to the previous checkpoint {tmp_path}/1" in caplog.text
    assert ckpt.meta() == meta
    assert os.path.isdir(ckpt.step_path(2))  # not an owner: the directory is left as it is


def test_checkpoints_from_before_the_checksums_restore(tmp_path):
    """Without the format marker: no checksums item restores unverified (the first
    version); checksums of the arrays only (the second) are verified."""
    import orbax.checkpoint as ocp

    from policyopt.checkpoint import CorruptCheckpointError, tree_checksums

    state = {"train": {"params": {"w": jnp.arange(4096, dtype=jnp.float32)}}}
    manager = ocp.CheckpointManager(str(tmp_path))
    manager.save(
        1,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"iteration": 1})
        ),
    )
    manager.save(
        2,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            meta=ocp.args.JsonSave({"iteration": 2}),
            checksums=ocp.args.JsonSave(tree_checksums(state)),
        ),
    )
    manager.wait_until_finished()
    manager.close()
    ckpt = Checkpointer(str(tmp_path))
    for step in (1, 2):
        restored, meta = ckpt.restore(state, step=step)
        assert meta == {"iteration": step} and _equal(restored, state)
    _corrupt_arrays(ckpt.step_path(2))
    with pytest.raises(CorruptCheckpointError, match="the checksums of train/params/w differ"):
        ckpt.restore(state, step=2)


def test_unreadable_state_metadata_is_corruption(tmp_path):
    """The issue's ``error: unknown config field 'NoneType'``: ``saved_shapes`` (and the
    shape check before every restore) failed with an AttributeError on a deleted
    ``state``, an emptied step directory or a truncated ``state/_METADATA``."""
    import shutil

    from policyopt.checkpoint import CorruptCheckpointError
    from policyopt.rl.loop import build

    for damage in ("state", "emptied", "_METADATA"):
        ckpt, states = _two_checkpoints(tmp_path / damage)
        step_dir = ckpt.step_path(2)
        if damage == "state":
            shutil.rmtree(os.path.join(step_dir, "state"))
        elif damage == "emptied":
            for name in os.listdir(step_dir):
                path = os.path.join(step_dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        else:
            path = os.path.join(step_dir, "state", "_METADATA")
            data = open(path, "rb").read()
            open(path, "wb").write(data[: len(data) // 2])
        with pytest.raises(CorruptCheckpointError, match=f"checkpoint {step_dir} is corrupt: "):
            ckpt.saved_shapes(2)
        with pytest.raises(CorruptCheckpointError, match=f"checkpoint {step_dir} is corrupt: "):
            build.check_checkpoint_shapes(ckpt, states[2], None, step=2)
        assert ckpt.restore(states[1])[1] == {"iteration": 1}, damage


def test_an_owner_sets_the_corrupt_checkpoint_aside_and_saves_that_step_again(tmp_path, caplog):
    """The issue's fault: after falling back from a corrupt step 2 the run retrained
    iteration 2 and died with ``Checkpoint for step 2 already exists``. An owner moves
    the corrupt directory aside (kept for inspection) once the fallback is found, so the
    step saves again; with no readable checkpoint nothing is moved."""
    from policyopt.checkpoint import CorruptCheckpointError

    ckpt, states = _two_checkpoints(tmp_path)
    _corrupt_arrays(ckpt.step_path(2))
    owner = Checkpointer(str(tmp_path), owner=True)
    with caplog.at_level("WARNING"):
        assert owner.restore(states[1])[1] == {"iteration": 1}
    assert f"moved the corrupt checkpoint {tmp_path}/2 aside to {tmp_path}/2.corrupt" in caplog.text
    assert owner.all_steps() == [1] and os.path.isdir(f"{tmp_path}/2.corrupt")
    owner.save(2, states[2], {"iteration": 2})
    assert owner.restore(states[1])[1] == {"iteration": 2}
    assert Checkpointer(str(tmp_path)).all_steps() == [1, 2]
    # Corrupt again, and the previous one too: nothing readable, nothing moved.
    _corrupt_arrays(owner.step_path(2))
    _corrupt_arrays(owner.step_path(1))
    with pytest.raises(CorruptCheckpointError, match="no earlier checkpoint"):
        owner.restore(states[1])
    assert owner.all_steps() == [1, 2] and sorted(os.listdir(tmp_path)) == ["1", "2", "2.corrupt"]
