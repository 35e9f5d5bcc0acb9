"""CTC decoding that keeps the recogniser's doubts: a confusion network ("sausage") per text line.

The recogniser emits class probabilities per frame, `probs [T, C]` with class 0 = CTC blank. Greedy
decoding keeps the best class per frame and merges repeats; here each emitted character also keeps
its rivals, and blank stretches where some character nearly won become optional insertions. The
result is a list of `Slot`s; the first option of every slot spells the greedy reading, and the
correction rounds search the other options.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A blank stretch becomes an optional insertion when a character reached this probability inside it.
INSERT_MIN_PROB = 0.3
# Rivals kept per emitted character (the deletion option comes on top).
NUM_RIVALS = 4


@dataclass
class Slot:
    """Options for one position, best first: (text, probability); text "" means "nothing here"."""

    options: list[tuple[str, float]]

    @property
    def best(self) -> str:
        return self.options[0][0]

    @property
    def conf(self) -> float:
        return self.options[0][1]


def decode(probs: np.ndarray, charset: list[str], num_frames: int | None = None) -> list[Slot]:
    """probs [T, C] (softmax outputs, blank = 0) -> slots; frames past `num_frames` are padding."""
    probs = probs[: num_frames or len(probs)]
    best = probs.argmax(axis=1)  # [T]
    slots: list[Slot] = []
    t, T = 0, len(best)
    while t < T:
        cls = int(best[t])
        end = t
        while end + 1 < T and best[end + 1] == cls:
            end += 1
        span = probs[t:end + 1]  # [run, C]
        if cls == 0:
            slot = _insertion(span, charset)
        else:
            slot = _character(span, cls, charset)
        if slot is not None:
            slots.append(slot)
        t = end + 1
    return slots


def _character(span: np.ndarray, cls: int, charset: list[str]) -> Slot:
    peak = span.max(axis=0)  # [C] best evidence of each class inside the run
    conf = float(peak[cls])
    peak[0] = 0.0
    peak[cls] = 0.0
    rivals = np.argsort(-peak)[:NUM_RIVALS]
    options = [(charset[cls], conf)] + [(charset[r], float(peak[r])) for r in rivals if peak[r] > 1e-3]
    options.append(("", max(1e-6, 1.0 - conf)))
    return Slot(options)


def _insertion(span: np.ndarray, charset: list[str]) -> Slot | None:
    peak = span[:, 1:].max(axis=0)  # [C-1]
    cls = int(peak.argmax())
    prob = float(peak[cls])
    if prob < INSERT_MIN_PROB:
        return None
    return Slot([("", 1.0 - prob), (charset[cls + 1], prob)])


def text_of(slots: list[Slot]) -> str:
    return "".join(s.best for s in slots)


def char_confs(slots: list[Slot]) -> list[float]:
    """Confidence of every character of the reading (insertion slots spell nothing)."""
    return [s.conf for s in slots if s.best]


def line_conf(slots: list[Slot]) -> float:
    """Mean character confidence (what PaddleOCR reports as the line score); 0 for an empty line."""
    confs = char_confs(slots)
    return float(np.mean(confs)) if confs else 0.0
