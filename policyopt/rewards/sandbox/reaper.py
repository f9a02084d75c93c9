"""Kills what sandboxes left behind: their processes (by uid) and their working directories.

Standard library only.
"""

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence

# Working directories are named `policyopt-sandbox-<scorer pid>-*`.
SANDBOX_PREFIX = "policyopt-sandbox-"


def count_processes(uid: int) -> int:
    """The number of processes (zombies included) owned by ``uid``."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def live_processes(uid: int) -> list[int]:
    """Pids owned by ``uid`` that are not zombies (a zombie waits only for its reaper)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            pids.append(int(entry.name))
    return pids


def reap_uid(uid: int) -> None:
    """SIGKILLs every live process owned by ``uid`` until none is left (fork races included)."""
    for _ in range(200):
        pids = live_processes(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_sandboxes(pids: Sequence[int] | None = None) -> int:
    """Deletes working directories left by dead scorers; returns how many were removed.

    Args:
      pids: scorer processes known to be dead (e.g. just-killed workers); None: every
        scorer pid that no longer exists.
    """
    removed = 0
    root = tempfile.gettempdir()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return 0
    for entry in entries:
        if not entry.name.startswith(SANDBOX_PREFIX):
            continue
        owner = entry.name[len(SANDBOX_PREFIX) :].split("-", 1)[0]
        if not owner.isdigit():
            continue
        pid = int(owner)
        stale = pid in pids if pids is not None else (pid != os.getpid() and not pid_alive(pid))
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed
