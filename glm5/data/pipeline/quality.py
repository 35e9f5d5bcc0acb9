"""Stage 7, model-based quality score: a hashed n-gram logistic-regression classifier (numpy).

Positives are documents that survived the rule filters and dedup (optionally only `positive_sources`,
like GPT-3's "reference corpus" classifier); negatives are the same documents degraded synthetically
(word salad, shuffled words, character noise, repeated lines, web boilerplate). Features are word (or
CJK character) unigrams and bigrams hashed into `num_buckets` slots, plus a few shape features; the
model is a sparse logistic regression trained with Adagrad. The trained model is saved as .npz and scores every document with
P(high quality) in [0, 1]; documents below `threshold` are dropped.
"""

from __future__ import annotations

import random
import zlib

import numpy as np

from .config import QualityConfig
from .text import words

BOILERPLATE = [
    "Click here to subscribe to our newsletter!", "Home | About Us | Contact | Privacy Policy",
    "Copyright (c) All rights reserved.", "Share on Facebook Share on Twitter", "Read more >>",
    "This website uses cookies to improve your experience. Accept", "Login | Register | Forgot password?",
    "BUY NOW!!! LIMITED OFFER!!! FREE SHIPPING", "Posted by admin at 12:00 AM | 0 comments",
    "点击这里订阅", "首页 | 关于我们 | 联系我们", "版权所有 违者必究", "登录 | 注册 | 忘记密码", "上一篇 下一篇 返回顶部",
    "免费领取!!! 限时优惠!!!", "分享到微信 分享到微博", "阅读全文 >>",
]


def features(text: str, cfg: QualityConfig) -> tuple[np.ndarray, np.ndarray]:
    """Hashed feature ids [F] int64 and weights [F] float32 of the first `max_chars` characters.

    N-grams (word/CJK-char unigrams + bigrams) share a total weight of 1, so the logit is their mean
    weight (length-independent); three "shape" features get weight 1 each: they carry what a bag of
    n-grams cannot see (repetition = low distinct-bigram ratio, symbol noise, line structure). No length
    feature: with one, the model learnt "short = junk" (boilerplate negatives are short) and rejected
    short real fortunes and poems.
    """
    head = text[: cfg.max_chars]
    ws = [w.lower() for w in words(head)] or [""]
    bigrams = [f"{a} {b}" for a, b in zip(ws, ws[1:])]
    grams = ws + bigrams
    distinct = len(set(bigrams)) / max(len(bigrams), 1)
    symbols = sum(not (c.isalnum() or c.isspace()) for c in head) / max(len(head), 1)
    line_len = len(head) / max(head.count("\n") + 1, 1)
    shape = [f"__distinct{int(distinct * 10)}", f"__symbols{min(int(symbols * 20), 19)}",
             f"__linelen{min(int(line_len).bit_length(), 12)}"]
    ids = [zlib.crc32(g.encode("utf-8")) % cfg.num_buckets for g in grams + shape]
    weights = [1.0 / len(grams)] * len(grams) + [1.0] * len(shape)
    return np.array(ids, dtype=np.int64), np.array(weights, dtype=np.float32)


def _join(ws: list[str]) -> str:
    """Re-join words: without spaces when most are single (CJK) characters."""
    return ("" if sum(len(w) == 1 for w in ws) > 0.5 * len(ws) else " ").join(ws)


