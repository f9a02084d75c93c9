"""The claims' SFT starts kept in the repository (experiments/starts.py): a start saved
where it was trained is restored elsewhere bit for bit (same identity, same RL
parameters), only for the same SFT config, never over a start trained here, never as a
parent that more SFT continues; a damaged file is refused; two processes restoring at
once leave one start."""

import contextlib
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import testbed
from configs.ablations import SETTINGS
from experiments import reproduce, starts
from experiments.ledger import legacy_start_id, start_id
from policyopt.checkpoint import Checkpointer
from policyopt.rl.loop import build
from tests.flags import ROOT, subprocess_env

TINY_SFT = (
    "model.num_layers=1,sft.steps=2,sft.batch_size=4,task.num_train=64,task.num_test=8,"
    "eval.num_prompts=0,train.loggers=jsonl"
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny SFT start 1 of the testbed, trained, and kept in a repository of its own."""
    root = tmp_path_factory.mktemp("starts")
    checkpoint = reproduce.ensure_sft("testbed", str(root / "here"), TINY_SFT, start=1)
    kept = str(root / "kept")
    identity = starts.save_start(checkpoint, starts.start_path("testbed", 1, kept))
    return root, checkpoint, kept, identity


def _refuse(*args, **kwargs):
    raise AssertionError("trained")


def _rl_params(checkpoint):
    """The parameters an RL run of the testbed starts from ``checkpoint`` with."""
    config = SETTINGS["testbed"](testbed.get_config(), checkpoint)
    config.unlock()
    config.model.num_layers = 1
    config.lock()
    mesh = build.make_mesh(config)
    model = build.make_model(config, build.make_tokenizer(config).vocab_size, mesh)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(build.init_params(config, model, mesh)[1])]


def test_a_kept_start_is_restored_bit_for_bit_instead_of_trained(trained, tmp_path, monkeypatch):
    _, checkpoint, kept, identity = trained
    assert identity == start_id(checkpoint)
    assert os.path.getsize(starts.start_path("testbed", 1, kept)) > 0
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    sft_root = str(tmp_path / "elsewhere")
    restored = reproduce.ensure_sft("testbed", sft_root, TINY_SFT, start=1)
    assert restored == os.path.join(sft_root, "testbed", "sft_start1", "checkpoints")
    assert start_id(restored) == identity  # the ledger's records of the start match it
    # The same parameters reach RL, bit for bit; no optimiser state was kept.
    assert all(np.array_equal(a, b) for a, b in zip(_rl_params(restored), _rl_params(checkpoint)))
    with Checkpointer(restored) as saved:
        assert not any(k.startswith("train/opt_state") for k in saved.checksums())
        assert saved.meta()["config"]["sft.steps"] == 2  # the meta record travels with it
    marker = json.loads(
        (tmp_path / "elsewhere" / "testbed" / "sft_start1" / starts.MARKER).read_text()
    )
    assert (marker["step"], marker["start_id"]) == (2, identity)
    # Records written before start_id left out the optimiser state name the start by the
    # digest of all its checksums: the kept start carries that name to the restored one.
    assert legacy_start_id(restored) == legacy_start_id(checkpoint) != identity
    # Finished for --rejudge, and reused as it is on the next call.
    assert reproduce.finished_sft("testbed", sft_root, TINY_SFT, start=1) == restored
    assert reproduce.ensure_sft("testbed", sft_root, TINY_SFT, start=1) == restored


def test_a_kept_start_of_another_config_is_not_used(trained, tmp_path, monkeypatch, capsys):
    """One more SFT step, or another start number's seed, is another start: trained."""
    _, _, kept, _ = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    calls = []

    def record(config, workdir, **kwargs):
        calls.append((workdir, config.sft.steps, config.seed))
        return {"checkpoint_dir": os.path.join(workdir, "checkpoints")}

    monkeypatch.setattr(reproduce, "run_sft", record)
    longer = TINY_SFT.replace("sft.steps=2", "sft.steps=3")
    reproduce.ensure_sft("testbed", str(tmp_path), longer, start=1)
    assert calls[-1][1] == 3
    assert "of another config (sft.steps differ)" in capsys.readouterr().out
    reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=2)  # none kept: trained
    assert calls[-1][1:] == (2, 2) and len(calls) == 2
    # kept=False trains even where one is kept (a parent that more SFT continues).
    reproduce.ensure_sft("testbed", str(tmp_path / "b"), TINY_SFT, start=1, kept=False)
    assert len(calls) == 3


