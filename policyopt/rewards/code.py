"""Code correctness: the completion's first fenced code block run against tests in a sandbox.

Tests (``tests`` argument) follow two conventions:

* a string of Python statements, typically ``assert``s (HumanEval / MBPP). A test passes
  when the tests ran to their end. By default (``isolation="process"``) they run in a
  process of their own, joined by pipes to the process that runs the program
  (:func:`run_isolated`, ``policyopt.rewards.isolation``): each name the program
  defined reaches the tests as a plain value (numbers, strings, containers, ...) or as
  a stand-in that forwards calls to the program's process, whose results cross as
  plain values too; the tests' process writes a random marker when they have run, and
  the scorer requires it. So a program cannot pass by exiting early, by returning an
  object whose ``__eq__`` always says True, by redefining a built-in the tests compare
  with, or by finding the marker (it is in another process, of another uid when the
  scorer is root). ``isolation.py``'s docstring lists what honest programs lose (their
  objects compared with ``==``, callbacks from the tests, globals read after a call).
  With ``isolation="none"`` the program and then the tests run in one process, in a
  fresh namespace, with ``exec`` and ``compile`` bound before the program runs; the
  program's own ``SystemExit`` is caught and the marker is written to a copy of the
  stdout descriptor after the tests. That stops exits and shadowed ``exec``, not a
  program that inspects its callers' frames (``sys._getframe``) to find the marker,
  returns an object equal to everything, or monkeypatches what the tests use: use it
  only for trusted programs (it starts one interpreter per test instead of two).
  unittest / pytest tests are refused: their failures are reported, not raised. The
  program runs as ``__main__`` with empty stdin and no ``__file__``, and its output is
  capped at ``max_output_bytes``. All-or-nothing: one run for the whole string. With
  partial credit, the top-level ``assert`` statements are split (``ast.parse`` of the
  trusted test string; nothing is evaluated in this process) and each runs on its own
  against a fresh run of the program, after the non-assert statements (imports, helpers);
* a list of ``{"input": str, "output": str}`` cases (competitive programming): the program
  reads ``input`` on stdin; a case passes when it exits with status 0 and its stdout
  equals ``output`` after stripping trailing blanks of every line and blank lines at both
  ends.

Datasets store tests in other shapes; :func:`parse_tests` brings each to one of the two
(MBPP's list of asserts, HumanEval's ``check(candidate)`` with its entry point, APPS's
``input_output`` and CodeContests' ``public_tests`` parallel lists, any of them as JSON
text), and the trainers' code tasks keep them as JSON text in their records.

Only Python is run: the first fenced block with a language tag (Magistral's format) must
be tagged ``python``, ``py`` or ``python3``; any other language scores 0. Magistral: 20
tests, 4 s and 300 MB per test, binary reward (partial credit hurt).

The sandbox (:func:`run_sandboxed`), per test process:

* a fresh temporary directory as working directory (deleted afterwards), holding the
  program, of at most ``disk_mb`` (``reward.code_disk_mb``, default 64 MB) and
  ``MAX_FILES`` files: in a jail (below) it is a tmpfs of that size (writes past it fail
  with ``ENOSPC`` in the program; nothing reaches the host's disk); without one it is on
  the host's disk, polled every 20 ms by the scorer, which kills the program once it
  holds more (``SandboxResult.disk_exceeded``; what it wrote in between, at most one
  poll's worth, is removed with the directory); stdin from a file; stdout and stderr to
  files outside that directory, which only the scorer may open (mode 0600: the child gets
  them as descriptors, and no other run's program reads this run's input or its tests'
  assert messages);
* a cleared environment (only ``PATH``), and an isolated interpreter ``python -I -S``
  (no ``PYTHON*`` variables, no user or site packages: the standard library only);
* resource limits set by a trusted prologue in the child before any untrusted code runs
  (``-c`` bootstrap; this avoids ``preexec_fn``, which is unsafe in a multithreaded parent
  such as a JAX process): ``RLIMIT_CPU`` (the time limit, rounded up), ``RLIMIT_AS``
  (``memory_mb``), ``RLIMIT_NPROC`` (``max_processes``), ``RLIMIT_FSIZE``
  (``max_output_bytes``: caps files and stdout), ``RLIMIT_NOFILE`` 64, ``RLIMIT_CORE`` 0,
  soft = hard so the program cannot raise them;
* when the scorer runs as root: the child drops to a fresh unprivileged uid/gid (a random
  one of ``_SANDBOX_UIDS``) that owns only the working directory. That makes
  ``RLIMIT_NPROC`` effective (the kernel does not apply it to root) and private to this
  run, keeps the program out of files it does not own (outside the working directory it
  can write only to world-writable places such as ``/tmp``, and at most
  ``max_output_bytes`` per file), and lets the reaper kill every process of that uid,
  including ones that escaped the process group with ``setsid``;
* a root of its own, when the scorer is root and mount namespaces work (probed once,
  ``_jail_works``; not in every container): ``unshare --mount``, then the bootstrap
  mounts a tmpfs as the new root holding read-only binds of ``/usr`` (and ``/bin``,
  ``/lib``..., or the interpreter's own folder), ``/dev/null``, ``zero``, ``random``,
  ``urandom``, a fresh ``/tmp`` and ``/dev/shm`` and a working directory ``/work`` (three
  tmpfs of ``disk_mb`` each: memory, not disk), and ``chroot``s into it before dropping
  privileges. So the program reads
  nothing of the host's (no dataset file, no ``/proc`` of the scorer, no other run's
  files) and leaves nothing for later runs (its ``/tmp`` dies with it). Without it (a
  non-root scorer, a container without mounts) the program reads what every user may
  read and may leave files in the host's ``/tmp`` (each at most ``max_output_bytes``,
  ``RLIMIT_FSIZE``, but their number is not bounded there: only the working directory
  is watched): keep answer files unreadable to other users there;
* network: when ``unshare --net`` works (root, or unprivileged user namespaces) the
  child runs in a fresh network namespace with no interface but a down loopback; where it
  does not, the program keeps the host network (this is the case for a non-root scorer
  on hosts without user namespaces: use a container or nsjail/gVisor there);
* a wall-clock limit (``timeout_s`` plus ``_STARTUP_GRACE_S`` for interpreter start); on
  expiry the whole process group is killed with ``SIGKILL``, then the uid is reaped;
* the child asks the kernel to ``SIGKILL`` it when the scorer dies (``PR_SET_PDEATHSIG``),
  so a scoring worker killed at a batch deadline does not leave its test running. (Its
  own forked children are bounded by the process and CPU limits, not by this signal.)

Without root (no uid switch) the process limit counts all of the user's processes
(the limit is set to the current count plus ``max_processes``), files the user can write
are writable by the program, and children that call ``setsid()`` escape the group kill
(they still die at their CPU limit unless they sleep): the sandbox is then a resource
guard, not a security boundary.

Working directories are named ``policyopt-sandbox-<scorer pid>-*``; those of a scorer
that died mid-test (a worker killed at a batch deadline) are removed by
:func:`remove_stale_sandboxes`, which the pool calls after killing workers and every
scorer process calls once before its first sandbox.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from policyopt.rewards.format import first_code_block
from policyopt.rewards.math import answer_region

PYTHON_TAGS = ("python", "py", "python3")
ISOLATIONS = ("process", "none")
DEFAULT_MAX_PROCESSES = 16
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20
# Size of the working directory, /tmp and /dev/shm (MB; `reward.code_disk_mb`).
DEFAULT_DISK_MB = 64
# Files a program may create in its working directory without a jail (with one: the
# tmpfs's inode limit).
MAX_FILES = 4096
# Without a jail the working directory's size is polled this often (s).
_DISK_POLL_S = 0.02
# Interpreter start-up allowance added to the wall-clock limit, seconds.
_STARTUP_GRACE_S = 0.5
# Unprivileged uids used when the scorer runs as root (unlikely to belong to anyone).
_SANDBOX_UIDS = range(2_000_000, 2_100_000)

# Trusted prologue run by the child interpreter before the untrusted program.
_BOOTSTRAP = """
import os, resource, sys
cpu_s, memory, nproc, fsize, uid, parent, disk = (int(a) for a in sys.argv[1:8])
jail, prefix = sys.argv[8:10]
if jail:  # a root of its own, in the mount namespace `unshare --mount` made (see _JAIL)
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def mount(source, target, kind, flags, data=None):
        names = [None if name is None else name.encode() for name in (source, target, kind)]
        if libc.mount(*names, flags, None if data is None else data.encode()) != 0:
            sys.stderr.write(f"sandbox: mount {target}: {os.strerror(ctypes.get_errno())}\\n")
            os._exit(125)

    def bind(host, read_only=True):
        target = jail + host
        if os.path.isdir(host):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        mount(host, target, None, 4096 | 16384)  # MS_BIND | MS_REC
        if read_only:  # MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
            mount(None, target, None, 32 | 4096 | 1 | 2 | 4)

    mount(None, "/", None, 16384 | (1 << 18))  # MS_REC | MS_PRIVATE: nothing reaches the host
    mount("tmpfs", jail, "tmpfs", 2 | 4, "size=1m,mode=755")
    for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), jail + "/" + name)
        elif os.path.isdir("/" + name):
            bind("/" + name)
    bind("/usr")
    if prefix and not os.path.exists(jail + prefix):
        bind(prefix)  # an interpreter installed outside /usr
    for device in ("null", "zero", "random", "urandom"):
        bind("/dev/" + device, read_only=False)
    for scratch in ("/tmp", "/dev/shm"):
        os.makedirs(jail + scratch)
        mount("tmpfs", jail + scratch, "tmpfs", 2 | 4, f"size={disk},mode=1777")
    # The working directory is a tmpfs of `disk` bytes too, not the host's disk: the
    # program (read from the host's copy, which is removed) goes in alone.
    os.makedirs(jail + "/work")
    owner = f",uid={uid},gid={uid}" if uid >= 0 else ""
    mount("tmpfs", jail + "/work", "tmpfs", 2 | 4, f"size={disk},nr_inodes=4096,mode=700{owner}")
    with open("main.py", "rb") as f:
        source = f.read()
    os.remove("main.py")
    with open(jail + "/work/main.py", "wb") as f:
        f.write(source)
    if uid >= 0:
        os.chown(jail + "/work/main.py", uid, uid)
    os.chroot(jail)
    os.chdir("/work")
    del libc, mount, bind, ctypes, owner, source, f
