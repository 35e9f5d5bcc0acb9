"""Fault isolation for one engine step: a failure one request causes ends that request only.

When the batched forward + sampling of a step raises, the step is run again one scheduled request at
a time: the requests that fail alone are the culprits (the engine aborts them and reports the error in
their `RequestOutput.error`), the others get their tokens as if nothing happened. Re-running is safe
because a step only writes KV slots the scheduler gave it (the same values again) and the scheduler
state advances in `update()`, after the runner.

Not isolated, because no request is to blame: device errors (`torch.AcceleratorError`, e.g. a CUDA
illegal access poisons the context), `MemoryError`/`SystemError`, and a streak of failures with no
success in between (`FaultTracker`); those raise `EngineFault`, and the server stops its engine.
"""

from __future__ import annotations

from typing import Callable

import torch

from .runner import RunnerOutput
from .scheduler import ScheduleOutput

FATAL_ERRORS: tuple[type[BaseException], ...] = (torch.AcceleratorError, MemoryError, SystemError)
MAX_CONSECUTIVE_FAILURES = 3  # failed requests in a row, none succeeding: the engine, not the requests


class NonFiniteOutput(ArithmeticError):
    """A request's own logits held NaN or inf (an overflowing adapter, a prompt that overflows the model):
    the request is aborted with this error, the rest of its batch carries on."""


class EngineFault(RuntimeError):
    """A failure that cannot be attributed to one request; the engine must not keep running."""


def is_fatal(e: BaseException) -> bool:
    return isinstance(e, FATAL_ERRORS) or not isinstance(e, Exception)


def run_each(run: Callable[[ScheduleOutput], RunnerOutput], out: ScheduleOutput
             ) -> tuple[RunnerOutput, dict[str, Exception]]:
    """Run every scheduled request of `out` alone -> (their merged outputs, request id -> its error).
    A fatal error propagates."""
    merged, failed = RunnerOutput(), {}
    for s in out.scheduled:
        try:
            result = run(ScheduleOutput([s]))
        except Exception as e:  # noqa: BLE001 - attributed to this request below
            if is_fatal(e):
                raise
            failed[s.request_id] = e
            continue
        for name in ("sampled", "logprobs", "prompt_logprobs", "draft_token_ids", "nonfinite"):
            getattr(merged, name).update(getattr(result, name))
    return merged, failed


class FaultTracker:
    """Counts failed requests since the last request that ran fine; too many in a row is an engine
    fault (a broken device or a bug every request hits), not a run of bad requests."""

    def __init__(self, limit: int = MAX_CONSECUTIVE_FAILURES):
        self.limit, self.streak = limit, 0

    def record(self, num_ok: int, errors: list[Exception]) -> None:
        """After a step: `num_ok` requests ran fine, `errors` are this step's request failures."""
        self.streak = len(errors) if num_ok else self.streak + len(errors)
        if errors and self.streak >= self.limit:
            last = errors[-1]
            raise EngineFault(f"{self.streak} requests failed in a row with none succeeding (last: "
                              f"{type(last).__name__}: {last}); stopping the engine") from last
