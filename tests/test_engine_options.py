"""Every model option is served: for each preset shape and routing/attention option, with plain fp32 (native
kernels with the whole-layer kernel where a compiler builds them; the per-function kernels alone; prefill
steps on oneDNN GEMMs), INT8 and
expert offload, the engine's greedy output (continuous batching, chunked prefill, prefix-cache
hits) equals the model's own full-recompute greedy (`generate_greedy`) with the same modules."""

import copy

import pytest
import torch

from glm5.infer import quant
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.experts import VersionedExperts
from glm5.infer.sampling import SamplingParams
from glm5.model.hf_adapter import save_pretrained

from ._tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [[5, 9, 33, 70, 2, 8, 100], [17, 4, 250, 3], list(range(40, 62)), list(range(40, 56)) + [7, 7]]

# Preset shapes (scaled down) and the seeds' options; index_topk 6 is below most contexts (DSA top-k).
OPTIONS = {
    "glm-5": dict(index_topk=6, num_nextn_predict_layers=1),
    "glm-5.2-indexshare": dict(index_topk=6, num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1),
    "soft-moe": dict(moe_type="soft", scoring_func="softmax", routed_scaling_factor=1.0, index_topk=6),
    "softmax-top2": dict(scoring_func="softmax", num_experts_per_tok=2, index_topk=6),
    "router-temperature": dict(router_temperature=2.5, index_topk=6),
    "capacity-factor": dict(moe_capacity_factor=0.5, index_topk=6),
    "window-global": dict(sparse_attention="window", window_size=4, window_global_every=5,
                          window_routed_blocks=1, window_block_size=4),
}
MODES = ["fp32", "fp32-ops", "fp32-onednn", "int8", "offload"]


