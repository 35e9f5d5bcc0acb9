"""Sparse attention: latent gather path vs dense SDPA, chunking, the window+global selector vs a brute-force
mask, packed documents and GLM blank-infilling masks."""

import math

import torch

import glm5.model.attention as attention
import glm5.model.indexer as indexer
import glm5.model.latent_attention as latent_attention
from glm5.model.indexer import dsa_topk, window_select
from glm5.model.layers import rope_angles
from glm5.model.masks import MaskSpec

from ._tiny import tiny_model


def _attn_inputs(m, T=21, B=2, layer=1):
    attn = m.model.layers[layer].self_attn
    x = torch.randn(B, T, 64)
    pos = torch.arange(T)[None].expand(B, -1)
    cos, sin = rope_angles(pos, m.model.inv_freq)
    return attn, x, cos, sin


def test_sparse_with_full_topk_equals_dense():
    m = tiny_model(seed=4)
    attn, x, cos, sin = _attn_inputs(m)
    mask = MaskSpec()
    q_nope, q_rope, q_resid = attn.project_q(x, cos, sin)
    c_kv, k_rope = attn.project_kv(x, cos, sin)
    qi, wi = attn.indexer.project_q(x, q_resid, cos, sin)
    sel = dsa_topk(attn.indexer, qi, wi, attn.indexer.project_k(x, cos, sin), mask, topk=x.shape[1])
    dense = attn._dense(q_nope, q_rope, c_kv, k_rope, mask)
    sparse = attn._sparse(q_nope, q_rope, c_kv, k_rope, sel)
    assert torch.allclose(dense, sparse, atol=1e-5)


