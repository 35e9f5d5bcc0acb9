"""Logit parity with transformers' GlmMoeDsaForCausalLM (eager, fp32), both checkpoint directions."""

import pytest
import torch

from glm5.model.hf_adapter import from_pretrained, save_pretrained

from ._tiny import tiny_model

transformers = pytest.importorskip("transformers")

CORNERS = {
    # index_topk well below T: the indexer really drops keys (catches RoPE-layout bugs)
    "sparse_topk": dict(index_topk=5),
    # IndexShare: full, shared, full, shared
    "shared_indexer": dict(index_topk=6, num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1),
    # group-limited routing with a non-zero correction bias, dense + MoE layers
    "groups_bias": dict(index_topk=7, n_group=4, topk_group=2, n_routed_experts=16, num_experts_per_tok=3,
                        first_k_dense_replace=2, num_hidden_layers=4),
    # no top-k normalisation, two shared experts, another scaling factor
    "unnormalised": dict(index_topk=9, norm_topk_prob=False, n_shared_experts=2, routed_scaling_factor=1.5),
}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


@pytest.mark.parametrize("corner", list(CORNERS))
def test_glm5_save_hf_load(corner, tmp_path):
    ours = tiny_model(seed=1, bias_std=0.2, **CORNERS[corner])
    save_pretrained(ours, tmp_path)
    hf = _hf(tmp_path)
    x = torch.randint(2, 512, (2, 23))
    with torch.no_grad():
        diff = (ours(x).logits - hf(x).logits).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("corner", ["sparse_topk", "groups_bias"])
def test_hf_save_glm5_load(corner, tmp_path):
    src = tiny_model(seed=2, bias_std=0.2, **CORNERS[corner])
    save_pretrained(src, tmp_path / "a")
    hf = _hf(tmp_path / "a")
    with torch.no_grad():  # perturb in HF so the check cannot pass by echoing our own file
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    hf.save_pretrained(tmp_path / "b")
    ours = from_pretrained(tmp_path / "b")
    x = torch.randint(2, 512, (3, 19))
    with torch.no_grad():
        diff = (ours(x).logits - hf(x).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_sharded_round_trip_with_mtp(tmp_path):
    ours = tiny_model(seed=3, num_nextn_predict_layers=1, index_topk=4)
    save_pretrained(ours, tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    back = from_pretrained(tmp_path)
    x = torch.randint(2, 512, (1, 17))
    with torch.no_grad():
        a, b = ours(x, return_mtp=True), back(x, return_mtp=True)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.mtp_logits, b.mtp_logits)
    hf = _hf(tmp_path)  # transformers ignores the MTP layer, like GLM-5's layers.78
    with torch.no_grad():
        assert (hf(x).logits - a.logits).abs().max() <= 1e-4
