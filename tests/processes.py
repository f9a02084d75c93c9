"""Process-tree helpers shared by the tests' subprocess scripts (importable by them: they run
with the repository on PYTHONPATH)."""

import os
import signal
import subprocess
import sys
import threading
import time


def _sigkill_pending(pid: int) -> bool:
    """Whether ``pid`` has a SIGKILL pending (sent, not yet acted on)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [
                int(line.split()[1], 16) for line in f if line.startswith(("SigPnd", "ShdPnd"))
            ]
    except OSError:
        return False
    return any(mask & (1 << (signal.SIGKILL - 1)) for mask in masks)


def descendants(pid: int | None = None) -> set[int]:
    """The processes below ``pid`` (default: this process), from /proc, that are neither
    zombies nor dying: a process with a SIGKILL pending was killed, and exits when the
    kernel next schedules it, which under load can take seconds (a process just forked into
    a new session, its autogroup, waited 20 s on a 2-core machine)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in "ZX":
                parents[int(name)] = int(fields[1])
    found, frontier = set(), {os.getpid() if pid is None else pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if not _sigkill_pending(p)}


def describe(pids) -> str:
    """Each of ``pids`` as ``pid state (name) wchan``: why a process has not gone yet."""
    out = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read().strip() or "-"
        except OSError:
            out.append(f"{pid} gone")
            continue
        out.append(f"{pid} {rest.split()[0]} ({head.split('(', 1)[1]}) {wchan}")
    return ", ".join(out)


def marked_script(directory, text: str, tag: str) -> tuple[str, str, dict]:
    """``text`` written as ``directory/plain.py`` (a script without a ``__main__`` guard),
    and the environment to run it in: the repository importable, the CPU, and a mark
    (``POLICYOPT_TEST_MARK``, unique to this call) that its processes inherit, so that the
    test finds every one of them later. Returns ``(mark, script path, environment)``; the
    mark is ``KEY=value``, as ``/proc/PID/environ`` holds it."""
    from tests.flags import ROOT

    value = f"{os.getpid()}-{tag}-{time.monotonic_ns()}"
    script = os.path.join(directory, "plain.py")
    with open(script, "w") as f:
        f.write(text)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", POLICYOPT_TEST_MARK=value)
    return f"POLICYOPT_TEST_MARK={value}", script, env


def start_script(script: str, arg: str, env: dict, cwd, *, stdin=subprocess.PIPE):
    """Starts ``python script arg`` (a :func:`marked_script`'s) in ``cwd`` under ``env``,
    its output and errors (and by default its input) piped, as text."""
    return subprocess.Popen(
        [sys.executable, str(script), arg],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
    )


def in_thread(function):
    """The result of ``function()`` called in a new thread (joined)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(function()))
    thread.start()
    thread.join()
    return out[0]