def degrade(text: str, rng: random.Random, vocab: list[str]) -> str:
    """A synthetic low-quality version of `text` (one of five corruptions, chosen by `rng`)."""
    ws = words(text) or ["x"]
    kind = rng.randrange(5)
    if kind == 0:  # word salad from the corpus unigram distribution
        return _join([rng.choice(vocab) for _ in range(len(ws))])
    if kind == 1:  # shuffled words: right vocabulary, no syntax
        rng.shuffle(ws)
        return _join(ws)
    if kind == 2:  # character noise
        chars = list(text)
        pool = "#$%&*@^~|<>{}[]_=+0123456789"
        for i in rng.sample(range(len(chars)), k=len(chars) // 4):
            chars[i] = rng.choice(pool)
        return "".join(chars)
    if kind == 3:  # one line repeated
        lines = [ln for ln in text.splitlines() if ln.strip()] or [text]
        return "\n".join([rng.choice(lines)] * rng.randint(5, 30))
    lines = [rng.choice(BOILERPLATE) for _ in range(rng.randint(4, 12))]  # boilerplate around a fragment
    lines.insert(rng.randrange(len(lines)), _join(ws[: rng.randint(3, 12)]))
    return "\n".join(lines)


class QualityModel:
    """Sparse logistic regression over hashed n-grams; `score(text)` -> P(high quality)."""

    def __init__(self, cfg: QualityConfig, weight: np.ndarray | None = None, bias: float = 0.0):
        self.cfg = cfg
        self.weight = np.zeros(cfg.num_buckets, np.float32) if weight is None else weight
        self.bias = float(bias)

    def score(self, text: str) -> float:
        ids, w = features(text, self.cfg)
        logit = float(self.weight[ids] @ w) + self.bias
        return float(1.0 / (1.0 + np.exp(-logit)))

    def save(self, path) -> None:
        np.savez(path, weight=self.weight, bias=np.float32(self.bias))

    @classmethod
    def load(cls, path, cfg: QualityConfig) -> "QualityModel":
        z = np.load(path)
        return cls(cfg, z["weight"], float(z["bias"]))


def _batch(feats: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat ids [sum F], weights [sum F] and the document index of each entry [sum F]."""
    ids = np.concatenate([i for i, _ in feats])
    vals = np.concatenate([w for _, w in feats])
    doc = np.repeat(np.arange(len(feats)), [len(i) for i, _ in feats])
    return ids, vals, doc


def train(positives: list[str], cfg: QualityConfig) -> tuple[QualityModel, dict]:
    """Train on positives vs their degradations (Adagrad on the logistic loss); (model, held-out metrics).

    The gradient of a sparse linear model touches only the active buckets, so a step is two
    `bincount`s and a dense Adagrad update over `num_buckets` floats (milliseconds).
    """
    rng, np_rng = random.Random(cfg.seed), np.random.default_rng(cfg.seed)
    vocab = [w for t in positives[:500] for w in words(t[:2000])] or ["x"]
    texts = positives + [degrade(t, rng, vocab) for t in positives]
    labels = np.array([1.0] * len(positives) + [0.0] * len(positives))
    feats = [features(t, cfg) for t in texts]
    # hold out a fixed 20% of source documents (each with its degraded twin)
    is_test = np.array([zlib.crc32(str(i % len(positives)).encode()) % 5 == 0 for i in range(len(texts))])
    weight, bias = np.zeros(cfg.num_buckets), 0.0
    g2, b2 = np.full(cfg.num_buckets, 1e-8), 1e-8
    train_idx = np.flatnonzero(~is_test)
    for _ in range(cfg.epochs):
        order = np_rng.permutation(train_idx)
        for s in range(0, len(order), 64):
            idx = order[s:s + 64]
            ids, vals, doc = _batch([feats[i] for i in idx])
            logits = np.bincount(doc, weights=weight[ids] * vals, minlength=len(idx)) + bias  # [B]
            err = 1.0 / (1.0 + np.exp(-logits)) - labels[idx]  # dLoss/dlogit [B]
            grad = np.bincount(ids, weights=err[doc] * vals, minlength=cfg.num_buckets) / len(idx)
            grad += cfg.weight_decay * weight
            g2 += grad**2
            weight -= cfg.lr * grad / np.sqrt(g2)
            b2 += err.mean() ** 2
            bias -= cfg.lr * err.mean() / np.sqrt(b2)
    model = QualityModel(cfg, weight.astype(np.float32), bias)
    return model, _metrics(model, [texts[i] for i in np.flatnonzero(is_test)], labels[is_test])


def _metrics(model: QualityModel, texts: list[str], labels: np.ndarray) -> dict:
    """Held-out accuracy at 0.5, and at the configured threshold: kept positives, dropped negatives."""
    scores = np.array([model.score(t) for t in texts])
    pos, thr = labels > 0.5, model.cfg.threshold
    return {"heldout_docs": len(texts), "heldout_accuracy": round(float(np.mean((scores >= 0.5) == pos)), 4),
            "heldout_positive_kept": round(float(np.mean(scores[pos] >= thr)), 4),
            "heldout_negative_dropped": round(float(np.mean(scores[~pos] < thr)), 4)}
