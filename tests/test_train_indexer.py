"""DSA indexer training: KL target against a brute-force recomputation, warm-up trains only the
indexers and lowers the KL, the sparse-stage indexer loss never reaches the main model."""

import torch

from glm5.model.config import ModelConfig
from glm5.model.masks import MaskSpec
from glm5.model.model import GLM5ForCausalLM
from glm5.train.indexer_warmup import (AttnCapture, attention_target, indexer_kl, indexer_parameters,
                                       warmup_step)
from glm5.train.step import MODEL_KEYS

CFG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
           index_topk=4, num_nextn_predict_layers=0, pad_token_id=0, eos_token_id=[1])


def _model(**kw):
    torch.manual_seed(0)
    return GLM5ForCausalLM(ModelConfig.from_preset("tiny", **{**CFG, **kw})).init_weights(seed=0)


def test_attention_target_is_head_summed_normalised_attention():
    model = _model()
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 6, 32)
    from glm5.model.layers import rope_angles
    cos, sin = rope_angles(torch.arange(6)[None].expand(2, -1), model.model.inv_freq)
    p = attention_target(attn, x, cos, sin, MaskSpec(causal=True), 0, 6)
    # brute force: expand K per head and softmax causally, head by head
    q_nope, q_rope, _ = attn.project_q(x, cos, sin)
    c_kv, k_rope = attn.project_kv(x, cos, sin)
    kv = attn.kv_b_proj(c_kv).view(2, 6, attn.n_heads, -1)
    ref = torch.zeros(2, 6, 6)
    for h in range(attn.n_heads):
        q = torch.cat([q_nope[:, :, h], q_rope[:, :, h]], -1)
        k = torch.cat([kv[:, :, h, : attn.nope], k_rope], -1)
        s = (q @ k.transpose(1, 2)) * attn.scale
        s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
        ref += s.softmax(-1)
    torch.testing.assert_close(p, ref / attn.n_heads, rtol=1e-4, atol=1e-5)


def test_warmup_trains_only_the_indexers_and_lowers_kl():
    model = _model()
    ids = torch.randint(0, 64, (2, 12))
    batch = {"input_ids": ids}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(indexer_parameters(model), lr=1e-2)
    cap = AttnCapture(model)
    kls = [warmup_step(model, batch, opt, cap, MODEL_KEYS) for _ in range(25)]
    assert kls[-1] < 0.7 * kls[0]
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (".indexer." in n), n
    assert model.config.index_topk == 4  # dense_attention restored it


def test_sparse_stage_loss_reaches_only_the_indexers():
    model = _model()
    cap = AttnCapture(model)
    ids = torch.randint(0, 64, (2, 12))
    out = model(ids)
    assert out.selections[0] is not None  # T=12 > index_topk=4: sparse
    kl = indexer_kl(cap.records, out.selections)
    assert kl > 0
    kl.backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == (".indexer." in n), n
