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

