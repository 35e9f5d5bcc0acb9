"""MinHash LSH dedup on planted near-duplicates with known (exactly computed) shingle Jaccard.

Base documents of random words get variants with k words replaced (k spread so that true Jaccard
covers ~0.3..1.0). Requirements: recall >= 0.95 over variants with Jaccard >= 0.8, and no removed
document whose true Jaccard with the kept twin it was matched to is below 0.5.
"""

import random

import numpy as np

from glm5.data.pipeline.config import DedupConfig
from glm5.data.pipeline.dedup import candidate_probability, exact_key, global_dedup, shingles, signature


def _jaccard(a: str, b: str, cfg: DedupConfig) -> float:
    sa, sb = shingles(a, cfg), shingles(b, cfg)
    return len(sa & sb) / len(sa | sb)


def _planted(num_base: int, variants: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """Docs [bases..., variants...] and, for each doc, the index of its base (itself for bases)."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    bases = [[rng.choice(vocab) for _ in range(200)] for _ in range(num_base)]
    docs, base_of = [" ".join(b) for b in bases], list(range(num_base))
    for b, words in enumerate(bases):
        for _ in range(variants):
            v = list(words)
            for pos in rng.sample(range(len(v)), rng.randint(0, 16)):
                v[pos] = rng.choice(vocab)
            docs.append(" ".join(v))
            base_of.append(b)
    return docs, base_of


def test_lsh_probability_formula():
    cfg = DedupConfig(num_bands=20, rows_per_band=5)
    assert candidate_probability(0.8, cfg) > 0.999
    assert abs(candidate_probability(0.5, cfg) - (1 - (1 - 0.5**5) ** 20)) < 1e-12
    datatrove = DedupConfig(num_bands=14, rows_per_band=8)
    assert abs(candidate_probability(0.8, datatrove) - 0.924) < 0.001  # the value datatrove documents


def test_minhash_recall_and_precision_on_planted_near_duplicates():
    cfg = DedupConfig()
    docs, base_of = _planted(num_base=60, variants=5)
    keys = [exact_key(d) for d in docs]
    sigs = np.stack([signature(d, cfg) for d in docs])  # [N, num_perm]
    removed = global_dedup(keys, sigs, cfg)
    jac = {i: _jaccard(docs[i], docs[base_of[i]], cfg) for i in range(60, len(docs))}
    high = [i for i, j in jac.items() if j >= 0.8 and j < 1.0]
    assert len(high) > 50 and any(j < 0.5 for j in jac.values())  # the planted range is wide
    recall = sum(i in removed for i in high) / len(high)
    assert recall >= 0.95, recall
    for i, (reason, twin) in removed.items():
        assert _jaccard(docs[i], docs[twin], cfg) >= 0.5, (i, twin, reason)
        assert twin < i and twin not in removed  # matched to a document that is kept
    assert not any(b in removed for b in range(60))  # bases come first and are unrelated to each other


def test_exact_dedup_ignores_case_and_whitespace_and_cjk_shingles():
    cfg = DedupConfig(minhash=False)
    docs = ["Hello  World\nagain", "hello world again", "something else"]
    removed = global_dedup([exact_key(d) for d in docs], np.zeros((3, 1), np.uint64), cfg)
    assert removed == {1: ("exact_dup", 0)}
    zh = shingles("床前明月光，疑是地上霜", DedupConfig(char_ngram=5))
    assert "床前明月光".encode() in zh and len(zh) == 6  # 10 characters (punctuation removed) -> 6 5-grams


def test_chinese_near_duplicates_use_character_shingles():
    cfg = DedupConfig()
    poem = ("床前明月光，疑是地上霜。举头望明月，低头思故乡。" * 3 + "春眠不觉晓，处处闻啼鸟。夜来风雨声，花落知多少。" * 3
            + "白日依山尽，黄河入海流。欲穷千里目，更上一层楼。")
    variant = poem.replace("黄河入海流", "长江入海流")  # one phrase changed: Jaccard stays high
    other = "红豆生南国，春来发几枝。愿君多采撷，此物最相思。" * 4
    docs = [poem, variant, other]
    sigs = np.stack([signature(d, cfg) for d in docs])
    assert _jaccard(poem, variant, cfg) >= 0.8
    assert global_dedup([exact_key(d) for d in docs], sigs, cfg) == {1: ("near_dup", 0)}
