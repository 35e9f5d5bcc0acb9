"""A frozen INT8 / FP8 base for LoRA (`model.base_quant`): the quantised base computes what a plain model
with the dequantised weights computes (dequantised here, independently: per-channel / per-tile loops,
then F.linear), LoRA gradients match that model's, a short run lowers the loss and its adapter loads with
PEFT on transformers' GlmMoeDsaForCausalLM, bad values are refused by name, and the base holds ~1/4 of
the fp32 bytes."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from glm5.cli.finetune import main as finetune_main
from glm5.core.resources import bundled
from glm5.data.tokenizer import load_tokenizer
from glm5.finetune.adapters import from_pretrained
from glm5.finetune.config import FinetuneConfig, FinetuneModelSection
from glm5.finetune.quant_base import base_bytes, load_base, quant_targets, quantize_base
from glm5.model import lora
from glm5.model.hf_adapter import fp8_to_float, quantize_fp8, save_pretrained
from glm5.model.model import GLM5ForCausalLM

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


@pytest.fixture(scope="module")
def fp8_dir(base_dir, tmp_path_factory):
    """The base as a FP8 block-scaled checkpoint (16 x 16 tiles: several per matrix), as released."""
    path = tmp_path_factory.mktemp("fp8")
    t = load_file(base_dir / "model.safetensors")
    for name in list(t):
        if name.startswith("model.layers.") and name.endswith("proj.weight") and "weights_proj" not in name:
            t[name], t[name + "_scale_inv"] = quantize_fp8(t[name], (16, 16))
    save_file(t, path / "model.safetensors")
    d = json.loads((base_dir / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [16, 16]}
    (path / "config.json").write_text(json.dumps(d))
    return path


def _ids(seed=0, shape=(2, 23)):
    return torch.randint(2, 512, shape, generator=torch.Generator().manual_seed(seed))


def _dequantised(chain) -> torch.Tensor:
    """The held weight dequantised by hand: int8 rows times their scale; fp8 tiles times theirs, each of
    the P fused parts tiled from its own first row."""
    q, scale = chain.original, chain[0].scale
    if q.dtype == torch.int8:
        return q.float() * scale.unsqueeze(-1)
    *lead, n, k = q.shape
    P, R, C = scale.shape[-3:]
    bo, bi = chain[0].block
    w = torch.empty(q.shape)
    for idx in torch.cartesian_prod(*[torch.arange(d) for d in lead]).view(-1, len(lead)) if lead else [()]:
        idx = tuple(int(i) for i in idx)
        for p in range(P):
            for r in range(R):
                for c in range(C):
                    rows = slice(p * (n // P) + r * bo, min(p * (n // P) + (r + 1) * bo, (p + 1) * (n // P)))
                    cols = slice(c * bi, min((c + 1) * bi, k))
                    w[idx + (rows, cols)] = q[idx + (rows, cols)].float() * scale[idx + (p, r, c)]
    return w


def test_fp8_table_conversion_is_torch_conversion():
    every = torch.arange(256, dtype=torch.uint8)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        w = every[torch.randperm(256)].repeat(3, 2).view(dtype)  # [3, 512]: every byte, NaNs and infs included
        assert torch.equal(fp8_to_float(w).nan_to_num(), w.float().nan_to_num())
        assert fp8_to_float(w).isnan().equal(w.float().isnan())


def _reference(model) -> GLM5ForCausalLM:
    """A plain model whose weights are `model`'s dequantised values."""
    ref = GLM5ForCausalLM(model.config)
    sd = {n: t for n, t in model.state_dict().items() if ".parametrizations." not in n and "lora_" not in n}
    for name, mod, attr, _ in quant_targets(model):
        sd[name] = _dequantised(mod.parametrizations[attr])
    ref.load_state_dict(sd, strict=True)
    return ref.eval()


