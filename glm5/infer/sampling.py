"""Sampling: `SamplingParams` (vLLM names, defaults and checks) and the batched `Sampler`.

The sampler works on rows of fp32 logits [N, V], one row per sampled position (a request with
speculative drafts has several rows). Processing order follows vLLM v1: logit_bias, the structured-output
token bitmask (`structured.py`; one place for both, so constrained and free rows share a batch), min_tokens masking,
penalties, greedy argmax (temperature 0), temperature, min-p, top-k, top-p, then sampling with each
row's own `torch.Generator` (when the request is seeded), so a seeded request draws the same tokens
whatever else is in the batch. Logprobs are always the log_softmax of the *raw* model logits
(vLLM's default `raw_logprobs`): penalties, temperature and truncation do not change them.
Knows nothing about blocks or scheduling. Legend: N rows, V vocabulary, K top logprobs.
"""

from __future__ import annotations

import logging
import math
import operator
from array import array
from dataclasses import dataclass, field
from typing import Iterable, Literal

import torch

from glm5.infer.outputs import Logprob, PositionLogprobs
from glm5.infer.structured import StructuredOutputs, apply_token_bitmask

log = logging.getLogger(__name__)
Sequence = list[int] | tuple[int, ...]

# Numerically safe ranges. Logits are divided by the temperature and by the repetition penalty (or
# multiplied by it) in fp32: 1e-38 or 1e-300 overflow to inf and softmax then yields NaN. vLLM raises
# 0 < temperature < 1e-2 to 1e-2 (its _MAX_TEMP); the penalty gets the same factor-100 bound both ways.
MIN_TEMPERATURE = 1e-2
REPETITION_PENALTY_RANGE = (1e-2, 1e2)


def check_token_ids(name: str, ids: Iterable, vocab_size: int) -> None:
    """Raise `ValueError` naming `name` unless every id is an integer in [0, vocab_size).

    The one check for every token id a request carries (prompt ids, `stop_token_ids`, `logit_bias`
    keys, `allowed_token_ids`, `bad_words` ids): an id outside the vocabulary would index past the
    logits inside a batched step, so it is rejected when the request arrives."""
    bad = []
    for t in ids:
        try:
            ok = not isinstance(t, bool) and 0 <= operator.index(t) < vocab_size
        except TypeError:
            ok = False
        if not ok:
            bad.append(t)
            if len(bad) == 5:
                break
    if bad:
        raise ValueError(f"{name} must be token ids in [0, {vocab_size}) (the model's vocabulary); got {bad}")


