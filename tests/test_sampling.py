"""Sampling semantics: params validation, seeded reproducibility whatever the batch, top-k/top-p/min-p
masses, penalty formulas, logprobs = log_softmax of raw logits, min_tokens masking, temperature
schedule, beam search (brute force and HF transformers on a transition-table "model") and speculative
acceptance (exact for greedy, distribution-preserving for sampling)."""

import itertools

import pytest
import torch

from glm5.infer.beam_search import BeamSearch
from glm5.infer.sampling import (Sampler, SamplingParams, SamplingRow, apply_min_p, apply_penalties,
                                 apply_top_k_top_p, logprobs_of, spec_verify)


def row(prompt=(1, 2), output=(), generator=None, stop_ids=(), **params):
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, stop_ids)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("n", 0), ("min_tokens", -1), ("logprobs", -2), ("beam_width", 0),
    ("early_stopping", "sometimes"), ("temperature_schedule", (0.8,)),
])
def test_params_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_params_defaults_and_normalisation():
    p = SamplingParams(stop="###")
    assert p.stop == ["###"] and p.max_tokens == 16 and p.temperature == 1.0 and p.top_k == 0
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(temperature_schedule=(0.8, 0.2), max_tokens=None)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(use_beam_search=True, temperature=1.0)


def test_temperature_schedule_is_linear_over_max_tokens():
    p = SamplingParams(temperature_schedule=(0.8, 0.2), max_tokens=7)
    assert [round(p.temperature_at(i), 6) for i in range(8)] == [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.2]


def test_greedy_is_argmax_of_penalised_logits():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0], [0.5, 0.1, 0.2, 0.3]])
    out = Sampler()(logits, [row(temperature=0), row(temperature=0, output=[1], repetition_penalty=2.0)])
    assert out.token_ids.tolist() == [1, 0]
    out = Sampler()(logits, [row(temperature=0, output=[1], frequency_penalty=0.2), row(temperature=0)])
    assert out.token_ids.tolist() == [2, 0]


def test_seeded_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(5, 50, generator=g) for _ in range(6)]

    def draws(batch_rows, seeded_index):
        gen = torch.Generator().manual_seed(1234)
        sampler = Sampler(torch.Generator().manual_seed(99))
        got = []
        for logits in steps:
            rows = [row(temperature=0.9, top_p=0.95) for _ in range(batch_rows)]
            rows[seeded_index] = row(temperature=0.7, top_k=20, generator=gen)
            got.append(int(sampler(logits[:batch_rows], rows).token_ids[seeded_index]))
        return got

    alone = draws(1, 0)
    assert draws(5, 0) == alone  # same logits row, other rows around it
    shifted = [torch.cat([torch.randn(2, 50), x[:1]]) for x in steps]  # the row moves to index 2
    steps[:] = shifted
    assert draws(3, 2) == alone
    assert len(set(alone)) > 1  # it really samples


def empirical(logits_row, n, **params):
    """Token frequencies of n independent draws of one row (one batch of n identical rows)."""
    sampler = Sampler(torch.Generator().manual_seed(0))
    r = row(**params)
    out = sampler(logits_row.expand(n, -1).clone(), [r] * n)
    return torch.bincount(out.token_ids, minlength=logits_row.shape[-1]).float() / n


def test_sampled_distribution_follows_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    n = 20000
    t = 2.0
    expect = torch.softmax(logits[0] / t, dim=-1)
    assert torch.allclose(empirical(logits, n, temperature=t), expect, atol=0.012)
    expect_k = torch.tensor([0.4, 0.3, 0, 0]) / 0.7
    assert torch.allclose(empirical(logits, n, top_k=2), expect_k, atol=0.012)
    expect_p = torch.tensor([0.4, 0.3, 0.2, 0]) / 0.9  # 0.4 + 0.3 < 0.8: the third token is needed
    assert torch.allclose(empirical(logits, n, top_p=0.8), expect_p, atol=0.012)


