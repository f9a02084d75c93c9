"""Control groups for sandboxes: each sandbox's processes in groups of its own, killed as a
whole and held to one memory limit, where the host lets the scorer make groups.

:func:`support` probes once per process: a cgroup v2 group gives ``cgroup.kill`` (Linux
5.14) and, with the memory controller, ``memory.max``; a cgroup v1 memory hierarchy gives
``memory.limit_in_bytes`` (and a kill by listing the group's processes). The sandbox's
trusted prologue joins its groups (:attr:`Groups.procs_files`) before any untrusted code
runs. Without groups the sandbox falls back to its process group and uid
(``docs/rewards.md``, "The sandbox").
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import secrets
import subprocess
import sys

from policyopt.rewards.sandbox import reaper


@dataclasses.dataclass(frozen=True)
class Support:
    """Where this process can make sandbox groups (None: nowhere).

    Attributes:
      v2_base: a cgroup v2 directory under which each sandbox gets a group.
      v2_memory: the v2 groups take ``memory.max``.
      v1_memory_base: a cgroup v1 memory directory under which each sandbox gets a group.
    """

    v2_base: str | None = None
    v2_memory: bool = False
    v1_memory_base: str | None = None

    @property
    def kills(self) -> bool:
        """Whether each sandbox's processes are killed as a group."""
        return self.v2_base is not None or self.v1_memory_base is not None

    @property
    def limits_memory(self) -> bool:
        """Whether each sandbox's processes share one memory limit."""
        return self.v2_memory or self.v1_memory_base is not None

    def bases(self) -> list[str]:
        """The directories holding the sandboxes' groups."""
        return [base for base in (self.v2_base, self.v1_memory_base) if base is not None]


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """``(mount point, root, file system type, super options)`` of the cgroup mounts."""
    mounts = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                dash = fields.index("-")
                kind = fields[dash + 1]
                if kind in ("cgroup", "cgroup2"):
                    options = set(fields[dash + 3].split(",")) if len(fields) > dash + 3 else set()
                    mounts.append((fields[4], fields[3], kind, options))
    except (OSError, ValueError):
        pass
    return mounts


def _own_groups() -> dict[str, str]:
    """This process's group path per hierarchy: ``""`` for v2, controller names for v1."""
    groups = {}
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for name in controllers.split(",") if controllers else [""]:
                    groups[name] = path
    except (OSError, ValueError):
        pass
    return groups


def _inside(mount_point: str, mount_root: str, path: str) -> str | None:
    """The directory of group ``path`` in a hierarchy mounted at ``mount_point`` from
    ``mount_root``, or None when the mount does not show it."""
    relative = os.path.relpath(path, mount_root)
    if relative.startswith(".."):
        return None
    return os.path.normpath(os.path.join(mount_point, relative))


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _can_join(group: str) -> bool:
    """Whether a new process can move itself into ``group`` (a probe process)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            "import os, sys\nopen(sys.argv[1], 'w').write(str(os.getpid()))",
            os.path.join(group, "cgroup.procs"),
        ],
        capture_output=True,
        timeout=30,
        start_new_session=True,
    )
    return probe.returncode == 0


def _probe_base(parent: str, check) -> str | None:
    """``parent/policyopt-sandbox`` when a group made in it passes ``check(group)`` and can
    be joined, else None."""
    base = os.path.join(parent, reaper.SANDBOX_GROUPS)
    probe = os.path.join(base, f"{os.getpid()}-probe-{secrets.token_hex(3)}")
    try:
        os.makedirs(probe)
    except OSError:
        return None
    try:
        return base if check(probe) and _can_join(probe) else None
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        reaper.remove_group(probe)


def _v2_memory(base: str) -> bool:
    """Enables the memory controller for ``base``'s children where its parent has it."""
    parent = os.path.dirname(base)
    if "memory" not in _read(os.path.join(parent, "cgroup.controllers")).split():
        return False
    if "memory" not in _read(os.path.join(parent, "cgroup.subtree_control")).split():
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")  # EBUSY if populated
    control = os.path.join(base, "cgroup.subtree_control")
    return "memory" in _read(control).split() or _write(control, "+memory")


