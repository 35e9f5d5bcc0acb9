"""`Scheduler`: waiting/running queues, token-budget scheduling, preemption, and stop conditions.

Each step is `schedule() -> ScheduleOutput`, the runner computes the scheduled tokens and samples,
then `update(out, sampled) -> finished`. There is no prefill or decode phase (vLLM v1): a request
has `num_tokens` and `num_computed_tokens`, and each step gives it min(gap, budget) tokens, so chunked
prefill, prefix-cache hits, recompute after preemption and speculative drafts are all "schedule some
tokens". Running requests go first (in admission order), then waiting ones (FIFO). When blocks run
out, the latest-admitted running request is preempted: its blocks are freed and it goes back to the
front of the waiting queue, to be recomputed from its prompt + output tokens.
The scheduler owns the `BlockManager`; it never touches tensors.

The waiting queue is the engine's one admission queue, also for the server: requests reach it as they
arrive. A driver may pass a `Batching` policy (the server's dynamic batching, from `EngineConfig`) to
`schedule()`: at most `max_batch_size` requests running, and new ones admitted oldest first with the other
free places given to the waiting prompts closest in length to it (seed I6); `batch_wait()` says how long an
idle engine should gather for `preferred_batch_size` requests before its first step. Without a policy
(offline drivers: everything is queued before the first step) waiting requests are admitted FIFO up to
`max_num_seqs`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from glm5.infer.block_manager import BlockManager, cdiv
from glm5.infer.config import EngineConfig
from glm5.infer.outputs import PositionLogprobs
from glm5.infer.request import Request, RequestStatus, check_stop_strings


@dataclass(frozen=True)
class Batching:
    """Dynamic batching over the waiting queue (see the module docstring); built from the config's fields,
    which hold the one set of defaults."""

    max_batch_size: int  # requests running at most (with max_num_seqs: the smaller one holds)
    preferred_batch_size: int  # an idle engine starts as soon as this many wait ...
    batch_timeout_s: float  # ... or once the oldest waited this long
    by_length: bool  # the free places after the oldest go to the prompts closest in length to it

    @classmethod
    def from_config(cls, config: EngineConfig) -> Batching:
        return cls(config.max_batch_size, config.preferred_batch_size, config.batch_timeout_ms / 1000.0,
                   config.batch_by_length)


@dataclass
class ScheduledRequest:
    """One request's share of a step: compute tokens [start, start + num_tokens) of
    `request.all_token_ids + spec_token_ids`, whose KV goes to slots of `request.block_ids`."""

    request: Request
    num_tokens: int
    start: int  # num_computed_tokens when scheduled = position of the first token
    spec_token_ids: list[int] = field(default_factory=list)  # drafts at the end of the chunk
    is_new: bool = False  # first admission or resumed after preemption: the runner (re)builds state
    is_resumed: bool = False  # admitted again after a preemption

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the last known token, so the runner must sample (1 + drafts rows)."""
        return self.start + self.num_tokens - len(self.spec_token_ids) >= self.request.num_tokens


