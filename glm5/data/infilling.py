"""GLM autoregressive blank infilling (seed M4; Du et al. 2022, see GLM5_ARCHITECTURE.md section 5).

Owns span sampling for the three GLM objectives and the construction of one training sample:
- `[MASK]`: spans with lengths ~ Poisson(3) truncated to 1..39, drawn until >= 15% of the tokens are
  covered, placed uniformly without overlap (and never adjacent, so every span has its own mask);
- `[sMASK]`: whole sentences, picked at random until >= 15% are covered;
- `[gMASK]`: one suffix span of 50-100% of the text.
Part A is the text with each span collapsed to its mask token; Part B is the spans in random order,
each fed as `<sop>`+span with targets span+`<eop>`. 2D positions: `position_ids` is the position in
Part A (Part B reuses its mask's position), `block_position_ids` is 0 in A and 1..len+1 in a span.
Attention: bidirectional over A, causal over B, B sees all of A; the loss is on B only.
Labels are aligned with the inputs (`labels[t]` is the target of position t). Pure numpy; no tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

IGNORE = -100


@dataclass(kw_only=True)
class InfillConfig:
    """Blank-infilling objective settings (the GLM defaults)."""

    mask_ratio: float = 0.15
    """[MASK]: sample spans until at least this fraction of tokens is masked."""
    poisson_lambda: float = 3.0
    """[MASK]: span lengths ~ Poisson(lambda) truncated to 1..max_span."""
    max_span: int = 39
    """[MASK]: longest span."""
    sentence_ratio: float = 0.15
    """[sMASK]: mask whole sentences until at least this fraction is masked."""
    gmask_min: float = 0.5
    """[gMASK]: the masked suffix covers between gmask_min..."""
    gmask_max: float = 1.0
    """... and gmask_max of the text (at least one token of context is always kept)."""
    objective_weights: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.25])
    """Probabilities of the [MASK], [sMASK] and [gMASK] objectives for one sample."""
    min_tokens: int = 16
    """Shorter source pieces are not infilled (the loader uses causal LM for them)."""

    def __post_init__(self):
        if len(self.objective_weights) != 3 or min(self.objective_weights) < 0 or sum(self.objective_weights) <= 0:
            raise ValueError("objective_weights must be 3 non-negative numbers ([MASK], [sMASK], [gMASK])")
        if not (0 < self.gmask_min <= self.gmask_max <= 1):
            raise ValueError("need 0 < gmask_min <= gmask_max <= 1")
        if self.min_tokens < 4:
            raise ValueError("min_tokens must be >= 4")


@dataclass
class InfillTokens:
    """The special-token ids blank infilling needs."""

    mask: int
    smask: int
    gmask: int
    sop: int
    eop: int

    @classmethod
    def from_special_tokens(cls, special: dict[str, int]) -> "InfillTokens":
        return cls(special["[MASK]"], special["[sMASK]"], special["[gMASK]"], special["<sop>"], special["<eop>"])


@dataclass
class GLMSample:
    """One blank-infilling sample of length L = |A| + |B|; arrays are int64 [L]."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    block_position_ids: np.ndarray
    sep: int  # |Part A|

    def attention_mask(self) -> np.ndarray:
        """[L, L] bool, True = may attend: every row sees Part A; Part B rows also see B causally."""
        n = len(self.input_ids)
        mask = np.tril(np.ones((n, n), dtype=bool))
        mask[:, : self.sep] = True
        return mask


@dataclass(frozen=True)
class InfillLayout:
    """Where a blank-infilling sequence's parts sit, for one span generated at inference (training
    samples hold several spans; `build_sample` lays each out by the same rule). Part A is sequence
    indices [0, part_a_len) (bidirectional attention, the mask token at `span_position`); Part B starts at
    index part_a_len with <sop> and is generated until <eop>: every Part B token has RoPE position
    `span_position` and block position 1, 2, ... (Part A: its index and 0)."""

    part_a_len: int
    span_position: int
    end_token_id: int  # <eop>: ends the span

    def position_ids(self, start: int, end: int) -> list[int]:
        """RoPE positions of sequence indices [start, end)."""
        return [i if i < self.part_a_len else self.span_position for i in range(start, end)]

    def block_position_ids(self, start: int, end: int) -> list[int]:
        """GLM block (intra-span) positions of sequence indices [start, end)."""
        return [max(i - self.part_a_len + 1, 0) for i in range(start, end)]


def infill_prompt(prefix: list[int], suffix: list[int], ids: InfillTokens,
                  mask: Literal["mask", "gmask"] = "mask") -> tuple[list[int], InfillLayout]:
    """Prompt ids for generating the blank between `prefix` and `suffix`: Part A = prefix + [MASK] + suffix
    (or prefix + [gMASK], open-ended continuation; then `suffix` must be empty), then <sop>."""
    if mask == "gmask" and suffix:
        raise ValueError("[gMASK] infilling continues the text: the suffix must be empty")
    mask_id = ids.mask if mask == "mask" else ids.gmask
    part_a = list(prefix) + [mask_id] + list(suffix)
    return part_a + [ids.sop], InfillLayout(len(part_a), len(prefix), ids.eop)


def poisson_span_lengths(cfg: InfillConfig) -> np.ndarray:
    """P(len = i) for i = 1..max_span, proportional to the Poisson pmf."""
    i = np.arange(1, cfg.max_span + 1)
    log_pmf = i * np.log(cfg.poisson_lambda) - cfg.poisson_lambda - np.cumsum(np.log(i))
    p = np.exp(log_pmf)
    return p / p.sum()


