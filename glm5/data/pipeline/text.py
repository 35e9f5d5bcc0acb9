"""Text helpers shared by the stages: CJK detection and CJK-aware word splitting.

Chinese has no spaces, so "words" are whitespace tokens for other scripts and single characters for CJK
ideographs (and kana/hangul). Word-count rules (Gopher, C4) and shingles then work for both.
"""

from __future__ import annotations

import re

# CJK Unified Ideographs (+ Ext A, compatibility), kana, hangul syllables
CJK_CHARS = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\u3040-\u30ff\uac00-\ud7af"
CJK_RE = re.compile(f"[{CJK_CHARS}]")
# a CJK character, or a run of non-space non-CJK characters
WORD_RE = re.compile(f"[{CJK_CHARS}]|[^\\s{CJK_CHARS}]+")
# CJK punctuation and full-width forms: not words on their own when they stand between CJK characters
CJK_PUNCT = set("，。、；：？！“”‘’（）《》【】「」『』…—～·")


def cjk_ratio(text: str) -> float:
    """Fraction of non-space characters that are CJK."""
    n = sum(1 for c in text if not c.isspace())
    return len(CJK_RE.findall(text)) / n if n else 0.0


def words(text: str) -> list[str]:
    """CJK-aware words: each CJK character is a word; other scripts split on whitespace."""
    return [w for w in WORD_RE.findall(text) if w not in CJK_PUNCT]


def is_cjk(word: str) -> bool:
    return len(word) == 1 and CJK_RE.match(word) is not None


def count_tokens(text: str) -> int:
    """The token count reported by `glm5 data stats`: whitespace tokens plus CJK characters."""
    return len(WORD_RE.findall(text))
