"""One sandboxed process: started with limits, waited for, killed with all it left, read.

:class:`Sandbox` is the mechanism behind :func:`policyopt.rewards.sandbox.run_sandboxed`;
``docs/rewards.md`` ("The sandbox") says what it contains and where it falls short.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from policyopt.rewards.sandbox import cgroup, host, reaper

DEFAULT_MAX_PROCESSES = 16
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20
# Size of the working directory, /tmp and /dev/shm (MB; `reward.code_disk_mb`).
DEFAULT_DISK_MB = 64
# Files a program may create in its working directory without a jail (with one: the
# tmpfs's inode limit).
MAX_FILES = 4096
# Without a jail the working directory's size is polled this often (s).
DISK_POLL_S = 0.02
# Interpreter start-up allowance added to the wall-clock limit, seconds.
STARTUP_GRACE_S = 0.5


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one sandboxed process may use.

    Attributes:
      timeout_s: wall-clock limit (plus ``STARTUP_GRACE_S``) and CPU-time limit (rounded up).
      memory_mb: address space of each process (``RLIMIT_AS``) and, where the sandbox has
        control groups, the memory of all its processes together.
      max_processes: processes of the sandbox's uid (``RLIMIT_NPROC``).
      max_output_bytes: stdout, stderr and each file written (``RLIMIT_FSIZE``).
      disk_mb: size of the working directory (and of a jail's ``/tmp`` and ``/dev/shm``).
    """

    timeout_s: float = 4.0
    memory_mb: int = 300
    max_processes: int = DEFAULT_MAX_PROCESSES
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    disk_mb: int = DEFAULT_DISK_MB


# Trusted prologue run by the child interpreter before the untrusted program.
BOOTSTRAP = """
import os, resource, sys


def join(groups):  # the sandbox's control groups, before anything else
    for procs in filter(None, groups.split("\\n")):
        try:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        except OSError as error:
            sys.stderr.write(f"sandbox: joining {procs}: {error}\\n")
            os._exit(125)


join(sys.argv[10])
del join
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
      stdout: captured standard output (at most ``max_output_bytes``), decoded (an invalid
        byte as U+FFFD: for reading; compare ``raw_stdout``).
      stderr: captured standard error (same cap), decoded.
      timed_out: the wall-clock limit expired.
      uid: the unprivileged uid the program ran as (-1: the scorer's own, not root).
      disk_exceeded: killed for filling its working directory (without a jail; in one,
        writes past the tmpfs's size fail with ``ENOSPC`` in the program instead).
      memory_exceeded: a process of the sandbox was killed for the memory limit of the
        sandbox's control group (where there is one).
      raw_stdout: the standard output's bytes, as written.
    """

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    uid: int = -1
    disk_exceeded: bool = False
    memory_exceeded: bool = False
    raw_stdout: bytes = dataclasses.field(default=b"", repr=False)


