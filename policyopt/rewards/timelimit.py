"""Wall-clock time limits for verifier calls, in any thread (:func:`time_limit`).

The main thread gets a ``SIGALRM`` timer (sub-second; it also interrupts blocking system
calls), other threads a watchdog that injects the exception with
``PyThreadState_SetAsyncExc``; both deliver :class:`VerifierTimeout` at the next bytecode
boundary, so neither stops one long C call (``policyopt.rewards.killable`` does, by
killing a process). math-verify's own ``signal.alarm`` timeouts are switched off in favour
of these. ``docs/rewards.md``, "Verifier processes".
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
import time
from collections.abc import Iterator

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
