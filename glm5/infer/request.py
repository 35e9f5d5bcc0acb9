"""`Request`: one sequence's state as the scheduler, block manager and runner see it.

A request has a target (`num_tokens` = prompt + output so far) and progress (`num_computed_tokens`,
tokens whose KV is in the cache); each step schedules part of the gap (vLLM v1). It also carries its
block table, its prefix-block hashes, speculative draft tokens, its own `torch.Generator` (seeded
requests sample the same tokens whatever the batch), its detokenized text for stop strings, and
monotonic timestamps for metrics, and its grammar state when its output is constrained (structured
output: the next-token bitmask goes into its sampling row, sampled tokens advance it). `n > 1` becomes
child requests (`fan_out`).
Knows nothing about tensors besides the generator.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import time
from array import array
from typing import Protocol

import torch

from glm5.data.infilling import InfillLayout
from glm5.infer.outputs import PositionLogprobs, RequestMetrics
from glm5.infer.sampling import SamplingParams, SamplingRow
from glm5.infer.structured import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its blocks; waits to be recomputed
    FINISHED_STOPPED = "stop"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


class Detokenizer(Protocol):
    """What a request needs to detokenize (e.g. glm5.data.tokenizer.IncrementalDetokenizer)."""

    def add(self, ids: list[int]) -> str: ...  # returns the newly completed text


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 *, eos_token_ids=(), prompt: str | None = None, cache_salt: str | None = None,
                 detokenizer: Detokenizer | None = None, arrival_time: float | None = None,
                 parent_id: str | None = None, index: int = 0, device: str | torch.device = "cpu",
                 infill: InfillLayout | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params or SamplingParams()
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_salt = cache_salt  # mixed into the first block hash: isolates tenants' caches
        self.adapter_id = -1  # multi-LoRA slot (-1 = base model); its name and version are in cache_salt
        self.num_virtual_tokens = 0  # prefix-adapter placeholders at the start of the prompt (not reported)
        # GLM blank infilling: Part A is bidirectional, so its KV depends on all of Part A; the runner takes
        # positions from the layout and the scheduler computes Part A in one chunk.
        self.infill = infill
        if infill is not None:
            if not 0 < infill.part_a_len < len(self.prompt_token_ids):
                raise ValueError(f"request {request_id!r}: infill Part A ({infill.part_a_len} tokens) must be a "
                                 f"proper prefix of the {len(self.prompt_token_ids)}-token prompt")
            digest = hashlib.blake2b(array("q", self.prompt_token_ids[:infill.part_a_len]).tobytes(),
                                     digest_size=16).hexdigest()
            self.cache_salt = f"{cache_salt or ''}|infill:{infill.part_a_len}:{infill.span_position}:{digest}"
        self.parent_id, self.index = parent_id, index  # child `index` of a request with n > 1
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(self.prompt_token_ids)  # prompt + output, appended in place
        self.num_computed_tokens = 0  # tokens whose KV is in this request's blocks
        self.block_ids: list[int] = []  # block table
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        self.spec_token_ids: list[int] = []  # draft tokens to verify in the next step
        self.detokenizer = detokenizer
        self.output_text = ""
        self.stop_reason: int | str | None = None
        self.logprobs: list[PositionLogprobs] | None = [] if self.params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.cumulative_logprob = 0.0
        self.num_preemptions = 0
        self.model_version = 0  # expert version the request started on (set by the engine)
        self.num_cached_tokens = -1  # prefix-cache hit at first admission (-1 = not admitted yet)
        self.grammar: GrammarState | None = None  # set by the engine for structured output
        self._bitmask: torch.Tensor | None = None
        self.generator = None
        if self.params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(self.params.seed)
        t = time.monotonic() if arrival_time is None else arrival_time
        self.metrics = RequestMetrics(arrival_time=t, num_prompt_tokens=len(self.prompt_token_ids))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks={self.block_ids})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Token ids that end generation: EOS (unless ignore_eos) and stop_token_ids."""
        eos = () if self.params.ignore_eos else self.eos_token_ids
        span_end = (self.infill.end_token_id,) if self.infill is not None else ()  # <eop> always ends a span
        return eos + span_end + tuple(self.params.stop_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> str:
        """Append sampled tokens; detokenize them; return the new text (empty without a detokenizer)."""
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        now = time.monotonic()
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.metrics.num_generation_tokens = len(self.output_token_ids)
        if self.grammar is not None:
            for t in token_ids:
                if not self.grammar.is_terminated:
                    self.grammar.accept(t)
        if self.detokenizer is None:
            return ""
        new_text = self.detokenizer.add(list(token_ids))
        self.output_text += new_text
        return new_text

    def sampling_row(self, num_drafts: int = 0) -> SamplingRow:
        """The sampler's view of this request at the position after `num_drafts` draft tokens."""
        out = self.output_token_ids + self.spec_token_ids[:num_drafts] if num_drafts else self.output_token_ids
        bitmask = None
        if self.grammar is not None:  # constrained requests get no drafts (the engine drops them)
            if self._bitmask is None:
                self._bitmask = torch.zeros(self.grammar.bitmask_words, dtype=torch.int32)
            self.grammar.fill_bitmask(self._bitmask)
            bitmask = self._bitmask
        return SamplingRow(params=self.params, prompt_token_ids=self.prompt_token_ids,
                           output_token_ids=out, generator=self.generator,
                           # the grammar decides where the output may end: min_tokens does not mask EOS
                           stop_ids_until_min=() if self.grammar is not None else self.stop_ids,
                           token_bitmask=bitmask)

    def text_for_output(self) -> str:
        """Detokenized text safe to stream: while running, hold back the last len(longest stop) - 1
        characters, since they could be the start of a stop string that must not be shown."""
        if self.is_finished or not self.params.stop:
            return self.output_text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.output_text[: max(len(self.output_text) - hold, 0)]


def fan_out(request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kwargs) -> list[Request]:
    """Requests for `params.n` samples of one prompt. n == 1: the request itself. n > 1: children
    `"{i}_{request_id}"` with n=1 and seed + i (vLLM's parallel sampling); they share the prompt's full
    blocks through the prefix cache (the scheduler admits siblings after the first one's prefill)."""
    if params.n == 1:
        return [Request(request_id, prompt_token_ids, params, **kwargs)]
    children = []
    for i in range(params.n):
        seed = None if params.seed is None else params.seed + i
        child = dataclasses.replace(params, n=1, seed=seed)
        children.append(Request(f"{i}_{request_id}", prompt_token_ids, child, parent_id=request_id, index=i,
                                **kwargs))
    return children


def check_stop_strings(text: str, num_new_chars: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """Find a stop string that ends in the last `num_new_chars` characters of `text` (it may start in
    older text: stop strings can span tokens). Returns (stop string, length to truncate the text to)
    for the earliest match, or None."""
    best = None
    for stop in stops:
        start = max(len(text) - num_new_chars - len(stop) + 1, 0)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[1]):
            best = (stop, i)
    if best is None:
        return None
    stop, i = best
    return stop, (i + len(stop) if include else i)
