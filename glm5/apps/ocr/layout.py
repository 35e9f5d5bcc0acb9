"""Layout: recognised lines -> blocks (heading, paragraph, list, code, table) in reading order.

Works on geometry only (plus the line texts for list markers and code), in a frame rotated by the
page's skew so that rotated scans lay out like straight ones:

1. skew = median slope of the long lines;
2. tables = ruled grids found in the image (morphological opening keeps long rules), their lines
   become cells by row and column; then unruled tables: runs of >= 3 consecutive rows of >= 2
   pieces each whose pieces leave the same >= 1 vertical gutters free (`find_unruled_tables`);
3. columns = vertical gutters: x-ranges that many lines flank and almost none cross; a line or table
   that crosses a gutter spans columns and splits the page into bands;
4. reading order = band by band, each band column by column (left to right), top to bottom;
5. blocks = runs of lines in one column with small vertical gaps, similar height and similar glyph
   width, then typed; a heading is a block of <= 2 rows whose lines are taller (x 1.3) or whose
   characters are wider (x 1.3) than the page's median line (`glyph_width`): the detector's boxes
   of a 30 px heading are barely taller than those of 20 px text (30 vs 26 px on the generated
   pages), its characters are half as wide again.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from glm5.apps.ocr.perception import Line

_CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")
LIST_MARKER = re.compile(r"^\s*(?:[•●▪◦‣]\s*|[·\-–*+.]\s+|[·\-–*+](?=[A-Z])|\d{1,3}[.)、](?:\s+|(?=[^\W\d_]))|[a-zA-Z][.)]\s+|"
                         r"\(\d{1,3}\)\s*|\([a-z]\)\s+)(?=\S)")
"""A list item's marker at the start of a line: a bullet glyph; `-`, `*`, `+`, `–`, `·` or `.` (how the
recogniser often reads a small bullet) followed by a space, or (all but `.`) by a capital letter (the
recogniser drops spaces); a number or letter with `.` / `)` followed by a space (a number also by a
letter), or in parentheses. `9.6.16. Title`, `-1`, `--verbose`, `*args`, `.. index::` and `e.g.` are not
markers."""
LIST_LOOSE = 1.06
"""A row whose centre lies more than this many times the page's leading (`_Scale.leading`: median
distance between the centres of a line and the next one below it) below the previous row's is set off
from it: a list starts only at such a row or at a block's first row, and a row without a marker that
is set off ends the list (measured on seed-1 `single` pages: rows of one paragraph 0.88-1.01 leadings
apart, list items 1.11-1.20, paragraphs 1.37-1.76)."""
MIN_LIST_ITEMS = 2
"""A lone line that begins like a list item (a `* ` or `1.` in running text) is read as a paragraph."""
_CODE_TOKEN = re.compile(r"(^(def|class|return|import|from|if|elif|else|for|while|try|except|finally|with|"
                         r"raise|yield|assert|pass|break|continue|lambda|async|await|@)\b)|[(){}\[\]=;:#]\s*$|"
                         r"\bself\.|==|!=|\w\(|\)\s*:|\w+\.\w+\(|^#|\"\"\"|'''")


@dataclass
class Block:
    """A run of lines read together. `rows` holds a table's cells (line indices) row by row."""

    kind: str  # heading | paragraph | list | code | table
    lines: list[int]  # indices into the page's line list, in reading order
    column: int = 0
    rows: list[list[list[int]]] = field(default_factory=list)  # table: rows -> cells -> line indices
    ruled: bool = False  # table: found from rules in the image (else from aligned columns of text)
    indents: list[int] = field(default_factory=list)  # code: leading spaces per line
    blank_before: list[int] = field(default_factory=list)  # code: empty lines before each line
    joins_previous: list[bool] = field(default_factory=list)  # line continues the previous one's row

    def visual_rows(self) -> list[list[int]]:
        """Lines grouped into rows: the detector may cut one printed line into several pieces."""
        rows: list[list[int]] = []
        for n, i in enumerate(self.lines):
            if rows and n < len(self.joins_previous) and self.joins_previous[n]:
                rows[-1].append(i)
            else:
                rows.append([i])
        return rows


@dataclass
class PageLayout:
    skew: float  # degrees
    blocks: list[Block]
    num_columns: int

    def reading_order(self) -> list[int]:
        return [i for b in self.blocks for i in b.lines]


