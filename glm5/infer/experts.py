"""Routed-expert weight access shared by hot swap, INT8 and offload: parse/validate swap updates, write
one expert into whatever expert module a layer has (fused fp tensors, INT8, offloaded LRU), and
collect expert-cache statistics; and `VersionedExperts`, the module a hot swap puts in front of a layer's
experts while requests started before it run (glm5/infer/hot_swap.py). Expert e's weights are gate
[I, H], up [I, H], down [H, I]. (The expert computation itself lives in glm5/model/moe.py; INT8, offload
and hot swap swap the expert module.)

Dims: N tokens, H hidden, A experts per token, I expert FFN width, K held experts.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from glm5.model.config import ModelConfig
from glm5.model.moe import MoE, TaggedExperts, swiglu

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


def experts_module(model, layer: int) -> nn.Module:
    """The module holding `layer`'s current expert weights (behind a `VersionedExperts`: its inner one)."""
    ex = model.model.layers[layer].mlp.experts
    return ex.inner if isinstance(ex, VersionedExperts) else ex


class VersionedExperts(TaggedExperts):
    """A layer's experts module (`inner`, current weights) plus the weights its swapped experts had at
    `version`: rows tagged `version` run their assignments to those experts on the held weights, every
    other assignment runs on `inner` (the same sort, kernels and dtype as without a swap)."""

    def __init__(self, inner: nn.Module, version: int, old: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.inner, self.version = inner, version
        self.n_experts, self.inter = inner.n_experts, inner.inter
        self.old = old  # expert -> (gate_up [2I, H], down [H, I]) at `version`
        device = next(iter(old.values()))[0].device
        self.swapped = torch.tensor(sorted(old), device=device)  # [K] expert ids held

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None = None,
                row_tags: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H], idx/weights [N, A], keep [N, A] | None, row_tags [N] | None -> [N, H]."""
        if row_tags is None:
            return self.inner(x, idx, weights, keep)
        held = (row_tags == self.version)[:, None] & torch.isin(idx, self.swapped)  # [N, A]
        if keep is not None:
            held &= keep
        routed = self.inner(x, idx, weights, ~held if keep is None else keep & ~held)
        for e, (gate_up, down) in self.old.items():
            tok, slot = torch.where(held & (idx == e))
            if tok.numel():
                y = swiglu(x[tok], gate_up, down) * weights[tok, slot, None].to(x.dtype)
                routed = routed.index_add(0, tok, y.to(routed.dtype))
        return routed

    def forward_dense(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Soft MoE is never held (glm5/infer/hot_swap.py): the current weights."""
        return self.inner.forward_dense(x, probs)


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


@torch.no_grad()
def read_expert(module, e: int) -> dict[str, torch.Tensor]:
    """Expert e's current gate [I, H], up [I, H], down [H, I] (a copy, dequantised for INT8), from any kind
    of expert module: what a rollback writes back and what requests pinned to the old version run on."""
    if hasattr(module, "get_expert"):  # INT8 / offloaded experts know their own storage
        return module.get_expert(e)
    inter = module.inter
    gate_up = module.gate_up_proj[e]
    return {"gate": gate_up[:inter].clone(), "up": gate_up[inter:].clone(), "down": module.down_proj[e].clone()}


def apply_expert_updates(model, grouped: dict[tuple[int, int], dict]) -> None:
    for (layer, expert), parts in grouped.items():
        write_expert(experts_module(model, layer), expert, parts)


def expert_stats(model) -> dict:
    """Hit/miss counters of the offloaded-expert caches (empty when nothing is offloaded)."""
    caches = {}
    for i, layer in enumerate(model.model.layers):
        ex = experts_module(model, i) if isinstance(layer.mlp, MoE) else None
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
