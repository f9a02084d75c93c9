"""Checkpoints of a run: one orbax ``CheckpointManager`` holding a pytree and a JSON record.

A checkpoint at step ``s`` is a directory ``<dir>/<s>/`` with two items:

- ``state``: any pytree of arrays (for RL: parameters, optimiser state, update counters,
  the rng key), saved with orbax's standard handler and restored onto the structure,
  shapes and dtypes of a target pytree;
- ``meta``: a JSON-serialisable dict (the loop's iteration, the data iterator's state,
  anything the loop needs to continue exactly where it stopped).

Restoring the latest checkpoint and continuing gives bit-identical parameters to an
uninterrupted run (tested in ``tests/test_checkpoint.py`` and ``tests/test_rl_trainer.py``).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
    """Saves and restores ``(state pytree, meta dict)`` pairs by integer step.

    Args:
      directory: where checkpoints live (created if missing; relative paths are
        resolved against the current directory, orbax needs an absolute one).
      max_to_keep: how many recent checkpoints to keep (None keeps all).
    """

    def __init__(self, directory: str, *, max_to_keep: int | None = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The most recent saved step, or None when the directory holds none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict | None = None) -> None:
        """Saves ``state`` and ``meta`` at ``step`` and waits until they are on disk."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  meta=ocp.args.JsonSave(dict(meta or {})))
        self._manager.save(int(step), args=args, force=True)
        self._manager.wait_until_finished()

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores the checkpoint at ``step`` (default: latest) onto ``target``'s structure.

        Args:
          target: a pytree with the structure, shapes and dtypes to restore (concrete
            arrays or ``jax.ShapeDtypeStruct`` leaves).
          step: which checkpoint; None for the latest.

        Returns:
          ``(state, meta)``.

        Raises:
          FileNotFoundError: naming the directory when it holds no checkpoint.
        """
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        restored = self._manager.restore(int(step), args=args)
        return restored["state"], dict(restored["meta"] or {})

    def saved_shapes(self, step: int | None = None) -> dict[str, tuple[int, ...]]:
        """``{"train.params.embed.embedding": (V, D), ...}``: the shape of every array of
        the checkpoint's ``state`` (default: latest), read from its metadata, without
        reading the arrays."""
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        path = os.path.join(self.directory, str(int(step)), "state")
        verbosity = logging.get_verbosity()
        logging.set_verbosity(logging.ERROR)  # orbax warns about a step-level file it does not need
        try:
            tree = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
        finally:
            logging.set_verbosity(verbosity)
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
        """The JSON record of the checkpoint at ``step`` (default: latest), without
        reading its arrays (a resumed run checks its config against it first)."""
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(int(step), args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"] or {})

    def restore_subtree(self, path: tuple[str, ...], target: Any, step: int | None = None) -> Any:
        """Restores only the subtree at ``path`` of the saved state (e.g. the parameters).

        Used to start RL from an SFT checkpoint whatever the SFT optimiser state was:
        ``restore_subtree(("train", "params"), params)``.

        Args:
          path: keys (attribute or dict names) leading to the subtree in the saved state.
          target: concrete arrays with the subtree's structure, shapes and dtypes.
          step: which checkpoint; None for the latest.
        """
        if step is None:
            step = self.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        item = target
        for key in reversed(path):
            item = {key: item}
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=restore_args, partial_restore=True))
        restored = self._manager.restore(int(step), args=args)["state"]
        for key in path:
            restored = restored[key]
        return restored

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
