"""What the engine hands back: `RequestOutput` with one `CompletionOutput` per sample (vLLM shapes).

`text` and `token_ids` are cumulative (the whole completion so far), as in vLLM's default output kind.
Logprobs per position are `{token_id: Logprob}` dicts holding the sampled token and the top-N
(computed from the raw model logits). No tensors here, so outputs pickle and JSON-encode cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Engine-side monotonic timestamps (seconds), as vLLM's QUEUED/SCHEDULED/FIRST_TOKEN events."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    model_version: int | str | None = None
    error: str | None = None  # set (with finished=True) when the engine aborted this request on a failure
