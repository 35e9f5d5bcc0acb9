"""DSA lightning-indexer training (GLM5_ARCHITECTURE.md §1.6; DeepSeek-V3.2 recipe), from outside the model.

Stage 1, dense warm-up: the main model is frozen and attends densely; only the indexers learn, by
KL(p || softmax(I)) where p is the main attention distribution summed over heads and L1-normalised,
and I the indexer scores, over the keys each query may attend to.
Stage 2, sparse training: the main model trains on its top-k selection; each indexer gets the same KL
restricted to the keys it selected, computed on a detached copy of its input, so the indexer loss
never reaches the main model (and the LM loss never reaches the indexer: selection is non-differentiable).

Forward pre-hooks on the attention modules capture each layer's input (x, cos, sin, mask); the
attention target is recomputed from the layer's own projections. Dims: B batch, T queries, S keys,
H heads, c a chunk of query rows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_ELEMS = 1 << 24  # query rows per chunk: B * c * H * S stays under this many floats


class AttnCapture:
    """Records (attention module, detached input x, cos, sin, mask) for every layer that owns an indexer."""

    def __init__(self, model: nn.Module):
        self.records: list[tuple] = []
        self.enabled = True
        self._handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True)
                         for m in model.modules() if getattr(m, "indexer", None) is not None]

    def _hook(self, module, args, kwargs):
        if self.enabled:
            x, cos, sin, mask = (list(args) + [kwargs.get(k) for k in ("x", "cos", "sin", "mask")][len(args):])[:4]
            self.records.append((module, x.detach(), cos, sin, mask))

    def clear(self) -> None:
        self.records = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@torch.no_grad()
def attention_target(attn, x, cos, sin, mask, q0: int, q1: int) -> torch.Tensor:
    """Head-summed, L1-normalised dense attention probabilities of rows [q0, q1): [B, c, S]."""
    B, S = x.shape[0], x.shape[1]
    q_nope, q_rope, _ = attn.project_q(x[:, q0:q1], cos[:, q0:q1], sin[:, q0:q1])
    c_kv, k_rope = attn.project_kv(x, cos, sin)
    kv = attn.kv_b_proj(c_kv).view(B, S, attn.n_heads, attn.nope + attn.v_dim)  # [B, S, H, E+V]
    k = torch.cat([kv[..., : attn.nope], k_rope[:, :, None].expand(-1, -1, attn.n_heads, -1)], -1)  # [B, S, H, E+P]
    q = torch.cat([q_nope, q_rope], dim=-1)  # [B, c, H, E+P]
    s = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * attn.scale  # [B, H, c, S]
    allowed = mask.rows(q0, q1, S, x.device)
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).sum(1)  # [B, c, S]
    return p / p.sum(-1, keepdim=True).clamp(min=1e-20)


def indexer_scores(attn, x, cos, sin, q0: int, q1: int) -> torch.Tensor:
    """Indexer scores I [B, c, S] of rows [q0, q1) (differentiable w.r.t. the indexer's weights only:
    the input and the query latent are detached)."""
    x = x.detach()
    with torch.no_grad():
        _, _, q_resid = attn.project_q(x[:, q0:q1], cos[:, q0:q1], sin[:, q0:q1])
    qi, wi = attn.indexer.project_q(x[:, q0:q1], q_resid.detach(), cos[:, q0:q1], sin[:, q0:q1])
    ki = attn.indexer.project_k(x, cos, sin)
    return attn.indexer.scores(qi, wi, ki)


def kl_to_attention(p: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum over query rows of KL(p || softmax(scores)), both restricted to (and renormalised over) the
    keys in `keep` [B, c, S]; returns (sum, number of rows that had any key)."""
    p = p * keep
    rows = p.sum(-1) > 0  # [B, c]
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-20)
    logq = F.log_softmax(scores.float().masked_fill(~keep, float("-inf")), dim=-1)
    terms = torch.where(p > 0, p * (torch.log(p.clamp(min=1e-20)) - logq), torch.zeros_like(p))
    return terms.sum(-1)[rows].sum(), int(rows.sum())


def indexer_kl(records: list[tuple], selections: list | None = None) -> torch.Tensor:
    """Mean per-query KL over the captured layers. With `selections` (the model's per-layer
    (idx, valid) or None), each layer's KL is restricted to its selected keys (stage 2)."""
    total, rows = None, 0
    by_layer = {}
    if selections is not None:
        by_layer = {i: s for i, s in enumerate(selections)}
    for attn, x, cos, sin, mask in records:
        B, T = x.shape[:2]
        sel = by_layer.get(attn.layer_idx) if selections is not None else None
        if selections is not None and sel is None:
            continue  # dense layer in stage 2: the indexer selected nothing
        c = max(1, CHUNK_ELEMS // max(1, B * attn.n_heads * T))
        for q0 in range(0, T, c):
            q1 = min(T, q0 + c)
            allowed = mask.rows(q0, q1, T, x.device)
            keep = torch.ones(B, q1 - q0, T, dtype=torch.bool, device=x.device) if allowed is None \
                else allowed.expand(B, -1, -1)
            if sel is not None:
                idx, valid = sel
                chosen = torch.zeros_like(keep).scatter_(-1, idx[:, q0:q1], valid[:, q0:q1])
                keep = keep & chosen
            kl, n = kl_to_attention(attention_target(attn, x, cos, sin, mask, q0, q1),
                                    indexer_scores(attn, x, cos, sin, q0, q1), keep)
            total = kl if total is None else total + kl
            rows += n
    if total is None:
        return torch.zeros(())
    return total / max(1, rows)


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".indexer." in n]


@contextlib.contextmanager
def dense_attention(model: nn.Module):
    """Temporarily make every layer attend densely (selection off) by lifting `index_topk`."""
    cfg = model.config
    old = cfg.index_topk
    cfg.index_topk = 1 << 62
    try:
        yield
    finally:
        cfg.index_topk = old


def warmup_step(model: nn.Module, batch: dict, optimizer: torch.optim.Optimizer, capture: AttnCapture,
                model_keys: tuple[str, ...]) -> float:
    """One stage-1 step: frozen dense forward (no graph), then the indexers' KL loss and update."""
    capture.clear()
    with torch.no_grad(), dense_attention(model):
        model(**{k: batch[k] for k in model_keys if batch.get(k) is not None})
    loss = indexer_kl(capture.records)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    capture.clear()
    return float(loss.detach())
