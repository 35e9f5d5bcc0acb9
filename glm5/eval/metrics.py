"""Metric arithmetic: means with standard errors, the unbiased pass@k estimator, text overlap.

`mean_stderr` is lm-eval's `mean_stderr` (sample standard deviation / sqrt(n)); `pass_at_k` is the
estimator of Chen et al. 2021 (HumanEval paper): 1 - C(n-c, k) / C(n, k), computed as a stable product.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence

Metric = tuple[float, float | None]  # (value, standard error or None when it has none)


def mean_stderr(xs: Sequence[float]) -> Metric:
    n = len(xs)
    if n == 0:
        return float("nan"), None
    mean = sum(xs) / n
    if n < 2:
        return mean, None
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c of them correct) passes."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def normalize_answer(text: str) -> str:
    """Lower case, NFKC, no punctuation or articles, single spaces (SQuAD-style, plus CJK width)."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def words(text: str) -> list[str]:
    """Overlap units: latin words and numbers, and single CJK characters (Chinese has no spaces)."""
    return re.findall(r"[\u4e00-\u9fff]|[^\W\u4e00-\u9fff]+", normalize_answer(text))


def token_f1(prediction: str, reference: str) -> float:
    """Harmonic mean of word precision and recall (SQuAD's F1, CJK-aware)."""
    pred, ref = words(prediction), words(reference)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(ref)
    return 2 * p * r / (p + r)


def keyword_recall(prediction: str, keywords: Sequence[str]) -> float:
    """Fraction of rubric keywords present in the response (normalised substring match)."""
    if not keywords:
        return float("nan")
    text = normalize_answer(prediction)
    return sum(normalize_answer(k) in text for k in keywords) / len(keywords)
