"""Verifier calls in processes of their own, killed when they overrun their time limit.

A call stuck in one C loop (a big-integer power, ``sum(range(10**12))``) ignores signals
and asynchronous exceptions; :class:`KillableWorker` runs calls in a process that is
killed when one overruns. The processes are forked from one server per caller process,
started from the library (``python -c``) with the math verifier imported and warmed: the
caller's ``__main__`` is never imported (as multiprocessing's spawn and forkserver do),
start-up is paid once per process and before any call's limit, a new worker costs a
fork (the scoring pool's workers, ``policyopt.rewards.worker``, are such forks too, and
fork their own). :func:`thread_worker`'s workers end with their thread; the server kills
every worker when its caller exits or dies, and they die with it. ``docs/rewards.md``,
"Verifier processes".
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from policyopt.rewards.timelimit import VerifierTimeout, time_limit

# Imported (and called, for "module:function") by the server before it forks a worker:
# the math verifier, warm, in every worker at the cost of a fork.
PRELOAD = (
    "policyopt.rewards.math:load_math_verify",
    "policyopt.rewards.math:mark_killable_process",
)
# A worker gets this long past its call's limit before it is killed (it enforces the
# limit itself first, which costs no new process), seconds.
KILL_GRACE_S = 0.5
# Start-up of the server (imports, warm-up) or of a worker (its initializer), at most.
START_TIMEOUT_S = 300.0

_SERVER_MAIN = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from policyopt.rewards.killable import serve_forks\n"
    "serve_forks(int(sys.argv[2]), json.loads(sys.argv[3]))\n"
)
# b"F" (fork; the worker's socket attached), b"K" + pid, or b"P" + the length of the JSON
# list of preloads that follows.
_MESSAGE = struct.Struct(">cq")
_PR_SET_PDEATHSIG = 1  # prctl(2)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the verifier server is gone")
        data += chunk
    return data


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _load(preload: Sequence[str]) -> None:
    for item in preload:
        module_name, _, function = item.partition(":")
        module = importlib.import_module(module_name)
        if function:
            getattr(module, function)()


# True in a process the server forked (a verifier process, a scoring worker): it forks the
# verifier processes it needs itself (`_LocalForks`), rather than starting a server.
_FORKED = False


def _worker_main(fd: int, parent: int, close_fds: bool) -> None:
    """A forked worker's life: serves calls on ``fd`` and exits (never returns into the
    code that forked it). ``close_fds``: close every other inherited descriptor (a fork of
    a scoring worker inherits its sockets, whose ends must close when it dies)."""
    global _FORKED
    try:
        _FORKED = True
        if close_fds:
            gc.freeze()  # no collection may close an inherited object's (reused) descriptor
            os.closerange(3, fd)
            os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
        _die_with_parent(parent)
        _serve_calls(fd)
    finally:
        os._exit(0)


def _die_with_parent(parent: int) -> None:
    """In a forked worker: SIGKILL when ``parent`` (the server) dies, even by SIGKILL
    (Linux's ``PR_SET_PDEATHSIG``; elsewhere the closed sockets end an idle worker)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(0)


def serve_forks(control_fd: int, preload: Sequence[str]) -> None:
    """The server's main: imports ``preload``, says it is ready, then forks a worker for
    each ``F`` message (serving calls on the socket attached), kills its worker for each
    ``K`` and imports (or calls) more for each ``P``, until its caller closes the control
    socket; then kills every worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's Ctrl-C is the caller's
    _load(preload)
    control = socket.socket(fileno=control_fd)
    control.sendall(b"R")
    children: set[int] = set()
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, _MESSAGE.size, 1)
        except OSError:
            break
        if len(message) < _MESSAGE.size:
            break  # the caller exited or died
        op, pid = _MESSAGE.unpack(message)
        _reap(children)
        if op == b"K":
            if pid in children:  # never another process that took a reaped worker's pid
                os.kill(pid, signal.SIGKILL)
            continue
        if op == b"P":  # here `pid` is the length of the list
            try:
                _load(json.loads(_recv_exact(control, pid)))
                error = b""
            except Exception as failure:  # noqa: BLE001 - reported to the caller
                error = f"{type(failure).__name__}: {failure}".encode()
            control.sendall(struct.pack(">q", len(error)) + error)
            continue
        server_pid, child = os.getpid(), os.fork()
        if child == 0:
            control.close()
            _worker_main(fds[0], server_pid, close_fds=False)
        for fd in fds:
            os.close(fd)
        children.add(child)
        control.sendall(struct.pack(">q", child))
    for pid in children:
        os.kill(pid, signal.SIGKILL)


def _serve_calls(fd: int) -> None:
    """A worker: takes the caller's ``sys.path``, runs its initializer, says it is ready,
    then runs ``(function, args, seconds)`` requests under :func:`time_limit` and answers
    ``("ok", value)``, ``("timeout", None)`` or ``("error", message)`` (any exception,
    ``SystemExit`` and ``KeyboardInterrupt`` included), until the caller closes its end."""
    connection = Connection(fd)
    try:
        path, initializer = connection.recv()
        sys.path[:] = path  # the caller's, as it is now
        if initializer is not None:
            initializer[0](*initializer[1])
    except BaseException as error:  # noqa: BLE001 - reported, then the worker ends
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    connection.send(("ready", os.getpid()))
    while True:
        try:
            function, args, seconds = connection.recv()
        except (EOFError, OSError):
            return
        try:
            with time_limit(seconds):
                reply = ("ok", function(*args))
        except VerifierTimeout:
            reply = ("timeout", None)
        except BaseException as error:  # noqa: BLE001 - the call's, reported to the caller
            reply = ("error", f"{type(error).__name__}: {error}")
        try:
            connection.send(reply)
        except Exception as error:  # noqa: BLE001 - a value that does not pickle
            connection.send(("error", f"returned {type(reply[1]).__name__}: {error}"))


class _Server:
    """A server process and its control socket (one per caller process)."""

    def __init__(self, preload: Sequence[str]):
        mine, theirs = socket.socketpair()
        self.lock = threading.Lock()
        self.loaded = set(preload)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER_MAIN, json.dumps(sys.path), str(theirs.fileno())]
            + [json.dumps(list(preload))],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # the terminal's Ctrl-C goes to the caller alone
        )
        theirs.close()
        self.control = mine
        mine.settimeout(START_TIMEOUT_S)
        try:
            if _recv_exact(mine, 1) != b"R":
                raise EOFError("no ready message")
        except (OSError, EOFError) as error:
            self.close()
            raise RuntimeError(f"the verifier server did not start ({error})") from None
        mine.settimeout(None)

    def fork(self) -> tuple[int, Connection]:
        """A new worker: its pid and a connection to it."""
        mine, theirs = socket.socketpair()
        try:
            with self.lock:
                socket.send_fds(self.control, [_MESSAGE.pack(b"F", 0)], [theirs.fileno()])
                (pid,) = struct.unpack(">q", _recv_exact(self.control, 8))
        finally:
            theirs.close()
        return pid, Connection(mine.detach())

    def preload(self, items: Sequence[str]) -> None:
        """Has the server import ``items`` (``"module"`` or ``"module:function"``, the
        function called) for the workers it forks from now on; each item once.

        Raises:
          RuntimeError: an import or call failed in the server (the server goes on).
        """
        with self.lock:
            todo = [item for item in items if item not in self.loaded]
            if not todo:
                return
            payload = json.dumps(todo).encode()
            self.control.sendall(_MESSAGE.pack(b"P", len(payload)) + payload)
            (size,) = struct.unpack(">q", _recv_exact(self.control, 8))
            error = _recv_exact(self.control, size).decode()
            if error:
                raise RuntimeError(f"the verifier server could not load {todo}: {error}")
            self.loaded.update(todo)

    def kill(self, pid: int) -> None:
        """Has the server SIGKILL its worker ``pid`` (if it is still one of its)."""
        with self.lock:
            self.control.sendall(_MESSAGE.pack(b"K", pid))

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        """Closes the control socket: the server kills its workers and exits."""
        self.control.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class _LocalForks:
    """The server's part in a process the server forked (a scoring worker): that process
    is a copy of the server (one thread, the verifiers imported and warm), so it forks
    its verifier processes itself, milliseconds each, where a server of its own would
    cost seconds and a process. They die with it (``PR_SET_PDEATHSIG``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.children: set[int] = set()

    def fork(self) -> tuple[int, Connection]:
        mine, theirs = socket.socketpair()
        with self.lock:
            _reap(self.children)
            parent, child = os.getpid(), os.fork()
            if child == 0:
                _worker_main(theirs.fileno(), parent, close_fds=True)
            self.children.add(child)
        theirs.close()
        return child, Connection(mine.detach())

    def kill(self, pid: int) -> None:
        with self.lock:
            if pid in self.children:  # never another process that took a reaped one's pid
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                self.children.discard(pid)

    def preload(self, items: Sequence[str]) -> None:
        _load(items)  # here, for the processes this one forks from now on

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        for pid in list(self.children):
            self.kill(pid)


_SERVERS: dict[int, _Server | _LocalForks] = {}  # by caller pid (a forked child: its own)
_SERVERS_LOCK = threading.Lock()


def server() -> _Server | _LocalForks:
    """This process's server, started (seconds: imports and warm-up) on first use; in a
    process the server forked, that process itself (:class:`_LocalForks`)."""
    with _SERVERS_LOCK:
        found = _SERVERS.get(os.getpid())
        if found is None or not found.alive():
            found = _LocalForks() if _FORKED else _Server(PRELOAD)
            _SERVERS[os.getpid()] = found
        return found


@atexit.register
def _close_server() -> None:
    with _SERVERS_LOCK:
        found = _SERVERS.pop(os.getpid(), None)
    if found is not None:
        found.close()


class KillableWorker:
    """A process for calls that a time limit in this process cannot stop.

    ``call(function, args, seconds)`` runs ``function(*args)`` in the worker under
    :func:`time_limit`; if no reply has come ``seconds`` + ``KILL_GRACE_S`` later (the
    call sits inside one C call), the worker is killed, the next call forks a new one, and
    the caller gets :class:`VerifierTimeout`. The worker is forked on first use or by
    :meth:`start`, before any call's clock starts; one found dead between calls is
    replaced. One call at a time (a lock); one worker per calling thread is the intended
    use (:func:`thread_worker`). :meth:`close` ends it from any thread, even mid-call.

    Args:
      initializer: ``(function, args)`` run once in each new worker (picklable), e.g.
        importing a custom verifier.
    """

    def __init__(self, initializer: tuple[Callable[..., Any], tuple] | None = None):
        self._initializer = initializer
        self._lock = threading.Lock()  # one call (or start) at a time
        self._state = threading.Lock()  # the fields below, also for close() mid-call
        self._pid: int | None = None
        self._last_pid: int | None = None
        self._connection: Connection | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        """The worker's process id, None when none is running."""
        return self._pid

    @property
    def last_pid(self) -> int | None:
        """The process id of the latest worker, running or not (None before the first)."""
        return self._last_pid

    def start(self) -> None:
        """Forks the worker now (if it is not running) and waits until it is ready."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        if self._closed:
            raise RuntimeError("verifier process closed")
        if self._connection is not None:
            if not self._connection.poll(0):
                return
            self._kill()  # it died (or said something unasked) since its last call
        pid, connection = server().fork()
        with self._state:
            self._pid, self._last_pid, self._connection = pid, pid, connection
            closed = self._closed
        if closed:  # close() ran during the fork and did not see this worker
            self._kill()
            raise RuntimeError("verifier process closed")
        try:
            connection.send((list(sys.path), self._initializer))
            reply = connection.recv() if connection.poll(START_TIMEOUT_S) else None
        except (EOFError, OSError):
            reply = None
        if reply is None or reply[0] != "ready":
            self._kill()
            why = reply[1] if reply is not None else "it died or did not answer"
            raise RuntimeError(f"verifier process did not start: {why}")

    def _kill(self) -> None:
        with self._state:
            pid, connection = self._pid, self._connection
            self._pid = self._connection = None
            if connection is not None:
                connection.close()
        _kill_forked(pid)

    def kill(self) -> None:
        """Kills the worker (if any) once its call (if any) returns; the next call forks a
        new one."""
        with self._lock:
            self._kill()

    def close(self) -> None:
        """Kills the worker now, from any thread, and for good: a call in progress raises
        ``RuntimeError`` at once, later calls too."""
        with self._state:
            self._closed = True
            pid, connection = self._pid, self._connection
            if connection is not None:  # wakes a caller blocked on the connection
                try:
                    with socket.socket(fileno=os.dup(connection.fileno())) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        _kill_forked(pid)

    def call(self, function: Callable[..., Any], args: tuple, seconds: float | None) -> Any:
        """``function(*args)`` in the worker, under a limit of ``seconds`` (None: none).

        Raises:
          VerifierTimeout: the limit expired (the worker was killed if it did not stop by
            itself within the grace period).
          RuntimeError: the call raised in the worker (its type and message; ``SystemExit``
            and ``KeyboardInterrupt`` too), or the worker died or was closed.
        """
        with self._lock:
            self._ensure()
            wait = None if seconds is None else seconds + KILL_GRACE_S
            try:
                self._connection.send((function, args, seconds))
                ready = self._connection.poll(wait)
                reply = self._connection.recv() if ready else None
            except (EOFError, OSError):
                self._kill()
                raise RuntimeError("verifier process died") from None
            except BaseException:  # the caller's Ctrl-C: the worker is mid-call
                self._kill()
                raise
            if reply is None:
                self._kill()
                raise VerifierTimeout(f"call exceeded {seconds:g} s; worker process killed")
        kind, value = reply
        if kind == "timeout":
            raise VerifierTimeout(f"call exceeded {seconds:g} s")
        if kind == "error":
            raise RuntimeError(value)
        return value


def _kill_forked(pid: int | None) -> None:
    """Has this process's server kill its worker ``pid`` (gone with the server if that
    is not running)."""
    running = _SERVERS.get(os.getpid())
    if pid is not None and running is not None and running.alive():
        try:
            running.kill(pid)
        except OSError:
            pass  # the server is gone, and its workers with it


class _ThreadWorkers:
    """One thread's workers by name; they are killed when the thread ends (its
    thread-local data is released) or at exit."""

    def __init__(self):
        self.pid = os.getpid()
        self.workers: dict[str, KillableWorker] = {}
        weakref.finalize(self, _kill_all, self.workers)


def _kill_all(workers: dict[str, KillableWorker]) -> None:
    for worker in list(workers.values()):
        worker.kill()
    workers.clear()


_LOCAL = threading.local()


def thread_worker(
    name: str, initializer: tuple[Callable[..., Any], tuple] | None = None
) -> KillableWorker:
    """The calling thread's :class:`KillableWorker` called ``name`` (made on first use,
    killed when the thread ends). A worker per thread: concurrent callers never queue
    behind one another's time limits."""
    mine = getattr(_LOCAL, "workers", None)
    if mine is None or mine.pid != os.getpid():
        mine = _LOCAL.workers = _ThreadWorkers()
    worker = mine.workers.get(name)
    if worker is None:
        worker = mine.workers[name] = KillableWorker(initializer)
    return worker
