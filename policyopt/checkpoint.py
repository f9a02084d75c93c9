"""Checkpoints of a run: one orbax ``CheckpointManager`` holding a pytree and a JSON record.

A checkpoint at step ``s`` is a directory ``<dir>/<s>/`` with three items:

- ``state``: any pytree of arrays (for RL: parameters, optimiser state, update counters,
  the rng key), saved with orbax's standard handler and restored onto the structure,
  shapes and dtypes of a target pytree;
- ``meta``: a JSON-serialisable dict (the loop's iteration, the data iterator's state,
  anything the loop needs to continue exactly where it stopped), with the format marker
  ``FORMAT_KEY``;
- ``checksums``: one 32-bit checksum per array of ``state`` (by its key path,
  :func:`tree_checksums`) and a SHA-256 of ``meta``, written in the same atomic save.

Restoring the latest checkpoint and continuing gives bit-identical parameters to an
uninterrupted run (tested in ``tests/test_checkpoint.py`` and ``tests/rl/test_trainer.py``).

Verification: ``meta`` must match its digest, the restored arrays their checksums, and a
checkpoint whose ``meta`` carries the marker must have its ``checksums`` (older ones,
without either, are restored unverified). Restoring the latest (``step=None``) falls back
to the newest readable kept one when the latest is corrupt (any of these, unreadable or
missing files and items, broken JSON), with a warning naming both directories; an
``owner`` moves the corrupt one aside to ``<step>.corrupt``, so that it saves that step
again. A target of another shape is not corruption and is never skipped. Every restore
error is a :class:`CheckpointError` naming the directory (docs/runs.md, "Checkpoints and
resume").

:func:`lock_workdir` gives a run's directory one owner: a second process is refused
(``fcntl.flock`` on ``<workdir>/.lock``; the kernel releases it when the owner exits, so a
killed run leaves no stale lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored; the message names its directory."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files are damaged (checksums, unreadable or missing items)."""


# The key of ``meta`` that marks a checkpoint written with checksums of its arrays and of
# its meta record (its value, the format): without ``checksums`` such a checkpoint is
# corrupt. Checkpoints without it predate both and are restored unverified.
FORMAT_KEY = "checkpoint_format"
FORMAT = 2