def test_top_p_top_k_min_p_masks():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    x = probs.log()
    kept = lambda y: (y[0] > float("-inf")).nonzero().flatten().tolist()  # noqa: E731
    big = torch.tensor([4])
    assert kept(apply_top_k_top_p(x, big, torch.tensor([0.75]))) == [1, 3]  # 0.5 < 0.75 <= 0.8
    assert kept(apply_top_k_top_p(x, big, torch.tensor([0.85]))) == [1, 2, 3]
    assert kept(apply_top_k_top_p(x, big, torch.tensor([0.3]))) == [1]  # at least the top token
    assert kept(apply_top_k_top_p(x, torch.tensor([2]), torch.tensor([1.0]))) == [1, 3]
    assert kept(apply_top_k_top_p(x, torch.tensor([3]), torch.tensor([0.6]))) == [1, 3]
    assert kept(apply_min_p(x, torch.tensor([0.2]))) == [1, 2, 3]  # threshold 0.1
    assert kept(apply_min_p(x, torch.tensor([0.7]))) == [1]  # threshold 0.35


def test_penalty_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -0.5]])
    r = row(prompt=[0], output=[1, 1, 2], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits.clone(), [r])[0]
    # repetition on prompt + output tokens {0, 1, 2}: positive / 2, negative * 2
    # then frequency * count and presence * seen on output tokens {1: 2, 2: 1}
    expect = torch.tensor([2.0 / 2, -1.0 * 2 - 0.25 * 2 - 0.5, 0.5 / 2 - 0.25 - 0.5, 1.0, -0.5])
    assert torch.allclose(got, expect)
    assert torch.equal(apply_penalties(logits.clone(), [row(output=[1])]), logits)  # defaults: no-op


def test_logprobs_are_log_softmax_of_raw_logits():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 30, generator=g)
    rows = [row(logprobs=4, temperature=0.5, repetition_penalty=1.5, output=[3]), row(logprobs=0),
            row(temperature=0)]
    out = Sampler(torch.Generator().manual_seed(1))(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.logprobs.shape == (3, 5) and out.logprob_token_ids.shape == (3, 5)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    assert torch.allclose(out.logprobs, ref.gather(1, out.logprob_token_ids))
    assert torch.equal(out.logprob_token_ids[:, 1:], ref.topk(4, dim=-1).indices)
    ranks = (ref > ref.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_ranks, ranks) and out.sampled_ranks[2] == 1
    full = Sampler()(logits[:1], [row(logprobs=-1, temperature=0)])
    assert full.logprobs.shape == (1, 31)


def test_logprobs_of_given_tokens():
    logits = torch.randn(3, 10)
    got = logprobs_of(logits, [1, 4, 1], 2)
    ref = torch.log_softmax(logits, dim=-1)
    for j, tok in enumerate([1, 4, 1]):
        assert got[j][tok].logprob == pytest.approx(float(ref[j, tok]), abs=1e-6)
        assert got[j][tok].rank == int((ref[j] > ref[j, tok]).sum()) + 1
        top = ref[j].topk(2).indices.tolist()
        assert set(got[j]) == set(top) | {tok} and [got[j][t].rank for t in top] == [1, 2]
    assert len(logprobs_of(logits[:1], [0], -1)[0]) == 10


def test_logprob_token_ids_give_exact_logprob_and_rank_of_those_ids_only():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=g)
    ids = [7, 0, 39]
    rows = [row(temperature=0, logprob_token_ids=ids), row(temperature=0.7, logprobs=2), row(logprob_token_ids=[3])]
    out = Sampler(torch.Generator().manual_seed(1))(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.requested[1] is None and set(out.requested[0]) == set(ids) and set(out.requested[2]) == {3}
    for i, want in ((0, ids), (2, [3])):
        for t in want:
            assert out.requested[i][t].logprob == pytest.approx(float(ref[i, t]), abs=1e-6)
            assert out.requested[i][t].rank == int((ref[i] > ref[i, t]).sum()) + 1
    assert SamplingParams(logprob_token_ids=(1, 2)).logprobs == 0  # implies per-position logprob dicts
    assert SamplingParams(logprob_token_ids=[1], logprobs=3).logprobs == 3
    for bad in ([-1], [1.5], [True]):
        with pytest.raises(ValueError, match="logprob_token_ids"):
            SamplingParams(logprob_token_ids=bad)
    with pytest.raises(ValueError, match="logprob_token_ids"):
        SamplingParams(logprob_token_ids=[40]).check_vocab(40)


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 0.0, 4.0, 1.0]])
    before = row(temperature=0, min_tokens=2, output=[3], stop_ids=(0, 2))
    after = row(temperature=0, min_tokens=2, output=[3, 3], stop_ids=(0, 2))
    assert Sampler()(logits, [before]).token_ids.tolist() == [3]
    assert Sampler()(logits, [after]).token_ids.tolist() == [0]
    lp = Sampler()(logits, [row(temperature=0, min_tokens=2, stop_ids=(0,), logprobs=1)])
    assert lp.logprob_token_ids[0].tolist() == [2, 0]  # logprobs still come from the raw logits


