"""glibc malloc settings for CPU serving processes (`glm5 serve`, `glm5 generate`, the engine benches).

A serving step allocates activations of a few MiB ([tokens, hidden] hidden states, expert rows, scores).
glibc serves blocks above its mmap threshold (128 KiB at start, raised only as such blocks are freed)
with fresh mmaps and unmaps them on free, so every step touches new pages and pays a page fault per
4 KiB: in a profile of a 2,048-token prefill step the expert-row gather and weighting ops ran at about
2 GB/s, bound by faults. Raising the mmap threshold to glibc's 64-bit maximum (32 MiB) and keeping freed
memory in the heap (trim threshold, top pad) lets steps reuse the same pages: about 10% less CPU time
in prefill and 5% offline on the bench checkpoint (docs/bench-engine.md). vLLM's CPU backend gets the
same effect by preloading tcmalloc.

This changes the whole process's allocator, so it is a call made by process entry points, never a side
effect of importing or constructing glm5 objects. The price is memory held after peaks (up to the trim
threshold) instead of being returned to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters (glibc malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 * 2**30
TOP_PAD = 64 * 2**20


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD,
                top_pad: int = TOP_PAD) -> bool:
    """Apply the settings with glibc's `mallopt`. Returns False (and changes nothing) where the C library
    is not glibc (macOS, musl) or refuses a value."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: AttributeError elsewhere)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = True
    for param, value in ((M_MMAP_THRESHOLD, mmap_threshold), (M_TRIM_THRESHOLD, trim_threshold),
                         (M_TOP_PAD, top_pad)):
        ok = bool(mallopt(param, value)) and ok
    return ok


def trim_malloc() -> bool:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`); True when some were released.

    With `tune_malloc`'s 1 GiB trim threshold a process keeps what a large request freed; this returns it
    (tests/test_engine_malloc.py: 255 of 256 freed 1 MiB blocks below a live one stay resident until the
    call). `glm5 serve` calls it once the server is quiet (`IdleHook`). False where the C library is not
    glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
