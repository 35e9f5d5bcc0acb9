"""GLM-4.5/4.6/4.7 (`glm4_moe`, GQA) and GLM-4.7-Flash (`glm4_moe_lite`, MLA without the indexer): logits
equal to transformers' Glm4MoeForCausalLM / Glm4MoeLiteForCausalLM (eager, fp32) in both checkpoint
directions, FP8 block-scaled loading, the MTP layer, config.json interchange and the refusal of other
architectures."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import glm5
from glm5.core.io import CheckpointError
from glm5.model.config import ModelConfig, ModelConfigError
from glm5.model.gqa_attention import GQAttention
from glm5.model.hf_adapter import from_pretrained, quantize_fp8, save_pretrained
from glm5.model.model import GLM5ForCausalLM

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
              n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, num_nextn_predict_layers=0,
              rms_norm_eps=1e-5, eos_token_id=[1], pad_token_id=0)
GQA = dict(COMMON, model_type="glm4_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           use_qk_norm=True, attention_bias=True,
           rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
LITE = dict(COMMON, model_type="glm4_moe_lite", num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
            kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})

CORNERS = {
    "gqa_qknorm_bias_partial": GQA,
    # no QK-norm, no bias, full rotary, MQA (one key/value head), group-limited routing, 2 dense layers
    "gqa_plain_groups": dict(GQA, use_qk_norm=False, attention_bias=False, num_key_value_heads=1,
                             rope_parameters={"rope_theta": 5e5, "rope_type": "default", "partial_rotary_factor": 1.0},
                             n_group=4, topk_group=2, n_routed_experts=16, num_experts_per_tok=3,
                             first_k_dense_replace=2, num_hidden_layers=4, norm_topk_prob=False,
                             routed_scaling_factor=2.5),
    "lite": LITE,
    # half-split MLA rope (transformers' rope_interleave=False), two shared experts, groups
    "lite_halfsplit_groups": dict(LITE, rope_interleave=False, n_shared_experts=2, n_group=2, topk_group=1,
                                  routed_scaling_factor=1.8),
}


def _model(cfg: dict, seed: int) -> GLM5ForCausalLM:
    torch.manual_seed(seed)
    m = GLM5ForCausalLM(ModelConfig.from_dict(cfg)).init_weights(seed)
    with torch.no_grad():  # non-trivial biases, norms and routing bias: zeros and ones would hide mistakes
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)
    return m.eval()


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the logit scale (fp32 summation order differs between implementations)."""
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


@pytest.mark.parametrize("corner", list(CORNERS))
def test_glm5_save_transformers_load(corner, tmp_path):
    ours = _model(CORNERS[corner], seed=1)
    save_pretrained(ours, tmp_path)
    arch = json.loads((tmp_path / "config.json").read_text())["architectures"]
    hf = _hf(tmp_path)
    assert type(hf).__name__ == arch[0]
    x = torch.randint(2, 512, (2, 21))
    with torch.no_grad():
        assert _close(ours(x).logits, hf(x).logits) <= 1e-4


@pytest.mark.parametrize("corner", ["gqa_qknorm_bias_partial", "gqa_plain_groups", "lite_halfsplit_groups"])
def test_transformers_save_glm5_load(corner, tmp_path):
    """A checkpoint transformers wrote from its own (perturbed) weights loads into glm5 with equal logits."""
    save_pretrained(_model(CORNERS[corner], seed=2), tmp_path / "a")
    hf = _hf(tmp_path / "a")
    with torch.no_grad():  # perturb in transformers so the check cannot pass by echoing our own file
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    hf.save_pretrained(tmp_path / "b")
    ours = glm5.from_pretrained(tmp_path / "b")
    x = torch.randint(2, 512, (3, 17))
    with torch.no_grad():
        assert _close(ours(x).logits, hf(x).logits) <= 1e-4
    # a left-padded batch (HF-style [B, T] mask) agrees too on the real tokens
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        a, b = ours(x, attention_mask=mask).logits, hf(x, attention_mask=mask).logits
    assert _close(a[mask.bool()], b[mask.bool()]) <= 1e-4


