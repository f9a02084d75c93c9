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
import itertools
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
# At exit, the server gets this long to kill its workers and exit before it is killed.
CLOSE_WAIT_S = 2.0
# The server waits this long for a preload request's list before it drops the request.
_REQUEST_WAIT_S = 10.0

_SERVER_MAIN = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[1])\n"
    "from policyopt.rewards.killable import serve_forks\n"
    "serve_forks(int(sys.argv[2]), json.loads(sys.argv[3]))\n"
)
# The control socket carries only these 9-byte messages, none answered on it: b"F" +
# token (fork a worker; its socket attached), b"K" + token (kill that worker) or b"P" +
# length (preload; a socket attached, on which the caller writes the JSON list and the
# server answers). Each is sent whole or not at all, so a caller interrupted anywhere
# (Ctrl-C) never leaves the socket out of step: no reply is left half-read on it.
_MESSAGE = struct.Struct(">cq")
_TOKENS = itertools.count(1)  # a worker's name with its server, chosen by the caller
_PR_SET_PDEATHSIG = 1  # prctl(2)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the verifier server is gone")
        data += chunk
    return data


def _reap(children: dict[int, int]) -> None:
    """Forgets (and reaps) the workers of ``children`` (token: pid) that have exited."""
    for token, pid in list(children.items()):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            del children[token]


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
    socket; then kills every worker. A caller gone before the server is ready ends it
    quietly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's Ctrl-C is the caller's
    _load(preload)
    control = socket.socket(fileno=control_fd)
    try:
        control.sendall(b"R")
    except OSError:
        return
    children: dict[int, int] = {}  # token: pid
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, _MESSAGE.size, 1)
            if message and len(message) < _MESSAGE.size:  # never split in practice
                message += _recv_exact(control, _MESSAGE.size - len(message))
        except (OSError, EOFError):
            break
        if not message:
            break  # the caller exited or died
        op, value = _MESSAGE.unpack(message)
        _reap(children)
        if op == b"K":
            if value in children:  # never another process that took a reaped one's pid
                os.kill(children[value], signal.SIGKILL)
        elif op == b"P" and fds:  # `value`: the length of the list
            _answer_preload(socket.socket(fileno=fds.pop()), value)
        elif op == b"F" and fds:
            server_pid, child = os.getpid(), os.fork()
            if child == 0:
                control.close()
                _worker_main(fds[0], server_pid, close_fds=False)
            children[value] = child
        for fd in fds:
            os.close(fd)
    for pid in children.values():
        os.kill(pid, signal.SIGKILL)


