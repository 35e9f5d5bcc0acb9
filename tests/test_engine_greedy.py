"""Engine greedy output == naive full-recompute greedy (`generate_greedy`) == transformers `generate`,
with concurrent requests of different lengths, chunked prefill, DSA top-k below the sequence length,
IndexShare layers, prefix-cache hits and forced preemption. Plus logprobs, n > 1, abort and hot swap."""

import pytest
import torch

from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.sampling import SamplingParams
from glm5.model.hf_adapter import save_pretrained

from ._tiny import tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# top-k 6 < every context here; full, shared, full, shared indexers (16 indexer heads from _tiny.BASE)
MODEL_KW = dict(index_topk=6, num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, bias_std=0.1, **MODEL_KW)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (3, 11, 19, 26)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [model.generate_greedy(torch.tensor([p]), GREEDY.max_tokens)[0, len(p):].tolist() for p in prompts]


def make_engine(model, **kw) -> LLMEngine:
    opts = dict(device="cpu", num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=16)
    return LLMEngine(EngineConfig(**{**opts, **kw}), model=model)


def run_all(engine: LLMEngine, prompts, params=GREEDY, prefix="r") -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt_token_ids=p, params=params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"{prefix}{i}"] for i in range(len(prompts))]


def test_engine_equals_naive_and_transformers(model, prompts, reference, tmp_path):
    transformers = pytest.importorskip("transformers")
    engine = make_engine(model)  # 16-token budget: the long prompts are prefilled in chunks
    assert run_all(engine, prompts) == reference
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    for p, ref in zip(prompts[2:], reference[2:]):
        out = hf.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert out[0, len(p):].tolist() == ref


def test_dense_fallback_equals_naive(prompts):
    m = tiny_model(seed=4, index_topk=64)  # index_topk >= every context: dense attention everywhere
    ref = [m.generate_greedy(torch.tensor([p]), 6)[0, len(p):].tolist() for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert run_all(make_engine(m, max_num_batched_tokens=64), prompts, params) == ref


def test_prefix_cache_hits_and_preemption(model, prompts, reference):
    engine = make_engine(model, num_blocks=20)  # 20 blocks x 4 tokens cannot hold all four at once
    assert run_all(engine, prompts) == reference
    assert engine.get_stats()["num_preemptions"] > 0
    hits = engine.get_stats()["prefix_cache_hits"]
    shared = [prompts[3][:16] + p for p in ([7, 8], [9], [10, 11, 12])]  # share 4 full blocks
    refs = [model.generate_greedy(torch.tensor([p]), GREEDY.max_tokens)[0, len(p):].tolist() for p in shared]
    assert run_all(engine, shared, prefix="s") == refs
    assert engine.get_stats()["prefix_cache_hits"] >= hits + 16


def test_logprobs_match_log_softmax(model, prompts):
    engine = make_engine(model)
    p = prompts[2]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    engine.add_request("a", prompt_token_ids=p, params=params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    toks = final.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([p + toks])).logits[0].float(), -1)  # [T, V]
    for j, (tok, lp) in enumerate(zip(toks, final.outputs[0].logprobs)):
        row = ref[len(p) - 1 + j]
        assert abs(lp[tok].logprob - row[tok].item()) < 1e-4 and lp[tok].rank == 1
        top = row.topk(3)
        assert sorted(lp) == sorted(set(top.indices.tolist()) | {tok})
    pl = final.prompt_logprobs
    assert len(pl) == len(p) and pl[0] is None
    for t in range(1, len(p)):
        assert abs(pl[t][p[t]].logprob - ref[t - 1, p[t]].item()) < 1e-4


def test_logprob_token_ids_equal_the_whole_vocabulary_entries(model, prompts):
    """Only the requested ids come back (plus the sampled token), with the values and ranks that a
    whole-vocabulary request (logprobs=-1) gives them, at every output position."""
    want = [5, 77, 300]
    outs = {}
    for name, params in (("ids", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprob_token_ids=want)),
                         ("all", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=-1))):
        engine = make_engine(model)
        engine.add_request(name, prompt_token_ids=prompts[1], params=params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs[name] = out.outputs[0]
    assert outs["ids"].token_ids == outs["all"].token_ids
    for tok, got, full in zip(outs["ids"].token_ids, outs["ids"].logprobs, outs["all"].logprobs):
        assert list(got)[0] == tok and set(got) == {tok, *want}
        for t in got:
            assert got[t].logprob == pytest.approx(full[t].logprob, abs=1e-5) and got[t].rank == full[t].rank


def test_seeded_sampling_independent_of_batch(model, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=123, max_tokens=8, ignore_eos=True)
    alone = run_all(make_engine(model), [prompts[1]], params)[0]
    noisy = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    engine = make_engine(model, max_num_batched_tokens=12)
    engine.add_request("x", prompt_token_ids=prompts[3], params=noisy)
    engine.add_request("y", prompt_token_ids=prompts[0], params=noisy)
    assert run_all(engine, [prompts[1]], params)[0] == alone


def test_n_samples_abort_and_expert_swap(model, prompts):
    engine = make_engine(model)
    engine.add_request("n", prompt_token_ids=prompts[1], params=SamplingParams(n=3, seed=5, max_tokens=4))
    engine.add_request("gone", prompt_token_ids=prompts[3], params=GREEDY)
    engine.step()
    engine.abort_request("gone")
    final = None
    while engine.has_unfinished_requests():
        final = {o.request_id: o for o in engine.step()}.get("n", final)
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert engine.block_manager.usage == 0.0  # the aborted request's blocks came back at once
    before = run_all(engine, [prompts[2]], prefix="b")[0]
    cfg = model.config
    layer = cfg.moe_layers[0]
    with pytest.raises(ValueError, match="shape"):
        engine.swap_experts({(layer, 0): {"gate_proj": torch.zeros(3, 3)}})
    assert engine.model_version == 0
    g = torch.Generator().manual_seed(9)
    new = {f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight":
           torch.randn(*(cfg.moe_intermediate_size, cfg.hidden_size)[:: -1 if p == "down" else 1], generator=g)
           for e in range(cfg.n_routed_experts) for p in ("gate", "up", "down")}
    experts = model.model.layers[layer].mlp.experts
    saved = experts.gate_up_proj.clone(), experts.down_proj.clone()
    try:
        assert engine.swap_experts(new) == 1
        assert run_all(engine, [prompts[2]], prefix="c")[0] != before
    finally:
        with torch.no_grad():
            experts.gate_up_proj.copy_(saved[0])
            experts.down_proj.copy_(saved[1])


def test_query_chunked_attention_is_exact(model, prompts, reference, monkeypatch):
    """Long prefill chunks are attended a few queries at a time (bounded score/gather memory)."""
    from glm5.model import latent_attention
    monkeypatch.setattr(latent_attention, "SCORE_CHUNK_BYTES", 1)  # one query per chunk
    assert run_all(make_engine(model, max_num_batched_tokens=64), prompts[2:]) == reference[2:]
