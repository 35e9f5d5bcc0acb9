"""INT8 weight-only quantisation, applied at load (`quantization="int8"`), gpt-fast style: replace modules.

W [out, in] -> int8 Wq with one fp32 scale per output channel (absmax / 127), so y = (x @ Wq^T) * scale.
Routed experts are quantised per expert ([E, out] scales), or with `int8_expert_group_size = gs` per
expert, output channel and group of gs input features (`Int8GroupExperts`, [E, in / gs, out] scales). Kept in full precision, on purpose: the
router and indexer (selection is sensitive to small score changes), `kv_b_proj` (read as a matrix by
the absorbed attention), norms and embeddings.

Matmul kernels on CPU (bench/engine.py measures them; `select_kernels` re-measures at load):
  * "int8pack": `aten._weight_int8pack_mm` with bf16 activations (fast for decode-sized M);
  * "int_mm": `torch._int_mm` with dynamic per-row int8 activations (int32 accumulate; W8A8, lossier);
  * "dequant": dequantise to fp32 on the fly and use the fp32 GEMM (the accurate reference path).
`_weight_int8pack_mm` with fp32 activations was measured 50-100x slower and is not offered.
Dims: M rows, K in features, N out features, E experts.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from glm5.model.moe import ExpertLoop, Experts

KERNELS = ("int8pack", "int_mm", "dequant")
# kernel per row bucket: "small" = M <= SMALL_M (decode), "large" (prefill); measured in docs/bench-engine.md.
# Each quantised module holds its own choice (quantize_model(kernels=...), e.g. from select_kernels).
# int8pack for both: weight-only. int_mm is ~3.5x faster at 64 rows but quantises the activations too
# (W8A8): on the converted SmolLM2 it costs +4.2 % perplexity against +0.77 % for int8pack and +0.60 %
# for dequant (bench/convert_int8.py), so it is offered (`int8_kernel = "int_mm"`), not the default.
DEFAULT_KERNELS = {"small": "int8pack", "large": "int8pack"}
SMALL_M = 16
_SKIP = ("kv_b_proj", "indexer")  # module names kept in full precision (the router is no nn.Linear)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (int8 [..., N, K], fp32 scale [..., N]): symmetric per output channel. Both come out
    contiguous whatever w's storage order (a served model's weights are stored [in, out]; the int8 kernels
    read [N, K] row-major)."""
    scale = w.float().abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(w.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `quantize_weight`: int8 [..., N, K] and scale [..., N] -> fp32 [..., N, K]."""
    return q.float() * scale[..., None]


def int8_linear(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, kernel: str | dict | None = None
                ) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (wq * scale)^T, in x's dtype. `kernel`: a name, or {"small", "large"} -> name
    chosen by row count (default DEFAULT_KERNELS)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])  # [M, K]
    if not isinstance(kernel, str):
        kernel = (kernel or DEFAULT_KERNELS)["small" if x2.shape[0] <= SMALL_M else "large"]
    if kernel == "int8pack" and x2.device.type == "cpu":
        y = torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16), wq, scale.to(torch.bfloat16))
    elif kernel == "int_mm" and x2.shape[0] > 0:
        s = x2.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0  # [M, 1]
        xq = torch.round(x2.float() / s).to(torch.int8)
        y = torch._int_mm(xq, wq.t()).float() * s * scale  # [M, N]
    else:
        y = F.linear(x2, wq.to(x2.dtype)) * scale.to(x2.dtype)
    return y.to(x.dtype).view(*shape[:-1], wq.shape[0])


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, kernels: dict | None = None):
        super().__init__()
        self.kernels = dict(kernels or DEFAULT_KERNELS)
        q, s = quantize_weight(linear.weight.data)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", s)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_linear(x, self.weight_int8, self.scale, self.kernels)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Int8Experts(ExpertLoop):
    """`Experts` with int8 gate_up [E, 2I, H] / down [E, H, I] and per-expert per-channel scales; the
    routed and soft forwards come from `ExpertLoop` over `ffn`."""

    def __init__(self, experts: nn.Module, kernels: dict | None = None):
        super().__init__()
        self.kernels = dict(kernels or DEFAULT_KERNELS)
        self.n_experts, self.inter = experts.n_experts, experts.inter
        gu, gu_s = quantize_weight(experts.gate_up_proj.data)
        dn, dn_s = quantize_weight(experts.down_proj.data)
        self.register_buffer("gate_up_int8", gu)
        self.register_buffer("gate_up_scale", gu_s)
        self.register_buffer("down_int8", dn)
        self.register_buffer("down_scale", dn_s)

    def ffn(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = int8_linear(xs, self.gate_up_int8[e], self.gate_up_scale[e], self.kernels).chunk(2, dim=-1)
        return int8_linear(F.silu(gate) * up, self.down_int8[e], self.down_scale[e], self.kernels)  # [n, H]

    @torch.no_grad()
    def get_expert(self, e: int) -> dict[str, torch.Tensor]:
        """Expert e dequantised (re-quantising it gives back the same int8 values)."""
        gate_up = dequantize_weight(self.gate_up_int8[e], self.gate_up_scale[e])  # [2I, H]
        down = dequantize_weight(self.down_int8[e], self.down_scale[e])  # [H, I]
        return {"gate": gate_up[: self.inter], "up": gate_up[self.inter:], "down": down}

    @torch.no_grad()
    def set_expert(self, e: int, parts: dict[str, torch.Tensor]) -> None:
        """Hot swap: re-quantise the given projections of expert e."""
        inter = self.inter
        for name, rows in (("gate", slice(0, inter)), ("up", slice(inter, 2 * inter))):
            if name in parts:
                self._store(self.gate_up_int8, self.gate_up_scale, e, rows, parts[name])
        if "down" in parts:
            self._store(self.down_int8, self.down_scale, e, slice(None), parts["down"])

    def _store(self, q_buf: torch.Tensor, s_buf: torch.Tensor, e: int, rows: slice, w: torch.Tensor) -> None:
        """Quantise w [rows, K] into output rows `rows` of expert e ([E, N, K] int8, [E, N] scales)."""
        q_buf[e, rows], s_buf[e, rows] = quantize_weight(w)


def quantize_groups(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (int8 [..., G, N, gs], fp32 scale [..., G, N]), G = K / gs: one scale per output
    channel and group of `group_size` input features, group-major so each group is a contiguous [N, gs]
    matrix for the int8 kernels."""
    n, k = w.shape[-2:]
    if group_size < 1 or k % group_size:
        raise ValueError(f"int8_expert_group_size={group_size} must divide the experts' input features ({k})")
    g = w.float().reshape(*w.shape[:-1], k // group_size, group_size).transpose(-3, -2)  # [..., G, N, gs]
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _dequant_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [G, N, gs] and scale [G, N] -> fp32 [N, G * gs]."""
    w = q.float() * scale[..., None]  # [G, N, gs]
    return w.transpose(0, 1).reshape(w.shape[1], -1)


class Int8GroupExperts(Int8Experts):
    """`Int8Experts` with one scale per output channel and group of `group_size` input features (the seed's
    grouped expert scales; finer than per channel where a few large weights would set a whole row's
    scale). y = sum over groups of (x_g @ Wq_g^T) * scale_g with the same int8 kernels per group; the native
    layer kernel reads per-channel experts only, so these run through the model's Python MoE forward."""

    def __init__(self, experts: nn.Module, group_size: int, kernels: dict | None = None):
        ExpertLoop.__init__(self)
        self.kernels = dict(kernels or DEFAULT_KERNELS)
        self.n_experts, self.inter, self.group_size = experts.n_experts, experts.inter, group_size
        gu, gu_s = quantize_groups(experts.gate_up_proj.data, group_size)  # [E, G, 2I, gs], [E, G, 2I]
        dn, dn_s = quantize_groups(experts.down_proj.data, group_size)  # [E, G', H, gs], [E, G', H]
        self.register_buffer("gate_up_int8", gu)
        self.register_buffer("gate_up_scale", gu_s)
        self.register_buffer("down_int8", dn)
        self.register_buffer("down_scale", dn_s)

    def _linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        gs = self.group_size
        y = None
        for g in range(q.shape[0]):
            part = int8_linear(x[:, g * gs:(g + 1) * gs].contiguous(), q[g], scale[g], self.kernels)
            y = part if y is None else y + part
        return y

    def ffn(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(xs, self.gate_up_int8[e], self.gate_up_scale[e]).chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, self.down_int8[e], self.down_scale[e])  # [n, H]

    @torch.no_grad()
    def get_expert(self, e: int) -> dict[str, torch.Tensor]:
        gate_up = _dequant_groups(self.gate_up_int8[e], self.gate_up_scale[e])  # [2I, H]
        down = _dequant_groups(self.down_int8[e], self.down_scale[e])  # [H, I]
        return {"gate": gate_up[: self.inter], "up": gate_up[self.inter:], "down": down}

    def _store(self, q_buf: torch.Tensor, s_buf: torch.Tensor, e: int, rows: slice, w: torch.Tensor) -> None:
        """Grouped buffers are [E, G, N, gs] / [E, G, N]: output rows are dim 2 / 2."""
        q_buf[e, :, rows], s_buf[e, :, rows] = quantize_groups(w, self.group_size)


def quantize_model(model: nn.Module, kernels: dict | None = None, expert_group_size: int | None = None) -> nn.Module:
    """Swap every eligible nn.Linear for Int8Linear and every expert block for Int8Experts (per output
    channel) or, with `expert_group_size`, Int8GroupExperts, in place; `kernels` ({"small", "large"} ->
    kernel name) defaults to DEFAULT_KERNELS."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if any(s in full for s in _SKIP):
                continue
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child, kernels))
            elif isinstance(child, Experts):
                setattr(module, child_name, Int8Experts(child, kernels) if expert_group_size is None
                        else Int8GroupExperts(child, expert_group_size, kernels))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers (what stays resident for the weights)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def time_kernel(kernel: str, m: int, k: int, n: int, iters: int = 20) -> float:
    """Seconds per call of one kernel on a random [m, k] x [n, k]^T problem."""
    w = torch.randn(n, k) * 0.02
    q, s = quantize_weight(w)
    x = torch.randn(m, k)
    int8_linear(x, q, s, kernel)
    t = time.perf_counter()
    for _ in range(iters):
        int8_linear(x, q, s, kernel)
    return (time.perf_counter() - t) / iters


def select_kernels(k: int, n: int, iters: int = 20) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """Measure every kernel at M=1 and M=64 for a K x N weight -> (fastest per bucket, seconds per call)."""
    times = {bucket: {kern: time_kernel(kern, m, k, n, iters) for kern in KERNELS}
             for bucket, m in (("small", 1), ("large", 64))}
    return {bucket: min(t, key=t.get) for bucket, t in times.items()}, times
