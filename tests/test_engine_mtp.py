"""MTP speculative decoding: greedy output with drafts == plain greedy == naive recompute, whatever the
acceptance; acceptance statistics per draft position; sampled requests stay valid and reproducible."""

import pytest
import torch

from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.sampling import SamplingParams

from ._tiny import tiny_model

PROMPTS = [[5, 9, 33, 70, 2, 8, 100], [17, 4, 250, 3], list(range(40, 63))]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, index_topk=6, num_nextn_predict_layers=1)


def run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, params=params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def make(model, k, **kw):
    opts = dict(device="cpu", num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=16)
    return LLMEngine(EngineConfig(**{**opts, **kw}, speculative_num_tokens=k), model=model)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_equals_plain(model, k):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [model.generate_greedy(torch.tensor([p]), 12)[0, len(p):].tolist() for p in PROMPTS]
    engine = make(model, k)
    assert run(engine, PROMPTS, params) == ref
    st = engine.get_stats()
    rates = st["spec_acceptance_per_position"]
    assert len(rates) == k and st["spec_num_draft_tokens"] > 0
    assert 0 <= st["spec_num_accepted_tokens"] <= st["spec_num_draft_tokens"]
    assert all(0.0 <= r <= 1.0 for r in rates)


def test_mtp_with_preemption_and_prefix_hits(model):
    """A 14-block budget forces a preemption (drafts dropped, MTP cache rebuilt on recompute) and the
    resumed request reuses cached blocks, whose MTP rows were written with them."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [model.generate_greedy(torch.tensor([p]), 12)[0, len(p):].tolist() for p in PROMPTS]
    engine = make(model, 2, num_blocks=14, max_model_len=40)
    assert run(engine, PROMPTS, params) == ref
    st = engine.get_stats()
    assert st["num_preemptions"] > 0 and st["prefix_cache_hits"] > 0


def test_accepted_drafts_keep_greedy_exact(model):
    """Random MTP weights rarely guess right, so feed the verifier oracle drafts (the true greedy
    continuation, every third one corrupted): long accepted runs, rejections and bonus tokens."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = {str(i): model.generate_greedy(torch.tensor([p]), 12)[0, len(p):].tolist() for i, p in enumerate(PROMPTS)}
    engine = make(model, 3)
    proposer = engine.runner.proposer
    real = proposer.propose
    calls = [0]

    def oracle(out, meta, hidden, sampled):
        drafts = real(out, meta, hidden, sampled)  # keeps the MTP cache refreshed
        for s in out.scheduled:
            rid = s.request_id
            if rid in drafts:
                n = s.request.num_output_tokens + len(sampled[rid])
                d = (ref[rid][n:n + 3] + [7, 7, 7])[:3]
                calls[0] += 1
                if calls[0] % 3 == 0:
                    d[2] = (d[2] + 1) % 512
                drafts[rid] = d
        return drafts

    proposer.propose = oracle
    assert run(engine, PROMPTS, params) == [ref[str(i)] for i in range(len(PROMPTS))]
    st = engine.get_stats()
    assert st["spec_acceptance_per_position"][0] > 0.5 and st["spec_num_accepted_tokens"] > 10


def test_mtp_sampling_reproducible_and_budget(model):
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=10, ignore_eos=True)
    a = run(make(model, 2), PROMPTS, params)
    b = run(make(model, 2, max_num_seqs=1), PROMPTS, params)  # one request at a time
    assert a == b and all(len(x) == 10 for x in a)


def test_drafts_equal_model_mtp_head(model):
    """Draft 1 after each step == argmax of the model's own MTP logits (full recompute) at the last kept
    position: the MTP cache rows written step by step equal what a full forward computes."""
    p = PROMPTS[2]
    engine = make(model, 1)
    engine.add_request("a", prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    req = engine.scheduler.requests["a"]
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        if req.is_finished or not req.spec_token_ids:
            continue
        ids = torch.tensor([req.all_token_ids])
        with torch.no_grad():
            mtp = model(ids, return_mtp=True).mtp_logits[0, -2]  # position T-2 reads token T-1, predicts T
        assert req.spec_token_ids[0] == int(mtp.argmax())
        checked += 1
    assert checked >= 3


def test_logprob_token_ids_with_drafts_equal_plain_decoding(model):
    """Requested-id logprobs on verified draft rows equal those of plain (draft-free) decoding."""
    want = [3, 40, 200]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprob_token_ids=want)
    got = []
    for k in (0, 2):
        engine = make(model, k)
        engine.add_request("a", prompt_token_ids=PROMPTS[0], params=params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                last = o.outputs[0]
        got.append(last)
    plain, spec = got
    assert plain.token_ids == spec.token_ids and len(spec.logprobs) == 8
    for tok, a, b in zip(spec.token_ids, plain.logprobs, spec.logprobs):
        assert set(b) == {tok, *want} and list(b)[0] == tok
        for t in a:
            assert b[t].logprob == pytest.approx(a[t].logprob, abs=1e-4) and b[t].rank == a[t].rank


def _lookup_reference(tokens, n_min, n_max):
    """Brute force: for n from n_max down, every earlier window equal to the last n tokens, latest first."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        hits = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
        if hits:
            return tokens[hits[-1] + n]
    return None


def test_prompt_lookup_matches_brute_force():
    from glm5.infer.mtp import prompt_lookup

    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        seq = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        for lo, hi in ((1, 1), (2, 4), (3, 3)):
            assert prompt_lookup(seq, lo, hi) == _lookup_reference(seq, lo, hi), (seq, lo, hi)


@pytest.mark.parametrize("k", [1, 3])
def test_prompt_lookup_drafts_keep_greedy_exact(model, k):
    """Repetitive prompts make prompt lookup replace MTP drafts; the output is still plain greedy."""
    prompts = [[5, 9, 33, 5, 9, 33, 5, 9], [17, 4, 17, 4, 17, 4, 17], PROMPTS[2]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [model.generate_greedy(torch.tensor([p]), 12)[0, len(p):].tolist() for p in prompts]
    engine = make(model, k, prompt_lookup_max=3, prompt_lookup_min=1)
    assert run(engine, prompts, params) == ref
    st = engine.get_stats()
    assert st["spec_num_lookup_draft_tokens"] > 0
    assert 0 <= st["spec_num_accepted_tokens"] <= st["spec_num_draft_tokens"]


def test_prompt_lookup_config_errors():
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        EngineConfig(prompt_lookup_max=2, prompt_lookup_min=3, speculative_num_tokens=1)
    with pytest.raises(ValueError, match="speculative_num_tokens"):
        EngineConfig(prompt_lookup_max=2)
