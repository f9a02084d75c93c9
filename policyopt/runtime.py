"""Process-level settings that make XLA:CPU runs faster.

``keep_freed_host_memory()``: XLA:CPU allocates every output and temporary buffer of a
jitted call with the C allocator and frees it afterwards. glibc returns multi-megabyte
blocks to the operating system (``mmap``/``munmap`` above ``M_MMAP_THRESHOLD``, heap
trimming above ``M_TRIM_THRESHOLD``), so the next call faults the same pages in again:
for a ``policy_loss`` with all metrics on ``[256, 4096]`` arrays that is about half of the
run time (``benchmarks/bench_core.py``). Raising both thresholds keeps freed blocks in the
process for reuse. The cost is that the resident size stays at its peak, which is what a
training process wants anyway. It is the same effect as preloading tcmalloc, as is
usual on TPU hosts.

Experiments and benchmarks call it at start-up; a library user calls it once in their
own entry point (it changes the whole process, so importing policyopt never does).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# mallopt(3) parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
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


def keep_freed_host_memory(mmap_threshold: int = DEFAULT_MMAP_THRESHOLD,
                           trim_threshold: int = 2**31 - 1) -> bool:
    """Tells glibc's malloc to keep freed blocks of up to ``mmap_threshold`` bytes for reuse.

    Args:
      mmap_threshold: blocks at most this large come from the heap instead of ``mmap``
        (so freeing them does not unmap them).
      trim_threshold: free memory at the top of the heap is returned to the system only
        beyond this many bytes.

    Returns:
      True when both settings were applied; False where the C library has no ``mallopt``
      (not glibc, e.g. macOS) or refused a value.
    """
    libc = _libc()
    if libc is None:
        return False
    mmap_ok = libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))
    trim_ok = libc.mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))
    return bool(mmap_ok and trim_ok)
