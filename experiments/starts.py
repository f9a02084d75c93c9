"""The claims' SFT starts kept in the repository (``docs/claims/starts/<setting>/start<K>.npz``).

A start's parameters, saved once where it was trained, let another machine run the same
start bit for bit instead of training it again (its bits depend on the CPU and the JAX
release): its runs then match the ledger's records (``experiments.ledger``), and a sweep
of many hours resumes anywhere. ``ensure_sft`` restores a kept start into the SFT cache
when the cache lacks it and the variant leaves the SFT config alone (docs/claims.md,
"SFT starts kept in the repository").

    python -m experiments.starts --setting testbed_long --starts 1,2   # keep the cached ones
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import app, flags

from configs.ablations import SETTINGS
from experiments.ledger import KEPT_MARKER, legacy_start_id, start_id
from policyopt.checkpoint import (
    Checkpointer,
    WorkdirLocked,
    key_path_name,
    lock_workdir,
    tree_checksums,
    unlock_workdir,
    workdir_owner,
)
from policyopt.metrics import quiet_library_logging
from policyopt.rl.loop import build
from policyopt.rl.sft import SFT_FIELDS, SFT_IGNORED

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTS_DIR = os.path.join(_REPOSITORY, "docs", "claims", "starts")
MARKER = KEPT_MARKER  # in an SFT cache directory restored from the repository
_META = "__meta__"  # the npz entry holding the checkpoint's meta record and identity
# Resume-free fields (RESUME_FREE_FIELDS) that do change a start's parameters.
_CHANGES_PARAMETERS = ("sft.steps",)


def start_path(setting: str, start: int, root: str | None = None) -> str:
    """Where start ``start`` of ``setting`` is kept: ``<root>/<setting>/start<K>.npz``
    (``root`` default ``STARTS_DIR``)."""
    return os.path.join(root or STARTS_DIR, setting, f"start{start}.npz")


def _shown(path: str) -> str:
    """``path`` relative to the repository when inside it (``docs/claims/starts/...``)."""
    path = os.path.abspath(path)
    inside = os.path.commonpath([path, _REPOSITORY]) == _REPOSITORY
    return os.path.relpath(path, _REPOSITORY) if inside else path


def is_kept(sft_workdir: str) -> bool:
    """Whether an SFT cache directory holds a start restored from the repository
    (parameters only: it cannot be continued by more SFT)."""
    return os.path.exists(os.path.join(sft_workdir, MARKER))


def save_start(checkpoint_dir: str, path: str) -> str:
    """Writes the parameters of ``checkpoint_dir``'s latest checkpoint, with its meta
    record and step, to ``path`` (npz); returns the start's identity (``start_id``)."""
    identity = start_id(checkpoint_dir)
    with Checkpointer(checkpoint_dir) as source:
        step = source.latest_step()
        meta = source.meta(step)
        sums = source.checksums(step) or {}
    state = ocp.StandardCheckpointer().restore(os.path.join(checkpoint_dir, str(step), "state"))
    arrays = {
        name: np.asarray(leaf)
        for keys, leaf in jax.tree_util.tree_leaves_with_path(state)
        if (name := key_path_name(keys)).startswith("train/params/")
    }
    saved = {k: v for k, v in sums.items() if k.startswith("train/params/")}
    read = tree_checksums(_nest(arrays))
    if read != saved:  # what restoring elsewhere checks: refused here, not there
        differ = sorted(k for k in set(read) | set(saved) if read.get(k) != saved.get(k))
        raise ValueError(
            f"{checkpoint_dir}: the parameters read from step {step} are not the ones saved "
            f"with it ({', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}): a damaged "
            "checkpoint; nothing kept"
        )
    kept = {"step": int(step), "meta": meta, "start_id": identity}
    legacy = legacy_start_id(checkpoint_dir)  # records written before name it so
    if legacy is not None:
        kept["legacy_id"] = legacy
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    temporary = path + ".partial"
    try:
        _write_npz(temporary, {**arrays, _META: np.array(json.dumps(kept, sort_keys=True))})
        os.replace(temporary, path)
    except BaseException:  # a full disk, an interrupt: nothing beside the kept starts
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    return identity


def _write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez_compressed`` with fixed entry times and order: the same start gives the
    same bytes, so keeping it again changes nothing in git."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in sorted(arrays):
            entry = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            entry.compress_type = zipfile.ZIP_DEFLATED
            with archive.open(entry, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(arrays[name]), allow_pickle=False)


