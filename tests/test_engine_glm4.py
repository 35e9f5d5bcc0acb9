"""The engine on GLM-4.5-style (`glm4_moe`: GQA, paged K/V rows) and GLM-4.7-Flash-style (`glm4_moe_lite`:
MLA without the indexer, paged latent rows) checkpoints: greedy output == transformers `generate` ==
naive full recompute, with concurrent requests, chunked prefill, prefix-cache hits, preemption, MTP
speculation, INT8 weights and expert offload."""

import copy

import pytest
import torch

from glm5.infer import quant
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.offload import OffloadedExperts
from glm5.infer.sampling import SamplingParams
from glm5.model.hf_adapter import save_pretrained

# the GLM-5 engine tests' fixtures and helpers; its prefix-cache / preemption test runs here on this
# module's `model` fixture (both new architectures)
from .test_engine_greedy import (GREEDY, make_engine, prompts, reference, run_all,  # noqa: F401 (fixtures)
                                 test_prefix_cache_hits_and_preemption)
from .test_hf_glm4 import CORNERS, _model

ARCHS = {"glm4_moe": dict(CORNERS["gqa_qknorm_bias_partial"], num_nextn_predict_layers=1),
         "glm4_moe_lite": dict(CORNERS["lite"], num_nextn_predict_layers=1)}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request):
    return _model(ARCHS[request.param], seed=7)


def test_engine_equals_transformers_generate(model, prompts, reference, tmp_path):
    transformers = pytest.importorskip("transformers")
    assert run_all(make_engine(model), prompts) == reference  # 16-token budget: long prompts in chunks
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    for p, ref in zip(prompts, reference):
        out = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert out[0, len(p):].tolist() == ref


def test_cache_rows_are_the_architectures(model):
    engine = make_engine(model)
    cfg, cache = model.config, engine.runner.cache
    width = (2 * cfg.num_key_value_heads * cfg.head_dim if cfg.model_type == "glm4_moe"
             else cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    assert all(t.shape[1] == width for t in cache.latent) and all(t is None for t in cache.index_k)


def test_mtp_speculation_keeps_greedy_exact(model, prompts, reference):
    engine = make_engine(model, speculative_num_tokens=2)
    assert run_all(engine, prompts) == reference
    assert engine.get_stats()["spec_num_draft_tokens"] > 0


def test_int8_engine_matches_the_quantized_model(model, prompts):
    q = quant.quantize_model(copy.deepcopy(model), {"small": "dequant", "large": "dequant"})
    ref = [q.generate_greedy(torch.tensor([p]), 8)[0, len(p):].tolist() for p in prompts]
    engine = make_engine(copy.deepcopy(model), quantization="int8", int8_kernel="dequant")
    assert isinstance(engine.model.lm_head, quant.Int8Linear)
    assert run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) == ref


def test_expert_offload_equals_resident(model, prompts, reference, tmp_path):
    save_pretrained(model, tmp_path)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_blocks=64, block_size=4,
                                    max_model_len=64, max_num_batched_tokens=16, max_resident_experts=2))
    assert isinstance(engine.model.model.layers[1].mlp.experts, OffloadedExperts)
    assert run_all(engine, prompts) == reference


def test_multi_lora_matches_merged_models(model, prompts, tmp_path):
    from glm5.finetune.adapters import from_pretrained
    from glm5.model import lora

    save_pretrained(model, tmp_path / "base")
    adapted = from_pretrained(tmp_path / "base")
    adapted.add_lora(lora.LoraConfig(r=4, alpha=8, targets=["attn", "mlp"]))
    names = {t.name for t, _ in lora.lora_layers(adapted)}
    attn = ("q_proj", "k_proj", "v_proj") if model.config.model_type == "glm4_moe" else ("q_a_proj", "kv_b_proj")
    assert all(any(n.endswith(f"self_attn.{a}") for n in names) for a in attn)
    with torch.no_grad():
        for t, mod in lora.lora_layers(adapted):
            mod.lora_B.weight.normal_(0, 0.15)
    adapted.save_adapter(tmp_path / "a")
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "base"), device="cpu", dtype="float32", num_blocks=64,
                                    block_size=4, max_model_len=64, max_num_batched_tokens=16, max_loras=1,
                                    lora_modules={"a": str(tmp_path / "a")}))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params, lora_name="a" if i != 1 else None)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    merged = from_pretrained(tmp_path / "base", adapter=tmp_path / "a")
    merged.merge_adapter()
    for i, p in enumerate(prompts[:3]):
        ref = (merged if i != 1 else model).generate_greedy(torch.tensor([p]), 8)[0, len(p):].tolist()
        assert done[f"r{i}"] == ref, i


def test_latent_prefix_is_refused_for_gqa():
    from glm5.finetune import prefix

    with pytest.raises(ValueError, match="grouped-query attention"):
        prefix.apply_prefix(_model(ARCHS["glm4_moe"], seed=7), 4)


def test_gqa_large_groups_run_sdpa_with_the_same_output(prompts, monkeypatch):
    """Groups past SMALL_SCORES take SDPA under the boolean mask instead of the grouped products."""
    from glm5.model import gqa_attention

    model = _model(ARCHS["glm4_moe"], seed=7)
    ref = [model.generate_greedy(torch.tensor([p]), GREEDY.max_tokens)[0, len(p):].tolist() for p in prompts]
    monkeypatch.setattr(gqa_attention, "SMALL_SCORES", 0)
    assert run_all(make_engine(model), prompts) == ref