def meta_digest(meta: dict) -> str:
    """SHA-256 (hex) of ``meta`` as JSON with sorted keys: what its JSON file holds, read
    back (tuples become lists, keys strings), hashes the same."""
    normal = json.loads(json.dumps(meta))
    text = json.dumps(normal, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _key_data(leaf):
    return jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf


@jax.jit
def _checksums(leaves: list) -> jax.Array:
    """``uint32 [len(leaves)]``: for each array, the sum over its elements of
    ``bits_i * (2 i + 1)`` mod 2^32, ``bits_i`` element i's bytes as an unsigned integer
    (32-bit chunks for 64-bit types). Any single flipped bit changes it (an odd multiple of
    a power of two below 2^32 is never 0 mod 2^32); sharded arrays reduce where they lie."""
    sums = []
    for leaf in leaves:
        if leaf.dtype == jnp.bool_:
            leaf = leaf.astype(jnp.uint8)
        if leaf.dtype.itemsize == 8:
            leaf = jax.lax.bitcast_convert_type(leaf, jnp.uint32)  # [..., 2]
        elif not jnp.issubdtype(leaf.dtype, jnp.unsignedinteger):  # floats, signed ints
            leaf = jax.lax.bitcast_convert_type(leaf, jnp.dtype(f"uint{8 * leaf.dtype.itemsize}"))
        bits = leaf.reshape(-1).astype(jnp.uint32)
        weights = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
        sums.append(jnp.sum(bits * weights, dtype=jnp.uint32))
    return jnp.stack(sums) if sums else jnp.zeros((0,), jnp.uint32)


def key_path_name(path) -> str:
    """``"train/params/embed/embedding"``: a key path by its names, whether its nodes are
    dicts or dataclasses (a full state and a partial restore of it name a leaf alike)."""
    names = []
    for key in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(key, attribute):
                names.append(str(getattr(key, attribute)))
                break
        else:
            names.append(str(key))
    return "/".join(names)


def tree_checksums(tree: Any) -> dict[str, int]:
    """``{key path: checksum}`` of every array leaf of ``tree`` (see ``_checksums``)."""
    paths, leaves = [], []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            paths.append(key_path_name(path))
            leaves.append(_key_data(jnp.asarray(leaf) if isinstance(leaf, np.ndarray) else leaf))
    values = np.asarray(jax.device_get(_checksums(leaves)))
    return {path: int(value) for path, value in zip(paths, values)}


# Words of tensorstore's and orbax's errors that mean damaged files (not a wrong target).
_CORRUPT_WORDS = (
    "corrupt",
    "decod",
    "checksum",
    "error while reading",
    "error reading",
    "unexpected end",
    "data_loss",
    "data loss",
)


def _first_line(error: BaseException, limit: int = 300) -> str:
    """``"Type: first line of the message"``, at most ``limit`` characters (tensorstore's
    messages carry whole JSON specs)."""
    message = str(error).strip().split(" See full TensorStore details")[0]
    text = f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class WorkdirLocked(RuntimeError):
    """Another process owns the workdir (``lock_workdir``); the message is one line."""


_held_locks: dict[str, int] = {}


def lock_workdir(workdir: str) -> None:
    """Makes this process the owner of ``workdir`` (created if missing) until it exits.

    ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<workdir>/.lock``, which holds the owner's pid.
    The kernel drops the lock when the owner exits, however it ends, so a stale file is
    harmless. Calling it again in the owning process is a no-op (a run resumed in the same
    process, the SFT then RL stages of the demo). In a multi-process job only process 0
    takes it (the processes share the workdir).

    Raises:
      WorkdirLocked: one line naming the directory and the other process's pid, when
        another process holds it.
    """
    path = os.path.join(os.path.abspath(workdir), ".lock")
    if path in _held_locks or jax.process_index() != 0:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise WorkdirLocked(
            f"workdir {os.path.dirname(path)} is in use by another process "
            f"(pid {owner}, lock {path}); wait for it to finish or choose "
            f"another workdir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held_locks[path] = fd  # kept open: the lock lives as long as this process


def unlock_workdir(workdir: str) -> None:
    """Releases ``lock_workdir``'s lock (also released when the process exits)."""
    fd = _held_locks.pop(os.path.join(os.path.abspath(workdir), ".lock"), None)
    if fd is not None:
        os.close(fd)


def workdir_owner(workdir: str) -> str | None:
    """The pid of another live process that holds ``workdir``'s lock (``lock_workdir``),
    or None: unlocked, never locked, or held by this process."""
    path = os.path.join(os.path.abspath(workdir), ".lock")
    if path in _held_locks or not os.path.exists(path):
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # closing drops the shared lock taken to test it
    return None


def holds_workdir_lock(workdir: str) -> bool:
    """Whether this process holds ``workdir``'s lock (``lock_workdir``)."""
    return os.path.join(os.path.abspath(workdir), ".lock") in _held_locks


class Checkpointer:
    """Saves and restores ``(state pytree, meta dict)`` pairs by integer step.

    Args:
      directory: where checkpoints live (created if missing; relative paths are
        resolved against the current directory, orbax needs an absolute one).
      max_to_keep: how many recent checkpoints to keep (None keeps all).
      owner: this process owns the directory (a run holding ``lock_workdir``): a restore
        of the latest checkpoint that falls back moves the corrupt ones it skipped aside
        (``<step>.corrupt``), so that the run saves those steps again and keeps its
        readable checkpoints. Readers (evaluation, a checkpoint to start from) leave the
        directory as it is.
    """

    def __init__(self, directory: str, *, max_to_keep: int | None = 2, owner: bool = False):
        self.directory = os.path.abspath(directory)
        self.owner = owner
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The most recent saved step, or None when the directory holds none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def step_path(self, step: int) -> str:
        """The directory of the checkpoint at ``step``."""
        return os.path.join(self.directory, str(int(step)))

    def save(self, step: int, state: Any, meta: dict | None = None) -> None:
        """Saves ``state``, ``meta`` (with ``FORMAT_KEY``) and the checksums of both at
        ``step`` and waits until they are on disk."""
        meta = {**(meta or {}), FORMAT_KEY: FORMAT}
        checksums = {"format": FORMAT, "arrays": tree_checksums(state), "meta": meta_digest(meta)}
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            meta=ocp.args.JsonSave(meta),
            checksums=ocp.args.JsonSave(checksums),
        )
        self._manager.save(int(step), args=args, force=True)
        self._manager.wait_until_finished()

    def _set_aside(self, steps: list[int]) -> None:
        """Renames each of ``steps``' directories to ``<step>.corrupt`` (``.corrupt-2``, ...
        when taken), which the manager does not list (process 0 on several processes)."""
        if jax.process_index() == 0:
            for step in steps:
                path, suffix, n = self.step_path(step), ".corrupt", 1
                while os.path.exists(path + suffix):
                    n += 1
                    suffix = f".corrupt-{n}"
                os.rename(path, path + suffix)
                logging.warning("moved the corrupt checkpoint %s aside to %s", path, path + suffix)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("policyopt checkpoint set aside")
        self._manager.reload()

    def _newest_first(self, step: int | None) -> list[int]:
        """``[step]``, or with None every saved step, newest first (the fallbacks)."""
        if step is not None:
            return [int(step)]
        steps = sorted(self.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return steps

    def _with_fallback(self, step: int | None, read, *, set_aside: bool = False):
        """``read(step)`` for ``step``, or with None for the newest step that is not corrupt
        (a warning names the corrupt and the fallback directories; with ``set_aside`` and
        ``owner``, the corrupt ones are moved aside once a readable one is found)."""
        steps = self._newest_first(step)
        first_error = None
        for index, candidate in enumerate(steps):
            try:
                result = read(candidate)
            except CorruptCheckpointError as error:
                first_error = first_error or error
                if index + 1 < len(steps):
                    logging.warning(
                        "%s; falling back to the previous checkpoint %s",
                        error,
                        self.step_path(steps[index + 1]),
                    )
                continue
            if index and set_aside and self.owner:
                self._set_aside(steps[:index])
            return result
        if len(steps) > 1:
            raise CorruptCheckpointError(
                f"{first_error}; no earlier checkpoint in {self.directory} is readable either"
            ) from first_error
        raise first_error

    def _read(
        self, step: int, args: ocp.args.Composite, what: str, *, checked: bool = False
    ) -> dict:
        """``manager.restore`` with every failure turned into a ``CheckpointError`` naming
        the step's directory (corrupt files: ``CorruptCheckpointError``; every failure when
        ``checked``: the target was compared with the checkpoint's metadata first, so
        what fails is the files)."""
        path = self.step_path(step)
        missing = [name for name in args.keys() if not os.path.isdir(os.path.join(path, name))]
        if missing:
            raise CorruptCheckpointError(
                f"checkpoint {path} is corrupt: its item(s) {missing} are "
                f"missing (a partial copy, or files deleted by hand?)"
            )
        try:
            return self._manager.restore(int(step), args=args)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, OSError) as error:
            raise CorruptCheckpointError(
                f"checkpoint {path} is corrupt: cannot read its {what} ({_first_line(error)})"
            ) from error
        except Exception as error:  # noqa: BLE001 - orbax / tensorstore raise many kinds
            message = str(error).lower()
            corrupt = checked or (
                "shape" not in message and any(word in message for word in _CORRUPT_WORDS)
            )
            kind = CorruptCheckpointError if corrupt else CheckpointError
            raise kind(
                f"checkpoint {path}{' is corrupt' if corrupt else ''}: cannot restore its "
                f"{what} ({_first_line(error)})"
            ) from error

    def _corrupt(self, step: int, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"checkpoint {self.step_path(step)} is corrupt: {what}")

    def _checked_meta(self, step: int) -> tuple[dict, dict | None]:
        """The ``meta`` record of ``step`` (without ``FORMAT_KEY``), verified against its
        digest, and the saved checksums of its arrays (None: a checkpoint from before
        checksums, restored unverified)."""
        read = lambda name: self._read(
            step, ocp.args.Composite(**{name: ocp.args.JsonRestore()}), name
        )[name]
        meta = read("meta")
        has_sums = os.path.isdir(os.path.join(self.step_path(step), "checksums"))
        sums = read("checksums") if has_sums else None
        if not isinstance(meta, dict):
            raise self._corrupt(step, f"its meta record is {type(meta).__name__}, not a dict")
        if not has_sums:
            if FORMAT_KEY in meta:  # written by a version that always saves checksums
                raise self._corrupt(
                    step,
                    f"its item 'checksums' is missing (a checkpoint of format "
                    f"{meta[FORMAT_KEY]!r} always has one; files deleted by hand?)",
                )
            return meta, None
        if not isinstance(sums, dict):
            raise self._corrupt(step, f"its checksums are {type(sums).__name__}, not a dict")
        if FORMAT_KEY not in meta and "format" not in sums:  # arrays only: an older version
            return meta, sums
        arrays = sums.get("arrays")
        if (
            meta.get(FORMAT_KEY) != sums.get("format")
            or meta_digest(meta) != sums.get("meta")
            or not isinstance(arrays, dict)
        ):
            raise self._corrupt(
                step,
                "its meta record (iteration, data position, config) differs from the "
                "checksum saved with it",
            )
        return {k: v for k, v in meta.items() if k != FORMAT_KEY}, arrays

    def _verify(self, step: int, restored_state: Any, saved: dict, prefix: tuple = ()) -> None:
        """Compares the checksums of ``restored_state`` (the subtree at ``prefix``) with the
        saved ones (``saved``: ``{key path: checksum}``)."""
        subtree = restored_state
        for key in reversed(prefix):
            subtree = {key: subtree}
        bad = [
            name
            for name, value in tree_checksums(subtree).items()
            if name in saved and saved[name] != value
        ]
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise self._corrupt(
                step,
                f"the checksums of {', '.join(bad[:3])}{more} differ from those saved with it "
                "(damaged array files)",
            )

    def restore(
        self,
        target: Any,
        step: int | None = None,
        *,
        check: Callable[[int, dict], None] | None = None,
    ) -> tuple[Any, dict]:
        """Restores the checkpoint at ``step`` (default: latest) onto ``target``'s structure
        and verifies its meta record and arrays against their saved checksums.

        Args:
          target: a pytree with the structure, shapes and dtypes to restore (concrete
            arrays or ``jax.ShapeDtypeStruct`` leaves).
          step: which checkpoint; None for the latest that is not corrupt (a corrupt
            latest checkpoint falls back to the previous kept one, with a warning; an
            ``owner`` moves the corrupt ones aside).
          check: ``check(step, meta)``, called with each candidate's verified meta record
            before its arrays are read (a resumed run compares its config and shapes);
            its errors end the restore, but a ``CorruptCheckpointError`` falls back.

        Returns:
          ``(state, meta)``.

        Raises:
          FileNotFoundError: naming the directory when it holds no checkpoint.
          CheckpointError: naming the checkpoint's directory (``CorruptCheckpointError``
            when its files are damaged: the checkpoint asked for, or every kept one).
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)

        def read(candidate):
            meta, sums = self._checked_meta(candidate)
            if check is not None:
                check(candidate, meta)
            self._check_shapes(candidate, abstract)
            args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            state = self._read(candidate, args, "state", checked=True)["state"]
            if sums is not None:
                self._verify(candidate, state, sums)
            return state, meta

        return self._with_fallback(step, read, set_aside=True)

    def compare_shapes(self, target: Any, step: int) -> tuple[list[tuple], list[str]]:
        """``target``'s arrays against the checkpoint's metadata (no array is read):
        ``([(name, saved shape, target shape), ...], [names not in the checkpoint])``,
        dotted names as orbax saves them (``train.params.w``; an ``nnx.State`` leaf's
        trailing ``.value`` is matched without it). The second list is empty when no name
        matches at all (another tree, not missing arrays). Typed PRNG keys are skipped:
        they are stored as their key data. Unreadable metadata: ``CorruptCheckpointError``."""
        saved = self.saved_shapes(step)
        lookup = lambda name: saved.get(name, saved.get(name.removesuffix(".value")))
        wanted = {
            key_path_name(path).replace("/", "."): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(target)
            if hasattr(leaf, "shape") and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        }
        diffs = [
            (name, tuple(lookup(name)), shape)
            for name, shape in wanted.items()
            if lookup(name) is not None and tuple(lookup(name)) != shape
        ]
        matched = any(lookup(name) is not None for name in wanted)
        missing = [name for name in wanted if matched and lookup(name) is None]
        return diffs, missing

    def _check_shapes(self, step: int, abstract: Any) -> None:
        """Refuses, before any array is read, a target whose arrays have other shapes than
        the checkpoint's (``compare_shapes``; unreadable metadata is corruption). Besides
        naming every such array, this keeps orbax from failing mid-restore: it then closes
        its event loop with the other arrays' reads still in flight, and each later prints
        "Exception ignored ... Event loop is closed" from wherever the program has got to.
        It also lets the read that follows count every failure as damaged files."""
        diffs, _ = self.compare_shapes(abstract, step)
        if diffs:
            wrong = [f"{name} saved {old}, target {new}" for name, old, new in diffs]
            more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
            raise CheckpointError(
                f"checkpoint {self.step_path(step)}: cannot restore its state onto a target "
                f"of other shapes ({'; '.join(wrong[:3])}{more})"
            )

    def saved_shapes(self, step: int | None = None) -> dict[str, tuple[int, ...]]:
        """``{"train.params.embed.embedding": (V, D), ...}``: the shape of every array of
        the checkpoint's ``state`` (default: latest), read from its metadata, without
        reading the arrays.

        Raises:
          CorruptCheckpointError: the ``state`` item or its metadata missing or unreadable.
        """
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        path = os.path.join(self.step_path(step), "state")
        if not os.path.isdir(path):
            raise self._corrupt(
                step,
                "its item(s) ['state'] are missing (a partial copy, or files deleted by hand?)",
            )
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.ERROR)  # orbax warns about a step-level file it does not need
        reader = ocp.StandardCheckpointer()
        try:
            # None (no item metadata) where state/_METADATA does not parse
            tree = getattr(getattr(reader.metadata(path), "item_metadata", None), "tree", None)
        except Exception as error:  # noqa: BLE001 - orbax / tensorstore raise many kinds
            raise self._corrupt(
                step, f"cannot read its state's metadata ({_first_line(error)})"
            ) from error
        finally:
            reader.close()  # its metadata store's thread: restore now reads this every time
            logging.set_verbosity(verbosity)
        if tree is None:
            raise self._corrupt(step, "its state's metadata (state/_METADATA) is unreadable")
        shapes = {}

        def visit(node, prefix):
            if isinstance(node, dict):
                for key, value in node.items():
                    visit(value, prefix + (str(key),))
            elif isinstance(node, (list, tuple)):
                for index, value in enumerate(node):
                    visit(value, prefix + (str(index),))
            elif node is not None and hasattr(node, "shape"):
                shapes[".".join(prefix)] = tuple(node.shape)

        visit(tree, ())
        return shapes

    def meta(self, step: int | None = None) -> dict:
        """The JSON record of the checkpoint at ``step`` (default: the latest whose record
        reads and matches its checksum, with the same fallback as ``restore``), without
        reading its arrays."""
        return self._with_fallback(step, lambda candidate: self._checked_meta(candidate)[0])

    def checksums(self, step: int | None = None) -> dict[str, int] | None:
        """``{key path: checksum}`` of the arrays saved at ``step`` (default: the latest
        readable), as saved with them (``tree_checksums``), without reading the arrays;
        None for a checkpoint from before checksums."""
        return self._with_fallback(step, lambda candidate: self._checked_meta(candidate)[1])

    def restore_subtree(
        self,
        path: tuple[str, ...],
        target: Any,
        step: int | None = None,
        *,
        check: Callable[[int, dict], None] | None = None,
    ) -> Any:
        """Restores only the subtree at ``path`` of the saved state (e.g. the parameters),
        verified against its saved checksums.

        Used to start RL from an SFT checkpoint whatever the SFT optimiser state was:
        ``restore_subtree(("train", "params"), params)``.

        Args:
          path: keys (attribute or dict names) leading to the subtree in the saved state.
          target: concrete arrays with the subtree's structure, shapes and dtypes.
          step: which checkpoint; None for the latest that is not corrupt.
          check: as ``restore``'s.
        """
        item = target
        for key in reversed(path):
            item = {key: item}
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)

        def read(candidate):
            meta, sums = self._checked_meta(candidate)
            if check is not None:
                check(candidate, meta)
            self._check_shapes(candidate, item)
            args = ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=item, restore_args=restore_args, partial_restore=True
                )
            )
            restored = self._read(candidate, args, "state", checked=True)["state"]
            for key in path:
                restored = restored[key]
            if sums is not None:
                self._verify(candidate, restored, sums, tuple(path))
            return restored

        return self._with_fallback(step, read)

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
