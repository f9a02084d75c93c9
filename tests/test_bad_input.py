"""Bad input fails before anything is written: every error a run's build can find (devices,
files, model, data, verifier) names the field or file in one line, before the run
directory, its `.lock` or `checkpoints/` exist; a build that fails after taking the lock
leaves nothing behind."""

import importlib
import json
import os
import subprocess
import sys

import pytest

from policyopt.checkpoint import WorkdirLocked
from policyopt.data.jsonl import MalformedRowError
from policyopt.rl import sft
from policyopt.rl.loop import trainer

TINY = (
    "model=tiny_dense,model.num_layers=1,batch.n_prompts=2,batch.group_size=4,batch.n_minibatches=1,"
    "sampling.max_new_tokens=6,task.num_train=64,task.num_test=8,eval.num_prompts=8,"
    "eval.batch_size=8,train.eval_every=0,train.num_iterations=1,train.loggers=jsonl,"
    "batch.prompt_buckets=(16,),batch.response_buckets=(24,),sft.steps=1,sft.batch_size=4"
)


def load(variant=""):
    return importlib.import_module("configs.sapo").get_config(TINY + variant)


def _rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _cases(tmp_path):
    good = _rows(tmp_path / "good.jsonl", [{"question": "1+1=", "answer": "2"}] * 4)
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"question": "1+1=", "answer": "2", "answer": "3"}\n')
    (tmp_path / "not_hf").mkdir()
    jsonl = ",task.name=math_jsonl,task.test_file=" + repr(good)
    return [
        (",mesh.data=4", ValueError, "config.mesh: mesh shape .* needs 4 devices"),
        (
            f",model.pretrained={str(tmp_path / 'nope')!r}",
            FileNotFoundError,
            "config.model.pretrained='.*nope' is not a directory",
        ),
        (
            f",model.pretrained={str(tmp_path / 'not_hf')!r}",
            FileNotFoundError,
            "config.model.pretrained='.*not_hf' has no tokenizer.json",
        ),
        (
            f",init_checkpoint={str(tmp_path / 'nope')!r}",
            FileNotFoundError,
            "config.init_checkpoint='.*nope' is not a directory",
        ),
        (
            jsonl + f",task.train_file={str(tmp_path / 'missing.jsonl')!r}",
            FileNotFoundError,
            "config.task.train_file='.*missing.jsonl' is not a file",
        ),
        (
            jsonl + f",task.train_file={str(twice)!r}",
            MalformedRowError,
            "twice.jsonl:1: invalid JSON \\(duplicate key 'answer'\\)",
        ),
        (
            jsonl + f",task.train_file={_rows(tmp_path / 'fields.jsonl', [{'q': '1+1='}])!r}",
            MalformedRowError,
            r"fields.jsonl:1: missing question field: none of \['question', 'problem', "
            r"'prompt'\] present \(fields: \['q'\]\)",
        ),
        (
            ",reward.verifier='no_such_module_here:score'",
            ValueError,
            "config.reward.verifier='no_such_module_here:score': cannot import",
        ),
    ]


def test_rl_build_errors_come_before_the_run_directory(tmp_path):
    for index, (variant, error, message) in enumerate(_cases(tmp_path)):
        workdir = tmp_path / f"run{index}"
        with pytest.raises(error, match=message):
            trainer.run_rl(load(variant), str(workdir), quiet=True)
        assert not workdir.exists(), variant


def test_async_build_errors_come_before_the_run_directory(tmp_path):
    from policyopt.rl.loop.async_rl import run_async_rl

    for index, (variant, error, message) in enumerate(_cases(tmp_path)):
        workdir = tmp_path / f"async{index}"
        with pytest.raises(error, match=message):
            run_async_rl(load(variant + ",async_mode.enabled=True"), str(workdir), quiet=True)
        assert not workdir.exists(), variant