def test_a_start_trained_here_is_used_and_named_when_not_the_kept_one(
    trained, tmp_path, monkeypatch, capsys
):
    root, checkpoint, kept, identity = trained
    # Kept: another start of the same config (another machine's bits).
    other = str(tmp_path / "other")
    arrays, saved = starts._load(starts.start_path("testbed", 1, kept))
    arrays = {name: value * np.float32(1.0001) for name, value in arrays.items()}
    with Checkpointer(os.path.join(other, "ckpt")) as checkpointer:
        checkpointer.save(2, starts._nest(arrays), saved["meta"])
    starts.save_start(os.path.join(other, "ckpt"), starts.start_path("testbed", 1, other))
    monkeypatch.setattr(starts, "STARTS_DIR", other)
    got = reproduce.ensure_sft("testbed", str(root / "here"), TINY_SFT, start=1)
    assert got == checkpoint and start_id(got) == identity  # this machine's start
    out = capsys.readouterr().out
    assert f"SFT start 1 of 'testbed' here ({identity}) is not the one kept" in out


def test_a_damaged_kept_start_is_refused(trained, tmp_path, monkeypatch):
    _, _, kept, identity = trained
    with np.load(starts.start_path("testbed", 1, kept)) as data:
        arrays = {name: data[name] for name in data.files}
    name = next(n for n in arrays if n.endswith("embed/value"))
    arrays[name] = arrays[name].copy()
    arrays[name].flat[3] = np.nextafter(arrays[name].flat[3], np.float32(9))
    damaged = str(tmp_path / "damaged")
    os.makedirs(os.path.join(damaged, "testbed"))
    np.savez(starts.start_path("testbed", 1, damaged), **arrays)
    monkeypatch.setattr(starts, "STARTS_DIR", damaged)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    with pytest.raises(ValueError, match=f"not the {identity} it was saved as"):
        reproduce.ensure_sft("testbed", str(tmp_path / "cache"), TINY_SFT, start=1)
    assert not os.path.exists(tmp_path / "cache" / "testbed" / "sft_start1")  # nothing left


def test_a_kept_parent_cannot_be_continued(trained, tmp_path, monkeypatch):
    _, _, kept, _ = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    with pytest.raises(ValueError, match="holds the SFT start kept in the repository"):
        reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1, kept=False)


def test_two_processes_restoring_at_once_leave_one_start(trained, tmp_path):
    """From plain scripts (no __main__ guard), started together."""
    _, _, kept, identity = trained
    script = tmp_path / "restore.py"
    script.write_text(
        "import sys\n"
        "from experiments import reproduce, starts\n"
        "from experiments.ledger import start_id\n"
        f"starts.STARTS_DIR = {kept!r}\n"
        f"got = reproduce.ensure_sft('testbed', sys.argv[1], {TINY_SFT!r}, start=1)\n"
        "print('ID', start_id(got))\n"
    )
    cache = str(tmp_path / "cache")
    env = subprocess_env(PYTHONPATH=ROOT)  # a script outside the repository, as a user's
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), cache],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert all(f"ID {identity}" in out for out in outs)
    assert os.listdir(os.path.join(cache, "testbed")) == ["sft_start1"]  # no partial left


def test_the_command_keeps_a_finished_start_and_refuses_an_unfinished_one(trained, tmp_path):
    root, checkpoint, kept, identity = trained
    command = ("--setting=testbed", "--starts=1", f"--variant={TINY_SFT}", f"--root={tmp_path}")
    done = _keep(*command, f"--sft_root={root / 'here'}")
    assert done.returncode == 0, done.stderr
    assert f"start 1 of 'testbed': {tmp_path}/testbed/start1.npz ({identity}," in done.stdout
    # The same start gives the same bytes: keeping it again changes nothing in git.
    with open(starts.start_path("testbed", 1, str(tmp_path)), "rb") as ours:
        with open(starts.start_path("testbed", 1, kept), "rb") as theirs:
            assert ours.read() == theirs.read()
    with pytest.raises(SystemExit, match="error: SFT start 1 of 'testbed' is not finished"):
        starts.keep_starts("testbed", ["1"], str(root / "nothing"), TINY_SFT, str(tmp_path))


