"""Absorbed MLA kernels over latent rows [c_kv | k_rope]: the sparse training path and the paged path.

With q_lat = W_uk^T q_nope, a query scores a key as q_lat . c_kv + q_rope . k_rope and its output
is softmax . c_kv in latent space (W_uv and o_proj are applied by the caller), so per-head K/V is never
formed. Keys are rows of a flat `latent` table [rows, R+P] addressed by `key_slots` [B, S] (the
paged KV cache; for the training sparse path, the batch's own latents flattened). Two kernels:
  * dense: every key of the row's sequence under an `allowed` mask (short contexts, decode), a block of
    sequences at a time;
  * gathered: only the K selected keys per query (DSA top-k / window selection), chunked over queries
    so memory grows with chunk x K, never with heads x T x S.

Dims: B sequences, T queries, S keys, H heads, W = R+P latent row width, R kv_lora_rank, K selected keys.
"""

from __future__ import annotations

import torch

# Scores / gathered rows are built a block of queries at a time so that a block stays under this size.
SCORE_CHUNK_BYTES = 64 * 2**20
# Dense decode: key rows gathered per block of sequences (see dense_latent_attention).
KEY_BLOCK_BYTES = 2**20


def dense_latent_attention(qq: torch.Tensor, latent: torch.Tensor, key_slots: torch.Tensor, bias: torch.Tensor,
                           kv_rank: int, scale: float, key_lens: list[int] | None = None,
                           block_bytes: int = KEY_BLOCK_BYTES) -> torch.Tensor:
    """qq [B, T, H, W]; latent [rows, W]; key_slots [B, S] row of each key index; bias [B, T, S] additive
    mask (0 = may attend, -inf = may not; `AttnGroup.key_bias`); key_lens: keys each sequence has (None: S),
    longest first for the trimming to pay -> [B, T, H, R].

    Sequences are attended a block at a time: a block's key rows are gathered into one small buffer
    (about `block_bytes`, so it is still in cache for the second matmul) and cut at the block's longest
    sequence, so a short sequence next to a long one does not pay for the long one's padding (the engine
    orders a group's sequences by length). A single gather of every padded row was several times slower:
    the buffer is tens of MiB for a large decode batch, freshly faulted in on every call. Per block: one
    gather, two batched matmuls, the mask added in place and a softmax (the scale rides on the queries)."""
    B, T, H, W = qq.shape
    S = key_slots.shape[1]
    lens = key_lens if key_lens is not None else [S] * B
    row_bytes = W * latent.element_size()
    qs = qq * scale
    out, b0 = None, 0
    while b0 < B:
        b1 = min(B, b0 + max(1, block_bytes // (max(lens[b0], 1) * row_bytes)))
        s, b = max(lens[b0:b1]), b1 - b0
        lat = latent.index_select(0, key_slots[b0:b1, :s].reshape(-1)).view(b, s, W)  # [b, s, W]
        step = max(1, SCORE_CHUNK_BYTES // (b * H * s * 4))  # query rows per score block (scores [b, step*H, s])
        parts = [_attend_rows(qs[b0:b1, t0:t0 + step], lat, bias[b0:b1, t0:t0 + step, :s], kv_rank)
                 for t0 in range(0, T, step)]
        o = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [b, T, H, R]
        if b0 == 0 and b1 == B:
            return o
        if out is None:
            out = o.new_empty(B, T, H, kv_rank)
        out[b0:b1] = o
        b0 = b1
    return out


def _attend_rows(qs: torch.Tensor, lat: torch.Tensor, bias: torch.Tensor, kv_rank: int) -> torch.Tensor:
    """Scaled queries qs [b, t, H, W], each sequence's keys lat [b, s, W], bias [b, t, s] -> [b, t, H, R]."""
    b, t, H, W = qs.shape
    s = lat.shape[1]
    sc = torch.bmm(qs.reshape(b, t * H, W), lat.transpose(1, 2)).float()  # [b, t*H, s]
    sc.view(b, t, H, s).add_(bias[:, :, None, :])
    p = torch.softmax(sc, dim=-1).to(lat.dtype)
    return torch.bmm(p, lat[..., :kv_rank]).view(b, t, H, kv_rank)


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
        g = latent.index_select(0, rows.reshape(-1)).view(B, t, K, W)  # [B, t, K, W] (index_select: one row copy each)
        s = torch.matmul(qq[:, t0:t0 + t], g.transpose(-1, -2)).float() * scale  # [B, t, H, K]
        s = s.masked_fill(~valid[:, t0:t0 + t, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).to(g.dtype)
        outs.append(torch.matmul(p, g[..., :kv_rank]))  # [B, t, H, R]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
