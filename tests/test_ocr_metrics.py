"""OCR metrics that need no recogniser: what a correction round fixed and broke, against the ground truth."""

import numpy as np
from PIL import Image

from glm5.apps.ocr import ctc, layout
from glm5.apps.ocr.metrics import correction_effects, line_cer
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
