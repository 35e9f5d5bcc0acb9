"""Limits on one OCR request: a work budget checked before the expensive stages, and a deadline.

Where the time goes (docs/ocr.md, measured on a 2-core CPU): decoding, detection and layout grow with
the page's pixels but stay bounded (detection sees at most 2000 px a side: a blank 6000 x 6000 page took
4.3-10.2 s in all; a 36 Mpx page of text was refused after 8.4 s), while the recogniser's cost grows
with the *text*: every line crop is scaled to 48 px high, so a line costs 48 x its scaled width whatever
the scan's resolution, and round 1 feeds three re-processed crops of every doubtful line again. The budget therefore counts recogniser
pixels, estimated from the detected line boxes before any line is recognised: `WorkEstimate`.

The deadline is cooperative: a `Deadline` object is passed down the stages, which call `check` between
steps (batches of lines, round-1 chunks, language-model lines) and stop with `OcrTimeout`, so the worker
thread ends soon after the limit instead of finishing a page nobody waits for.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from glm5.apps.ocr.perception import MAX_RATIO, MIN_BATCH_WIDTH, REC_HEIGHT

MAX_WORK_MPX = 32.0
"""Default recogniser budget: one to three minutes of recognition on the 2-core CPU of docs/ocr.md
(0.18-0.57 Mpx/s by load, bench/ocr_limits.py); the evaluation pages (960 x 1034-1211, 26-71 lines)
estimate 3.1-8.0 Mpx at rounds=1."""

ROUND1_VARIANTS = 3  # crops per doubtful line in round 1 (correct.crop_variants)
ROUND1_PAD = 0.12  # their padding (x line height above and below, a quarter of it at the ends)


class OcrTimeout(RuntimeError):
    """The request's deadline passed; `stage` names where the work stopped."""

    def __init__(self, limit_s: float, stage: str):
        super().__init__(f"OCR stopped at the {stage} stage: the page took longer than the limit of {limit_s:g} s")
        self.limit_s, self.stage = limit_s, stage


class OcrOverBudget(RuntimeError):
    """The page's estimated work exceeds `OcrConfig.max_work_mpx` (refused before recognition starts)."""

    def __init__(self, name: str, estimate: "WorkEstimate", rounds: int, limit_mpx: float):
        need = estimate.total(rounds)
        hint = (f"; with rounds=0 it needs {estimate.total(0):.1f}" if rounds >= 1 and estimate.total(0) <= limit_mpx
                else "")
        super().__init__(
            f"{name}: reading this page needs an estimated {need:.1f} Mpx of line recognition ({estimate.lines} "
            f"lines, rounds={rounds}), more than the limit max_work_mpx={limit_mpx:g}{hint}. Ask for fewer rounds, "
            "or split the page into parts and send them one at a time")
        self.estimate, self.rounds, self.limit_mpx = estimate, rounds, limit_mpx


@dataclass(frozen=True)
class WorkEstimate:
    """Recogniser pixels (millions) a page will cost, from its detected line quads.

    `round0` is exact up to batch padding (each crop's scaled width, at least the 320-px batch minimum);
    `round1` is an upper bound: it assumes every line is doubtful (three padded crops each)."""

    lines: int
    round0: float
    round1: float

    @classmethod
    def of(cls, quads: list[np.ndarray]) -> "WorkEstimate":
        r0 = r1 = 0.0
        for q in quads:
            w = float(max(np.linalg.norm(q[0] - q[1]), np.linalg.norm(q[2] - q[3])))
            h = float(max(np.linalg.norm(q[0] - q[3]), np.linalg.norm(q[1] - q[2])))
            r0 += rec_pixels(w, h)
            r1 += ROUND1_VARIANTS * rec_pixels(w + 0.5 * ROUND1_PAD * h, h * (1 + 2 * ROUND1_PAD))
        return cls(len(quads), r0 / 1e6, r1 / 1e6)

    def total(self, rounds: int) -> float:
        """Mpx for rounds 0..`rounds` (the language-model rounds run no recogniser)."""
        return self.round0 + (self.round1 if rounds >= 1 else 0.0)


def rec_pixels(width: float, height: float) -> float:
    """Recogniser input pixels of one crop: 48 px high, the width scaled alike (capped like the recogniser)."""
    scaled = min(REC_HEIGHT * MAX_RATIO, max(8, math.ceil(REC_HEIGHT * width / max(1.0, height))))
    return float(REC_HEIGHT * max(MIN_BATCH_WIDTH, scaled))


@dataclass
class Deadline:
    """Wall-clock limit for one request, started when the request arrives (`clock`: seconds, monotonic)."""

    limit_s: float
    clock: Callable[[], float] = time.monotonic
    start: float = field(default=-1.0)

    def __post_init__(self):
        if not self.limit_s > 0:
            raise ValueError(f"timeout_s: must be > 0 seconds, got {self.limit_s}")
        if self.start < 0:
            self.start = self.clock()

    @classmethod
    def after(cls, limit_s: float | None, clock: Callable[[], float] = time.monotonic) -> "Deadline | None":
        """A deadline `limit_s` from now on `clock`; None (no limit) for None."""
        return None if limit_s is None else cls(limit_s, clock)

    def remaining(self) -> float:
        return self.limit_s - (self.clock() - self.start)

    def check(self, stage: str) -> None:
        """Raise `OcrTimeout` once the limit has passed."""
        if self.remaining() <= 0:
            raise OcrTimeout(self.limit_s, stage)


def check(deadline: Deadline | None, stage: str) -> None:
    """`deadline.check(stage)` where there is a deadline."""
    if deadline is not None:
        deadline.check(stage)
