"""Stage 1, normalisation: Unicode form (NFKC), line endings, control/invisible characters, whitespace.

Leading indentation is kept (code and man pages depend on it); trailing spaces and long runs of blank
lines are not. A document that is empty afterwards is dropped with reason `empty`.
"""

from __future__ import annotations

import re
import unicodedata

from .config import NormalizeConfig

# C0/C1 controls except \t and \n, plus zero-width / bidi / BOM format characters
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2064\ufeff]")
_SPACES = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")  # exotic spaces -> ' '
_TRAILING = re.compile(r"[ \t]+$", re.M)


def normalize_text(text: str, cfg: NormalizeConfig) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if cfg.form != "none":
        text = unicodedata.normalize(cfg.form, text)
    text = _CONTROL.sub("", text)
    text = _SPACES.sub(" ", text)
    text = _TRAILING.sub("", text)
    text = re.sub(r"\n{%d,}" % (cfg.max_blank_lines + 2), "\n" * (cfg.max_blank_lines + 1), text)
    return text.strip("\n")


def normalize_doc(doc: dict, cfg: NormalizeConfig) -> str | None:
    """Normalise `doc["text"]` in place; return a drop reason or None."""
    doc["text"] = normalize_text(doc["text"], cfg)
    return "empty" if not doc["text"].strip() else None
