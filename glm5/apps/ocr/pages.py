"""Reproducible evaluation pages: corpus text rendered into page images with exact ground truth.

`TextPool.from_documents(docs)` picks English prose, Chinese prose and Python code out of corpus
documents (`{"text", "source", "lang"}`, the bundled corpus's JSONL records). `render_page(layout,
pool, seed)` draws one page (`single`, `two_column`, `table`, `code`, `mixed`, `table_unruled`) and
returns a `Page`: the RGB image plus every line's text, box, block kind and reading-order position;
`Page.blocks()` groups them into the ground-truth structure (headings, list items, tables with their
cell grids, code, paragraphs). `degrade(page,
condition, seed)` applies `noise`, `blur`, `jpeg`, `rotate` (<= 3 degrees) or `combo` and moves the
boxes with the pixels. The same (layout, seed, condition) always gives the same pixels.
"""

from __future__ import annotations

import io
import math
import random
import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Literal

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from glm5.apps.ocr.fonts import find_font

Layout = Literal["single", "two_column", "table", "code", "mixed", "table_unruled"]
Condition = Literal["clean", "noise", "blur", "jpeg", "rotate", "combo"]
LAYOUTS: tuple[Layout, ...] = ("single", "two_column", "table", "code", "mixed", "table_unruled")
CONDITIONS: tuple[Condition, ...] = ("clean", "noise", "blur", "jpeg", "rotate", "combo")

PAGE_W, MAX_H, MARGIN, BODY_PX = 960, 1240, 56, 20
_CJK = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")
_ZH_OK = re.compile(r"^[\u3000-\u303f\u4e00-\u9fff\uff01-\uff5e0-9A-Za-z ,.;:!?()\"'%-]+$")


@dataclass
class GtLine:
    """One ground-truth line (a table cell counts as a line)."""

    text: str
    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in page pixels
    kind: str  # heading | paragraph | list | table | code
    block: int  # index of the block in reading order
    indent: int = 0  # leading spaces of a code line
    row: int = -1  # table cell position
    col: int = -1


@dataclass
class GtBlock:
    """One ground-truth block: its kind and its lines (indices into `Page.lines`, reading order).

    Every list item is a block of its own (kind `list`); a table is one block whose `cells` grid
    holds each cell's text by (row, column), "" where nothing was drawn."""

    kind: str  # heading | paragraph | list | table | code
    lines: list[int]
    cells: list[list[str]] = field(default_factory=list)  # table: rows -> column texts


@dataclass
class Page:
    image: Image.Image
    lines: list[GtLine]  # in reading order
    layout: str
    condition: str = "clean"
    seed: int = 0

    def text(self) -> str:
        """Reading-order text: one line per line (cells in row-major order), code keeps its indent."""
        return "\n".join(" " * ln.indent + ln.text for ln in self.lines)

    def blocks(self) -> list[GtBlock]:
        """The page's structure, derived from its lines' `block`, `kind`, `row` and `col` (which the
        generator records as it draws, so that adding this changed no page's pixels)."""
        out: dict[int, GtBlock] = {}
        for i, ln in enumerate(self.lines):
            b = out.setdefault(ln.block, GtBlock(ln.kind, []))
            if b.kind != ln.kind:
                raise ValueError(f"page {self.layout}/{self.seed}: block {ln.block} mixes {b.kind} and {ln.kind}")
            b.lines.append(i)
        for b in out.values():
            if b.kind == "table":
                cells = [self.lines[i] for i in b.lines]
                if any(c.row < 0 or c.col < 0 for c in cells):
                    raise ValueError(f"page {self.layout}/{self.seed}: a table cell without row/col")
                grid = [[""] * (max(c.col for c in cells) + 1) for _ in range(max(c.row for c in cells) + 1)]
                for c in cells:
                    grid[c.row][c.col] = c.text
                b.cells = grid
        return [out[k] for k in sorted(out)]


