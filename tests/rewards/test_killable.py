"""The verifier processes under interrupts and exits (policyopt.rewards.killable): a real
Ctrl-C stops the run wherever it lands, an interrupt at any line of the fork server's
exchange leaves it in step, and an exit never waits on a daemon thread's verifier."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.flags import ROOT
from tests.processes import marked_script, start_script
from tests.rewards.test_verifier_processes import marked_processes

# Interrupted where a verifier process (started from tests.verifiers:announce_and_hang)
# says "waiting for Ctrl-C": in the server's start-up, a worker's start-up, the pool's
# preload, or a verifier's call. A test worker may run with SIGINT ignored, which its children
# inherit: the script first takes a terminal's disposition.
CTRL_C = r"""
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
import sys
from policyopt.rewards import RewardSpec, killable, score_batch
from tests.verifiers import announce_and_hang

HANG = "tests.verifiers:announce_and_hang"
where = sys.argv[1]
killable.PRELOAD = (HANG,) if where == "server start" else ()
print("started", flush=True)
if where == "server start":
    killable.server()
elif where == "worker start":
    killable.KillableWorker((announce_and_hang, ())).start()
elif where == "pool preload":
    killable.server().preload([HANG])
else:
    spec = RewardSpec(format_reward=False, verifier=HANG, verifier_timeout_s=60.0)
    score_batch(["a"] * 4, ["1"] * 4, [1] * 4, spec)
print("finished", flush=True)
"""


def holding(pipe) -> list[str]:
    """The processes (``pid: command line``) that have ``pipe``'s other end open."""
    target = f"pipe:[{os.fstat(pipe.fileno()).st_ino}]"
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if any(os.readlink(f"/proc/{name}/fd/{fd}") == target for fd in fds):
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    command = f.read().replace(b"\0", b" ")[:120].decode(errors="replace")
                found.append(f"{name}: {command}")
        except OSError:
            continue
    return found


