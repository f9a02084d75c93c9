"""Kills what sandboxes left behind: their processes (by control group, process group and
uid) and their working directories, from the scorer, its watcher or a later scorer.

Each sandbox's directory holds an ``owner`` file naming what to kill: its uid, its process
group and its control groups. A scorer's watcher (:func:`supervise`, one process per
scorer, started by ``policyopt.rewards.sandbox.process``) cleans up after the scorer when
it dies; the start-up sweep (:func:`remove_stale_sandboxes`) after scorers no one watched.
Standard library only: the watcher runs this file's source in ``python -I -S``.
"""

import os
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence

# Working directories are named `policyopt-sandbox-<scorer pid>-*`, and so are the
# sandboxes' control groups (`<scorer pid>-*`, under a base named SANDBOX_GROUPS).
SANDBOX_PREFIX = "policyopt-sandbox-"
SANDBOX_GROUPS = "policyopt-sandbox"
# A watcher's command line: `python -I -S -c <source> WATCHER_NAME <scorer pid> <bases>...`.
WATCHER_NAME = "policyopt-sandbox-supervisor"
# How long a kill waits for a group's processes to be gone, seconds.
_GROUP_EXIT_S = 5.0


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


def _state(pid: int | str) -> bytes | None:
    """The state letter of ``/proc/<pid>/stat`` (b"Z" for a zombie), None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def live_processes(uid: int) -> list[int]:
    """Pids owned by ``uid`` that are not zombies (a zombie waits only for its reaper)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if _state(entry.name) not in (None, b"Z", b"X"):
            pids.append(int(entry.name))
    return pids


def reap_uid(uid: int) -> None:
    """SIGKILLs every live process owned by ``uid`` until none is left (fork races included)."""
    for _ in range(200):
        pids = live_processes(uid)
        if not pids:
            return
        _kill_each(pids)
        time.sleep(0.002)


def _kill_each(pids: Iterable[int]) -> None:
    """SIGKILLs each of ``pids``, passing over those gone already."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists and is not a zombie (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return _state(pid) not in (b"Z", b"X")


def _group_pids(group: str) -> list[int]:
    try:
        with open(os.path.join(group, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def kill_group(group: str) -> None:
    """SIGKILLs every process of the control group directory ``group`` and waits (up to
    5 s) until it holds none: ``cgroup.kill`` where the kernel has it (cgroup v2, Linux
    5.14), else each listed process until the list stays empty."""
    kill_file = os.path.join(group, "cgroup.kill")
    deadline = time.monotonic() + _GROUP_EXIT_S
    while time.monotonic() < deadline:
        pids = _group_pids(group)
        if not pids:
            return
        try:
            with open(kill_file, "w") as f:
                f.write("1")
        except OSError:  # no cgroup.kill: one by one (the sandbox's process limit ends forks)
            _kill_each(pids)
        time.sleep(0.002)


def remove_group(group: str) -> None:
    """Kills the processes of the control group ``group``, then removes it."""
    if not os.path.isdir(group):
        return
    kill_group(group)
    for _ in range(100):
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: its last processes are still exiting
            time.sleep(0.01)


def read_owner(root: str) -> dict[str, list[str]]:
    """The ``owner`` file of a sandbox directory: ``{"uid": [...], "pgid": [...],
    "group": [...]}`` (missing keys: nothing of that kind)."""
    owner: dict[str, list[str]] = {}
    try:
        with open(os.path.join(root, "owner"), encoding="utf-8") as f:
            for line in f:
                key, _, value = line.rstrip("\n").partition(" ")
                owner.setdefault(key, []).append(value)
    except OSError:
        pass
    return owner


def remove_sandbox(root: str) -> None:
    """Kills every process of the sandbox whose directory is ``root`` (its control groups,
    its process group, its uid), then removes the groups and the directory."""
    owner = read_owner(root)
    for group in owner.get("group", []):
        kill_group(group)
    for pgid in owner.get("pgid", []):
        try:
            os.killpg(int(pgid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    for uid in owner.get("uid", []):
        if uid.isdigit():
            reap_uid(int(uid))
    for group in owner.get("group", []):
        remove_group(group)
    shutil.rmtree(root, ignore_errors=True)


def _owner_pid(name: str, prefix: str) -> int | None:
    owner = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
    return int(owner) if owner.isdigit() else None


def remove_stale_sandboxes(
    pids: Sequence[int] | None = None, group_bases: Iterable[str] = ()
) -> int:
    """Kills the processes of sandboxes whose scorer is dead and removes their directories
    and control groups; returns how many directories were removed.

    Args:
      pids: scorer processes known to be dead (e.g. just-killed workers); None: every
        scorer pid that no longer exists.
      group_bases: the directories under which sandboxes' control groups are made.
    """

    def stale(pid: int | None) -> bool:
        if pid is None:
            return False
        return pid in pids if pids is not None else (pid != os.getpid() and not pid_alive(pid))

    removed = 0
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        entries = []
    for entry in entries:
        if stale(_owner_pid(entry.name, SANDBOX_PREFIX)):
            remove_sandbox(entry.path)
            removed += 1
    for base in group_bases:  # groups whose directory went first (or never had one)
        try:
            groups = list(os.scandir(base))
        except OSError:
            continue
        for group in groups:
            if group.is_dir() and stale(_owner_pid(group.name, "")):
                remove_group(group.path)
    return removed


def supervise(scorer: int, group_bases: Sequence[str]) -> None:
    """The watcher's loop: reads ``+ <root>`` / ``- <root>`` lines (a sandbox directory
    made, removed) on stdin until the scorer closes it (it exited or died), then removes
    every sandbox still listed and the scorer's control groups."""
    roots, pending = set(), b""
    while True:
        ready, _, _ = select.select([0], [], [], 1.0)
        if not ready:
            if pid_alive(scorer):
                continue
            break  # gone, and yet the pipe is open: a child of the scorer holds it
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            sign, _, root = line.decode("utf-8", "surrogateescape").partition(" ")
            if sign == "+":
                roots.add(root)
            else:
                roots.discard(root)
    for root in roots:
        remove_sandbox(root)
    remove_stale_sandboxes([scorer], group_bases)


if __name__ == "__main__" and sys.argv[1:2] == [WATCHER_NAME]:  # the watcher: `python -c`
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scorer's Ctrl-C is not for it
    supervise(int(sys.argv[2]), sys.argv[3:])
