"""Confusion-network decoding of CTC outputs and the candidate beam of the language-model rounds."""

import math

import numpy as np
import pytest

from glm5.apps.ocr import ctc
from glm5.apps.ocr.correct import candidates, chosen_reading

CHARSET = ["", "a", "b", "c", "o", " "]  # 0 = blank


def frames(*rows):
    """Each row: {class: prob}; the rest of the mass goes to the blank."""
    out = np.zeros((len(rows), len(CHARSET)), dtype=np.float32)
    for t, row in enumerate(rows):
        for k, p in row.items():
            out[t, k] = p
        out[t, 0] = 1.0 - sum(row.values())
    return out


def greedy_reference(probs):
    """Textbook greedy CTC: argmax per frame, merge repeats, drop blanks."""
    best = probs.argmax(1)
    out, prev = [], None
    for k in best:
        if k != prev and k != 0:
            out.append(CHARSET[k])
        prev = k
    return "".join(out)


def test_decode_spells_the_greedy_reading_and_keeps_rivals():
    probs = frames({1: 0.9}, {1: 0.8}, {}, {2: 0.55, 4: 0.4}, {3: 0.35}, {1: 0.95}, {5: 0.9}, {3: 0.99})
    slots = ctc.decode(probs, CHARSET)
    assert ctc.text_of(slots) == greedy_reference(probs) == "ab" + "a c"
    b = next(s for s in slots if s.best == "b")
    assert b.options[1] == ("o", pytest.approx(0.4))  # the rival survives
    assert b.options[-1][0] == "" and b.options[-1][1] == pytest.approx(0.45)  # deletion option
    ins = [s for s in slots if s.best == ""]  # the blank frame with c at 0.35 -> optional insertion
    assert len(ins) == 1 and ins[0].options[1] == ("c", pytest.approx(0.35))
    assert ctc.char_confs(slots) == pytest.approx([0.9, 0.55, 0.95, 0.9, 0.99])
    assert ctc.line_conf(slots) == pytest.approx(np.mean([0.9, 0.55, 0.95, 0.9, 0.99]))


def test_decode_ignores_padding_frames():
    probs = frames({1: 0.9}, {2: 0.9}, {3: 0.9})
    assert ctc.text_of(ctc.decode(probs, CHARSET, num_frames=2)) == "ab"


def test_candidates_only_touch_doubtful_slots_and_keep_greedy_first():
    probs = frames({1: 0.99}, {}, {2: 0.5, 4: 0.45}, {}, {3: 0.99})
    slots = ctc.decode(probs, CHARSET)
    cands = candidates(slots, threshold=0.9, max_candidates=8)
    texts = [c.text(slots) for c in cands]
    assert texts[0] == "abc" and set(texts) == {"abc", "aoc", "ac"}
    by_text = dict(zip(texts, cands))
    assert by_text["aoc"].rec_logprob - by_text["abc"].rec_logprob == pytest.approx(math.log(0.45 / 0.5))
    assert chosen_reading(slots, by_text["aoc"].choice).text == "aoc"


def test_candidates_respect_max_edits_and_budget():
    slots = [ctc.Slot([("x", 0.5), ("y", 0.4), ("", 0.5)]) for _ in range(6)]
    cands = candidates(slots, 0.9, max_candidates=5, max_edits=1)
    assert len(cands) == 5 and cands[0].text(slots) == "xxxxxx"
    assert all(c.edits <= 1 for c in cands)