_INT64 = (-(2 ** 63), 2 ** 63 - 1)
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "beam_width",
               "thinking_budget", "thinking_end_token_id")


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request generation controls (vLLM names and defaults)."""

    n: int = 1  # number of completions (child requests sharing the prompt)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob
    repetition_penalty: float = 1.0  # > 0; applied to prompt and output tokens
    presence_penalty: float = 0.0  # in [-2, 2]; output tokens only
    frequency_penalty: float = 0.0  # in [-2, 2]; output tokens only
    seed: int | None = None  # per-request generator seed (child i of n uses seed + i)
    stop: list[str] = field(default_factory=list)  # stop strings (str is accepted too)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens (kept in output)
    ignore_eos: bool = False  # keep generating past EOS
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0  # EOS/stop tokens are masked before this many output tokens
    logprobs: int | None = None  # top-N logprobs per output token (-1 = whole vocabulary)
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token (-1 = whole vocabulary)
    # Also return the logprob and rank of these ids at every output position (SGLang's
    # `token_ids_logprob`): scoring a few candidates without a whole-vocabulary dict. Implies logprobs >= 0.
    logprob_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI)
    structured_outputs: StructuredOutputs | None = None  # output must match this grammar
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0  # beam score = sum logprob / generated_len ** length_penalty
    early_stopping: bool | Literal["never"] = False  # HF semantics
    temperature_schedule: tuple[float, float] | None = None  # linear (start, end) over max_tokens
    # Reasoning budget: once this many output tokens are out without `thinking_end_token_id` (`</think>`),
    # that token is forced, so the answer starts (the prompt left a thinking block open)
    thinking_budget: int | None = None
    thinking_end_token_id: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        if self.logprob_token_ids is not None:
            self.logprob_token_ids = list(self.logprob_token_ids)
            if self.logprobs is None:  # the entries live in the per-position logprob dicts
                self.logprobs = 0
        if self.temperature_schedule is not None:
            self.temperature_schedule = tuple(float(t) for t in self.temperature_schedule)
        for msg in self._errors():
            raise ValueError(msg)
        self._clamp()

    def _clamp(self) -> None:
        """Raise tiny temperatures and pull extreme repetition penalties into the safe ranges (as vLLM
        does for the temperature, with a warning): the request still runs, without NaN logits."""
        if 0 < self.temperature < MIN_TEMPERATURE:
            log.warning("temperature %g is below %g (NaN risk in fp32); using %g", self.temperature,
                        MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            clamped = min(max(self.repetition_penalty, lo), hi)
            log.warning("repetition_penalty %g is outside [%g, %g] (NaN risk in fp32); using %g",
                        self.repetition_penalty, lo, hi, clamped)
            self.repetition_penalty = clamped

    def token_id_fields(self) -> dict[str, Iterable[int]]:
        """Every field that holds token ids, by name (what `check_vocab` checks)."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or {}),
                "logprob_token_ids": self.logprob_token_ids or [],
                "thinking_end_token_id": [] if self.thinking_end_token_id is None else [self.thinking_end_token_id]}

    def check_vocab(self, vocab_size: int) -> None:
        """Raise `ValueError` naming the field if a token id is outside [0, vocab_size)."""
        for name, ids in self.token_id_fields().items():
            check_token_ids(name, ids, vocab_size)

    def _errors(self):
        for name in _INT_FIELDS:  # an int the tensors and generators cannot hold fails in the engine, not here
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool) and isinstance(v, int) and not _INT64[0] <= v <= _INT64[1]:
                yield f"{name} must fit in a signed 64-bit integer, got {v}"
                return
        if self.seed is not None and self.seed + self.n - 1 > _INT64[1]:  # child i of n is seeded seed + i
            yield f"seed + n - 1 must fit in a signed 64-bit integer, got seed {self.seed} and n {self.n}"
        if self.n < 1:
            yield f"n must be >= 1, got {self.n}"
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN fails every comparison
            yield f"temperature must be a finite number >= 0, got {self.temperature}"
        if not 0 < self.top_p <= 1:
            yield f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < -1:
            yield f"top_k must be -1, 0 (off) or >= 1, got {self.top_k}"
        if not 0 <= self.min_p <= 1:
            yield f"min_p must be in [0, 1], got {self.min_p}"
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            yield f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                yield f"{name} must be in [-2, 2], got {getattr(self, name)}"
        if self.max_tokens is not None and self.max_tokens < 1:
            yield f"max_tokens must be >= 1, got {self.max_tokens}"
        if self.min_tokens < 0:
            yield f"min_tokens must be >= 0, got {self.min_tokens}"
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            yield f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < -1:
                yield f"{name} must be None, -1 (all) or >= 0, got {v}"
        if self.logprob_token_ids is not None and any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.logprob_token_ids):
            yield f"logprob_token_ids must be token ids >= 0, got {self.logprob_token_ids[:5]}"
        if any(not s for s in self.stop):
            yield "stop must not contain empty strings"
        if self.thinking_budget is not None and (self.thinking_budget < 1 or self.thinking_end_token_id is None):
            yield f"thinking_budget must be >= 1 and come with thinking_end_token_id, got {self.thinking_budget}"
        for tid, bias in (self.logit_bias or {}).items():
            if not isinstance(tid, int) or tid < 0 or not -100 <= bias <= 100:
                yield f"logit_bias must map token ids >= 0 to values in [-100, 100], got {tid}: {bias}"
                break
        yield from self._beam_errors()

    def _beam_errors(self):
        if self.beam_width < 1:
            yield f"beam_width must be >= 1, got {self.beam_width}"
        if self.early_stopping not in (True, False, "never"):
            yield f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
        if self.use_beam_search and self.temperature != 0:
            yield f"temperature must be 0 with use_beam_search, got {self.temperature}"
        if self.temperature_schedule is not None:
            ts = self.temperature_schedule
            if len(ts) != 2 or not all(math.isfinite(t) and t >= 0 for t in ts):
                yield f"temperature_schedule must be (start, end) >= 0, got {self.temperature_schedule}"
            if self.max_tokens is None:
                yield "temperature_schedule needs max_tokens (the schedule spans max_tokens steps)"

    def temperature_at(self, num_output_tokens: int) -> float:
        """Temperature for the next token; a schedule goes linearly from start to end over max_tokens."""
        if self.temperature_schedule is None:
            return self.temperature
        start, end = self.temperature_schedule
        frac = min(num_output_tokens / max(self.max_tokens - 1, 1), 1.0)
        t = start + (end - start) * frac
        return MIN_TEMPERATURE if 0 < t < MIN_TEMPERATURE else t  # same floor as a fixed temperature

    @property
    def is_greedy(self) -> bool:
        return self.temperature_schedule is None and self.temperature == 0