# ---- beam search -----------------------------------------------------------------------------------

def table_model(seed, vocab=5):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(vocab, vocab, generator=g) * 2, dim=-1)  # [prev, next] logprobs


def run_beam(table, width, max_tokens, length_penalty, early_stopping, first=1, eos=0):
    bs = BeamSearch(width, max_tokens, [eos], length_penalty, early_stopping)
    while not bs.done:
        last = [b.token_ids[-1] if b.token_ids else first for b in bs.beams]
        bs.step(table[last])
    return bs.results()


def brute_force(table, max_tokens, length_penalty, first=1, eos=0):
    """Every sequence that ends at EOS or at max_tokens, with its length-penalised score."""
    vocab = table.shape[0]
    out = []
    for n in range(1, max_tokens + 1):
        for seq in itertools.product([v for v in range(vocab) if v != eos], repeat=n - 1):
            for last in range(vocab):
                if n < max_tokens and last != eos:
                    continue
                toks = list(seq) + [last]
                prev = [first] + toks[:-1]
                total = sum(float(table[p, t]) for p, t in zip(prev, toks))
                out.append((total / n ** length_penalty, toks))
    return sorted(out, key=lambda x: -x[0])


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beam_search_wide_enough_is_exact(length_penalty):
    table = table_model(0)
    best = brute_force(table, 4, length_penalty)
    got = run_beam(table, 128, 4, length_penalty, "never")
    assert got[0].token_ids == best[0][1] and got[0].score == pytest.approx(best[0][0], abs=1e-5)
    assert [b.token_ids for b in got[:3]] == [s for _, s in best[:3]]


