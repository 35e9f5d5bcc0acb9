"""Native CPU kernels in the served model (`EngineConfig.kernels`), by module swap: RMSNorm modules become
`NativeRMSNorm`, [in, out]-stored linear layers `NativeLinear`, the routed experts of each MoE layer
`NativeExperts` (same parameters, same state_dict keys, in-place writes such as
expert hot swap still land in them) whose inference forward calls the compiled kernel of glm5/native.
Every other case (autograd, non-fp32, the native [out, in] layout) runs the inherited PyTorch forward, so
the swap never changes what the model computes, only how fast. Measured on the bench's 64-expert
checkpoint (7 MoE layers, 1 thread, `grouped_experts` time / kernel time): 3.1x for one token, 1.9x for 8 and
64 decode rows, 1.3-1.8x for 256-2,048 prefill tokens (BLAS GEMMs plus the gather/scale/scatter around them
vs one pass per expert; docs/bench-engine.md).
"""

from __future__ import annotations

import torch
from torch import nn

from glm5.model.layers import RMSNorm
from glm5.model.moe import Experts
from glm5.native import NativeKernels, rows_stride

from .layout import is_transposed


class NativeExperts(Experts):
    """`Experts` whose no-grad fp32 CPU forward runs `NativeKernels.moe` over the [in, out]-stored weights."""

    kernels: NativeKernels

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        gu, dn = self.gate_up_proj, self.down_proj
        if (torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32
                or gu.dtype != torch.float32 or not (is_transposed(gu) and is_transposed(dn))):
            return super().forward(x, idx, weights, keep)
        w = weights if keep is None else weights * keep
        return self.kernels.moe(x.contiguous(), idx, w, gu.transpose(-2, -1), dn.transpose(-2, -1))


class NativeRMSNorm(RMSNorm):
    """`RMSNorm` whose no-grad fp32 CPU forward is one kernel call instead of PyTorch's composite
    (pow, mean, add, rsqrt, two products: ~27 us a call for one 384-wide row; the decode step runs 4 per
    layer)."""

    kernels: NativeKernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ld = self.weight, rows_stride(x)
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" or ld is None
                or type(w) is not nn.Parameter or w.dtype != torch.float32):
            return super().forward(x)
        return self.kernels.rms_norm(x, w, self.eps, ld)


# NativeLinear runs the kernel for at most this many rows and weights up to this size: measured at 1 thread
# on the bench checkpoint's projections (MKL / kernel time, cold weights): 1.2-1.9x at 1 row, 1.1-1.9x at 4,
# 0.9-1.4x at 8; the 12.6 MB LM head 0.73x at 1 row (BLAS streams a large weight well, a small one at 6-12
# GB/s).
LINEAR_MAX_ROWS = 4
LINEAR_MAX_BYTES = 4 << 20


class NativeLinear(nn.Linear):
    """`nn.Linear` whose no-grad fp32 CPU forward on a few rows (decode) runs `NativeKernels.linear` over the
    [in, out]-stored weight; everything else (more rows, other layouts, autograd) is `F.linear`."""

    kernels: NativeKernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ld = self.weight, rows_stride(x)
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" or w.dtype != torch.float32
                or not 0 < x.numel() <= LINEAR_MAX_ROWS * w.shape[1] or w.stride() != (1, w.shape[0])
                or type(w) is not nn.Parameter or w.numel() * 4 > LINEAR_MAX_BYTES or ld is None):
            return super().forward(x)
        return self.kernels.linear(x, w, self.bias, ld)


def _swapped(cls: type, mod: nn.Module, kernels: NativeKernels, shared: tuple[str, ...]) -> nn.Module:
    """An instance of `cls` (a native subclass of mod's class) holding mod's attributes `shared` - the same
    Parameter objects, not copies - and the kernels."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    for name in shared:
        setattr(new, name, getattr(mod, name))
    new.kernels = kernels
    return new


def use_native_kernels(model: nn.Module, kernels: NativeKernels) -> int:
    """Swap every plain `Experts` (not LoRA-parametrised), `RMSNorm` and [in, out]-stored `nn.Linear` module
    for its native subclass; returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Experts and not nn.utils.parametrize.is_parametrized(child):
                setattr(parent, name, _swapped(NativeExperts, child, kernels,
                                               ("n_experts", "inter", "gate_up_proj", "down_proj")))
                n += 1
            elif type(child) is RMSNorm and not nn.utils.parametrize.is_parametrized(child):
                setattr(parent, name, _swapped(NativeRMSNorm, child, kernels, ("weight", "eps")))
                n += 1
            elif (type(child) is nn.Linear and not nn.utils.parametrize.is_parametrized(child)
                  and is_transposed(child.weight)):  # (kv_b_proj stays: the absorbed attention reads it as a matrix)
                setattr(parent, name, _swapped(NativeLinear, child, kernels,
                                               ("in_features", "out_features", "weight", "bias")))
                n += 1
    return n
