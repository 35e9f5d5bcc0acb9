"""Expert hot swap (`POST /admin/experts`, `GET /admin/experts`): validation of uploaded expert weights.

The upload is a raw safetensors file (request body) whose tensors are named like the HF checkpoint keys
`model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight`. Everything is checked against the served
model's config (MoE layer, expert index, shape, dtype, finite values) before the engine is touched; the
swap itself runs between two engine steps (see `AsyncEngine.swap_experts`).
"""

from __future__ import annotations

import hashlib
import re

import torch

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from glm5.core.io import all_finite
from glm5.infer.engine import LLMEngine

from glm5.serve.common import APIError

EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def parse_expert_upload(body: bytes, engine: LLMEngine) -> tuple[dict[str, torch.Tensor], dict]:
    """Validate an upload; -> (HF name -> tensor, info for the version log). Raises APIError(400)."""
    if not body:
        raise APIError(400, "body: expected a safetensors file of expert weights", param="body")
    try:
        tensors = load_safetensors(body)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as e:
        raise APIError(400, f"body: not a valid safetensors file: {e}", param="body") from e
    if not tensors:
        raise APIError(400, "body: the safetensors file holds no tensors", param="body")
    cfg = engine.model_config
    dtype = getattr(torch, engine.config.dtype)  # the served dtype (resolved: fp32 on CPU)
    moe_layers = set(cfg.moe_layers)
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    pairs = set()
    for name, t in tensors.items():
        m = EXPERT_KEY.fullmatch(name)
        if m is None:
            raise APIError(400, f"{name}: not an expert weight name "
                                "(model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight)", param=name)
        layer, expert, proj = int(m[1]), int(m[2]), m[3]
        if layer not in moe_layers:
            raise APIError(400, f"{name}: layer {layer} is not an MoE layer ({sorted(moe_layers)})", param=name)
        if not 0 <= expert < cfg.n_routed_experts:
            raise APIError(400, f"{name}: expert {expert} out of range [0, {cfg.n_routed_experts})", param=name)
        if tuple(t.shape) != shapes[proj]:
            raise APIError(400, f"{name}: shape {list(t.shape)} != expected {list(shapes[proj])}", param=name)
        if t.dtype != dtype:
            raise APIError(400, f"{name}: dtype {t.dtype} != served dtype {dtype}", param=name)
        if not all_finite(t):
            raise APIError(400, f"{name}: holds NaN or Inf", param=name)
        pairs.add((layer, expert))
    info = {"experts": sorted([list(p) for p in pairs]), "num_tensors": len(tensors),
            "sha256": hashlib.sha256(body).hexdigest()}
    return tensors, info