@pytest.mark.parametrize("kind,src", [("int8", "fp32"), ("fp8", "fp32"), ("fp8", "fp8")])
def test_quantised_forward_equals_the_dequantised_model(base_dir, fp8_dir, kind, src):
    model = load_base(fp8_dir if src == "fp8" else base_dir, kind)
    held = list(quant_targets(model))
    assert {attr for _, _, attr, _ in held} == {"weight", "gate_up_proj", "down_proj"}
    for name, mod, attr, _ in held:
        stored = mod.parametrizations[attr].original
        assert stored.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn) and not stored.requires_grad
    if src == "fp8":  # loaded as stored: the checkpoint's fp8 bytes and scales, untouched
        t = load_file(fp8_dir / "model.safetensors")
        chain = model.get_submodule("model.layers.1.self_attn.kv_b_proj").parametrizations.weight
        assert torch.equal(chain.original.view(torch.uint8), t["model.layers.1.self_attn.kv_b_proj.weight"].view(torch.uint8))
        assert torch.equal(chain[0].scale[0], t["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"])
    ref = _reference(model)
    lin = model.get_submodule("model.layers.0.self_attn.q_b_proj")
    x = torch.randn(5, lin.in_features)
    with torch.no_grad():
        assert torch.allclose(lin(x), F.linear(x, _dequantised(lin.parametrizations.weight)), atol=1e-6)
        ids = _ids()
        ours, theirs = model(ids).logits, ref(ids).logits
        plain = load_base(base_dir, "none")(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5
    assert (ours - plain).abs().max() > 1e-4  # quantisation did change the weights
    if src == "fp32":  # a model already in memory, quantised in place: the same storage
        again = quantize_base(load_base(base_dir, "none"), kind)
        assert again.state_dict().keys() == model.state_dict().keys()
        assert all(torch.equal(a.float(), b.float()) for a, b in zip(again.state_dict().values(),
                                                                     model.state_dict().values()))


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_lora_gradients_equal_those_on_the_dequantised_base(base_dir, kind):
    model = from_pretrained(base_dir, base_quant=kind)
    ref = _reference(model)
    cfg = lora.LoraConfig(r=4, alpha=8, targets=ALL)
    for m in (model, ref):
        torch.manual_seed(0)
        lora.apply_lora(m, lora.resolve_targets(m, cfg))
    with torch.no_grad():
        for (_, a), (_, b) in zip(lora.lora_layers(model), lora.lora_layers(ref)):
            pa = [p for n, p in a.named_parameters() if "lora_" in n]
            pb = [p for n, p in b.named_parameters() if "lora_" in n]
            assert len(pa) == len(pb) == 2
            for p, q in zip(pa, pb):
                q.copy_(p.normal_(0, 0.05))
    ids = _ids(1)
    grads = []
    for m in (model.train(), ref.train()):
        m(ids).logits.square().mean().backward()
        # the experts' adapter follows the dequantisation in the chain: parametrizations.X.1 here, .0 there
        grads.append({re.sub(r"(parametrizations\.\w+)\.\d", r"\1", n): p.grad
                      for n, p in m.named_parameters() if p.grad is not None})
    ours, theirs = grads
    assert ours.keys() == theirs.keys() and all("lora_" in n for n in ours)
    assert len(ours) > len(lora.lora_layers(ref))  # (the indexer's adapters get none: its top-k is not differentiable)
    for n, g in ours.items():
        assert torch.allclose(g, theirs[n], rtol=1e-4, atol=1e-7), n
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    lora.remove_lora(model)  # only the adapters go: the int8 / fp8 storage stays, read as before
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, load_base(base_dir, kind)(ids).logits)
    with pytest.raises(ValueError, match="held in another form"):
        lora.merge_lora(lora.apply_lora(model, lora.resolve_targets(model, cfg)))


def test_base_memory_is_about_a_quarter_of_fp32(base_dir):
    plain = load_base(base_dir, "none")
    fp32 = sum(getattr(m, a).numel() * 4 for _, m, a, _ in quant_targets(plain))
    for kind in ("int8", "fp8"):
        model = load_base(base_dir, kind)
        held = sum(c.original.numel() * c.original.element_size() + c[0].scale.numel() * c[0].scale.element_size()
                   for c in (m.parametrizations[a] for _, m, a, _ in quant_targets(model)))
        assert 0.25 <= held / fp32 < 0.30, (kind, held / fp32)
        assert base_bytes(plain) - base_bytes(model) == fp32 - held  # nothing else changed size
    bf16 = load_base(base_dir, "fp8", dtype=torch.bfloat16)  # a bf16 compute dtype: storage and scales unchanged
    chain = bf16.get_submodule("model.layers.1.mlp.experts").parametrizations.gate_up_proj
    assert chain.original.dtype == torch.float8_e4m3fn and chain[0].scale.dtype == torch.float32
    assert bf16.get_submodule("model.layers.1.mlp.experts").gate_up_proj.dtype == torch.bfloat16
    assert torch.equal(chain.original.view(torch.uint8), model.get_submodule(
        "model.layers.1.mlp.experts").parametrizations.gate_up_proj.original.view(torch.uint8))


