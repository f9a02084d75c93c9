"""Custom verifiers (``RewardSpec.verifier="package.module:function"``): imported by path
and run in the calling thread's verifier process, where nothing they do can stop the run.

The function gets ``(completion, reference)`` and returns the correctness c in [0, 1]. In
its process (``policyopt.rewards.killable``) a call that blocks in C is killed at its
limit, and an exception, ``SystemExit``, ``KeyboardInterrupt`` or the process's death is a
verifier error (c = 0, counted), never the caller's. ``docs/rewards.md``, "Custom
verifiers".
"""

from __future__ import annotations

import functools
import importlib
import numbers
import os
from typing import Any

import numpy as np
from absl import logging

from policyopt.rewards import killable
from policyopt.rewards.timelimit import VerifierTimeout


class VerifierImportError(ValueError):
    """``RewardSpec.verifier`` names nothing importable (here, or in a scoring worker)."""


@functools.lru_cache(maxsize=None)
def load_verifier(path: str):
    """The function named by ``"package.module:function"`` (``RewardSpec.verifier``)."""
    module_name, sep, name = str(path).partition(":")
    if not sep or not module_name or not name:
        raise VerifierImportError(
            f"RewardSpec.verifier must be 'package.module:function', got {path!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise VerifierImportError(
            f"RewardSpec.verifier={path!r}: cannot import {module_name!r} "
            f"({error}; in process {os.getpid()})"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise VerifierImportError(
            f"RewardSpec.verifier={path!r}: {module_name!r} has no function {name!r}"
        )
    return function


def call_verifier(path: str, completion: str, reference: Any) -> Any:
    """What the verifier ``path`` says of one sample (run in its verifier process)."""
    return load_verifier(path)(completion, reference)


_LOGGED_ERRORS: set[str] = set()


def _error(path: str, message: str) -> tuple[float, str]:
    if path not in _LOGGED_ERRORS:  # once per verifier and process
        _LOGGED_ERRORS.add(path)
        logging.warning(
            "verifier %s failed (scored 0; later failures are counted in "
            "verifier_errors, not logged): %s",
            path,
            message,
        )
    return 0.0, "verifier_error"


def custom_correctness(
    path: str, completion: str, reference: Any, timeout_s: float
) -> tuple[float, str]:
    """``(c, status)`` of one sample from the verifier ``path``, under ``timeout_s`` in the
    calling thread's verifier process: "correct" (c = 1), "incorrect", "timeout" (c = 0)
    or "verifier_error" (c = 0: it raised, exited, died or returned no number in [0, 1]).
    Never raises for what the verifier does (the caller's own Ctrl-C goes through)."""
    worker = killable.thread_worker(f"verifier:{path}", initializer=(load_verifier, (path,)))
    try:
        worker.start()  # its start-up (the verifier's imports) is no part of the limit
        value = worker.call(call_verifier, (path, completion, reference), timeout_s)
    except VerifierTimeout:
        return 0.0, "timeout"
    except RuntimeError as error:  # it raised (SystemExit, KeyboardInterrupt too) or died
        return _error(path, str(error))
    if isinstance(value, (bool, np.bool_)):
        value = float(value)
    if not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        return _error(path, f"returned {value!r}, not a number in [0, 1]")
    return float(value), "correct" if value >= 1.0 else "incorrect"
