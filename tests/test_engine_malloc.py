"""`tune_malloc` (glm5/infer/malloc.py): after it, a loop that allocates and frees MiB-sized tensors reuses
heap pages instead of faulting in fresh mmaps every round (counted with getrusage, in child processes so
this test process keeps its allocator)."""

import platform
import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from glm5.infer.malloc import tune_malloc
if sys.argv[1] == "1":
    assert tune_malloc()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(1, 31):  # each size once, growing: glibc's own threshold only follows freed sizes, so
    y = torch.ones(mib * 2**18)  # untuned every tensor is a fresh mmap (~120K faults); tuned, heap pages
    del y  # are reused (the heap grows to 30 MiB once: ~8K faults)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(tuned: bool) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, str(int(tuned))], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_tuned_malloc_reuses_pages_instead_of_faulting_them_in():
    plain, tuned = _faults(False), _faults(True)
    assert tuned * 4 < plain, (plain, tuned)



TRIM_CHILD = """
import torch
from glm5.infer.malloc import trim_malloc, tune_malloc
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024
assert tune_malloc()
xs = [torch.ones(2**18) for _ in range(256)]  # 256 MiB in 1 MiB heap blocks (under the mmap threshold)
del xs[:-1]  # all but the last: the freed pages sit below it, so no trim from the top can reach them
held = rss()
assert trim_malloc()
print(held, rss())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_gives_freed_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], capture_output=True, text=True, check=True)
    held, trimmed = map(int, out.stdout.split())
    assert held - trimmed > 200, (held, trimmed)  # the tuned heap kept them (1 GiB trim threshold) until asked
