"""Pipeline statistics: merge per-shard stage stats into `stats.json`; summarise a cleaned directory.

`aggregate` (called by the runner) sums the per-shard counters of the local and final passes, in stage
order. `summarize` (behind `glm5 data stats DIR`) counts documents and tokens (whitespace tokens + CJK
characters) per source / lang / domain over any directory of JSONL(.gz) files, plus drop reasons from
`excluded/` when present.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

from .shards import read_jsonl
from .text import count_tokens

STAGE_ORDER = ("normalize", "langid", "filters", "pii", "signatures", "dedup", "quality", "domain")


def _merge(into: dict, shard: dict) -> None:
    for name, s in shard.get("stages", {}).items():
        t = into["stages"].setdefault(name, {"in": 0, "out": 0, "bytes_in": 0, "seconds": 0.0})
        for k in t:
            t[k] += s[k]
    for key in ("drops", "pii", "domain_agreement"):
        for k, v in shard.get(key, {}).items():
            into[key][k] = into[key].get(k, 0) + v


def aggregate(out: Path, num_shards: int, num_in: int, walls: dict) -> dict:
    """Merge work/local/*/stats.json and work/final/*.json into one stats dict."""
    merged: dict = {"stages": {}, "drops": {}, "pii": {}, "domain_agreement": {}}
    for s in range(num_shards):
        _merge(merged, json.loads((out / "work" / "local" / f"{s:05d}" / "stats.json").read_text()))
        _merge(merged, json.loads((out / "work" / "final" / f"{s:05d}.json").read_text()))
    stages = []
    for name in STAGE_ORDER:
        if name in merged["stages"]:
            s = merged["stages"][name]
            sec = max(s["seconds"], 1e-9)
            stages.append({"stage": name, **s, "seconds": round(s["seconds"], 3),
                           "docs_per_s": round(s["in"] / sec, 1), "mb_per_s": round(s["bytes_in"] / 1e6 / sec, 3)})
    quality_info = out / "work" / "quality.json"
    num_out = stages[-1]["out"] if stages else 0
    return {"num_in": num_in, "num_out": num_out, "num_shards": num_shards, "stages": stages,
            "drops": dict(sorted(merged["drops"].items(), key=lambda kv: -kv[1])), "pii": merged["pii"],
            "quality_model": json.loads(quality_info.read_text()) if quality_info.is_file() else None,
            "domain_agreement": merged["domain_agreement"],
            "wall_seconds": {k: round(v, 2) for k, v in walls.items()}}


def _data_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    root = path / "data" if (path / "data").is_dir() else path
    return sorted(p for p in root.glob("*.jsonl*") if p.is_file())


def summarize(path: str | Path) -> dict:
    """Documents/tokens per source, lang, domain (+ drop reasons from `excluded/` if present)."""
    path = Path(path)
    counts: dict[str, dict[str, list[int]]] = {k: defaultdict(lambda: [0, 0]) for k in ("source", "lang", "domain")}
    total = [0, 0]
    for f in _data_files(path):
        for d in read_jsonl(f):
            n = count_tokens(d["text"])
            total[0] += 1
            total[1] += n
            for key, table in counts.items():
                table[str(d.get(key))][0] += 1
                table[str(d.get(key))][1] += n
    drops: Counter = Counter()
    if path.is_dir() and (path / "excluded").is_dir():
        for f in sorted((path / "excluded").glob("*.jsonl*")):
            drops.update(f"{d['stage']}:{d['reason']}" for d in read_jsonl(f))
    return {"docs": total[0], "tokens": total[1], **{k: dict(v) for k, v in counts.items()},
            "drops": dict(drops.most_common())}


def format_summary(summary: dict) -> str:
    lines = [f"documents: {summary['docs']}   tokens (whitespace + CJK chars): {summary['tokens']}"]
    for key in ("source", "lang", "domain"):
        lines += ["", f"{'by ' + key:<28}{'docs':>10}{'tokens':>14}"]
        for name, (docs, toks) in sorted(summary[key].items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {name:<26}{docs:>10}{toks:>14}")
    if summary["drops"]:
        lines += ["", f"{'drop reason':<40}{'docs':>10}"]
        lines += [f"  {r:<38}{n:>10}" for r, n in summary["drops"].items()]
    return "\n".join(lines)
