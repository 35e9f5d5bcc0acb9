"""Checkpoint loading: clear errors for broken checkpoints, FP8 block-scaled weights, no pickle."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm5.model.hf_adapter import CheckpointError, dequantize_fp8, from_pretrained, quantize_fp8, save_pretrained

from ._tiny import tiny_model


@pytest.fixture
def ckpt(tmp_path):
    save_pretrained(tiny_model(seed=9, index_topk=5), tmp_path)
    return tmp_path


def _edit(path, fn):
    f = path / "model.safetensors"
    t = load_file(f)
    fn(t)
    save_file(t, f)


def test_missing_tensor_is_named(ckpt):
    _edit(ckpt, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
        from_pretrained(ckpt)


def test_extra_tensor_is_named(ckpt):
    _edit(ckpt, lambda t: t.__setitem__("model.layers.0.surprise.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.surprise\.weight"):
        from_pretrained(ckpt)


def test_misshaped_tensor_is_named(ckpt):
    _edit(ckpt, lambda t: t.__setitem__("model.layers.2.self_attn.kv_b_proj.weight", torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.weight.*shape \[3, 3\]"):
        from_pretrained(ckpt)
    save_pretrained(tiny_model(seed=9, index_topk=5), ckpt)
    _edit(ckpt, lambda t: t.__setitem__("model.layers.2.mlp.experts.0.down_proj.weight", torch.zeros(3, 3)))
    with pytest.raises(CheckpointError, match=r"experts\.0\.down_proj\.weight.*shape \[3, 3\]"):
        from_pretrained(ckpt)


def test_bad_config_names_key(ckpt):
    d = json.loads((ckpt / "config.json").read_text())
    d["num_experts_per_tok"] = "two"
    (ckpt / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        from_pretrained(ckpt)


def test_only_safetensors_are_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_model().config.to_dict()))
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        from_pretrained(tmp_path)


def test_fp8_block_dequant_round_trip():
    w = torch.randn(300, 200)
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    back = dequantize_fp8(q, s)
    assert (back - w).abs().max() <= 0.07 * w.abs().max()  # e4m3 keeps ~3 mantissa bits
    assert torch.allclose(dequantize_fp8(q, s), q.float() * s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200])


def test_fp8_checkpoint_loads_dequantised(ckpt):
    ref = from_pretrained(ckpt)

    def to_fp8(t):
        for name in list(t):
            if name.endswith("proj.weight") and "weights_proj" not in name and t[name].ndim == 2:
                q, s = quantize_fp8(t[name], (16, 16))
                t[name], t[name + "_scale_inv"] = q, s

    _edit(ckpt, to_fp8)
    d = json.loads((ckpt / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [16, 16]}
    (ckpt / "config.json").write_text(json.dumps(d))
    m = from_pretrained(ckpt)
    stored = load_file(ckpt / "model.safetensors")
    w = stored["model.layers.1.self_attn.q_b_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn
    expect = dequantize_fp8(w, stored["model.layers.1.self_attn.q_b_proj.weight_scale_inv"], (16, 16))
    assert torch.equal(m.model.layers[1].self_attn.q_b_proj.weight, expect)
    e = stored["model.layers.2.mlp.experts.5.up_proj.weight"]
    expect_up = dequantize_fp8(e, stored["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"], (16, 16))
    assert torch.equal(m.model.layers[2].mlp.experts.gate_up_proj[5, 32:], expect_up)
    x = torch.randint(2, 512, (1, 12))
    with torch.no_grad():
        a, b = m(x).logits, ref(x).logits
    assert (a - b).abs().mean() < 0.1 * b.abs().mean()  # close to the unquantised original


def test_convert_streams_fp8_to_bf16_shards(ckpt, tmp_path):
    from glm5.cli.convert import main as convert_main

    ref = from_pretrained(ckpt)

    def to_fp8(t):
        for name in list(t):
            if name.endswith("up_proj.weight"):
                q, s = quantize_fp8(t[name], (16, 16))
                t[name], t[name + "_scale_inv"] = q, s

    _edit(ckpt, to_fp8)
    d = json.loads((ckpt / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (ckpt / "config.json").write_text(json.dumps(d))
    out = tmp_path / "converted"
    assert convert_main([str(ckpt), str(out), "--dtype", "float32", "--max-shard-size", "300KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert not any("scale_inv" in k for k in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    m = from_pretrained(out)
    stored = load_file(ckpt / "model.safetensors")
    w = stored["model.layers.2.mlp.experts.1.up_proj.weight"]
    expect = dequantize_fp8(w, stored["model.layers.2.mlp.experts.1.up_proj.weight_scale_inv"], (16, 16))
    assert torch.equal(m.model.layers[2].mlp.experts.gate_up_proj[1, 32:], expect)
    assert torch.equal(m.model.layers[1].self_attn.q_b_proj.weight, ref.model.layers[1].self_attn.q_b_proj.weight)