def _load(path: str, arrays: bool = True) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays (none without ``arrays``: the record only is read) and record of a kept
    start; a ValueError naming ``path`` where it is not one (cut short, text in its place,
    no record)."""
    try:
        with np.load(path) as data:
            kept = json.loads(str(data[_META]))
            names = [name for name in data.files if name != _META] if arrays else []
            arrays = {name: data[name] for name in names}
        missing = [f for f in ("step", "meta", "start_id") if f not in kept]
        if missing:
            raise KeyError(f"its record lacks {', '.join(missing)}")
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as error:
        raise ValueError(
            f"{path} is not a readable kept SFT start ({type(error).__name__}: {error}); "
            "restore it from git (git checkout -- <file>) or remove it"
        ) from None
    return arrays, kept


def _nest(arrays: dict[str, np.ndarray]) -> dict:
    tree: dict[str, Any] = {}
    for name, value in arrays.items():
        node = tree
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def differing_fields(saved: dict, config) -> list[str]:
    """The fields of ``config`` (an SFT config) whose values differ from a kept start's
    saved config record (``saved``): those SFT reads (``sft.SFT_FIELDS``, as its resume
    check), but layout and cadence fields that leave the parameters alone; fields only
    one record has (added to the library since, or removed) are not compared, as on
    resume, but a start kept without a config record differs from every config. A start
    of another recipe is not this one's; a recipe's RL settings may change under it."""
    if not saved:  # no record to compare: no known config's start
        return ["config (not recorded)"]
    current = build.resolved_record(build.config_record(config))
    saved = build.resolved_record(saved)

    def matches(field, prefixes):
        return any(field == k or (k.endswith(".") and field.startswith(k)) for k in prefixes)

    def compared(field):
        if not matches(field, SFT_FIELDS) or matches(field, SFT_IGNORED):
            return False
        return field in _CHANGES_PARAMETERS or not matches(field, build.RESUME_FREE_FIELDS)

    def text(record, field):
        return json.dumps(record.get(field), default=str)

    fields = set(current) & set(saved)
    return sorted(f for f in fields if compared(f) and text(current, f) != text(saved, f))


def _remove_stale(sft_workdir: str) -> None:
    """Removes the partial directories beside ``sft_workdir`` (``restore_start``'s, and
    the leftovers ``use_kept_start`` moves aside) whose process is gone (killed
    mid-restore); a live one's are its own."""
    parent, name = os.path.split(os.path.abspath(sft_workdir))
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        stem, _, pid = entry.rpartition("-")
        if stem not in (f"{name}.restoring", f"{name}.leftover") or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        except OSError:  # alive, another user's
            pass


def restore_start(path: str, sft_workdir: str) -> str:
    """Restores the kept start at ``path`` into ``sft_workdir/checkpoints`` (parameters,
    step and meta record; no optimiser state) and returns that directory. The checkpoint
    is written beside it and moved into place whole, so that an interrupted restore or two
    processes restoring at once leave one complete start. Raises ValueError when the
    restored parameters are not the kept ones bit for bit."""
    arrays, kept = _load(path)
    step = int(kept["step"])
    _remove_stale(sft_workdir)
    partial = f"{sft_workdir}.restoring-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with Checkpointer(os.path.join(partial, "checkpoints"), max_to_keep=None) as target:
            target.save(step, _nest(arrays), kept["meta"])
        identity = start_id(os.path.join(partial, "checkpoints"))
    except BaseException:  # a full disk, an interrupt: no partial start left behind
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if identity != kept["start_id"]:
        shutil.rmtree(partial, ignore_errors=True)
        raise ValueError(
            f"{path}: its parameters give the start {identity}, not the {kept['start_id']} "
            "it was saved as (a damaged file?)"
        )
    with open(os.path.join(partial, MARKER), "w") as f:
        record = {"source": _shown(path), "step": step, "start_id": kept["start_id"]}
        if kept.get("legacy_id"):
            record["legacy_id"] = kept["legacy_id"]
        json.dump(record, f)
        f.write("\n")
    os.makedirs(os.path.dirname(os.path.abspath(sft_workdir)), exist_ok=True)
    try:
        os.rename(partial, sft_workdir)
    except OSError:  # another process restored it first (or a run began there)
        shutil.rmtree(partial, ignore_errors=True)
        if not is_kept(sft_workdir):
            raise
    return os.path.join(sft_workdir, "checkpoints")