def run(engine: LLMEngine, prompts) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, params=GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def greedy(model, prompts) -> list[list[int]]:
    return [model.generate_greedy(torch.tensor([p]), NEW)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_engine_greedy_equals_model_greedy(option, mode, tmp_path):
    model = tiny_model(seed=21, bias_std=0.1, **OPTIONS[option])
    opts = dict(device="cpu", num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=12)
    if mode == "int8":  # the engine quantises its copy; the reference is the same swap on another copy
        reference = quant.quantize_model(copy.deepcopy(model), {"small": "dequant", "large": "dequant"})
        engine = LLMEngine(EngineConfig(**opts, quantization="int8", int8_kernel="dequant"), model=copy.deepcopy(model))
    elif mode == "offload":  # experts stay in the checkpoint files; two resident per layer
        save_pretrained(model, tmp_path)
        reference = model
        engine = LLMEngine(EngineConfig(**opts, model=str(tmp_path), max_resident_experts=2))
    elif mode == "fp32-ops":  # the per-function native kernels alone (no whole-layer kernel), on a copy
        reference = model
        engine = LLMEngine(EngineConfig(**opts, native_layer_kernel=False), model=copy.deepcopy(model))
    elif mode == "fp32-onednn":  # prefill-sized steps (24 rows) on oneDNN GEMMs over prepacked weights
        reference = model
        engine = LLMEngine(EngineConfig(**{**opts, "max_num_batched_tokens": 24}, gemm="onednn"),
                           model=copy.deepcopy(model))
    else:
        reference = model
        engine = LLMEngine(EngineConfig(**opts), model=model)
    # the last prompt shares 4 full blocks with the third: a prefix-cache hit mid-run
    assert run(engine, PROMPTS) == greedy(reference, PROMPTS)
    assert engine.get_stats()["prefix_cache_hits"] > 0


def test_paged_forward_serves_blank_infilling_metadata():
    """The metadata's infilling places (issue 13): a bidirectional Part A (`prefix_len`), GLM 2D positions
    and repeated RoPE positions; the paged forward, Part A in one chunk then Part B token by token, gives
    the logits of the model's training forward under the blank-infilling mask."""
    from glm5.infer.input_batch import SeqChunk, build_metadata
    from glm5.model.kv_cache import LatentKVCache

    model = tiny_model(seed=8, index_topk=4, block_position_embedding=True, max_block_positions=16)
    T, sep = 10, 6  # Part A = first 6 tokens (bidirectional), Part B causal after
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    mask[:, :sep] = True
    mask[:sep, sep:] = False
    ids = torch.randint(2, 512, (T,), generator=torch.Generator().manual_seed(0)).tolist()
    pos = [0, 1, 2, 3, 4, 5, 3, 3, 3, 3]
    blk = [0, 0, 0, 0, 0, 0, 1, 2, 3, 4]
    with torch.no_grad():
        ref = model(torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=mask[None],
                    block_position_ids=torch.tensor([blk])).logits[0]
    cache = LatentKVCache(model.config, num_blocks=4, block_size=4)
    spans = [(0, sep)] + [(t, t + 1) for t in range(sep, T)]
    got = []
    with torch.inference_mode():
        for a, b in spans:
            chunk = SeqChunk("x", a, ids[a:b], [0, 1, 2], position_ids=pos[a:b], prefix_len=sep,
                             block_position_ids=blk[a:b])
            flat, meta = build_metadata([chunk], 4, "cpu")
            got.append(model(flat[None], attn_metadata=meta, kv_cache=cache).logits[0])
    assert torch.allclose(torch.cat(got), ref, atol=1e-4)


@pytest.mark.parametrize("option", ["capacity-factor", "window-global", "soft-moe"])
def test_mtp_speculation_with_options(option):
    """The MTP layer (an MoE decoder layer with its own indexer and cache layer) runs every option too:
    greedy output with 2 drafts per step == the model's greedy."""
    model = tiny_model(seed=22, bias_std=0.1, **{**OPTIONS[option], "num_nextn_predict_layers": 1})
    engine = LLMEngine(EngineConfig(device="cpu", num_blocks=64, block_size=4, max_model_len=64,
                                    max_num_batched_tokens=12, speculative_num_tokens=2), model=model)
    assert run(engine, PROMPTS[:3]) == greedy(model, PROMPTS[:3])
    assert engine.get_stats()["spec_num_draft_tokens"] > 0


def test_expert_load_stats_and_metrics():
    """Per-layer expert load in engine stats == the experts the model's own forward routes the same tokens
    to (every token the engine computed: prompt + all but the last generated token); rendered for /metrics."""
    from glm5.serve.metrics import ServerMetrics

    model = tiny_model(seed=23, bias_std=0.1, index_topk=6)
    engine = LLMEngine(EngineConfig(device="cpu", num_blocks=64, block_size=4, max_model_len=64,
                                    max_num_batched_tokens=12, enable_prefix_caching=False), model=model)
    outs = run(engine, PROMPTS[:3])
    load = engine.get_stats()["expert_load"]
    assert sorted(load) == model.config.moe_layers
    want = {layer: torch.zeros(model.config.n_routed_experts, dtype=torch.long) for layer in load}
    with torch.no_grad():
        for p, o in zip(PROMPTS[:3], outs):
            for st in model(torch.tensor([p + o[:-1]])).router_stats:
                want[st["layer"]] += st["tokens_per_expert"]
    for layer, entry in load.items():
        assert entry["tokens_per_expert"] == want[layer].tolist()
        assert entry["imbalance"] == pytest.approx(float(want[layer].max()) / float(want[layer].float().mean()))
    text = ServerMetrics("tiny").render(engine.get_stats())
    layer = model.config.moe_layers[0]
    assert f'glm5:moe_expert_tokens_total{{model_name="tiny",layer="{layer}",expert="0"}} {want[layer][0]}' in text
    assert f'glm5:moe_expert_load_imbalance{{model_name="tiny",layer="{layer}"}}' in text


def _new_experts(cfg, layer, seed):
    g = torch.Generator().manual_seed(seed)
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    return {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight":
            torch.randn(*((hidden, inter) if p == "down" else (inter, hidden)), generator=g) * 0.3
            for e in range(cfg.n_routed_experts) for p in ("gate", "up", "down")}


@pytest.mark.parametrize("mode", ["fp32", "int8"])
def test_hot_swap_without_draining_versions_and_rollback(mode):
    """A swap between steps: the running request finishes on the version it started on (its swapped
    experts run on a shadow copy), a request admitted after it runs on the new version; rollback returns
    to the old weights and version; a request overtaken by two swaps is told ("0->2")."""
    base = tiny_model(seed=24, bias_std=0.1, index_topk=6)
    cfg = base.config
    layer = cfg.moe_layers[0]
    new = _new_experts(cfg, layer, seed=5)
    swapped = copy.deepcopy(base)
    with torch.no_grad():
        for e in range(cfg.n_routed_experts):
            g, u, d = (new[f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            swapped.model.layers[layer].mlp.experts.gate_up_proj[e] = torch.cat([g, u])
            swapped.model.layers[layer].mlp.experts.down_proj[e] = d
    extra = dict(quantization="int8", int8_kernel="dequant") if mode == "int8" else {}
    if mode == "int8":
        ref_old = quant.quantize_model(copy.deepcopy(base), {"small": "dequant", "large": "dequant"})
        ref_new = quant.quantize_model(copy.deepcopy(swapped), {"small": "dequant", "large": "dequant"})
    else:
        ref_old, ref_new = base, swapped
    engine = LLMEngine(EngineConfig(device="cpu", num_blocks=64, block_size=4, max_model_len=64,
                                    max_num_batched_tokens=32, **extra), model=copy.deepcopy(base))
    long = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("old", prompt_token_ids=PROMPTS[2], params=long)
    engine.step()
    r = PROMPTS[3]
    engine.add_request("old2", prompt_token_ids=r, params=long)  # started before the swap, admitted after it
    assert engine.swap_experts(new) == 1
    for _ in range(3):
        engine.step()  # old2's prompt blocks are computed on the old experts: they must not serve new requests
    q = list(engine.scheduler.requests["old"].all_token_ids)
    engine.add_request("new", prompt_token_ids=q, params=long)
    engine.add_request("fresh", prompt_token_ids=r, params=long)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    p = PROMPTS[2]
    old_ref = ref_old.generate_greedy(torch.tensor([p]), 12)[0, len(p):].tolist()
    new_ref = ref_new.generate_greedy(torch.tensor([q]), 12)[0, len(q):].tolist()
    assert old_ref != ref_new.generate_greedy(torch.tensor([p]), 12)[0, len(p):].tolist()
    assert done["old"].outputs[0].token_ids == old_ref and done["old"].model_version == 0
    assert done["new"].outputs[0].token_ids == new_ref and done["new"].model_version == 1
    assert done["old2"].outputs[0].token_ids == ref_old.generate_greedy(torch.tensor([r]), 12)[0, len(r):].tolist()
    assert done["fresh"].outputs[0].token_ids == ref_new.generate_greedy(torch.tensor([r]), 12)[0, len(r):].tolist()
    assert done["fresh"].metrics.num_cached_tokens == 0  # no block computed on the old experts was reused
    assert engine.versions.held is None  # freed once nobody runs on version 0
    assert not any(isinstance(m, VersionedExperts) for m in engine.model.modules())
    assert engine.rollback_experts() == 0
    assert run(engine, [p])[0] == old_ref[:NEW]
    with pytest.raises(ValueError, match="no expert swap"):
        engine.rollback_experts()
    engine.add_request("told", prompt_token_ids=p, params=long)
    engine.step()
    engine.swap_experts(new)
    engine.swap_experts(_new_experts(cfg, layer, seed=6))  # version 3: the shadow now holds version 2
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.model_version == "0->3"