def test_a_restored_start_is_not_returned_for_another_config(trained, tmp_path, monkeypatch):
    """A cache holding the kept start (parameters only) is that config's start: a variant
    of more SFT steps gets an error, not the shorter start as if it were its own."""
    _, _, kept, _ = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    longer = TINY_SFT.replace("sft.steps=2", "sft.steps=3")
    with pytest.raises(ValueError, match=r"of another config \(sft\.steps differ"):
        reproduce.ensure_sft("testbed", str(tmp_path), longer, start=1)


def test_a_recipe_change_sft_does_not_read_leaves_the_kept_start_in_use(
    trained, tmp_path, monkeypatch
):
    """RL's own settings (the policy's learning rate) and fields the library added since
    the start was kept do not change its parameters: SFT's resume check ignores them, and
    so does the kept start's (else the start trains again to other bits)."""
    _, _, kept, identity = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    recipe = testbed.get_config

    def changed(arg=None):
        config = recipe(arg)
        config.unlock()
        config.optim.lr = 1e-4  # RL's; SFT trains at sft.lr
        config.lock()
        return config

    monkeypatch.setattr(testbed, "get_config", changed)
    restored = reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    assert start_id(restored) == identity
    _, saved = starts._load(starts.start_path("testbed", 1, kept))
    config = changed(TINY_SFT)
    config.unlock()
    config.seed += 1
    config.lock()
    older = {k: v for k, v in saved["meta"]["config"].items() if k != "sft.overlong_response"}
    assert starts.differing_fields(older, config) == []  # a field added since
    # A start kept without its config record is of no known config: not used for any.
    assert starts.differing_fields({}, config) == ["config (not recorded)"]
    config.unlock()
    config.sft.lr = 1e-4  # SFT's own: another start
    config.lock()
    assert starts.differing_fields(saved["meta"]["config"], config) == ["sft.lr"]


def test_a_cache_left_without_a_checkpoint_gets_the_kept_start(trained, tmp_path, monkeypatch):
    """An SFT run killed before its first checkpoint leaves its directory (lock file, log,
    an empty checkpoints directory): no start is there, so the kept one is restored."""
    _, _, kept, identity = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    workdir = tmp_path / "testbed" / "sft_start1"
    (workdir / "checkpoints").mkdir(parents=True)
    (workdir / ".lock").write_text("12345\n")
    (workdir / "sft_metrics.jsonl").write_text("")
    restored = reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    assert start_id(restored) == identity and starts.is_kept(str(workdir))
    assert os.listdir(tmp_path / "testbed") == ["sft_start1"]


def _keep(*args: str) -> subprocess.CompletedProcess:
    """The keep command (``python -m experiments.starts``), as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.starts", *args],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )


@contextlib.contextmanager
def _held(workdir: str):
    """Another process holds ``workdir``'s lock (a run training there) while inside."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom policyopt.checkpoint import lock_workdir\n"
            f"lock_workdir({workdir!r}); print('locked', flush=True); time.sleep(60)\n",
        ],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_a_cache_in_use_by_a_training_process_is_not_restored_over(trained, tmp_path, monkeypatch):
    _, _, kept, _ = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    workdir = tmp_path / "testbed" / "sft_start1"
    with _held(str(workdir)):
        with pytest.raises(Exception, match="in use by another process"):
            reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    assert os.listdir(workdir) == [".lock"]


def test_the_commands_errors_are_one_line_not_a_traceback(trained, tmp_path):
    """A start number that is not one, a setting that is none, a checkpoint of no
    parameters, and a start whose directory another process holds (still training, or
    resumed): each is an error line naming it, and nothing kept. The command itself (exit
    status 1, no traceback) runs for the first; the rest call what it calls."""
    root, _, _, _ = trained
    done = _keep(f"--root={tmp_path}", "--setting=testbed", "--starts=1,x")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --starts takes start numbers >= 0 (got '1,x')"
    ]

    def keep(setting, start_list, sft_root=str(root / "here")):
        starts.keep_starts(setting, start_list, sft_root, TINY_SFT, str(tmp_path))

    with pytest.raises(SystemExit, match="--starts takes start numbers >= 0"):
        keep("testbed", ["-1"])
    with pytest.raises(SystemExit, match="no setting 'nosuch'; known: demo, testbed,"):
        keep("nosuch", ["1"])
    # A cache whose checkpoint holds no parameters (not an SFT start): named.
    odd = os.path.join(str(tmp_path / "odd"), "testbed", "sft_start1", "checkpoints")
    with Checkpointer(odd) as saved:
        saved.save(2, {"train": {"opt_state": {"mu": np.zeros(3, np.float32)}}}, {})
    with pytest.raises(SystemExit, match="^error: .*: its checkpoint holds no parameters"):
        keep("testbed", ["1"], str(tmp_path / "odd"))
    workdir = os.path.join(str(root / "here"), "testbed", "sft_start1")
    with _held(workdir):
        with pytest.raises(SystemExit, match=re.escape(f"error: workdir {workdir} is in use")):
            keep("testbed", ["1"])
    assert not os.path.exists(starts.start_path("testbed", 1, str(tmp_path)))


