"""The OCR agent: image -> perception -> correction rounds -> layout -> `PageResult`.

    agent = OcrAgent(OcrConfig(rounds=2, model="runs/ocr-lm/final"))
    result = agent.read_bytes(open("page.png", "rb").read(), "page.png")
    print(to_markdown(result))

Round 0 is the recogniser's greedy reading. Round 1 re-recognises doubtful lines from re-processed
crops. Rounds 2..N ask the language model (`OcrConfig.model`, a glm5 checkpoint with its tokenizer)
about the lines that are still doubtful; they stop early when no line changed or every doubtful
line is settled. Without a model, rounds past 1 are skipped (and the summary says so). Every text
change is a `Change` (round, line, before, after, why) in the result.

Limits (glm5/apps/ocr/limits.py): after detection, before any line is recognised, the page's estimated
recogniser work is checked against `OcrConfig.max_work_mpx` (`OcrOverBudget`); a `Deadline` passed to
`read` / `read_bytes` is checked between stages, batches and lines (`OcrTimeout`), also while waiting
for the page before. Pages of `trim_memory_px` pixels or more hand freed heap pages back to the OS.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from glm5.apps.ocr import correct, layout
from glm5.apps.ocr.image import MAX_PIXELS, load_image
from glm5.apps.ocr.limits import MAX_WORK_MPX, Deadline, OcrOverBudget, OcrTimeout, WorkEstimate, check
from glm5.apps.ocr.perception import Perception
from glm5.apps.ocr.render import PageResult
from glm5.infer.malloc import trim_malloc

@dataclass(kw_only=True)
class OcrConfig:
    rounds: int = 2
    """0 = recogniser only, 1 = + re-recognition of doubtful lines, N >= 2 = + up to N-1 language-model rounds."""
    threshold: float = 0.9
    """A line is doubtful while any of its characters (or optional insertions) is under this confidence."""
    model: str | None = None
    """glm5 checkpoint directory (with tokenizer.json) for the language-model rounds; None skips them."""
    lm_weight: float = 0.25
    """Weight of the language model's log-probability against the recogniser's (defaults of the
    language-model fields: tuned on seed-1 pages, docs/ocr.md)."""
    lm_threshold: float = 0.9
    """Language-model rounds change only characters under this confidence (lines with none are skipped)."""
    lm_margin: float = 0.0
    """Nats by which a candidate's score must beat the recogniser's reading before it replaces it."""
    max_candidates: int = 8
    """Candidate readings scored per doubtful line."""
    max_edits: int = 3
    """Most characters a language-model round may change in one line."""
    lm_alternatives: bool = False
    """Language-model rounds also take candidates from round 1's other readings of a line."""
    lm_same_length: bool = True
    """Language-model rounds only substitute characters (never drop or add one)."""
    lm_unsupported: bool = False
    """Language-model rounds may change a character that no other round-1 reading of the line (another
    crop) supports, under the three guards below. Off: every change needs that visual support (docs/ocr.md,
    "No correction breaks a right character")."""
    lm_protect_conf: float = 0.9
    """With `lm_unsupported`: language-model rounds change a character read at this confidence or more only
    when another round-1 reading of the line reads the new character there (1.0: no protection; 0.9, the default,
    guards the characters `lm_threshold` already leaves alone if that is raised). The defaults of these
    three were chosen on seed-1 and seed-2 pages (docs/ocr.md)."""
    lm_min_rival: float = 0.1
    """With `lm_unsupported`: an unsupported language-model change needs the new character at >= this
    fraction of the read character's recogniser probability."""
    lm_min_gain: float = 8.0
    """With `lm_unsupported`: nats per unsupported changed character by which the language model alone must
    prefer a correction."""
    num_threads: int = 0
    """onnxruntime threads (0 = its default)."""
    max_pixels: int = MAX_PIXELS
    """Larger images are refused (decompression-bomb guard)."""
    max_work_mpx: float | None = MAX_WORK_MPX
    """Most recogniser work (millions of 48-px-high crop pixels, rounds 0-1, estimated after detection)
    one page may take; over it `OcrOverBudget` before recognition starts. None = no limit."""
    timeout_s: float | None = None
    """Wall-clock limit for one page (`deadline()`); None = none. `glm5 serve` sets one."""
    trim_memory_px: int | None = 4_000_000
    """After a page of at least this many pixels, return freed heap memory to the OS (`trim_malloc`);
    None = never."""

    def __post_init__(self):
        if self.rounds < 0:
            raise ValueError("rounds: must be >= 0")
        if self.max_work_mpx is not None and not self.max_work_mpx > 0:
            raise ValueError(f"max_work_mpx: must be > 0 (or None for no limit), got {self.max_work_mpx}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0 seconds (or None for no limit), got {self.timeout_s}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError("threshold: must be in (0, 1]")
        self.lm_rule  # validates the language-model fields

    @property
    def lm_rule(self) -> correct.LmRule:
        return correct.LmRule(lm_weight=self.lm_weight, threshold=self.lm_threshold, min_margin=self.lm_margin,
                              max_candidates=self.max_candidates, max_edits=self.max_edits,
                              alternatives=self.lm_alternatives, same_length=self.lm_same_length,
                              unsupported=self.lm_unsupported, protect_conf=self.lm_protect_conf,
                              min_rival=self.lm_min_rival, min_lm_gain=self.lm_min_gain)


class OcrAgent:
    """Reads pages. Thread-safe: one page at a time (the stages are CPU-bound and already threaded)."""

    def __init__(self, config: OcrConfig | None = None, perception: Perception | None = None, scorer=None):
        self.config = config or OcrConfig()
        self.perception = perception or Perception(self.config.num_threads)
        if scorer is None and self.config.model and self.config.rounds >= 2:
            from glm5.apps.ocr.lm import LMScorer  # noqa: PLC0415 - loads torch models only when needed
            scorer = LMScorer.from_pretrained(self.config.model)
        self.scorer = scorer
        self._lock = threading.Lock()

    clock = staticmethod(time.monotonic)
    """What deadlines are measured on (seconds, monotonic); the tests set a fake one."""

    def deadline(self) -> Deadline | None:
        """A deadline of `timeout_s` from now (None without a limit): make it when the request arrives."""
        return Deadline.after(self.config.timeout_s, self.clock)

    def read_bytes(self, data: bytes, name: str = "image", rounds: int | None = None,
                   deadline: Deadline | None = None) -> PageResult:
        """Encoded image -> result; `ImageError` for anything that is not a readable image,
        `OcrOverBudget` / `OcrTimeout` past the limits."""
        rgb = load_image(data, name, self.config.max_pixels)
        pixels = rgb.shape[0] * rgb.shape[1]
        try:
            return self.read(rgb, name, rounds, deadline)
        finally:
            del rgb  # the page and its copies are garbage now: let the trim below return their pages
            if self.config.trim_memory_px is not None and pixels >= self.config.trim_memory_px:
                trim_malloc()

    def read(self, rgb: np.ndarray, name: str = "image", rounds: int | None = None,
             deadline: Deadline | None = None) -> PageResult:
        """[H, W, 3] uint8 RGB page -> result (`rounds` overrides the configured number)."""
        rounds = self.config.rounds if rounds is None else rounds
        # one page at a time: a request that cannot start before its deadline gives up waiting
        if deadline is None:
            self._lock.acquire()
        elif not self._lock.acquire(timeout=min(threading.TIMEOUT_MAX, max(0.0, deadline.remaining()))):
            raise OcrTimeout(deadline.limit_s, "queue (waiting for the page before)")
        try:
            return self._read(rgb, name, rounds, deadline)
        finally:
            self._lock.release()

    def _read(self, rgb: np.ndarray, name: str, rounds: int, deadline: Deadline | None) -> PageResult:
        cfg = self.config
        check(deadline, "decoding")
        bgr = np.ascontiguousarray(rgb[:, :, ::-1])
        quads = self.perception.detector(bgr)
        check(deadline, "detection")
        estimate = WorkEstimate.of(quads)
        if cfg.max_work_mpx is not None and estimate.total(rounds) > cfg.max_work_mpx:
            raise OcrOverBudget(name, estimate, rounds, cfg.max_work_mpx)
        lines = self.perception.recognise(bgr, quads, deadline)
        summaries = [{"round": 0, "kind": "recognition", "lines": len(lines),
                      "doubtful_after": sum(correct.doubtful(ln, cfg.threshold) for ln in lines)}]
        changes = []
        if rounds >= 1:
            found, summary = correct.rerecognise(lines, bgr, self.perception.recognizer, cfg.threshold,
                                                 deadline=deadline)
            changes += found
            summaries.append(summary)
        check(deadline, "layout")
        res = PageResult(rgb.shape[1], rgb.shape[0], lines, layout.analyse(lines, bgr), changes, summaries, name)
        if rounds >= 2 and self.scorer is None:
            res.rounds.append({"round": 2, "kind": "language-model", "skipped": "no correction model configured"})
        elif rounds >= 2:
            self.lm_rounds(res, bgr, rounds, self.config.lm_rule, deadline=deadline)
        return res

    def lm_rounds(self, res: PageResult, bgr: np.ndarray | None, rounds: int, rule: correct.LmRule,
                  scorer=None, deadline: Deadline | None = None, trace: list | None = None) -> bool:
        """Language-model rounds 2..rounds on a page read through round 1, in place (`scorer`
        defaults to the agent's); True when some line changed (the layout is then analysed again).
        `trace` (a list) collects every scored line's candidates (`correct.lm_correct`)."""
        scorer = scorer or self.scorer
        order = res.layout.reading_order()
        block_of = {i: n for n, b in enumerate(res.layout.blocks) for i in b.lines}
        code = {i for b in res.layout.blocks if b.kind == "code" for i in b.lines}
        settled: set[int] = set()
        for round_no in range(2, rounds + 1):
            changes, summary = correct.lm_correct(res.lines, order, block_of, scorer, rule, settled, round_no, code,
                                                 deadline, trace)
            res.changes += changes
            res.rounds.append(summary)
            if not changes:
                break
        changed = any(c.round >= 2 for c in res.changes)
        if changed:
            res.layout = layout.analyse(res.lines, bgr)  # corrected texts may change list/code typing
        return changed