def test_beam_width_one_is_greedy_and_beam_beats_greedy():
    for seed in range(6):
        table = table_model(seed)
        (greedy,) = run_beam(table, 1, 6, 0.0, False)
        toks, prev = [], 1
        while len(toks) < 6:
            prev = int(table[prev].argmax())
            toks.append(prev)
            if prev == 0:
                break
        assert greedy.token_ids == toks
        wide = run_beam(table, 4, 6, 0.0, False)[0]
        assert wide.score >= greedy.score - 1e-6


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_beam_search_matches_hf_transformers(early_stopping):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    class TableLM(transformers.PreTrainedModel, transformers.GenerationMixin):
        config_class = transformers.PretrainedConfig

        def __init__(self, config, table):
            super().__init__(config)
            self.table = table
            self.dummy = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return CausalLMOutput(logits=self.table[input_ids])  # [B, T, V]

    for seed, width, lp in itertools.product(range(4), (2, 3), (1.0, 0.0, 2.0, -0.5)):
        table = table_model(seed, vocab=6)
        hf = TableLM(transformers.PretrainedConfig(vocab_size=6, is_decoder=True), table)
        out = hf.generate(torch.tensor([[1]]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=5, eos_token_id=0, pad_token_id=0, length_penalty=lp,
                          early_stopping=early_stopping, use_cache=False, output_scores=True,
                          return_dict_in_generate=True)
        ours = run_beam(table, width, 5, lp, early_stopping)
        theirs = []
        for seq, score in zip(out.sequences[:, 1:].tolist(), out.sequences_scores.tolist()):
            seq = seq[: seq.index(0) + 1] if 0 in seq else seq  # HF pads after EOS with 0
            theirs.append((round(score, 4), seq))
        # sorted, so that exact ties (the tables have symmetric paths) compare equal whatever their order
        assert sorted(theirs) == sorted((round(b.score, 4), b.token_ids) for b in ours), (seed, width, lp)


# ---- speculative decoding ----------------------------------------------------------------------------

def test_spec_verify_greedy_is_exact():
    target = torch.eye(6)[[2, 3, 4, 5]]  # argmax 2, 3, 4 at the draft positions, 5 as the bonus
    assert spec_verify(target, None, [2, 3, 4], greedy=True) == [2, 3, 4, 5]
    assert spec_verify(target, None, [2, 1, 4], greedy=True) == [2, 3]
    assert spec_verify(target, None, [0, 3, 4], greedy=True) == [2]


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_spec_verify_preserves_the_target_distribution(deterministic_draft):
    """Chain of 2 draft tokens from a draft table q, verified against a target table p: the first two
    output tokens must follow p(x0 | start) p(x1 | x0) whatever q is."""
    vocab, trials = 4, 10000
    g = torch.Generator().manual_seed(7)
    p_tab = torch.softmax(torch.randn(vocab, vocab, generator=g), dim=-1)  # [prev, next]
    q_tab = torch.softmax(torch.randn(vocab, vocab, generator=g) * 2, dim=-1)
    counts = torch.zeros(vocab, vocab)
    for _ in range(trials):
        prev, drafts, qs = 0, [], []
        for _ in range(2):
            q = q_tab[prev]
            d = int(q.argmax()) if deterministic_draft else int(torch.multinomial(q, 1, generator=g))
            drafts.append(d)
            qs.append(q)
            prev = d
        ctx = [0] + drafts
        target = p_tab[ctx]  # [3, V]: p at each draft position and the bonus position
        out = spec_verify(target, None if deterministic_draft else torch.stack(qs), drafts, g)
        if len(out) < 2:  # rejected at the first position: continue with the target as the sampler
            out.append(int(torch.multinomial(p_tab[out[0]], 1, generator=g)))
        counts[out[0], out[1]] += 1
    expect = p_tab[0][:, None] * p_tab  # [x0, x1]
    assert (counts / trials - expect).abs().max() < 0.02  # ~4 sigma; seeded, so deterministic


def test_position_logprobs_dict():
    from glm5.infer.sampling import position_logprobs
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    out = Sampler()(logits, [row(temperature=0, logprobs=2)])
    d = position_logprobs(out.logprob_token_ids[0], out.logprobs[0], int(out.sampled_ranks[0]), 2)
    ref = torch.log_softmax(logits[0], -1)
    assert list(d) == [1, 2] and d[1].rank == 1 and d[2].rank == 2
    assert d[2].logprob == pytest.approx(float(ref[2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_rows_do_not_depend_on_the_batch_and_match_greedy():
    from glm5.infer.request import Request
    dev = "cuda"
    logits = torch.randn(6, 151552, device=dev)

    def draws(batch, index):
        req = Request("r", [1, 2, 3], SamplingParams(temperature=0.8, top_p=0.9, seed=11), device=dev)
        sampler = Sampler(torch.Generator(device=dev).manual_seed(5))
        got = []
        for step in range(4):
            rows = [row(temperature=1.0) for _ in range(batch)]
            rows[index] = req.sampling_row()
            x = logits.roll(step, dims=1)[:batch].clone()
            x[index] = logits.roll(step, dims=1)[0]
            got.append(int(sampler(x, rows).token_ids[index]))
        return got

    assert draws(1, 0) == draws(6, 3)
    out = Sampler()(logits, [row(temperature=0, logprobs=3) for _ in range(6)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert torch.allclose(out.logprobs[:, 0], torch.log_softmax(logits, -1).max(-1).values)
    target = torch.softmax(logits[:3], -1)
    assert spec_verify(target, None, target[:2].argmax(-1).tolist(), greedy=True) == target.argmax(-1).tolist()


def test_sampler_probs_are_the_sampling_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]))
    p = Sampler().probs(logits, [row(top_k=2), row(temperature=0)])
    assert torch.allclose(p[0], torch.tensor([0.4, 0.3, 0, 0]) / 0.7)
    assert p[1].tolist() == [0, 0, 0, 1]
