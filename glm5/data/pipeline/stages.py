"""Per-shard work of the pipeline, run as executor jobs: the local pass, the quality sample and training,
the final pass.

Local pass (`local_shard`): normalise -> langid -> rule filters -> PII -> exact key + MinHash signature.
Final pass (`final_shard`): drop global duplicates -> quality score/threshold -> domain tags -> write.
Each pass writes its outputs atomically and a stats file last, which marks the shard as done. Stats
carry per-stage in/out counts, input bytes and seconds, so throughput per stage can be computed.
"""

from __future__ import annotations

import heapq
import json
import os
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

from glm5.core.io import atomic_dir, atomic_write_json

from .config import DataConfig, QualityConfig
from .dedup import exact_key, signature
from .domain import tag_doc
from .filters import filter_doc
from .langid import langid_doc
from .normalize import normalize_doc
from .pii import redact
from .quality import QualityModel
from .shards import read_jsonl, write_jsonl


class StageStats:
    """Counts per stage: documents in/out, bytes in, seconds; drop reasons as `stage:reason`."""

    def __init__(self):
        self.stages: dict[str, dict] = {}
        self.drops: Counter = Counter()

    def add(self, stage: str, n_in: int, n_out: int, bytes_in: int, seconds: float) -> None:
        s = self.stages.setdefault(stage, {"in": 0, "out": 0, "bytes_in": 0, "seconds": 0.0})
        s["in"] += n_in
        s["out"] += n_out
        s["bytes_in"] += bytes_in
        s["seconds"] += seconds

    def to_dict(self) -> dict:
        return {"stages": self.stages, "drops": dict(sorted(self.drops.items()))}


def _nbytes(docs: list[dict]) -> int:
    return sum(len(d["text"].encode("utf-8")) for d in docs)


def run_stage(name: str, docs: list[dict], fn, stats: StageStats, excluded: list[dict]) -> list[dict]:
    """Apply `fn(doc) -> drop reason | None` to every doc; dropped docs go to `excluded`."""
    t0, b0, kept = time.perf_counter(), _nbytes(docs), []
    for d in docs:
        reason = fn(d)
        if reason is None:
            kept.append(d)
        else:
            stats.drops[f"{name}:{reason}"] += 1
            excluded.append(exclusion(d, name, reason))
    stats.add(name, len(docs), len(kept), b0, time.perf_counter() - t0)
    return kept


def exclusion(doc: dict, stage: str, reason: str, **extra) -> dict:
    """The exclusion record of a dropped document (with its quality score once it has one, to review
    thresholds)."""
    if "quality" in doc:
        extra["quality"] = doc["quality"]
    return {"id": doc["id"], "source": doc.get("source"), "stage": stage, "reason": reason, **extra,
            "text": doc["text"]}


def local_shard(cfg: DataConfig, in_path: Path, out_dir: Path) -> dict:
    """Local pass over one input shard into `out_dir` (written atomically as a whole directory)."""
    docs, excluded, stats = list(read_jsonl(in_path)), [], StageStats()
    docs = run_stage("normalize", docs, lambda d: normalize_doc(d, cfg.normalize), stats, excluded)
    if cfg.langid.enabled:
        docs = run_stage("langid", docs, lambda d: langid_doc(d, cfg.langid), stats, excluded)
    docs = run_stage("filters", docs, lambda d: filter_doc(d, cfg), stats, excluded)
    pii_counts: dict = {}
    if cfg.pii.enabled:
        def _pii(d):
            d["text"] = redact(d["text"], cfg.pii, pii_counts)
        docs = run_stage("pii", docs, _pii, stats, excluded)
    t0 = time.perf_counter()
    keys = [exact_key(d["text"]) for d in docs]
    sigs = np.stack([signature(d["text"], cfg.dedup) for d in docs]) if docs and cfg.dedup.minhash else None
    stats.add("signatures", len(docs), len(docs), _nbytes(docs), time.perf_counter() - t0)
    with atomic_dir(out_dir) as tmp:
        write_jsonl(tmp / "docs.jsonl.gz", docs)
        write_jsonl(tmp / "excluded.jsonl.gz", excluded)
        atomic_write_json(tmp / "keys.json", {"ids": [d["id"] for d in docs], "keys": keys})
        if sigs is not None:
            np.save(tmp / "signatures.npy", sigs)  # [n_docs, num_perm] uint64
        atomic_write_json(tmp / "stats.json", {**stats.to_dict(), "pii": pii_counts})
    return json.loads((out_dir / "stats.json").read_text())


_QUALITY_MODELS: dict[str, QualityModel] = {}  # per worker process: load the model once


