"""Stage 3, rule filters: Gopher quality, Gopher repetition, C4, FineWeb, and code rules.

Each rule group returns a drop reason (`gopher:min_words`, `c4:lorem_ipsum`, ...) or None; C4 may also
remove lines (javascript, policy, no terminal punctuation) before its document-level checks, as C4 did.
Thresholds follow datatrove's implementations of the papers; word counts are CJK-aware (`text.words`).
A group is skipped for documents whose input domain is in its `skip_domains` (per-domain filtering).
"""

from __future__ import annotations

import re

import numpy as np

from .config import C4Config, CodeConfig, DataConfig, FineWebConfig, GopherConfig, RepetitionConfig
from .text import is_cjk, words

STOP_WORDS = {  # Gopher's English stop words, plus the commonest Chinese function characters
    "en": {"the", "be", "to", "of", "and", "that", "have", "with"},
    # modern and classical function characters (Chinese has no closed list of short stop words)
    "zh": set("的了是在和有不这我们你他也就都而与之其以可中为个上到地得着要会对从把被于乃者兮矣所"),
}
BULLETS = ("•", "●", "○", "■", "□", "▪", "▫", "※", "·", "-", "*", "–", "‣")
TERMINAL_PUNCT = (".", "!", "?", '"', "'", "。", "！", "？", "”", "…", ":", "：")
POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
LINE_PUNCT = TERMINAL_PUNCT + (";", "；", ")", "）", "」", "』", "》")


def _stop_words() -> set[str]:
    return STOP_WORDS["en"] | STOP_WORDS["zh"]


def gopher_quality(text: str, cfg: GopherConfig) -> str | None:
    ws = words(text)
    n = len(ws)
    if n < cfg.min_words:
        return "gopher:min_words"
    if n > cfg.max_words:
        return "gopher:max_words"
    latin = [w for w in ws if not is_cjk(w)]
    if len(latin) > n / 2:  # mean word length is meaningless for Chinese (1 char = 1 word)
        avg = sum(len(w) for w in latin) / len(latin)
        if not cfg.min_avg_word_length <= avg <= cfg.max_avg_word_length:
            return "gopher:avg_word_length"
    if (text.count("#") + text.count("...") + text.count("…")) / n > cfg.max_symbol_word_ratio:
        return "gopher:symbol_word_ratio"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if lines and sum(ln.lstrip().startswith(BULLETS) for ln in lines) / len(lines) > cfg.max_bullet_lines_ratio:
        return "gopher:bullet_lines"
    if lines and sum(ln.rstrip().endswith(("...", "…")) for ln in lines) / len(lines) > cfg.max_ellipsis_lines_ratio:
        return "gopher:ellipsis_lines"
    if sum(any(c.isalpha() for c in w) for w in ws) / n < cfg.min_alpha_words_ratio:
        return "gopher:alpha_words"
    stop = _stop_words()
    if sum(w.lower() in stop for w in ws) < cfg.min_stop_words:
        return "gopher:stop_words"
    return None


def _dup_stats(items: list[str]) -> tuple[float, float]:
    """(fraction of items that repeat an earlier one, fraction of characters in them)."""
    seen, dup_n, dup_chars = set(), 0, 0
    for it in items:
        if it in seen:
            dup_n += 1
            dup_chars += len(it)
        seen.add(it)
    total = sum(len(it) for it in items)
    return dup_n / max(len(items), 1), dup_chars / max(total, 1)


