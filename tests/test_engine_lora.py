"""Multi-LoRA serving: requests for different adapters and the base in one batch give each adapter's
merged-model greedy output; adapters load/unload between steps; bad adapters and misuse are refused."""

import pytest
import torch

from glm5 import LLM, SamplingParams
from glm5.finetune.adapters import from_pretrained
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.model import lora
from glm5.model.hf_adapter import save_pretrained
from glm5.model.peft_adapter import AdapterError

from ._tiny import tiny_model

TARGETS = {"a": ["attn", "mlp", "experts"], "b": ["q_b_proj", "kv_b_proj", "o_proj", "shared_experts.up_proj"],
           "c": ["experts.down_proj", "kv_a_proj_with_mqa"]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlora")
    save_pretrained(tiny_model(seed=7, bias_std=0.1, index_topk=6, num_hidden_layers=3), root / "base")
    for k, (name, targets) in enumerate(TARGETS.items()):
        model = from_pretrained(root / "base")
        model.add_lora(lora.LoraConfig(r=4 + 2 * k, alpha=8, targets=targets, use_rslora=k == 1))
        with torch.no_grad():
            for t, mod in lora.lora_layers(model):
                (mod.lora_B.weight if t.param is None else mod.lora_B).normal_(0, 0.15)
        model.save_adapter(root / name)
    return root


def _merged_greedy(dirs, name, prompt, n):
    model = from_pretrained(dirs / "base", adapter=None if name is None else dirs / name)
    if name is not None:
        model.merge_adapter()
    out = model.generate_greedy(torch.tensor([prompt]), n)
    return out[0, len(prompt):].tolist()


def test_mixed_batch_matches_merged_models(dirs):
    engine = LLMEngine(EngineConfig(model=str(dirs / "base"), device="cpu", num_blocks=64, max_model_len=256, max_loras=3,
                                    max_num_batched_tokens=24, lora_modules={k: str(dirs / k) for k in TARGETS}))
    seen_active = []
    hook = engine.model.register_forward_pre_hook(
        lambda m, args, kw: seen_active.append(set(engine.loras.batch.active)), with_kwargs=True)
    prompts = [[5, 9, 23, 41, 7, 88, 19], [5, 9, 23, 41, 7, 88, 19], [300, 12, 77], [5, 9, 23, 41, 7, 88, 19, 4, 4],
               [61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73]]
    names = ["a", "b", None, "c", "a"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, (p, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", prompt_token_ids=p, params=params, lora_name=name)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    hook.remove()
    assert any(len(a) >= 3 for a in seen_active)  # several adapters (and the base) shared forwards
    for i, (p, name) in enumerate(zip(prompts, names)):
        assert done[f"r{i}"] == _merged_greedy(dirs, name, p, 8), (i, name)
    assert done["r0"] != done["r1"]  # same prompt, different adapters: different outputs


def test_load_unload_and_misuse(dirs, tmp_path):
    llm = LLM(str(dirs / "base"), device="cpu", num_blocks=64, max_model_len=256, max_loras=2, max_lora_rank=8, lora={"a": str(dirs / "a")})
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = [5, 9, 23, 41, 7]
    out_a = llm.generate([prompt], params, lora="a")[0].outputs[0].token_ids
    assert out_a == _merged_greedy(dirs, "a", prompt, 4)
    with pytest.raises(ValueError, match="already loaded"):
        engine.load_lora("a", dirs / "b")
    with pytest.raises(ValueError, match="no adapter named 'zz'"):
        engine.add_request("x", prompt_token_ids=prompt, params=params, lora_name="zz")
    engine.load_lora("b", dirs / "b")
    assert engine.loras.slots == {"a": 0, "b": 1}
    with pytest.raises(ValueError, match="all 2 adapter slots"):
        engine.load_lora("c", dirs / "c")
    engine.add_request("busy", prompt_token_ids=prompt, params=params, lora_name="b")
    with pytest.raises(ValueError, match="in use by 1 running request"):
        engine.unload_lora("b")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora("b")
    assert engine.list_loras() == {"a": str(dirs / "a")}
    # a re-used slot serves the new adapter (its prefix-cache entries are not the old one's)
    engine.load_lora("c", dirs / "c")
    assert llm.generate([prompt], params, lora="c")[0].outputs[0].token_ids == _merged_greedy(dirs, "c", prompt, 4)
    other = tmp_path / "other"
    save_pretrained(tiny_model(seed=1, hidden_size=32), other)
    wrong = from_pretrained(other)
    wrong.add_lora(lora.LoraConfig(r=2, targets=["attn"]))
    wrong.save_adapter(tmp_path / "wrong")
    engine.unload_lora("c")
    with pytest.raises(AdapterError, match="expected"):
        engine.load_lora("w", tmp_path / "wrong")
    with pytest.raises(AdapterError, match="max_lora_rank 8"):
        high = from_pretrained(dirs / "base")
        high.add_lora(lora.LoraConfig(r=12, targets=["o_proj"]))
        high.save_adapter(tmp_path / "high")
        engine.load_lora("h", tmp_path / "high")
    assert engine.list_loras() == {"a": str(dirs / "a")}  # failed loads changed nothing


def test_prefix_adapter_served_from_the_cache(dirs, tmp_path):
    from glm5.finetune import prefix

    model = from_pretrained(dirs / "base")
    prefix.apply_prefix(model, 16)  # random (unit-RMS) entries: far from any real prompt
    prefix.save_prefix(model, tmp_path / "pfx")
    prompt = [5, 9, 23, 41, 7, 88, 19, 4, 31]
    ids = torch.tensor([prompt])
    with torch.no_grad():  # reference: the training-side prefix model, real tokens at positions 16..
        for _ in range(6):
            pos = torch.arange(16, 16 + ids.shape[1])[None]
            ids = torch.cat([ids, model(ids, position_ids=pos).logits[:, -1:].argmax(-1)], dim=1)
    want = ids[0, len(prompt):].tolist()
    llm = LLM(str(dirs / "base"), device="cpu", num_blocks=64, max_model_len=256, max_loras=1,
              lora={"p": str(tmp_path / "pfx"), "a": str(dirs / "a")})
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([prompt, prompt, prompt], params, lora=["p", None, "a"])
    assert outs[0].outputs[0].token_ids == want and outs[0].prompt_token_ids == prompt
    assert outs[1].outputs[0].token_ids == _merged_greedy(dirs, None, prompt, 6)
    assert outs[2].outputs[0].token_ids == _merged_greedy(dirs, "a", prompt, 6)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    assert llm.generate([prompt], params, lora="p")[0].outputs[0].token_ids == want  # again, from the cache
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), lora="p")
    llm.engine.unload_lora("p")
    assert "p" not in llm.engine.list_loras()


def test_masked_lowrank_equals_each_rows_own_adapter():
    """The few-slot decode kernel (every slot's A in one matmul, other slots masked) == B_s A_s x per row."""
    from glm5.infer.lora import lowrank_masked

    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(5, 8, 24, generator=g), torch.randn(5, 12, 8, generator=g)
    A[4], B[4] = 0, 0  # the base model's all-zero slot
    x, slots = torch.randn(30, 24, generator=g), torch.randint(0, 5, (30,), generator=g)
    ref = torch.stack([B[s] @ (A[s] @ x[i]) for i, s in enumerate(slots.tolist())])
    torch.testing.assert_close(lowrank_masked(x, A, B, slots), ref, rtol=1e-5, atol=1e-5)
    assert lowrank_masked(x, A, B, torch.full((30,), 4)).abs().max() == 0
