"""Multi-head latent attention (MLA) with DSA sparse key selection.

Queries go through a low-rank bottleneck (q_a -> RMSNorm -> q_b); keys/values are compressed into one
latent `c_kv` [kv_lora_rank] plus one shared rope key [qk_rope_head_dim] per token (decoupled RoPE).
Two execution paths, equal in exact arithmetic:
  * dense: expand K/V per head with kv_b_proj and run SDPA (training / prefill when every allowed key is
    selected, i.e. index_topk >= T as in GLM-5 below 2048 tokens);
  * sparse: per query, gather only the K selected latents and attend in the latent space with kv_b_proj
    absorbed into the query and the output (memory grows with T*K, never with heads*T*T); when the
    sequence is short (S <= 4K) the selection is applied as a [B, T, S] mask on dense SDPA instead.
The engine reuses the projection helpers (`project_q`, `project_kv`, `absorb_q`, `latent_to_output`).

Dims: B batch, T queries, S keys, H heads, R kv_lora_rank, P qk_rope_head_dim, E nope dim, V v dim, K selected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .indexer import SCORE_CHUNK_BYTES, Indexer, dsa_topk, window_select
from .layers import RMSNorm, apply_rope
from .masks import MaskSpec


# Sparse layers with at most this many keys per selected key run dense SDPA under a selection mask
# (cheaper than gathering at short lengths, e.g. T = 512 with index_topk 256); longer ones gather.
DENSE_MASK_RATIO = 4


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, has_indexer: bool):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps=1e-6)  # class default eps, not rms_norm_eps
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=bias)
        self.indexer = (Indexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                                cfg.qk_rope_head_dim, cfg.indexer_rope_interleave) if has_indexer else None)

    # --- projections (shared with the inference engine) ---------------------------------------------
    def project_q(self, x: torch.Tensor, cos, sin):
        """-> q_nope [B, T, H, E], q_rope (rotated) [B, T, H, P], q_resid [B, T, q_lora_rank]."""
        B, T, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, T, self.n_heads, self.nope + self.rope)  # [B, T, H, E+P]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = apply_rope(q_rope, cos[:, :, None], sin[:, :, None], self.cfg.rope_interleave)
        return q_nope, q_rope, q_resid

    def project_kv(self, x: torch.Tensor, cos, sin):
        """-> normalised latent c_kv [B, S, R] and the rotated shared rope key [B, S, P]: the MLA cache."""
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        return self.kv_a_layernorm(c_kv), apply_rope(k_rope, cos, sin, self.cfg.rope_interleave)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)  # [H, E+V, R]
        return w[:, : self.nope], w[:, self.nope:]  # W_uk [H, E, R], W_uv [H, V, R]

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [.., H, E] -> latent-space query [.., H, R] (q . W_uk c == (W_uk^T q) . c)."""
        w_uk, _ = self._kv_b()
        return torch.einsum("...he,her->...hr", q_nope, w_uk)

    def latent_to_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [.., H, R] -> hidden [.., hidden_size] (W_uv then o_proj)."""
        _, w_uv = self._kv_b()
        o = torch.einsum("...hr,hvr->...hv", o_lat, w_uv)  # [.., H, V]
        return self.o_proj(o.flatten(-2))

    # --- forward ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: MaskSpec,
                prev_topk: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x [B, T, hidden] -> (out [B, T, hidden], selection (idx, valid) [B, T, K] or None if dense)."""
        B, T, _ = x.shape
        q_nope, q_rope, q_resid = self.project_q(x, cos, sin)
        c_kv, k_rope = self.project_kv(x, cos, sin)
        S = c_kv.shape[1]
        sel = self.select(x, q_resid, cos, sin, S, mask, prev_topk)
        if sel is None:
            return self._dense(q_nope, q_rope, c_kv, k_rope, mask), None
        if S <= DENSE_MASK_RATIO * sel[0].shape[-1]:
            # Few keys per selected key: dense SDPA under the selection mask ([B, T, S] bools, no heads)
            # is cheaper than gathering; same result (tested).
            allowed = torch.zeros(sel[0].shape[:2] + (S,), dtype=torch.bool, device=x.device)
            allowed.scatter_(-1, sel[0], sel[1])
            return self._dense(q_nope, q_rope, c_kv, k_rope, MaskSpec(causal=False, attention_mask=allowed)), sel
        return self._sparse(q_nope, q_rope, c_kv, k_rope, sel), sel

    def needs_selection(self, num_keys: int) -> bool:
        if self.cfg.sparse_attention == "window":
            return True
        return self.cfg.index_topk < num_keys

    def select(self, x, q_resid, cos, sin, num_keys: int, mask: MaskSpec, prev_topk):
        """Key selection for this layer: own indexer ("full"), the previous layer's ("shared"), or None."""
        if not self.needs_selection(num_keys):
            return None
        if self.indexer is None:
            if prev_topk is None:
                raise ValueError(f"layer {self.layer_idx} is a 'shared' indexer layer but no previous full "
                                 "layer produced a top-k selection")
            return prev_topk
        qi, wi = self.indexer.project_q(x, q_resid, cos, sin)
        ki = self.indexer.project_k(x, cos, sin)
        cfg = self.cfg
        if cfg.sparse_attention == "window":
            return window_select(self.indexer, qi, wi, ki, mask, cfg.window_size, cfg.window_global_every,
                                 cfg.window_routed_blocks, cfg.window_block_size)
        return dsa_topk(self.indexer, qi, wi, ki, mask, cfg.index_topk)

    def _dense(self, q_nope, q_rope, c_kv, k_rope, mask: MaskSpec) -> torch.Tensor:
        B, T, S = q_nope.shape[0], q_nope.shape[1], c_kv.shape[1]
        kv = self.kv_b_proj(c_kv).view(B, S, self.n_heads, self.nope + self.v_dim)  # [B, S, H, E+V]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, self.n_heads, -1)], dim=-1)  # [B, S, H, E+P]
        q = torch.cat([q_nope, q_rope], dim=-1)  # [B, T, H, E+P]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T|S, D]
        # SDPA's flash kernels need one head dim for q, k and v: zero-pad the narrower side (the scale is
        # explicit, zero channels add nothing to q.k, padded value channels are sliced off). Without it
        # CPU SDPA falls back to the math kernel and materialises [B, H, T, S] (4.6x slower at T = 4096).
        d = max(q.shape[-1], v.shape[-1])
        if v.shape[-1] < d:
            v = F.pad(v, (0, d - v.shape[-1]))
        elif q.shape[-1] < d:
            q, k = F.pad(q, (0, d - q.shape[-1])), F.pad(k, (0, d - k.shape[-1]))
        if mask.is_plain_causal and mask.q_offset == 0 and T == S:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            allowed = mask.dense(T, S, q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if allowed is None else allowed[:, None],
                                               scale=self.scale)
        o = o[..., : self.v_dim]  # [B, H, T, V]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim))

    def _sparse(self, q_nope, q_rope, c_kv, k_rope, sel) -> torch.Tensor:
        """Attend to the selected keys only, in the latent space. Chunked over queries."""
        idx, valid = sel
        B, T, K = idx.shape
        q_lat = self.absorb_q(q_nope)  # [B, T, H, R]
        lat = torch.cat([c_kv, k_rope], dim=-1)  # [B, S, R+P]
        qq = torch.cat([q_lat, q_rope], dim=-1)  # [B, T, H, R+P]
        per_row = B * K * (lat.shape[-1] + 2 * self.n_heads) * 4
        c = max(1, SCORE_CHUNK_BYTES // per_row)
        outs = []
        for q0 in range(0, T, c):
            q1 = min(T, q0 + c)
            outs.append(sparse_latent_attention(qq[:, q0:q1], lat, idx[:, q0:q1], valid[:, q0:q1],
                                                self.kv_rank, self.scale))
        o_lat = torch.cat(outs, dim=1)  # [B, T, H, R]
        return self.latent_to_output(o_lat)


def sparse_latent_attention(qq: torch.Tensor, lat: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                            kv_rank: int, scale: float) -> torch.Tensor:
    """Absorbed MLA over gathered keys.

    qq [B, c, H, R+P] (latent query | rope query), lat [B, S, R+P] (latent | rope key),
    idx/valid [B, c, K] -> latent output [B, c, H, R] (softmax over the K selected keys, fp32).
    """
    B, c, K = idx.shape
    S = lat.shape[1]
    rows = (idx + torch.arange(B, device=idx.device)[:, None, None] * S).reshape(-1)  # flat key rows
    g = lat.reshape(B * S, -1).index_select(0, rows).view(B, c, K, -1)  # [B, c, K, R+P]
    s = torch.matmul(qq, g.transpose(-1, -2)).float() * scale  # [B, c, H, K]
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(g.dtype)
    return torch.matmul(p, g[..., :kv_rank])  # [B, c, H, R]