@dataclass
class _Item:
    """A line, or a whole table, placed on the deskewed page."""

    box: tuple[float, float, float, float]
    lines: list[int]
    table: Block | None = None


def analyse(lines: list[Line], page_bgr: np.ndarray | None = None) -> PageLayout:
    """Lines (any order) -> typed blocks in reading order. `page_bgr` enables ruled-table detection."""
    keep = [i for i, ln in enumerate(lines) if ln.reading.text.strip()]
    if not keep:
        return PageLayout(0.0, [], 0)
    skew = estimate_skew([lines[i] for i in keep])
    h, w = page_bgr.shape[:2] if page_bgr is not None else (0, 0)
    boxes = {i: _upright_box(lines[i].quad, skew, (w / 2, h / 2)) for i in keep}
    items, used = [], set()
    if page_bgr is not None:
        for grid in find_tables(page_bgr, skew):
            table = _table_block(grid, boxes, used)
            if table is not None:
                used.update(table.lines)
                items.append(_Item(grid.bbox, table.lines, table))
    heights = np.array([boxes[i][3] - boxes[i][1] for i in keep])
    line_h = float(np.median(heights))
    leading = _leading(boxes, line_h)
    texts = {i: lines[i].reading.text.strip() for i in keep}
    glyphs = {i: glyph_width(boxes[i], texts[i]) for i in keep}
    known = [g for g in glyphs.values() if g is not None]
    page_glyph = float(np.median(known)) if known else 0.0
    for table in find_unruled_tables({i: boxes[i] for i in keep if i not in used}, texts, line_h):
        used.update(table.lines)
        bbox = (min(boxes[i][0] for i in table.lines), min(boxes[i][1] for i in table.lines),
                max(boxes[i][2] for i in table.lines), max(boxes[i][3] for i in table.lines))
        items.append(_Item(bbox, table.lines, table))
    items += [_Item(boxes[i], [i]) for i in keep if i not in used]
    gutters = find_gutters([it.box for it in items if it.table is None], line_h)
    blocks = []
    for column, band_items in _columns_in_bands(items, gutters):
        blocks += _blocks(band_items, boxes, lines, _Scale(line_h, glyphs, page_glyph, leading), column)
    return PageLayout(skew, blocks, len(gutters) + 1)


def _leading(boxes: dict[int, tuple], line_h: float) -> float:
    """The page's leading: median distance from a line's centre to the centre of the nearest line
    below it that overlaps it horizontally (within three line heights; 0 when there is none)."""
    cy = {i: (b[1] + b[3]) / 2 for i, b in boxes.items()}
    pitches = []
    for i, (x0, _, x1, _) in boxes.items():
        below = [cy[j] - cy[i] for j, b in boxes.items()
                 if min(x1, b[2]) - max(x0, b[0]) > 0 and 0.5 * line_h < cy[j] - cy[i] < 3 * line_h]
        if below:
            pitches.append(min(below))
    return float(np.median(pitches)) if pitches else 0.0


def estimate_skew(lines: list[Line]) -> float:
    """Median top-edge slope (degrees) of lines at least 4x as wide as tall; 0 without such lines."""
    angles = [ln.angle for ln in lines if (ln.box[2] - ln.box[0]) > 4 * max(1.0, ln.height)]
    return float(np.median(angles)) if angles else 0.0


def _rotate(points: np.ndarray, degrees: float, centre: tuple[float, float]) -> np.ndarray:
    """Rotate [N, 2] points by -degrees about centre (undo a skew of `degrees`)."""
    a = math.radians(-degrees)
    c, s = math.cos(a), math.sin(a)
    d = points - np.asarray(centre, dtype=np.float64)
    return np.stack([d[:, 0] * c - d[:, 1] * s, d[:, 0] * s + d[:, 1] * c], axis=1) + centre


def _upright_box(quad: np.ndarray, skew: float, centre) -> tuple[float, float, float, float]:
    p = _rotate(quad.astype(np.float64), skew, centre)
    return float(p[:, 0].min()), float(p[:, 1].min()), float(p[:, 0].max()), float(p[:, 1].max())


# ---------------------------------------------------------------- tables


@dataclass
class Grid:
    """A ruled table in the deskewed frame: the x of its vertical rules, the y of its horizontal ones."""

    xs: list[float]
    ys: list[float]

    @property
    def bbox(self) -> tuple[float, float, float, float]:
        return self.xs[0], self.ys[0], self.xs[-1], self.ys[-1]


