"""Weight storage order for serving on CPU (`EngineConfig.weight_layout`).

nn.Linear stores W [out, in] row-major and computes x @ W^T. For the few rows of a decode step, CPU GEMM
streams the weight faster when it is stored the other way round, [in, out] row-major, i.e. W^T contiguous:
measured here (1 thread, weights cold in cache) 2.2x for one row through a [1024, 384] or the
[8192, 384] LM head, 1.2-1.6x for 1-16 rows through the attention projections, 1.3x for the grouped
expert matmuls of a 64-sequence decode, about 1.02x at prefill sizes. Same products, same values for
more than one row; one row (a GEMV) may differ in the last bits (summation order).

`transpose_weights` re-stores the parameters in place as a transposed view of W^T-contiguous memory:
shapes, names, `state_dict` keys and the model's forward are unchanged (F.linear(x, W) then reads W^T
contiguous), no second copy is kept, and in-place writes (expert hot swap, LoRA merges) land in the new
storage. Left as they are: `kv_b_proj` (the absorbed attention reads it as [H, E+V, R] matrices),
embeddings, norms, and quantised or offloaded modules (they hold their own formats).
"""

from __future__ import annotations

import torch
from torch import nn

from glm5.model.moe import Experts

KEEP = ("kv_b_proj",)  # read as a matrix by the absorbed attention, not through F.linear


def _restore(p: nn.Parameter) -> None:
    """p [..., out, in] -> the same values, stored as [..., in, out] row-major (p stays [..., out, in])."""
    p.data = p.data.transpose(-2, -1).contiguous().transpose(-2, -1)


def transpose_weights(model: nn.Module) -> int:
    """Re-store every plain nn.Linear weight (except KEEP) and the fused expert weights W^T-contiguous.
    Returns how many tensors were re-stored. Serving only: the model must not be trained afterwards
    (optimizers and FSDP expect the native layout)."""
    n = 0
    for name, mod in model.named_modules():
        if type(mod) is nn.Linear and not any(k in name for k in KEEP):
            _restore(mod.weight)
            n += 1
        elif type(mod) is Experts and not nn.utils.parametrize.is_parametrized(mod):
            _restore(mod.gate_up_proj)
            _restore(mod.down_proj)
            n += 2
    return n


def is_transposed(w: torch.Tensor) -> bool:
    """Whether w [..., out, in] is stored [..., in, out] row-major (transpose_weights' layout)."""
    return w.dim() >= 2 and w.transpose(-2, -1).is_contiguous() and not w.is_contiguous()