class Sandbox:
    """One sandboxed process, started at construction: its directory, files, uid, control
    groups and ``Popen``; ``wait`` then ``finish`` (kill, reap, read the output), ``close``
    always. Its scorer's watcher is told of it, to clean up if the scorer dies."""

    def __init__(
        self,
        program: str,
        *,
        stdin: str,
        limits: Limits,
        python: str | None,
        uid: int,
        pass_fds: tuple[int, ...] = (),
        jail: bool | None = None,
    ):
        self.uid, self.max_output_bytes = uid, limits.max_output_bytes
        self.files, self.process, self.groups, self.owner = [], None, None, None
        self.disk_bytes, self.disk_exceeded, self.jailed = limits.disk_mb << 20, False, False
        self.root = tempfile.mkdtemp(prefix=f"{reaper.SANDBOX_PREFIX}{os.getpid()}-")
        try:
            watch(self.root)
            os.chmod(self.root, 0o711)
            workdir = self.workdir = os.path.join(self.root, "work")
            os.mkdir(workdir, 0o700)
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
                f.write(program)
            if uid >= 0:
                os.chown(workdir, uid, uid)
                os.chown(os.path.join(workdir, "main.py"), uid, uid)
                nproc = limits.max_processes
            else:
                nproc = reaper.count_processes(os.getuid()) + limits.max_processes
            # The run's files are the scorer's alone (0600): the child gets them as open
            # descriptors, and another run's program cannot read this one's tests' output.
            stdin_path = os.path.join(self.root, "stdin")
            with open(private(stdin_path), "w", encoding="utf-8") as f:
                f.write(stdin)
            python = python or sandbox_python()
            jail_dir = ""
            if jail or (jail is None and jail_works(python)):
                jail_dir = os.path.join(self.root, "jail")
                os.mkdir(jail_dir, 0o755)
                self.jailed = True
            # One memory limit for all the sandbox's processes, its in-memory files (three
            # tmpfs in a jail; the page cache of its directory without one) on top.
            files_mb = limits.disk_mb * (3 if self.jailed else 1)
            self.groups = cgroup.Groups(
                (limits.memory_mb + files_mb) << 20 if cgroup.support().limits_memory else None
            )
            owner = [f"uid {uid}"] if uid >= 0 else []
            owner += [f"group {group}" for group in self.groups.dirs]
            self.owner = os.fdopen(private(os.path.join(self.root, "owner")), "w")
            self.owner.write("".join(line + "\n" for line in owner))
            self.owner.flush()
            prefix = host.interpreter_prefix(python)
            command = [
                *(host.jail_prefix() if jail_dir else host.unshare_prefix()),
                python, "-I", "-S", "-c", BOOTSTRAP,
                str(max(1, int(-(-limits.timeout_s // 1)))), str(limits.memory_mb << 20),
                str(nproc), str(limits.max_output_bytes), str(uid), str(os.getpid()),
                str(self.disk_bytes), jail_dir, prefix, "\n".join(self.groups.procs_files),
            ]  # fmt: skip
            self.files.append(open(stdin_path, "rb"))
            for name in ("stdout", "stderr"):  # one at a time: close() closes what is open
                self.files.append(open(private(os.path.join(self.root, name)), "w+b"))
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
            self.owner.write(f"pgid {self.process.pid}\n")
            self.owner.flush()
        except BaseException:
            self.close()
            raise

    def wait(self, timeout_s: float, watch: Sequence[Sandbox] = ()) -> int | None:
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
                    box.kill()
            try:
                left = deadline - time.monotonic()
                return self.process.wait(timeout=max(0.0, min(DISK_POLL_S, left)))
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
        """Kills what is left of the run (:meth:`kill`) and reads its output."""
        if not self.jailed and not self.disk_exceeded and self.over_disk_limit():
            # Filled between two polls, or after the last one (the run ended first): a
            # fast program can write MAX_FILES empty files within one poll's interval.
            self.disk_exceeded = True
        # On an idle machine a busy loop reaches its CPU-time limit (= the time limit)
        # before the wall-clock one: killed by SIGXCPU (or SIGKILL at the hard limit),
        # which is a timeout too.
        memory_exceeded = self.groups.memory_exceeded()
        timed_out = not (self.disk_exceeded or memory_exceeded) and (
            returncode is None or returncode in (-signal.SIGXCPU, -signal.SIGKILL)
        )
        self.kill()
        raw = []
        for f in self.files[1:]:
            f.seek(0)
            raw.append(f.read(self.max_output_bytes))
        outputs = [data.decode("utf-8", errors="replace") for data in raw]
        if self.disk_exceeded:
            outputs[1] += (
                f"\nsandbox: killed: the working directory passed "
                f"{self.disk_bytes >> 20} MB or {MAX_FILES} files\n"
            )
        if memory_exceeded:
            outputs[1] += "\nsandbox: killed: the sandbox's processes passed memory_mb\n"
        return SandboxResult(
            returncode,
            outputs[0],
            outputs[1],
            timed_out,
            self.uid,
            self.disk_exceeded,
            memory_exceeded,
            raw[0],
        )

    def kill(self) -> None:
        """SIGKILLs every process of the sandbox: its control groups (which hold them all),
        its process group, every process of its uid; then reaps the first one."""
        if self.groups is not None:
            self.groups.kill()
        if self.process is not None:
            kill_group(self.process.pid)
        if self.uid >= 0:
            reaper.reap_uid(self.uid)
        if self.process is not None:
            self.process.wait()

    def close(self) -> None:
        """Kills what is left (if ``finish`` did not run), removes the control groups and
        the directory."""
        if self.process is None or self.process.returncode is None:
            self.kill()
        if self.groups is not None:
            self.groups.remove()
        for f in self.files:
            f.close()
        if self.owner is not None:
            self.owner.close()
        shutil.rmtree(self.root, ignore_errors=True)
        unwatch(self.root)


# Each scorer process's watcher (``reaper.supervise``): its process and the sandbox
# directories it is told of, by scorer pid (a forked child has its own).
_WATCHERS: dict[int, tuple[subprocess.Popen, set[str]]] = {}
_WATCHERS_LOCK = threading.Lock()


def _tell_watcher(line: str, root: str) -> None:
    with _WATCHERS_LOCK:
        pid = os.getpid()
        watcher, roots = _WATCHERS.get(pid, (None, set()))
        if line == "+":
            roots.add(root)
        else:
            roots.discard(root)
        for attempt in range(2):
            if watcher is None or watcher.poll() is not None:
                watcher = _start_watcher()
                _WATCHERS[pid] = (watcher, roots)
                lines = [f"+ {known}" for known in roots]
            else:
                lines = [f"{line} {root}"]
            try:
                watcher.stdin.write("".join(text + "\n" for text in lines).encode())
                watcher.stdin.flush()
                return
            except OSError:  # it died: a new one is told of every live sandbox
                watcher.kill()
                watcher = None


def _start_watcher() -> subprocess.Popen:
    """The watcher of this scorer process: it removes the scorer's sandboxes when it dies."""
    with open(reaper.__file__, encoding="utf-8") as f:
        source = f.read()
    return subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", source, reaper.WATCHER_NAME, str(os.getpid())]
        + cgroup.support().bases(),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
        start_new_session=True,
        close_fds=True,
    )


def watch(root: str) -> None:
    """Tells this scorer's watcher of a new sandbox directory (started on first use)."""
    _tell_watcher("+", root)


def unwatch(root: str) -> None:
    """Tells this scorer's watcher that the sandbox directory ``root`` is gone."""
    _tell_watcher("-", root)


def private(path: str) -> int:
    """A new file only its owner can read or write, opened for writing (a descriptor)."""
    return os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)


def kill_group(pgid: int) -> None:
    """SIGKILLs the process group ``pgid`` (nothing if it is gone)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_probe(program: str, python: str, uid: int, jail: bool) -> bool:
    """Whether ``program`` prints ``ok`` in a sandbox of that interpreter, uid and jail."""
    sandbox = Sandbox(
        program,
        stdin="",
        limits=Limits(timeout_s=10.0, max_output_bytes=1 << 16),
        python=python,
        uid=uid,
        jail=jail,
    )
    try:
        result = sandbox.finish(sandbox.wait(10.0 + STARTUP_GRACE_S))
    finally:
        sandbox.close()
    return result.returncode == 0 and result.stdout.strip() == "ok"


@functools.cache
def jail_works(python: str) -> bool:
    """Whether programs can run in a root of their own here (root, a mount namespace,
    mounts allowed in it: not in every container), probed once per interpreter."""
    if not host.jail_prefix():
        return False
    return run_probe(
        "import json, math, re\nprint('ok')\n", python, host.sandbox_uids(1)[0], jail=True
    )


@functools.cache
def sandbox_python() -> str:
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
    if not host.is_root():
        return candidates[0]
    probe = (
        "import collections, functools, heapq, itertools, json, math, re, string, sys\n"
        "print('ok')\n"
    )
    for candidate in dict.fromkeys(candidates):
        if run_probe(probe, candidate, host.sandbox_uids(1)[0], jail=None):
            return candidate
    return candidates[0]
