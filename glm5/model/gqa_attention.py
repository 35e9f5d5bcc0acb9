"""Grouped-query attention of GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): the one layer where they differ from GLM-5.

Per token: q = q_proj(x) [H heads x D], k = k_proj(x) and v = v_proj(x) [G key/value heads x D], each with a
bias when `attention_bias`; with `use_qk_norm` every query and key head goes through an RMSNorm over D
(eps = rms_norm_eps) before RoPE. RoPE is half-split (NeoX pairs x[i], x[i + r/2]) over the first
r = D * partial_rotary_factor channels of each head only (GLM-4.5: 64 of 128); the rest pass through.
Each group of H / G query heads shares one key/value head; scores are scaled by D^-0.5; o_proj has no bias.
Training / no cache: SDPA over the batch. Paged (serving: `PagedContext`): this step's rotated keys and
values are written into the cache rows [k | v] (glm5/model/kv_cache.py), then each attention group's
queries attend to their sequences' cached rows under the group's mask.

Dims: B batch, T queries, S keys, H query heads, G key/value heads, D head dim, r rotary channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import SMALL_SCORES, _place, _rows
from .config import ModelConfig
from .layers import RMSNorm, apply_rope
from .masks import MaskSpec
from .paged import AttnGroup, PagedContext


class GQAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.scale = self.head_dim ** -0.5
        H, D, bias = cfg.hidden_size, self.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * D, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * D, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.use_qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.use_qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, hidden] -> rotated q [B, T, H, D], rotated k [B, T, G, D], v [B, T, G, D]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, r/2]: one angle per pair, shared by the heads
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rotated = apply_rope(x[..., :r], cos, sin, interleave=False)
        return rotated if r == self.head_dim else torch.cat([rotated, x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: MaskSpec | PagedContext,
                prev_sel=None):
        """x [B, T, hidden] -> (out [B, T, hidden], None): no key selection in this architecture."""
        if isinstance(ctx, PagedContext):
            return self._forward_paged(x, cos, sin, ctx), None
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.project(x, cos, sin))  # [B, H|G, T, D]
        S = k.shape[2]
        if ctx.is_plain_causal and ctx.q_offset == 0 and T == S:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            allowed = ctx.dense(T, S, x.device)  # [B|1, T, S] bool, None = every key
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if allowed is None else allowed[:, None],
                                               scale=self.scale, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), None

    def _forward_paged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedContext) -> torch.Tensor:
        """Flat tokens x [1, N, hidden] -> [1, N, hidden]."""
        meta, rows = ctx.meta, ctx.cache.latent[self.layer_idx]
        q, k, v = self.project(x, cos, sin)  # [1, N, H, D], [1, N, G, D], [1, N, G, D]
        ctx.cache.write_kv(self.layer_idx, meta.slot_mapping, k[0].flatten(-2), v[0].flatten(-2))
        out = None  # [N, H, D]
        for g in meta.groups:
            out = _place(out, g, self._attend_group(g, q[0], rows), q.shape[1])
        return self.o_proj(out.flatten(-2))[None]

    def _attend_group(self, g: AttnGroup, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One group's queries (rows of q [N, H, D]) over its sequences' cached [k | v] rows -> [B, T, H, D].

        The keys and values are gathered head by head straight into [B, G, S, D] (a cache row is G key
        heads then G value heads of D values). Small score tensors (decode steps, short chunks) then go
        through two batched products with the query heads grouped by their key/value head ([B, G, r*T, D],
        r = H / G) and the group's additive mask added in place: no K/V repeat, no mask conversion per
        call; on CPU 2x cheaper than SDPA's flash kernel for a 64-sequence decode step (bench/engine.py
        --arch glm4_moe). Larger ones run SDPA under the boolean mask."""
        B, S = g.key_slots.shape
        G, D, H = self.n_kv, self.head_dim, self.n_heads
        heads = g.key_slots[:, None, :] * (2 * G) + torch.arange(G, device=rows.device)[None, :, None]  # [B, G, S]
        flat = rows.view(-1, D)  # one row per cached head
        k = flat.index_select(0, heads.reshape(-1)).view(B, G, S, D).to(q.dtype)
        v = flat.index_select(0, (heads + G).reshape(-1)).view(B, G, S, D).to(q.dtype)
        qg = _rows(g, q)  # [B, T, H, D]
        T = qg.shape[1]
        if B * H * T * S > SMALL_SCORES:
            o = F.scaled_dot_product_attention(qg.transpose(1, 2), k, v, attn_mask=g.allowed[:, None],
                                               scale=self.scale, enable_gqa=True)  # [B, H, T, D]
            return o.transpose(1, 2)
        r = H // G
        qh = qg.view(B, T, G, r, D).permute(0, 2, 3, 1, 4).reshape(B, G, r * T, D)  # head h = (h // r, h % r)
        sc = torch.matmul(qh, k.transpose(-1, -2)).float()  # [B, G, r*T, S]
        sc.view(B, G, r, T, S).mul_(self.scale).add_(g.key_bias[:, None, None])
        o = torch.matmul(sc.softmax(-1).to(v.dtype), v)  # [B, G, r*T, D]
        return o.view(B, G, r, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H, D)
