"""policyopt.runtime: glibc keeps freed multi-megabyte blocks after keep_freed_host_memory."""

import ctypes
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# In a fresh interpreter: is a 16 MiB block mmapped (counted in mallinfo2().hblkhd) or
# taken from the heap, before and after the call?
_PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    from policyopt import runtime
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks "
                     "fordblks keepcost").split()]
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mmapped_bytes_of_a_16mib_block():
        before = libc.mallinfo2().hblkhd
        block = libc.malloc(16 << 20)
        delta = libc.mallinfo2().hblkhd - before
        libc.free(block)
        return delta

    tune = sys.argv[1] == "tune"
    applied = runtime.keep_freed_host_memory() if tune else None
    print(applied, mmapped_bytes_of_a_16mib_block())
""")


def _probe(mode):
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_keep_freed_host_memory_serves_large_blocks_from_the_heap():
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("mallinfo2 needs glibc >= 2.33")
    _, default_mmapped = _probe("default")
    applied, tuned_mmapped = _probe("tune")
    assert default_mmapped >= 16 << 20  # glibc's default: a 16 MiB block is mmapped
    assert applied == "True"
    assert tuned_mmapped == 0  # after the call it comes from the heap and is kept when freed
