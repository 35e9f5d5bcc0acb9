"""Transparent huge pages for the served weights on CPU (`EngineConfig.huge_pages`).

Serving on CPU streams every weight of the step from memory (decode is bandwidth-bound). With 4 KiB pages
the hardware prefetchers stop at every page boundary and each page needs its own TLB entry; backing large
tensors by 2 MiB pages keeps the stream going. Linux gives a mapping huge pages when it is advised
(`madvise(MADV_HUGEPAGE)`) and transparent huge pages are set to `always` or `madvise`
(/sys/kernel/mm/transparent_hugepage/enabled); elsewhere this does nothing. Measured here (1 thread, the
bench's 64-expert checkpoint, 64 decode rows through 7 MoE layers): 41.7-44.9 ms on 4 KiB pages, 35.6-36.0
ms on 2 MiB pages; the whole offline run of `bench/vllm_cpu.py` 1.02-1.04x. The KV cache is left on 4 KiB
pages: its pages are first touched while serving, and faulting in huge pages there (with the kernel's
default `defrag=madvise`, a synchronous compaction) made the same run 0.97x.

`huge_empty` allocates a tensor in its own mapping aligned to 2 MiB and advised before any page is touched
(the first write then faults in huge pages); `rehome` moves a module's large parameters and buffers there,
keeping their shapes, strides (the transposed weight layout), names and values.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import torch
from torch import nn

HUGE = 2 << 20  # bytes per huge page (x86-64, arm64 with 4 KiB base pages)
MADV_HUGEPAGE = 14
MIN_BYTES = HUGE  # smaller tensors gain nothing (they fit in one huge page's worth of TLB reach anyway)


@functools.cache
def _madvise():
    """libc's madvise, or None where it cannot be used (not Linux, THP off or missing)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    return _madvise() is not None


def huge_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat uninitialised CPU tensor of `numel` elements in a fresh anonymous mapping, 2 MiB-aligned and
    advised for huge pages before any page is touched (torch.empty where huge pages are unavailable)."""
    madvise = _madvise()
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if madvise is None or nbytes < MIN_BYTES:
        return torch.empty(numel, dtype=dtype)
    # MAP_PRIVATE: a shared anonymous mapping is shmem, whose huge pages are governed by another setting
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # untouched: huge pages on first write
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    skip = -addr % HUGE
    if madvise(addr + skip, nbytes // HUGE * HUGE, MADV_HUGEPAGE) != 0:
        return torch.empty(numel, dtype=dtype)
    flat = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    return flat[skip:skip + nbytes].view(dtype)


def rehome(module: nn.Module, min_bytes: int = 1 << 16) -> int:
    """Move the module's CPU parameters and buffers of at least `min_bytes` into huge-page memory: one
    arena holding them all back to back (64-byte aligned), so that the many sub-2 MiB projection
    weights share huge pages too. In place (`t.data` is replaced: shapes, strides - the transposed
    layout -, names and values are kept; serving only, no optimiser involved). Returns how many tensors
    moved; 0 where huge pages are unavailable."""
    if not available():
        return 0
    tensors, seen, total = [], set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        nbytes = t.numel() * t.element_size()
        if id(t) in seen or t.device.type != "cpu" or nbytes < min_bytes or not _dense(t):
            continue  # (a view into a larger tensor - tied or sliced weights - is left where it is)
        seen.add(id(t))
        tensors.append((t, total))
        total += (nbytes + 63) // 64 * 64
    if not tensors:
        return 0
    arena = huge_empty(total, torch.uint8)
    for t, offset in tensors:
        nbytes = t.numel() * t.element_size()
        t.data = arena[offset:offset + nbytes].view(t.dtype).as_strided(t.shape, t.stride()).copy_(t.data)
    return len(tensors)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly its span of memory (contiguous or a permutation of it)."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0) == t.numel()
