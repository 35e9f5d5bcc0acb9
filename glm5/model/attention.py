"""Multi-head latent attention (MLA) with DSA sparse key selection; one module for training and serving.

Queries go through a low-rank bottleneck (q_a -> RMSNorm -> q_b); keys/values are compressed into one
latent `c_kv` [kv_lora_rank] plus one shared rope key [qk_rope_head_dim] per token (decoupled RoPE).
Execution paths, equal in exact arithmetic:
  * dense (training, no cache): expand K/V per head with kv_b_proj and run SDPA, when every allowed key
    is selected (index_topk >= T, as in GLM-5 below 2048 tokens);
  * sparse (training): per query, gather only the K selected latents and attend in the latent space with
    kv_b_proj absorbed into the query and the output (memory grows with T*K, never with heads*T*T); when
    the sequence is short (S <= 4K) the selection is applied as a [B, T, S] mask on dense SDPA instead;
  * paged (serving: `PagedContext`): write this step's latent / rope key / indexer key rows into the
    cache, then per attention group absorbed MLA over the cached rows (dense or over the selected keys),
    or, for prefill chunks where it is cheaper, the dense kernel on K/V expanded from the cached rows.
The key selection (DSA top-k or the window+global pattern) is the same function on every path.

Dims: B batch, T queries, S keys, H heads, R kv_lora_rank, P qk_rope_head_dim, E nope dim, V v dim, K selected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .indexer import Indexer, dsa_topk, window_select
from .latent_attention import dense_latent_attention, gathered_latent_attention
from .layers import RMSNorm, apply_rope
from .masks import MaskSpec
from .paged import AttnGroup, PagedContext

Selection = tuple[torch.Tensor, torch.Tensor]  # (idx, valid) [B, T, K]: selected key indices per query


# Sparse layers with at most this many keys per selected key run dense SDPA under a selection mask
# (cheaper than gathering at short lengths, e.g. T = 512 with index_topk 256); longer ones gather.
DENSE_MASK_RATIO = 4
# inference on CPU: score matrices up to this many elements (B * H * T * S) go through `_attend_math`
SMALL_SCORES = 2**21


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

    # --- projections -------------------------------------------------------------------------------
    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the rope part of queries / keys (`apply_rope` in the checkpoint's pair layout)."""
        return apply_rope(x, cos, sin, self.cfg.rope_interleave)

    def project_q(self, x: torch.Tensor, cos, sin):
        """-> q_nope [B, T, H, E], q_rope (rotated) [B, T, H, P], q_resid [B, T, q_lora_rank]."""
        B, T, _ = x.shape
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(B, T, self.n_heads, self.nope + self.rope)  # [B, T, H, E+P]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = self.rotate(q_rope, cos[:, :, None], sin[:, :, None])
        return q_nope, q_rope, q_resid

    def project_kv(self, x: torch.Tensor, cos, sin):
        """-> normalised latent c_kv [B, S, R] and the rotated shared rope key [B, S, P]: the MLA cache."""
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        return self.kv_a_layernorm(c_kv), self.rotate(k_rope, cos, sin)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight
        w = w.to_local() if hasattr(w, "to_local") else w  # tensor parallel: this rank's heads only
        w = w.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)  # [H, E+V, R]
        return w[:, : self.nope], w[:, self.nope:]  # W_uk [H, E, R], W_uv [H, V, R]

    def absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [.., H, E] -> latent-space query [.., H, R] (q . W_uk c == (W_uk^T q) . c)."""
        w_uk, _ = self._kv_b()
        q = q_nope.reshape(-1, *q_nope.shape[-2:]).transpose(0, 1)  # [H, n, E]
        return torch.bmm(q, w_uk).transpose(0, 1).reshape(*q_nope.shape[:-1], -1)  # one bmm (einsum: +10 us)

    def latent_to_heads(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [.., H, R] -> per-head values [.., H, V] (W_uv)."""
        _, w_uv = self._kv_b()
        o = o_lat.reshape(-1, *o_lat.shape[-2:]).transpose(0, 1)  # [H, n, R]
        return torch.bmm(o, w_uv.transpose(1, 2)).transpose(0, 1).reshape(*o_lat.shape[:-1], -1)

    def latent_to_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space [.., H, R] -> hidden [.., hidden_size] (W_uv then o_proj)."""
        return self.o_proj(self.latent_to_heads(o_lat).flatten(-2))

    # --- forward ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: MaskSpec | PagedContext,
                prev_sel=None):
        """x [B, T, hidden] -> (out [B, T, hidden], this layer's selection or None if dense).

        Training: ctx is a MaskSpec and the selection is (idx, valid) [B, T, K]. Paged: x is [1, N, hidden]
        (flat tokens) and the selection is a list with one entry per attention group."""
        if isinstance(ctx, PagedContext):
            return self._forward_paged(x, cos, sin, ctx, prev_sel)
        q_nope, q_rope, q_resid = self.project_q(x, cos, sin)
        c_kv, k_rope = self.project_kv(x, cos, sin)
        S = c_kv.shape[1]
        sel = None
        if self.needs_selection(S):
            qi, wi, ki = self._index_inputs(x, q_resid, cos, sin)
            sel = self.select(qi, wi, ki, ctx, prev_sel)
        if sel is None:
            return self._dense(q_nope, q_rope, c_kv, k_rope, ctx), None
        if S <= DENSE_MASK_RATIO * sel[0].shape[-1]:
            # Few keys per selected key: dense SDPA under the selection mask ([B, T, S] bools, no heads)
            # is cheaper than gathering; same result (tested).
            allowed = torch.zeros(sel[0].shape[:2] + (S,), dtype=torch.bool, device=x.device)
            allowed.scatter_(-1, sel[0], sel[1])
            return self._dense(q_nope, q_rope, c_kv, k_rope, MaskSpec(causal=False, attention_mask=allowed)), sel
        return self._sparse(q_nope, q_rope, c_kv, k_rope, sel), sel

    def needs_selection(self, num_keys: int) -> bool:
        """Whether attention over `num_keys` keys selects keys (else every allowed key is attended)."""
        if self.cfg.attention_kind != "dsa":  # glm4_moe_lite: MLA without the indexer, always dense
            return False
        if self.cfg.sparse_attention == "window":
            return True
        return self.cfg.index_topk < num_keys

    def _index_inputs(self, x, q_resid, cos, sin):
        """Indexer queries/weights for x, and its keys when this layer has its own indexer."""
        if self.indexer is None:
            return None, None, None
        qi, wi = self.indexer.project_q(x, q_resid, cos, sin)
        return qi, wi, self.indexer.project_k(x, cos, sin)

    def select(self, qi, wi, ki, mask: MaskSpec, prev_sel: Selection | None) -> Selection:
        """Key selection for this layer: own indexer ("full") or the previous layer's ("shared").
        qi [B, T, N, D], wi [B, T, N], ki [B, S, D] -> (idx, valid) [B, T, K]."""
        if self.indexer is None:
            if prev_sel is None:
                raise ValueError(f"layer {self.layer_idx} is a 'shared' indexer layer but no previous full "
                                 "layer produced a top-k selection")
            return prev_sel
        cfg = self.cfg
        if cfg.sparse_attention == "window":
            return window_select(self.indexer, qi, wi, ki, mask, cfg.window_size, cfg.window_global_every,
                                 cfg.window_routed_blocks, cfg.window_block_size)
        return dsa_topk(self.indexer, qi, wi, ki, mask, cfg.index_topk)

    # --- paged (serving) -----------------------------------------------------------------------------
    def _forward_paged(self, x, cos, sin, ctx: PagedContext, prev_sel: list | None):
        """Flat tokens x [1, N, hidden] -> (out [1, N, hidden], per-group selections)."""
        meta, cache, layer = ctx.meta, ctx.cache, self.layer_idx
        q_nope, q_rope, q_resid = self.project_q(x, cos, sin)  # [1, N, H, E], [1, N, H, P]
        c_kv, k_rope = self.project_kv(x, cos, sin)  # [1, N, R], [1, N, P]
        qi = wi = ki = None
        if self.indexer is not None and cache.index_k[layer] is not None:
            ki = self.indexer.project_k(x, cos, sin)[0]  # [N, D]: every full layer caches its indexer key
        cache.write(layer, meta.slot_mapping, c_kv[0], k_rope[0], ki)
        if self.indexer is not None and any(self.needs_selection(g.num_keys) for g in meta.groups):
            qi, wi = self.indexer.project_q(x, q_resid, cos, sin)
            qi, wi = qi[0], wi[0]  # [N, I, D], [N, I]
        q_nope, q_rope = q_nope[0], q_rope[0]  # [N, H, E], [N, H, P]
        latent, N = cache.latent[layer], q_nope.shape[0]
        sels = [None if not self.needs_selection(g.num_keys) else
                self._select_group(g, qi, wi, cache, None if prev_sel is None else prev_sel[gi])
                for gi, g in enumerate(meta.groups)]
        # per-row kv_b_proj adapters (multi-LoRA) act on the absorbed path only (see glm5/infer/lora.py)
        expand = [meta.adapter_ids is None and self._expands(g, sel) for g, sel in zip(meta.groups, sels)]
        fused = self.fuses_absorbed(ctx)  # small steps: each group's absorbed path in one piece
        if not any(expand) and (not fused or any(sel is not None for sel in sels)):
            # all absorbed (decode steps): W_uk once over the step, W_uv + o_proj once
            qq = torch.cat([self.absorb_q(q_nope), q_rope], dim=-1)  # [N, H, R+P]
            o_lat = None  # [N, H, R]
            for g, sel in zip(meta.groups, sels):
                o_lat = _place(o_lat, g, self._attend_latent(g, _rows(g, qq), latent, sel), N)
            return self.latent_to_output(o_lat)[None], sels
        # [N, H, V]: expanded groups, fused ones (small steps) and other absorbed ones (W_uk / W_uv on their rows)
        o_heads = None
        for g, sel, exp in zip(meta.groups, sels, expand):
            if exp:
                og = self._attend_expanded(g, q_nope, q_rope, latent, sel)  # [B, T, H, V]
            elif sel is None:
                og = self.absorbed_heads(g, _rows(g, q_nope), _rows(g, q_rope), latent)
            else:
                qg = torch.cat([self.absorb_q(_rows(g, q_nope)), _rows(g, q_rope)], dim=-1)  # [B, T, H, R+P]
                og = self.latent_to_heads(self._attend_latent(g, qg, latent, sel))
            o_heads = _place(o_heads, g, og, N)
        return self.o_proj(o_heads.flatten(-2))[None], sels

    def fuses_absorbed(self, ctx: PagedContext) -> bool:
        """Whether this step attends each absorbed group in one piece (`absorbed_heads` per group) rather than
        W_uk once over the step, the groups' attention, then W_uv once: never here (the two are equal; the
        engine's native module, glm5/infer/kernels.py, fuses small steps into one kernel call per group)."""
        return False

    def absorbed_heads(self, g: AttnGroup, q_nope: torch.Tensor, q_rope: torch.Tensor,
                       latent: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA of one group over every allowed key from its un-absorbed queries q_nope [B, T, H, E],
        q_rope [B, T, H, P] -> per-head values [B, T, H, V]: W_uk into the query, latent attention, W_uv."""
        qg = torch.cat([self.absorb_q(q_nope), q_rope], dim=-1)  # [B, T, H, R+P]
        return self.latent_to_heads(self.dense_latent(g, qg, latent))

    def dense_latent(self, g: AttnGroup, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        """Absorbed attention of one group's queries q [B, T, H, R+P] over every allowed cached key -> [B, T, H, R]."""
        return dense_latent_attention(q, latent, g.key_slots, g.key_bias, self.kv_rank, self.scale, g.key_lens)

    def _expands(self, g: AttnGroup, sel) -> bool:
        """Whether to attend this group with per-head K/V (kv_b_proj on the cached latents, then SDPA: the
        training kernel) instead of absorbed MLA: when it costs fewer multiply-adds, i.e. for prefill
        chunks (T queries over S keys pay S expansions once); decode rows stay absorbed. Equal in exact
        arithmetic. Selections wider than a quarter of the keys are applied as a mask, sparser ones keep
        the gathered latent kernel (as in training)."""
        T, S = g.q_index.shape[1], g.num_keys
        if sel is not None and S > DENSE_MASK_RATIO * sel[0].shape[-1]:
            return False
        H, E, P, V, R = self.n_heads, self.nope, self.rope, self.v_dim, self.kv_rank
        absorbed = T * H * (E * R + S * (2 * R + P) + R * V)
        expanded = S * R * H * (E + V) + T * S * H * (E + P + V) // (2 if g.causal_from_start else 1)
        return expanded < absorbed

    def _attend_expanded(self, g: AttnGroup, q_nope, q_rope, latent, sel) -> torch.Tensor:
        """q_nope [N, H, E], q_rope [N, H, P]; the group's cached latents expanded per head -> [B, T, H, V]."""
        B, T = g.q_index.shape
        S = g.num_keys
        lat = latent.index_select(0, g.key_slots.reshape(-1)).view(B, S, -1)  # [B, S, R+P]
        c_kv, k_rope = lat.split([self.kv_rank, self.rope], dim=-1)
        qn, qr = _rows(g, q_nope), _rows(g, q_rope)  # [B, T, H, E], [B, T, H, P]
        if sel is not None:  # the selection as a [B, T, S] mask (it only selects allowed keys)
            allowed = torch.zeros(B, T, S, dtype=torch.bool, device=lat.device).scatter_(-1, sel[0], sel[1])
            mask = MaskSpec(causal=False, attention_mask=allowed)
        elif g.causal_from_start:
            mask = MaskSpec(causal=True)
        else:
            mask = MaskSpec(causal=False, attention_mask=g.allowed)
        return self._dense_heads(qn, qr, c_kv, k_rope, mask)

    def _select_group(self, g: AttnGroup, qi, wi, cache, prev_sel) -> Selection:
        """The group's selection over its cached indexer keys (idx = key indices within each sequence)."""
        if self.indexer is None:
            return self.select(None, None, None, MaskSpec(), prev_sel)
        ki = cache.gather_index_k(self.layer_idx, g.key_slots).float()  # [B, S, D]
        mask = MaskSpec(causal=False, attention_mask=g.allowed, q_positions=g.q_pos)
        return self.select(qi[g.q_index], wi[g.q_index], ki, mask, None)  # [B, T, I, D], [B, T, I]

    def _attend_latent(self, g: AttnGroup, q: torch.Tensor, latent: torch.Tensor, sel) -> torch.Tensor:
        """Absorbed MLA for one group's queries q [B, T, H, R+P] over cache rows `latent` [slots, R+P]
        -> [B, T, H, R]: every allowed key, or the selected ones."""
        if sel is None:
            return self.dense_latent(g, q, latent)
        return gathered_latent_attention(q, latent, g.key_slots, sel[0], sel[1], self.kv_rank, self.scale)

    # --- training kernels -----------------------------------------------------------------------------
    def _dense(self, q_nope, q_rope, c_kv, k_rope, mask: MaskSpec) -> torch.Tensor:
        B, T = q_nope.shape[:2]
        return self.o_proj(self._dense_heads(q_nope, q_rope, c_kv, k_rope, mask).reshape(B, T, -1))

    def _dense_heads(self, q_nope, q_rope, c_kv, k_rope, mask: MaskSpec) -> torch.Tensor:
        """Per-head K/V from the latents and SDPA: q_nope [B, T, H, E], q_rope [B, T, H, P], c_kv [B, S, R],
        k_rope [B, S, P] -> [B, T, H, V]."""
        B, T, S = q_nope.shape[0], q_nope.shape[1], c_kv.shape[1]
        kv = self.kv_b_proj(c_kv).view(B, S, self.n_heads, self.nope + self.v_dim)  # [B, S, H, E+V]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(-1, -1, self.n_heads, -1)], dim=-1)  # [B, S, H, E+P]
        q = torch.cat([q_nope, q_rope], dim=-1)  # [B, T, H, E+P]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T|S, D]
        if not torch.is_grad_enabled() and q.device.type == "cpu" and B * self.n_heads * T * S <= SMALL_SCORES:
            return self._attend_math(q, k, v, mask, T, S)
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
        return o[..., : self.v_dim].transpose(1, 2)  # [B, T, H, V]

    def _attend_math(self, q, k, v, mask: MaskSpec, T: int, S: int) -> torch.Tensor:
        """q, k [B, H, T|S, E+P], v [B, H, S, V] -> [B, T, H, V]: scores, mask, softmax, values as three
        batched products. At inference on CPU with small score matrices (prefill chunks of a few hundred
        tokens) this beats SDPA's flash kernel, which needs v zero-padded to q's head dim (2.3x the value
        products here) and has per-block overhead: 1.2-1.45x at T = S = 64-256, 6 heads, 1 thread."""
        B, H = q.shape[:2]
        allowed = mask.dense(T, S, q.device)  # [B|1, T, S] bool, None = every key
        bias = None if allowed is None else torch.zeros(allowed.shape, device=q.device).masked_fill_(~allowed, float("-inf"))
        qf, kf = q.reshape(B * H, T, -1), k.reshape(B * H, S, -1)
        if bias is None:
            sc = torch.bmm(qf, kf.transpose(1, 2)).mul_(self.scale)
        else:
            sc = torch.baddbmm(bias[:, None].expand(B, H, T, S).reshape(B * H, T, S), qf, kf.transpose(1, 2),
                               alpha=self.scale)
        o = torch.bmm(sc.softmax(-1), v.reshape(B * H, S, -1))  # [B*H, T, V]
        return o.view(B, H, T, -1).transpose(1, 2)

    def _sparse(self, q_nope, q_rope, c_kv, k_rope, sel: Selection) -> torch.Tensor:
        """Attend to the selected keys only, in the latent space (the same kernel as the paged path, over
        the batch's own latents as the key table)."""
        B, S = c_kv.shape[:2]
        qq = torch.cat([self.absorb_q(q_nope), q_rope], dim=-1)  # [B, T, H, R+P]
        lat = torch.cat([c_kv, k_rope], dim=-1).reshape(B * S, -1)  # [B*S, R+P]
        rows = torch.arange(B * S, device=c_kv.device).view(B, S)  # [B, S] row of each key
        o_lat = gathered_latent_attention(qq, lat, rows, sel[0], sel[1], self.kv_rank, self.scale)  # [B, T, H, R]
        return self.latent_to_output(o_lat)


def _rows(g: AttnGroup, x: torch.Tensor) -> torch.Tensor:
    """The group's query rows of a step tensor x [N, ...] -> [B, T, ...] (padding rows: token 0)."""
    B, T = g.q_index.shape
    if g.is_identity:
        return x.view(B, T, *x.shape[1:])
    return x.index_select(0, g.q_index.reshape(-1)).view(B, T, *x.shape[1:])


def _place(out: torch.Tensor | None, g: AttnGroup, og: torch.Tensor, n: int) -> torch.Tensor:
    """Write a group's output og [B, T, H, D] (valid query rows only) into the step's out [N, H, D],
    allocated uninitialised on first use: every token is a valid query of exactly one group."""
    if g.is_identity:
        return og.reshape(-1, *og.shape[2:])  # the group is the whole step, in order
    if out is None:
        out = og.new_empty(n, *og.shape[2:])
    rows = og.reshape(-1, *og.shape[2:])  # [B*T, H, D]
    return out.index_copy_(0, g.out_index, rows if g.valid_rows is None else rows.index_select(0, g.valid_rows))
