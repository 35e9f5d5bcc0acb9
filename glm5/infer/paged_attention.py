"""Paged attention inputs (`AttnMetadata`) and the absorbed-MLA attention over the latent cache.

The runner flattens a step's tokens (no batch dim: N tokens of many sequences back to back) and builds
one `AttnMetadata` per forward: input ids, positions, the KV slot of every token, and attention groups.
A group is a padded batch of sequences attended together: all short chunks (decodes, draft
verification) go in one group, each longer prefill chunk in a group of its own, so padding stays small.

Attention is absorbed MLA on the cached rows [c_kv | k_rope]: q_lat = W_uk^T q_nope, scores
q_lat . c_kv + q_rope . k_rope, output softmax . c_kv (W_uv and o_proj applied by the caller). When a
group's context exceeds `index_topk`, the DSA indexer scores every cached indexer key (O(T x D)) and
only the top-k latent rows are gathered (O(k x R)); otherwise all keys are used (dense fallback).

Dims: N flat tokens, B sequences in a group, T queries per sequence (padded), S keys (padded),
H heads, R kv_lora_rank, P rope dim, I indexer heads, D indexer dim, K selected keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5.model.indexer import dsa_topk
from glm5.model.masks import MaskSpec

from .kv_cache import KVCache

SHORT_CHUNK = 8  # chunks up to this many tokens share one padded group
SCORE_BYTES = 64 * 2**20  # dense scores are built a block of queries at a time under this size


@dataclass
class SeqChunk:
    """One sequence's share of a forward: tokens at positions [start, start + len(token_ids))."""

    key: str
    start: int
    token_ids: list[int]
    block_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class AttnGroup:
    seq_idx: list[int]  # which chunks of the forward
    q_index: torch.Tensor  # [B, T] flat token index of each query (padding: 0)
    q_valid: torch.Tensor  # [B, T] bool
    key_slots: torch.Tensor  # [B, S] cache slot of each key position (padding: 0)
    allowed: torch.Tensor  # [B, T, S] bool: causal and inside the sequence
    needs_selection: bool  # some sequence has more than index_topk keys
    is_identity: bool = False  # one group holding every token in order: outputs need no scatter