def _args(root, run, steps, *extra):
    return ["--config", "configs/finetune/lora.toml", f"--model.name={root}/base",
            f"--data.train_path={root}/train.jsonl", "--data.val_path=", "--data.batch_size=2", "--data.seq_len=128",
            f"--train.steps={steps}", f"--log.run_dir={run}", "--log.measure_peak=false", "--log.progress=false",
            "--log.every=1", "--checkpoint.every=0", "--schedule.warmup_steps=0", *extra]


@pytest.fixture(scope="module")
def sft_root(tmp_path_factory):
    import gzip
    root = tmp_path_factory.mktemp("sft")
    save_pretrained(tiny_model(seed=0, vocab_size=8192, num_hidden_layers=2), root / "base")
    load_tokenizer(bundled("tokenizer-8k")).save(root / "base")
    with gzip.open(bundled("sft/train.jsonl.gz"), "rt", encoding="utf-8") as f:
        short = [line for line in f if len(line) < 700][:4]  # a few short conversations, seen repeatedly
    (root / "train.jsonl").write_text("".join(short * 4))
    return root


def test_training_on_the_int8_base_lowers_the_loss_and_its_adapter_loads_in_peft(sft_root, tmp_path):
    run = tmp_path / "run"
    assert finetune_main(_args(sft_root, run, 12, "--model.base_quant=int8", "--optim.lr=5e-3",
                               "--lora.dropout=0.0", '--lora.targets=["attn","mlp","experts"]')) == 0
    losses = [r["loss"] for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3  # nats
    # the adapter on the dequantised base: ours (fp32 base) against PEFT on transformers
    deq = _reference(load_base(sft_root / "base", "int8"))
    save_pretrained(deq, tmp_path / "deq")
    ours = from_pretrained(tmp_path / "deq", adapter=run / "final")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq", attn_implementation="eager",
                                                           dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, str(run / "final")).eval()
    trained = from_pretrained(sft_root / "base", adapter=run / "final", base_quant="int8")  # onto the int8 base
    ids = _ids(2, (2, 17)) * 16  # ids across the 8k vocabulary
    with torch.no_grad():
        a, b, c = ours(ids).logits, theirs(ids).logits, trained(ids).logits
        base = from_pretrained(tmp_path / "deq")(ids).logits
    assert (a - b).abs().max() <= 1e-4 and (a - c).abs().max() <= 1e-4
    assert (a - base).abs().max() > 1e-3  # the adapter trained
    with pytest.raises(ValueError, match="held quantised"):
        trained.merge_adapter()


def test_prefix_tuning_runs_on_the_fp8_base(sft_root, tmp_path):
    run = tmp_path / "run"
    assert finetune_main(_args(sft_root, run, 2, "--method=prefix", "--data.pack=false",
                               "--model.base_quant=fp8", "--prefix.num_virtual_tokens=4")) == 0
    steps = [r for r in map(json.loads, open(run / "metrics.jsonl")) if "loss" in r]
    assert len(steps) == 2 and all(r["tokens"] > 0 and r["grad_norm"] > 0 for r in steps)
    assert (run / "final" / "adapter_config.json").is_file()


def test_bad_base_quant_is_refused_naming_the_key(sft_root, tmp_path, capsys):
    assert finetune_main(_args(sft_root, tmp_path, 1, "--model.base_quant=int4")) == 2
    assert "model.base_quant" in capsys.readouterr().err
    assert finetune_main(_args(sft_root, tmp_path, 1, "--method=full", "--model.base_quant=fp8")) == 2
    assert "model.base_quant = 'fp8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="model.base_quant = 'nf4'"):
        FinetuneConfig(model=FinetuneModelSection(name=str(sft_root / "base"), base_quant="nf4"))
    with pytest.raises(ValueError, match="model.base_quant = 'int4'"):
        load_base(sft_root / "base", "int4")