def _answer_preload(reply: socket.socket, size: int) -> None:
    """In the server: reads a preload request's list (``size`` bytes) from ``reply``,
    loads it and answers there: the length of an error message (0: none) and the message.
    A caller that went away (interrupted) is not waited for, nor answered."""
    with reply:
        reply.settimeout(_REQUEST_WAIT_S)
        try:
            items = json.loads(_recv_exact(reply, size))
        except (OSError, EOFError, ValueError):
            return
        try:
            _load(items)
            error = b""
        except Exception as failure:  # noqa: BLE001 - reported to the caller
            error = f"{type(failure).__name__}: {failure}".encode()
        try:
            reply.sendall(struct.pack(">q", len(error)) + error)
        except OSError:
            pass


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
    """A server process and its control socket (one per caller process). Its requests
    are single messages (``_MESSAGE``): any thread may make one, and an interrupted one
    leaves nothing to read; a preload's answer comes on a socket of its own."""

    def __init__(self, preload: Sequence[str]):
        mine, theirs = socket.socketpair()
        self.lock = threading.Lock()  # one message at a time on the control socket
        self.loaded = set(preload)
        self.control, self.owner = mine, os.getpid()
        self.process: subprocess.Popen | None = None
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _SERVER_MAIN, json.dumps(sys.path), str(theirs.fileno())]
                + [json.dumps(list(preload))],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl-C goes to the caller alone
            )
            theirs.close()
            _SERVERS[self.owner] = self  # while it starts too: the exit's clean-up sees it
            mine.settimeout(START_TIMEOUT_S)
            if _recv_exact(mine, 1) != b"R":
                raise EOFError("no ready message")
            mine.settimeout(None)
        except BaseException as error:  # a Ctrl-C too: no server may go on starting
            theirs.close()
            if _SERVERS.get(self.owner) is self:
                del _SERVERS[self.owner]
            self._stop()
            if isinstance(error, (OSError, EOFError)):
                raise RuntimeError(f"the verifier server did not start ({error})") from None
            raise

    def _send(self, op: bytes, value: int, fd: int | None = None) -> None:
        with self.lock:
            message = _MESSAGE.pack(op, value)
            if fd is None:
                self.control.sendall(message)
            else:
                socket.send_fds(self.control, [message], [fd])

    def fork(self, token: int) -> Connection:
        """A new worker, called ``token`` (for :meth:`kill`): a connection to it."""
        mine, theirs = socket.socketpair()
        try:
            self._send(b"F", token, theirs.fileno())
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        return Connection(mine.detach())

    def preload(self, items: Sequence[str]) -> None:
        """Has the server import ``items`` (``"module"`` or ``"module:function"``, the
        function called) for the workers it forks from now on; each item once.

        Raises:
          RuntimeError: an import or call failed in the server (the server goes on), or
            the server is gone.
        """
        todo = [item for item in items if item not in self.loaded]
        if not todo:
            return
        payload = json.dumps(todo).encode()
        mine, theirs = socket.socketpair()
        with mine:
            try:
                self._send(b"P", len(payload), theirs.fileno())
            finally:
                theirs.close()
            try:
                mine.sendall(payload)
                (size,) = struct.unpack(">q", _recv_exact(mine, 8))
                error = _recv_exact(mine, size).decode()
            except (OSError, EOFError) as failure:
                error = f"the verifier server is gone ({failure})"
        if error:
            raise RuntimeError(f"the verifier server could not load {todo}: {error}")
        self.loaded.update(todo)

    def kill(self, token: int) -> None:
        """Has the server SIGKILL its worker ``token`` (if it is still running)."""
        self._send(b"K", token)

    def alive(self) -> bool:
        return self.process.poll() is None

    def _stop(self) -> None:
        """SIGKILLs the server and every process of its group (its workers), reaped."""
        if self.process is not None and self.process.poll() is None:  # its group is its own
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                self.process.kill()
            try:
                self.process.wait(timeout=CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        self.control.close()

    def close(self) -> None:
        """Closes the control socket: the server kills its workers and exits (or is
        killed, with them, after ``CLOSE_WAIT_S``)."""
        try:
            self.control.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it too
        except OSError:
            pass
        self.control.close()
        try:
            self.process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self._stop()


class _LocalForks:
    """The server's part in a process the server forked (a scoring worker): that process
    is a copy of the server (one thread, the verifiers imported and warm), so it forks
    its verifier processes itself, milliseconds each, where a server of its own would
    cost seconds and a process. They die with it (``PR_SET_PDEATHSIG``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.children: dict[int, int] = {}  # token: pid

    def fork(self, token: int) -> Connection:
        mine, theirs = socket.socketpair()
        with self.lock:
            _reap(self.children)
            parent, child = os.getpid(), os.fork()
            if child == 0:
                _worker_main(theirs.fileno(), parent, close_fds=True)
            self.children[token] = child
        theirs.close()
        return Connection(mine.detach())

    def kill(self, token: int) -> None:
        with self.lock:
            pid = self.children.pop(token, None)
            if pid is not None:  # never another process that took a reaped one's pid
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)

    def preload(self, items: Sequence[str]) -> None:
        _load(items)  # here, for the processes this one forks from now on

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        for token in list(self.children):
            self.kill(token)


_SERVERS: dict[int, _Server | _LocalForks] = {}  # by caller pid (a forked child: its own)
_SERVERS_LOCK = threading.Lock()


def server() -> _Server | _LocalForks:
    """This process's server, started (seconds: imports and warm-up) on first use; in a
    process the server forked, that process itself (:class:`_LocalForks`)."""
    with _SERVERS_LOCK:
        found = _SERVERS.get(os.getpid())
        if found is None or not found.alive():
            if found is not None:
                found.close()  # reaps it
            found = _LocalForks() if _FORKED else _Server(PRELOAD)
            _SERVERS[os.getpid()] = found
        return found


@atexit.register
def _close_server() -> None:
    found = _SERVERS.pop(os.getpid(), None)  # no lock: a thread may hold it, starting one
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
        self._token: int | None = None  # its name with the server (for `_kill_forked`)
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
        token = next(_TOKENS)
        with self._state:
            self._token = token  # before the fork: an interrupted start still kills it
        try:
            try:
                connection = server().fork(token)
                with self._state:
                    self._connection = connection
                    closed = self._closed
                if closed:  # close() ran during the fork and did not see this worker
                    raise RuntimeError("verifier process closed")
                connection.send((list(sys.path), self._initializer))
                reply = connection.recv() if connection.poll(START_TIMEOUT_S) else None
            except (EOFError, OSError) as error:
                reply = ("error", f"it died or did not answer ({error})")
            if reply is None or reply[0] != "ready":
                why = reply[1] if reply is not None else "it did not answer"
                raise RuntimeError(f"verifier process did not start: {why}")
            with self._state:
                self._pid = self._last_pid = reply[1]
        except BaseException:  # a Ctrl-C too: a worker half started is killed
            self._kill()
            raise

    def _kill(self) -> None:
        with self._state:
            token, connection = self._token, self._connection
            self._token = self._pid = self._connection = None
            if connection is not None:
                connection.close()
        _kill_forked(token)

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
            token, connection = self._token, self._connection
            if connection is not None:  # wakes a caller blocked on the connection
                try:
                    with socket.socket(fileno=os.dup(connection.fileno())) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        _kill_forked(token)

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


def _kill_forked(token: int | None) -> None:
    """Has this process's server kill its worker ``token`` (gone with the server if that
    is not running)."""
    running = _SERVERS.get(os.getpid())
    if token is not None and running is not None and running.alive():
        try:
            running.kill(token)
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
        worker.close()  # not kill(): it would wait for a call in progress (a daemon's)
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
