"""DSA lightning-indexer training (GLM5_ARCHITECTURE.md §1.6; DeepSeek-V3.2 recipe), from outside the model.

Stage 1, dense warm-up: the main model is frozen and attends densely; only the indexers learn, by
KL(p || softmax(I)) where p is the main attention distribution summed over heads and L1-normalised,
and I the indexer scores, over the keys each query may attend to.
Stage 2, sparse training: the main model trains on its top-k selection; each indexer gets the same KL
restricted to the keys it selected, computed on a detached copy of its input, so the indexer loss
never reaches the main model (and the LM loss never reaches the indexer: selection is non-differentiable).

Forward pre-hooks on the attention modules capture each layer's input (x, cos, sin, mask); the
attention target is recomputed from the layer's own projections. The KL may be taken over a random
subset of the query rows (`rows`, `dsa.indexer_kl_rows`): its cost is rows x keys per layer, the frozen
forward's is linear in the tokens. Dims: B batch, T queries, S keys, H heads, c a chunk of query rows.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from glm5.model.masks import MaskSpec

CHUNK_ELEMS = 1 << 24  # query rows per chunk: B * c * H * S stays under this many floats


class AttnCapture:
    """Records (attention module, detached input x, cos, sin, mask) for every layer that owns an indexer.
    `rows`: query rows per sequence that the KL over these records takes (`indexer_kl`; 0 = all)."""

    def __init__(self, model: nn.Module, rows: int = 0):
        self.records: list[tuple] = []
        self.enabled = True
        self.rows = rows
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
def attention_keys(attn, x, cos, sin) -> torch.Tensor:
    """The layer's per-head attention keys [B, S, H, E+P] (fp32): kv_b_proj's nope part + the shared rope key."""
    B, S = x.shape[:2]
    c_kv, k_rope = attn.project_kv(x, cos, sin)
    kv = attn.kv_b_proj(c_kv).view(B, S, attn.n_heads, attn.nope + attn.v_dim)  # [B, S, H, E+V]
    return torch.cat([kv[..., : attn.nope], k_rope[:, :, None].expand(-1, -1, attn.n_heads, -1)], -1).float()


@torch.no_grad()
def attention_probs(attn, x, cos, sin, q, keys: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Head-summed, L1-normalised dense attention probabilities of the query rows `q` (a slice or an index
    tensor into T) over `keys` [B, S', H, E+P] (S' <= S: a causal prefix is enough), `allowed`
    [B|1, c, S'] bool or None -> [B, c, S']."""
    q_nope, q_rope, _ = attn.project_q(x[:, q], cos[:, q], sin[:, q])
    qq = torch.cat([q_nope, q_rope], dim=-1).float()  # [B, c, H, E+P]
    s = torch.einsum("bthd,bshd->bhts", qq, keys) * attn.scale  # [B, H, c, S']
    if allowed is not None:
        s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).sum(1)  # [B, c, S']
    return p / p.sum(-1, keepdim=True).clamp(min=1e-20)


def attention_target(attn, x, cos, sin, mask: MaskSpec, q0: int, q1: int) -> torch.Tensor:
    """Head-summed, L1-normalised dense attention probabilities of rows [q0, q1) over every key: [B, c, S]."""
    S = x.shape[1]
    return attention_probs(attn, x, cos, sin, slice(q0, q1), attention_keys(attn, x, cos, sin),
                           mask.rows(q0, q1, S, x.device))


def indexer_scores(attn, x, cos, sin, q, ki: torch.Tensor) -> torch.Tensor:
    """Indexer scores I [B, c, S'] of the query rows `q` over the indexer keys `ki` [B, S', D], differentiable
    w.r.t. the indexer's weights only (the input and the query latent are detached)."""
    x = x.detach()
    xq, cq, sq = x[:, q], cos[:, q], sin[:, q]
    with torch.no_grad():
        _, _, q_resid = attn.project_q(xq, cq, sq)
    qi, wi = attn.indexer.project_q(xq, q_resid, cq, sq)
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


def query_rows(num_queries: int, rows: int) -> torch.Tensor | None:
    """`rows` distinct query indices of [0, num_queries), sorted, drawn from torch's global RNG (every
    checkpoint stores its state, so a resumed run draws what the uninterrupted one would have);
    None = every row (rows <= 0 or rows >= num_queries)."""
    if rows <= 0 or rows >= num_queries:
        return None
    return torch.randperm(num_queries)[:rows].sort().values


def indexer_kl(records: list[tuple], selections: list | None = None, rows: int = 0) -> torch.Tensor:
    """Mean per-query KL over the captured layers. With `selections` (the model's per-layer
    (idx, valid) or None), each layer's KL is restricted to its selected keys (stage 2). `rows` > 0:
    only that many query rows (drawn once per call, the same rows in every layer) enter the KL."""
    total, n_rows = None, 0
    by_layer = dict(enumerate(selections)) if selections is not None else {}
    picked: dict[int, torch.Tensor | None] = {}  # sequence length -> the query rows drawn for it
    for attn, x, cos, sin, mask in records:
        B, T = x.shape[:2]
        sel = by_layer.get(attn.layer_idx)
        if selections is not None and sel is None:
            continue  # dense layer in stage 2: the indexer selected nothing
        if T not in picked:
            picked[T] = query_rows(T, rows)
        order = picked[T] if picked[T] is not None else torch.arange(T)
        keys = attention_keys(attn, x, cos, sin)  # [B, S, H, E+P], once per layer
        ki = attn.indexer.project_k(x.detach(), cos, sin)  # [B, S, D], differentiable
        c = max(1, CHUNK_ELEMS // max(1, B * attn.n_heads * T))
        for part in order.to(x.device).split(c):
            lo, hi = int(part[0]), int(part[-1]) + 1
            # causal: keys past the chunk's last query are never allowed, so they are not scored
            s_end = min(T, mask.q_offset + hi) if mask.causal and mask.q_positions is None else T
            allowed = mask.rows(lo, hi, s_end, x.device)
            allowed = None if allowed is None else allowed[:, part - lo]  # [B|1, c, s_end]
            keep = (torch.ones(B, len(part), s_end, dtype=torch.bool, device=x.device) if allowed is None
                    else allowed.expand(B, -1, -1))
            if sel is not None:
                idx, valid = sel[0][:, part], sel[1][:, part]  # [B, c, K]
                # padding entries may point anywhere (even past s_end): they add nothing at key 0
                hits = torch.zeros(keep.shape, device=x.device).scatter_add_(
                    -1, torch.where(valid, idx, 0), valid.float())
                keep = keep & (hits > 0)
            kl, n = kl_to_attention(attention_probs(attn, x, cos, sin, part, keys[:, :s_end], allowed),
                                    indexer_scores(attn, x, cos, sin, part, ki[:, :s_end]), keep)
            total = kl if total is None else total + kl
            n_rows += n
    if total is None:
        return torch.zeros(())
    return total / max(1, n_rows)


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
    """One stage-1 step: frozen dense forward (no graph, logits of one position only), then the indexers'
    KL loss (over `capture.rows` random query rows per sequence, 0 = all) and update."""
    capture.clear()
    with torch.no_grad(), dense_attention(model):
        model(**{k: batch[k] for k in model_keys if batch.get(k) is not None}, logits_to_keep=1)
    loss = indexer_kl(capture.records, rows=capture.rows)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    capture.clear()
    return float(loss.detach())
