"""`LatentKVCache`: the paged cache tensors that the model's paged forward reads and writes.

Per cache layer and token one row: for MLA (`glm_moe_dsa`, `glm4_moe_lite`) the latent `c_kv`
[kv_lora_rank] and the shared rotated rope key [qk_rope_head_dim] ([R+P]); for GQA (`glm4_moe`) the
rotated keys and the values of the G key/value heads ([2*G*Dh], keys first). Beside it the DSA indexer
key [index_head_dim] on layers with their own ("full") indexer, and, only when the config has a capacity
factor, the token's routed expert ids [A] on MoE layers (the per-sequence capacity rule counts earlier
assignments; see moe.capacity_keep). MLA never stores the per-head K/V it would expand to. Cache layer i
is model layer i; MTP layers (index num_hidden_layers + j) get cache layers only when the cache is built
`with_mtp`.

Slots are rows of a flat axis: slot = block_id * block_size + offset. Block ids come from the engine's
block manager; this file owns only the tensors and their layout (sizing from a memory budget is in
glm5/infer/kv_cache.py).

Dims: S slots, R kv_lora_rank, P qk_rope_head_dim, G key/value heads, Dh GQA head dim, D index_head_dim,
A experts per token.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cache_layers(cfg: ModelConfig, with_mtp: bool) -> list[bool]:
    """One entry per cache layer (main layers, then MTP layers): True if it stores indexer keys."""
    dsa = cfg.attention_kind == "dsa"
    full = [dsa and t == "full" for t in cfg.indexer_types]
    return full + ([dsa] * cfg.num_nextn_predict_layers if with_mtp else [])


def row_width(cfg: ModelConfig) -> int:
    """Values one token's attention row holds per cache layer: MLA [c_kv | k_rope], GQA [k | v]."""
    if cfg.attention_kind == "gqa":
        return 2 * cfg.num_key_value_heads * cfg.head_dim
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def moe_cache_layers(cfg: ModelConfig, with_mtp: bool) -> list[bool]:
    """Per cache layer: True if it is an MoE layer (the MTP layer always is)."""
    return ([t == "sparse" for t in cfg.mlp_layer_types]
            + ([True] * cfg.num_nextn_predict_layers if with_mtp else []))


def selection_possible(cfg: ModelConfig, max_keys: int) -> bool:
    """Whether any attention layer can select keys when a sequence holds at most `max_keys` keys: the
    window pattern always selects; DSA top-k only past index_topk keys (below it every key is attended,
    so indexer keys are never read). Architectures without the indexer never select."""
    if cfg.attention_kind != "dsa":
        return False
    return cfg.sparse_attention == "window" or cfg.index_topk < max_keys


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32, with_mtp: bool = False) -> int:
    """KV bytes one token occupies across all cache layers: its attention row (+ indexer key)
    (+ int32 routed expert ids per MoE layer under a capacity factor)."""
    e = _elem(dtype)
    per = row_width(cfg)
    total = sum((per + (cfg.index_head_dim if full else 0)) * e for full in cache_layers(cfg, with_mtp))
    if cfg.moe_capacity_factor is not None:
        total += 4 * cfg.num_experts_per_tok * sum(moe_cache_layers(cfg, with_mtp))
    return total


def expanded_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype = torch.float32, with_mtp: bool = False) -> int:
    """What a per-head K/V cache would take: K [H, E+P] and V [H, V] per layer (+ the same indexer key);
    for GQA that is what the cache holds."""
    e = _elem(dtype)
    kv = row_width(cfg) if cfg.attention_kind == "gqa" else cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return sum((kv + (cfg.index_head_dim if full else 0)) * e for full in cache_layers(cfg, with_mtp))


class LatentKVCache:
    """Per cache layer: `latent[l]` [S, row_width] (MLA: c_kv | rotated rope key; GQA: keys | values),
    `index_k[l]` [S, D] or None, `routes[l]` [S, A] int32 or None (capacity factor only)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", with_mtp: bool = False, index_keys: bool = True):
        """index_keys=False: no indexer keys are stored (nor computed by the model's paged forward); only
        valid when no sequence can outgrow the selection (see `selection_possible`)."""
        self.cfg, self.num_blocks, self.block_size = cfg, num_blocks, block_size
        self.dtype, self.with_mtp = dtype, with_mtp
        self.kv_rank = cfg.kv_lora_rank
        num_slots = num_blocks * block_size
        width = row_width(cfg)
        self.latent: list[torch.Tensor] = []
        self.index_k: list[torch.Tensor | None] = []
        self.routes: list[torch.Tensor | None] = []
        capacity = cfg.moe_capacity_factor is not None
        for full, moe in zip(cache_layers(cfg, with_mtp), moe_cache_layers(cfg, with_mtp)):
            self.latent.append(torch.zeros(num_slots, width, dtype=dtype, device=device))
            self.index_k.append(torch.zeros(num_slots, cfg.index_head_dim, dtype=dtype, device=device)
                                if full and index_keys else None)
            self.routes.append(torch.full((num_slots, cfg.num_experts_per_tok), -1, dtype=torch.int32,
                                          device=device) if capacity and moe else None)

    @property
    def num_layers(self) -> int:
        return len(self.latent)

    def bytes_per_token(self) -> int:
        return bytes_per_token(self.cfg, self.dtype, self.with_mtp)

    def expanded_bytes_per_token(self) -> int:
        return expanded_bytes_per_token(self.cfg, self.dtype, self.with_mtp)

    @property
    def nbytes(self) -> int:
        tensors = self.latent + [t for t in self.index_k + self.routes if t is not None]
        return sum(t.nbytes for t in tensors)

    def write(self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
              index_k: torch.Tensor | None = None) -> None:
        """slots [N] long; c_kv [N, R], k_rope [N, P], index_k [N, D] (full-indexer layers)."""
        lat = self.latent[layer]
        lat.index_copy_(0, slots, torch.cat([c_kv, k_rope], dim=-1).to(lat.dtype))  # [N, R+P] rows
        if index_k is not None and self.index_k[layer] is not None:
            self.index_k[layer].index_copy_(0, slots, index_k.to(self.dtype))

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """GQA: slots [N] long; rotated keys k and values v [N, G*Dh] -> rows [k | v]."""
        self.write(layer, slots, k, v)

    def copy_block_rows(self, copies: list[tuple[int, int, int]]) -> None:
        """For each (source block, destination block, rows): the source's first `rows` slots copied into the
        destination's, on every cache layer (a partial prefix block reused copy-on-write)."""
        bs = self.block_size
        for t in self.latent + self.index_k + self.routes:
            if t is None:
                continue
            for src, dst, rows in copies:
                t[dst * bs:dst * bs + rows] = t[src * bs:src * bs + rows]

    def gather_latent(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Rows for slots of any shape [...] -> [..., R+P]."""
        return self.latent[layer][slots]

    def gather_index_k(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return self.index_k[layer][slots]