def test_sft_build_errors_come_before_the_run_directory(tmp_path):
    for index, (variant, error, message) in enumerate(_cases(tmp_path)):
        workdir = tmp_path / f"sft{index}"
        with pytest.raises(error, match=message):
            sft.run_sft(load(variant), str(workdir), quiet=True)
        assert not workdir.exists(), variant
    # The held-out file too, which SFT reads only at its end.
    good = _rows(tmp_path / "train.jsonl", [{"question": "1+1=", "answer": "2"}] * 4)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    config = load(f",task.name=math_jsonl,task.train_file={good!r},task.test_file={str(empty)!r}")
    with pytest.raises(ValueError, match="empty.jsonl: no rows \\(an empty file\\)"):
        sft.run_sft(config, str(tmp_path / "sft_eval"), quiet=True)
    assert not (tmp_path / "sft_eval").exists()
    with pytest.raises(FileNotFoundError, match="init_checkpoint='.*nope' is not a directory"):
        sft.run_sft(load(), str(tmp_path / "sft_init"), init_checkpoint=str(tmp_path / "nope"))
    assert not (tmp_path / "sft_init").exists()


def test_a_build_that_fails_after_the_lock_removes_what_it_made(tmp_path, monkeypatch):
    def failing_checkpointer(directory, **kwargs):
        os.makedirs(directory)  # as orbax does, then fails
        raise OSError(f"{directory}: no space left on device")

    monkeypatch.setattr(trainer, "Checkpointer", failing_checkpointer)
    workdir = tmp_path / "new"
    with pytest.raises(OSError, match="no space left"):
        trainer.run_rl(load(), str(workdir), quiet=True)
    assert not workdir.exists()
    # A directory that existed keeps what it held; only the lock and the build's own
    # (empty) checkpoints/ go.
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="no space left"):
        trainer.run_rl(load(), str(existing), quiet=True)
    assert sorted(os.listdir(existing)) == ["notes.txt"]
    # The lock was released: the same process (or another) can take it again.
    monkeypatch.undo()
    trainer.build_run(load(), str(existing), lock=True)
    assert sorted(os.listdir(existing)) == [".lock", "checkpoints", "notes.txt"]


def test_another_owners_lock_is_left_alone(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    lock = workdir / ".lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "os.write(fd, b'%d' % os.getpid())\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(WorkdirLocked, match=f"pid {holder.pid}"):
            trainer.run_rl(load(), str(workdir), quiet=True)
        assert lock.read_text() == str(holder.pid)
    finally:
        holder.kill()
        holder.wait()


def test_a_start_still_being_trained_is_refused(tmp_path):
    """An RL run (or SFT continuation) whose init_checkpoint belongs to a run another process
    is still training would start from whatever step that run has reached."""
    from policyopt.rl.sft import run_sft

    start = tmp_path / "sft"
    (start / "checkpoints").mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from policyopt.checkpoint import lock_workdir\n"
            f"lock_workdir({str(start)!r})\n"
            "print('locked', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        config = load()
        config.unlock()
        config.init_checkpoint = str(start / "checkpoints")
        config.lock()
        with pytest.raises(RuntimeError, match=f"still training \\(pid {holder.pid} holds"):
            trainer.run_rl(config, str(tmp_path / "rl"), quiet=True)
        with pytest.raises(RuntimeError, match=f"init_checkpoint=.*pid {holder.pid}"):
            run_sft(load(), str(tmp_path / "sft2"), init_checkpoint=str(start / "checkpoints"))
    finally:
        holder.kill()
        holder.wait()
    # Once the owner is gone the directory is an ordinary (here empty) start.
    from policyopt.rl.loop import build

    assert build.check_init_directory(str(start / "checkpoints"), "f") == str(start / "checkpoints")


def test_evaluating_a_missing_run_creates_nothing(tmp_path):
    from experiments.eval import evaluate_checkpoint

    with pytest.raises(FileNotFoundError, match="no checkpoint in .*missing/checkpoints"):
        evaluate_checkpoint(load(), str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()
