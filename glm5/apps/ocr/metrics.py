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
- `structure_scores`: is the page's structure found (headings, list items, tables and their cells)?
  Counts, so that pages add up; see `StructureScores` for the definitions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rapidfuzz.distance import Levenshtein

from glm5.apps.ocr.layout import LIST_MARKER
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


CELL_MAX_CER = 0.2
"""A table cell counts as read right when its edit distance to the ground truth (whitespace
normalised) is at most this fraction of the ground-truth cell's length."""


@dataclass
class StructureScores:
    """Structure found on one page, as counts (sum them over pages, then divide).

    Predicted lines are assigned to the ground-truth line under their centre (as `line_cer` does).

    - headings: `heading_hits` = ground-truth heading lines that some line of a predicted heading
      block is assigned to; `heading_predicted` = distinct ground-truth lines (a line over none
      counts on its own) that lines of predicted heading blocks are assigned to; `heading_true` =
      ground-truth heading lines. Precision = hits / predicted, recall = hits / true.
    - list items: an item starts at a predicted list block's first row and at every later row that
      begins with a list marker (the rows Markdown renders as items); `list_hits` = ground-truth
      items (list blocks) whose first line some item start is assigned to; `list_predicted` = item
      starts; `list_true` = ground-truth items.
    - tables: each ground-truth table is matched with the predicted table block that holds the
      most lines assigned to its cells; `tables_found` counts those matched, `tables_shape` those
      whose grid has the ground truth's number of rows and of columns, `tables_predicted` the
      predicted table blocks; `cells_right` = ground-truth cells (non-empty) whose text equals the
      text at the same (row, column) of the matched grid within CELL_MAX_CER, out of `cells_true`.
      A missing table reads all its cells wrong; a shifted row or column reads its cells wrong.
    """

    heading_hits: int = 0
    heading_predicted: int = 0
    heading_true: int = 0
    list_hits: int = 0
    list_predicted: int = 0
    list_true: int = 0
    tables_found: int = 0
    tables_shape: int = 0
    tables_predicted: int = 0
    tables_true: int = 0
    cells_right: int = 0
    cells_true: int = 0


def structure_scores(res: PageResult, page: Page) -> StructureScores:
    """The page's `StructureScores` (the result's final texts)."""
    gt_blocks = page.blocks()
    owner = {i: _owner(page, ln.box) for i, ln in enumerate(res.lines)}
    out = StructureScores()

    gt_heads = {i for b in gt_blocks if b.kind == "heading" for i in b.lines}
    pred_heads = [owner[i] for b in res.layout.blocks if b.kind == "heading" for i in b.lines]
    out.heading_true = len(gt_heads)
    out.heading_hits = len(gt_heads & set(pred_heads))
    out.heading_predicted = len({o for o in pred_heads if o is not None}) + sum(o is None for o in pred_heads)

    gt_items = {b.lines[0] for b in gt_blocks if b.kind == "list"}
    starts = []
    for b in res.layout.blocks:
        if b.kind == "list":
            for n, row in enumerate(b.visual_rows()):
                if n == 0 or LIST_MARKER.match(res.line_text(row[0])):
                    starts.append(owner[row[0]])
    out.list_true, out.list_predicted = len(gt_items), len(starts)
    out.list_hits = len(gt_items & set(starts))

    pred_tables = [b for b in res.layout.blocks if b.kind == "table"]
    out.tables_predicted = len(pred_tables)
    for gt in (b for b in gt_blocks if b.kind == "table"):
        out.tables_true += 1
        cells = [(r, c, t) for r, row in enumerate(gt.cells) for c, t in enumerate(row) if t]
        out.cells_true += len(cells)
        members = set(gt.lines)
        best = max(pred_tables, key=lambda b: sum(owner[i] in members for i in b.lines), default=None)
        if best is None or not any(owner[i] in members for i in best.lines):
            continue
        out.tables_found += 1
        grid = [[" ".join(res.line_text(i) for i in cell) for cell in row] for row in best.rows]
        width = max((len(row) for row in grid), default=0)
        out.tables_shape += len(grid) == len(gt.cells) and width == max(len(row) for row in gt.cells)
        for r, c, ref in cells:
            hyp = grid[r][c] if r < len(grid) and c < len(grid[r]) else ""
            edits, n = cer(hyp, ref)
            out.cells_right += edits <= CELL_MAX_CER * n
    return out