def test_a_start_half_trained_here_is_resumed_with_a_note(trained, tmp_path, monkeypatch, capsys):
    """SFT interrupted here before the kept start was in the repository: resumed as this
    machine's own (its optimiser state and progress are kept), but the console says its
    runs will not be the kept start's, rather than only once it is finished."""
    _, _, kept, identity = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    calls = []

    def record(config, workdir, **kwargs):
        calls.append(workdir)
        return {"checkpoint_dir": os.path.join(workdir, "checkpoints")}

    monkeypatch.setattr(reproduce, "run_sft", record)
    workdir = os.path.join(str(tmp_path), "testbed", "sft_start1")
    with Checkpointer(os.path.join(workdir, "checkpoints")) as saved:
        saved.save(1, {"train": {"params": {"w": np.zeros(3, np.float32)}}}, {})
    reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    assert calls == [workdir]
    out = capsys.readouterr().out
    assert "note: SFT start 1 of 'testbed' begun here (step 1 of 2) is resumed" in out
    assert f"not the one kept in {starts._shown(starts.start_path('testbed', 1, kept))}" in out
    assert identity in out


def test_the_command_does_not_replace_a_kept_start_of_another_identity(trained, tmp_path):
    """The repository keeps one start per setting and number: the ledger's records name
    it. Keeping another (this machine's start trained again, or a variant's) over it is
    refused, the kept file untouched; keeping the same start again is not."""
    root, _, kept, identity = trained
    arrays, saved = starts._load(starts.start_path("testbed", 1, kept))
    arrays = {name: value * np.float32(1.0001) for name, value in arrays.items()}
    with Checkpointer(str(tmp_path / "ckpt")) as checkpointer:
        checkpointer.save(2, starts._nest(arrays), saved["meta"])
    path = starts.start_path("testbed", 1, str(tmp_path / "repo"))
    other = starts.save_start(str(tmp_path / "ckpt"), path)
    with open(path, "rb") as f:
        before = f.read()

    def keep():
        starts.keep_starts("testbed", ["1"], str(root / "here"), TINY_SFT, str(tmp_path / "repo"))

    with pytest.raises(SystemExit) as refused:
        keep()
    assert f"keeps another SFT start 1 of 'testbed' ({other})" in str(refused.value)
    assert identity in str(refused.value)
    with open(path, "rb") as f:
        assert f.read() == before
    with open(path, "wb") as f:  # cut short: which start it keeps is unknown
        f.write(before[:1000])
    with pytest.raises(SystemExit, match=re.escape(f"error: {path} is not a readable kept SFT")):
        keep()


def test_a_restore_that_fails_or_was_killed_leaves_no_partial_directory(
    trained, tmp_path, monkeypatch
):
    """A restore that raises (a full disk, a path the checkpoint library refuses) removes
    its partial directory, and one left by a restore killed outright (its process gone)
    is removed by the next: the cache holds the start, or nothing."""
    _, _, kept, identity = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    setting_dir = tmp_path / "testbed"
    gone = subprocess.Popen(["true"])
    gone.wait()
    (setting_dir / f"sft_start1.restoring-{gone.pid}" / "checkpoints").mkdir(parents=True)

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(Checkpointer, "save", full)
        with pytest.raises(OSError, match="No space left"):
            reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    assert os.listdir(setting_dir) == []
    (setting_dir / f"sft_start1.restoring-{gone.pid}").mkdir()
    restored = reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    assert start_id(restored) == identity
    assert os.listdir(setting_dir) == ["sft_start1"]


