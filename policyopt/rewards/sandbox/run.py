"""The sandbox's interface: run a program (or a program and its tests) with limits."""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
from collections.abc import Sequence

from policyopt.rewards.sandbox import cgroup, host, reaper
from policyopt.rewards.sandbox.process import (
    DEFAULT_DISK_MB,
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_MAX_PROCESSES,
    STARTUP_GRACE_S,
    Limits,
    Sandbox,
    SandboxResult,
)


def remove_stale_sandboxes(pids: Sequence[int] | None = None) -> int:
    """Kills the processes of sandboxes whose scorer died (by control group, process group
    and uid) and removes their directories and groups; returns how many directories.

    Args:
      pids: scorer processes known to be dead (e.g. just-killed workers); None: every
        scorer pid that no longer exists (the start-up sweep).
    """
    return reaper.remove_stale_sandboxes(pids, cgroup.support().bases())


@functools.cache
def sweep_once() -> None:
    """The start-up sweep (:func:`remove_stale_sandboxes`), once per process, before its
    first sandbox."""
    remove_stale_sandboxes()


def run_sandboxed(
    program: str,
    *,
    stdin: str = "",
    timeout_s: float = 4.0,
    memory_mb: int = 300,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    python: str | None = None,
    disk_mb: int = DEFAULT_DISK_MB,
    jail: bool | None = None,
) -> SandboxResult:
    """Runs untrusted Python source in the sandbox (``docs/rewards.md``, "The sandbox").

    Args:
      program: the source, run as ``__main__`` (no ``__file__``).
      stdin: its standard input.
      timeout_s, memory_mb, max_processes, max_output_bytes, disk_mb: the limits
        (:class:`~policyopt.rewards.sandbox.process.Limits`).
      python: the interpreter (None: one the sandbox uid can read).
      jail: None uses a root of its own where that works; False runs without one (the
        fallback of a non-root scorer, for tests).
    """
    sweep_once()
    limits = Limits(timeout_s, memory_mb, max_processes, max_output_bytes, disk_mb)
    sandbox = Sandbox(
        program,
        stdin=stdin,
        limits=limits,
        python=python,
        uid=host.sandbox_uids(1)[0],
        jail=jail,
    )
    try:
        return sandbox.finish(sandbox.wait(timeout_s + STARTUP_GRACE_S))
    finally:
        sandbox.close()


def run_isolated(
    program: str,
    tests: str,
    marker: str,
    *,
    timeout_s: float = 4.0,
    memory_mb: int = 300,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
    python: str | None = None,
    disk_mb: int = DEFAULT_DISK_MB,
    jail: bool | None = None,
) -> SandboxResult:
    """Runs assert ``tests`` against ``program`` in two sandboxes joined by pipes
    (``policyopt.rewards.sandbox.isolation``): the program's process serves the tests'
    process, which writes ``marker`` when the tests ran to their end. Each process has the
    limits of :func:`run_sandboxed` and its own uid; the wall-clock limit covers both.

    Returns:
      The tests' process's result; ``timed_out`` also when the program's process hit
      its CPU limit.
    """
    sweep_once()
    limits = Limits(timeout_s, memory_mb, max_processes, max_output_bytes, disk_mb)
    common = dict(stdin="", limits=limits, python=python, jail=jail)
    server_uid, client_uid = host.sandbox_uids(2)
    sandboxes, requests_r, requests_w, replies_r, replies_w = [], -1, -1, -1, -1
    try:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        sandboxes.append(
            Sandbox(
                f"{isolation_source()}\nserve({program!r}, {requests_r}, {replies_w})\n",
                uid=server_uid,
                pass_fds=(requests_r, replies_w),
                **common,
            )
        )
        sandboxes.append(
            Sandbox(
                f"{isolation_source()}\nrun_tests({tests!r}, {marker!r}, {replies_r}, "
                f"{requests_w})\n",
                uid=client_uid,
                pass_fds=(replies_r, requests_w),
                **common,
            )
        )
        for fd in (requests_r, requests_w, replies_r, replies_w):
            os.close(fd)
        requests_r = requests_w = replies_r = replies_w = -1
        server, client = sandboxes
        returncode = client.wait(timeout_s + STARTUP_GRACE_S, watch=[server])
        server_code = server.process.poll()  # before the kill: did it die of its CPU limit?
        result = client.finish(returncode)
        server.finish(server_code)
        if server.disk_exceeded:  # killed for its disk use: a failure, not a timeout
            result = dataclasses.replace(result, disk_exceeded=True)
        elif server_code in (-signal.SIGXCPU, -signal.SIGKILL):
            result = dataclasses.replace(result, timed_out=True)
        return result
    finally:
        for fd in (requests_r, requests_w, replies_r, replies_w):
            if fd >= 0:
                os.close(fd)
        for sandbox in sandboxes:
            sandbox.close()


@functools.cache
def isolation_source() -> str:
    """The source of ``policyopt.rewards.sandbox.isolation``, which both sandboxes run."""
    from policyopt.rewards.sandbox import isolation

    with open(isolation.__file__, encoding="utf-8") as f:
        return f.read()
