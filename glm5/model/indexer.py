"""Key selection for sparse attention: the DSA lightning indexer and the seeds' window+global selector.

Both produce, per query, a fixed-width list of key indices `idx` [B, T, K] plus `valid` [B, T, K] (the
selected key is really attendable: causal, same document, ...). Scores are computed a block of queries at
a time, so memory grows with chunk x T_k, never with heads x T x T.

Dims: B batch, T queries, S keys, N indexer heads, D indexer head dim, K selected keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .layers import apply_rope
from .masks import MaskSpec

# Score rows are built in chunks of queries so that a chunk's [c, N, S] fp32 scores stay under this.
SCORE_CHUNK_BYTES = 64 * 2**20


class Indexer(nn.Module):
    """DSA lightning indexer (GLM-5 = DeepSeek-V3.2 indexer with interleaved RoPE).

    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(D)),  w = weights_proj(x) / sqrt(N), in fp32.
    One key head is shared by the N query heads (MQA-like); `k_norm` is a real LayerNorm with bias.
    Head layout is [rope | nope] (the opposite of the MLA query's [nope | rope]).
    """

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int,
                 rope_interleave: bool):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.rope_interleave = rope_interleave
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin, self.rope_interleave), rest], dim=-1)

    def project_q(self, x: torch.Tensor, q_resid: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [B, T, N, D] (fp32) and signed head weights [B, T, N] (fp32, scaled by N^-1/2)."""
        B, T, _ = x.shape
        q = self.wq_b(q_resid).view(B, T, self.n_heads, self.head_dim)  # [B, T, N, D]
        q = self._rope(q, cos[:, :, None], sin[:, :, None])
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads ** -0.5  # [B, T, N]
        return q.float(), w

    def project_k(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """The shared key [B, S, D] (fp32): this is what a KV cache stores per token."""
        k = self.k_norm(self.wk(x))  # [B, S, D]
        return self._rope(k, cos, sin).float()

    def scores(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Index scores [B, c, S] for queries q [B, c, N, D], weights w [B, c, N], keys k [B, S, D]."""
        B, c, N, D = q.shape
        S = k.shape[1]
        s = torch.matmul(q.reshape(B, c * N, D), k.transpose(1, 2)).relu_()  # [B, c*N, S]
        # relu(x * a) = relu(x) * a for a > 0: the 1/sqrt(D) scale rides on the head weights
        w = (w * D ** -0.5).reshape(B * c, 1, N)
        return torch.bmm(w, s.view(B * c, N, S)).view(B, c, S)


def _chunk_size(n_heads: int, num_keys: int, batch: int) -> int:
    per_row = max(1, batch * (n_heads + 2) * num_keys * 4)
    return max(1, SCORE_CHUNK_BYTES // per_row)


@torch.no_grad()
def dsa_topk(indexer: Indexer, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, mask: MaskSpec,
             topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k keys per query by index score, masked causally first. -> idx [B, T, K] long, valid [B, T, K]."""
    B, T = q.shape[:2]
    S = k.shape[1]
    K = min(topk, S)
    idx_out = torch.empty(B, T, K, dtype=torch.long, device=q.device)
    valid_out = torch.empty(B, T, K, dtype=torch.bool, device=q.device)
    c = _chunk_size(indexer.n_heads, S, B)
    for q0 in range(0, T, c):
        q1 = min(T, q0 + c)
        # causal: keys past the chunk's last query can never be selected, so they are not scored
        s_end = min(S, mask.q_offset + q1) if mask.causal and mask.q_positions is None else S
        sc = indexer.scores(q[:, q0:q1], w[:, q0:q1], k[:, :s_end])  # [B, c, s_end]
        allowed = mask.rows(q0, q1, s_end, q.device)
        if allowed is not None:
            sc = sc.masked_fill(~allowed, float("-inf"))
        kk = min(K, s_end)
        top = sc.topk(kk, dim=-1)
        idx_out[:, q0:q1, :kk] = top.indices
        valid_out[:, q0:q1, :kk] = top.values > float("-inf")
        if kk < K:  # rows that see fewer than K keys: pad with invalid entries
            idx_out[:, q0:q1, kk:] = 0
            valid_out[:, q0:q1, kk:] = False
    return idx_out, valid_out


@torch.no_grad()
def window_select(indexer: Indexer | None, q, w, k, mask: MaskSpec, window: int, global_every: int,
                  routed_blocks: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeds' pattern: a local causal window, every `global_every`-th key, and `routed_blocks`
    content-routed blocks of `block_size` keys (ranked by the block's mean index score).

    Returns idx/valid like `dsa_topk`, width K = window + ceil(S / global_every) + routed_blocks * block_size
    (capped at S); only keys the mask allows are valid.
    """
    B, T = q.shape[:2]
    S = k.shape[1]
    K = min(S, window + math.ceil(S / global_every) + routed_blocks * block_size)
    idx_out = torch.empty(B, T, K, dtype=torch.long, device=q.device)
    valid_out = torch.empty(B, T, K, dtype=torch.bool, device=q.device)
    keys = torch.arange(S, device=q.device)
    nblk = math.ceil(S / block_size)
    c = _chunk_size(indexer.n_heads if indexer is not None else 1, S, B)
    for q0 in range(0, T, c):
        q1 = min(T, q0 + c)
        allowed = mask.rows(q0, q1, S, q.device)
        if allowed is None:
            allowed = torch.ones(1, q1 - q0, S, dtype=torch.bool, device=q.device)
        qi = mask.query_index(q0, q1, q.device)[:, :, None]  # [B|1, c, 1] key index of each query
        fixed = ((keys <= qi) & (keys > qi - window)) | (keys % global_every == 0)  # [B|1, c, S]
        sel = fixed & allowed  # [B|1, c, S]
        if routed_blocks > 0 and indexer is not None:
            sc = indexer.scores(q[:, q0:q1], w[:, q0:q1], k)  # [B, c, S]
            cand = allowed & ~sel  # keys a routed block could add
            pad = nblk * block_size - S
            sc = F.pad(sc.masked_fill(~cand, 0.0), (0, pad))
            cnt = F.pad(cand.float(), (0, pad)).reshape(*cand.shape[:2], nblk, block_size).sum(-1)
            blk = sc.reshape(B, q1 - q0, nblk, block_size).sum(-1) / cnt.clamp(min=1)  # [B, c, nblk]
            blk = blk.masked_fill(cnt == 0, float("-inf"))
            r = min(routed_blocks, nblk)
            top = blk.topk(r, dim=-1)
            chosen = torch.zeros_like(blk, dtype=torch.bool).scatter(-1, top.indices, top.values > float("-inf"))
            chosen_keys = chosen.repeat_interleave(block_size, dim=-1)[..., :S]  # [B, c, S]
            sel = sel | (chosen_keys & cand)
        sel = sel.expand(B, -1, -1)
        # fixed-width index list: selected keys first (stable order by key index), then padding
        order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices[..., :K]
        idx_out[:, q0:q1] = order
        valid_out[:, q0:q1] = sel.gather(-1, order)
    return idx_out, valid_out