def _content_lines(text: str, ignore_layout: bool) -> list[str]:
    """Non-empty lines; with `ignore_layout`, without letter-free lines (table borders, `-----` rules)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return [ln for ln in lines if any(c.isalpha() for c in ln)] if ignore_layout else lines


# fixed random odd 64-bit multipliers: a linear hash of small ids collides only with probability ~2^-64
_MULTIPLIERS = np.random.default_rng(0).integers(0, 2**63, size=16, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


class NGrams:
    """Word n-gram statistics of one document, vectorised: words -> int ids, n-grams -> 64-bit keys.

    Keys are random linear hashes of the id window (wrapping uint64 arithmetic); a collision would need
    two different n-grams of the same document to agree on 64 bits.
    """

    def __init__(self, ws: list[str]):
        vocab: dict[str, int] = {}
        self.ids = np.array([vocab.setdefault(w, len(vocab)) for w in ws], dtype=np.uint64)  # [N]
        self.lens = np.array([len(w) for w in ws], dtype=np.int64)  # [N]
        self.total = max(int(self.lens.sum()), 1)

    def keys(self, n: int) -> np.ndarray:
        """[N - n + 1] uint64 keys of the n-grams starting at each position."""
        win = np.lib.stride_tricks.sliding_window_view(self.ids, n)  # [N - n + 1, n]
        mult = _MULTIPLIERS[:n]
        with np.errstate(over="ignore"):
            return (win * mult).sum(axis=1, dtype=np.uint64) + np.uint64(n)

    def top_frac(self, n: int) -> float:
        """Characters of the most frequent n-gram times its count / all word characters (count >= 2)."""
        if len(self.ids) < n:
            return 0.0
        _, first, counts = np.unique(self.keys(n), return_index=True, return_counts=True)
        best = int(np.argmax(counts))
        if counts[best] < 2:  # an n-gram that occurs once is not repetition (matters for short documents)
            return 0.0
        start = int(first[best])
        return int(self.lens[start:start + n].sum()) * int(counts[best]) / self.total

    def dup_frac(self, n: int) -> float:
        """Fraction of word characters covered by occurrences of n-grams seen earlier in the document."""
        if len(self.ids) < n:
            return 0.0
        keys = self.keys(n)
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        starts = np.flatnonzero(first[inverse] < np.arange(len(keys)))  # repeated occurrences
        diff = np.zeros(len(self.ids) + 1, dtype=np.int64)
        np.add.at(diff, starts, 1)
        np.add.at(diff, starts + n, -1)
        covered = np.cumsum(diff[:-1]) > 0  # [N] word inside some repeated n-gram
        return int(self.lens[covered].sum()) / self.total


def gopher_repetition(text: str, cfg: RepetitionConfig) -> str | None:
    if cfg.ignore_layout_lines:  # drop letter-free lines (keeping blank ones, which separate paragraphs)
        text = "\n".join(ln for ln in text.splitlines() if not ln.strip() or any(c.isalpha() for c in ln))
    paras = [p for p in re.split(r"\n{2,}", text.strip()) if p.strip()]
    frac, char_frac = _dup_stats(paras)
    if frac > cfg.dup_para_frac:
        return "repetition:dup_para_frac"
    if char_frac > cfg.dup_para_char_frac:
        return "repetition:dup_para_char_frac"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    frac, char_frac = _dup_stats(lines)
    if frac > cfg.dup_line_frac:
        return "repetition:dup_line_frac"
    if char_frac > cfg.dup_line_char_frac:
        return "repetition:dup_line_char_frac"
    grams = NGrams(words(text))
    for n, thr in zip((2, 3, 4), cfg.top_ngram_char_frac):
        if grams.top_frac(n) > thr:
            return f"repetition:top_{n}gram"
    for n, thr in zip(range(5, 11), cfg.dup_ngram_char_frac):
        if grams.dup_frac(n) > thr:
            return f"repetition:dup_{n}gram"
    return None


def _keep_c4_line(line: str, cfg: C4Config) -> bool:
    low = line.lower()
    if cfg.remove_javascript_lines and "javascript" in low:
        return False
    if cfg.remove_policy_lines and any(p in low for p in POLICY):
        return False
    if cfg.remove_no_terminal_punct_lines and not line.rstrip().endswith(TERMINAL_PUNCT):
        return False
    if len(words(line)) < cfg.min_words_per_line:
        return False
    return max((len(w) for w in line.split()), default=0) <= cfg.max_word_length


def c4(text: str, cfg: C4Config) -> tuple[str, str | None]:
    """C4 rules: (text with bad lines removed, drop reason or None)."""
    low = text.lower()
    if cfg.drop_lorem_ipsum and "lorem ipsum" in low:
        return text, "c4:lorem_ipsum"
    if cfg.drop_curly_bracket and "{" in text:
        return text, "c4:curly_bracket"
    kept = [ln for ln in text.splitlines() if not ln.strip() or _keep_c4_line(ln, cfg)]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).strip("\n")
    if not text.strip():
        return text, "c4:no_lines"
    n_sentences = len(re.findall(r"[.!?]+[\"'”’)]*(?:\s|$)|[。！？]", text))
    if n_sentences < cfg.min_sentences:
        return text, "c4:min_sentences"
    return text, None


def fineweb(text: str, cfg: FineWebConfig) -> str | None:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "fineweb:empty"
    if sum(ln.endswith(LINE_PUNCT) for ln in lines) / len(lines) < cfg.line_punct_thr:
        return "fineweb:line_punct_ratio"
    if sum(len(ln) <= cfg.short_line_length for ln in lines) / len(lines) > cfg.short_line_thr:
        return "fineweb:short_line_ratio"
    _, dup_chars = _dup_stats(_content_lines(text, cfg.ignore_layout_lines))
    if dup_chars > cfg.char_dup_ratio:
        return "fineweb:char_dup_ratio"
    if text.count("\n") / max(len(words(text)), 1) > cfg.new_line_ratio:
        return "fineweb:new_line_ratio"
    return None


def code_rules(text: str, cfg: CodeConfig) -> str | None:
    lines = text.splitlines()
    if len(lines) < cfg.min_lines:
        return "code:min_lines"
    if sum(len(ln) for ln in lines) / len(lines) > cfg.max_avg_line_length:
        return "code:avg_line_length"
    if max(len(ln) for ln in lines) > cfg.max_line_length:
        return "code:max_line_length"
    if sum(c.isalnum() for c in text) / len(text) < cfg.min_alnum_frac:
        return "code:alnum_frac"
    return None


def filter_doc(doc: dict, cfg: DataConfig) -> str | None:
    """Apply every enabled rule group in order; may shorten `doc["text"]` (C4). Returns a drop reason."""
    domain = doc.get("domain") or ""
    if domain == "code":
        return code_rules(doc["text"], cfg.code) if cfg.code.enabled else None
    if cfg.gopher.enabled and domain not in cfg.gopher.skip_domains:
        if reason := gopher_quality(doc["text"], cfg.gopher):
            return reason
    if cfg.repetition.enabled and domain not in cfg.repetition.skip_domains:
        if reason := gopher_repetition(doc["text"], cfg.repetition):
            return reason
    if cfg.c4.enabled and domain not in cfg.c4.skip_domains:
        doc["text"], reason = c4(doc["text"], cfg.c4)
        if reason:
            return reason
    if cfg.fineweb.enabled and domain not in cfg.fineweb.skip_domains:
        if reason := fineweb(doc["text"], cfg.fineweb):
            return reason
    return None