@pytest.mark.parametrize("where", ["server start", "worker start", "pool preload", "call"])
def test_a_real_ctrl_c_still_stops_the_run(tmp_path, where):
    """The user's Ctrl-C (SIGINT), wherever it lands (a verifier process starting or
    running), is not the verifier's error: the script stops with KeyboardInterrupt within
    seconds, without scoring the rest, and no process of it is left (none holding its
    output open)."""
    mark, script, env = marked_script(tmp_path, CTRL_C, "ctrl-c")
    process = start_script(script, where, env, tmp_path, stdin=None)
    out, err = [], []
    readers = [
        threading.Thread(target=lambda: out.extend(iter(process.stdout.readline, ""))),
        threading.Thread(target=lambda: err.extend(iter(process.stderr.readline, ""))),
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 240
        while "waiting for Ctrl-C\n" not in out and time.monotonic() < deadline:
            assert process.poll() is None, ("the script ended early", out, err)
            time.sleep(0.02)
        assert "waiting for Ctrl-C\n" in out, ("no verifier process started", out, err)
        process.send_signal(signal.SIGINT)
        start = time.monotonic()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script did not exit 15 s after SIGINT ({where}): {out} {err}")
        for reader, pipe in zip(readers, ("stdout", "stderr")):
            reader.join(timeout=max(15 - (time.monotonic() - start), 0.1))
            assert not reader.is_alive(), (
                f"the script exited (status {process.returncode}) but its {pipe} stayed open "
                f"15 s after SIGINT ({where}), held by {holding(getattr(process, pipe))}"
            )
    finally:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and marked_processes(mark):
        time.sleep(0.05)
    assert not marked_processes(mark), ("processes left", where, marked_processes(mark))
    stderr = "".join(err)
    assert "finished\n" not in out and process.returncode != 0, (out, stderr)
    assert "KeyboardInterrupt" in stderr and stderr.count("Traceback") == 1, stderr


# Interrupts (a real SIGINT) the verifier processes' requests at the start of each line
# that killable.py runs, point after point: first a server's start, then a worker's start,
# a call, a preload, a kill and a close. After each, no process is left but the server
# (a server interrupted while starting is gone at once), and the next start, or the same
# requests uninterrupted, are answered in step (a worker's pid is its own).
# A `with` statement's exit is skipped: no signal reaches it outside a tracer (CPython
# handles signals after calls; the exit's call releases the lock first).
SWEEP = r"""
import faulthandler, json, linecache, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
from policyopt.rewards import killable

killable.PRELOAD = ()  # a server starts in about a second
FILE = killable.__file__
from tests.processes import describe, descendants


def settle(where, grace_s=5.0):
    # The server, if one is running, is left; nothing else (workers are killed by the
    # server, within `grace_s`; a server interrupted while starting is gone at once). A
    # preload's round trip first: the server acts on its messages in order, so the fork and
    # kill requests sent before it have been acted on (a killed worker has its SIGKILL
    # pending, `descendants` leaves it out), however late the server was scheduled.
    running = killable._SERVERS.get(os.getpid())
    expected = set()
    if running is not None and running.alive():
        running.loaded.discard("json")
        running.preload(["json"])
        expected = {running.process.pid}
    deadline = time.monotonic() + grace_s
    while descendants() != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    left = descendants()
    assert left == expected, f"{where}: left {describe(left)}, expected {expected}"


def no_server():
    running = killable._SERVERS.get(os.getpid())
    if running is not None and running.alive():
        killable._close_server()


def requests():
    server = killable.server()
    worker = killable.KillableWorker((os.getpid, ()))
    worker.start()
    assert worker.call(os.getpid, (), 30.0) == worker.pid, "a worker's pid is not its own"
    server.loaded.discard("tests.verifiers")
    server.preload(["tests.verifiers"])
    worker.kill()
    worker.close()


def interrupt_at(point):
    count, seen = 0, set()

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            key = (id(frame), frame.f_lineno)
            source = linecache.getline(FILE, frame.f_lineno).lstrip()
            if key not in seen or not source.startswith("with "):
                count += 1
                if count == point:
                    print(f"  at {frame.f_code.co_name}:{frame.f_lineno}", flush=True)
                    os.kill(os.getpid(), signal.SIGINT)
            seen.add(key)
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename == FILE else None)


points = {}
for name, prepare, steps in (("start", no_server, killable.server), ("requests", str, requests)):
    point = 0
    while True:
        point += 1
        prepare()
        print(f"{name} {point}: interrupted", flush=True)
        try:
            interrupt_at(point)
            steps()
            break  # past the last point: nothing was interrupted
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        print(f"{name} {point}: waiting for the processes to settle", flush=True)
        settle(f"{name} {point}", 0.0 if name == "start" else 5.0)
        if name == "start":
            continue  # the next point's start, uninterrupted up to it, is the check
        print(f"{name} {point}: the requests again", flush=True)
        faulthandler.dump_traceback_later(60, exit=True)  # where it waits, if it hangs
        requests()
        faulthandler.cancel_dump_traceback_later()
        settle(f"{name} {point}, after")
    points[name] = point - 1
print(json.dumps(points), flush=True)
"""


def test_an_interrupt_anywhere_leaves_the_verifier_processes_in_step(tmp_path):
    """A Ctrl-C caught by the caller (a notebook, a REPL) at any line of the verifier
    processes' requests leaves no process behind and no reply half-read: before, one
    between a fork request and its reply left the reply to the next request, which took
    it for its worker's pid (and a preload after it waited forever)."""
    script = tmp_path / "sweep.py"
    script.write_text(SWEEP)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    try:
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as timeout:
        lines = (timeout.stdout or b"").decode().splitlines()[-3:]
        pytest.fail(f"the sweep hung after {lines}: {(timeout.stderr or b'').decode()[-2000:]}")
    lines = done.stdout.splitlines()
    assert done.returncode == 0, (lines[-3:], done.stderr[-3000:])
    points = json.loads(lines[-1])
    assert points["start"] >= 20 and points["requests"] >= 80, points  # every line, each once


# Exits (on a line from stdin) while a daemon thread waits on its verifier process, or
# starts a scoring pool (the server's start-up: its preload announces itself and hangs).
DAEMON = r"""
import sys, threading
from policyopt.rewards import RewardSpec, killable, score_batch, start_workers

HANG = "tests.verifiers:announce_and_hang"
if sys.argv[1] == "call":
    killable.PRELOAD = ()
    spec = RewardSpec(format_reward=False, verifier=HANG, verifier_timeout_s=60.0)
    work = lambda: score_batch(["a"], ["1"], [1], spec)
else:
    killable.PRELOAD = (HANG,)
    work = lambda: start_workers(2)
threading.Thread(target=work, daemon=True).start()
sys.stdin.readline()
"""


@pytest.mark.parametrize("waiting_in", ["call", "pool start"])
def test_an_exit_never_waits_for_a_daemon_threads_verifier(tmp_path, waiting_in):
    """A script that ends while a daemon thread (the asynchronous trainer's scorer is one)
    waits on its verifier process, or on the server's start-up for a scoring pool, exits
    at once, leaving no process: before, the exit's clean-up waited for the call to end,
    or for the pool's start (60 s), and a server still starting went on alone."""
    mark, script, env = marked_script(tmp_path, DAEMON, "daemon")
    process = start_script(script, waiting_in, env, tmp_path)
    try:
        line = process.stdout.readline()
        assert line == "waiting for Ctrl-C\n", (line, process.stderr.read())
        process.stdin.write("exit\n")
        process.stdin.flush()
        start = time.monotonic()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script did not exit 15 s after its main thread ended ({waiting_in})")
        assert time.monotonic() - start < 10, time.monotonic() - start
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and marked_processes(mark):
            time.sleep(0.05)
        assert not marked_processes(mark), ("processes left", marked_processes(mark))
    finally:
        process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout, process.stderr):
            pipe.close()  # not read to its end: a process left would hold it open
