"""Throughput accounting: active parameters per token, the machine's measured matmul peak, MFU.

MFU = 6 * active_params * tokens_per_second / peak_flops, where 6 = 2 (forward multiply-add) x 3
(forward + backward) and the peak is *measured* here with a square matmul in the training dtype
(the best ever seen per device/dtype/thread count is kept in `~/.cache/glm5/matmul_peak.json`), not read off a datasheet.
Attention's T^2 term is left out, as in the usual 6N estimate.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from torch import nn

CACHE = Path(os.environ.get("GLM5_CACHE", Path.home() / ".cache" / "glm5")) / "matmul_peak.json"


def active_params(model: nn.Module, include_mtp: bool = False, names: set[str] | None = None) -> int:
    """Parameters one token passes through: all but the input embedding, with each routed-expert
    stack counted at top_k / n_routed_experts (and the MTP layer only when it runs); `names`: only those."""
    cfg = getattr(model, "config", None)
    frac = (cfg.num_experts_per_tok / cfg.n_routed_experts) if cfg is not None and cfg.n_routed_experts else 1.0
    n_main = getattr(cfg, "num_hidden_layers", None)
    embed = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    total = 0.0
    for name, p in model.named_parameters():
        if id(p) in embed and p is not head:
            continue
        if not include_mtp and n_main is not None and f"layers.{n_main}." in name:
            continue
        if names is not None and name not in names:
            continue
        total += p.numel() * (frac if ".experts." in name else 1.0)
    return int(total)


def _key(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu-{torch.get_num_threads()}t"
    return f"{name}|{dtype}".replace(" ", "_")


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, use_cache: bool = True) -> float:
    """Best FLOP/s of an n x n matmul over a few repeats (n = 4096 on GPU, 1024 on CPU)."""
    key = _key(device, dtype)
    cache = {}
    if use_cache and CACHE.is_file():
        try:
            cache = json.loads(CACHE.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3 if key in cache else 5):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / 4)
    # Keep the best peak ever seen on this machine: a measurement taken while other jobs share the
    # cores is low, and dividing by it would report MFU above 100%.
    peak = max(2 * n**3 / best, float(cache.get(key, 0.0)))
    if use_cache and peak > float(cache.get(key, 0.0)):
        try:
            CACHE.parent.mkdir(parents=True, exist_ok=True)
            cache[key] = peak
            CACHE.write_text(json.dumps(cache, indent=2) + "\n")
        except OSError:
            pass  # read-only home: measure again next time
    return peak


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(active: int, tokens_per_s: float, peak_flops: float) -> float:
    return 6.0 * active * tokens_per_s / peak_flops if peak_flops > 0 else 0.0
