"""OCR metrics against a generated page's ground truth.

- `cer`, `wer`: edit distance over characters / words of the whitespace-normalised reading-order text,
  divided by the reference length. Chinese has no spaces, so every CJK character counts as a word.
- `line_cer`: recognition only: each predicted line is assigned to the ground-truth line under its
  centre, so reading-order mistakes do not count (unassigned predictions count as insertions).
- `reading_order_accuracy`: of all pairs of predicted lines that belong to different ground-truth
  lines, the fraction in the ground truth's order (1.0 = perfect; Kendall-tau style).
- `indent_accuracy`: code lines whose recovered leading spaces equal the ground truth's.
- `correction_effects`: of one round's corrections, the ground-truth characters they made right
  (fixed) and those that were right before and are not after (broken).
"""

from __future__ import annotations

import re

from rapidfuzz.distance import Levenshtein

from glm5.apps.ocr.pages import Page
from glm5.apps.ocr.render import PageResult

_WORD = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]|[^\s\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]+")


def normalise(text: str) -> str:
    return " ".join(text.split())


def cer(hyp: str, ref: str) -> tuple[int, int]:
    """(character edits, reference characters) after whitespace normalisation."""
    h, r = normalise(hyp), normalise(ref)
    return Levenshtein.distance(h, r), len(r)


def wer(hyp: str, ref: str) -> tuple[int, int]:
    h, r = _WORD.findall(hyp), _WORD.findall(ref)
    return Levenshtein.distance(h, r), len(r)


def _owner(page: Page, box) -> int | None:
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    best, best_d = None, None
    for i, g in enumerate(page.lines):
        x0, y0, x1, y1 = g.box
        if x0 - 6 <= cx <= x1 + 6 and y0 - 6 <= cy <= y1 + 6:
            d = abs(cy - (y0 + y1) / 2)
            if best_d is None or d < best_d:
                best, best_d = i, d
    return best


def line_cer(res: PageResult, page: Page, after_round: int | None = None) -> tuple[int, int]:
    """Recognition errors independent of reading order (spaces ignored: line pieces join without them)."""
    pieces: dict[int, list[tuple[float, str]]] = {}
    edits = 0
    for i, ln in enumerate(res.lines):
        text = res.line_text(i, after_round).replace(" ", "")
        owner = _owner(page, ln.box)
        if owner is None:
            edits += len(text)
        else:
            pieces.setdefault(owner, []).append((ln.box[0], text))
    total = 0
    for i, g in enumerate(page.lines):
        ref = g.text.replace(" ", "")
        hyp = "".join(t for _, t in sorted(pieces.get(i, [])))
        edits += Levenshtein.distance(hyp, ref)
        total += len(ref)
    return edits, total


def _matched(hyp: str, ref: str) -> set[int]:
    """Indices of `ref` that an optimal alignment of `hyp` to it reads correctly."""
    return {j for tag, _, _, j0, j1 in Levenshtein.opcodes(hyp, ref) if tag == "equal" for j in range(j0, j1)}


def correction_effects(res: PageResult, page: Page, round_: int) -> tuple[int, int]:
    """(fixed, broken) ground-truth characters over the corrections made in `round_` (spaces ignored).

    A changed line is aligned to the ground-truth line under it before and after its round-`round_`
    changes; a character read right before and not after is broken, the opposite is fixed. A changed
    line over no ground-truth line counts its lost or gained characters as broken."""
    fixed = broken = 0
    for i in sorted({c.line for c in res.changes if c.round == round_}):
        before = res.line_text(i, round_ - 1).replace(" ", "")
        after = res.line_text(i, round_).replace(" ", "")
        owner = _owner(page, res.lines[i].box)
        if owner is None:
            broken += abs(len(after) - len(before))
            continue
        ref = page.lines[owner].text.replace(" ", "")
        was, now = _matched(before, ref), _matched(after, ref)
        fixed, broken = fixed + len(now - was), broken + len(was - now)
    return fixed, broken


def reading_order_accuracy(res: PageResult, page: Page) -> float:
    seq = [o for o in (_owner(page, res.lines[i].box) for i in res.layout.reading_order()) if o is not None]
    good = total = 0
    for a in range(len(seq)):
        for b in range(a + 1, len(seq)):
            if seq[a] != seq[b]:
                total += 1
                good += seq[a] < seq[b]
    return good / total if total else 1.0


def indent_accuracy(res: PageResult, page: Page) -> tuple[int, int]:
    """(code lines with the right indent, code lines matched) over the result's code blocks."""
    right = total = 0
    for b in res.layout.blocks:
        if b.kind != "code":
            continue
        for i, n in zip(b.lines, b.indents):
            owner = _owner(page, res.lines[i].box)
            if owner is not None and page.lines[owner].kind == "code":
                total += 1
                right += n == page.lines[owner].indent
    return right, total