for limit, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 64),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NPROC, nproc),
                     (resource.RLIMIT_AS, memory)):
    resource.setrlimit(limit, (value, value))
# SIGXCPU at the time limit; SIGKILL one second later if the program ignores it.
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
if uid >= 0:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
try:  # die with the scorer (PR_SET_PDEATHSIG = 1; cleared by setuid, so set after it)
    import ctypes
    ctypes.CDLL(None).prctl(1, 9)
    del ctypes
except Exception:
    pass
if os.getppid() != parent:
    os._exit(137)
sys.argv = ["main.py"]


def run(remove=os.remove):
    # Read, delete and run main.py in this frame: the harness's marker is in its text,
    # which then sits in no file and no module attribute.
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    remove("main.py")
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


del os, resource, cpu_s, memory, nproc, fsize, uid, parent, limit, value, jail, prefix, disk
run()
"""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """One sandboxed run.

    Attributes:
      returncode: exit status (negative: killed by that signal; None: wall timeout).
      stdout: captured standard output (at most ``max_output_bytes``), decoded.
      stderr: captured standard error (same cap), decoded.
      timed_out: the wall-clock limit expired.
      uid: the unprivileged uid the program ran as (-1: the scorer's own, not root).
      disk_exceeded: killed for filling its working directory (without a jail; in one,
        writes past the tmpfs's size fail with ``ENOSPC`` in the program instead).
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    uid: int = -1
    disk_exceeded: bool = False


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """Outcome of :func:`run_code_tests`.

    Attributes:
      passed: number of test cases passed.
      total: number of test cases (1 for an all-or-nothing assert string).
      status: "correct", "incorrect", "timeout" (a test hit the wall-clock limit),
        "no_code" (no Python block), "no_tests".
    """

    passed: int
    total: int
    status: str

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total


@functools.cache
def _is_root() -> bool:
    return os.geteuid() == 0


@functools.cache
def _unshare_prefix() -> tuple[str, ...]:
    """``("unshare", "--net", "--")`` when creating a network namespace works here."""
    unshare = shutil.which("unshare") or (
        "/usr/bin/unshare" if os.path.exists("/usr/bin/unshare") else None
    )
    if unshare is None:
        return ()
    for flags in (("--net",), ("--net", "--map-root-user")):
        try:
            probe = subprocess.run(
                [unshare, *flags, "--", "true"], capture_output=True, timeout=10, env={}
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return (unshare, *flags, "--")
    return ()


@functools.cache
def _sandbox_python() -> str:
    """An interpreter whose standard library the unprivileged sandbox uid can read.

    The scorer's own interpreter may live in a private directory (e.g. a pyenv build in
    root's home directory); candidates are probed by importing a few stdlib modules as a
    sandbox uid, and the first that works is used. Programs therefore run on the standard
    library of that interpreter, which may be another Python 3 version than the scorer's.
    """
    candidates = [os.path.realpath(sys.executable)]
    for name in ("python3", f"python{sys.version_info.major}.{sys.version_info.minor}"):
        for folder in ("/usr/bin", "/usr/local/bin"):
            path = os.path.join(folder, name)
            if os.path.exists(path):
                candidates.append(os.path.realpath(path))
    if not _is_root():
        return candidates[0]
    probe = (
        "import collections, functools, heapq, itertools, json, math, re, string, sys\n"
        "print('ok')\n"
    )
    for candidate in dict.fromkeys(candidates):
        result = run_sandboxed(probe, timeout_s=10.0, python=candidate)
        if result.returncode == 0 and result.stdout.strip() == "ok":
            return candidate
    return candidates[0]


def _count_processes(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:
                pass
    return count


def _live_processes(uid: int) -> list[int]:
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


def _reap_uid(uid: int) -> None:
    """SIGKILLs every live process owned by ``uid`` until none is left (fork races included)."""
    for _ in range(200):
        pids = _live_processes(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.002)


_SANDBOX_PREFIX = "policyopt-sandbox-"


def _pid_alive(pid: int) -> bool:
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
        if not entry.name.startswith(_SANDBOX_PREFIX):
            continue
        owner = entry.name[len(_SANDBOX_PREFIX) :].split("-", 1)[0]
        if not owner.isdigit():
            continue
        pid = int(owner)
        stale = pid in pids if pids is not None else (pid != os.getpid() and not _pid_alive(pid))
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed


@functools.cache
def _sweep_once() -> None:
    remove_stale_sandboxes()


class _Sandbox:
    """One sandboxed process, started at construction: its directory, files, uid and
    ``Popen``; ``wait`` then ``finish`` (kill, reap, read the output), ``close`` always."""

    def __init__(
        self,
        program: str,
        *,
        stdin: str,
        timeout_s: float,
        memory_mb: int,
        max_processes: int,
        max_output_bytes: int,
        python: str | None,
        uid: int,
        pass_fds: tuple[int, ...] = (),
        jail: bool | None = None,
        disk_mb: int = DEFAULT_DISK_MB,
    ):
        self.uid, self.max_output_bytes, self.files, self.process = uid, max_output_bytes, [], None
        self.disk_bytes, self.disk_exceeded, self.jailed = disk_mb << 20, False, False
        self.root = tempfile.mkdtemp(prefix=f"{_SANDBOX_PREFIX}{os.getpid()}-")
        try:
            os.chmod(self.root, 0o711)
            workdir = self.workdir = os.path.join(self.root, "work")
            os.mkdir(workdir, 0o700)
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(program)
            if uid >= 0:
                os.chown(workdir, uid, uid)
                os.chown(os.path.join(workdir, "main.py"), uid, uid)
                nproc = max_processes
            else:
                nproc = _count_processes(os.getuid()) + max_processes
            # The run's files are the scorer's alone (0600): the child gets them as open
            # descriptors, and another run's program cannot read this one's tests' output.
            stdin_path = os.path.join(self.root, "stdin")
            with open(_private(stdin_path), "w", encoding="utf-8") as f:
                f.write(stdin)
            python = python or _sandbox_python()
            jail_dir = ""
            if jail or (jail is None and _jail_works(python)):
                jail_dir = os.path.join(self.root, "jail")
                os.mkdir(jail_dir, 0o755)
                self.jailed = True
            prefix = _interpreter_prefix(python)
            command = [
                *(_jail_prefix() if jail_dir else _unshare_prefix()),
                python, "-I", "-S", "-c", _BOOTSTRAP,
                str(max(1, int(-(-timeout_s // 1)))), str(memory_mb << 20), str(nproc),
                str(max_output_bytes), str(uid), str(os.getpid()), str(self.disk_bytes), jail_dir,
                prefix,
            ]  # fmt: skip
            self.files.append(open(stdin_path, "rb"))
            for name in ("stdout", "stderr"):  # one at a time: close() closes what is open
                self.files.append(open(_private(os.path.join(self.root, name)), "w+b"))
            self.process = subprocess.Popen(
                command,
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin"},
                stdin=self.files[0],
                stdout=self.files[1],
                stderr=self.files[2],
                start_new_session=True,
                close_fds=True,
                pass_fds=pass_fds,
            )
        except BaseException:
            self.close()
            raise

    def wait(self, timeout_s: float, watch: Sequence["_Sandbox"] = ()) -> int | None:
        """The exit status, or None when the wall-clock limit expired first.

        Without a jail the working directories of this sandbox and of ``watch`` (the
        program's process of an isolated test) are polled meanwhile: one that holds more
        than ``disk_mb`` or ``MAX_FILES`` files has its process group killed
        (``disk_exceeded``).
        """
        polled = [box for box in (self, *watch) if not box.jailed]
        if not polled:
            try:
                return self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return None
        deadline = time.monotonic() + timeout_s
        while True:
            for box in polled:
                if not box.disk_exceeded and box.process.poll() is None and box.over_disk_limit():
                    box.disk_exceeded = True
                    _kill_group(box.process.pid)
            try:
                left = deadline - time.monotonic()
                return self.process.wait(timeout=max(0.0, min(_DISK_POLL_S, left)))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    return None

    def over_disk_limit(self) -> bool:
        """Whether the working directory holds more than ``disk_mb`` (allocated blocks) or
        ``MAX_FILES`` entries (a scan that stops as soon as either is passed)."""
        used, count, stack = 0, 0, [self.workdir]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except OSError:
                continue
            for entry in entries:
                count += 1
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                used += info.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                if used > self.disk_bytes or count > MAX_FILES:
                    return True
        return False

    def finish(self, returncode: int | None) -> SandboxResult:
        """Kills what is left of the run (group, then uid) and reads its output."""
        if not self.jailed and not self.disk_exceeded and self.over_disk_limit():
            # Filled between two polls, or after the last one (the run ended first): a
            # fast program can write MAX_FILES empty files within one poll's interval.
            self.disk_exceeded = True
        # On an idle machine a busy loop reaches its CPU-time limit (= the time limit)
        # before the wall-clock one: killed by SIGXCPU (or SIGKILL at the hard limit),
        # which is a timeout too.
        timed_out = not self.disk_exceeded and (
            returncode is None or returncode in (-signal.SIGXCPU, -signal.SIGKILL)
        )
        _kill_group(self.process.pid)
        if self.uid >= 0:
            _reap_uid(self.uid)
        self.process.wait()
        outputs = []
        for f in self.files[1:]:
            f.seek(0)
            outputs.append(f.read(self.max_output_bytes).decode("utf-8", errors="replace"))
        if self.disk_exceeded:
            outputs[1] += (
                f"\nsandbox: killed: the working directory passed "
                f"{self.disk_bytes >> 20} MB or {MAX_FILES} files\n"
            )
        return SandboxResult(
            returncode, outputs[0], outputs[1], timed_out, self.uid, self.disk_exceeded
        )

    def close(self) -> None:
        if self.process is not None and self.process.returncode is None:
            _kill_group(self.process.pid)
            if self.uid >= 0:
                _reap_uid(self.uid)
            self.process.wait()
        for f in self.files:
            f.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _private(path: str) -> int:
    """A new file only its owner can read or write, opened for writing (a descriptor)."""
    return os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)


def _interpreter_prefix(python: str) -> str:
    """The installation folder of an interpreter outside /usr (``/opt/python3.11`` for
    ``/opt/python3.11/bin/python3``), which the jail must hold too; "" under /usr."""
    real = os.path.realpath(python)
    return "" if real.startswith("/usr/") else os.path.dirname(os.path.dirname(real))


@functools.cache
def _jail_prefix() -> tuple[str, ...]:
    """``("unshare", "--net", "--mount", "--")`` when the scorer is root and that works."""
    net = _unshare_prefix()
    if not _is_root() or not net or "--map-root-user" in net:
        return ()
    probe = subprocess.run(
        [net[0], "--net", "--mount", "--", "true"], capture_output=True, timeout=10, env={}
    )
    return (net[0], "--net", "--mount", "--") if probe.returncode == 0 else ()


@functools.cache
def _jail_works(python: str) -> bool:
    """Whether programs can run in a root of their own here (root, a mount namespace,
    mounts allowed in it: not in every container), probed once per interpreter."""
    if not _jail_prefix():
        return False
    sandbox = _Sandbox(
        "import json, math, re\nprint('ok')\n",
        stdin="",
        timeout_s=10.0,
        memory_mb=300,
        max_processes=DEFAULT_MAX_PROCESSES,
        max_output_bytes=1 << 16,
        python=python,
        uid=_sandbox_uids(1)[0],
        jail=True,
    )
    try:
        result = sandbox.finish(sandbox.wait(10.0 + _STARTUP_GRACE_S))
    finally:
        sandbox.close()
    return result.returncode == 0 and result.stdout.strip() == "ok"


def _sandbox_uids(count: int) -> list[int]:
    """``count`` distinct throw-away uids when the scorer is root, else -1 each."""
    return random.sample(_SANDBOX_UIDS, count) if _is_root() else [-1] * count


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
    """Runs untrusted Python source in the sandbox described in the module docstring.

    ``disk_mb``: size of the working directory (and of ``/tmp`` and ``/dev/shm`` in a
    jail). ``jail``: None uses a root of its own where that works; False runs without
    one (the fallback of a non-root scorer, for tests).
    """
    _sweep_once()
    sandbox = _Sandbox(
        program,
        stdin=stdin,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_processes=max_processes,
        max_output_bytes=max_output_bytes,
        python=python,
        uid=_sandbox_uids(1)[0],
        disk_mb=disk_mb,
        jail=jail,
    )
    try:
        return sandbox.finish(sandbox.wait(timeout_s + _STARTUP_GRACE_S))
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
    (``policyopt.rewards.isolation``): the program's process serves the tests' process,
    which writes ``marker`` when the tests ran to their end. Each process has the limits
    of :func:`run_sandboxed` and its own uid; the wall-clock limit covers both.

    Returns:
      The tests' process's result; ``timed_out`` also when the program's process hit
      its CPU limit.
    """
    _sweep_once()
    limits = dict(
        stdin="",
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_processes=max_processes,
        max_output_bytes=max_output_bytes,
        python=python,
        disk_mb=disk_mb,
        jail=jail,
    )
    server_uid, client_uid = _sandbox_uids(2)
    sandboxes, requests_r, requests_w, replies_r, replies_w = [], -1, -1, -1, -1
    try:
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        sandboxes.append(
            _Sandbox(
                f"{_isolation_source()}\nserve({program!r}, {requests_r}, {replies_w})\n",
                uid=server_uid,
                pass_fds=(requests_r, replies_w),
                **limits,
            )
        )
        sandboxes.append(
            _Sandbox(
                f"{_isolation_source()}\nrun_tests({tests!r}, {marker!r}, {replies_r}, "
                f"{requests_w})\n",
                uid=client_uid,
                pass_fds=(replies_r, requests_w),
                **limits,
            )
        )
        for fd in (requests_r, requests_w, replies_r, replies_w):
            os.close(fd)
        requests_r = requests_w = replies_r = replies_w = -1
        server, client = sandboxes
        returncode = client.wait(timeout_s + _STARTUP_GRACE_S, watch=[server])
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
def _isolation_source() -> str:
    """The source of ``policyopt.rewards.isolation``, which both sandboxes run."""
    from policyopt.rewards import isolation

    with open(isolation.__file__, encoding="utf-8") as f:
        return f.read()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _lines(value: Any, what: str) -> str:
    """A stdin / stdout text: a string, a number, or a list of lines (joined by newlines)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (list, tuple)) and all(isinstance(line, str) for line in value):
        return "\n".join(value)
    raise ValueError(
        f"a test case's {what} must be text, a number or a list of lines, "
        f"got {type(value).__name__}"
    )


def _check_runnable(tests: str) -> None:
    """Raises ``ValueError`` unless ``tests`` is Python that can fail: a string that does not
    parse (a math answer such as ``\\frac12``, a compressed blob) would fail every
    program, and one whose top level neither asserts, raises nor calls anything (``34``;
    ``def test_x(): assert ...`` never called) would pass every program."""
    try:
        tree = ast.parse(tests)
    except SyntaxError as error:
        raise ValueError(f"the tests are not Python ({error.msg}, line {error.lineno})") from None
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if any(name.split(".")[0] in ("unittest", "pytest") for name in names):
            raise ValueError(
                "unittest / pytest tests are not supported: their failures are reported, "
                "not raised (write them as asserts)"
            )
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if any(isinstance(sub, (ast.Assert, ast.Raise, ast.Call)) for sub in ast.walk(node)):
            return
    if any(
        isinstance(node, ast.FunctionDef) and node.name.startswith("test") for node in tree.body
    ):
        raise ValueError(
            "pytest-style tests (def test_...) are not run: call them at the top level of the "
            "tests, or write them as asserts"
        )
    raise ValueError(
        "the tests cannot fail: nothing at their top level asserts, raises or calls "
        "(every program would pass)"
    )


def _calls_check(tests: str) -> bool:
    """Whether a test string calls ``check`` outside ``def check`` (``ast.parse`` of the
    trusted tests: nothing is evaluated)."""
    try:
        tree = ast.parse(tests)
    except SyntaxError:
        return re.search(r"^check\(", tests, re.M) is not None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            continue
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Call)
                and isinstance(sub.func, ast.Name)
                and sub.func.id == "check"
            ):
                return True
    return False


# Keys that mark call-based cases (the function's arguments and return value, not stdin and
# stdout): APPS's fn_name, LiveCodeBench's testtype "functional" (DeepCoder's rows),
# PrimeIntellect's type "function_call".
_CALL_BASED = ("fn_name", "func_name")


def _refuse_call_based(tests: dict) -> None:
    if (
        any(tests.get(key) for key in _CALL_BASED)
        or tests.get("type") == "function_call"
        or (tests.get("testtype") not in (None, "stdin"))
    ):
        raise ValueError(
            "call-based tests (fn_name / testtype 'functional' / type 'function_call') are not "
            "supported: the cases must be stdin / stdout"
        )


def parse_tests(tests: Any, *, entry_point: str | None = None) -> str | list[dict[str, str]]:
    """Tests in any of the encodings datasets use, as :func:`run_code_tests` takes them.

    - A string of Python statements (asserts; HumanEval, MBPP's ``test``): as it is. A
      string holding JSON text (an array, an object or a string: ``"[...]"``) is decoded
      first and read by these rules; a string that is not valid JSON is Python.
    - A list of strings (MBPP's ``test_list``): the statements, one per line.
    - A list of ``{"input": ..., "output": ...}`` cases: stdin / expected stdout; either
      may be a number or a list of lines.
    - An object of parallel lists, ``{"inputs": [...], "outputs": [...]}`` (APPS's
      ``input_output``) or ``{"input": [...], "output": [...]}`` (CodeContests'
      ``public_tests``): the cases, in order; or with a ``test_cases`` list
      (PrimeIntellect's ``verification_info``): those cases.

    Args:
      tests: the tests, in one of those encodings.
      entry_point: HumanEval's function name: a test string that defines
        ``check(candidate)`` and never calls it gets ``check(<entry_point>)`` appended.

    Returns:
      An assert string, or a list of ``{"input": str, "output": str}`` dicts.

      Empty tests stay empty (``run_code_tests`` reports "no_tests" for an empty list).

    Raises:
      ValueError: an encoding not listed above; call-based cases (APPS's ``fn_name``,
        LiveCodeBench's ``testtype: "functional"``, ``type: "function_call"``: the
        function's arguments and return value instead of stdin / stdout); a
        ``check(candidate)`` that is never called and no ``entry_point``; a test string
        that is not Python, or whose top level neither asserts, raises nor calls
        anything (it would fail, or pass, every program).
    """
    if isinstance(tests, str):
        text = tests.strip()
        if text[:1] in ("[", "{", '"'):
            try:
                decoded = json.loads(text)
            except json.JSONDecodeError:
                decoded = None
            if decoded is not None:
                return parse_tests(decoded, entry_point=entry_point)
        if not text:
            return tests
        if re.search(r"^def check\(", tests, re.M) and not _calls_check(tests):
            if not entry_point:
                raise ValueError(
                    "the tests define check(candidate) but never call it, and no entry_point "
                    "names the function to check (every program would pass)"
                )
            if not entry_point.isidentifier():
                raise ValueError(f"entry_point {entry_point!r} is not a Python name")
            tests = tests.rstrip() + f"\n\n\ncheck({entry_point})\n"
        _check_runnable(tests)
        return tests
    if isinstance(tests, dict):
        _refuse_call_based(tests)
        if isinstance(tests.get("test_cases"), (list, tuple)):  # PrimeIntellect's verification_info
            return parse_tests(tests["test_cases"], entry_point=entry_point)
        inputs = tests.get("inputs", tests.get("input"))
        outputs = tests.get("outputs", tests.get("output"))
        if not isinstance(inputs, (list, tuple)) or not isinstance(outputs, (list, tuple)):
            raise ValueError(
                "a tests object needs parallel lists 'inputs' / 'outputs' (or 'input' / 'output'), "
                f"got keys {sorted(tests)[:6]}"
            )
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if isinstance(tests, (list, tuple)):
        if not tests:
            return []
        if all(isinstance(t, str) for t in tests):
            return parse_tests("\n".join(tests), entry_point=entry_point)
        if all(isinstance(t, dict) for t in tests):
            cases = []
            for case in tests:
                _refuse_call_based(case)
                if "input" not in case or "output" not in case:
                    raise ValueError(
                        f"a test case needs 'input' and 'output', got keys {sorted(case)[:6]}"
                    )
                cases.append(
                    {
                        "input": _lines(case["input"], "input"),
                        "output": _lines(case["output"], "output"),
                    }
                )
            return cases
        raise ValueError(
            "a list of tests must hold only assert strings or only {input, output} cases"
        )
    raise ValueError(f"tests must be text, a list or an object, got {type(tests).__name__}")


def _assert_harness(program: str, tests: str, marker: str) -> str:
    """The source run for assert tests: the program (its own ``SystemExit`` caught), then
    the tests, in a fresh namespace, then ``marker`` on a line of its own, written to a
    copy of the stdout descriptor. ``exec``, ``compile`` and the writer are bound before the
    program runs, so a program that replaces them (``exec = ...``, ``builtins.exec``,
    ``sys.stdout.close()``) neither skips the tests nor hides the marker."""
    return (
        "def _policyopt_run(program, tests, marker, exec=exec, compile=compile, "
        "SystemExit=SystemExit,\n"
        "                   write=__import__('os').write, fd=__import__('os').dup(1)):\n"
        "    namespace = {'__name__': '__main__', '__builtins__': __builtins__}\n"
        "    try:\n"
        "        exec(compile(program, 'program.py', 'exec'), namespace)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    exec(compile(tests, 'tests.py', 'exec'), namespace)\n"
        "    write(fd, ('\\n' + marker + '\\n').encode())\n"
        f"_policyopt_run({program!r}, {tests!r}, {marker!r})\n"
    )


def limit_tests(
    tests: str | list[dict[str, str]], max_tests: int | None
) -> str | list[dict[str, str]]:
    """The first ``max_tests`` cases of parsed tests, or an assert string cut after its
    ``max_tests``-th top-level assert (the statements before it kept in order; asserts
    inside functions, as in HumanEval's ``check``, are not counted); None: all of them."""
    if max_tests is None:
        return tests
    if max_tests < 1:
        raise ValueError(f"max_tests must be >= 1 or None, got {max_tests}")
    if not isinstance(tests, str):
        return tests[:max_tests]
    try:
        statements = _statements(tests)
    except SyntaxError:
        return tests
    asserts = [i for i, (is_assert, _) in enumerate(statements) if is_assert]
    if len(asserts) <= max_tests:
        return tests
    cut = "\n".join(source for _, source in statements[: asserts[max_tests - 1] + 1]) + "\n"
    return cut if _parses(cut) else tests  # all of them rather than a cut that went wrong


def _statements(tests: str) -> list[tuple[bool, str]]:
    """``(is an assert, source)`` of each top-level statement of a test string, in order,
    decorators included."""
    lines = re.split(r"(?<=\n)|(?<=\r)(?!\n)", tests)  # ast's line breaks: \n, \r\n, \r only
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno: int, col: int) -> int:  # ast columns count UTF-8 bytes
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))

    statements = []
    for node in ast.parse(tests).body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        begin = starts[first - 1] if first < node.lineno else offset(node.lineno, node.col_offset)
        statements.append(
            (
                isinstance(node, ast.Assert),
                tests[begin : offset(node.end_lineno, node.end_col_offset)],
            )
        )
    return statements


def _split_asserts(tests: str) -> list[str]:
    """One source string per top-level assert of a test string: the statements before it
    that are not asserts, in order, then the assert (partial credit); and when statements
    after the last assert can fail (a loop of asserts, a ``check(f)`` call), one more
    case: every statement that is not a top-level assert, in order. A string without
    top-level asserts (HumanEval's asserts inside ``check``) is one test."""
    statements = _statements(tests)
    cases = []
    for index, (is_assert, source) in enumerate(statements):
        if is_assert:
            setup = [s for a, s in statements[:index] if not a]
            cases.append("\n".join(setup + [source]) + "\n")
    last = max((i for i, (is_assert, _) in enumerate(statements) if is_assert), default=-1)
    if cases and any(_can_fail(source) for _, source in statements[last + 1 :]):
        cases.append("\n".join(s for a, s in statements if not a) + "\n")
    if not cases or not all(_parses(case) for case in cases):
        return [tests]  # one test rather than a case the split got wrong
    return cases


def _can_fail(source: str) -> bool:
    """Whether a top-level statement can fail a test: it asserts, raises or calls
    (outside a function or class definition, which runs nothing by being defined)."""
    try:
        node = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return True
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    return any(isinstance(sub, (ast.Assert, ast.Raise, ast.Call)) for sub in ast.walk(node))


def _parses(source: str) -> bool:
    try:
        ast.parse(source)
    except SyntaxError:
        return False
    return True


def run_code_tests(
    completion: str,
    tests: str | Sequence[dict[str, Any]],
    *,
    timeout_s: float = 4.0,
    memory_mb: int = 300,
    stop_at_first_failure: bool = True,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    max_tests: int | None = None,
    isolation: str = "process",
    disk_mb: int = DEFAULT_DISK_MB,
) -> CodeResult:
    """Runs the first code block of ``completion`` against ``tests``; never raises on model output.

    Args:
      completion: model output; the block is searched after ``</think>`` when present.
      tests: assert string, or list of {"input", "output"} cases, or any encoding
        :func:`parse_tests` reads (a malformed one raises ``ValueError``).
      timeout_s: wall-clock (and CPU) limit per test process.
      memory_mb: address-space limit per test process.
      stop_at_first_failure: stop once a case fails (binary reward needs no more).
      max_processes: RLIMIT_NPROC of the sandbox uid.
      max_tests: run only the first this many cases, or top-level asserts (Magistral runs
        20 tests per problem); None: all.
      isolation: where assert tests run: ``"process"`` (default) in a process of their
        own that talks to the program's process (:func:`run_isolated`,
        ``policyopt.rewards.isolation``), or ``"none"``, after the program in its process
        (one interpreter instead of two, and open to the reward hacks that module
        describes). stdin / stdout cases run the program alone either way.
      disk_mb: size of each test process's working directory (and jail's ``/tmp``).
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    tests = limit_tests(parse_tests(tests), max_tests)
    marker = secrets.token_hex(16)  # printed after the tests (assert strings), per call
    block = first_code_block(answer_region(str(completion)))
    if block is None or block[0] not in PYTHON_TAGS:
        return CodeResult(0, max(len(tests), 1) if not isinstance(tests, str) else 1, "no_code")
    program = block[1]
    limits = dict(
        timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes, disk_mb=disk_mb
    )
    if isinstance(tests, str):
        cases = [
            (test, "", None)
            for test in ([tests] if stop_at_first_failure else _split_asserts(tests))
        ]
    else:
        cases = [(program, str(case["input"]), str(case["output"])) for case in tests]
    if not cases:
        return CodeResult(0, 0, "no_tests")
    passed, any_timeout = 0, False
    for source, stdin, expected in cases:
        if expected is None and isolation == "process":
            result = run_isolated(program, source, marker, **limits)
        elif expected is None:
            result = run_sandboxed(_assert_harness(program, source, marker), **limits)
        else:
            result = run_sandboxed(source, stdin=stdin, **limits)
        any_timeout |= result.timed_out
        if expected is None:  # assert tests: they must have run to their end
            ok = result.returncode == 0 and marker in result.stdout
        else:
            ok = result.returncode == 0 and _normalise_output(result.stdout) == _normalise_output(
                expected
            )
        ok = ok and not result.disk_exceeded  # past reward.code_disk_mb: a failure
        passed += ok
        if not ok and stop_at_first_failure:
            break
    status = "correct" if passed == len(cases) else ("timeout" if any_timeout else "incorrect")
    return CodeResult(passed, len(cases), status)


def code_correctness(
    completion: str,
    tests: str | Sequence[dict[str, Any]],
    *,
    timeout_s: float = 4.0,
    memory_mb: int = 300,
    partial: bool = False,
    max_tests: int | None = None,
    isolation: str = "process",
) -> float:
    """1.0 if the completion's first code block passes every test (pass rate if ``partial``).

    See the module docstring for the test conventions and the sandbox. Never raises on
    model output.
    """
    try:
        result = run_code_tests(
            completion,
            tests,
            timeout_s=timeout_s,
            memory_mb=memory_mb,
            stop_at_first_failure=not partial,
            max_tests=max_tests,
            isolation=isolation,
        )
    except (OSError, SyntaxError, ValueError, KeyError, TypeError):
        return 0.0
    return result.pass_rate if partial else float(result.all_passed)