def test_gqa_layer_is_the_attention_of_glm4_moe():
    m = _model(GQA, seed=3)
    attn = m.model.layers[0].self_attn
    assert isinstance(attn, GQAttention) and attn.rotary_dim == 8 and attn.q_norm is not None
    names = {n for n, _ in m.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.bias" in names and "model.layers.0.self_attn.o_proj.bias" not in names
    lite = _model(LITE, seed=3)
    assert all(layer.self_attn.indexer is None for layer in lite.model.layers)


@pytest.mark.parametrize("corner", ["gqa_qknorm_bias_partial", "lite"])
def test_mtp_layer_round_trips(corner, tmp_path):
    ours = _model(dict(CORNERS[corner], num_nextn_predict_layers=1), seed=4)
    ours.save_pretrained(tmp_path, max_shard_size="100KB")
    back = glm5.from_pretrained(tmp_path)
    x = torch.randint(2, 512, (1, 13))
    with torch.no_grad():
        a, b = ours(x, return_mtp=True), back(x, return_mtp=True)
    assert a.mtp_logits is not None and torch.equal(a.logits, b.logits) and torch.equal(a.mtp_logits, b.mtp_logits)


@pytest.mark.parametrize("corner", ["gqa_qknorm_bias_partial", "lite"])
def test_fp8_block_scaled_checkpoint(corner, tmp_path):
    save_pretrained(_model(CORNERS[corner], seed=5), tmp_path)
    f = tmp_path / "model.safetensors"
    t = load_file(f)
    quantized = []
    for name in list(t):
        if name.endswith("proj.weight") and t[name].ndim == 2:
            t[name], t[name + "_scale_inv"] = quantize_fp8(t[name], (16, 16))
            quantized.append(name)
    save_file(t, f)
    d = json.loads((tmp_path / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(d))
    m = glm5.from_pretrained(tmp_path)
    sd = m.state_dict()
    name = "model.layers.0.self_attn." + ("q_proj.weight" if "gqa" in corner else "kv_b_proj.weight")
    assert name in quantized
    scale = t[name + "_scale_inv"].repeat_interleave(16, 0).repeat_interleave(16, 1)
    assert torch.equal(sd[name], t[name].float() * scale[: sd[name].shape[0], : sd[name].shape[1]])
    # `glm5 convert` dequantises the same checkpoint into plain fp32 files with the same weights
    from glm5.cli.main import main

    assert main(["convert", str(tmp_path), str(tmp_path / "plain"), "--dtype", "float32"]) == 0
    plain = glm5.from_pretrained(tmp_path / "plain").state_dict()
    assert all(torch.equal(plain[k], v) for k, v in sd.items())


def test_unknown_architecture_is_refused_by_name(tmp_path):
    save_pretrained(_model(GQA, seed=6), tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["model_type"], d["architectures"] = "qwen3_moe", ["Qwen3MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"model_type 'qwen3_moe' is not supported; supported: .*glm4_moe"):
        glm5.from_pretrained(tmp_path)


def test_glm5_only_options_are_refused_for_glm4():
    with pytest.raises(ModelConfigError, match="router_temperature"):
        ModelConfig.from_dict(dict(GQA, router_temperature=2.0))
    with pytest.raises(ModelConfigError, match="partial_rotary_factor"):
        ModelConfig.from_dict(dict(LITE, rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}))
    with pytest.raises(ModelConfigError, match="num_key_value_heads"):
        ModelConfig.from_dict(dict(GQA, num_key_value_heads=3))


# GLM-4.7-Flash's config.json as released (legacy top-level rope keys; no mlp_layer_types)
FLASH_JSON = {"architectures": ["Glm4MoeLiteForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "pad_token_id": 154820, "eos_token_id": [154820, 154827, 154829], "hidden_act": "silu",
              "hidden_size": 2048, "intermediate_size": 10240, "max_position_embeddings": 202752,
              "model_type": "glm4_moe_lite", "moe_intermediate_size": 1536, "topk_method": "noaux_tc",
              "norm_topk_prob": True, "num_attention_heads": 20, "n_group": 1, "topk_group": 1,
              "n_routed_experts": 64, "n_shared_experts": 1, "routed_scaling_factor": 1.8, "num_experts_per_tok": 4,
              "first_k_dense_replace": 1, "num_hidden_layers": 47, "num_key_value_heads": 20,
              "num_nextn_predict_layers": 1, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-05,
              "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "dtype": "bfloat16",
              "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64,
              "v_head_dim": 256, "vocab_size": 154880}


def test_released_flash_config_and_transformers_reads_ours():
    cfg = ModelConfig.from_dict(FLASH_JSON)
    assert cfg.model_type == "glm4_moe_lite" and cfg.mlp_layer_types == ["dense"] + ["sparse"] * 46
    assert cfg.rope_parameters["partial_rotary_factor"] == 1.0 and cfg.rotary_dim == 64
    d = cfg.to_dict()
    assert not any(k.startswith("index") for k in d) and "layer_types" not in d and "use_qk_norm" not in d
    theirs = transformers.Glm4MoeLiteConfig.from_dict(d)
    assert theirs.mlp_layer_types == cfg.mlp_layer_types and theirs.q_lora_rank == 768
    gqa = ModelConfig.from_preset("glm-4.5").to_dict()
    assert "q_lora_rank" not in gqa and "mlp_layer_types" not in gqa
    theirs = transformers.Glm4MoeConfig.from_dict(gqa)
    assert (theirs.head_dim, theirs.use_qk_norm, theirs.rope_parameters["partial_rotary_factor"]) == (128, True, 0.5)


# Model cards: GLM-4.5 355B total / 32B active, GLM-4.5-Air 106B / 12B, GLM-4.7-Flash "30B-A3B".
CARDS = {"glm-4.5": (355, 32), "glm-4.5-air": (106, 12), "glm-4.6": (355, 32), "glm-4.7": (355, 32),
         "glm-4.7-flash": (30, 3)}


@pytest.mark.parametrize("preset", list(CARDS))
def test_preset_parameter_counts_match_the_model_cards(preset):
    from glm5.model.params import count_parameters

    cfg = ModelConfig.from_preset(preset)
    c = count_parameters(cfg)
    total, active = CARDS[preset]
    assert abs(c["total"] / 1e9 - total) / total < 0.01, c["total"]
    assert abs(c["active_non_embedding"] / 1e9 - active) / active < 0.1, c["active_non_embedding"]
    if preset == "glm-4.7-flash":  # the released safetensors hold 31,221,488,576 values: ours plus the MTP
        # layer's stored copies of embed_tokens and lm_head (layers.47.embed_tokens / shared_head.head)
        assert c["total_with_mtp"] + 2 * cfg.vocab_size * cfg.hidden_size == 31_221_488_576


@pytest.mark.parametrize("preset", ["glm-4.5", "glm-4.7-flash"])
def test_pretraining_loop_and_the_final_checkpoint(preset, tmp_path):
    """The trainer on a shrunken real preset: the loss falls (with the MTP loss), and the final model is
    a checkpoint transformers loads with our logits."""
    from glm5.core.config import from_dict
    from glm5.train.config import TrainConfig
    from glm5.train.data import SyntheticData
    from glm5.train.trainer import Trainer

    small = dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=24,
                 n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4, pad_token_id=0, eos_token_id=[1])
    small.update(dict(num_key_value_heads=2, head_dim=12) if preset == "glm-4.5" else
                 dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                      qk_rope_head_dim=4, v_head_dim=8, mlp_layer_types=["dense", "sparse"]))
    cfg = from_dict(TrainConfig, {"model": {"name": preset, "overrides": small}, "optim": {"lr": 3e-3},
                                  "schedule": {"warmup_steps": 2}, "train": {"steps": 24},
                                  "log": {"run_dir": str(tmp_path), "progress": False, "eval_batches": 1,
                                          "measure_peak": False}})
    t = Trainer(cfg, data=SyntheticData(96, 4, 24, seed=1))
    t.fit()
    losses = [h["loss"] for h in t.history]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2 and all(h["mtp_loss"] > 0 for h in t.history)
    ours = glm5.from_pretrained(tmp_path / "final")
    assert ours.config.model_type == ModelConfig.from_preset(preset).model_type
    x = torch.randint(2, 96, (2, 11))
    with torch.no_grad():
        assert _close(ours(x).logits, _hf(tmp_path / "final")(x).logits) <= 1e-4


def test_indexer_training_is_refused_without_an_indexer(tmp_path):
    from glm5.core.config import from_dict
    from glm5.train.config import TrainConfig
    from glm5.train.data import SyntheticData
    from glm5.train.trainer import Trainer

    small = dict(vocab_size=96, hidden_size=48, num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=24,
                 n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                 pad_token_id=0, eos_token_id=[1])
    cfg = from_dict(TrainConfig, {"model": {"name": "glm-4.5", "overrides": small}, "dsa": {"indexer_warmup_steps": 2},
                                  "train": {"steps": 2}, "log": {"run_dir": str(tmp_path), "progress": False}})
    with pytest.raises(ValueError, match="dsa.indexer_warmup_steps train the DSA indexer, but model_type 'glm4_moe'"):
        Trainer(cfg, data=SyntheticData(96, 4, 24, seed=1))


def test_prune_refuses_the_glm4_architectures():
    from glm5.distill.prune import PruneConfig, PruneError, validate

    for cfg in (GQA, LITE):
        with pytest.raises(PruneError, match=f"model_type = '{cfg['model_type']}'"):
            validate(PruneConfig(num_hidden_layers=2), ModelConfig.from_dict(cfg))
