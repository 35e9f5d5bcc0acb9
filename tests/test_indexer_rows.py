"""The indexer KL over a random subset of query rows (`dsa.indexer_kl_rows`): the mean of the per-row KLs of
exactly the drawn rows (a brute-force reference, row by row over every key), the same with small chunks
(causal key prefixes), stage-2 selections with padding entries, and the config checks naming the key."""

import pytest
import torch

import glm5.train.indexer_warmup as iw
from glm5.core.config import from_dict
from glm5.model.config import ModelConfig
from glm5.model.model import GLM5ForCausalLM
from glm5.train.config import TrainConfig
from glm5.train.step import MODEL_KEYS

CFG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, intermediate_size=64, moe_intermediate_size=16,
           index_topk=4, num_nextn_predict_layers=0, pad_token_id=0, eos_token_id=[1])
T = 24


def _model():
    torch.manual_seed(0)
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", **CFG)).init_weights(seed=0)
    for layer in model.model.layers:  # indexer weights away from their zero-ish init: KLs of order 1
        for p in layer.self_attn.indexer.parameters():
            p.data.normal_(0, 0.5)
    return model


def _records(model, segments: bool = False):
    cap = iw.AttnCapture(model)
    ids = torch.randint(0, 64, (2, T))
    kw = {}
    if segments:  # two documents in row 0, positions restarting at the second
        kw["segment_ids"] = torch.tensor([[1] * 10 + [2] * 14, [1] * T])
        kw["position_ids"] = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.arange(T)])
    with torch.no_grad(), iw.dense_attention(model):
        model(ids, **kw)
    return cap.records


def _row_kls(record, keep_fn=None) -> torch.Tensor:
    """Brute force: KL of each query row [B, T] over every key, one row at a time (NaN: no key)."""
    attn, x, cos, sin, mask = record
    B = x.shape[0]
    out = torch.full((B, T), float("nan"))
    allowed = mask.rows(0, T, T).expand(B, -1, -1)
    qi, wi = attn.indexer.project_q(x, attn.project_q(x, cos, sin)[2], cos, sin)
    scores = attn.indexer.scores(qi, wi, attn.indexer.project_k(x, cos, sin))  # [B, T, T]
    for t in range(T):
        p = iw.attention_target(attn, x, cos, sin, mask, t, t + 1)  # [B, 1, T]
        keep = allowed[:, t:t + 1] if keep_fn is None else keep_fn(t)
        for b in range(B):
            kl, n = iw.kl_to_attention(p[b:b + 1], scores[b:b + 1, t:t + 1], keep[b:b + 1])
            if n:
                out[b, t] = kl
    return out


@pytest.mark.parametrize("segments", [False, True])
def test_rows_subset_is_the_mean_over_exactly_the_drawn_rows(segments):
    model = _model()
    records = _records(model, segments)
    ref = torch.stack([_row_kls(r) for r in records])  # [layers, B, T]
    torch.testing.assert_close(iw.indexer_kl(records), ref.nanmean(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(iw.indexer_kl(records, rows=T), ref.nanmean(), rtol=1e-4, atol=1e-6)
    torch.manual_seed(7)
    got = iw.indexer_kl(records, rows=5)
    torch.manual_seed(7)
    rows = iw.query_rows(T, 5)
    assert rows.tolist() == sorted(set(rows.tolist())) and len(rows) == 5
    torch.testing.assert_close(got, ref[:, :, rows].nanmean(), rtol=1e-4, atol=1e-6)
    # a different draw gives a different subset (and value): the rows really are drawn
    assert not torch.allclose(iw.indexer_kl(records, rows=5), got)


def test_small_chunks_with_causal_key_prefixes_change_nothing(monkeypatch):
    model = _model()
    records = _records(model, segments=True)
    params = iw.indexer_parameters(model)
    whole = iw.indexer_kl(records)
    g_whole = torch.autograd.grad(whole, params)
    monkeypatch.setattr(iw, "CHUNK_ELEMS", 2 * 4 * T * 3)  # 3 query rows per chunk
    chunked = iw.indexer_kl(records)
    g_chunked = torch.autograd.grad(chunked, params)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-7)
    for a, b in zip(g_chunked, g_whole):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_stage2_padding_entries_never_unselect_key_0():
    model = _model()
    records = _records(model)
    K = 6
    # every query selects keys {0, .., min(t, 2)} and pads the rest with (key 0, invalid): the padding sits
    # after the real key 0, so writing it last must not drop key 0 from the selection
    idx = torch.zeros(2, T, K, dtype=torch.long)
    valid = torch.zeros(2, T, K, dtype=torch.bool)
    for t in range(T):
        n = min(t, 2) + 1
        idx[:, t, :n] = torch.arange(n)
        valid[:, t, :n] = True
    sels = [(idx, valid), None]

    def keep(t):
        k = torch.zeros(2, 1, T, dtype=torch.bool)
        k[:, :, : min(t, 2) + 1] = True
        return k

    ref = _row_kls(records[0], keep)  # layer 1 has no selection: skipped
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(iw.indexer_kl(records, sels), ref.mean(), rtol=1e-4, atol=1e-6)


def test_warmup_on_row_subsets_lowers_the_kl_of_a_fixed_batch():
    model = _model()
    batch = {"input_ids": torch.randint(0, 64, (2, T))}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(iw.indexer_parameters(model), lr=2e-2)
    cap = iw.AttnCapture(model, rows=6)
    torch.manual_seed(0)
    for _ in range(30):
        iw.warmup_step(model, batch, opt, cap, MODEL_KEYS)
    full = iw.AttnCapture(model)
    with torch.no_grad(), iw.dense_attention(model):
        model(**batch)
        after_kl = float(iw.indexer_kl(full.records))
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (".indexer." in n), n
    fresh = _model()
    cap0 = iw.AttnCapture(fresh)
    with torch.no_grad(), iw.dense_attention(fresh):
        fresh(**batch)
        before_kl = float(iw.indexer_kl(cap0.records))
    assert after_kl < 0.5 * before_kl


@pytest.mark.parametrize("dsa, key", [
    ({"indexer_kl_rows": -1}, "dsa.indexer_kl_rows"),
    ({"indexer_warmup_steps": -2}, "dsa.indexer_warmup_steps"),
    ({"indexer_warmup_lr": 0.0}, "dsa.indexer_warmup_lr"),
    ({"indexer_loss_coef": -0.5}, "dsa.indexer_loss_coef"),
])
def test_dsa_values_are_checked_naming_the_key(dsa, key):
    with pytest.raises(ValueError, match=key):
        from_dict(TrainConfig, {"dsa": dsa})


def test_warmup_without_training_steps_points_to_trainable_indexer():
    with pytest.raises(ValueError, match="train.trainable = 'indexer'"):
        from_dict(TrainConfig, {"train": {"steps": 0}, "dsa": {"indexer_warmup_steps": 5}})
    cfg = from_dict(TrainConfig, {"train": {"trainable": "indexer"}, "dsa": {"indexer_kl_rows": 64}})
    assert cfg.dsa.indexer_kl_rows == 64
