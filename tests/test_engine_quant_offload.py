"""INT8 weight-only quantisation (kernels agree, bounded logit error, engine runs it) and expert offload
(output == fully resident output, plausible hit/miss counts, hot swap through the override path)."""

import copy

import pytest
import torch

from glm5.infer import quant
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.offload import ExpertCache, OffloadedExperts, load_offloaded
from glm5.infer.sampling import SamplingParams
from glm5.model.hf_adapter import save_pretrained

from ._tiny import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


def run(engine, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, params=params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def engine_opts(**kw):
    return EngineConfig(**{**dict(device="cpu", num_blocks=48, block_size=4, max_model_len=48,
                                  max_num_batched_tokens=32), **kw})


PROMPTS = [[5, 9, 33, 70, 2, 8, 100], [17, 4, 250, 3], list(range(40, 61))]


def test_int8_kernels_agree_with_dequant():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g) * 0.05, torch.randn(5, 64, generator=g)
    q, s = quant.quantize_weight(w)
    assert (q.float() * s[:, None] - w).abs().max() <= s.max() / 2 + 1e-7  # round-to-nearest
    ref = x @ (q.float() * s[:, None]).T
    for kernel in quant.KERNELS:
        y = quant.int8_linear(x, q, s, kernel)
        tol = 0.02 * ref.abs().max()  # bf16 activations (int8pack) / int8 activations (int_mm)
        assert (y - ref).abs().max() <= tol, kernel


