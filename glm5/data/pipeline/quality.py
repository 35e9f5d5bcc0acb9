"""Stage 7, model-based quality score: a hashed n-gram logistic-regression classifier (torch).

Positives are documents that survived the rule filters and dedup (optionally only `positive_sources`,
like GPT-3's "reference corpus" classifier); negatives are the same documents degraded synthetically
(word salad, shuffled words, character noise, repeated lines, web boilerplate). Features are word (or
CJK character) unigrams and bigrams hashed into `num_buckets` slots: an `EmbeddingBag(num_buckets, 1)`
is exactly a sparse linear model. The trained model is saved as .npz and scores every document with
P(high quality) in [0, 1]; documents below `threshold` are dropped.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch

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


def features(text: str, cfg: QualityConfig) -> np.ndarray:
    """Hashed unigram + bigram ids [F] int64 of the first `max_chars` characters."""
    ws = [w.lower() for w in words(text[: cfg.max_chars])]
    grams = ws + [f"{a} {b}" for a, b in zip(ws, ws[1:])]
    grams.append(f"__len{min(len(ws).bit_length(), 16)}")  # coarse length bucket
    return np.array([zlib.crc32(g.encode("utf-8")) % cfg.num_buckets for g in grams], dtype=np.int64)


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
        f = features(text, self.cfg)
        logit = float(self.weight[f].sum()) / np.sqrt(len(f)) + self.bias
        return float(1.0 / (1.0 + np.exp(-logit)))

    def save(self, path) -> None:
        np.savez(path, weight=self.weight, bias=np.float32(self.bias))

    @classmethod
    def load(cls, path, cfg: QualityConfig) -> "QualityModel":
        z = np.load(path)
        return cls(cfg, z["weight"], float(z["bias"]))


def _batch(feats: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EmbeddingBag inputs: flat ids [sum F], offsets [B], per-sample weights 1/sqrt(F)."""
    lens = [len(f) for f in feats]
    ids = torch.from_numpy(np.concatenate(feats))
    offsets = torch.tensor([0] + lens[:-1]).cumsum(0)
    w = torch.cat([torch.full((n,), 1.0 / np.sqrt(n)) for n in lens])
    return ids, offsets, w


def train(positives: list[str], cfg: QualityConfig) -> tuple[QualityModel, dict]:
    """Train on positives vs their degradations; returns (model, held-out metrics)."""
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    vocab = [w for t in positives[:500] for w in words(t[:2000])] or ["x"]
    texts = positives + [degrade(t, rng, vocab) for t in positives]
    labels = np.array([1.0] * len(positives) + [0.0] * len(positives), np.float32)
    feats = [features(t, cfg) for t in texts]
    is_test = np.array([zlib.crc32(str(i % len(positives)).encode()) % 5 == 0 for i in range(len(texts))])
    bag = torch.nn.EmbeddingBag(cfg.num_buckets, 1, mode="sum")
    torch.nn.init.zeros_(bag.weight)
    bias = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([bag.weight, bias], lr=cfg.lr, weight_decay=cfg.weight_decay)
    train_idx = np.flatnonzero(~is_test)
    for _ in range(cfg.epochs):
        order = train_idx[torch.randperm(len(train_idx)).numpy()]
        for s in range(0, len(order), 256):
            idx = order[s:s + 256]
            ids, offs, w = _batch([feats[i] for i in idx])
            logits = bag(ids, offs, per_sample_weights=w).squeeze(1) + bias  # [B]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels[idx]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    model = QualityModel(cfg, bag.weight.detach().squeeze(1).numpy().copy(), float(bias.item()))
    return model, _metrics(model, [texts[i] for i in np.flatnonzero(is_test)], labels[is_test])


def _metrics(model: QualityModel, texts: list[str], labels: np.ndarray) -> dict:
    scores = np.array([model.score(t) for t in texts])
    acc = float(np.mean((scores >= 0.5) == (labels > 0.5))) if len(texts) else float("nan")
    return {"heldout_docs": len(texts), "heldout_accuracy": round(acc, 4)}