def kept_start_id(setting: str, start: int, root: str | None = None) -> str | None:
    """The identity of the kept start of ``setting`` number ``start`` (its record only is
    read: ``--list``); None where the repository keeps none or it is unreadable."""
    path = start_path(setting, start, root)
    try:
        return _load(path, arrays=False)[1]["start_id"] if os.path.exists(path) else None
    except ValueError:
        return None


def kept_identity(
    setting: str, start: int, config, root: str | None = None
) -> tuple[str, str | None] | None:
    """``(start_id, legacy id or None)`` of the start of ``setting`` number ``start`` kept
    in the repository for ``config`` (the SFT config), read from its file without
    restoring it; None where none is kept, or one of another config."""
    path = start_path(setting, start, root or STARTS_DIR)
    if not os.path.exists(path):
        return None
    _, kept = _load(path, arrays=False)
    if differing_fields(kept["meta"].get("config", {}), config):
        return None
    return kept["start_id"], kept.get("legacy_id")


def _note_other(setting: str, start: int, checkpoints: str, path: str, kept: dict) -> None:
    """A note where the cache's start (``checkpoints``) is not the one kept at ``path``."""
    here = start_id(checkpoints)
    if here != kept["start_id"]:
        print(
            f"note: SFT start {start} of {setting!r} here ({here}) is not the one kept in "
            f"{_shown(path)} ({kept['start_id']}): its runs are another start's; remove "
            f"{os.path.dirname(checkpoints)} to use the kept one",
            flush=True,
        )


def use_kept_start(setting: str, start: int, config, sft_workdir: str, root: str | None = None):
    """The checkpoint directory of the kept start of ``setting`` number ``start``, restored
    into ``sft_workdir`` if needed; None where the repository keeps none, where the
    cache already holds a start of its own (trained here, or restored before the
    repository kept another: it is used, and a note says when it is not the kept one), or
    where ``config`` (the SFT config) differs from the kept start's in a field that
    changes its parameters (the start is trained). A cache directory without a checkpoint
    (a run stopped before its first) makes way for the kept start, unless a live process
    holds it (``WorkdirLocked``); a restored start of another config is a ValueError."""
    path = start_path(setting, start, root or STARTS_DIR)
    checkpoints = os.path.join(sft_workdir, "checkpoints")
    if is_kept(sft_workdir):
        # Restored for the config it was kept with: another (more SFT steps, another
        # recipe) is not this start, and a start without optimiser state cannot train on.
        with Checkpointer(checkpoints) as restored:
            saved = restored.meta().get("config", {})
        differ = differing_fields(saved, config)
        if differ:
            raise ValueError(
                f"{sft_workdir} holds the SFT start {start} of {setting!r} kept in the "
                f"repository, of another config ({', '.join(differ[:4])}"
                f"{' ...' if len(differ) > 4 else ''} differ); remove it, or use another "
                "--sft_root, to train this config's start"
            )
        if os.path.exists(path):  # restored before the repository kept another
            kept = _load(path)[1]
            if not differing_fields(kept["meta"].get("config", {}), config):
                _note_other(setting, start, checkpoints, path, kept)
        return checkpoints
    if not os.path.exists(path):
        return None
    _, kept = _load(path)
    where = _shown(path)
    names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else []
    steps = [int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(checkpoints, n))]
    if steps:
        if max(steps) == kept["step"]:
            _note_other(setting, start, checkpoints, path, kept)
        elif max(steps) < kept["step"] and not differing_fields(
            kept["meta"].get("config", {}), config
        ):
            print(
                f"note: SFT start {start} of {setting!r} begun here (step {max(steps)} of "
                f"{kept['step']}) is resumed: its runs will be another start's, not the one "
                f"kept in {where} ({kept['start_id']}); remove {sft_workdir} to use the kept "
                "one",
                flush=True,
            )
        return None
    differ = differing_fields(kept["meta"].get("config", {}), config)
    if differ:
        print(
            f"note: the SFT start kept in {where} is of another config ({', '.join(differ[:4])}"
            f"{' ...' if len(differ) > 4 else ''} differ): training start {start} of "
            f"{setting!r} here",
            flush=True,
        )
        return None
    if os.path.exists(sft_workdir) and not is_kept(sft_workdir):
        # A run begun here and stopped before its first checkpoint (a lock file, a log, an
        # empty or unfinished checkpoints directory): no start is here. One still running
        # is refused; otherwise the leftovers make way for the kept start.
        owner = workdir_owner(sft_workdir)
        if owner is not None:
            raise WorkdirLocked(
                f"workdir {sft_workdir} is in use by another process (pid {owner}: an SFT "
                "run with no checkpoint yet); wait for it to finish, or stop it and rerun to "
                "restore the kept start"
            )
        aside = f"{sft_workdir}.leftover-{os.getpid()}"
        try:
            os.rename(sft_workdir, aside)
        except FileNotFoundError:
            pass
        else:
            shutil.rmtree(aside, ignore_errors=True)
            print(f"note: {sft_workdir} held no SFT checkpoint (a run stopped before its first)")
    restored = restore_start(path, sft_workdir)
    print(f"SFT start {start} of {setting!r}: restored from {where} ({kept['start_id']})")
    return restored