def find_tables(page_bgr: np.ndarray, skew: float) -> list[Grid]:
    """Ruled grids: long thin horizontal and vertical strokes that cross each other."""
    import cv2  # noqa: PLC0415 - optional dependency

    gray = cv2.cvtColor(page_bgr, cv2.COLOR_BGR2GRAY)
    h, w = gray.shape
    if abs(skew) > 0.05:  # rules must be axis-aligned for the opening below
        m = cv2.getRotationMatrix2D((w / 2, h / 2), skew, 1.0)
        gray = cv2.warpAffine(gray, m, (w, h), flags=cv2.INTER_LINEAR, borderValue=255)
    ink = cv2.adaptiveThreshold(gray, 255, cv2.ADAPTIVE_THRESH_MEAN_C, cv2.THRESH_BINARY_INV, 25, 15)
    span = max(20, w // 12)
    horiz = cv2.morphologyEx(ink, cv2.MORPH_OPEN, cv2.getStructuringElement(cv2.MORPH_RECT, (span, 1)))
    vert = cv2.morphologyEx(ink, cv2.MORPH_OPEN, cv2.getStructuringElement(cv2.MORPH_RECT, (1, max(15, h // 40))))
    grids = []
    n, labels, stats, _ = cv2.connectedComponentsWithStats(cv2.dilate(horiz | vert, np.ones((3, 3), np.uint8)))
    for k in range(1, n):
        x, y, bw, bh, _ = stats[k]
        if bw < span or bh < 20:
            continue
        region = labels[y:y + bh, x:x + bw] == k
        ys = _rule_positions(horiz[y:y + bh, x:x + bw] * region, axis=1, min_len=0.6 * bw)
        xs = _rule_positions(vert[y:y + bh, x:x + bw] * region, axis=0, min_len=0.6 * bh)
        if len(xs) >= 2 and len(ys) >= 3:  # at least two rows between three rules
            grids.append(Grid([x + v for v in xs], [y + v for v in ys]))
    return grids


def _rule_positions(mask: np.ndarray, axis: int, min_len: float) -> list[float]:
    """Centres of runs of rows (axis=1) / columns (axis=0) holding a rule at least min_len long."""
    counts = (mask > 0).sum(axis=axis)
    hits = np.flatnonzero(counts >= min_len)
    if hits.size == 0:
        return []
    runs = np.split(hits, np.flatnonzero(np.diff(hits) > 2) + 1)
    return [float(r.mean()) for r in runs]


def _table_block(grid: Grid, boxes: dict[int, tuple], used: set[int]) -> Block | None:
    rows: list[list[list[int]]] = [[[] for _ in grid.xs[1:]] for _ in grid.ys[1:]]
    members = []
    for i, (x0, y0, x1, y1) in boxes.items():
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        if i in used or not (grid.xs[0] <= cx <= grid.xs[-1] and grid.ys[0] <= cy <= grid.ys[-1]):
            continue
        r = int(np.searchsorted(grid.ys, cy)) - 1
        c = int(np.searchsorted(grid.xs, cx)) - 1
        rows[min(max(r, 0), len(rows) - 1)][min(max(c, 0), len(rows[0]) - 1)].append(i)
        members.append(i)
    if not members:
        return None
    rows = [[sorted(cell, key=lambda i: (boxes[i][1], boxes[i][0])) for cell in row] for row in rows
            if any(row)]
    order = [i for row in rows for cell in row for i in cell]
    return Block("table", order, rows=rows, ruled=True)


MIN_TABLE_ROWS = 3
GUTTER_LINE_HEIGHTS = 0.8  # an unruled table's gutters are at least this many line heights wide
PROSE_WORDS = 4  # a column whose median cell has this many words or more is running text


def find_unruled_tables(boxes: dict[int, tuple], texts: dict[int, str], line_h: float) -> list[Block]:
    """Tables set out with space only, from the line boxes (deskewed) and their texts.

    The detector cuts a printed line at wide spaces, so a table row comes as several pieces side by
    side. Rows are pieces that overlap vertically (as `_row_major` groups them); a candidate is a run
    of consecutive rows of >= 2 pieces each, close together (gap under one line height) and of
    similar height. Its gutters are the x-ranges, at least GUTTER_LINE_HEIGHTS line heights wide,
    that no piece of the run covers, between its leftmost and rightmost ink: every piece then falls
    in one column, and aligned left edges or right edges both leave such gutters. The run is a
    table when it has >= MIN_TABLE_ROWS rows each filling >= 2 columns, and it is not
      - running text in columns (two-column prose): every column's median cell has PROSE_WORDS or
        more words, or every one of its gutters overlaps a gutter of the page's other lines
        (`find_gutters` without the run: the page's columns go on above or below it), or
      - code: half its pieces or more look like code (`_CODE_TOKEN`).
    A run that fails as a whole is retried without its first row (a title or caption line beside
    the table's first row must not hide the table), until fewer than MIN_TABLE_ROWS rows are left."""
    rows = _page_rows(boxes)
    tables: list[Block] = []
    run: list[list[int]] = []
    for row in rows + [[]]:  # the empty sentinel ends the last run
        if len(row) >= 2 and run and _row_follows(run[-1], row, boxes, line_h):
            run.append(row)
            continue
        tables += _tables_in_run(run, boxes, texts, line_h)
        run = [row] if len(row) >= 2 else []
    return tables


def _rows_of(ids, boxes, key) -> list[list[int]]:
    """Pieces `ids` taken in `key` order grouped into rows: a piece joins the last row when it overlaps one
    of its pieces vertically by more than half the smaller height; each row left to right."""
    rows: list[list[int]] = []
    for i in sorted(ids, key=key):
        row = rows[-1] if rows else None
        if row is not None and any(min(boxes[j][3], boxes[i][3]) - max(boxes[j][1], boxes[i][1]) >
                                   0.5 * min(boxes[j][3] - boxes[j][1], boxes[i][3] - boxes[i][1]) for j in row):
            row.append(i)
        else:
            rows.append([i])
    return [sorted(r, key=lambda i: boxes[i][0]) for r in rows]


def _page_rows(boxes: dict[int, tuple]) -> list[list[int]]:
    """Pieces grouped into rows top to bottom (by their vertical centres), each left to right."""
    return _rows_of(boxes, boxes, lambda i: (boxes[i][1] + boxes[i][3]) / 2)


def _row_follows(a: list[int], b: list[int], boxes, line_h: float) -> bool:
    """Row b continues a table whose last row is a: close below it, with pieces of similar height."""
    gap = min(boxes[i][1] for i in b) - max(boxes[i][3] for i in a)
    ha = float(np.median([boxes[i][3] - boxes[i][1] for i in a]))
    hb = float(np.median([boxes[i][3] - boxes[i][1] for i in b]))
    return gap < max(line_h, ha, hb) and abs(ha - hb) <= 0.3 * max(ha, hb)


def _tables_in_run(run: list[list[int]], boxes, texts: dict[int, str], line_h: float) -> list[Block]:
    while len(run) >= MIN_TABLE_ROWS:
        table = _unruled_table(run, boxes, texts, line_h)
        if table is not None:
            return [table]
        run = run[1:]
    return []


def _unruled_table(run: list[list[int]], boxes, texts: dict[int, str], line_h: float) -> Block | None:
    """The run as a table (see `find_unruled_tables`), or None when it is not one."""
    pieces = [i for row in run for i in row]
    x_min = int(math.floor(min(boxes[i][0] for i in pieces)))
    x_max = int(math.ceil(max(boxes[i][2] for i in pieces)))
    covered = np.zeros(x_max - x_min + 1, dtype=bool)
    for i in pieces:
        covered[int(math.floor(boxes[i][0])) - x_min:int(math.ceil(boxes[i][2])) - x_min + 1] = True
    free = np.flatnonzero(~covered)
    gaps = np.split(free, np.flatnonzero(np.diff(free) > 1) + 1) if free.size else []
    free_x = [(float(g[0] + x_min), float(g[-1] + x_min)) for g in gaps if g.size >= GUTTER_LINE_HEIGHTS * line_h]
    cuts = [(g0 + g1) / 2 for g0, g1 in free_x]
    if not cuts:
        return None
    grid = [[[] for _ in range(len(cuts) + 1)] for _ in run]
    for r, row in enumerate(run):
        for i in row:
            grid[r][int(np.searchsorted(cuts, (boxes[i][0] + boxes[i][2]) / 2))].append(i)
    if any(sum(bool(cell) for cell in row) < 2 for row in grid):
        return None
    columns = [[" ".join(texts[i] for i in row[k]) for row in grid if row[k]] for k in range(len(cuts) + 1)]
    if all(np.median([len(t.split()) for t in col]) >= PROSE_WORDS for col in columns if col):
        return None
    if sum(bool(_CODE_TOKEN.search(texts[i])) for i in pieces) >= 0.5 * len(pieces):
        return None
    members = set(pieces)
    page_gutters = find_gutters([b for i, b in boxes.items() if i not in members], line_h)
    if all(any(g0 <= p1 and p0 <= g1 for p0, p1 in page_gutters) for g0, g1 in free_x):
        return None
    order = [i for row in grid for cell in row for i in cell]
    return Block("table", order, rows=grid)


# ---------------------------------------------------------------- columns and reading order


def find_gutters(boxes: list[tuple], line_h: float) -> list[tuple[float, float]]:
    """Vertical gutters: x-ranges at least one line-height wide that at most a few lines cross while
    many lines end on their left and start on their right."""
    if len(boxes) < 6:
        return []
    x_min = int(min(b[0] for b in boxes))
    x_max = int(math.ceil(max(b[2] for b in boxes)))
    cover = np.zeros(x_max - x_min + 1, dtype=np.int32)
    for x0, _, x1, _ in boxes:
        cover[int(x0) - x_min:int(math.ceil(x1)) - x_min + 1] += 1
    low = cover <= max(2, 0.15 * len(boxes))
    gutters = []
    for run in np.split(np.flatnonzero(low), np.flatnonzero(np.diff(np.flatnonzero(low)) > 1) + 1):
        if run.size == 0 or run[0] == 0 or run[-1] == len(cover) - 1 or run.size < line_h:
            continue
        g0, g1 = run[0] + x_min, run[-1] + x_min
        left = sum(1 for b in boxes if b[2] <= g0 + 1)
        right = sum(1 for b in boxes if b[0] >= g1 - 1)
        if min(left, right) >= 3:
            gutters.append((float(g0), float(g1)))
    return gutters


def _columns_in_bands(items: list[_Item], gutters: list[tuple[float, float]]):
    """Yield (column, items) in reading order: bands split at column-spanning items, columns within a band."""
    def column_of(box) -> int | None:
        x0, _, x1, _ = box
        col = 0
        for g0, g1 in gutters:
            if x0 < g0 + 1 and x1 > g1 - 1:
                return None  # crosses this gutter: spans columns
            if x0 >= g1 - 1:
                col += 1
        return col

    ordered = sorted(items, key=lambda it: (it.box[1], it.box[0]))
    band: list[tuple[int, _Item]] = []
    for it in ordered:
        col = column_of(it.box)
        if col is None:
            yield from _flush(band)
            band = []
            yield 0, [it]
        else:
            band.append((col, it))
    yield from _flush(band)


def _flush(band: list[tuple[int, "_Item"]]):
    for col in sorted({c for c, _ in band}):
        yield col, [it for c, it in band if c == col]


# ---------------------------------------------------------------- blocks


HEADING_RATIO = 1.3  # a heading's lines are this much taller, or its characters this much wider;
# consecutive lines whose characters differ in width by more belong to different blocks
GLYPH_MIN_CHARS = 8  # the box's padding inflates a short line's width per character


def glyph_width(box: tuple, text: str) -> float | None:
    """Box width per character column (a CJK character takes two), None under GLYPH_MIN_CHARS
    characters: the font size as the detector sees it, independent of how tall the box came out."""
    cols = sum(2 if _CJK.match(ch) else 1 for ch in text)
    return (box[2] - box[0]) / cols if len(text) >= GLYPH_MIN_CHARS else None


@dataclass
class _Scale:
    """The page's typical line: its height, and every line's glyph width with the page's median."""

    line_h: float
    glyphs: dict[int, float | None]
    page_glyph: float
    leading: float = 0.0  # median distance between the centres of a line and the next one below it

    def set_off(self, a: tuple, b: tuple) -> bool:
        """Is box b (below a) further from it than the page's leading allows within a paragraph?"""
        return self.leading > 0 and (b[1] + b[3]) / 2 - (a[1] + a[3]) / 2 > LIST_LOOSE * self.leading

    def wider(self, run: list[int]) -> bool:
        """Are the run's characters HEADING_RATIO wider than the page's (with enough letters to tell)?"""
        known = [g for i in run if (g := self.glyphs.get(i)) is not None]
        return bool(known) and self.page_glyph > 0 and float(np.median(known)) > HEADING_RATIO * self.page_glyph

    def glyph_change(self, a: int, b: int) -> bool:
        ga, gb = self.glyphs.get(a), self.glyphs.get(b)
        return ga is not None and gb is not None and max(ga, gb) > HEADING_RATIO * min(ga, gb)


def _blocks(items: list[_Item], boxes, lines: list[Line], scale: _Scale, column: int) -> list[Block]:
    """Group one column's items (top to bottom) into typed blocks."""
    line_h = scale.line_h
    out: list[Block] = []
    run: list[int] = []
    prev = None
    for it in items:
        if it.table is not None:
            out += _typed(run, boxes, lines, scale, column)
            run, prev = [], None
            it.table.column = column
            out.append(it.table)
            continue
        i = it.lines[0]
        if prev is not None and (_breaks(boxes[prev], boxes[i], line_h) or scale.glyph_change(prev, i)):
            out += _typed(run, boxes, lines, scale, column)
            run = []
        run.append(i)
        prev = i
    out += _typed(run, boxes, lines, scale, column)
    return _merge_code(_join_lists(out, boxes, lines, scale), boxes, lines, line_h)


def _breaks(a: tuple, b: tuple, line_h: float) -> bool:
    """Does a new block start between vertically consecutive lines a and b?"""
    gap = b[1] - a[3]
    ha, hb = a[3] - a[1], b[3] - b[1]
    if b[1] < a[3] - 0.5 * min(ha, hb):  # side by side on one row: same block only if close
        return b[0] - a[2] > 2 * line_h
    if abs(ha - hb) > 0.25 * max(ha, hb):
        return True
    return gap > 0.75 * max(ha, hb, 0.8 * line_h)


def _typed(run: list[int], boxes, lines: list[Line], scale: _Scale, column: int) -> list[Block]:
    if not run:
        return []
    run = _row_major(run, boxes)
    texts = [lines[i].reading.text.strip() for i in run]
    height = float(np.median([boxes[i][3] - boxes[i][1] for i in run]))
    joins = [False] + [_same_row(boxes[a], boxes[b]) for a, b in zip(run, run[1:])]
    letters = sum(ch.isalpha() for t in texts for ch in t)
    if sum(not j for j in joins) <= 2 and letters >= 3 and (height > HEADING_RATIO * scale.line_h or scale.wider(run)):
        return [Block("heading", run, column, joins_previous=joins)]
    if _is_code(texts):
        return [Block("code", run, column, joins_previous=joins)]
    # rows (a row = the detector's pieces of one printed line) in list items or not (`_list_rows`);
    # consecutive rows of the same kind form one block
    rows = _rows_by_joins(run, joins)
    in_list = _list_rows(rows, boxes, lines, scale)
    out: list[Block] = []
    for row, listed in zip(rows, in_list):
        kind = "list" if listed else "paragraph"
        if out and out[-1].kind == kind:
            out[-1].lines += row
            out[-1].joins_previous += [False] + [True] * (len(row) - 1)
        else:
            out.append(Block(kind, list(row), column, joins_previous=[False] + [True] * (len(row) - 1)))
    return out


def _rows_by_joins(run: list[int], joins: list[bool]) -> list[list[int]]:
    rows: list[list[int]] = []
    for i, j in zip(run, joins):
        if j and rows:
            rows[-1].append(i)
        else:
            rows.append([i])
    return rows


def _list_rows(rows: list[list[int]], boxes, lines: list[Line], scale: "_Scale") -> list[bool]:
    """Which rows of a block belong to list items. An item starts at a row beginning with a list marker
    (`LIST_MARKER`) that is the block's first row, is set off from the row above (`_Scale.set_off`), or
    follows another item's rows; a row without a marker continues the item unless it is set off from
    the row above, which ends the list. (Too few items are undone later: `_join_lists`.)"""
    out, in_list = [], False
    for r, row in enumerate(rows):
        text = lines[row[0]].reading.text.strip()
        set_off = r == 0 or scale.set_off(_row_box(rows[r - 1], boxes), _row_box(row, boxes))
        if LIST_MARKER.match(text) and (set_off or in_list):
            in_list = True
        elif set_off:
            in_list = False
        out.append(in_list)
    return out


def _row_box(row: list[int], boxes) -> tuple[float, float, float, float]:
    return (min(boxes[i][0] for i in row), min(boxes[i][1] for i in row),
            max(boxes[i][2] for i in row), max(boxes[i][3] for i in row))


def _join_lists(blocks: list[Block], boxes, lines: list[Line], scale: "_Scale") -> list[Block]:
    """List blocks that follow each other (a list cut by the block gaps) become one; a list of fewer
    than MIN_LIST_ITEMS items is a paragraph again (a lone `* ...` line reads as running text; it was
    cut from the rows around it only where they are set off from it, i.e. at paragraph breaks)."""
    merged: list[Block] = []
    for b in blocks:
        prev = merged[-1] if merged else None
        if prev is not None and prev.kind == b.kind == "list":
            prev.lines = prev.lines + b.lines
            prev.joins_previous = prev.joins_previous + b.joins_previous
        else:
            merged.append(b)
    for b in merged:
        if b.kind == "list":
            items = sum(bool(LIST_MARKER.match(lines[row[0]].reading.text.strip())) for row in b.visual_rows())
            if items < MIN_LIST_ITEMS:
                b.kind = "paragraph"
    return merged


def _same_row(a: tuple, b: tuple) -> bool:
    overlap = min(a[3], b[3]) - max(a[1], b[1])
    return overlap > 0.5 * min(a[3] - a[1], b[3] - b[1]) and b[0] >= a[2] - 2


def _row_major(run: list[int], boxes) -> list[int]:
    """Top to bottom (by their tops); pieces that overlap vertically form one row, read left to right."""
    return [i for row in _rows_of(run, boxes, lambda i: boxes[i][1]) for i in row]


def _is_code(texts: list[str]) -> bool:
    if len(texts) < 2:
        return False
    hits = sum(bool(_CODE_TOKEN.search(t)) for t in texts)
    return hits >= max(2, 0.5 * len(texts))


def _merge_code(blocks: list[Block], boxes, lines: list[Line], line_h: float) -> list[Block]:
    """Code split at blank lines is one listing: merge code blocks that follow within ~2 lines, then
    recover indentation and the blank lines."""
    out: list[Block] = []
    for b in blocks:
        prev = out[-1] if out else None
        follows = prev is not None and prev.kind == "code" and \
            boxes[b.lines[0]][1] - boxes[prev.lines[-1]][3] < 2.5 * line_h
        if follows and (b.kind == "code" or (b.kind == "paragraph" and all(
                _CODE_TOKEN.search(lines[i].reading.text.strip()) for i in b.lines))):
            prev.lines = prev.lines + b.lines
            prev.joins_previous = prev.joins_previous + b.joins_previous
            continue
        out.append(b)
    for b in out:
        if b.kind == "code":
            b.indents = _indents(b.lines, boxes, lines)
            b.blank_before = _blank_lines(b.lines, boxes)
    return out


def _indents(run: list[int], boxes, lines: list[Line]) -> list[int]:
    """Leading spaces per code line: left offset over the monospace character width (median of
    box width / characters), snapped to multiples of the smallest indent step of 2+ characters."""
    widths = [(boxes[i][2] - boxes[i][0]) / len(lines[i].reading.text.strip())
              for i in run if len(lines[i].reading.text.strip()) >= 6]
    if not widths:
        return [0] * len(run)
    char_w = float(np.median(widths))
    # measure from the leftmost line that looks like code: a prose line glued to the listing would
    # otherwise shift every indent
    codeish = [i for i in run if _CODE_TOKEN.search(lines[i].reading.text.strip())] or run
    left = min(boxes[i][0] for i in codeish)
    raw = [max(0, round((boxes[i][0] - left) / char_w)) for i in run]
    levels = sorted(set(raw))
    step = min((b - a for a, b in zip(levels, levels[1:]) if b - a >= 2), default=0)
    if step:
        return [round(n / step) * step for n in raw]
    return raw


def _blank_lines(run: list[int], boxes) -> list[int]:
    pitch = [boxes[b][1] - boxes[a][1] for a, b in zip(run, run[1:])]
    if not pitch:
        return [0] * len(run)
    step = float(np.median(pitch))
    return [0] + [max(0, round(p / step) - 1) for p in pitch]