@dataclass
class AttnMetadata:
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] where each token's KV is written
    query_start: list[int]  # [num_chunks + 1] offsets into N
    chunks: list[SeqChunk]
    groups: list[AttnGroup] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [start, end) of a sequence with block table `block_ids`."""
    pos = torch.arange(start, end)
    table = torch.as_tensor(block_ids, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def build_metadata(chunks: list[SeqChunk], block_size: int, index_topk: int, device) -> AttnMetadata:
    ids, pos, slots, starts = [], [], [], [0]
    for c in chunks:
        ids.extend(c.token_ids)
        pos.append(torch.arange(c.start, c.context_len))
        slots.append(slots_for(c.block_ids, c.start, c.context_len, block_size))
        starts.append(starts[-1] + c.num_tokens)
    meta = AttnMetadata(torch.tensor(ids, dtype=torch.long, device=device), torch.cat(pos).to(device),
                        torch.cat(slots).to(device), starts, chunks)
    short = [i for i, c in enumerate(chunks) if c.num_tokens <= SHORT_CHUNK]
    long_ = [[i] for i, c in enumerate(chunks) if c.num_tokens > SHORT_CHUNK]
    for members in ([short] if short else []) + long_:
        meta.groups.append(_group(meta, members, block_size, index_topk, device))
    return meta


def _group(meta: AttnMetadata, members: list[int], block_size: int, index_topk: int, device) -> AttnGroup:
    chunks = [meta.chunks[i] for i in members]
    B, T, S = len(chunks), max(c.num_tokens for c in chunks), max(c.context_len for c in chunks)
    q_index = torch.zeros(B, T, dtype=torch.long)
    q_valid = torch.zeros(B, T, dtype=torch.bool)
    key_slots = torch.zeros(B, S, dtype=torch.long)
    qpos = torch.zeros(B, T, dtype=torch.long)  # absolute position of each query (padding: 0)
    for b, (i, c) in enumerate(zip(members, chunks)):
        n = c.num_tokens
        q_index[b, :n] = torch.arange(meta.query_start[i], meta.query_start[i] + n)
        q_valid[b, :n] = True
        qpos[b, :n] = torch.arange(c.start, c.context_len)
        key_slots[b, : c.context_len] = slots_for(c.block_ids, 0, c.context_len, block_size)
    allowed = torch.arange(S)[None, None, :] <= qpos[:, :, None]  # [B, T, S]; padded rows see key 0 only
    allowed &= q_valid[:, :, None] | (torch.arange(S) == 0)[None, None, :]
    identity = B == 1 and T == meta.num_tokens  # single sequence, all of the step's tokens
    return AttnGroup(members, q_index.to(device), q_valid.to(device), key_slots.to(device), allowed.to(device),
                     needs_selection=S > index_topk, is_identity=identity)


def dense_latent_attention(qq: torch.Tensor, lat: torch.Tensor, allowed: torch.Tensor, kv_rank: int,
                           scale: float) -> torch.Tensor:
    """qq [B, T, H, R+P], lat [B, S, R+P], allowed [B, T, S] -> latent output [B, T, H, R]."""
    B, T, H, W = qq.shape
    S = lat.shape[1]
    step = max(1, SCORE_BYTES // max(1, B * H * S * 4))
    if step >= T:  # the common case: one block of queries
        s = torch.matmul(qq.reshape(B, T * H, W), lat.transpose(1, 2)).float() * scale  # [B, T*H, S]
        s = s.view(B, T, H, S).masked_fill(~allowed[:, :, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(lat.dtype).view(B, T * H, S)
        return torch.matmul(p, lat[..., :kv_rank]).view(B, T, H, kv_rank)  # [B, T, H, R]
    outs = []
    for t0 in range(0, T, step):
        q = qq[:, t0:t0 + step]
        t = q.shape[1]
        s = torch.matmul(q.reshape(B, t * H, W), lat.transpose(1, 2)).float() * scale  # [B, t*H, S]
        s = s.view(B, t, H, S).masked_fill(~allowed[:, t0:t0 + t, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(lat.dtype).view(B, t * H, S)
        outs.append(torch.matmul(p, lat[..., :kv_rank]).view(B, t, H, kv_rank))  # [B, t, H, R]
    return torch.cat(outs, dim=1)


def gathered_latent_attention(qq: torch.Tensor, g: torch.Tensor, valid: torch.Tensor, kv_rank: int,
                              scale: float) -> torch.Tensor:
    """qq [B, T, H, R+P], selected rows g [B, T, K, R+P], valid [B, T, K] -> [B, T, H, R]."""
    s = torch.matmul(qq, g.transpose(-1, -2)).float() * scale  # [B, T, H, K]
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(g.dtype)
    return torch.matmul(p, g[..., :kv_rank])  # [B, T, H, R]


def select_topk(indexer, cache: KVCache, layer: int, group: AttnGroup, qi: torch.Tensor, wi: torch.Tensor,
                topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DSA top-k over the cached indexer keys of a group. qi [N, I, D], wi [N, I] -> idx/valid [B, T, K]
    (idx = key positions within each sequence)."""
    ki = cache.gather_index_k(layer, group.key_slots).float()  # [B, S, D]
    q, w = qi[group.q_index], wi[group.q_index]  # [B, T, I, D], [B, T, I]
    return dsa_topk(indexer, q, w, ki, MaskSpec(causal=False, attention_mask=group.allowed), topk)


def attend_group(cache: KVCache, layer: int, group: AttnGroup, qq: torch.Tensor, sel, scale: float) -> torch.Tensor:
    """Absorbed MLA for one group. qq [N, H, R+P]; sel (idx, valid) [B, T, K] or None (dense).
    -> latent output [B, T, H, R]."""
    q = qq[group.q_index]  # [B, T, H, R+P]
    if sel is None:
        lat = cache.gather_latent(layer, group.key_slots)  # [B, S, R+P]
        return dense_latent_attention(q, lat, group.allowed, cache.kv_rank, scale)
    idx, valid = sel
    B, T, K = idx.shape
    H, W = q.shape[2], q.shape[3]
    step = max(1, SCORE_BYTES // max(1, B * K * (W + H) * 4))  # queries per chunk: bounded gather
    outs = []
    for t0 in range(0, T, step):
        ic = idx[:, t0:t0 + step]
        t = ic.shape[1]
        slots = group.key_slots.gather(1, ic.reshape(B, t * K)).view(B, t, K)  # [B, t, K]
        g = cache.gather_latent(layer, slots)  # [B, t, K, R+P]: only the selected rows are read
        outs.append(gathered_latent_attention(q[:, t0:t0 + t], g, valid[:, t0:t0 + t], cache.kv_rank, scale))
    return torch.cat(outs, dim=1)
