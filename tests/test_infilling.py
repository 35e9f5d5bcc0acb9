"""GLM blank infilling vs a brute-force reference written straight from the paper's definition."""

import numpy as np
import pytest

from glm5.data.infilling import (IGNORE, InfillConfig, InfillTokens, build_sample, make_infill_sample,
                                 poisson_span_lengths, sample_gmask_span, sample_mask_spans,
                                 sample_sentence_spans, sentence_bounds)

IDS = InfillTokens(mask=1, smask=2, gmask=3, sop=4, eop=5)
CFG = InfillConfig()


def reference(tokens, spans, mask_id, order):
    """Slow, literal construction: Part A by walking the tokens; Part B spans in `order`."""
    part_a, mask_at = [], {}
    i = 0
    while i < len(tokens):
        span = next((k for k, (s, e) in enumerate(spans) if s == i), None)
        if span is not None:
            mask_at[span] = len(part_a)
            part_a.append(mask_id)
            i = spans[span][1]
        else:
            part_a.append(int(tokens[i]))
            i += 1
    inp, lab, pos, blk = list(part_a), [IGNORE] * len(part_a), list(range(len(part_a))), [0] * len(part_a)
    for k in order:
        s, e = spans[k]
        body = [int(t) for t in tokens[s:e]]
        inp += [IDS.sop] + body
        lab += body + [IDS.eop]
        pos += [mask_at[k]] * (len(body) + 1)
        blk += list(range(1, len(body) + 2))
    n, sep = len(inp), len(part_a)
    mask = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for k in range(n):
            in_a = k < sep
            mask[q, k] = in_a if q < sep else (in_a or k <= q)  # A: bidirectional over A; B: A + causal B
    return inp, lab, pos, blk, mask, sep


def span_order(sample, spans, tokens):
    """Recover which span each Part B block holds (tokens are unique, so the first token tells)."""
    starts = np.flatnonzero(sample.block_position_ids == 1)
    first = [int(sample.input_ids[s + 1]) for s in starts]
    return [next(k for k, (s, e) in enumerate(spans) if int(tokens[s]) == f) for f in first]


@pytest.mark.parametrize("seed", range(40))
def test_sample_matches_reference(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 48))
    tokens = rng.permutation(np.arange(100, 100 + n))  # unique values: each token is traceable
    sentence_ends = set(tokens[rng.random(n) < 0.2].tolist())
    sample = make_infill_sample(tokens, rng, InfillConfig(min_tokens=4), IDS, sentence_ends)
    mask_id = int(sample.input_ids[np.isin(sample.input_ids, [1, 2, 3])][0])
    # Recover spans from Part B, then compare everything with the reference.
    starts = np.flatnonzero(sample.block_position_ids == 1)
    spans = []
    for s in starts:
        end = s + 1
        while end < len(sample.input_ids) and sample.block_position_ids[end] > 1:
            end += 1
        body = sample.input_ids[s + 1: end]
        p = int(np.flatnonzero(tokens == body[0])[0])
        spans.append((p, p + len(body)))
    order = np.argsort(np.argsort([s for s, _ in spans]))  # block k holds the order[k]-th span
    spans_sorted = sorted(spans)
    inp, lab, pos, blk, mask, sep = reference(tokens, spans_sorted, mask_id, list(order))
    assert sample.sep == sep
    assert sample.input_ids.tolist() == inp
    assert sample.labels.tolist() == lab
    assert sample.position_ids.tolist() == pos
    assert sample.block_position_ids.tolist() == blk
    assert np.array_equal(sample.attention_mask(), mask)
    # Every masked token appears exactly once in Part B, and every token is in A xor B.
    masked = [int(t) for s, e in spans_sorted for t in tokens[s:e]]
    part_b = sample.input_ids[sep:]
    assert sorted(masked) == sorted(int(t) for t in part_b if t not in (IDS.sop,))
    assert sorted(masked + [int(t) for t in sample.input_ids[:sep] if t >= 100]) == sorted(tokens.tolist())
    assert (sample.labels[:sep] == IGNORE).all() and (sample.labels[sep:] != IGNORE).all()


def test_part_b_order_is_shuffled_and_deterministic():
    tokens = np.arange(100, 400)
    spans = [(10 * k, 10 * k + 3) for k in range(20)]
    a = build_sample(tokens, spans, IDS.mask, IDS, np.random.default_rng(0))
    b = build_sample(tokens, spans, IDS.mask, IDS, np.random.default_rng(0))
    assert np.array_equal(a.input_ids, b.input_ids)
    order = span_order(a, spans, tokens)
    assert sorted(order) == list(range(20)) and order != list(range(20))


def test_mask_spans_properties():
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(300):
        n = int(rng.integers(20, 400))
        spans = sample_mask_spans(n, rng, CFG)
        covered = sum(e - s for s, e in spans)
        assert covered >= np.ceil(0.15 * n) and covered < n
        for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
            assert e0 < s1  # non-overlapping and not adjacent: each span has its own mask token
        assert spans[0][0] >= 0 and spans[-1][1] <= n
        lengths += [e - s for s, e in spans[:-1]]  # the last one may be clipped by the room left
    assert 1 <= min(lengths) and max(lengths) <= 39
    p = poisson_span_lengths(CFG)
    expected_mean = float((np.arange(1, 40) * p).sum())
    assert abs(np.mean(lengths) - expected_mean) < 0.15


def test_sentence_spans_are_whole_sentences():
    rng = np.random.default_rng(1)
    tokens = np.arange(100, 200)
    ends = {109, 129, 139, 159, 179, 199}  # sentence-final tokens
    bounds = sentence_bounds(tokens, ends)
    assert bounds[0] == (0, 10) and bounds[-1] == (80, 100)
    for _ in range(50):
        spans = sample_sentence_spans(tokens, ends, rng, CFG)
        assert set(spans) <= set(bounds) and sum(e - s for s, e in spans) >= 15
        assert len(spans) < len(bounds)  # one sentence always stays as context
    assert sample_sentence_spans(tokens, set(), rng, CFG) == []  # one sentence: no [sMASK]


def test_gmask_is_a_suffix_of_half_or_more():
    rng = np.random.default_rng(2)
    for n in (2, 5, 100):
        for _ in range(50):
            [(s, e)] = sample_gmask_span(n, rng, CFG)
            assert e == n and 1 <= s and (n - s) >= min(n - 1, round(0.5 * n))
    sample = make_infill_sample(np.arange(100, 140), rng, InfillConfig(objective_weights=[0, 0, 1]), IDS)
    assert sample.input_ids[sample.sep - 1] == IDS.gmask and sample.input_ids[sample.sep] == IDS.sop
