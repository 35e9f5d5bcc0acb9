"""The global dedup phase over partitions, as jobs for any executor (`dedup.py` holds the rule itself).

Every step reads and writes files under `work/dedup/p<P>/` atomically and is skipped when its output exists,
so the phase resumes at job granularity. With P = `run.dedup_partitions`:
  1. bucket (per shard)       exact keys and LSH band records, split by partition -> `buckets/NNNNN/`
  2. exact (per partition)    first-copy exact duplicates among that partition's keys -> `exact/PPP.npz`
  3. lsh (per partition)      band records of exact survivors -> candidate pairs -> verified pairs, and
                              their union-find components -> `lsh/PPP.npz`
  4. merge (driver)           union-find over the partitions' (node, root) pairs -> `components.npz`
  5. keep (per partition)     the keep rule over the components whose root falls in the partition
                              -> `keep/PPP.json`
Memory per job: one shard (1), 1/P of the keys (2) or band records (3, plus the signatures of the
documents in its candidate pairs, read from the shards' memory-mapped `signatures.npy`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from glm5.core.io import atomic_dir, atomic_write_json

from .config import DataConfig
from .dedup import (band_records, candidate_pairs, components, exact_dups, key_partition, keep_rule,
                    verify_pairs)
from .executor import Executor


def _save_npz(path: Path, **arrays) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def bucket_shard(cfg: DataConfig, local_dir: Path, offset: int, out_dir: Path) -> None:
    """Step 1: one shard's exact keys and band records, one file per partition."""
    k = json.loads((local_dir / "keys.json").read_text())
    parts, idx = cfg.run.dedup_partitions, np.arange(offset, offset + len(k["ids"]), dtype=np.int64)
    with atomic_dir(out_dir) as tmp:
        if cfg.dedup.exact:
            split: dict[int, list] = {}
            for g, key in zip(idx.tolist(), k["keys"]):
                split.setdefault(key_partition(key, parts), []).append((g, key))
            for p, items in split.items():
                atomic_write_json(tmp / f"keys-{p:03d}.json", items)
        if cfg.dedup.minhash and len(idx):
            sigs = np.load(local_dir / "signatures.npy")
            for p, (i, band, vals) in band_records(idx, sigs, cfg.dedup, parts).items():
                _save_npz(tmp / f"bands-{p:03d}.npz", idx=i, band=band, vals=vals)


def exact_partition(cfg: DataConfig, work: Path, num_shards: int, p: int) -> None:
    """Step 2: exact duplicates among partition p's keys: {index: first index with the key}."""
    items = [it for s in range(num_shards) if (f := _bucket(cfg, work, s) / f"keys-{p:03d}.json").is_file()
             for it in json.loads(f.read_text())]
    dups = sorted(exact_dups(np.array([g for g, _ in items], np.int64), [key for _, key in items]).items())
    _save_npz(_dir(cfg, work) / "exact" / f"{p:03d}.npz", idx=np.array([g for g, _ in dups], np.int64).reshape(-1),
              twin=np.array([t for _, t in dups], np.int64).reshape(-1))


def lsh_partition(cfg: DataConfig, work: Path, offsets: list[int], p: int) -> None:
    """Step 3: verified candidate pairs of partition p's band records (exact duplicates left out) and
    the union-find components of those pairs."""
    num_shards, parts = len(offsets) - 1, cfg.run.dedup_partitions
    recs = [np.load(f) for s in range(num_shards) if (f := _bucket(cfg, work, s) / f"bands-{p:03d}.npz").is_file()]
    r = cfg.dedup.rows_per_band
    idx = np.concatenate([x["idx"] for x in recs]) if recs else np.zeros(0, np.int64)
    band = np.concatenate([x["band"] for x in recs]) if recs else np.zeros(0, np.int32)
    vals = np.concatenate([x["vals"] for x in recs]) if recs else np.zeros((0, r), np.uint64)
    gone = np.concatenate([np.zeros(0, np.int64)] + [np.load(_dir(cfg, work) / "exact" / f"{q:03d}.npz")["idx"]
                                                     for q in range(parts) if cfg.dedup.exact])  # 8 B per dup
    keep = ~np.isin(idx, gone)
    pairs = candidate_pairs(idx[keep], band[keep], vals[keep])
    sig_a, sig_b = load_signatures(work, offsets, pairs[:, 0]), load_signatures(work, offsets, pairs[:, 1])
    edges = verify_pairs(pairs, sig_a, sig_b, cfg.dedup.verify_threshold)
    comp = components(edges)
    nodes = np.array(sorted(comp), np.int64)
    _save_npz(_dir(cfg, work) / "lsh" / f"{p:03d}.npz", edges=edges.reshape(-1, 2),
              nodes=nodes, roots=np.array([comp[n] for n in nodes.tolist()], np.int64))


