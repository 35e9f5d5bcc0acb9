"""Expert offload: routed experts stay memory-mapped in the checkpoint's safetensors files and are
materialised on demand into a bounded LRU cache, so a model whose experts exceed RAM still runs.

`load_offloaded(path, ...)` builds the model on the meta device, swaps every `Experts` block for an
`OffloadedExperts` (no parameters), then loads only the non-expert weights. Each forward looks up
the experts its tokens were routed to: a hit uses the resident copy, a miss reads the expert from the
mapped file (dequantising FP8) and may evict the least recently used one. The cache is bounded by
`max_resident_experts` per MoE layer or by a byte budget shared by all layers. Hot-swapped experts
are kept as overrides (the checkpoint files are never written).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from glm5.core.io import LazyTensors, safetensors_files
from glm5.model.config import ModelConfig
from glm5.model.generation_config import GenerationConfig
from glm5.model.hf_adapter import cast_model, dequantize_fp8, load_hf_state_dict
from glm5.model.model import GLM5ForCausalLM
from glm5.model.moe import ExpertLoop, swiglu



class ExpertCache:
    """LRU of materialised experts keyed by (layer, expert), bounded by a count or by bytes."""

    def __init__(self, max_items: int | None = None, max_bytes: int | None = None):
        if max_items is None and max_bytes is None:
            raise ValueError("an expert cache needs max_items or max_bytes")
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0

    def get(self, key, load):
        if key in self.items:
            self.hits += 1
            self.items.move_to_end(key)
            return self.items[key]
        self.misses += 1
        value = load()
        self.put(key, value)
        return value

    def put(self, key, value) -> None:
        self.drop(key)
        self.items[key] = value
        self.nbytes += sum(t.nbytes for t in value)
        while len(self.items) > 1 and self._over():
            _, old = self.items.popitem(last=False)
            self.nbytes -= sum(t.nbytes for t in old)

    def drop(self, key) -> None:
        old = self.items.pop(key, None)
        if old is not None:
            self.nbytes -= sum(t.nbytes for t in old)

    def _over(self) -> bool:
        return ((self.max_items is not None and len(self.items) > self.max_items)
                or (self.max_bytes is not None and self.nbytes > self.max_bytes))


class OffloadedExperts(ExpertLoop):
    """Drop-in for `Experts`: the `ExpertLoop` forwards, weights fetched per expert through an `ExpertCache`."""

    def __init__(self, cfg: ModelConfig, layer: int, tensors: LazyTensors, cache: ExpertCache,
                 dtype: torch.dtype, device, fp8_block=(128, 128)):
        super().__init__()
        self.n_experts, self.inter, self.layer = cfg.n_routed_experts, cfg.moe_intermediate_size, layer
        self.tensors, self.cache, self.dtype, self.device = tensors, cache, dtype, torch.device(device)
        self.fp8_block = fp8_block
        self.overrides: dict[int, dict[str, torch.Tensor]] = {}  # hot-swapped experts

    def _read(self, e: int, part: str) -> torch.Tensor:
        if part in self.overrides.get(e, {}):
            return self.overrides[e][part]
        name = f"model.layers.{self.layer}.mlp.experts.{e}.{part}_proj.weight"
        w = self.tensors.get(name)
        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            w = dequantize_fp8(w, self.tensors.get(name + "_scale_inv"), self.fp8_block)
        return w

    def _load(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate_up = torch.cat([self._read(e, "gate"), self._read(e, "up")], dim=0)  # [2I, H]
        return (gate_up.to(self.device, self.dtype).contiguous(),
                self._read(e, "down").to(self.device, self.dtype).contiguous())  # [H, I]

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.get((self.layer, e), lambda: self._load(e))

    def ffn(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        return swiglu(xs, *self.expert(e))

    def get_expert(self, e: int) -> dict[str, torch.Tensor]:
        return {part: self._read(e, part).to(self.dtype).clone() for part in ("gate", "up", "down")}

    def set_expert(self, e: int, parts: dict[str, torch.Tensor]) -> None:
        self.overrides.setdefault(e, {}).update({k: v.detach().clone() for k, v in parts.items()})
        self.cache.drop((self.layer, e))

def load_offloaded(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu",
                   max_resident_experts: int | None = None, expert_cache_bytes: int | None = None
                   ) -> GLM5ForCausalLM:
    """A checkpoint with every routed expert left in the mapped files (see module docstring)."""
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    tensors = LazyTensors(safetensors_files(path))
    qc = cfg.extra.get("quantization_config") or {}
    block = tuple(qc.get("weight_block_size") or (128, 128))
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg)
    shared = ExpertCache(max_bytes=expert_cache_bytes) if max_resident_experts is None else None
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            cache = shared or ExpertCache(max_items=max_resident_experts)
            mlp.experts = OffloadedExperts(cfg, layer.layer_idx, tensors, cache, dtype, device, block)
    model.to_empty(device=device)
    cast_model(model, dtype)
    model.model.inv_freq.copy_(cfg.rope_inv_freq())
    load_hf_state_dict(model, tensors, strict=False)
    model.generation_config = GenerationConfig.from_pretrained(path) or model.generation_config
    return model.eval()