@dataclass
class ScheduleOutput:
    scheduled: list[ScheduledRequest]
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished/aborted since the last step
    # (source block, destination block, rows): partial prefix blocks to copy before the step (block_manager.py)
    block_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def new_request_ids(self) -> list[str]:
        return [s.request_id for s in self.scheduled if s.is_new]

    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager | None = None):
        self.config = config
        if block_manager is None:
            if config.num_blocks is None:
                raise ValueError("Scheduler needs a BlockManager or config.num_blocks")
            block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.block_manager = block_manager
        if config.max_model_len is None:
            raise ValueError("Scheduler needs a resolved max_model_len (LLMEngine sets it from the model)")
        needed = cdiv(config.max_model_len + config.speculative_num_tokens, block_manager.block_size)
        if needed > block_manager.num_blocks:
            raise ValueError(f"{block_manager.num_blocks} KV blocks cannot hold one request of max_model_len "
                             f"{config.max_model_len} ({needed} blocks); lower max_model_len or add KV memory")
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # ---- queue management ------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.num_prompt_tokens == 0:
            raise ValueError(f"request {req.request_id!r}: the prompt is empty")
        if req.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(f"request {req.request_id!r}: the prompt has {req.num_prompt_tokens} tokens, "
                             f"more than max_model_len={self.config.max_model_len}")
        if req.params.stop and req.detokenizer is None:
            raise ValueError(f"request {req.request_id!r}: stop strings need a detokenizer on the request")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Stop a request now and free its blocks. Returns it, or None if unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self._finish(req)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_stats(self) -> dict:
        bm = self.block_manager
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_cache_usage": bm.usage, "prefix_cache_queries": bm.prefix_cache_queries,
                "prefix_cache_hits": bm.prefix_cache_hits, "num_preemptions": self.num_preemptions}

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self, batching: Batching | None = None) -> ScheduleOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        # 1. Running requests, oldest first: decodes, remaining prefill chunks, draft tokens.
        for req in list(self.running):
            if budget == 0 or req.status is not RequestStatus.RUNNING:
                break  # out of budget, or `req` was preempted to make room for an older request
            num_new, num_drafts = self._num_new_tokens(req, budget)
            if num_new == 0:
                continue
            if not self._allocate_or_preempt(req, num_new, preempted):
                break  # `req` preempted itself: it was the last running request
            scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens,
                                              req.spec_token_ids[:num_drafts]))
            budget -= num_new

        # 2. Waiting requests (new or preempted) in admission order; none if this step had to preempt.
        max_running = self.config.max_num_seqs if batching is None else min(self.config.max_num_seqs,
                                                                             batching.max_batch_size)
        admitted: set[int] = set()
        for req in self._admission_order(batching, max_running - len(self.running)):
            if budget <= 0 or preempted or len(self.running) >= max_running:
                break
            if self._waits_for_sibling(req):
                continue  # admit it once its sibling's prompt blocks are cached
            computed = self.block_manager.get_computed_blocks(req)
            num_new = req.num_tokens - computed.num_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            whole = self._unsplittable(req, computed.num_tokens)
            if whole > budget:
                if scheduled or budget < self.config.max_num_batched_tokens:
                    break  # next step, with the whole budget
                budget = whole  # alone in a step: a bidirectional Part A may exceed the token budget
            num_new = min(num_new, budget)
            if self.block_manager.allocate_slots(req, num_new, computed, self.config.speculative_num_tokens) is None:
                break  # no blocks: wait for running requests to finish
            scheduled.append(self._admit(req, computed.num_tokens, num_new))
            admitted.add(id(req))
            budget -= num_new
        if admitted:
            self.waiting = deque(r for r in self.waiting if id(r) not in admitted)

        finished, self._finished_ids = self._finished_ids, []
        return ScheduleOutput(scheduled, preempted, finished, self.block_manager.take_copies())

    def _admission_order(self, batching: Batching | None, free: int) -> list[Request]:
        """Waiting requests in the order to try them: FIFO; with `batching.by_length` and more waiting than
        free places, the oldest first, then the rest by closeness of prompt length to it (stable: FIFO ties)."""
        if batching is None or not batching.by_length or len(self.waiting) <= max(free, 1):
            return list(self.waiting)
        first, *rest = self.waiting
        n = first.num_prompt_tokens
        return [first, *sorted(rest, key=lambda r: abs(r.num_prompt_tokens - n))]

    def batch_wait(self, batching: Batching, now: float | None = None) -> float | None:
        """Seconds an idle engine should keep gathering before its first step: until `preferred_batch_size`
        requests wait or the oldest has waited `batch_timeout_s` (None: step now, or nothing waits)."""
        if self.running or not self.waiting or len(self.waiting) >= batching.preferred_batch_size:
            return None
        now = time.monotonic() if now is None else now
        left = self.waiting[0].metrics.arrival_time + batching.batch_timeout_s - now
        return left if left > 0 else None

    @staticmethod
    def _unsplittable(req: Request, num_computed: int) -> int:
        """Tokens that must be computed in this request's next chunk: the rest of a blank-infilling Part A
        (bidirectional, so every Part A token must see all of Part A in one forward)."""
        if req.infill is None:
            return 0
        return max(req.infill.part_a_len - num_computed, 0)

    def _num_new_tokens(self, req: Request, budget: int) -> tuple[int, int]:
        """Tokens to compute for a running request this step, and how many of them are drafts."""
        gap = req.num_tokens - req.num_computed_tokens
        limit = min(budget, self.config.max_model_len - req.num_computed_tokens)
        num_new = min(gap + len(req.spec_token_ids), limit)
        return num_new, max(num_new - gap, 0)

    def _allocate_or_preempt(self, req: Request, num_new: int, preempted: list[str]) -> bool:
        """Allocate slots for `req`, preempting the latest-admitted running requests until it fits.
        False if `req` itself had to be preempted."""
        lookahead = self.config.speculative_num_tokens
        while self.block_manager.allocate_slots(req, num_new, num_lookahead_tokens=lookahead) is None:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.metrics.num_preemptions = req.num_preemptions
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, req: Request, num_cached: int, num_new: int) -> ScheduledRequest:
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
            req.metrics.num_cached_tokens = num_cached
            req.metrics.first_scheduled_time = time.monotonic()
        self.running.append(req)
        return ScheduledRequest(req, num_new, num_cached, is_new=True, is_resumed=req.num_preemptions > 0)

    def _waits_for_sibling(self, req: Request) -> bool:
        """A child of an n > 1 request waits while a running sibling is still computing the prompt's full
        blocks: admitted one step later it reuses them from the prefix cache instead of recomputing."""
        if req.parent_id is None or not self.block_manager.enable_prefix_caching:
            return False
        bs = self.block_manager.block_size
        full = req.num_prompt_tokens // bs * bs
        return any(r.parent_id == req.parent_id and r.num_computed_tokens < full for r in self.running)

    # ---- after the runner -------------------------------------------------------------------------

    def update(self, out: ScheduleOutput, sampled: dict[str, list[int]],
               logprobs: dict[str, list[PositionLogprobs]] | None = None,
               draft_token_ids: dict[str, list[int]] | None = None) -> list[Request]:
        """Apply a step's results: `sampled[id]` holds the accepted drafts plus one sampled token (one
        token without drafts; nothing for a prefill chunk that did not reach the end). Appends tokens,
        checks stop conditions, registers newly full blocks in the prefix cache, stores the next drafts.
        Returns the requests that finished this step (their blocks are already freed)."""
        finished = []
        for s in out.scheduled:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted (or preempted) after schedule()
            tokens = sampled.get(req.request_id, []) if s.samples else []
            num_rejected = len(s.spec_token_ids) + 1 - len(tokens) if tokens else len(s.spec_token_ids)
            req.num_computed_tokens += s.num_tokens - num_rejected
            req.spec_token_ids = []
            if tokens:
                self._append_and_check(req, tokens, (logprobs or {}).get(req.request_id))
            self.block_manager.cache_blocks(req)
            if req.is_finished:
                self._finish(req)
                finished.append(req)
            elif draft_token_ids and req.request_id in draft_token_ids and req.grammar is None:
                req.spec_token_ids = list(draft_token_ids[req.request_id])
        return finished

    def _append_and_check(self, req: Request, tokens: list[int], logprobs: list[PositionLogprobs] | None):
        for j, token in enumerate(tokens):
            new_text = req.append_output_token_ids([token])
            if logprobs is not None and req.logprobs is not None:
                req.logprobs.append(logprobs[j])
                req.cumulative_logprob += logprobs[j][token].logprob
            if self._check_stop(req, token, len(new_text)):
                return  # tokens after a stop (accepted drafts) are dropped

    def _check_stop(self, req: Request, token: int, num_new_chars: int) -> bool:
        """Stop conditions after appending `token` (none before min_tokens output tokens)."""
        p = req.params
        if req.grammar is not None and req.grammar.is_terminated:  # the grammar's end (after its EOS)
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if req.num_output_tokens >= p.min_tokens:
            if token in req.stop_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                ends = token in req.eos_token_ids and not p.ignore_eos
                ends |= req.infill is not None and token == req.infill.end_token_id  # <eop>: the span is done
                req.stop_reason = None if ends else token
                return True
            hit = check_stop_strings(req.output_text, num_new_chars, p.stop, p.include_stop_str_in_output)
            if p.stop and hit is not None:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason, keep = hit
                req.output_text = req.output_text[:keep]
                return True
        max_tokens = p.max_tokens if p.max_tokens is not None else self.config.max_model_len
        if req.num_output_tokens >= max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.block_manager.free(req)
        req.metrics.finished_time = time.monotonic()
        self.requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)
