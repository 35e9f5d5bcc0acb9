"""Every model option is served: for each preset shape and routing/attention option, with plain fp32,
INT8 and expert offload, the engine's greedy output (continuous batching, chunked prefill, prefix-cache
hits) equals the model's own full-recompute greedy (`generate_greedy`) with the same modules."""

import copy

import pytest
import torch

from glm5.infer import quant
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
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
MODES = ["fp32", "int8", "offload"]


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
