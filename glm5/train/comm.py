"""Communication time and volume of a training step, measured with `torch.profiler`.

`profile_step(fn)` runs `fn()` under the profiler and returns its result and a `CommStats`: per
collective kind (all_reduce, all_gather, reduce_scatter, all_to_all, send, recv, broadcast) the number
of calls, elements moved by this rank and seconds. What counts as time:
- gloo (CPU): the wall time of the backend's own ops (`gloo:all_reduce`, ...), which includes waiting
  for the slowest peer, as a step would;
- NCCL (GPU): the device time of the NCCL kernels (`ncclDevKernel_*` / `ncclKernel_*`); the CPU-side
  `nccl:*` ops only enqueue them and give the element counts.
Elements come from the recorded input shapes (the profiler does not record dtypes: on CPU everything is
fp32, so bytes = 4 x elements there). gloo has no reduce-scatter of its own: c10d runs FSDP's as an
all-reduce of the whole input, which is counted here under reduce_scatter (matched by size to the
`c10d::_reduce_scatter_base_` call that issued it). Collectives that torch issues without a profiler
event are missed, so the numbers are a lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")
_KERNEL_KIND = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
                "sendrecv": "send", "alltoall": "all_to_all", "broadcast": "broadcast"}


@dataclass
class CommStats:
    """This rank's collectives in the profiled region."""

    calls: dict[str, int] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def as_metrics(self, step_seconds: float) -> dict:
        """Flat metrics for the log: comm_s, comm_frac (of the step) and per-kind seconds / elements."""
        out = {"comm_s": round(self.total_seconds, 6),
               "comm_frac": round(self.total_seconds / step_seconds, 4) if step_seconds > 0 else 0.0}
        for kind in sorted(self.calls):
            out[f"comm_{kind}_s"] = round(self.seconds.get(kind, 0.0), 6)
            out[f"comm_{kind}_elems"] = self.elements.get(kind, 0)
        return out


def _kind(name: str) -> str | None:
    """`gloo:all_reduce` / `nccl:all_gather` -> the collective kind (None for anything else)."""
    backend, sep, op = name.partition(":")
    if not sep or backend not in ("gloo", "nccl"):
        return None
    op = op.removesuffix("_base").removesuffix("_coalesced")
    for kind in KINDS:
        if op.startswith(kind) or op.replace("_", "").startswith(kind.replace("_", "")):
            return kind
    return None


def _kernel_kind(name: str) -> str | None:
    low = name.lower()
    if not low.startswith(("nccldevkernel", "ncclkernel")):
        return None
    for key, kind in _KERNEL_KIND.items():
        if key in low:
            return kind
    return None


def collect(events) -> CommStats:
    """CommStats from profiler events (see the module docstring)."""
    stats = CommStats()
    device_kernels = False
    for e in events:
        kind = _kernel_kind(e.name)
        if kind is not None:
            device_kernels = True
            stats.seconds[kind] = stats.seconds.get(kind, 0.0) + e.device_time_total / 1e6
    emulated: dict[int, int] = {}  # input sizes of reduce-scatters gloo runs as all-reduces
    for e in events:
        if e.name == "c10d::_reduce_scatter_base_" and len(e.input_shapes or []) > 1:
            n = math.prod(e.input_shapes[1])
            emulated[n] = emulated.get(n, 0) + 1
    for e in events:
        kind = _kind(e.name)
        if kind is None:
            continue
        if kind == "all_reduce" and e.name.startswith("gloo"):
            n = math.prod(e.input_shapes[0]) if e.input_shapes and isinstance(e.input_shapes[0], list) else -1
            if emulated.get(n):
                emulated[n] -= 1
                kind = "reduce_scatter"
        stats.calls[kind] = stats.calls.get(kind, 0) + 1
        shapes = [s for s in (e.input_shapes or []) if isinstance(s, list)]
        stats.elements[kind] = stats.elements.get(kind, 0) + sum(math.prod(s) for s in shapes[:1])
        if not device_kernels:
            stats.seconds[kind] = stats.seconds.get(kind, 0.0) + e.cpu_time_total / 1e6
    return stats


def profile_step(fn):
    """(fn(), CommStats of what it ran)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        result = fn()
    return result, collect(prof.events())
