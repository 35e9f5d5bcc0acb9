"""Routed-expert weight access shared by hot swap, INT8 and offload: parse/validate swap updates, write
one expert into whatever expert module a layer has (fused fp tensors, INT8, offloaded LRU), and
collect expert-cache statistics. Expert e's weights are gate [I, H], up [I, H], down [H, I].
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from glm5.model.config import ModelConfig

EXPERT_KEY = re.compile(r"(?:model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.)?(gate|up|down)_proj(?:\.weight)?")
PARTS = ("gate", "up", "down")


def parse_expert_updates(updates: dict, cfg: ModelConfig, dtype: torch.dtype) -> dict[tuple[int, int], dict]:
    """-> {(layer, expert): {"gate"|"up"|"down": tensor}}, all checked (layer is MoE, expert in range,
    shape, finite). Raises ValueError naming the first bad entry; nothing is applied here."""
    grouped: dict[tuple[int, int], dict] = {}
    for key, value in updates.items():
        if isinstance(key, tuple):
            layer, expert = map(int, key)
            if not isinstance(value, dict):
                raise ValueError(f"update for {key}: expected a dict of projection name -> tensor")
            items = value.items()
        else:
            m = EXPERT_KEY.fullmatch(str(key))
            if m is None or m[1] is None:
                raise ValueError(f"{key}: not an expert weight name (model.layers.L.mlp.experts.E.gate_proj.weight)")
            layer, expert = int(m[1]), int(m[2])
            items = [(key, value)]
        for name, t in items:
            m = EXPERT_KEY.fullmatch(str(name))
            if m is None:
                raise ValueError(f"({layer}, {expert}) {name}: expected gate_proj, up_proj or down_proj")
            grouped.setdefault((layer, expert), {})[m[3]] = t
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    for (layer, expert), parts in grouped.items():
        if layer not in cfg.moe_layers:
            raise ValueError(f"layer {layer} is not an MoE layer ({cfg.moe_layers})")
        if not 0 <= expert < cfg.n_routed_experts:
            raise ValueError(f"expert {expert} out of range [0, {cfg.n_routed_experts})")
        for part, t in parts.items():
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shapes[part]:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"layer {layer} expert {expert} {part}_proj: shape {got} != {list(shapes[part])}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"layer {layer} expert {expert} {part}_proj holds NaN or Inf")
            parts[part] = t.to(dtype)
    return grouped


def sort_by_expert(idx: torch.Tensor, n_experts: int, keep=None):
    """Assignments grouped by expert: (order [M] into the flat N*A list, token [M], counts [E])."""
    A = idx.shape[1]
    flat = idx.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, n_experts)  # dropped -> a virtual expert E
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts]
    order = order[: int(counts.sum())]
    return order, order // A, counts


def expert_loop(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, keep, n_experts: int, ffn) -> torch.Tensor:
    """Routed-expert output [N, H] for x [N, H], idx/weights [N, A]: tokens sorted by expert, then
    `ffn(e, rows [n, H]) -> [n, H]` once per expert that received tokens (the inference hot path:
    contiguous slices, no per-expert views of unused experts)."""
    if x.shape[0] == 1 and keep is None:  # one token (batch-1 decode): no sort, same summation order
        out = torch.zeros_like(x)  # [1, H]
        w = weights[0].tolist()
        for a, e in sorted(enumerate(idx[0].tolist()), key=lambda ae: ae[1]):
            out += ffn(e, x) * w[a]  # w[a] came from fp32: the product is the one the sorted path forms
        return out
    order, token, counts = sort_by_expert(idx, n_experts, keep)
    xs = x[token]  # [M, H]
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            outs.append(ffn(e, xs[start:start + n]))
            start += n
    ys = torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])
    ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token, ys)


class InferenceExperts(nn.Module):
    """The model's fused `Experts` weights (shared, not copied) with the inference expert loop: the
    training-oriented forward unbinds every expert's weight per call, which costs more than the
    matmuls at decode batch sizes."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.n_experts, self.inter = experts.n_experts, experts.inter
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]

    def forward(self, x, idx, weights, keep=None) -> torch.Tensor:
        return expert_loop(x, idx, weights, keep, self.n_experts, self._ffn)

    def _ffn(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(xs, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


def use_inference_experts(model) -> None:
    """Swap every plain `Experts` block for `InferenceExperts` (same parameters), in place."""
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and type(getattr(mlp, "experts", None)).__name__ == "Experts":
            mlp.experts = InferenceExperts(mlp.experts)


def experts_module(model, layer: int):
    return model.model.layers[layer].mlp.experts


@torch.no_grad()
def write_expert(module, e: int, parts: dict[str, torch.Tensor]) -> None:
    """Write some of expert e's projections into an expert module of any kind."""
    if hasattr(module, "set_expert"):  # INT8 / offloaded experts know their own storage
        module.set_expert(e, parts)
        return
    inter = module.inter
    if "gate" in parts:
        module.gate_up_proj[e, :inter].copy_(parts["gate"])
    if "up" in parts:
        module.gate_up_proj[e, inter:].copy_(parts["up"])
    if "down" in parts:
        module.down_proj[e].copy_(parts["down"])


def apply_expert_updates(model, grouped: dict[tuple[int, int], dict]) -> None:
    for (layer, expert), parts in grouped.items():
        write_expert(experts_module(model, layer), expert, parts)


def expert_stats(model) -> dict:
    """Hit/miss counters of the offloaded-expert caches (empty when nothing is offloaded)."""
    caches = {}
    for layer in model.model.layers:
        ex = getattr(getattr(layer, "mlp", None), "experts", None)
        cache = getattr(ex, "cache", None)
        if cache is not None:
            caches[id(cache)] = cache  # a byte-budget cache is shared by every layer
    if not caches:
        return {}
    hits = sum(c.hits for c in caches.values())
    misses = sum(c.misses for c in caches.values())
    return {"expert_cache_hits": hits, "expert_cache_misses": misses,
            "expert_cache_resident": sum(len(c.items) for c in caches.values()),
            "expert_cache_bytes": sum(c.nbytes for c in caches.values()),
            "expert_cache_hit_rate": hits / (hits + misses) if hits + misses else 0.0}