def _load_quality(path: str, cfg: QualityConfig) -> QualityModel:
    key = f"{path}@{os.stat(path).st_mtime_ns}"  # a retrained model at the same path is reloaded
    if key not in _QUALITY_MODELS:
        _QUALITY_MODELS[key] = QualityModel.load(path, cfg)
    return _QUALITY_MODELS[key]


def final_shard(cfg: DataConfig, index: int, local_dir: Path, removed: dict[int, list], quality_path: str | None,
                out_root: Path) -> dict:
    """Final pass over one shard: global dedup decisions, quality, domain; writes data + exclusions."""
    docs, stats = list(read_jsonl(local_dir / "docs.jsonl.gz")), StageStats()
    excluded = list(read_jsonl(local_dir / "excluded.jsonl.gz"))
    docs = _dedup_stage(docs, removed, stats, excluded)
    if quality_path is not None:
        quality_model = _load_quality(quality_path, cfg.quality)
        def _quality(d):
            d["quality"] = round(quality_model.score(d["text"]), 4)
            return None if d["quality"] >= cfg.quality.threshold else "below_threshold"
        docs = run_stage("quality", docs, _quality, stats, excluded)
    agreement: Counter = Counter()
    if cfg.domain.enabled:
        def _domain(d):
            given = d.get("domain") or ""
            agreement[f"{given or '-'}->{tag_doc(d, cfg.domain)}"] += 1
        docs = run_stage("domain", docs, _domain, stats, excluded)
    for d in docs:
        d.setdefault("quality", None)
    write_jsonl(out_root / "data" / f"part-{index:05d}.jsonl.gz", docs)
    write_jsonl(out_root / "excluded" / f"part-{index:05d}.jsonl.gz", excluded)
    result = {**stats.to_dict(), "domain_agreement": dict(sorted(agreement.items())), "num_out": len(docs)}
    atomic_write_json(out_root / "work" / "final" / f"{index:05d}.json", result)  # done marker: last
    return result


def _dedup_stage(docs: list[dict], removed: dict[int, list], stats: StageStats, excluded: list[dict]) -> list[dict]:
    """Drop the documents the global pass marked (`removed`: local index -> [reason, dup_of id])."""
    t0, b0, kept = time.perf_counter(), _nbytes(docs), []
    for i, d in enumerate(docs):
        hit = removed.get(i)
        if hit is None:
            kept.append(d)
            continue
        stats.drops[f"dedup:{hit[0]}"] += 1
        excluded.append(exclusion(d, "dedup", hit[0], dup_of=hit[1]))
    stats.add("dedup", len(docs), len(kept), b0, time.perf_counter() - t0)
    return kept


SAMPLE_JOBS = 256  # quality sample: at most this many jobs, so the driver merges <= 256 x max_train_docs picks


def sample_shards(cfg: DataConfig, work: Path, shards: list[int], removed: dict[int, dict[int, list]]) -> list[tuple]:
    """Quality-training candidates of a group of shards: the `max_train_docs` surviving documents with the
    smallest crc32(id), as (-crc32, id, shard, index) items, without their texts (the group's share of a
    fixed, shard-independent sample; `merge_samples` picks the global ones)."""
    heap: list[tuple[int, str, int, int]] = []
    for s in shards:
        gone = removed.get(s, {})
        for i, d in enumerate(read_jsonl(work / "local" / f"{s:05d}" / "docs.jsonl.gz")):
            if i in gone or (cfg.quality.positive_sources and d.get("source") not in cfg.quality.positive_sources):
                continue
            item = (-zlib.crc32(d["id"].encode()), d["id"], s, i)
            if len(heap) < cfg.quality.max_train_docs:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
    return heap


def merge_samples(picks: list[list[tuple]], k: int) -> list[tuple]:
    """The k largest items over all groups' picks, largest first."""
    return heapq.nlargest(k, (item for p in picks for item in p))


def train_quality(cfg: DataConfig, sample: list[tuple], out_root: Path) -> dict:
    """Read the sampled documents' texts, train the quality classifier on them; writes quality_model.npz,
    then work/quality.json (the done marker)."""
    from .quality import train

    want: dict[int, set[int]] = {}
    for _, _, s, i in sample:
        want.setdefault(s, set()).add(i)
    texts: dict[tuple[int, int], str] = {}
    for s, rows in want.items():
        for i, d in enumerate(read_jsonl(out_root / "work" / "local" / f"{s:05d}" / "docs.jsonl.gz")):
            if i in rows:
                texts[s, i] = d["text"]
    positives = [texts[s, i] for _, _, s, i in sample]
    model, metrics = train(positives, cfg.quality)
    tmp = out_root / "work" / ".tmp-quality_model.npz"
    model.save(tmp)
    os.replace(tmp, out_root / "quality_model.npz")
    info = {**metrics, "positives": len(positives)}
    atomic_write_json(out_root / "work" / "quality.json", info)
    return info
