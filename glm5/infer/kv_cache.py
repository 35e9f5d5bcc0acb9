"""`KVCache`: the paged cache tensors. Per layer and per token it stores the MLA latent `c_kv`
[kv_lora_rank] and the shared rope key [qk_rope_head_dim] (one row [R+P]), plus the DSA indexer key
[index_head_dim] on layers with their own ("full") indexer -- never the per-head K/V that a
non-absorbed MLA would expand to (H x (qk_head_dim + v_head_dim) per token and layer).

Blocks are `block_size` consecutive rows of a flat slot axis: slot = block_id * block_size + offset. The
block manager hands out block ids; this file only owns the tensors, sizes them from a memory budget
and reads/writes rows by slot. The MTP layer (if any) gets its own cache layer after the main ones.

Dims: S slots, R kv_lora_rank, P qk_rope_head_dim, D index_head_dim.
"""

from __future__ import annotations

import os

import torch

from glm5.model.config import ModelConfig


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cache_layers(cfg: ModelConfig, with_mtp: bool) -> list[bool]:
    """One entry per cache layer (main layers, then MTP layers): True if it stores indexer keys."""
    full = [t == "full" for t in cfg.indexer_types]
    return full + ([True] * cfg.num_nextn_predict_layers if with_mtp else [])


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32, with_mtp: bool = False) -> int:
    """KV bytes one token occupies across all cache layers: latent + rope key (+ indexer key)."""
    e = _elem(dtype)
    per = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return sum((per + (cfg.index_head_dim if full else 0)) * e for full in cache_layers(cfg, with_mtp))


def expanded_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32, with_mtp: bool = False) -> int:
    """What a per-head K/V cache would take: K [H, E+P] and V [H, V] per layer (+ the same indexer key)."""
    e = _elem(dtype)
    kv = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return sum((kv + (cfg.index_head_dim if full else 0)) * e for full in cache_layers(cfg, with_mtp))


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


class KVCache:
    """Per cache layer: `latent[l]` [S, R+P] (c_kv | rotated rope key) and `index_k[l]` [S, D] or None."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", with_mtp: bool = False):
        self.cfg, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        self.dtype, self.with_mtp = dtype, with_mtp
        self.kv_rank = cfg.kv_lora_rank
        num_slots = num_blocks * block_size
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        self.latent: list[torch.Tensor] = []
        self.index_k: list[torch.Tensor | None] = []
        for full in cache_layers(cfg, with_mtp):
            self.latent.append(torch.zeros(num_slots, width, dtype=dtype, device=device))
            self.index_k.append(torch.zeros(num_slots, cfg.index_head_dim, dtype=dtype, device=device)
                                if full else None)

    @property
    def num_layers(self) -> int:
        return len(self.latent)

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.cfg, self.dtype, self.with_mtp)

    def expanded_bytes_per_token(self) -> int:
        return expanded_bytes_per_token(self.cfg, self.dtype, self.with_mtp)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.latent) + sum(t.nbytes for t in self.index_k if t is not None)

    def write(self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
              index_k: torch.Tensor | None = None) -> None:
        """slots [N] long; c_kv [N, R], k_rope [N, P], index_k [N, D] (full-indexer layers)."""
        lat = self.latent[layer]
        lat[slots, : self.kv_rank] = c_kv.to(lat.dtype)
        lat[slots, self.kv_rank:] = k_rope.to(lat.dtype)
        if index_k is not None:
            self.index_k[layer][slots] = index_k.to(self.dtype)

    def gather_latent(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows for slots of any shape [...] -> [..., R+P]."""
        return self.latent[layer][slots]

    def gather_index_k(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.index_k[layer][slots]
