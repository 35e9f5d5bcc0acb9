"""Page results and their three renderings: JSON (everything), Markdown and plain text (structure kept).

Markdown: headings `#`/`##`, paragraphs as one line each, list items as `-` or their own number,
code fenced with its indentation and blank lines, tables (ruled or set out with space only) as pipe
tables (first row = header).
Plain text: the page's own line breaks, blocks separated by a blank line, code indented, table
columns padded to line up.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from glm5.apps.ocr.layout import LIST_MARKER, Block, PageLayout
from glm5.apps.ocr.perception import Line

_CJK_END = re.compile(r"[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]$")
_CJK_START = re.compile(r"^[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]")


@dataclass
class Change:
    """One correction: which line, in which round, the text before and after, and why."""

    round: int
    line: int
    before: str
    after: str
    why: str


@dataclass
class PageResult:
    width: int
    height: int
    lines: list[Line]
    layout: PageLayout
    changes: list[Change] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)  # per round: lines examined, changed, still uncertain
    name: str = "image"

    def line_text(self, i: int, after_round: int | None = None) -> str:
        """A line's text now, or as it stood at the end of `after_round` (from its change history)."""
        ln = self.lines[i]
        if after_round is not None:
            later = [h for h in ln.history if h["round"] > after_round]
            if later:
                return later[0]["text"].strip()
        return ln.reading.text.strip()

    def row_texts(self, b: Block, after_round: int | None = None) -> list[tuple[int, str]]:
        """(position in b.lines of the row's first piece, the row's text) per printed line of a block."""
        out, n = [], 0
        for row in b.visual_rows():
            out.append((n, " ".join(t for t in (self.line_text(i, after_round) for i in row) if t)))
            n += len(row)
        return out

    def reading_text(self, after_round: int | None = None) -> str:
        """Printed lines in reading order, one per line (table cells row-major): what CER is measured on."""
        parts = []
        for b in self.layout.blocks:
            if b.kind == "table":
                parts += [self.line_text(i, after_round) for i in b.lines]
            else:
                parts += [t for _, t in self.row_texts(b, after_round)]
        return "\n".join(parts)


def to_json(res: PageResult) -> dict:
    ids = {i: n for n, i in enumerate(res.layout.reading_order())}

    def line(i: int) -> dict:
        ln = res.lines[i]
        raw = ln.reading.text
        lead, text = len(raw) - len(raw.lstrip()), raw.strip()
        confs = ln.reading.char_confs[lead:lead + len(text)]  # aligned with the stripped text
        return {"id": ids[i], "text": text, "box": [round(v, 1) for v in ln.box],
                "quad": [[round(float(x), 1), round(float(y), 1)] for x, y in ln.quad],
                "confidence": round(ln.reading.conf, 4),
                "char_confidences": [round(c, 4) for c in confs], "source": ln.source}

    blocks = []
    for n, b in enumerate(res.layout.blocks):
        d = {"id": n, "kind": b.kind, "column": b.column, "box": _block_box(res, b),
             "lines": [line(i) for i in b.lines]}
        if b.kind == "table":
            d["rows"] = [[" ".join(res.line_text(i) for i in cell) for cell in row] for row in b.rows]
            d["ruled"] = b.ruled
        if b.kind == "code":
            d["indents"] = b.indents
        blocks.append(d)
    return {"name": res.name, "width": res.width, "height": res.height, "skew_degrees": round(res.layout.skew, 3),
            "columns": res.layout.num_columns, "blocks": blocks,
            "reading_order": list(range(len(ids))),
            "changes": [{**asdict(c), "line": ids.get(c.line, c.line)} for c in res.changes],
            "rounds": res.rounds}


def _block_box(res: PageResult, b: Block) -> list[float]:
    boxes = [res.lines[i].box for i in b.lines]
    return [round(min(x[0] for x in boxes), 1), round(min(x[1] for x in boxes), 1),
            round(max(x[2] for x in boxes), 1), round(max(x[3] for x in boxes), 1)]


def join_lines(texts: list[str]) -> str:
    """Soft-wrapped lines -> one paragraph: a space between Latin words, none between CJK characters."""
    out = ""
    for t in texts:
        if out and not (_CJK_END.search(out) and _CJK_START.search(t)):
            out += " "
        out += t
    return out


def to_markdown(res: PageResult) -> str:
    parts = []
    heights = [res.lines[b.lines[0]].height for b in res.layout.blocks if b.kind == "heading"]
    top = max(heights, default=0.0)
    for b in res.layout.blocks:
        rows = res.row_texts(b)
        texts = [t for _, t in rows]
        if b.kind == "heading":
            level = "#" if res.lines[b.lines[0]].height >= 0.95 * top else "##"
            parts.append(f"{level} {join_lines(texts)}")
        elif b.kind == "list":
            parts.append("\n".join(_list_items(texts)))
        elif b.kind == "code":
            parts.append("```\n" + "\n".join(_code_lines(b, rows)) + "\n```")
        elif b.kind == "table":
            parts.append(_markdown_table([[" ".join(res.line_text(i) for i in c) for c in row] for row in b.rows]))
        else:
            parts.append(_escape(join_lines(texts)))
    return "\n\n".join(p for p in parts if p) + ("\n" if parts else "")


def _list_items(texts: list[str]) -> list[str]:
    """Continuation lines join their item; bullets become `-`, numbers stay."""
    items: list[str] = []
    for t in texts:
        m = LIST_MARKER.match(t)
        if m or not items:
            marker = m.group(0).strip() if m else ""
            body = t[m.end():] if m else t
            items.append(("-" if not marker[:1].isalnum() else marker) + " " + body)
        else:
            items[-1] = join_lines([items[-1], t])
    return items


def _code_lines(b: Block, rows: list[tuple[int, str]]) -> list[str]:
    out = []
    for n, t in rows:
        out += [""] * (b.blank_before[n] if n < len(b.blank_before) else 0)
        out.append(" " * (b.indents[n] if n < len(b.indents) else 0) + t)
    return out


def _escape(text: str) -> str:
    """Keep a paragraph from turning into Markdown structure it was not (leading #, >, list marks)."""
    return re.sub(r"^([#>]|[-*+] |\d+[.)] )", r"\\\1", text)


def _markdown_table(rows: list[list[str]]) -> str:
    if not rows:
        return ""
    width = max(len(r) for r in rows)
    cells = [[c.replace("|", "\\|") for c in r] + [""] * (width - len(r)) for r in rows]
    lines = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * width]
    lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
    return "\n".join(lines)


def to_text(res: PageResult) -> str:
    parts = []
    for b in res.layout.blocks:
        rows = res.row_texts(b)
        if b.kind == "code":
            parts.append("\n".join(_code_lines(b, rows)))
        elif b.kind == "table":
            parts.append(_text_table([[" ".join(res.line_text(i) for i in c) for c in row] for row in b.rows]))
        else:
            parts.append("\n".join(t for _, t in rows))
    return "\n\n".join(p for p in parts if p) + ("\n" if parts else "")


def _text_table(rows: list[list[str]]) -> str:
    width = max((len(r) for r in rows), default=0)
    rows = [r + [""] * (width - len(r)) for r in rows]
    col_w = [max(_display_width(r[k]) for r in rows) for k in range(width)]
    return "\n".join("  ".join(c + " " * (col_w[k] - _display_width(c)) for k, c in enumerate(r)).rstrip()
                     for r in rows)


def _display_width(s: str) -> int:
    """Terminal columns: CJK characters take two."""
    return sum(2 if _CJK_START.match(ch) else 1 for ch in s)
