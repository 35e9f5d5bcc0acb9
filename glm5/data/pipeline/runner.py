"""`glm5 data run`: shard the input, run the stages over shards in parallel, resume after interruptions.

Layout of `run.output_dir`:
    data/part-NNNNN.jsonl.gz       cleaned documents (input fields + `quality`)
    excluded/part-NNNNN.jsonl.gz   dropped documents with `stage`, `reason` (and `dup_of` for dedup)
    stats.json                     per-stage in/out counts, drop reasons, PII counts, quality metrics
    quality_model.npz              the trained quality classifier
    work/                          resumable intermediate state (input shards, local pass, dedup, markers)
Phases: input sharding (a job per input file) -> local pass (parallel) -> global dedup (partitioned) ->
quality training (sample per shard, one training job) -> final pass (parallel) -> stats. The jobs run on
`run.executor` (local process pool or Ray, `executor.py`): the same stage functions, so the same bytes.
Every phase's output is written atomically and checked before the phase runs, so a rerun after a crash
or kill skips finished work and produces the same bytes as one clean run.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from glm5.core.config import ConfigError, to_dict
from glm5.core.io import atomic_write_json

from . import stages
from .config import DataConfig
from .dedup_shuffle import run_dedup
from .executor import Executor, JobFailed, make_executor
from .shards import make_input_shards
from .stats import aggregate

RUNTIME_ONLY = ("executor", "ray_address", "num_workers", "max_retries", "dedup_partitions", "progress",
                "overwrite")  # run options that do not change the output


def run(cfg: DataConfig) -> dict:
    """Run (or resume) the whole pipeline; returns the aggregated stats (also in `stats.json`)."""
    out = Path(cfg.run.output_dir)
    work = out / "work"
    _check_config(cfg, out)
    _remove_stale_temps(out)
    executor = make_executor(cfg.run, cfg.run.progress)
    try:
        return _run(cfg, out, work, executor)
    except JobFailed as e:
        raise JobFailed(f"{e}; the finished shards are kept: rerun the same command to resume") from e
    finally:
        executor.close()


def _run(cfg: DataConfig, out: Path, work: Path, executor: Executor) -> dict:
    walls: dict[str, float] = {}
    t = time.perf_counter()
    manifest = make_input_shards(cfg.input.paths, cfg.input.text_key, cfg.run.shard_docs, work / "shards",
                                 cfg.input.limit, executor)
    num_shards = len(manifest["shards"])
    walls["shard_input"] = time.perf_counter() - t
    t = time.perf_counter()
    sizes = [(work / "shards" / s["path"]).stat().st_size for s in manifest["shards"]]
    todo = largest_first([i for i in range(num_shards) if not (work / "local" / f"{i:05d}" / "stats.json").is_file()],
                         sizes)
    executor.map(stages.local_shard, [(cfg, work / "shards" / manifest["shards"][i]["path"],
                                       work / "local" / f"{i:05d}") for i in todo],
                 [f"local pass shard {i:05d}" for i in todo], "local pass")
    walls["local_pass"] = time.perf_counter() - t
    t = time.perf_counter()
    removed = _dedup_phase(cfg, work, num_shards, executor)
    walls["global_dedup"] = time.perf_counter() - t
    t = time.perf_counter()
    quality_path = _quality_phase(cfg, out, num_shards, removed, executor)
    walls["quality_train"] = time.perf_counter() - t
    t = time.perf_counter()
    todo = largest_first([i for i in range(num_shards) if not (work / "final" / f"{i:05d}.json").is_file()], sizes)
    executor.map(stages.final_shard, [(cfg, i, work / "local" / f"{i:05d}", removed.get(i, {}), quality_path, out)
                                      for i in todo], [f"final pass shard {i:05d}" for i in todo], "final pass")
    walls["final_pass"] = time.perf_counter() - t
    stats = aggregate(out, num_shards, manifest["num_docs"], walls)
    atomic_write_json(out / "stats.json", stats)
    return stats


def largest_first(shards: list[int], sizes: list[int]) -> list[int]:
    """The shards to run, biggest input first (ties in shard order): the long jobs start first, so the
    pass does not end on one worker running a big shard while the others idle. Each job writes its own
    outputs, so the order changes no byte of them."""
    return sorted(shards, key=lambda i: (-sizes[i], i))


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


def _dedup_phase(cfg: DataConfig, work: Path, num_shards: int, executor: Executor) -> dict[int, dict[int, list]]:
    """Global exact + MinHash decisions over every shard's keys/signatures (`dedup_shuffle.py`, jobs on the
    executor); cached as {shard: {local index: [reason, id of the kept twin]}} in dedup.json."""
    path = work / "dedup.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        return {int(s): {int(i): v for i, v in d.items()} for s, d in saved.items()}
    removed: dict[int, dict[int, list]] = {}
    if cfg.dedup.exact or cfg.dedup.minhash:
        decisions, offsets = run_dedup(cfg, work, num_shards, executor)
        ids: dict[int, list[str]] = {}  # shard -> document ids, read for the shards holding a twin
        for g, (reason, twin) in decisions.items():
            s = int(np.searchsorted(offsets, g, side="right")) - 1
            t = int(np.searchsorted(offsets, twin, side="right")) - 1
            if t not in ids:
                ids[t] = json.loads((work / "local" / f"{t:05d}" / "keys.json").read_text())["ids"]
            removed.setdefault(s, {})[g - offsets[s]] = [reason, ids[t][twin - offsets[t]]]
    atomic_write_json(path, {str(s): {str(i): v for i, v in sorted(d.items())} for s, d in sorted(removed.items())})
    return removed


def _quality_phase(cfg: DataConfig, out: Path, num_shards: int, removed: dict, executor: Executor) -> str | None:
    """Train the quality classifier once on a sample (cached as quality_model.npz + work/quality.json):
    jobs over groups of shards pick candidates (ids only), one job reads their texts and trains."""
    if not cfg.quality.enabled:
        return None
    path, info = out / "quality_model.npz", out / "work" / "quality.json"
    if info.is_file():
        return str(path)
    size = max(1, -(-num_shards // stages.SAMPLE_JOBS))  # shards per sample job
    groups = [list(range(a, min(a + size, num_shards))) for a in range(0, num_shards, size)]
    picks = executor.map(stages.sample_shards, [(cfg, out / "work", g, {s: removed[s] for s in g if s in removed})
                                                for g in groups],
                         [f"quality sample shards {g[0]:05d}-{g[-1]:05d}" for g in groups], "quality: sample")
    sample = stages.merge_samples(picks, cfg.quality.max_train_docs)
    executor.map(stages.train_quality, [(cfg, sample, out)], ["quality training"], "quality: train")
    return str(path)
