"""Stages 5-6, deduplication: exact (normalised-text hash) and near-duplicate (MinHash LSH, datasketch).

Per shard (parallel): `exact_key` and `signature` of every surviving document are saved next to it.
Global pass (one process, `global_dedup`): documents are visited in (shard, index) order; a document
is dropped if its exact key was seen, or if the LSH index of the documents *kept so far* returns a
candidate whose estimated Jaccard is >= `verify_threshold`. Greedy "keep the first" (no union-find
chains) means every removed document has a kept twin that really is similar. Shingles: word 5-grams,
or character 5-grams for CJK-dominant text (no spaces to split on). num_perm = bands x rows.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
from datasketch import MinHash, MinHashLSH

from .config import DedupConfig
from .text import cjk_ratio

SCHEME = "affine32"  # datasketch >= 2: 32-bit sha1 shingle hashes, affine permutations mod 2^61-1
_PUNCT = re.compile(r"[^\w\s]")


def exact_key(text: str) -> str:
    """Hash of the text with case and whitespace normalised (so re-wrapped copies are exact dups)."""
    return hashlib.sha1(" ".join(text.lower().split()).encode("utf-8")).hexdigest()[:24]


def shingles(text: str, cfg: DedupConfig) -> set[bytes]:
    """Word n-grams of lower-cased, punctuation-free text; character n-grams for CJK-dominant text."""
    clean = _PUNCT.sub(" ", text.lower())
    if cjk_ratio(text) >= cfg.cjk_ratio:
        seq: list[str] | str = "".join(clean.split())
        n, joiner = cfg.char_ngram, ""
    else:
        seq = clean.split()
        n, joiner = cfg.word_ngram, " "
    if len(seq) <= n:  # shorter than one shingle: the whole text is the single shingle
        return {joiner.join(seq).encode("utf-8")}
    return {joiner.join(seq[i:i + n]).encode("utf-8") for i in range(len(seq) - n + 1)}


def num_perm(cfg: DedupConfig) -> int:
    return cfg.num_bands * cfg.rows_per_band


def signature(text: str, cfg: DedupConfig) -> np.ndarray:
    """MinHash signature [num_perm] uint64 (datasketch, seeded: identical across processes and runs)."""
    m = MinHash(num_perm=num_perm(cfg), seed=cfg.seed, scheme=SCHEME)
    m.update_batch(list(shingles(text, cfg)))
    return m.hashvalues.astype(np.uint64)


def candidate_probability(s: float, cfg: DedupConfig) -> float:
    """P(two documents with Jaccard s share at least one band) = 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - s ** cfg.rows_per_band) ** cfg.num_bands


def global_dedup(keys: list[str], sigs: np.ndarray, cfg: DedupConfig, progress: bool = False) -> dict[int, tuple[str, int]]:
    """Decide removals over all documents in global order.

    keys: exact keys [N]; sigs: [N, num_perm] uint64 (ignored when MinHash is off).
    Returns {global index: (reason, index of the kept duplicate)}.
    """
    from tqdm import tqdm

    removed: dict[int, tuple[str, int]] = {}
    first_seen: dict[str, int] = {}
    lsh = MinHashLSH(num_perm=num_perm(cfg), params=(cfg.num_bands, cfg.rows_per_band)) if cfg.minhash else None
    for i in tqdm(range(len(keys)), desc="dedup (global)", disable=not progress, mininterval=1.0):
        if cfg.exact and keys[i] in first_seen:
            removed[i] = ("exact_dup", first_seen[keys[i]])
            continue
        first_seen.setdefault(keys[i], i)
        if lsh is None:
            continue
        m = MinHash(num_perm=num_perm(cfg), seed=cfg.seed, hashvalues=sigs[i], scheme=SCHEME)
        twin = _best_candidate(lsh.query(m), sigs, sigs[i], cfg.verify_threshold)
        if twin is not None:
            removed[i] = ("near_dup", twin)
        else:
            lsh.insert(i, m, check_duplication=False)
    return removed


def _best_candidate(cands: list[int], sigs: np.ndarray, sig: np.ndarray, threshold: float) -> int | None:
    """The earliest candidate whose estimated Jaccard (fraction of equal hash values) >= threshold."""
    best = None
    for c in cands:
        if threshold <= 0 or float(np.mean(sigs[c] == sig)) >= threshold:
            best = c if best is None else min(best, c)
    return best