@pytest.mark.parametrize("damage", ["truncated", "text", "no_meta"])
def test_an_unreadable_kept_start_is_named(trained, tmp_path, monkeypatch, damage):
    """A kept file cut short (an interrupted copy), text in its place (a merge, a pointer
    file) or without its record: a ValueError naming the file, not numpy's or zipfile's
    words about pickles and central directories."""
    _, _, kept, _ = trained
    with open(starts.start_path("testbed", 1, kept), "rb") as f:
        data = f.read()
    path = starts.start_path("testbed", 1, str(tmp_path / "repo"))
    os.makedirs(os.path.dirname(path))
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "text":
        data = b"version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n"
    with open(path, "wb") as f:
        f.write(data)
    if damage == "no_meta":
        arrays, _ = starts._load(starts.start_path("testbed", 1, kept))
        starts._write_npz(path, arrays)
    monkeypatch.setattr(starts, "STARTS_DIR", str(tmp_path / "repo"))
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    with pytest.raises(ValueError, match=f"{path} is not a readable kept SFT start"):
        reproduce.ensure_sft("testbed", str(tmp_path / "cache"), TINY_SFT, start=1)


def test_a_start_read_back_other_than_saved_is_not_kept(trained, tmp_path, monkeypatch):
    """The parameters read from the cache's checkpoint (a damaged file, a read that went
    wrong) are checked against the checksums saved with it before they are kept: else
    every machine that restores the file refuses it as damaged, long after."""
    _, checkpoint, _, _ = trained
    real = starts.ocp.StandardCheckpointer

    class Flipping(real):
        def restore(self, *args, **kwargs):
            state = super().restore(*args, **kwargs)
            leaf = state["train"]["params"]["embed"]["value"]
            flipped = np.array(leaf)
            flipped.flat[0] = np.nextafter(flipped.flat[0], np.float32(9))
            state["train"]["params"]["embed"]["value"] = flipped
            return state

    monkeypatch.setattr(starts.ocp, "StandardCheckpointer", Flipping)
    path = starts.start_path("testbed", 1, str(tmp_path))
    with pytest.raises(ValueError, match="not the ones saved with it"):
        starts.save_start(checkpoint, path)
    assert not os.path.exists(path) and not os.path.exists(path + ".partial")


def test_a_start_restored_before_the_repository_kept_another_is_named(
    trained, tmp_path, monkeypatch, capsys
):
    """The cache holds a kept start restored before a pull brought another kept start of
    that number (trained again and kept, with its records): used as it is, like a start
    trained here, and a note names both (the runs will not match the new records)."""
    _, _, kept, identity = trained
    monkeypatch.setattr(starts, "STARTS_DIR", kept)
    monkeypatch.setattr(reproduce, "run_sft", _refuse)
    restored = reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1)
    arrays, saved = starts._load(starts.start_path("testbed", 1, kept))
    arrays = {name: value * np.float32(1.0001) for name, value in arrays.items()}
    with Checkpointer(str(tmp_path / "ckpt")) as checkpointer:
        checkpointer.save(2, starts._nest(arrays), saved["meta"])
    newer = starts.save_start(
        str(tmp_path / "ckpt"), starts.start_path("testbed", 1, str(tmp_path / "pulled"))
    )
    monkeypatch.setattr(starts, "STARTS_DIR", str(tmp_path / "pulled"))
    capsys.readouterr()
    assert reproduce.ensure_sft("testbed", str(tmp_path), TINY_SFT, start=1) == restored
    out = capsys.readouterr().out
    assert f"SFT start 1 of 'testbed' here ({identity}) is not the one kept" in out
    assert newer in out


def test_a_keep_that_fails_while_writing_leaves_no_partial_file(trained, tmp_path, monkeypatch):
    """A write cut short (a full disk) leaves no ``start1.npz.partial`` beside the kept
    starts, where ``git add docs/claims/starts`` would commit it."""
    _, checkpoint, _, _ = trained
    write = starts._write_npz

    def full(path, arrays):
        write(path, dict(list(arrays.items())[:1]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(starts, "_write_npz", full)
    with pytest.raises(OSError, match="No space left"):
        starts.save_start(checkpoint, starts.start_path("testbed", 1, str(tmp_path)))
    assert os.listdir(tmp_path / "testbed") == []