@dataclass
class TextPool:
    """Paragraph-sized snippets to typeset, filtered to characters the fonts can draw."""

    english: list[str] = field(default_factory=list)
    chinese: list[str] = field(default_factory=list)
    code: list[list[str]] = field(default_factory=list)  # snippets of code lines

    @classmethod
    def from_documents(cls, docs: Iterable[dict]) -> "TextPool":
        pool = cls()
        for doc in docs:
            lang, text = doc.get("lang"), doc.get("text", "")
            if lang == "code":
                pool.code += _code_snippets(text)
            elif lang == "zh":
                pool.chinese += [p for p in _paragraphs(text) if 20 <= len(p) <= 240 and _ZH_OK.match(p)
                                 and len(_CJK.findall(p)) > len(p) // 2]
            elif lang == "en":
                pool.english += [p for p in _paragraphs(text) if 50 <= len(p) <= 600 and p.isascii()
                                 and p.isprintable() and not re.search(r"[`*=_~^|<>\\]{2}", p)]
        return pool


def bundled_pool(split: str = "validation") -> TextPool:
    """The pool from glm5's bundled corpus (`glm5/data/assets/corpus/<split>.jsonl.gz`)."""
    import gzip  # noqa: PLC0415
    import json  # noqa: PLC0415

    from glm5.core.resources import bundled  # noqa: PLC0415

    with gzip.open(bundled(f"corpus/{split}.jsonl.gz"), "rt", encoding="utf-8") as f:
        return TextPool.from_documents(json.loads(line) for line in f)


def _paragraphs(text: str) -> list[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def _code_snippets(text: str, size: int = 14) -> list[list[str]]:
    lines = [ln.rstrip().expandtabs(4) for ln in text.splitlines()]
    out = []
    for start in range(0, len(lines) - size, size):
        chunk = lines[start:start + size]
        while chunk and not chunk[0].strip():
            chunk = chunk[1:]
        if len(chunk) >= 6 and all(ln.isascii() and ln.isprintable() and len(ln) <= 64 for ln in chunk) \
                and sum(bool(ln.strip()) for ln in chunk) >= 5:
            out.append(_dedent(chunk))
    return out


def _dedent(lines: list[str]) -> list[str]:
    """Strip the common indent (a snippet cut from inside a function starts indented)."""
    cut = min(len(ln) - len(ln.lstrip(" ")) for ln in lines if ln.strip())
    return [ln[cut:] for ln in lines]


class _Canvas:
    """A white page being typeset top to bottom; records every drawn line."""

    def __init__(self, fonts: dict[str, str], width: int = PAGE_W):
        self.image = Image.new("RGB", (width, MAX_H), "white")
        self.draw = ImageDraw.Draw(self.image)
        self.fonts, self.width, self.y = fonts, width, MARGIN
        self.lines: list[GtLine] = []
        self.block = -1

    def font(self, family: str, px: int) -> ImageFont.FreeTypeFont:
        return ImageFont.truetype(self.fonts[family], px)

    def text(self, x: float, y: float, s: str, font, kind: str, **kw) -> None:
        self.draw.text((x, y), s, fill=(20, 20, 20), font=font)
        box = self.draw.textbbox((x, y), s, font=font)
        self.lines.append(GtLine(s.strip(), tuple(float(v) for v in box), kind, self.block, **kw))

    def new_block(self) -> None:
        self.block += 1

    def room(self, px: float) -> bool:
        return self.y + px < MAX_H - MARGIN


def _wrap(text: str, font, width: float) -> list[str]:
    """Greedy line breaking: by words for Latin text, by characters where CJK allows it."""
    tokens = re.findall(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]|[^\s\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]+|\s+",
                        text)
    lines, cur = [], ""
    for tok in tokens:
        trial = cur + tok
        if cur.strip() and font.getlength(trial.rstrip()) > width:
            lines.append(cur.strip())
            cur = tok.lstrip()
        else:
            cur = trial
    if cur.strip():
        lines.append(cur.strip())
    return lines


def _paragraph(c: _Canvas, text: str, font, x0: float, width: float, y_limit: float, kind="paragraph",
               prefix: str = "") -> bool:
    """Typeset one paragraph at c.y between x0 and x0 + width; False (nothing drawn) if it does not fit."""
    step = font.size * 1.45
    hang = font.getlength(prefix) if prefix else 0.0
    lines = _wrap(text, font, width - hang)
    if c.y + step * len(lines) > y_limit:
        return False
    c.new_block()
    for i, s in enumerate(lines):
        c.text(x0 + (0 if i == 0 else hang), c.y, (prefix + s) if i == 0 else s, font, kind)
        c.y += step
    c.y += font.size * 0.8
    return True


def _heading(c: _Canvas, rng: random.Random, pool: TextPool, family: str, zh: bool = False) -> None:
    source = rng.choice(pool.chinese if zh else pool.english)
    words = list(source[:14]) if zh else source.split()[:6]
    title = ("".join(words) if zh else " ".join(words)).strip(" ,.;:!?，。；：！？")
    font = c.font(family, 30)
    c.new_block()
    c.text(MARGIN, c.y, title, font, "heading")
    c.y += 30 * 1.9


def _prose(c: _Canvas, rng, texts: list[str], font, x0, width, y_limit, lists: bool = True) -> None:
    """Paragraphs (and now and then a short list) until the area is full."""
    fails = 0
    while fails < 3 and c.room(font.size * 3):
        if lists and rng.random() < 0.25:
            marker = rng.choice(["• ", "- ", "{n}. "])
            items = [" ".join(rng.choice(texts).split()[:rng.randint(4, 12)]) for _ in range(rng.randint(2, 4))]
            start_y, ok = c.y, True
            for n, item in enumerate(items, 1):
                ok = _paragraph(c, item, font, x0, width, y_limit, "list", marker.format(n=n)) and ok
                c.y -= font.size * 0.5  # list items sit closer than paragraphs
            fails += 0 if ok and c.y > start_y else 1
            continue
        fails += not _paragraph(c, rng.choice(texts), font, x0, width, y_limit)


def _single(c: _Canvas, rng, pool: TextPool) -> None:
    family = rng.choice(["sans", "serif"])
    _heading(c, rng, pool, family)
    _prose(c, rng, pool.english, c.font(family, BODY_PX), MARGIN, c.width - 2 * MARGIN, MAX_H - MARGIN)


def _two_column(c: _Canvas, rng, pool: TextPool) -> None:
    family, gutter = rng.choice(["sans", "serif"]), 48
    _heading(c, rng, pool, family)
    col_w = (c.width - 2 * MARGIN - gutter) / 2
    top, font = c.y, c.font(family, BODY_PX - 2)
    for col in range(2):
        c.y = top
        _prose(c, rng, pool.english, font, MARGIN + col * (col_w + gutter), col_w, MAX_H - MARGIN, lists=False)


def _table(c: _Canvas, rng, pool: TextPool) -> None:
    family = rng.choice(["sans", "serif"])
    _heading(c, rng, pool, family)
    words = [w.strip(".,;:!?\"'()") for p in rng.sample(pool.english, 20) for w in p.split()]
    words = [w for w in words if 3 <= len(w) <= 11 and w.isalpha()]
    n_cols, n_rows = rng.randint(3, 4), rng.randint(6, 10)
    font, bold = c.font(family, BODY_PX - 2), c.font(family, BODY_PX - 2)
    col_w, row_h = (c.width - 2 * MARGIN) / n_cols, int(BODY_PX * 2.0)
    x0, y0 = MARGIN, c.y
    c.new_block()
    for r in range(n_rows):
        for k in range(n_cols):
            if r == 0:
                cell = rng.choice(words).capitalize()
            elif k == 0 or rng.random() < 0.5:
                cell = " ".join(rng.sample(words, rng.randint(1, 2)))
            else:
                cell = rng.choice([f"{rng.randint(0, 9999)}", f"{rng.uniform(0, 100):.2f}", f"{rng.randint(1, 99)}%"])
            c.text(x0 + k * col_w + 10, y0 + r * row_h + (row_h - BODY_PX) / 2 - 2, cell,
                   bold if r == 0 else font, "table", row=r, col=k)
    for r in range(n_rows + 1):  # ruling
        c.draw.line([(x0, y0 + r * row_h), (x0 + n_cols * col_w, y0 + r * row_h)], fill=(60, 60, 60), width=1)
    for k in range(n_cols + 1):
        c.draw.line([(x0 + k * col_w, y0), (x0 + k * col_w, y0 + n_rows * row_h)], fill=(60, 60, 60), width=1)
    c.y = y0 + n_rows * row_h + 36
    _prose(c, rng, pool.english, font, MARGIN, c.width - 2 * MARGIN, MAX_H - MARGIN, lists=False)


def _table_unruled(c: _Canvas, rng, pool: TextPool) -> None:
    """A heading, a paragraph, then a 3-4 column x 5-8 row table set out with space only (every
    column starts at one x, at least 3 average characters right of the widest cell before it; no
    rules), then prose. Every cell holds text: a header word, 1-2 words or a number."""
    family = rng.choice(["sans", "serif"])
    _heading(c, rng, pool, family)
    font = c.font(family, BODY_PX - 2)
    width = c.width - 2 * MARGIN
    _paragraph(c, rng.choice(pool.english), font, MARGIN, width, MAX_H - MARGIN)
    words = [w.strip(".,;:!?\"'()") for p in rng.sample(pool.english, 20) for w in p.split()]
    words = [w for w in words if 3 <= len(w) <= 10 and w.isalpha()]
    n_cols, n_rows = rng.randint(3, 4), rng.randint(5, 8)
    grid = []
    for r in range(n_rows):
        row = []
        for k in range(n_cols):
            if r == 0:
                row.append(rng.choice(words).capitalize())
            elif k == 0 or rng.random() < 0.4:
                row.append(" ".join(rng.sample(words, rng.randint(1, 2))))
            else:
                row.append(rng.choice([f"{rng.randint(0, 9999)}", f"{rng.uniform(0, 100):.2f}",
                                       f"{rng.randint(1, 99)}%"]))
        grid.append(row)
    col_w = [max(font.getlength(row[k]) for row in grid) for k in range(n_cols)]
    gap = max(3 * font.getlength("n"), (width - sum(col_w)) / max(1, n_cols - 1) * rng.uniform(0.3, 0.8))
    xs = [MARGIN + sum(col_w[:k]) + k * gap for k in range(n_cols)]
    c.new_block()
    step = font.size * 1.7
    for r, row in enumerate(grid):
        for k, cell in enumerate(row):
            c.text(xs[k], c.y, cell, font, "table", row=r, col=k)
        c.y += step
    c.y += BODY_PX
    _prose(c, rng, pool.english, font, MARGIN, width, MAX_H - MARGIN, lists=False)


def _code(c: _Canvas, rng, pool: TextPool) -> None:
    family = rng.choice(["sans", "serif"])
    _heading(c, rng, pool, family)
    body, mono = c.font(family, BODY_PX), c.font("mono", BODY_PX - 2)
    while c.room(200):
        if not _paragraph(c, rng.choice(pool.english), body, MARGIN, c.width - 2 * MARGIN, MAX_H - MARGIN):
            break
        snippet = rng.choice(pool.code)
        step = mono.size * 1.4
        snippet = snippet[:max(0, int((MAX_H - MARGIN - c.y) / step) - 1)]
        if len(snippet) < 4:
            break
        c.new_block()
        for ln in snippet:
            if ln.strip():
                indent = len(ln) - len(ln.lstrip(" "))
                c.text(MARGIN + 24 + mono.getlength(" " * indent), c.y, ln.strip(), mono, "code", indent=indent)
            c.y += step
        c.y += BODY_PX


def _mixed(c: _Canvas, rng, pool: TextPool) -> None:
    _heading(c, rng, pool, "cjk", zh=True)
    zh, en = c.font("cjk", BODY_PX + 2), c.font("sans", BODY_PX)
    width, fails = c.width - 2 * MARGIN, 0
    while fails < 3 and c.room(BODY_PX * 3):
        use_zh = rng.random() < 0.6
        ok = _paragraph(c, rng.choice(pool.chinese if use_zh else pool.english), zh if use_zh else en,
                        MARGIN, width, MAX_H - MARGIN)
        fails += not ok


_RENDER = {"single": _single, "two_column": _two_column, "table": _table, "code": _code, "mixed": _mixed,
           "table_unruled": _table_unruled}


def layout_fonts(layout: Layout) -> dict[str, str] | None:
    """The font files a layout needs, or None when one is missing (e.g. no CJK font for `mixed`)."""
    need = ("sans", "serif", "mono") + (("cjk",) if layout == "mixed" else ())
    found = {f: find_font(f) for f in need}
    return None if any(v is None for v in found.values()) else {k: str(v) for k, v in found.items()}


def render_page(layout: Layout, pool: TextPool, seed: int) -> Page:
    """One clean page; raises LookupError when a needed font is not installed."""
    fonts = layout_fonts(layout)
    if fonts is None:
        raise LookupError(f"no font for layout {layout!r} (the CJK font comes with `pip install glm5[ocr]`)")
    rng = random.Random(f"{layout}:{seed}")
    c = _Canvas(fonts)
    _RENDER[layout](c, rng, pool)
    height = int(min(MAX_H, max(ln.box[3] for ln in c.lines) + MARGIN)) if c.lines else 2 * MARGIN
    return Page(c.image.crop((0, 0, c.image.width, height)), c.lines, layout, "clean", seed)


def degrade(page: Page, condition: Condition, seed: int = 0) -> Page:
    """The page under one degradation; ground-truth boxes follow a rotation."""
    rng = np.random.default_rng(_seed(condition, seed))
    img, lines = page.image, page.lines
    if condition in ("rotate", "combo"):
        angle = float(rng.uniform(1.0, 3.0 if condition == "rotate" else 2.0) * rng.choice([-1, 1]))
        img, lines = _rotate(img, lines, angle)
    if condition in ("blur", "combo"):
        img = img.filter(ImageFilter.GaussianBlur(1.6 if condition == "blur" else 1.0))
    if condition in ("noise", "combo"):
        arr = np.asarray(img, dtype=np.float32)
        arr = arr + rng.normal(0, 40 if condition == "noise" else 22, size=arr.shape[:2])[..., None]
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    if condition in ("jpeg", "combo"):
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=8 if condition == "jpeg" else 25)
        img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return replace(page, image=img, lines=lines, condition=condition)


def _seed(condition: str, seed: int) -> int:
    return (CONDITIONS.index(condition) + 1) * 1_000_003 + seed


def _rotate(img: Image.Image, lines: list[GtLine], angle: float) -> tuple[Image.Image, list[GtLine]]:
    """Rotate counter-clockwise by `angle` degrees about the centre; boxes become their rotated hulls."""
    cx, cy = img.width / 2, img.height / 2
    out = img.rotate(angle, resample=Image.BICUBIC, fillcolor="white")
    a = math.radians(angle)
    cos, sin = math.cos(a), math.sin(a)

    def move(x, y):  # PIL rotates counter-clockwise on screen (y down)
        dx, dy = x - cx, y - cy
        return cx + dx * cos + dy * sin, cy - dx * sin + dy * cos

    moved = []
    for ln in lines:
        x0, y0, x1, y1 = ln.box
        pts = [move(x, y) for x, y in ((x0, y0), (x1, y0), (x1, y1), (x0, y1))]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        moved.append(replace(ln, box=(min(xs), min(ys), max(xs), max(ys))))
    return out, moved
