"""Logit parity with transformers' GlmMoeDsaForCausalLM (eager, fp32), both checkpoint directions."""

import json

import pytest
import torch

import glm5
from glm5.model.generation_config import GenerationConfig
from glm5.model.hf_adapter import from_pretrained, save_pretrained
from glm5.model.model import GLM5ForCausalLM

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
    ours.save_pretrained(tmp_path, max_shard_size="200KB")  # the HF method names
    assert (tmp_path / "model.safetensors.index.json").is_file()
    back = GLM5ForCausalLM.from_pretrained(tmp_path)
    assert type(back) is GLM5ForCausalLM
    x = torch.randint(2, 512, (1, 17))
    with torch.no_grad():
        a, b = ours(x, return_mtp=True), back(x, return_mtp=True)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.mtp_logits, b.mtp_logits)
    hf = _hf(tmp_path)  # transformers ignores the MTP layer, like GLM-5's layers.78
    with torch.no_grad():
        assert (hf(x).logits - a.logits).abs().max() <= 1e-4


# Options transformers' glm_moe_dsa has no notion of: it would load such a checkpoint and compute other logits.
NON_HF = {
    "softmax": dict(scoring_func="softmax"),
    "router_temperature": dict(router_temperature=2.0),
    "capacity": dict(moe_capacity_factor=0.5),
    "soft_moe": dict(moe_type="soft"),
    "window": dict(sparse_attention="window", window_size=4, window_global_every=8, window_routed_blocks=1,
                   window_block_size=4),
    "block_positions": dict(block_position_embedding=True),
    "half_split_rope": dict(rope_interleave=False),
}


@pytest.mark.parametrize("option", list(NON_HF))
def test_non_hf_options_get_their_own_model_type(option, tmp_path):
    ours = tiny_model(seed=4, bias_std=0.2, index_topk=5, **NON_HF[option])
    glm5.save_pretrained(ours, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("glm5_ext", ["Glm5ExtForCausalLM"])
    with pytest.raises((ValueError, KeyError)):  # transformers refuses rather than computing something else
        _hf(tmp_path)
    x = torch.randint(2, 512, (2, 21))
    with torch.no_grad():
        assert torch.equal(GLM5ForCausalLM.from_pretrained(tmp_path)(x).logits, ours(x).logits)


@pytest.mark.slow
@pytest.mark.parametrize("option", list(NON_HF))
def test_non_hf_options_would_load_wrong_under_the_hf_label(option, tmp_path):
    """Why the label: relabelled `glm_moe_dsa`, transformers loads such a checkpoint and computes other logits."""
    ours = tiny_model(seed=4, bias_std=0.2, index_topk=5, **NON_HF[option])
    ours.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    x = torch.randint(2, 512, (2, 21))
    with torch.no_grad():
        assert (_hf(tmp_path)(x).logits - ours(x).logits).abs().max() > 1e-3


def test_training_only_option_stays_glm_moe_dsa(tmp_path):
    ours = tiny_model(seed=5, index_topk=5, expert_dropout=0.1)  # dropout acts in training only
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "glm_moe_dsa"
    x = torch.randint(2, 512, (1, 15))
    with torch.no_grad():
        assert (_hf(tmp_path)(x).logits - ours(x).logits).abs().max() <= 1e-4


def test_generation_config_round_trips_through_transformers(tmp_path):
    ours = tiny_model(seed=6, index_topk=5)
    ours.generation_config.temperature, ours.generation_config.top_p = 0.6, 0.95
    ours.save_pretrained(tmp_path / "a")
    hf_gen = transformers.GenerationConfig.from_pretrained(tmp_path / "a")
    assert (hf_gen.eos_token_id, hf_gen.pad_token_id, hf_gen.temperature, hf_gen.top_p) == ([1], 0, 0.6, 0.95)
    hf = _hf(tmp_path / "a")
    hf.generation_config.temperature, hf.generation_config.top_k = 0.7, 20  # written by transformers
    assert hf.generation_config.do_sample  # ours wrote do_sample: true with the sampling values
    hf.save_pretrained(tmp_path / "b")
    back = GLM5ForCausalLM.from_pretrained(tmp_path / "b")
    assert back.generation_config.sampling_defaults() == {"temperature": 0.7, "top_p": 0.95, "top_k": 20}
    assert back.generation_config.eos_token_ids == (1,)
    assert GenerationConfig.from_pretrained(tmp_path / "c") is None  # no file: nothing to read


def test_rmsnorm_backward_matches_autograd_formula():
    """RMSNorm's hand-written fp32 backward (layers._RMSNormFn) against autograd through the plain
    formula (transformers' GlmMoeDsaRMSNorm, fp32), and gradcheck in float64 via the Function."""
    from glm5.model.layers import RMSNorm, _RMSNormFn
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    x = torch.randn(3, 7, 24, generator=g, requires_grad=True)
    dy = torch.randn(3, 7, 24, generator=g)
    norm(x).backward(dy)
    got = x.grad.clone(), norm.weight.grad.clone()
    x.grad = norm.weight.grad = None
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    ref.backward(dy)
    torch.testing.assert_close(got[0], x.grad)
    torch.testing.assert_close(got[1], norm.weight.grad)
    x64 = torch.randn(2, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w64 = torch.rand(6, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, 1e-5), (x64, w64))


@pytest.mark.parametrize("corner", ["sparse_topk", "groups_bias"])
def test_left_padded_batch_matches_transformers(corner, tmp_path):
    """An HF-style [B, T] padding mask: the real tokens' logits equal transformers' (padding rows stay
    finite, so no NaN reaches later layers through their keys)."""
    ours = tiny_model(seed=5, bias_std=0.2, **CORNERS[corner])
    save_pretrained(ours, tmp_path)
    hf = _hf(tmp_path)
    x = torch.randint(2, 512, (3, 21))
    mask = torch.ones(3, 21, dtype=torch.long)
    mask[0, :7], mask[2, :2] = 0, 0
    with torch.no_grad():
        a, b = ours(x, attention_mask=mask).logits, hf(x, attention_mask=mask).logits
    assert torch.isfinite(a).all()
    assert (a[mask.bool()] - b[mask.bool()]).abs().max() <= 1e-4
