"""`glm5 data run`: shard the input, run the stages over shards in parallel, resume after interruptions.

Layout of `run.output_dir`:
    data/part-NNNNN.jsonl.gz       cleaned documents (input fields + `quality`)
    excluded/part-NNNNN.jsonl.gz   dropped documents with `stage`, `reason` (and `dup_of` for dedup)
    stats.json                     per-stage in/out counts, drop reasons, PII counts, quality metrics
    quality_model.npz              the trained quality classifier
    work/                          resumable intermediate state (input shards, local pass, dedup, markers)
Phases: input sharding -> local pass (parallel) -> global dedup -> quality training -> final pass
(parallel) -> stats. Every phase's output is written atomically and checked before the phase runs, so a
rerun after a crash or kill skips finished work and produces the same bytes as one clean run.
"""

from __future__ import annotations

import heapq
import json
import multiprocessing
import os
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
from tqdm import tqdm

from glm5.core.config import ConfigError, to_dict
from glm5.core.io import atomic_write_json

from . import stages
from .config import DataConfig
from .dedup import global_dedup
from .shards import make_input_shards, read_jsonl
from .stats import aggregate

RUNTIME_ONLY = ("num_workers", "progress", "overwrite")  # run options that do not change the output


def run(cfg: DataConfig) -> dict:
    """Run (or resume) the whole pipeline; returns the aggregated stats (also in `stats.json`)."""
    out = Path(cfg.run.output_dir)
    work = out / "work"
    _check_config(cfg, out)
    _remove_stale_temps(out)
    walls: dict[str, float] = {}
    t = time.perf_counter()
    manifest = make_input_shards(cfg.input.paths, cfg.input.text_key, cfg.run.shard_docs, work / "shards",
                                 cfg.input.limit)
    num_shards = len(manifest["shards"])
    walls["shard_input"] = time.perf_counter() - t
    t = time.perf_counter()
    jobs = [(cfg, work / "shards" / s["path"], work / "local" / f"{i:05d}") for i, s in enumerate(manifest["shards"])
            if not (work / "local" / f"{i:05d}" / "stats.json").is_file()]
    _parallel(stages.local_shard, jobs, cfg, "local pass")
    walls["local_pass"] = time.perf_counter() - t
    t = time.perf_counter()
    removed = _dedup_phase(cfg, work, num_shards)
    walls["global_dedup"] = time.perf_counter() - t
    t = time.perf_counter()
    quality_path = _quality_phase(cfg, out, num_shards, removed)
    walls["quality_train"] = time.perf_counter() - t
    t = time.perf_counter()
    jobs = [(cfg, i, work / "local" / f"{i:05d}", removed.get(i, {}), quality_path, out) for i in range(num_shards)
            if not (work / "final" / f"{i:05d}.json").is_file()]
    _parallel(stages.final_shard, jobs, cfg, "final pass")
    walls["final_pass"] = time.perf_counter() - t
    stats = aggregate(out, num_shards, manifest["num_docs"], walls)
    atomic_write_json(out / "stats.json", stats)
    return stats


def _remove_stale_temps(out: Path) -> None:
    """Delete `.tmp-*` leftovers of a killed run (atomic writers never rename them into place)."""
    for p in sorted(out.rglob(".tmp-*"), reverse=True):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _fingerprint(cfg: DataConfig) -> dict:
    d = to_dict(cfg)
    for k in RUNTIME_ONLY:
        d["run"].pop(k)
    return d


def _check_config(cfg: DataConfig, out: Path) -> None:
    """Resume only with the same output-affecting config; `run.overwrite=true` starts afresh."""
    path = out / "work" / "config.json"
    if path.is_file() and json.loads(path.read_text()) != _fingerprint(cfg):
        if not cfg.run.overwrite:
            raise ConfigError(f"{out} holds a run with a different config ({path}); use a new "
                              "run.output_dir or --run.overwrite=true to discard it")
        shutil.rmtree(out)
    atomic_write_json(path, _fingerprint(cfg))


def _call(args):
    fn, job = args
    return fn(*job)


def _parallel(fn, jobs: list[tuple], cfg: DataConfig, desc: str) -> list:
    """Run `fn(*job)` for every job: in-process for one worker, else a process pool.

    Fork (where available) skips re-importing numpy/torch in every worker; the workers run no torch or
    OpenMP code, so threads the parent may hold cannot deadlock them."""
    workers = min(cfg.run.num_workers or os.cpu_count() or 1, len(jobs))
    bar = dict(desc=desc, total=len(jobs), unit="shard", disable=not cfg.run.progress)
    if workers <= 1:
        return [fn(*job) for job in tqdm(jobs, **bar)]
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers) as pool:
        return list(tqdm(pool.imap_unordered(_call, [(fn, j) for j in jobs]), **bar))


def _dedup_phase(cfg: DataConfig, work: Path, num_shards: int) -> dict[int, dict[int, list]]:
    """Global exact + MinHash decisions over every shard's keys/signatures (cached in dedup.json)."""
    path = work / "dedup.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        return {int(s): {int(i): v for i, v in d.items()} for s, d in saved.items()}
    ids, keys, sigs, where = [], [], [], []
    for s in range(num_shards):
        local = work / "local" / f"{s:05d}"
        k = json.loads((local / "keys.json").read_text())
        ids += k["ids"]
        keys += k["keys"]
        where += [(s, i) for i in range(len(k["ids"]))]
        if cfg.dedup.minhash and (local / "signatures.npy").is_file():
            sigs.append(np.load(local / "signatures.npy"))
    sig = np.concatenate(sigs) if sigs else np.zeros((0, 1), np.uint64)  # [N, num_perm]
    removed: dict[int, dict[int, list]] = {}
    if cfg.dedup.exact or cfg.dedup.minhash:
        for g, (reason, twin) in global_dedup(keys, sig, cfg.dedup, cfg.run.progress).items():
            s, i = where[g]
            removed.setdefault(s, {})[i] = [reason, ids[twin]]
    atomic_write_json(path, {str(s): {str(i): v for i, v in d.items()} for s, d in removed.items()})
    return removed


def _quality_phase(cfg: DataConfig, out: Path, num_shards: int, removed: dict) -> str | None:
    """Train the quality classifier once (cached as quality_model.npz + work/quality.json)."""
    if not cfg.quality.enabled:
        return None
    path, info = out / "quality_model.npz", out / "work" / "quality.json"
    if info.is_file():
        return str(path)
    from .quality import train

    positives = _sample_positives(cfg, out / "work", num_shards, removed)
    model, metrics = train(positives, cfg.quality)
    tmp = out / "work" / ".tmp-quality_model.npz"
    model.save(tmp)
    os.replace(tmp, path)
    atomic_write_json(info, {**metrics, "positives": len(positives)})  # marker: written after the model
    return str(path)


def _sample_positives(cfg: DataConfig, work: Path, num_shards: int, removed: dict) -> list[str]:
    """The `max_train_docs` surviving documents with the smallest crc32(id): a fixed, shard-independent
    sample, kept in a bounded heap (streaming)."""
    heap: list[tuple[int, str, str]] = []
    for s in range(num_shards):
        gone = removed.get(s, {})
        for i, d in enumerate(read_jsonl(work / "local" / f"{s:05d}" / "docs.jsonl.gz")):
            if i in gone or (cfg.quality.positive_sources and d.get("source") not in cfg.quality.positive_sources):
                continue
            item = (-zlib.crc32(d["id"].encode()), d["id"], d["text"])
            if len(heap) < cfg.quality.max_train_docs:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
    return [text for _, _, text in sorted(heap, reverse=True)]
