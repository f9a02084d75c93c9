"""Process-level settings that make XLA:CPU runs faster.

``keep_freed_host_memory()``: XLA:CPU allocates every output and temporary buffer of a
jitted call with the C allocator and frees it afterwards. glibc returns multi-megabyte
blocks to the operating system (``mmap``/``munmap`` above ``M_MMAP_THRESHOLD``, heap
trimming above ``M_TRIM_THRESHOLD``), so the next call faults the same pages in again:
for a ``policy_loss`` with all metrics on ``[256, 4096]`` arrays that is about half of the
run time (``benchmarks/bench_core.py``). Where JAX runs on the CPU alone it keeps every
freed block (no ``mmap``, no trimming, one arena: a training step's temporary buffer of
several GB is not unmapped after each call; the long task's iteration ran 1.19x faster,
1.34x with routing metrics, ``benchmarks/bench_host_memory.py``); beside an accelerator
plugin it keeps blocks of up to 256 MiB, so that the host copies of whole parameter sets
go back to the system. The cost is that the resident size stays at its peak, which is
what a training process wants anyway. It is the same effect as preloading tcmalloc, as
is usual on TPU hosts.

Experiments and benchmarks call it at start-up; a library user calls it once in their
own entry point (it changes the whole process, so importing policyopt never does).

``enable_compilation_cache()``: JAX's persistent compilation cache, on by default for the
experiments (docs/runs.md "Compilation cache"); ``compile_count()`` counts the process's
XLA compilations (cache loads included), which the console's ETA leaves out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import importlib.util
import os
import threading

# mallopt(3) parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# Blocks above this stay mmapped (and unmapped when freed): very large buffers (whole
# parameter sets) should go back to the system.
DEFAULT_MMAP_THRESHOLD = 256 * 1024 * 1024


@functools.lru_cache(maxsize=None)
def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def cpu_only() -> bool:
    """Whether JAX in this process can only run on the CPU: ``JAX_PLATFORMS`` names only
    "cpu", or it is unset and neither libtpu nor a ``jax_plugins`` backend (CUDA, ROCm) is
    installed. Reads no device (a multi-host run initialises its backends later)."""
    platforms = [p.strip() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return set(platforms) == {"cpu"}
    if importlib.util.find_spec("libtpu") is not None:
        return False
    return not importlib.metadata.entry_points(group="jax_plugins")


def keep_freed_host_memory(
    mmap_threshold: int = DEFAULT_MMAP_THRESHOLD,
    trim_threshold: int = 2**31 - 1,
    *,
    every_block: bool | None = None,
) -> bool:
    """Tells glibc's malloc to keep freed blocks in the process for reuse.

    Args:
      mmap_threshold: blocks at most this large come from the heap instead of ``mmap``
        (so freeing them does not unmap them).
      trim_threshold: free memory at the top of the heap is returned to the system only
        beyond this many bytes.
      every_block: keep blocks of any size instead (one arena, no ``mmap``, no trimming;
        the two thresholds are then unused). None: when JAX runs on the CPU alone
        (``cpu_only``).

    Returns:
      True when the settings were applied; False where the C library has no ``mallopt``
      (not glibc, e.g. macOS) or refused a value.
    """
    libc = _libc()
    if libc is None:
        return False
    if every_block is None:
        every_block = cpu_only()
    if every_block:
        settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    else:
        settings = ((_M_MMAP_THRESHOLD, int(mmap_threshold)), (_M_TRIM_THRESHOLD, trim_threshold))
    return all([libc.mallopt(param, int(value)) for param, value in settings])


class GracefulStop:
    """SIGINT (Ctrl-C) and SIGTERM ask a training loop to stop at its next iteration
    boundary, where it saves a checkpoint; a second SIGINT stops at once
    (``KeyboardInterrupt``). Installed while used as a context manager, on the main thread
    only (elsewhere Python delivers no signals, and it does nothing).

        with GracefulStop() as stop:
            while not stop.requested:
                ...
        stop.signal_name  # "SIGINT" / "SIGTERM", or None
    """

    def __init__(
        self,
        message: str = "stopping after this iteration (a checkpoint is saved); "
        "Ctrl-C again to stop at once",
    ):
        self.message = message
        self.signal_number: int | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signal_number is not None

    @property
    def signal_name(self) -> str | None:
        import signal

        return None if self.signal_number is None else signal.Signals(self.signal_number).name

    def _handle(self, number, frame) -> None:
        import signal
        import sys

        del frame
        if self.signal_number is not None and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = number
        print(f"\n{signal.Signals(number).name}: {self.message}", file=sys.stderr, flush=True)

    def __enter__(self) -> "GracefulStop":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}


# The persistent compilation cache: an environment variable names another directory or
# turns it off ("off", "0", "false", "no", "none").
CACHE_ENV = "POLICYOPT_COMPILATION_CACHE"
_OFF = ("off", "0", "false", "no", "none")


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/policyopt/jax`` (``~/.cache/policyopt/jax`` without it)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "policyopt", "jax")


def enable_compilation_cache(directory: str | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache, so that a rerun (a resumed run, the
    same recipe with more iterations, an evaluation) loads the programs an earlier process
    compiled instead of compiling them again.

    Every program is cached (``jax_persistent_cache_min_compile_time_secs = 0``: a run's
    first iteration also compiles hundreds of small host-side programs, together as long
    as its large ones). Call it before the first compilation; it changes the whole process.

    Args:
      directory: where the programs go. None: a directory JAX already has
        (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``, e.g. the test suite's), else
        ``$POLICYOPT_COMPILATION_CACHE``, else ``default_cache_dir()``.

    Returns:
      The directory in use, or None when ``$POLICYOPT_COMPILATION_CACHE`` is "off" (or
      "0", "false", "no", "none"), which leaves the cache as JAX has it.
    """
    import jax

    if directory is None:
        setting = os.environ.get(CACHE_ENV, "").strip()
        if setting.lower() in _OFF:
            return None
        if jax.config.jax_compilation_cache_dir:
            return jax.config.jax_compilation_cache_dir
        directory = setting or default_cache_dir()
    directory = os.path.expanduser(directory)
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


_COMPILES = [0]
_COMPILES_LOCK = threading.Lock()


# Programs loaded from the persistent compilation cache (JAX's cache-hit event).
_CACHE_HITS = [0]


def _count_compile(event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
        with _COMPILES_LOCK:
            _COMPILES[0] += 1


def _count_cache_hit(event: str, **kwargs) -> None:
    del kwargs
    if event == "/jax/compilation_cache/cache_hits":
        with _COMPILES_LOCK:
            _CACHE_HITS[0] += 1


@functools.lru_cache(maxsize=None)
def _start_counting() -> None:
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_count_compile)
    monitoring.register_event_listener(_count_cache_hit)


def compile_count() -> int:
    """XLA compilations in this process so far (a program loaded from the persistent
    cache counts: it stands in for one); counting starts with the first call."""
    _start_counting()
    with _COMPILES_LOCK:
        return _COMPILES[0]


def compile_counts() -> tuple[int, int]:
    """``(compiled, loaded)``: the programs XLA compiled in this process so far and those
    loaded from the persistent compilation cache instead (together ``compile_count()``);
    counting starts with the first call."""
    _start_counting()
    with _COMPILES_LOCK:
        return _COMPILES[0] - _CACHE_HITS[0], _CACHE_HITS[0]
