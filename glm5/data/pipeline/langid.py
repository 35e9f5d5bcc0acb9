"""Stage 2, language identification with py3langid (langid.py's model, shipped offline in the wheel).

Keeps documents whose top language is in `languages` with normalised probability >= `min_score`, and
writes the detected language into `doc["lang"]`. Documents whose input domain is in `skip_domains`
(code) keep their `lang` unchecked. The model is loaded once per worker process.
"""

from __future__ import annotations

from functools import lru_cache

from .config import LangIdConfig


@lru_cache(maxsize=1)
def _identifier():
    from py3langid import langid
    return langid.LanguageIdentifier.from_model_file(langid.MODEL_FILE, norm_probs=True)


def detect(text: str, max_chars: int = 2000, aliases: dict[str, str] | None = None) -> tuple[str, float]:
    """(language code, probability) of the most likely language, after merging `aliases`.

    The model separates close varieties (Wu `wuu`, Cantonese `yue` ...); classical poems often land
    there, so their probabilities are summed into the target code before taking the maximum.
    """
    probs: dict[str, float] = {}
    for lang, p in _identifier().rank(text[:max_chars]):
        key = (aliases or {}).get(lang, lang)
        probs[key] = probs.get(key, 0.0) + float(p)
    lang = max(probs, key=probs.__getitem__)
    return lang, probs[lang]


def langid_doc(doc: dict, cfg: LangIdConfig) -> str | None:
    """Set `doc["lang"]`; return a drop reason (`lang:<code>` or `lang_score`) or None."""
    if doc.get("domain") in cfg.skip_domains:
        return None
    lang, score = detect(doc["text"], cfg.max_chars, cfg.aliases)
    doc["lang"] = lang
    if lang not in cfg.languages:
        return f"lang:{lang}"
    if score < cfg.min_score:
        return "lang_score"
    return None
