"""Stages 5-6, deduplication: exact (normalised-text hash) and near-duplicate (MinHash LSH).

Per shard (parallel): `exact_key` and `signature` of every surviving document are saved next to it.
Keep rule (global order = (shard, index)): a document is an exact duplicate if an earlier document has
its exact key (its twin is the first such). Among the rest, a document is a near duplicate if an
earlier document that is *kept* shares an LSH band with it and has estimated Jaccard >= `verify_threshold`;
its twin is the earliest such kept document. Greedy "keep the first" (no chains through removed
documents) means every removed document has a kept twin that really is similar. Shingles: word 5-grams,
or character 5-grams for CJK-dominant text (no spaces to split on). num_perm = bands x rows.

The rule is computed in pieces that run the same way in one process (`global_dedup`) or spread over
partitions (`dedup_shuffle.py`, any executor): `exact_dups` per key partition; `band_records` ->
`candidate_pairs` -> `verify_pairs` per band partition (documents sharing a band's values exactly: the
candidates an LSH index returns); `components` (union-find) per partition, merged by `components` again;
then `keep_rule` per connected component of the verified-pair graph (a document's fate depends only on
its component, so components are independent).
"""

from __future__ import annotations

import hashlib
import re

import numpy as np
from datasketch import MinHash

from .config import DedupConfig
from .text import cjk_ratio

SCHEME = "affine32"  # datasketch >= 2: 32-bit sha1 shingle hashes, affine permutations mod 2^61-1
_PUNCT = re.compile(r"[^\w\s]")
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit constant: spreads band values over partitions


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


def key_partition(key: str, num_partitions: int) -> int:
    """The partition an exact key is shuffled to (stable across processes and machines)."""
    return int(key[:8], 16) % num_partitions


def exact_dups(idx: np.ndarray, keys: list[str]) -> dict[int, int]:
    """{global index: index of the first document with the same key} for every later copy.

    idx: global indices [M] (any order) of documents whose keys are `keys` [M]; a key's copies must all
    be in the same call (one key partition)."""
    first: dict[str, int] = {}
    out: dict[int, int] = {}
    for i in np.argsort(idx, kind="stable"):
        g, k = int(idx[i]), keys[i]
        if k in first:
            out[g] = first[k]
        else:
            first[k] = g
    return out


def band_records(idx: np.ndarray, sigs: np.ndarray, cfg: DedupConfig, num_partitions: int):
    """LSH band records of documents `idx` [N] with signatures `sigs` [N, b*r], split by partition.

    Returns {partition: (idx [M] int64, band [M] int32, values [M, r] uint64)}; a band's records with equal
    values always land in the same partition."""
    n, b, r = len(idx), cfg.num_bands, cfg.rows_per_band
    vals = sigs.reshape(n, b, r)  # [N, b, r]
    band = np.broadcast_to(np.arange(b, dtype=np.int32), (n, b))  # [N, b]
    with np.errstate(over="ignore"):
        h = (vals * _MIX).sum(axis=2, dtype=np.uint64) ^ band.astype(np.uint64)  # [N, b], wraps mod 2^64
    part = (h % np.uint64(num_partitions)).astype(np.int64)
    rec_idx = np.broadcast_to(np.asarray(idx, np.int64)[:, None], (n, b))
    out = {}
    for p in np.unique(part):
        m = part == p
        out[int(p)] = (rec_idx[m], band[m], vals[m])
    return out


def candidate_pairs(idx: np.ndarray, band: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """Pairs [P, 2] (i < j, unique, sorted) of documents whose values are equal in some band."""
    if len(idx) == 0:
        return np.zeros((0, 2), np.int64)
    order = np.lexsort((idx, *vals.T[::-1], band))  # by band, then values, then index
    band, vals, idx = band[order], vals[order], idx[order]
    same = (band[1:] == band[:-1]) & (vals[1:] == vals[:-1]).all(axis=1)
    starts = np.flatnonzero(np.concatenate([[True], ~same]))
    ends = np.append(starts[1:], len(idx))
    pairs = []
    for s, e in zip(starts, ends):
        if e - s > 1:
            members = np.unique(idx[s:e])
            a, c = np.triu_indices(len(members), k=1)
            pairs.append(np.stack([members[a], members[c]], axis=1))
    if not pairs:
        return np.zeros((0, 2), np.int64)
    return np.unique(np.concatenate(pairs), axis=0)


def verify_pairs(pairs: np.ndarray, sig_a: np.ndarray, sig_b: np.ndarray, threshold: float) -> np.ndarray:
    """The pairs whose estimated Jaccard (fraction of equal hash values) >= threshold (0 = all)."""
    if threshold <= 0 or len(pairs) == 0:
        return pairs
    return pairs[(sig_a == sig_b).mean(axis=1) >= threshold]


def components(edges: np.ndarray) -> dict[int, int]:
    """Union-find over edges [E, 2]: {node: smallest node of its connected component}.

    Merging partitions: the (node, root) pairs of several calls are themselves edges; `components` of
    their concatenation is the components of all the partitions' edges together."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        root = x
        while parent.setdefault(root, root) != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    for a, b in edges.tolist():
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in parent}


def keep_rule(edges: np.ndarray) -> dict[int, int]:
    """{node: twin} of near duplicates: visiting nodes in order, a node with a kept earlier neighbour is
    removed (twin = the earliest kept one), else kept. `edges` [E, 2] hold whole components."""
    earlier: dict[int, list[int]] = {}
    for a, b in edges.tolist():
        lo, hi = min(a, b), max(a, b)
        earlier.setdefault(hi, []).append(lo)
        earlier.setdefault(lo, [])
    removed: dict[int, int] = {}
    for j in sorted(earlier):
        kept = [i for i in earlier[j] if i not in removed]
        if kept:
            removed[j] = min(kept)
    return removed


def near_dups(idx: np.ndarray, sigs: np.ndarray, cfg: DedupConfig) -> np.ndarray:
    """Verified candidate pairs among documents `idx` with signatures `sigs` (one partition)."""
    recs = band_records(idx, sigs, cfg, 1).get(0)
    if recs is None:
        return np.zeros((0, 2), np.int64)
    pairs = candidate_pairs(*recs)
    row = {int(g): k for k, g in enumerate(idx)}
    a = sigs[[row[int(g)] for g in pairs[:, 0]]]
    b = sigs[[row[int(g)] for g in pairs[:, 1]]]
    return verify_pairs(pairs, a, b, cfg.verify_threshold)


def global_dedup(keys: list[str], sigs: np.ndarray, cfg: DedupConfig) -> dict[int, tuple[str, int]]:
    """Decide removals over all documents in global order, in one process (one partition).

    keys: exact keys [N]; sigs: [N, num_perm] uint64 (ignored when MinHash is off).
    Returns {global index: (reason, index of the kept duplicate)}.
    """
    idx = np.arange(len(keys), dtype=np.int64)
    removed: dict[int, tuple[str, int]] = {}
    if cfg.exact:
        removed = {g: ("exact_dup", t) for g, t in exact_dups(idx, keys).items()}
    if cfg.minhash and len(keys):
        alive = np.array([g for g in idx if int(g) not in removed], np.int64)
        for g, t in keep_rule(near_dups(alive, sigs[alive], cfg)).items():
            removed[g] = ("near_dup", t)
    return dict(sorted(removed.items()))
