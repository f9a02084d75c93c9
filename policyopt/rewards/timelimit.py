"""Wall-clock time limits for in-process verifiers (math-verify, SymPy).

math-verify's own timeout (``math_verify.utils.timeout``) uses ``signal.alarm``: whole
seconds only, and it raises ``ValueError`` when called from any thread but the main one.
It also re-arms the same process-wide alarm timer that an outer limit would use. The
rewards module therefore switches math-verify's timeouts off and wraps every call in
:func:`time_limit`, which works in any thread:

* main thread: ``signal.setitimer(ITIMER_REAL)`` with a ``SIGALRM`` handler (sub-second
  resolution; also interrupts blocking system calls);
* other threads: a watchdog thread that injects the exception into the verifying thread
  with ``PyThreadState_SetAsyncExc``.

Both deliver :class:`VerifierTimeout` at the next Python bytecode boundary. A computation
stuck inside one C call (e.g. a Python ``int`` power with a ten-billion-digit result) is
not interruptible by either mechanism; :mod:`policyopt.rewards.math` screens such inputs
out before they reach SymPy, :func:`policyopt.rewards.score_batch` adds a per-batch
deadline enforced by killing worker processes, and :class:`KillableWorker` runs a call in
a process of its own that is killed when it overruns (for callers that no one else can
kill: a trainer's main thread, a scoring thread).

:class:`VerifierTimeout` derives from ``BaseException`` so that the many ``except
Exception`` clauses inside math-verify and SymPy cannot swallow it; if some code does
swallow it anyway (a bare ``except:``), the limit fires again every
``_REFIRE_S`` seconds until the guarded block exits.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# After the first expiry, fire again this often until the guarded block exits.
_REFIRE_S = 0.05


class VerifierTimeout(BaseException):
    """A verifier ran past its time limit (BaseException: ``except Exception`` misses it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raises :class:`VerifierTimeout` inside the block once ``seconds`` have elapsed.

    Args:
      seconds: wall-clock limit; ``None`` or ``<= 0`` means no limit.

    Works in the main thread (``SIGALRM`` timer) and in any other thread (watchdog thread
    with an asynchronous exception). Limits nest: an inner block runs under the shorter of
    the two limits, and the outer limit is re-armed with its remaining time on exit.
    """
    if seconds is None or seconds <= 0:
        yield
        return
    if threading.current_thread() is threading.main_thread():
        with _signal_limit(float(seconds)):
            yield
    else:
        with _watchdog_limit(float(seconds)):
            yield


@contextlib.contextmanager
def _signal_limit(seconds: float) -> Iterator[None]:
    active = [True]

    def handler(signum, frame):
        if not active[0]:
            return  # the block has finished: a late signal is ignored
        signal.setitimer(signal.ITIMER_REAL, _REFIRE_S)
        raise VerifierTimeout(f"verifier exceeded {seconds:g} s")

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, handler)
    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer_left) if outer_left > 0 else seconds)
    try:
        yield
    finally:
        # The handler may fire while we clean up; retry until `active` is False, after
        # which it never raises again.
        while True:
            try:
                active[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                if outer_left > 0:  # re-arm an enclosing limit (or someone else's alarm)
                    signal.setitimer(
                        signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 1e-3)
                    )
                break
            except VerifierTimeout:
                continue


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


@contextlib.contextmanager
def _watchdog_limit(seconds: float) -> Iterator[None]:
    thread_id = threading.get_ident()
    lock = threading.Lock()
    stop = threading.Event()
    active = [True]

    def watchdog():
        wait_s = seconds
        while not stop.wait(wait_s):
            with lock:
                if not active[0]:
                    return
                _set_async_exc(thread_id, VerifierTimeout)
            wait_s = _REFIRE_S

    watcher = threading.Thread(target=watchdog, name="verifier-time-limit", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        while True:
            try:
                with lock:
                    active[0] = False
                    _set_async_exc(thread_id, None)  # clear an exception not yet raised
                stop.set()
                break
            except VerifierTimeout:
                continue


# A killable worker waits this long past the time limit before it kills its process (the
# process enforces the limit itself first, which costs no restart).
_KILL_GRACE_S = 0.5


def _serve(connection, initializer: Callable[[], None] | None) -> None:
    """A :class:`KillableWorker` process: runs ``(function, args, seconds)`` requests under
    :func:`time_limit` on its main thread and sends back ``("ok", value)``, ``("timeout",
    None)`` or ``("error", message)``, until the pipe closes."""
    if initializer is not None:
        initializer()
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
        except Exception as error:  # noqa: BLE001 - reported to the caller, process lives on
            reply = ("error", f"{type(error).__name__}: {error}")
        connection.send(reply)


class KillableWorker:
    """A process of its own for calls that a time limit in this process cannot stop.

    ``call(function, args, seconds)`` sends the call to the process (started on first use
    from the ``forkserver``, never forked from a process that may run JAX's threads), which
    runs it under :func:`time_limit` on its main thread; if no reply has come
    ``seconds`` + 0.5 s later (the call sits inside one C call, e.g. a big-integer power),
    the process is killed, the next call starts a new one, and the caller gets
    :class:`VerifierTimeout`. One call at a time (a lock); one worker per calling thread is
    the intended use (:func:`thread_worker`).

    Args:
      preload: modules the fork server imports before forking (``set_forkserver_preload``;
        effective only if the fork server is not running yet).
      initializer: run once in the new process (picklable), e.g. a warm-up.
    """

    def __init__(self, preload: Sequence[str] = (), initializer: Callable[[], None] | None = None):
        self._preload = list(preload)
        self._initializer = initializer
        self._lock = threading.Lock()
        self._process = None
        self._connection = None

    def _start(self) -> None:
        context = multiprocessing.get_context("forkserver")
        if self._preload:
            context.set_forkserver_preload(self._preload)
        parent, child = context.Pipe()
        process = context.Process(
            target=_serve, args=(child, self._initializer), daemon=True, name="killable-verifier"
        )
        process.start()
        child.close()
        self._process, self._connection = process, parent

    def kill(self) -> None:
        """Kills the process (if any); the next call starts a new one."""
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()
        if process is not None and process.is_alive():
            process.kill()
        if process is not None:
            process.join(timeout=5)

    @property
    def pid(self) -> int | None:
        """The process id of the worker process, None before the first call."""
        return None if self._process is None else self._process.pid

    def call(self, function: Callable[..., Any], args: tuple, seconds: float) -> Any:
        """``function(*args)`` in the worker process, under a limit of ``seconds``.

        Raises:
          VerifierTimeout: the limit expired (the process was killed if it did not stop
            by itself within the grace period).
          RuntimeError: the call raised in the worker (its type and message), or the
            worker died.
        """
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self.kill()
                self._start()
            self._connection.send((function, args, seconds))
            try:
                ready = self._connection.poll(seconds + _KILL_GRACE_S)
                reply = self._connection.recv() if ready else None
            except (EOFError, OSError):
                self.kill()
                raise RuntimeError("killable worker process died") from None
            if reply is None:
                self.kill()
                raise VerifierTimeout(f"call exceeded {seconds:g} s; worker process killed")
        kind, value = reply
        if kind == "timeout":
            raise VerifierTimeout(f"call exceeded {seconds:g} s")
        if kind == "error":
            raise RuntimeError(value)
        return value


_WORKERS: dict[tuple[int, int, str], KillableWorker] = {}
_WORKERS_LOCK = threading.Lock()


def thread_worker(
    name: str, preload: Sequence[str] = (), initializer: Callable[[], None] | None = None
) -> KillableWorker:
    """The calling thread's :class:`KillableWorker` called ``name`` (created on first use;
    all are killed at exit). A worker per thread: concurrent callers never queue behind
    one another's time limits."""
    key = (os.getpid(), threading.get_ident(), name)
    with _WORKERS_LOCK:
        worker = _WORKERS.get(key)
        if worker is None:
            worker = _WORKERS[key] = KillableWorker(preload, initializer)
        return worker


@atexit.register
def _kill_workers() -> None:
    with _WORKERS_LOCK:
        workers = [w for (pid, _, _), w in _WORKERS.items() if pid == os.getpid()]
        _WORKERS.clear()
    for worker in workers:
        worker.kill()
