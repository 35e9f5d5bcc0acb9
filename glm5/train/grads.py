"""Gradient buffers kept from step to step (one process), with set-to-None semantics preserved.

Freeing every gradient after the optimizer step (`zero_grad(set_to_none=True)`) hands the large
buffers back to the OS: glibc maps allocations of 32 MiB and more (the [E, 2I, H] expert stacks of
`small`) fresh each time, and the next backward pays a page fault per 4 KiB page it writes -- 42k faults,
~9% of the `small` CPU step. `KeptGrads` zeroes the buffers in place instead, so that the next
backward adds into them (the expert loop's backward writes straight into an existing `.grad`, see
glm5/model/moe.py), and afterwards sets back to None every gradient the step did not touch (its
tensor and version counter unchanged since zeroing): a parameter without a gradient this step (the
MTP layer on a blank-infilling step, an indexer on a dense step) is skipped by the optimizer as it
would be after set_to_none, instead of taking a momentum and weight-decay step on zeros.
"""

from __future__ import annotations

import torch


class KeptGrads:
    """`zero(params)` after the optimizer step; `drop_untouched()` after the step's backward passes."""

    def __init__(self) -> None:
        self._zeroed: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (param, its grad, version after zeroing)

    @torch.no_grad()
    def zero(self, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        self._zeroed = [(p, p.grad, p.grad._version) for p in params if p.grad is not None]

    def drop_untouched(self) -> None:
        for p, grad, version in self._zeroed:
            if p.grad is grad and grad._version == version:
                p.grad = None
        self._zeroed = []
