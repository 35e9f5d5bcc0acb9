"""OCR metrics that need no recogniser: what a correction round fixed and broke, and the structure
scores (headings, list items, table cells), against hand-made ground truth."""

import numpy as np
import pytest
from PIL import Image

from glm5.apps.ocr import ctc, layout
from glm5.apps.ocr.metrics import correction_effects, line_cer, structure_scores
from glm5.apps.ocr.pages import GtLine, Page
from glm5.apps.ocr.perception import Line, Reading
from glm5.apps.ocr.render import Change, PageResult


def _line(y: float, text: str, history: list[dict]) -> Line:
    quad = np.array([[10, y], [200, y], [200, y + 20], [10, y + 20]], dtype=np.float32)
    return Line(quad, Reading([ctc.Slot([(ch, 0.9)]) for ch in text]), history=history)


def _result(rows: list[tuple[str, str | None, str]]) -> tuple[PageResult, Page]:
    """rows: (ground truth, text after round 1 when round 2 changed it else None, text now)."""
    lines, gt, changes = [], [], []
    for n, (truth, before, now) in enumerate(rows):
        y = 10 + 40 * n
        hist = [{"round": 2, "text": before, "source": "raw"}] if before is not None else []
        lines.append(_line(y, now, hist))
        gt.append(GtLine(truth, (10, y, 200, y + 20), "paragraph", n))
        if before is not None:
            changes.append(Change(2, n, before, now, "lm"))
    page = Page(Image.new("RGB", (220, 40 * len(rows) + 20), "white"), gt, "single")
    return PageResult(220, 40 * len(rows) + 20, lines, layout.analyse(lines, None), changes), page


def test_fixed_and_broken_characters_of_a_round():
    res, page = _result([
        ("alpha", "a1pha", "alpha"),     # one character made right
        ("8000", "8000", "8ooo"),        # three right characters made wrong
        ("beta gamma", "beta gamme", "beta gamxe"),  # a wrong one stays wrong, a right one is broken
        ("delta", None, "delta"),        # untouched
    ])
    assert correction_effects(res, page, 2) == (1, 4)
    assert correction_effects(res, page, 1) == (0, 0)
    # consistent with the line CER: edits after round 1 minus fixed plus broken = edits after round 2
    e1, _ = line_cer(res, page, 1)
    e2, _ = line_cer(res, page, 2)
    assert (e1, e2) == (2, 5) and e1 - 1 + 4 == e2


def test_a_change_that_only_helps_breaks_nothing():
    res, page = _result([("Hello world", "He1lo wor1d", "Hello world")])
    assert correction_effects(res, page, 2) == (2, 0)


def _piece(text: str, box: tuple[float, float, float, float]) -> Line:
    x0, y0, x1, y1 = box
    quad = np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]], dtype=np.float32)
    return Line(quad, Reading([ctc.Slot([(ch, 0.9)]) for ch in text]))


def _structured_page() -> Page:
    """Heading, two list items (the first wraps), a 3 x 2 table, a paragraph."""
    gt = [GtLine("Title", (10, 10, 200, 40), "heading", 0),
          GtLine("1. first item", (10, 60, 200, 80), "list", 1), GtLine("wraps here", (30, 84, 200, 104), "list", 1),
          GtLine("2. second item", (10, 110, 200, 130), "list", 2)]
    gt += [GtLine(t, (10 + 200 * c, 150 + 30 * r, 150 + 200 * c, 170 + 30 * r), "table", 3, row=r, col=c)
           for r, row in enumerate([["Name", "Size"], ["alpha", "12"], ["beta", "7.5"]]) for c, t in enumerate(row)]
    gt.append(GtLine("closing words", (10, 260, 200, 280), "paragraph", 4))
    return Page(Image.new("RGB", (420, 300), "white"), gt, "single")


def _predicted(page: Page, texts: dict[int, str], blocks: list[tuple[str, list]]) -> PageResult:
    """One predicted piece per ground-truth line (text overridden by `texts`), grouped as `blocks`:
    (kind, line indices) or ("table", rows of cells of line indices)."""
    lines = [_piece(texts.get(i, g.text), g.box) for i, g in enumerate(page.lines)]
    out = []
    for kind, spec in blocks:
        if kind == "table":
            out.append(layout.Block("table", [i for row in spec for cell in row for i in cell], rows=spec))
        else:
            out.append(layout.Block(kind, spec, joins_previous=[False] * len(spec)))
    return PageResult(420, 300, lines, layout.PageLayout(0.0, out, 1))


def test_page_blocks_give_the_table_grid_and_reject_mixed_kinds():
    page = _structured_page()
    blocks = page.blocks()
    assert [(b.kind, b.lines) for b in blocks] == [("heading", [0]), ("list", [1, 2]), ("list", [3]),
                                                    ("table", [4, 5, 6, 7, 8, 9]), ("paragraph", [10])]
    assert blocks[3].cells == [["Name", "Size"], ["alpha", "12"], ["beta", "7.5"]]
    page.lines[10].block = 3
    with pytest.raises(ValueError, match="mixes table and paragraph"):
        page.blocks()


def test_structure_scores_of_a_perfect_reading():
    page = _structured_page()
    res = _predicted(page, {}, [("heading", [0]), ("list", [1, 2, 3]),
                                ("table", [[[4], [5]], [[6], [7]], [[8], [9]]]), ("paragraph", [10])])
    s = structure_scores(res, page)
    assert (s.heading_hits, s.heading_predicted, s.heading_true) == (1, 1, 1)
    assert (s.list_hits, s.list_predicted, s.list_true) == (2, 2, 2)  # "wraps here" starts no item
    assert (s.tables_found, s.tables_shape, s.tables_predicted, s.tables_true) == (1, 1, 1, 1)
    assert (s.cells_right, s.cells_true) == (6, 6)


def test_structure_scores_count_what_went_wrong():
    page = _structured_page()
    # the heading read as a paragraph, the paragraph as a heading; the items as one paragraph;
    # the table's first row missing (its lines left as a paragraph) and one cell misread
    res = _predicted(page, {7: "1Z", 9: "7.6"},
                     [("paragraph", [0]), ("paragraph", [1, 2, 3]), ("paragraph", [4, 5]),
                      ("table", [[[6], [7]], [[8], [9]]]), ("heading", [10])])
    s = structure_scores(res, page)
    assert (s.heading_hits, s.heading_predicted, s.heading_true) == (0, 1, 1)
    assert (s.list_hits, s.list_predicted, s.list_true) == (0, 0, 2)
    assert (s.tables_found, s.tables_shape) == (1, 0)
    # the grid is shifted up a row: no cell's text sits at its ground-truth (row, column)
    assert (s.cells_right, s.cells_true) == (0, 6)
    ok = _predicted(page, {9: "7.6"}, [("table", [[[4], [5]], [[6], [7]], [[8], [9]]])])
    assert structure_scores(ok, page).cells_right == 5  # 1 edit over 3 characters is more than 0.2
    long = _structured_page()
    long.lines[9].text = "7.5 units"
    ok = _predicted(long, {9: "7.5 unit"}, [("table", [[[4], [5]], [[6], [7]], [[8], [9]]])])
    assert structure_scores(ok, long).cells_right == 6  # 1 edit over 9 characters is within 0.2


def test_a_table_nowhere_in_the_result_reads_no_cell():
    page = _structured_page()
    s = structure_scores(_predicted(page, {}, [("paragraph", list(range(11)))]), page)
    assert (s.tables_found, s.tables_predicted, s.cells_right, s.cells_true) == (0, 0, 0, 6)
