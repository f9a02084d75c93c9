"""The scoring pool of :func:`policyopt.rewards.score_batch`: worker processes forked from
the library's verifier server (``policyopt.rewards.killable``), never from the caller.

The server is started with ``python -c`` (no process imports the caller's ``__main__``, so
a script without ``if __name__ == "__main__":`` runs once) and, before it forks the first
worker of a pool, loads :func:`warm_up`'s verifiers; every worker is then a fork with
SymPy, math-verify and the language-id model ready, and replacing a pool killed at a
deadline costs forks. Each worker is fed by a thread of the caller; the server kills the
workers when the caller exits or dies, and they die with the server. ``docs/rewards.md``,
"Batch scoring".
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from policyopt.rewards import killable

# What the server loads before it forks a pool's workers (once per server).
POOL_PRELOAD = ("policyopt.rewards.worker:warm_up",)


def warm_up() -> None:
    """In the server: imports and warms the verifiers a scoring worker uses."""
    from policyopt.rewards import language as language_lib
    from policyopt.rewards import math as math_lib

    math_lib.load_math_verify()
    math_lib.mark_killable_process()  # its callers kill a worker stuck at a deadline
    language_lib.load_language_identifier()


class PoolClosed(RuntimeError):
    """The pool was killed (a deadline, a crashed worker, ``kill``) or shut down."""


class WorkerCrashed(RuntimeError):
    """A worker died, or its call raised, while it ran this task: the pool is broken."""


def wait_gone(pids: Iterable[int | None], timeout_s: float = 5.0) -> bool:
    """Waits until no process of ``pids`` is running (gone, or a zombie: a killed worker
    its server has not reaped yet); False if some still run after ``timeout_s``."""
    pending = {pid for pid in pids if pid is not None}
    end = time.monotonic() + timeout_s
    while pending:
        for pid in list(pending):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                state = "X"
            if state in "ZX":
                pending.discard(pid)
        if not pending or time.monotonic() >= end:
            break
        time.sleep(0.01)
    return not pending


class WorkerPool:
    """``size`` worker processes forked from the verifier server, each fed by a thread here.

    ``submit(function, *args)`` queues a call (picklable, run in a worker's main thread)
    and returns its :class:`concurrent.futures.Future`. A worker that dies mid-call breaks
    the pool, as multiprocessing's pools do: every pending call fails
    (:class:`WorkerCrashed` / :class:`PoolClosed`, queued ones cancelled) and the pool
    takes no more work; one that died between calls is replaced unseen. :meth:`kill`
    stops everything at once; :meth:`shutdown` lets running calls finish.

    Args:
      size: number of worker processes (started, and ready, when this returns).
      name: for the feeding threads' names.
      preload: what the server loads before forking them (``killable._Server.preload``),
        e.g. the module of the functions the pool will run.
    """

    def __init__(self, size: int, name: str = "pool", preload: tuple[str, ...] = POOL_PRELOAD):
        if size < 1:
            raise ValueError(f"WorkerPool: size must be >= 1, got {size}")
        killable.server().preload(preload)  # seconds, once per process; the forks are cheap
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._state = threading.Lock()
        self._closed = False
        self._workers = [killable.KillableWorker() for _ in range(size)]
        try:
            for worker in self._workers:
                worker.start()
        except BaseException:
            self.kill()
            raise
        self._threads = [
            threading.Thread(target=self._feed, args=(worker,), name=f"{name}-{i}", daemon=True)
            for i, worker in enumerate(self._workers)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pids(self) -> list[int | None]:
        """The workers' process ids (None for one not running)."""
        return [worker.pid for worker in self._workers]

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, function: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queues ``function(*args)`` for a worker.

        Raises:
          PoolClosed: the pool was killed, broken or shut down (make a new one).
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._state:
            if self._closed:
                raise PoolClosed("the scoring pool was stopped")
            self._tasks.put((future, function, args))
        return future

    def _feed(self, worker: killable.KillableWorker) -> None:
        """A thread's loop: runs queued calls on its worker until a ``None`` comes."""
        try:
            while (task := self._tasks.get()) is not None:
                future, function, args = task
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = worker.call(function, args, None)
                except BaseException as error:  # noqa: BLE001 - it died, or raised
                    if self._closed:
                        future.set_exception(PoolClosed("the scoring pool was stopped"))
                    else:
                        future.set_exception(WorkerCrashed(f"scoring worker failed: {error}"))
                        if self._stop(kill=True):  # the pool is broken
                            self._remove_sandboxes()
                    continue
                future.set_result(result)
        finally:
            worker.kill()

    def _stop(self, kill: bool) -> bool:
        """Takes no more work, cancels queued calls and tells every thread to end; with
        ``kill``, kills the workers (running calls fail at once). True if it was open."""
        with self._state:
            was_closed, self._closed = self._closed, True
        if was_closed and not kill:
            return False
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task[0].cancel()
        if kill:
            for worker in self._workers:
                worker.close()
        for _ in self._workers:
            self._tasks.put(None)
        return not was_closed

    def _remove_sandboxes(self) -> None:
        """Once the killed workers are gone: removes the sandboxes of the code tests they
        were running."""
        pids = [worker.last_pid for worker in self._workers]  # a crashed one's too
        wait_gone(pids)
        if any(pids):
            from policyopt.rewards import sandbox  # deferred: only code tests make sandboxes

            sandbox.remove_stale_sandboxes([pid for pid in pids if pid is not None])

    def kill(self) -> None:
        """Kills the workers now (some may be stuck in C code): pending calls fail, queued
        ones are cancelled. Returns once the workers are gone, their threads ended, and the
        sandboxes of code tests they were running removed."""
        self._stop(kill=True)
        for thread in getattr(self, "_threads", ()):
            if thread is not threading.current_thread():  # e.g. a future's callback
                thread.join(timeout=10)
        self._remove_sandboxes()

    def shutdown(self) -> None:
        """Takes no more work, cancels queued calls, and returns once running calls have
        finished and the workers have ended."""
        self._stop(kill=False)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
