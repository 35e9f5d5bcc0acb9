"""Sizing the paged KV cache: how many blocks fit a memory budget (or a share of free host memory).

The cache tensors and their per-token layout live with the model (glm5/model/kv_cache.py, the cache
the paged forward reads and writes); this file only turns bytes into a block count.
"""

from __future__ import annotations

import os

import torch

from glm5.model.config import ModelConfig
from glm5.model.kv_cache import bytes_per_token


def available_memory_bytes() -> int:
    """Free host memory (MemAvailable), used when no KV budget or block count is configured."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks_for_budget(cfg: ModelConfig, block_size: int, memory_bytes: int, dtype: torch.dtype,
                          with_mtp: bool = False) -> int:
    return int(memory_bytes) // (block_size * bytes_per_token(cfg, dtype, with_mtp))
