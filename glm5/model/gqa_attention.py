"""Grouped-query attention of GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): the one layer where they differ from GLM-5.

Per token: q = q_proj(x) [H heads x D], k = k_proj(x) and v = v_proj(x) [G key/value heads x D], each with a
bias when `attention_bias`; with `use_qk_norm` every query and key head goes through an RMSNorm over D
(eps = rms_norm_eps) before RoPE. RoPE is half-split (NeoX pairs x[i], x[i + r/2]) over the first
r = D * partial_rotary_factor channels of each head only (GLM-4.5: 64 of 128); the rest pass through.
Each group of H / G query heads shares one key/value head; scores are scaled by D^-0.5; o_proj has no bias.

Dims: B batch, T queries, S keys, H query heads, G key/value heads, D head dim, r rotary channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import RMSNorm, apply_rope
from .masks import MaskSpec
from .paged import PagedContext


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
            raise ValueError("glm4_moe (GQA) layers have no paged K/V cache: the engine serves the MLA "
                             "architectures (glm_moe_dsa, glm4_moe_lite)")
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