@dataclass
class SamplingRow:
    """What the sampler needs about one row: the request's params and its tokens so far."""

    params: SamplingParams
    prompt_token_ids: Sequence
    output_token_ids: Sequence  # tokens before this row's position (drafts included for spec rows)
    generator: torch.Generator | None = None
    stop_ids_until_min: Sequence = ()  # eos + stop ids: masked while len(output) < min_tokens
    token_bitmask: torch.Tensor | None = None  # int32 [ceil(V / 32)]: allowed tokens (structured output)


@dataclass
class SamplerOutput:
    """Sampled ids [N]; optional logprobs: column 0 is the sampled token, then the top-K."""

    token_ids: torch.Tensor  # [N] long
    logprob_token_ids: torch.Tensor | None = None  # [N, 1 + K] long
    logprobs: torch.Tensor | None = None  # [N, 1 + K] fp32
    sampled_ranks: torch.Tensor | None = None  # [N] rank of the sampled token (1 = most likely)
    requested: list[PositionLogprobs | None] | None = None  # per row: its params' logprob_token_ids


class Sampler:
    """Batched sampling over rows of logits; `generator` serves unseeded rows."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [N, V] (any float dtype; processed in fp32) -> SamplerOutput."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), "one row of logits per SamplingRow"
        raw = logits.float()
        x, greedy = self._adjust(raw, rows)
        token_ids = x.argmax(dim=-1)  # [N]
        if not bool(greedy.all()):
            sampled = self._draw(self._truncated_probs(x, rows), rows)
            token_ids = torch.where(greedy, token_ids, sampled)
        out = SamplerOutput(token_ids=token_ids)
        num_logprobs = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        if num_logprobs:
            k = raw.shape[1] if -1 in num_logprobs else max(num_logprobs)
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(raw, token_ids, k)
            if any(r.params.logprob_token_ids for r in rows):
                out.requested = requested_logprobs(raw, [r.params.logprob_token_ids for r in rows])
        return out

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution [N, V] each row is sampled from (one-hot at the argmax for greedy rows);
        the target probabilities for `spec_verify`."""
        x, greedy = self._adjust(logits.float(), rows)
        probs = self._truncated_probs(x, rows)
        one_hot = torch.zeros_like(probs).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
        return torch.where(greedy[:, None], one_hot, probs)

    @staticmethod
    def _adjust(raw: torch.Tensor, rows: list[SamplingRow]):
        """logit_bias, grammar bitmask, min_tokens masking, penalties, then temperature; returns
        (logits [N, V], greedy mask [N]). Every step copies before it writes: `raw` stays raw."""
        x = apply_logit_bias(raw, rows)
        x = apply_token_bitmask(x, [r.token_bitmask for r in rows])
        x = apply_min_tokens(x, rows)
        x = apply_thinking_budget(x, rows)
        x = apply_penalties(x, rows)
        temps = [r.params.temperature_at(len(r.output_token_ids)) for r in rows]
        greedy = torch.tensor([t == 0 for t in temps], device=x.device)
        if bool(greedy.all()):
            return x, greedy
        temp = torch.tensor([t if t > 0 else 1.0 for t in temps], device=x.device)
        return x / temp[:, None], greedy  # argmax is unchanged by a positive temperature

    @staticmethod
    def _truncated_probs(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """min-p, top-k, top-p, softmax -> [N, V]."""
        x = apply_min_p(x, torch.tensor([r.params.min_p for r in rows], device=x.device))
        top_k = torch.tensor([min(r.params.top_k, x.shape[1]) if r.params.top_k > 0 else x.shape[1] for r in rows],
                             device=x.device)
        top_p = torch.tensor([r.params.top_p for r in rows], device=x.device)
        return torch.softmax(apply_top_k_top_p(x, top_k, top_p), dim=-1)  # [N, V]

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # Exponential race: argmax(p / q), q ~ Exp(1), is a draw from p; each row's q comes from the
        # row's own generator, so a seeded row's draw does not depend on the other rows.
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            q[unseeded] = torch.empty_like(probs[unseeded]).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        return (probs / q).argmax(dim=-1)  # [N]


def apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Add each row's `logit_bias` (token id -> bias) to its logits (on a copy, only if any row has one)."""
    biased = [(i, r.params.logit_bias) for i, r in enumerate(rows) if r.params.logit_bias]
    if not biased:
        return x
    x = x.clone()
    for i, bias in biased:
        ids = torch.tensor(list(bias), device=x.device)
        x[i, ids] += torch.tensor(list(bias.values()), device=x.device, dtype=x.dtype)
    return x


def apply_min_tokens(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask EOS/stop ids (-inf) for rows that have fewer than min_tokens output tokens (on a copy)."""
    masked = [i for i, r in enumerate(rows)
              if r.stop_ids_until_min and len(r.output_token_ids) < r.params.min_tokens]
    if not masked:
        return x
    x = x.clone()
    for i in masked:
        x[i, list(rows[i].stop_ids_until_min)] = float("-inf")
    return x


def apply_thinking_budget(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Rows whose reasoning used up `thinking_budget` output tokens without closing get only the
    `thinking_end_token_id` logit left (on a copy): the next token ends the thinking block."""
    forced = [i for i, r in enumerate(rows) if r.params.thinking_budget is not None
              and len(r.output_token_ids) >= r.params.thinking_budget
              and r.params.thinking_end_token_id not in r.output_token_ids]
    if not forced:
        return x
    x = x.clone()
    for i in forced:
        x[i] = float("-inf")
        x[i, rows[i].params.thinking_end_token_id] = 0.0  # the one finite logit: sampled at any temperature
    return x


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """vLLM penalties. Repetition (prompt + output tokens): divide positive logits by the penalty,
    multiply negative ones. Frequency/presence (output tokens only): subtract f * count and p * seen."""
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    if all(v == 1.0 for v in rep) and not any(freq) and not any(pres):
        return x
    n, v = x.shape
    counts = _scatter_counts([r.output_token_ids for r in rows], n, v, x.device)  # [N, V]
    prompt_ids = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
    seen_in_prompt = _scatter_counts(prompt_ids, n, v, x.device) > 0  # [N, V]
    rep_t = torch.tensor(rep, device=x.device)[:, None]
    seen = seen_in_prompt | (counts > 0)
    penalised = torch.where(x > 0, x / rep_t, x * rep_t)
    x = torch.where(seen, penalised, x)
    x = x - torch.tensor(freq, device=x.device)[:, None] * counts
    return x - torch.tensor(pres, device=x.device)[:, None] * (counts > 0).float()


def _scatter_counts(id_lists, n: int, v: int, device) -> torch.Tensor:
    """Per-row token counts [N, V] from N id lists, with one host-to-device copy (no per-row tensors)."""
    flat = array("q")
    for ids in id_lists:
        flat.extend(ids)  # C-speed list -> int64 buffer
    counts = torch.zeros(n * v, device=device)
    if len(flat):
        lens = torch.tensor([len(ids) for ids in id_lists])
        rows = torch.repeat_interleave(torch.arange(n), lens)  # [M] row of each id
        idx = (rows * v + torch.frombuffer(flat, dtype=torch.int64)).to(device)
        counts.index_add_(0, idx, torch.ones(len(flat), device=device))
    return counts.view(n, v)  # [N, V]


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (max probability) of their row."""
    if not bool((min_p > 0).any()):
        return x
    probs = torch.softmax(x, dim=-1)  # [N, V]
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest set whose mass reaches top_p (>= 1 token)."""
    if bool((top_k >= x.shape[1]).all()) and bool((top_p >= 1).all()):
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
    ranks = torch.arange(x.shape[1], device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [N, V] mass of strictly more likely tokens
    sorted_x = sorted_x.masked_fill((mass_before >= top_p[:, None]) & (ranks > 0), float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def gather_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, k: int):
    """log_softmax of raw logits -> ([N, 1+K] ids, [N, 1+K] logprobs, [N] rank of token_ids)."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)  # [N, V]
    top_lp, top_ids = logprobs.topk(k, dim=-1)  # [N, K] (K may be 0: sampled token only)
    sampled_lp = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1  # [N]
    ids = torch.cat([token_ids[:, None], top_ids], dim=1)
    return ids, torch.cat([sampled_lp, top_lp], dim=1), ranks


def position_logprobs(ids: torch.Tensor, logprobs: torch.Tensor, rank: int | None, k: int) -> PositionLogprobs:
    """One row of `gather_logprobs` output -> {token_id: Logprob} with the sampled token and the top-k.
    `rank` is the sampled token's rank (the top-k tokens have ranks 1..k)."""
    ids_l, lps = ids.tolist(), logprobs.tolist()
    out = {ids_l[0]: Logprob(lps[0], rank)}
    for j in range(1, min(k, len(ids_l) - 1) + 1):
        out.setdefault(ids_l[j], Logprob(lps[j], j))
    return out


def requested_logprobs(raw: torch.Tensor, ids_per_row: list[Sequence | None]) -> list[PositionLogprobs | None]:
    """Per row of raw logits [N, V]: {id: Logprob(logprob, rank)} for the row's requested ids (None where
    a row requests none). Only those entries are built, so the cost grows with the ids, not with V."""
    rows = [i for i, ids in enumerate(ids_per_row) if ids]
    out: list[PositionLogprobs | None] = [None] * len(ids_per_row)
    if not rows:
        return out
    logprobs = torch.log_softmax(raw[rows].float(), dim=-1)  # [n, V]
    for j, i in enumerate(rows):
        ids = torch.as_tensor(ids_per_row[i], device=raw.device)  # [m]
        lp = logprobs[j, ids]  # [m]
        ranks = (logprobs[j][None, :] > lp[:, None]).sum(dim=-1) + 1  # [m]
        out[i] = {t: Logprob(v, r) for t, v, r in zip(ids.tolist(), lp.tolist(), ranks.tolist())}
    return out


def with_requested(entry: PositionLogprobs, requested: PositionLogprobs | None) -> PositionLogprobs:
    """A position's {sampled, top-k} dict plus the requested ids (the sampled token stays the first key)."""
    if not requested:
        return entry
    return entry | {t: lp for t, lp in requested.items() if t not in entry}


def logprobs_of(raw: torch.Tensor, token_ids: Sequence, k: int) -> list[PositionLogprobs]:
    """Per row of raw logits [n, V]: the logprob (and rank) of token_ids[i] plus the top-k (-1 = the whole
    vocabulary), from log_softmax of the raw logits (prompt logprobs; verified speculative tokens)."""
    k = raw.shape[-1] if k == -1 else k
    ids, lps, ranks = gather_logprobs(raw, torch.as_tensor(token_ids, device=raw.device), k)
    ranks = ranks.tolist()
    return [position_logprobs(ids[j], lps[j], ranks[j], k) for j in range(ids.shape[0])]


def spec_verify(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_tokens: Sequence,
                generator: torch.Generator | None = None, greedy: bool = False) -> list[int]:
    """Speculative-decoding acceptance for one request: accepted draft tokens plus one more token.

    target_probs [k+1, V]: target distribution at each draft position and the bonus position.
    draft_probs [k, V] or None (a deterministic draft, e.g. greedy MTP: q is one-hot at the draft).
    Greedy: accept while the draft equals the target argmax, then emit the target argmax (exact).
    Sampling: accept d with prob min(1, p(d)/q(d)); on rejection draw from norm(max(p - q, 0)) and stop;
    if all are accepted draw the bonus from p[k]. The output follows the target distribution exactly.
    """
    k = len(draft_tokens)
    assert target_probs.shape[0] == k + 1, "target_probs needs k + 1 rows"
    out: list[int] = []
    for i, d in enumerate(draft_tokens):
        p = target_probs[i]
        if greedy:
            best = int(p.argmax())
            out.append(best)
            if best != d:
                return out
            continue
        if draft_probs is not None:
            q = draft_probs[i]
        else:  # deterministic draft: q is one-hot at d
            q = torch.zeros_like(p)
            q[d] = 1.0
        u = torch.rand((), generator=generator, device=p.device)
        if q[d] > 0 and u * q[d] <= p[d]:
            out.append(int(d))
            continue
        residual = (p - q).clamp(min=0)
        residual = residual if residual.sum() > 0 else p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    last = target_probs[k]
    bonus = last.argmax() if greedy else torch.multinomial(last, 1, generator=generator)
    return out + [int(bonus)]