def _reference_sparse(attn, x, cos, sin, topk):
    """Brute force: full [H, T, T] scores, dense index-score matrix, top-k mask (transformers' eager way)."""
    B, T, _ = x.shape
    q_nope, q_rope, q_resid = attn.project_q(x, cos, sin)
    c_kv, k_rope = attn.project_kv(x, cos, sin)
    qi, wi = attn.indexer.project_q(x, q_resid, cos, sin)
    ki = attn.indexer.project_k(x, cos, sin)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    I = torch.einsum("btn,btns->bts", wi, torch.relu(torch.einsum("btnd,bsd->btns", qi, ki) / math.sqrt(qi.shape[-1])))
    I = I.masked_fill(~causal, float("-inf"))
    keep = torch.zeros(B, T, T, dtype=torch.bool).scatter(-1, I.topk(min(topk, T), -1).indices, True) & causal
    kv = attn.kv_b_proj(c_kv).view(B, T, attn.n_heads, -1)
    k = torch.cat([kv[..., :attn.nope], k_rope[:, :, None].expand(-1, -1, attn.n_heads, -1)], -1)
    v = kv[..., attn.nope:]
    q = torch.cat([q_nope, q_rope], -1)
    s = torch.einsum("bthd,bshd->bhts", q, k) * attn.scale
    p = s.masked_fill(~keep[:, None], float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshd->bthd", p, v)
    return attn.o_proj(o.reshape(B, T, -1))


def test_sparse_topk_matches_bruteforce_and_chunking(monkeypatch):
    m = tiny_model(seed=5, index_topk=6)
    attn, x, cos, sin = _attn_inputs(m, T=30)
    ref = _reference_sparse(attn, x, cos, sin, topk=6)
    monkeypatch.setattr(attention, "DENSE_MASK_RATIO", 100)  # short sequence: masked dense SDPA path
    masked, _ = attn(x, cos, sin, MaskSpec())
    assert torch.allclose(masked, ref, atol=1e-5)
    monkeypatch.setattr(attention, "DENSE_MASK_RATIO", 0)  # the gather path
    out, sel = attn(x, cos, sin, MaskSpec())
    assert sel[0].shape == (2, 30, 6)  # [B, T, K]: memory grows with T*K
    assert torch.allclose(out, ref, atol=1e-5)
    monkeypatch.setattr(indexer, "SCORE_CHUNK_BYTES", 1)  # one query row per chunk
    monkeypatch.setattr(latent_attention, "SCORE_CHUNK_BYTES", 1)
    out2, sel2 = attn(x, cos, sin, MaskSpec())
    picked = lambda s: torch.where(s[1], s[0], -1)  # noqa: E731  (invalid slots may hold anything)
    assert torch.equal(picked(sel), picked(sel2)) and torch.allclose(out, out2, atol=1e-6)


def _window_bruteforce(T, window, g, r, b, I):
    """Python loops over the rule: window, globals, then the r best other blocks by mean index score."""
    want = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(i + 1):
            if j > i - window or j % g == 0:
                want[i, j] = True
        cand = [j for j in range(i + 1) if not want[i, j]]
        blocks = {}
        for j in cand:
            blocks.setdefault(j // b, []).append(j)
        ranked = sorted(blocks, key=lambda k: -sum(I[i, j].item() for j in blocks[k]) / len(blocks[k]))
        for k in ranked[:r]:
            for j in blocks[k]:
                want[i, j] = True
    return want


def test_window_selector_matches_bruteforce():
    m = tiny_model(seed=6, sparse_attention="window", window_size=5, window_global_every=8,
                   window_routed_blocks=2, window_block_size=4)
    attn, x, cos, sin = _attn_inputs(m, T=37, B=1)
    q_nope, q_rope, q_resid = attn.project_q(x, cos, sin)
    qi, wi = attn.indexer.project_q(x, q_resid, cos, sin)
    ki = attn.indexer.project_k(x, cos, sin)
    idx, valid = window_select(attn.indexer, qi, wi, ki, MaskSpec(), 5, 8, 2, 4)
    got = torch.zeros(37, 37, dtype=torch.bool)
    for i in range(37):
        got[i, idx[0, i][valid[0, i]]] = True
    I = attn.indexer.scores(qi, wi, ki)[0]
    assert torch.equal(got, _window_bruteforce(37, 5, 8, 2, 4, I))
    out, _ = attn(x, cos, sin, MaskSpec())  # and the layer runs end to end on it
    assert torch.isfinite(out).all()


def test_packed_documents_equal_separate_runs():
    m = tiny_model(seed=7, index_topk=4)
    a, b = torch.randint(2, 512, (1, 9)), torch.randint(2, 512, (1, 12))
    packed = torch.cat([a, b], 1)
    seg = torch.tensor([[0] * 9 + [1] * 12])
    pos = torch.cat([torch.arange(9), torch.arange(12)])[None]
    with torch.no_grad():
        out = m(packed, position_ids=pos, segment_ids=seg).logits
        ra, rb = m(a).logits, m(b).logits
    assert torch.allclose(out[:, :9], ra, atol=1e-5) and torch.allclose(out[:, 9:], rb, atol=1e-5)


def test_blank_infilling_mask_and_2d_positions():
    m = tiny_model(seed=8, block_position_embedding=True, max_block_positions=16)
    T, sep = 10, 6  # Part A = first 6 tokens (bidirectional), Part B causal after
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    mask[:, :sep] = True
    mask[:sep, sep:] = False
    ids = torch.randint(2, 512, (1, T))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 3, 3, 3, 3]])
    blk = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 2, 3, 4]])
    with torch.no_grad():
        out = m(ids, position_ids=pos, attention_mask=mask[None], block_position_ids=blk).logits
        changed = ids.clone()
        changed[0, 5] = 3  # a Part A token: every position sees it (bidirectional A)
        out2 = m(changed, position_ids=pos, attention_mask=mask[None], block_position_ids=blk).logits
        later = ids.clone()
        later[0, 9] = 3  # the last Part B token: nobody before it sees it
        out3 = m(later, position_ids=pos, attention_mask=mask[None], block_position_ids=blk).logits
    assert not torch.allclose(out[0, 0], out2[0, 0])
    assert torch.allclose(out[0, :9], out3[0, :9], atol=1e-6)
