"""The evaluation pages and metrics: the generator is deterministic, its ground truth matches what
a reference OCR library reads on clean pages, and the agent keeps layout on them (slow: real OCR on
full pages)."""

import numpy as np
import pytest

from glm5.apps.ocr.pages import LAYOUTS, TextPool, degrade, layout_fonts, render_page

DOCS = [{"lang": "en", "text": " ".join(f"Sentence number {k} talks about the quick brown fox." for k in range(4))
         + f"\n\nSecond paragraph {j} with more words to wrap around the page width nicely."} for j in range(30)]
DOCS += [{"lang": "code", "text": "\n".join(["def f(x):", "    if x:", "        return g(x)", "    return None", ""] * 6)}]
DOCS += [{"lang": "zh", "text": "床前明月光，疑是地上霜。举头望明月，低头思故乡。这是一个用于测试的中文段落。"} for _ in range(5)]


def test_pages_are_reproducible_and_degradations_move_boxes():
    pool = TextPool.from_documents(DOCS)
    a, b = render_page("two_column", pool, 3), render_page("two_column", pool, 3)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)) and a.text() == b.text()
    assert render_page("two_column", pool, 4).text() != a.text()
    r1, r2 = degrade(a, "rotate", 3), degrade(a, "rotate", 3)
    assert np.array_equal(np.asarray(r1.image), np.asarray(r2.image))
    assert r1.lines[5].box != a.lines[5].box and r1.text() == a.text()
    code = render_page("code", pool, 0)
    assert {ln.indent for ln in code.lines if ln.kind == "code"} == {0, 4, 8}


def test_unruled_table_page_has_a_grid_set_out_with_space_only():
    pool = TextPool.from_documents(DOCS)
    for seed in range(4):
        page = render_page("table_unruled", pool, seed)
        tables = [b for b in page.blocks() if b.kind == "table"]
        assert len(tables) == 1 and [b.kind for b in page.blocks()][:2] == ["heading", "paragraph"]
        grid = tables[0].cells
        assert 5 <= len(grid) <= 8 and 3 <= len(grid[0]) <= 4 and all(all(row) for row in grid)
        cells = [page.lines[i] for i in tables[0].lines]
        for col in range(len(grid[0])):  # every column starts at one x (ink boxes: side bearings differ)
            lefts = [c.box[0] for c in cells if c.col == col]
            assert max(lefts) - min(lefts) <= 3
        ink = np.asarray(page.image.convert("L")) < 128
        edges = [np.diff(np.r_[0, row.astype(np.int8), 0]) for row in ink]
        longest = max((np.flatnonzero(e == -1) - np.flatnonzero(e == 1)).max(initial=0) for e in edges)
        assert longest < 60  # no rule: no dark run along a pixel row longer than a few letters


# CER after round 1 on each layout's clean seed-0 page, measured 0.49 / 3.61 / 0.19 / 1.24 / 4.23 %
# (single / two_column / table / code / mixed; the same to the character with 1 or all onnxruntime
# threads and at load averages 2-15), limits = measured + max(1 point, 30%), rounded up to 0.5 points.
# The code page read 6.31% while the detector dropped its docstring line (RapidOCR's box threshold 0.5):
# this test caught that.
# table_unruled: 1.64% measured (33 / 2013, with unruled-table detection: the cells read row-major) -> 3%.
CER_LIMITS = {"single": 0.015, "two_column": 0.05, "table": 0.015, "code": 0.025, "mixed": 0.06,
              "table_unruled": 0.03}


@pytest.mark.slow
def test_agent_on_generated_pages():
    pytest.importorskip("rapidocr_onnxruntime")
    from glm5.apps.ocr import metrics as M
    from glm5.apps.ocr.agent import OcrAgent, OcrConfig
    from glm5.apps.ocr.pages import bundled_pool
    pool = bundled_pool()
    agent = OcrAgent(OcrConfig(rounds=1))
    for layout in LAYOUTS:
        if layout_fonts(layout) is None:
            continue  # no CJK font: the mixed page is skipped, as the benchmark does
        page = render_page(layout, pool, 0)
        res = agent.read(np.asarray(page.image))
        edits, n = M.cer(res.reading_text(), page.text())
        assert edits / n < CER_LIMITS[layout], (layout, edits, n, res.reading_text())
        assert M.reading_order_accuracy(res, page) > 0.97, layout
        if layout in ("table", "table_unruled"):
            tables = [b for b in res.layout.blocks if b.kind == "table"]
            assert [b.ruled for b in tables] == [layout == "table"], layout
            s = M.structure_scores(res, page)
            assert s.tables_shape == 1 and s.cells_right >= 0.9 * s.cells_true, (layout, s)
        if layout == "code":
            right, total = M.indent_accuracy(res, page)
            assert total and right / total > 0.7
