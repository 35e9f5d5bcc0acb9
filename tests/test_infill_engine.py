"""GLM blank infilling at inference: the engine's greedy infill == a naive full-recompute reference built
straight from the GLM paper's definition (Part A bidirectional, Part B causal and seeing all of A; Part B
tokens at their mask's position with intra-span positions 1, 2, ...), with DSA top-k below the context,
batching next to causal requests, a Part A larger than the token budget, prefix-cache hits and preemption."""

import pytest
import torch

from glm5.data.infilling import InfillTokens, infill_prompt
from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.sampling import SamplingParams

from ._tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = InfillTokens(mask=500, smask=501, gmask=502, sop=503, eop=504)
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def model():
    # top-k 6 < every context; full, shared, full, shared indexers; a learned block-position table
    m = tiny_model(seed=5, bias_std=0.1, index_topk=6, num_hidden_layers=4, index_topk_freq=2,
                   index_skip_topk_offset=1, block_position_embedding=True, max_block_positions=64)
    with torch.no_grad():  # make <eop> likely enough that some spans end before MAX_NEW
        m.lm_head.weight[IDS.eop] *= 3.0
    return m


def naive_infill(model, prefix, suffix, gmask=False):
    """Greedy Part B by full recompute, every mask and position written out from the definition."""
    part_a = prefix + [IDS.gmask if gmask else IDS.mask] + suffix
    sep, span_pos = len(part_a), len(prefix)
    seq, out = part_a + [IDS.sop], []
    for _ in range(MAX_NEW):
        n = len(seq)
        pos = list(range(sep)) + [span_pos] * (n - sep)
        blk = [0] * sep + list(range(1, n - sep + 1))
        mask = torch.zeros(n, n, dtype=torch.bool)
        for q in range(n):
            for k in range(n):
                mask[q, k] = k < sep or (q >= sep and k <= q)
        logits = model(torch.tensor([seq]), position_ids=torch.tensor([pos]), attention_mask=mask[None],
                       block_position_ids=torch.tensor([blk])).logits[0, -1]
        tok = int(logits.argmax())
        out.append(tok)
        if tok == IDS.eop:
            break
        seq.append(tok)
    return out


@pytest.fixture(scope="module")
def cases():
    g = torch.Generator().manual_seed(1)
    rnd = lambda n: torch.randint(2, 490, (n,), generator=g).tolist()  # noqa: E731
    return [(rnd(5), rnd(3), False), (rnd(14), rnd(9), False), (rnd(2), [], False), (rnd(11), [], True),
            (rnd(21), rnd(6), False)]


@pytest.fixture(scope="module")
def reference(model, cases):
    return [naive_infill(model, p, s, g) for p, s, g in cases]


def make_engine(model, **kw) -> LLMEngine:
    opts = dict(device="cpu", num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=16)
    return LLMEngine(EngineConfig(**{**opts, **kw}), model=model)


def run(engine, cases, causal=(), tag="i"):
    for i, (p, s, g) in enumerate(cases):
        ids, layout = infill_prompt(p, s, IDS, "gmask" if g else "mask")
        engine.add_request(f"{tag}{i}", prompt_token_ids=ids, params=GREEDY, infill=layout)
    for i, p in enumerate(causal):
        engine.add_request(f"c{tag}{i}", prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=5,
                                                                                   ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[f"{tag}{i}"] for i in range(len(cases))], [done[f"c{tag}{i}"] for i in range(len(causal))]


def test_engine_infill_equals_naive(model, cases, reference):
    causal = [[7, 8, 9, 10, 11, 12], [40, 41, 42]]
    engine = make_engine(model)  # 16-token budget: the 31-token Part A runs alone, over budget
    outs, couts = run(engine, cases, causal)
    assert [o.token_ids for o in outs] == reference
    assert any(r[-1] == IDS.eop for r in reference) and any(r[-1] != IDS.eop for r in reference)
    for o, r in zip(outs, reference):  # <eop> ends the span like an EOS
        assert (o.finish_reason, o.stop_reason) == (("stop", None) if r[-1] == IDS.eop else ("length", None))
    # causal requests batched next to the infill ones are unaffected
    for p, o in zip(causal, couts):
        assert o.token_ids == model.generate_greedy(torch.tensor([p]), 5)[0, len(p):].tolist()


def test_infill_prefix_cache_and_preemption(model, cases, reference):
    engine = make_engine(model, num_blocks=16, max_num_batched_tokens=40)  # too few blocks: preemption
    outs, _ = run(engine, cases)
    assert [o.token_ids for o in outs] == reference
    assert engine.get_stats()["num_preemptions"] > 0
    hits = engine.get_stats()["prefix_cache_hits"]
    outs, _ = run(engine, cases, tag="again")  # identical Part A: served from the cache, same output
    assert [o.token_ids for o in outs] == reference
    assert engine.get_stats()["prefix_cache_hits"] > hits


def test_part_a_cache_is_not_shared_with_other_layouts(model, cases):
    """A causal prompt (or another infill) starting with the same tokens must not reuse Part A's KV, which
    saw the whole Part A bidirectionally."""
    p, s, _ = cases[4]
    ids, layout = infill_prompt(p, s, IDS)
    engine = make_engine(model)
    engine.add_request("a", prompt_token_ids=ids, params=GREEDY, infill=layout)
    while engine.has_unfinished_requests():
        engine.step()
    hits = engine.get_stats()["prefix_cache_hits"]
    causal = ids[:20]
    engine.add_request("b", prompt_token_ids=causal, params=SamplingParams(temperature=0, max_tokens=4,
                                                                           ignore_eos=True))
    got = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            got = o.outputs[0].token_ids
    assert engine.get_stats()["prefix_cache_hits"] == hits
    assert got == model.generate_greedy(torch.tensor([causal]), 4)[0, 20:].tolist()


def test_infill_needs_a_block_position_model(cases):
    engine = make_engine(tiny_model(seed=1))
    ids, layout = infill_prompt([5, 6], [7], IDS)
    with pytest.raises(ValueError, match="block_position_embedding"):
        engine.add_request("x", prompt_token_ids=ids, params=GREEDY, infill=layout)
