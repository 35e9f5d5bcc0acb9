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
x = torch.randn(2**20)
for _ in range(3):
    x.repeat(4) * 2
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    y = x.repeat(4) * 2  # two 16 MiB tensors per round, freed by the next
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _faults(tuned: bool) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, str(int(tuned))], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_tuned_malloc_reuses_pages_instead_of_faulting_them_in():
    plain, tuned = _faults(False), _faults(True)
    assert tuned * 4 < plain, (plain, tuned)