def test_int8_model_logit_error_and_memory():
    # dense attention and every expert active: no discrete top-k flips (keys or experts) from perturbed
    # scores, so the error measured is the int8 rounding itself
    m = tiny_model(seed=5, index_topk=64, n_routed_experts=4, num_experts_per_tok=4)
    q = quant.quantize_model(copy.deepcopy(m), {"small": "dequant", "large": "dequant"})
    assert isinstance(q.lm_head, quant.Int8Linear) and not isinstance(q.model.layers[0].self_attn.kv_b_proj,
                                                                       quant.Int8Linear)
    x = torch.randint(2, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = m(x).logits, q(x).logits
    err = (out - ref).abs().max() / ref.std()
    assert err < 0.1, err
    assert quant.weight_bytes(q) < 0.55 * quant.weight_bytes(m)


def test_int8_engine_matches_quantized_model():
    m = tiny_model(seed=6, index_topk=6)
    q = quant.quantize_model(copy.deepcopy(m), {"small": "dequant", "large": "dequant"})
    ref = [q.generate_greedy(torch.tensor([p]), 8)[0, len(p):].tolist() for p in PROMPTS]
    engine = LLMEngine(engine_opts(quantization="int8", int8_kernel="dequant"), model=copy.deepcopy(m))
    assert isinstance(engine.model.lm_head, quant.Int8Linear)
    assert run(engine, PROMPTS) == ref


def test_int8_from_a_model_already_served():
    """A model an fp32 engine has served (its weights re-stored [in, out], native modules swapped in, all in
    place) can be deep-copied and quantised for an INT8 engine: the int8 weights come out row-major for the
    int8pack kernel, and the INT8 engine serves what the quantised model computes."""
    m = tiny_model(seed=6, index_topk=6)
    LLMEngine(engine_opts(), model=m)  # fp32, CPU defaults: transposed layout + native kernels, in place
    gu = m.model.layers[1].mlp.experts.gate_up_proj
    assert not gu.is_contiguous()  # the engine's [in, out] storage
    q, scale = quant.quantize_weight(gu)
    assert q.is_contiguous() and scale.is_contiguous() and torch.equal(q, quant.quantize_weight(gu.contiguous())[0])
    ref_model = quant.quantize_model(copy.deepcopy(m), {"small": "int8pack", "large": "int8pack"})
    ref = [ref_model.generate_greedy(torch.tensor([p]), 8)[0, len(p):].tolist() for p in PROMPTS]
    engine = LLMEngine(engine_opts(quantization="int8", int8_kernel="int8pack"), model=copy.deepcopy(m))
    assert run(engine, PROMPTS) == ref


def test_grouped_expert_scales():
    """Int8GroupExperts: one scale per output channel and input group; the forward equals the dequantised
    experts' fp32 forward, hot swap re-quantises, a group size that does not divide is refused, and on a
    weight with an outlier per row the grouped rounding error is far below per-channel's."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 12, 32, generator=g) * 0.05
    w[..., 0] = 2.0  # one large weight per row: per-channel scales waste most levels on it
    q, s = quant.quantize_groups(w, 8)
    assert q.shape == (2, 4, 12, 8) and s.shape == (2, 4, 12)
    per_channel = quant.quantize_weight(w)
    # outside the outlier's group
    err_channel = (per_channel[0].float() * per_channel[1][..., None] - w).abs()[..., 8:].max()
    err_group = torch.stack([(quant._dequant_groups(q[e], s[e]) - w[e]).abs()[:, 8:].max() for e in range(2)]).max()
    assert err_group < 0.25 * err_channel
    with pytest.raises(ValueError, match="int8_expert_group_size=5"):
        quant.quantize_groups(w, 5)

    m = tiny_model(seed=5, index_topk=64, n_routed_experts=4, num_experts_per_tok=4)
    experts = m.model.layers[1].mlp.experts
    ge = quant.Int8GroupExperts(experts, 16, {"small": "dequant", "large": "dequant"})
    parts = ge.get_expert(2)
    x = torch.randn(5, m.config.hidden_size, generator=g)
    ref = torch.nn.functional.linear(torch.nn.functional.silu(x @ parts["gate"].T) * (x @ parts["up"].T), parts["down"])
    assert torch.allclose(ge.ffn(2, x), ref, atol=1e-5)
    for kernel in ("int8pack", "int_mm"):
        ge.kernels = {"small": kernel, "large": kernel}
        assert (ge.ffn(2, x) - ref).abs().max() <= 0.03 * ref.abs().max(), kernel
    ge.set_expert(1, parts)  # expert 2's weights into slot 1: the same int8 values and scales
    assert torch.equal(ge.gate_up_int8[1], ge.gate_up_int8[2]) and torch.equal(ge.down_scale[1], ge.down_scale[2])


def test_int8_engine_with_grouped_expert_scales():
    m = tiny_model(seed=6, index_topk=6)
    q = quant.quantize_model(copy.deepcopy(m), {"small": "dequant", "large": "dequant"}, expert_group_size=16)
    assert isinstance(q.model.layers[1].mlp.experts, quant.Int8GroupExperts)
    ref = [q.generate_greedy(torch.tensor([p]), 8)[0, len(p):].tolist() for p in PROMPTS]
    engine = LLMEngine(engine_opts(quantization="int8", int8_kernel="dequant", int8_expert_group_size=16),
                       model=copy.deepcopy(m))
    assert isinstance(engine.model.model.layers[1].mlp.experts, quant.Int8GroupExperts)
    assert run(engine, PROMPTS) == ref
    with pytest.raises(ValueError, match="int8_expert_group_size"):
        EngineConfig(quantization="int8", int8_expert_group_size=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    m = tiny_model(seed=7, index_topk=6, n_routed_experts=8, num_experts_per_tok=2)
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(m, path)
    return path, m


def test_offload_equals_resident(checkpoint):
    path, m = checkpoint
    resident = run(LLMEngine(engine_opts(model=str(path))), PROMPTS)
    engine = LLMEngine(engine_opts(model=str(path), max_resident_experts=2))
    assert isinstance(engine.model.model.layers[1].mlp.experts, OffloadedExperts)
    assert run(engine, PROMPTS) == resident
    st = engine.get_stats()
    moe_layers = len(m.config.moe_layers)
    assert st["expert_cache_resident"] <= 2 * moe_layers
    assert st["expert_cache_misses"] >= moe_layers * 2  # every layer loaded at least its first two experts
    lookups = st["expert_cache_hits"] + st["expert_cache_misses"]
    # each forward looks up at most E experts per MoE layer and at least top-k = 2
    num_forwards = sum(len(p) for p in PROMPTS) // 32 + 8 + 1
    assert 2 * moe_layers * 8 <= lookups <= 8 * moe_layers * (num_forwards + 8)
    # a budget that holds every expert: only cold misses (one per (layer, expert)), then hits
    big = LLMEngine(engine_opts(model=str(path), expert_cache_bytes=10**9))
    assert run(big, PROMPTS) == resident
    st = big.get_stats()
    assert st["expert_cache_misses"] <= 8 * moe_layers and st["expert_cache_hits"] > st["expert_cache_misses"]


def test_expert_cache_lru_and_offload_swap(checkpoint):
    cache = ExpertCache(max_items=2)
    for key in ["a", "b", "a", "c", "b"]:
        cache.get(key, lambda: (torch.zeros(1),))
    assert (cache.hits, cache.misses, list(cache.items)) == (1, 4, ["c", "b"])
    path, m = checkpoint
    off = load_offloaded(path, max_resident_experts=1)
    layer = m.config.moe_layers[0]
    ex = off.model.layers[layer].mlp.experts
    gate_up, down = ex.expert(3)
    assert torch.equal(gate_up, m.model.layers[layer].mlp.experts.gate_up_proj[3])
    ex.set_expert(3, {"down": torch.ones_like(down)})
    assert torch.equal(ex.expert(3)[1], torch.ones_like(down))
