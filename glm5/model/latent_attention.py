"""Absorbed MLA kernels over latent rows [c_kv | k_rope]: the sparse training path and the paged path.

With q_lat = W_uk^T q_nope, a query scores a key as q_lat . c_kv + q_rope . k_rope and its output
is softmax . c_kv in latent space (W_uv and o_proj are applied by the caller), so per-head K/V is never
formed. Keys are rows of a flat `latent` table [rows, R+P] addressed by `key_slots` [B, S] (the
paged KV cache; for the training sparse path, the batch's own latents flattened). Two kernels:
  * dense: every key of the row's sequence under an `allowed` mask (short contexts, decode);
  * gathered: only the K selected keys per query (DSA top-k / window selection), chunked over queries
    so memory grows with chunk x K, never with heads x T x S.

Dims: B sequences, T queries, S keys, H heads, W = R+P latent row width, R kv_lora_rank, K selected keys.
"""

from __future__ import annotations

import torch

# Scores / gathered rows are built a block of queries at a time so that a block stays under this size.
SCORE_CHUNK_BYTES = 64 * 2**20


def dense_latent_attention(qq: torch.Tensor, lat: torch.Tensor, allowed: torch.Tensor, kv_rank: int,
                           scale: float) -> torch.Tensor:
    """qq [B, T, H, W], lat [B, S, W] (the sequence's keys), allowed [B, T, S] -> [B, T, H, R]."""
    B, T, H, W = qq.shape
    S = lat.shape[1]
    step = max(1, SCORE_CHUNK_BYTES // max(1, B * H * S * 4))
    outs = []
    for t0 in range(0, T, step):
        q = qq[:, t0:t0 + step]
        t = q.shape[1]
        s = torch.matmul(q.reshape(B, t * H, W), lat.transpose(1, 2)).float() * scale  # [B, t*H, S]
        s = s.view(B, t, H, S).masked_fill(~allowed[:, t0:t0 + t, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(lat.dtype).view(B, t * H, S)
        outs.append(torch.matmul(p, lat[..., :kv_rank]).view(B, t, H, kv_rank))  # [B, t, H, R]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def gathered_latent_attention(qq: torch.Tensor, latent: torch.Tensor, key_slots: torch.Tensor,
                              idx: torch.Tensor, valid: torch.Tensor, kv_rank: int, scale: float) -> torch.Tensor:
    """qq [B, T, H, W]; latent [rows, W]; key_slots [B, S] row of each key index; idx/valid [B, T, K]
    selected key indices -> [B, T, H, R]. Only the selected rows are read."""
    B, T, K = idx.shape
    H, W = qq.shape[2], qq.shape[3]
    step = max(1, SCORE_CHUNK_BYTES // max(1, B * K * (W + 2 * H) * 4))
    outs = []
    for t0 in range(0, T, step):
        ic = idx[:, t0:t0 + step]
        t = ic.shape[1]
        rows = key_slots.gather(1, ic.reshape(B, t * K)).view(B, t, K)  # [B, t, K]
        g = latent[rows]  # [B, t, K, W]
        s = torch.matmul(qq[:, t0:t0 + t], g.transpose(-1, -2)).float() * scale  # [B, t, H, K]
        s = s.masked_fill(~valid[:, t0:t0 + t, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(g.dtype)
        outs.append(torch.matmul(p, g[..., :kv_rank]))  # [B, t, H, R]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
