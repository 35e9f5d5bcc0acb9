"""LoRA: identity at init, merged == unmerged, and PEFT interchange both ways against transformers'
GlmMoeDsaForCausalLM + peft (attention, indexer, dense/shared MLP, routed experts), plus bad input."""

import json
import shutil

import pytest
import torch

from glm5.cli.merge import main as merge_main
from glm5.model import lora
from glm5.finetune.adapters import from_pretrained
from glm5.model.peft_adapter import AdapterError
from glm5.model.hf_adapter import save_pretrained

from ._tiny import tiny_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["attn", "indexer", "mlp", "experts"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    # index_topk 5 < T: sparse layers read kv_b_proj.weight (absorbed MLA), not only call it
    save_pretrained(tiny_model(seed=1, bias_std=0.2, index_topk=5), path)
    return path


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()


def _randomize_b(model, std=0.05):
    with torch.no_grad():
        for t, mod in lora.lora_layers(model):
            (mod.lora_B.weight if t.param is None else mod.lora_B).normal_(0, std)


def _ids(seed=0, shape=(2, 23)):
    return torch.randint(2, 512, shape, generator=torch.Generator().manual_seed(seed))


def test_fresh_adapter_is_identity_and_trains_only_lora(base_dir):
    model = from_pretrained(base_dir)
    x = _ids()
    with torch.no_grad():
        ref = model(x).logits
    targets = model.add_lora(lora.LoraConfig(r=4, alpha=8, targets=ALL, dropout=0.1))
    assert {t.param for t in targets} == {None, "gate_up_proj", "down_proj"}
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref)  # B = 0
    model.train()
    model(x).logits.square().mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    rep = model.trainable_report()
    assert 0 < rep["trainable_fraction"] < 0.2 and rep["trainable_params"] == sum(
        p.numel() for n, p in model.named_parameters() if "lora_" in n)


def test_merge_equals_unmerged_and_restores_names(base_dir):
    model = from_pretrained(base_dir)
    names = set(model.state_dict())
    model.add_lora(lora.LoraConfig(r=4, alpha=8, targets=ALL, use_rslora=True))
    _randomize_b(model)
    x = _ids(1)
    with torch.no_grad():
        unmerged = model(x).logits
        model.merge_adapter()
        merged = model(x).logits
    assert (merged - unmerged).abs().max() < 1e-5
    assert set(model.state_dict()) == names and not lora.has_lora(model)


@pytest.mark.parametrize("cfg", [
    dict(r=4, alpha=8, targets=ALL, use_rslora=True),
    dict(r=3, alpha=5, targets=["q_b_proj", "o_proj", "shared_experts.up_proj", "experts.down_proj"], layers=[1]),
], ids=["all_targets_rslora", "some_layers"])
def test_glm5_adapter_loads_in_peft(base_dir, tmp_path, cfg):
    model = from_pretrained(base_dir)
    model.add_lora(lora.LoraConfig(**cfg))
    _randomize_b(model)
    model.save_adapter(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["base_model_name_or_path"] == str(base_dir)
    ref = peft.PeftModel.from_pretrained(_hf(base_dir), str(tmp_path / "adapter")).eval()
    x = _ids(2)
    with torch.no_grad():
        ours, theirs = model.eval()(x).logits, ref(x).logits
        base = from_pretrained(base_dir)(x).logits
    assert (ours - theirs).abs().max() <= 1e-4
    assert (theirs - base).abs().max() > 1e-2  # the adapter really changes the output
    back = from_pretrained(base_dir, adapter=tmp_path / "adapter")  # and our own round trip
    with torch.no_grad():
        assert torch.allclose(back(x).logits, ours, atol=1e-6)


PEFT_CONFIGS = {
    # PEFT's own v5 rewrite: gate/up/down_proj become the fused experts (gate_up_proj at rank 2r)
    "moe_rewrite": dict(target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                        "gate_proj", "up_proj", "down_proj"]),
    # explicit target_parameters (one expert weight, shared and dense MLP), patterns, rsLoRA, indexer
    "params_patterns": dict(target_modules=["kv_b_proj", "wq_b", "weights_proj"],
                            target_parameters=["shared_experts.gate_proj.weight", "mlp.down_proj.weight",
                                               "experts.down_proj"],
                            use_rslora=True, rank_pattern={"layers.1.self_attn.kv_b_proj": 2},
                            alpha_pattern={"experts.down_proj": 3}),
}


@pytest.mark.parametrize("name", sorted(PEFT_CONFIGS))
def test_peft_adapter_loads_in_glm5(base_dir, tmp_path, name):
    ref = peft.get_peft_model(_hf(base_dir), peft.LoraConfig(r=4, lora_alpha=8, **PEFT_CONFIGS[name]))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    ref.save_pretrained(str(tmp_path / "peft"))
    model = from_pretrained(base_dir, adapter=tmp_path / "peft")
    x = _ids(3)
    with torch.no_grad():
        assert (model(x).logits - ref.eval()(x).logits).abs().max() <= 1e-4


def test_merge_cli_writes_a_checkpoint_transformers_loads(base_dir, tmp_path):
    model = from_pretrained(base_dir)
    model.add_lora(lora.LoraConfig(r=4, alpha=8, targets=ALL))
    _randomize_b(model)
    model.save_adapter(tmp_path / "adapter")
    assert merge_main([str(base_dir), str(tmp_path / "adapter"), str(tmp_path / "merged")]) == 0
    x = _ids(4)
    with torch.no_grad():
        assert (_hf(tmp_path / "merged")(x).logits - model.eval()(x).logits).abs().max() <= 1e-4


def test_bad_adapters_fail_naming_the_key(base_dir, tmp_path, capsys):
    model = from_pretrained(base_dir)
    model.add_lora(lora.LoraConfig(r=4, alpha=8, targets=["attn", "experts"]))
    good = tmp_path / "good"
    model.save_adapter(good)

    def variant(name, edit=None):
        d = tmp_path / name
        shutil.copytree(good, d)
        if edit:
            cfg = json.loads((d / "adapter_config.json").read_text())
            edit(cfg)
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        return d

    fresh = from_pretrained(base_dir)
    with pytest.raises(AdapterError, match=r"lora_A.weight.*has shape \[4, 64\], expected \[8, 64\]"):
        fresh.load_adapter(variant("rank", lambda c: c.update(r=8)))
    with pytest.raises(AdapterError, match="unexpected tensor.*experts"):
        fresh.load_adapter(variant("targets", lambda c: c.update(target_parameters=[])))
    with pytest.raises(AdapterError, match="match nothing"):
        fresh.load_adapter(variant("none", lambda c: c.update(target_modules=["q_proj"], target_parameters=[])))
    with pytest.raises(AdapterError, match="use_dora"):
        fresh.load_adapter(variant("dora", lambda c: c.update(use_dora=True)))
    pickled = variant("pickle")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickled adapter"):
        fresh.load_adapter(pickled)
    assert not lora.has_lora(fresh)  # nothing was applied by the failed loads
    other = tmp_path / "other_base"  # another base: hidden size 32 instead of 64
    save_pretrained(tiny_model(seed=1, hidden_size=32), other)
    with pytest.raises(AdapterError, match=r"q_a_proj.lora_A.weight.*shape \[4, 64\], expected \[4, 32\]"):
        from_pretrained(other, adapter=good)
    assert merge_main([str(base_dir), str(pickled), str(tmp_path / "m")]) == 2
    assert "pickled adapter" in capsys.readouterr().err and not (tmp_path / "m").exists()
