"""Stage 8, domain tagging: a transparent rule-based tagger (code / tech / literature / general).

Scores are counts of cheap cues (Python/C syntax, command-line and system vocabulary in English and
Chinese, verse layout). With `keep_existing` a non-empty input `domain` is kept and the tagger's
agreement with it is reported in the stats, which is how the tagger is checked on labelled sources.
"""

from __future__ import annotations

import re

from .config import DomainConfig

CODE_RE = re.compile(r"^\s*(def |class |import |from \w+ import|return\b|if __name__|#include|for .* in .*:|"
                     r"elif |try:|except\b|self\.)", re.M)
TECH_WORDS = re.compile(
    r"\b(package|command|file|directory|option|kernel|server|module|function|install|configure|"
    r"debian|linux|python|system|network|default|shell|root|argument|library|apt|sudo)\b|"
    r"(命令|文件|目录|选项|内核|服务器|模块|函数|安装|配置|系统|网络|参数|默认|软件包|程序|用户)", re.I)
VERSE_AUTHOR = re.compile(r"(作者[:：]|^\s*--\s*\S|——\s*\S)", re.M)


def tag(text: str) -> str:
    """Predict the domain of `text` from cues counted on the first 5000 characters."""
    head = text[:5000]
    lines = [ln for ln in head.splitlines() if ln.strip()]
    n_lines = max(len(lines), 1)
    if len(CODE_RE.findall(head)) / n_lines > 0.15:
        return "code"
    tech = len(TECH_WORDS.findall(head))
    if tech >= 3 and tech / max(len(head) / 100, 1) > 0.3:
        return "tech"
    short = sum(len(ln.strip()) <= 40 for ln in lines) / n_lines
    if VERSE_AUTHOR.search(head) or (short > 0.7 and n_lines >= 4):
        return "literature"
    return "general"


def tag_doc(doc: dict, cfg: DomainConfig) -> str:
    """Set `doc["domain"]` (unless kept); returns the tagger's prediction for agreement stats."""
    pred = tag(doc["text"])
    if not (cfg.keep_existing and doc.get("domain")):
        doc["domain"] = pred
    return pred
