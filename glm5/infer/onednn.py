"""oneDNN GEMMs for prefill-sized steps on CPU (`EngineConfig.gemm`).

PyTorch's CPU `mm` runs on MKL, which on AMD processors does not use AVX-512; oneDNN (shipped inside the
PyTorch wheel, the library vLLM's CPU backend runs its linear layers on) does. Measured at 1 thread on an
AVX-512 AMD EPYC (2026-12-07, the bench checkpoint's shapes, fp32): `mm` 80-89 GFLOP/s from 64 rows up,
oneDNN on a prepacked weight 150-208 GFLOP/s (2.0-2.4x); at 16 rows 1.2-3.8x; at 1-4 rows oneDNN is slower
(0.3-0.7x at 1 row), where the native GEMV kernels serve anyway. On a CPU where MKL is at its best the two
are close, so "auto" measures both once at engine build (`onednn_pays`).

`OneDNNWeight` holds one weight [out, in] prepacked (a second copy of it: the dense weight stays for the
decode kernels and everything else) and repacks it when the weight was written in place (an expert hot swap
bumps the tensor's version counter), so a packed copy is never stale. The operators are PyTorch's own
(`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, what inductor's CPU weight freezing emits).
"""

from __future__ import annotations

import time

import torch

# Steps with at least this many rows take the oneDNN GEMM (fewer: the native GEMV or `mm`): measured as
# above, oneDNN / mm 1.2-3.8x at 16 rows, 0.58-1.86x at 4.
ONEDNN_MIN_ROWS = 16
# the batch size the weights are packed for (oneDNN's blocking hint; any row count runs on the result)
PACK_ROWS = 256
# "auto" uses oneDNN when it is at least this much faster than `mm` on the model's hidden x hidden GEMM
AUTO_MIN_SPEEDUP = 1.2


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class OneDNNWeight:
    """weight [out, in] (any strides; or weight[index] of a stacked [E, out, in] one) prepacked for oneDNN;
    `linear(x [..., in], bias) -> [..., out]`."""

    def __init__(self, weight: torch.Tensor, index: int | None = None):
        self.source, self.index = weight, index
        self.version = -1
        self.packed = self._pack()

    def _pack(self) -> torch.Tensor:
        self.version = self.source._version
        w = self.source.detach()
        return torch.ops.mkldnn._reorder_linear_weight(w if self.index is None else w[self.index], PACK_ROWS)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.source._version != self.version:  # written in place since it was packed
            self.packed = self._pack()
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        padded = padded_rows(m)
        if padded != m:  # a bounded set of shapes: oneDNN builds a primitive per new one (~0.5 ms each)
            rows = torch.cat([rows, rows.new_zeros(padded - m, rows.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return y[:m].view(*x.shape[:-1], y.shape[-1])


    @staticmethod
    def apply(x: torch.Tensor, weight: OneDNNWeight) -> torch.Tensor:
        """`F.linear`'s argument order (for `moe.swiglu`'s `linear`)."""
        return weight.linear(x)


def padded_rows(m: int) -> int:
    """Row counts rounded up to a bucket (16 up to 512, 64 up to 2,048, then 256): oneDNN creates a GEMM
    primitive for every new shape, 0.5 ms each here (measured: 383 new row counts 275 ms, the same again
    88 ms), and keeps 1,024 of them, so exact row counts (every prefill chunk and every expert's share
    differ) would rebuild them all the time. Rows are independent, so padding changes no result."""
    step = 16 if m <= 512 else 64 if m <= 2048 else 256
    return -(-m // step) * step


def _seconds(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def onednn_pays(hidden: int) -> bool:
    """Whether oneDNN's GEMM beats `mm` here by AUTO_MIN_SPEEDUP on a [PACK_ROWS, k] x [k, k] product,
    k = min(hidden, 1024) (best of 5 each: a few milliseconds to ~0.1 s in all)."""
    if not available():
        return False
    k = min(hidden, 1024)
    x, w = torch.randn(PACK_ROWS, k), torch.randn(k, k)
    try:
        packed = OneDNNWeight(w)
    except RuntimeError:  # a PyTorch build whose oneDNN cannot run this
        return False
    with torch.no_grad():
        ours = _seconds(lambda: packed.linear(x))
        theirs = _seconds(lambda: torch.nn.functional.linear(x, w))
    return theirs >= AUTO_MIN_SPEEDUP * ours