FLAGS = flags.FLAGS


def _define_flags() -> None:  # at run time only: experiments.reproduce has flags of these names
    flags.DEFINE_string("setting", None, "The setting whose cached SFT starts to keep.")
    flags.DEFINE_list("starts", ["0", "1"], "Which of its starts.")
    flags.DEFINE_string("sft_root", "runs", "Cache of the settings' SFT starts.")
    flags.DEFINE_string("variant", "", "The SFT items the starts were trained with.")
    flags.DEFINE_string("root", STARTS_DIR, "Where the starts are kept.")


def keep_starts(
    setting: str, start_list: list[str], sft_root: str, variant: str = "", root: str | None = None
) -> None:
    """Keep the cached SFT starts ``start_list`` of ``setting`` in ``root`` (default
    ``STARTS_DIR``); what the command does. A user's error raises ``SystemExit`` with
    its ``error: ...`` line."""
    from experiments.reproduce import finished_sft, sft_dir  # noqa: PLC0415 - no cycle at import

    if setting not in SETTINGS:
        raise SystemExit(f"error: no setting {setting!r}; known: {', '.join(SETTINGS)}")
    if not all(s.strip().isdigit() for s in start_list):
        raise SystemExit(f"error: --starts takes start numbers >= 0 (got {','.join(start_list)!r})")
    for start in (int(s) for s in start_list):
        if is_kept(sft_dir(sft_root, setting, start)):
            print(f"start {start} of {setting!r} is the kept one already")
            continue
        try:
            checkpoint = finished_sft(setting, sft_root, variant, start)
        except ValueError as error:
            raise SystemExit(f"error: {error}") from None
        workdir = os.path.dirname(checkpoint)
        try:
            lock_workdir(workdir)  # refused while it trains
        except WorkdirLocked as error:
            raise SystemExit(f"error: {error}") from None
        try:
            path = start_path(setting, start, root)
            if os.path.exists(path):  # the one the ledger's records name: not replaced
                try:
                    identity, there = start_id(checkpoint), _load(path)[1]["start_id"]
                except ValueError as error:
                    raise SystemExit(f"error: {error}") from None
                if there != identity:
                    raise SystemExit(
                        f"error: {_shown(path)} keeps another SFT start {start} of "
                        f"{setting!r} ({there}) than the one in {workdir} ({identity}); "
                        "the ledger's records may name it: remove the file first to keep "
                        "this one instead"
                    )
            try:
                identity = save_start(checkpoint, path)
            except ValueError as error:  # not an SFT start (no parameters), a damaged one
                raise SystemExit(f"error: {error}") from None
        finally:
            unlock_workdir(workdir)
        size = os.path.getsize(path) / 2**20
        print(f"start {start} of {setting!r}: {_shown(path)} ({identity}, {size:.1f} MiB)")


def main(argv):
    del argv
    quiet_library_logging()
    if not FLAGS.setting:
        raise app.UsageError("--setting is required (e.g. --setting testbed_long)")
    keep_starts(FLAGS.setting, FLAGS.starts, FLAGS.sft_root, FLAGS.variant, FLAGS.root)


if __name__ == "__main__":
    from experiments import cli  # noqa: PLC0415 - its flags with this command's only

    _define_flags()
    cli.run(main)  # a ValueError (a damaged start, a checkpoint of no parameters): one line
