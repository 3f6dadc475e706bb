"""Keep freed host memory in the process for the next allocation (glibc's malloc), for compiled segments.

Inductor's CPU code allocates each buffer it writes with ``empty_strided_cpu`` and frees it
when the call returns, so every compiled call of a step frees and allocates again. With
glibc's default settings much of that memory went back to the kernel between calls
(trimmed, or mapped and unmapped), and each reuse faulted its pages in anew, zeroed: a
compiled 1F1B step of the ``stack`` model (two ranks of the local runtime, 8 microbatches)
took 17,000-22,600 minor page faults where the eager step took 500-900, and ran 12-17%
slower than eager; with freed memory kept, 1,300-3,000 faults and 1.02x eager
(docs/compile.md). PyTorch's own CPU allocator caches nothing, which is why CPU training
guides recommend jemalloc or tcmalloc; this is the same effect from glibc's two settings:

- ``M_MMAP_THRESHOLD`` 32 MiB (glibc's largest): blocks below it come from the heap, not from
  a mapping of their own that ``free`` unmaps;
- ``M_TRIM_THRESHOLD`` 1 GiB: free memory at the top of a heap stays until there is that
  much of it.

The price is a resident size that stays at its high-water mark. ``keep_freed_memory`` sets
both once per process, where the C library is glibc (elsewhere it does nothing and says so).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

# glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 1 << 30

_lock = threading.Lock()
_done: bool | None = None  # the first call's answer


def _mallopt() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt may mean other things
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (module doc) once for this process; whether they are set."""
    global _done
    with _lock:
        if _done is None:
            mallopt = _mallopt()
            _done = mallopt is not None and bool(
                mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
            )
        return _done