def sample_mask_spans(n: int, rng: np.random.Generator, cfg: InfillConfig) -> list[tuple[int, int]]:
    """[MASK] spans over n tokens: sorted, non-overlapping, separated by at least one kept token."""
    target = max(1, int(np.ceil(cfg.mask_ratio * n)))
    probs = poisson_span_lengths(cfg)
    lengths: list[int] = []
    total = 0
    for length in rng.choice(len(probs), size=target, p=probs) + 1:  # never more than `target` spans
        room = n - total - len(lengths) - 1  # one kept token between spans, one more overall
        if total >= target or room < 1:
            break
        lengths.append(int(min(length, room)))
        total += lengths[-1]
    rng.shuffle(lengths)
    # GLM's placement: choose k gap sizes uniformly by sorting k draws in [0, free], then lay out
    # span, gap of >= 1, span, ... from left to right.
    free = n - total - (len(lengths) - 1)
    places = np.sort(rng.integers(0, free, size=len(lengths), endpoint=True))
    spans, offset = [], 0
    for place, length in zip(places, lengths):
        start = offset + int(place)
        spans.append((start, start + length))
        offset += length + 1
    return spans


def sentence_bounds(tokens: np.ndarray, sentence_end_ids) -> list[tuple[int, int]]:
    """Split tokens into sentences, each ending after a sentence-end token (the last may not)."""
    ends = np.flatnonzero(np.isin(tokens, np.asarray(list(sentence_end_ids), dtype=np.int64))) + 1
    bounds, start = [], 0
    for e in ends:
        bounds.append((start, int(e)))
        start = int(e)
    if start < len(tokens):
        bounds.append((start, len(tokens)))
    return bounds


def sample_sentence_spans(tokens: np.ndarray, sentence_end_ids, rng: np.random.Generator,
                          cfg: InfillConfig) -> list[tuple[int, int]]:
    """[sMASK] spans: random whole sentences until >= sentence_ratio of the tokens is covered.
    Returns [] when the text has fewer than two sentences (masking it all would leave no context)."""
    bounds = sentence_bounds(tokens, sentence_end_ids)
    if len(bounds) < 2:
        return []
    target = max(1, int(np.ceil(cfg.sentence_ratio * len(tokens))))
    chosen, covered = [], 0
    for i in rng.permutation(len(bounds)):
        if covered >= target or len(chosen) == len(bounds) - 1:  # always keep one sentence as context
            break
        chosen.append(bounds[i])
        covered += bounds[i][1] - bounds[i][0]
    return sorted(chosen)


def sample_gmask_span(n: int, rng: np.random.Generator, cfg: InfillConfig) -> list[tuple[int, int]]:
    """[gMASK]: one suffix span of a uniform 50-100% of the text, keeping >= 1 context token."""
    length = int(round(rng.uniform(cfg.gmask_min, cfg.gmask_max) * n))
    length = min(max(length, 1), n - 1)
    return [(n - length, n)]


def build_sample(tokens: np.ndarray, spans: list[tuple[int, int]], mask_id: int, ids: InfillTokens,
                 rng: np.random.Generator | None) -> GLMSample:
    """Part A (spans collapsed to `mask_id`) + Part B (spans shuffled by `rng`; None keeps order)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    part_a, mask_pos, prev, n_a = [], [], 0, 0
    for s, e in spans:
        part_a += [tokens[prev:s], np.array([mask_id], dtype=np.int64)]
        n_a += s - prev
        mask_pos.append(n_a)  # where this span's mask token sits in Part A
        n_a += 1
        prev = e
    part_a.append(tokens[prev:])
    a = np.concatenate(part_a)
    sep = len(a)
    order = rng.permutation(len(spans)) if rng is not None else np.arange(len(spans))
    inp, lab, pos, blk = [a], [np.full(sep, IGNORE)], [np.arange(sep)], [np.zeros(sep, dtype=np.int64)]
    for k in order:
        s, e = spans[k]
        span = tokens[s:e]
        layout = InfillLayout(0, mask_pos[k], ids.eop)  # this span's Part B, indexed from its <sop>
        inp.append(np.concatenate([[ids.sop], span]))
        lab.append(np.concatenate([span, [ids.eop]]))
        pos.append(np.asarray(layout.position_ids(0, e - s + 1)))
        blk.append(np.asarray(layout.block_position_ids(0, e - s + 1)))
    cat = lambda xs: np.concatenate(xs).astype(np.int64)  # noqa: E731
    return GLMSample(cat(inp), cat(lab), cat(pos), cat(blk), sep)


def make_infill_sample(tokens: np.ndarray, rng: np.random.Generator, cfg: InfillConfig,
                       ids: InfillTokens, sentence_end_ids=()) -> GLMSample:
    """Pick an objective by `cfg.objective_weights` and build the sample for `tokens`."""
    tokens = np.asarray(tokens, dtype=np.int64)
    w = np.asarray(cfg.objective_weights, dtype=np.float64)
    kind = int(rng.choice(3, p=w / w.sum()))
    spans = []
    if kind == 1:
        spans = sample_sentence_spans(tokens, sentence_end_ids, rng, cfg)
        if not spans:  # one sentence only: fall back to token-level spans
            kind = 0
    if kind == 0:
        spans = sample_mask_spans(len(tokens), rng, cfg)
    if kind == 2:
        spans = sample_gmask_span(len(tokens), rng, cfg)
    mask_id = (ids.mask, ids.smask, ids.gmask)[kind]
    return build_sample(tokens, spans, mask_id, ids, rng)
