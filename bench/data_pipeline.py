"""Benchmark the data pipeline on the bundled corpus, and our MinHash dedup against datatrove's.

1. Full `glm5 data run` (configs/data/default.toml) into a temp dir: wall time per phase and per-stage
   throughput (docs/s and MB/s per core: stage seconds are summed over workers).
2. MinHash near-dup detection on the same real text: English documents that survived the rule
   filters, plus variants with k words replaced (true 5-gram Jaccard computed exactly). Ours (20x5 with
   verification, and datatrove's 14x8 layout) vs datatrove's 4-stage MinHash (14x8, 5-grams) in the
   same process: time, recall at Jaccard >= 0.8, removals below 0.5.
3. `--executor ray` (or `local,ray`) with `--workers 1,2`: the full run once per executor and worker count
   (`--run.executor`, a fresh output dir each): docs/s end to end (Ray's cluster start included, it is
   part of a run), per-phase walls, scaling 1 -> 2 workers, Ray / local wall at equal workers, and
   whether the outputs are byte-identical (data/, excluded/) across all of them.
Run: `python bench/data_pipeline.py [--workers 2] [--executor local,ray --workers 1,2 --rounds 3] [--out docs/bench-data.json]`
(datatrove runs if it is importable, e.g. from a venv with `--system-site-packages`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from glm5.core.config import load_config
from glm5.data.pipeline.config import DataConfig, DedupConfig
from glm5.data.pipeline.dedup import exact_key, global_dedup, shingles, signature
from glm5.data.pipeline.runner import run
from glm5.data.pipeline.shards import read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def bench_pipeline(tmp: Path, workers: int, executor: str = "local") -> tuple[dict, Path]:
    out = tmp / f"clean-{executor}-{workers}"
    cfg = load_config(DataConfig, "configs/data/default.toml",
                      [f"--run.output_dir={out}", f"--run.num_workers={workers}", "--run.progress=false",
                       f"--run.executor={executor}"])
    t = time.perf_counter()
    stats = run(cfg)
    stats["total_wall_s"] = round(time.perf_counter() - t, 2)
    return stats, out


def _digest(out: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(q for sub in ("data", "excluded") for q in (out / sub).glob("*")):
        h.update(p.relative_to(out).as_posix().encode() + p.read_bytes())
    return h.hexdigest()[:16]


def bench_executors(tmp: Path, executors: list[str], workers: list[int], rounds: int = 1) -> dict:
    """The full run per (executor, workers), `rounds` times with the executors' order alternated (this
    machine is shared and a single run varies by 20%); rows per run, then scaling and Ray / local ratios of
    the per-configuration medians, and Ray / local per round (each pair ran back to back)."""
    import statistics

    rows, outs = [], []
    for r in range(rounds):
        for w in workers:
            for ex in (executors if r % 2 == 0 else executors[::-1]):
                stats, out = bench_pipeline(tmp / f"round{r}", w, ex)
                phases = round(sum(stats["wall_seconds"].values()), 2)  # without the executor's start and stop
                rows.append({"round": r, "executor": ex, "workers": w, "total_wall_s": stats["total_wall_s"],
                             "phases_s": phases, "start_stop_s": round(stats["total_wall_s"] - phases, 2),
                             "docs_per_s": round(stats["num_in"] / stats["total_wall_s"], 1),
                             "wall_seconds": stats["wall_seconds"], "num_out": stats["num_out"],
                             "digest": _digest(out), "load_average": round(os.getloadavg()[0], 1)})
                outs.append(out)

    def median(key: str, ex: str, w: int) -> float:
        return statistics.median(r[key] for r in rows if (r["executor"], r["workers"]) == (ex, w))

    def ratios(key: str) -> dict:
        return {w: round(median(key, "ray", w) / median(key, "local", w), 2) for w in workers
                if {"ray", "local"} <= set(executors)}

    def per_round(w: int) -> list[float]:
        walls = {(r["round"], r["executor"]): r["total_wall_s"] for r in rows if r["workers"] == w}
        return [round(walls[(i, "ray")] / walls[(i, "local")], 2) for i in range(rounds)]

    summary = {"identical_outputs": len({r["digest"] for r in rows}) == 1,
               "median_wall_s": {f"{ex}/{w}": median("total_wall_s", ex, w) for w in workers for ex in executors},
               "scaling": {ex: round(median("total_wall_s", ex, workers[0]) / median("total_wall_s", ex, workers[-1]), 2)
                           for ex in executors if len(workers) > 1},
               "ray_over_local_wall": ratios("total_wall_s"),
               "ray_over_local_phases": ratios("phases_s"),
               "ray_over_local_wall_per_round": {w: per_round(w) for w in workers
                                                 if {"ray", "local"} <= set(executors)}}
    return {"rows": rows, **summary}, outs[0]


def planted_set(clean: Path, seed: int = 0) -> tuple[list[dict], dict[str, tuple[str, float]]]:
    """English docs (>= 100 words) after the rule filters + 3 variants each; variant id -> (base id, J)."""
    rng, cfg = random.Random(seed), DedupConfig()
    base = [d for p in sorted((clean / "work/local").glob("*/docs.jsonl.gz")) for d in read_jsonl(p)
            if d.get("lang") == "en" and len(d["text"].split()) >= 100]
    docs, truth = [], {}
    for d in base:
        docs.append({"id": d["id"], "text": d["text"]})
        words = d["text"].split()
        for v in range(3):
            w = list(words)
            k = rng.randint(0, max(1, len(w) // 12))  # up to ~8% of words: Jaccard ~0.3..1
            for pos in rng.sample(range(len(w)), k):
                w[pos] = rng.choice(words)
            text = " ".join(w)
            sa, sb = shingles(d["text"], cfg), shingles(text, cfg)
            vid = f"{d['id']}#v{v}"
            docs.append({"id": vid, "text": text})
            truth[vid] = (d["id"], len(sa & sb) / len(sa | sb))
    return docs, truth


def score(removed: set[str], truth: dict[str, tuple[str, float]], num_docs: int) -> dict:
    high = [v for v, (_, j) in truth.items() if 0.8 <= j < 1.0]
    low = [v for v, (_, j) in truth.items() if j < 0.5]
    planted = set(truth)
    return {"removed": len(removed), "recall_at_0.8": round(sum(v in removed for v in high) / max(len(high), 1), 4),
            "pairs_at_0.8": len(high), "pairs_below_0.5": len(low),
            "removed_below_0.5": sum(v in removed for v in low),
            "removed_non_planted": len(removed - planted), "num_docs": num_docs}


def ours(docs: list[dict], truth: dict, cfg: DedupConfig) -> dict:
    t = time.perf_counter()
    sigs = np.stack([signature(d["text"], cfg) for d in docs])  # [N, num_perm]
    t_sig = time.perf_counter() - t
    removed = global_dedup([exact_key(d["text"]) for d in docs], sigs, cfg)
    total = time.perf_counter() - t
    r = score({docs[i]["id"] for i in removed}, truth, len(docs))
    return {**r, "signature_s": round(t_sig, 2), "total_s": round(total, 2)}


def datatrove(docs: list[dict], truth: dict, tmp: Path) -> dict:
    try:
        from datatrove.executor import LocalPipelineExecutor
        from datatrove.pipeline.dedup import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                              MinhashDedupFilter, MinhashDedupSignature)
        from datatrove.pipeline.readers import JsonlReader
        from datatrove.pipeline.writers import JsonlWriter
    except ImportError as e:
        return {"error": f"datatrove not importable: {e}"}
    from importlib.metadata import version

    d = tmp / "datatrove"
    write_jsonl(d / "in" / "docs.jsonl.gz", docs)
    mcfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
    reader = lambda: JsonlReader(str(d / "in"), text_key="text", id_key="id")  # noqa: E731
    stages = [
        ([reader(), MinhashDedupSignature(output_folder=str(d / "sigs"), config=mcfg)], 1),
        ([MinhashDedupBuckets(input_folder=str(d / "sigs"), output_folder=str(d / "buckets"), config=mcfg)], 14),
        ([MinhashDedupCluster(input_folder=str(d / "buckets"), output_folder=str(d / "remove"), config=mcfg)], 1),
        ([reader(), MinhashDedupFilter(input_folder=str(d / "remove")), JsonlWriter(str(d / "out"))], 1),
    ]
    t, stage_s = time.perf_counter(), []
    for i, (pipeline, tasks) in enumerate(stages):
        t_stage = time.perf_counter()
        LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=1, logging_dir=str(d / f"logs{i}"),
                              start_method="fork").run()
        stage_s.append(round(time.perf_counter() - t_stage, 2))
    total = time.perf_counter() - t
    kept = {x["id"] for p in sorted((d / "out").glob("*.jsonl.gz")) for x in read_jsonl(p)}
    r = score({x["id"] for x in docs} - kept, truth, len(docs))
    return {**r, "total_s": round(total, 2), "stage_s": stage_s, "version": version("datatrove")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="0", help="pipeline workers (0 = all cores); with --executor: a list, 1,2")
    ap.add_argument("--executor", default=None, help="local, ray or local,ray: the executor rows (section 3)")
    ap.add_argument("--rounds", type=int, default=1, help="with --executor: runs per configuration, order alternated")
    ap.add_argument("--skip-minhash", action="store_true", help="only the pipeline rows")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-data-"))
    try:
        workers = [int(w) for w in args.workers.split(",")]
        results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                    f"load average {os.getloadavg()[0]:.1f} at start"}
        if args.executor:
            results["executors"], clean = bench_executors(tmp, args.executor.split(","), workers, args.rounds)
        else:
            stats, clean = bench_pipeline(tmp, workers[0])
            results["pipeline"] = {k: stats[k] for k in ("num_in", "num_out", "total_wall_s", "wall_seconds",
                                                         "stages", "quality_model")}
        if not args.skip_minhash:
            docs, truth = planted_set(clean)
            results["minhash"] = {"ours_20x5_verify0.7": ours(docs, truth, DedupConfig()),
                                  "ours_14x8_noverify": ours(docs, truth, DedupConfig(
                                      num_bands=14, rows_per_band=8, verify_threshold=0.0)),
                                  "datatrove_14x8": datatrove(docs, truth, tmp)}
        results["load_average_at_end"] = round(os.getloadavg()[0], 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