@functools.cache
def support() -> Support:
    """What this host allows (probed once per process; moves nothing but probe processes)."""
    mounts, own = _mounts(), _own_groups()
    v2_base, v2_memory = None, False
    if "" in own:
        candidates = []
        for point, root, kind, _ in mounts:
            if kind == "cgroup2":
                mine = _inside(point, root, own[""])
                candidates += [d for d in (mine, _inside(point, root, root)) if d]
        for parent in dict.fromkeys(candidates):
            base = _probe_base(parent, lambda g: os.path.exists(os.path.join(g, "cgroup.kill")))
            if base is None:
                continue
            memory = _v2_memory(base)
            if v2_base is None or memory:
                v2_base, v2_memory = base, memory
            if memory:
                break
    v1_memory_base = None
    if not v2_memory and "memory" in own:
        for point, root, kind, options in mounts:
            mine = _inside(point, root, own["memory"]) if "memory" in options else None
            if kind == "cgroup" and mine:
                v1_memory_base = _probe_base(
                    mine, lambda g: _write(os.path.join(g, "memory.limit_in_bytes"), str(1 << 30))
                )
                if v1_memory_base:
                    break
    return Support(v2_base, v2_memory, v1_memory_base)


_COUNTER = itertools.count()


class Groups:
    """The control groups of one sandbox, made at construction: ``procs_files`` for its
    prologue to join, ``memory_exceeded`` after the run, ``kill`` and ``remove``.

    Args:
      memory_bytes: the limit of all the sandbox's processes together (None: none).
    """

    def __init__(self, memory_bytes: int | None):
        found = support()
        name = f"{os.getpid()}-{next(_COUNTER)}-{secrets.token_hex(3)}"
        self.dirs: list[str] = []
        self.memory_files: list[tuple[str, str]] = []  # (file, its "oom_kill" counter)
        try:
            if found.v2_base is not None:
                group = os.path.join(found.v2_base, name)
                os.mkdir(group)
                self.dirs.append(group)
                if found.v2_memory and memory_bytes is not None:
                    self._limit(group, "memory.max", memory_bytes)
                    _write(os.path.join(group, "memory.swap.max"), "0")
                    self.memory_files.append((os.path.join(group, "memory.events"), "oom_kill"))
            if found.v1_memory_base is not None:
                group = os.path.join(found.v1_memory_base, name)
                os.mkdir(group)
                self.dirs.append(group)
                if memory_bytes is not None:
                    self._limit(group, "memory.limit_in_bytes", memory_bytes)
                    _write(os.path.join(group, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                    self.memory_files.append(
                        (os.path.join(group, "memory.oom_control"), "oom_kill")
                    )
        except BaseException:
            self.remove()
            raise

    @staticmethod
    def _limit(group: str, name: str, value: int) -> None:
        if not _write(os.path.join(group, name), str(value)):
            raise OSError(f"cannot set {name} of the sandbox's control group {group}")

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files the sandbox's first process writes its pid to."""
        return [os.path.join(group, "cgroup.procs") for group in self.dirs]

    def memory_exceeded(self) -> bool:
        """Whether the kernel killed a process of the sandbox for the group's memory limit."""
        for path, key in self.memory_files:
            for line in _read(path).splitlines():
                name, _, count = line.partition(" ")
                if name == key and count.strip().isdigit() and int(count) > 0:
                    return True
        return False

    def kill(self) -> None:
        """SIGKILLs every process of the sandbox (``setsid`` or not) and waits for them."""
        for group in self.dirs:
            reaper.kill_group(group)

    def remove(self) -> None:
        """Kills what is left and removes the groups."""
        for group in self.dirs:
            reaper.remove_group(group)
        self.dirs = []