def load_signatures(work: Path, offsets: list[int], idx: np.ndarray) -> np.ndarray:
    """Signatures [len(idx), num_perm] of global document indices, read from memory-mapped shard files."""
    shard = np.searchsorted(np.asarray(offsets), idx, side="right") - 1
    out = None
    for s in np.unique(shard).tolist():
        sigs = np.load(work / "local" / f"{s:05d}" / "signatures.npy", mmap_mode="r")
        m = shard == s
        if out is None:
            out = np.zeros((len(idx), sigs.shape[1]), np.uint64)
        out[m] = sigs[idx[m] - offsets[s]]
    return out if out is not None else np.zeros((0, 1), np.uint64)


def keep_partition(cfg: DataConfig, work: Path, p: int) -> None:
    """Step 5: the keep rule over the components whose root r has r % P == p."""
    c = np.load(_dir(cfg, work) / "components.npz")
    nodes, roots = c["nodes"], c["roots"]
    parts = cfg.run.dedup_partitions
    edges = [np.load(_dir(cfg, work) / "lsh" / f"{q:03d}.npz")["edges"] for q in range(parts)]
    e = np.concatenate(edges) if edges else np.zeros((0, 2), np.int64)
    if len(e):
        root = roots[np.searchsorted(nodes, e[:, 0])]
        e = e[root % parts == p]
    atomic_write_json(_dir(cfg, work) / "keep" / f"{p:03d}.json",
                      {str(g): t for g, t in sorted(keep_rule(e).items())})


def _dir(cfg: DataConfig, work: Path) -> Path:
    """The phase's files for this partition count (so `run.dedup_partitions` may change between a killed
    run and its rerun: it never changes the decisions)."""
    return work / "dedup" / f"p{cfg.run.dedup_partitions}"


def _bucket(cfg: DataConfig, work: Path, s: int) -> Path:
    return _dir(cfg, work) / "buckets" / f"{s:05d}"


def run_dedup(cfg: DataConfig, work: Path, num_shards: int,
              executor: Executor) -> tuple[dict[int, tuple[str, int]], list[int]]:
    """Steps 1-5; returns {global index: (reason, global index of the kept twin)} and the shards' first
    global indices (offsets [num_shards + 1])."""
    d, parts = _dir(cfg, work), cfg.run.dedup_partitions
    for sub in ("buckets", "exact", "lsh", "keep"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    counts = [json.loads((work / "local" / f"{s:05d}" / "stats.json").read_text())["stages"]["signatures"]["out"]
              for s in range(num_shards)]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    todo = [s for s in range(num_shards) if not _bucket(cfg, work, s).is_dir()]
    executor.map(bucket_shard, [(cfg, work / "local" / f"{s:05d}", offsets[s], _bucket(cfg, work, s)) for s in todo],
                 [f"dedup bucket shard {s:05d}" for s in todo], "dedup: bucket")
    removed: dict[int, tuple[str, int]] = {}
    if cfg.dedup.exact:
        todo = [p for p in range(parts) if not (d / "exact" / f"{p:03d}.npz").is_file()]
        executor.map(exact_partition, [(cfg, work, num_shards, p) for p in todo],
                     [f"dedup exact partition {p:03d}" for p in todo], "dedup: exact")
        for p in range(parts):
            x = np.load(d / "exact" / f"{p:03d}.npz")
            removed.update({g: ("exact_dup", t) for g, t in zip(x["idx"].tolist(), x["twin"].tolist())})
    if cfg.dedup.minhash:
        todo = [p for p in range(parts) if not (d / "lsh" / f"{p:03d}.npz").is_file()]
        executor.map(lsh_partition, [(cfg, work, offsets, p) for p in todo],
                     [f"dedup lsh partition {p:03d}" for p in todo], "dedup: lsh")
        if not (d / "components.npz").is_file():
            local = [np.load(d / "lsh" / f"{p:03d}.npz") for p in range(parts)]
            pairs = np.concatenate([np.stack([x["nodes"], x["roots"]], axis=1) for x in local])
            comp = components(pairs)
            nodes = np.array(sorted(comp), np.int64)
            _save_npz(d / "components.npz", nodes=nodes, roots=np.array([comp[n] for n in nodes.tolist()], np.int64))
        todo = [p for p in range(parts) if not (d / "keep" / f"{p:03d}.json").is_file()]
        executor.map(keep_partition, [(cfg, work, p) for p in todo], [f"dedup keep partition {p:03d}" for p in todo],
                     "dedup: keep")
        for p in range(parts):
            removed.update({int(g): ("near_dup", t) for g, t in
                            json.loads((d / "keep" / f"{p:03d}.json").read_text()).items()})
    return dict(sorted(removed.items())), offsets
