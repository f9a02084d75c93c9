"""policyopt.runtime: glibc keeps freed blocks after keep_freed_host_memory: every block
where JAX runs on the CPU alone, blocks of up to 256 MiB beside an accelerator."""

import ctypes
import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# In a fresh interpreter: is a block of SIZE bytes mmapped (counted in mallinfo2().hblkhd)
# or taken from the heap, and how much of the heap is still the process's once it is
# freed (mallinfo2().arena), before and after the call? malloc does not touch the pages.
_PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, json, sys
    from policyopt import runtime
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                     "fordblks keepcost").split()]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def a_block(size):
        before = libc.mallinfo2().hblkhd
        block = libc.malloc(size)
        mmapped = libc.mallinfo2().hblkhd - before
        libc.free(block)
        return {"mmapped": mmapped, "heap_after_free": libc.mallinfo2().arena}

    mode = sys.argv[1]
    applied = None
    if mode == "auto":
        applied = runtime.keep_freed_host_memory()
    elif mode != "default":
        applied = runtime.keep_freed_host_memory(every_block=mode == "every_block")
    sizes = {"16MiB": 16 << 20, "512MiB": 512 << 20}
    print(json.dumps({"applied": applied, "cpu_only": runtime.cpu_only(),
                      **{name: a_block(size) for name, size in sizes.items()}}))
""")


def _probe(mode, **env):
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    ).stdout
    return json.loads(out)


@pytest.fixture(autouse=True)
def _mallinfo2():
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("mallinfo2 needs glibc >= 2.33")


def test_glibc_unmaps_large_blocks_by_default():
    default = _probe("default")
    assert default["applied"] is None
    assert default["16MiB"]["mmapped"] >= 16 << 20 and default["512MiB"]["mmapped"] >= 512 << 20


def test_beside_an_accelerator_blocks_up_to_256_mib_come_from_the_heap():
    bounded = _probe("bounded")
    assert bounded["applied"] is True
    assert bounded["16MiB"]["mmapped"] == 0  # from the heap, kept when freed
    assert bounded["512MiB"]["mmapped"] >= 512 << 20  # a whole parameter set goes back
    # The automatic choice where a TPU or GPU backend is named.
    for platforms in ("tpu", "cuda,cpu"):
        auto = _probe("auto", JAX_PLATFORMS=platforms)
        assert auto["cpu_only"] is False and auto["512MiB"]["mmapped"] >= 512 << 20, platforms


def test_on_the_cpu_alone_every_block_comes_from_the_heap_and_stays():
    """A training step's temporary buffer of several GB (the long task's update: 2.6 GB)
    would otherwise be mapped and faulted in again at every call."""
    for every in (_probe("every_block"), _probe("auto", JAX_PLATFORMS="cpu")):
        assert every["applied"] is True and every["cpu_only"] is True
        for size, name in ((16 << 20, "16MiB"), (512 << 20, "512MiB")):
            assert every[name]["mmapped"] == 0, name
            assert every[name]["heap_after_free"] >= size, name  # not trimmed
