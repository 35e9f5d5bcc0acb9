"""Run tasks against models, keeping every finished record on disk so that a rerun resumes.

    result = run_task(build_task(TaskConfig(task="mmlu", data="mmlu/")), build_model(ModelSpec(model="runs/tiny/final")),
                      Path("out.json"))

Records go to `OUT.records.jsonl` chunk by chunk (first line: the model and task fingerprint; a file
made under another fingerprint is set aside as `.stale`, never mixed in). `OUT.json` is then written
atomically: `{"task", "model", "dimension", "primary", "metrics": {name: value}, "stderr": {name: se},
"n", "config"}`. `run_config` does this for every model x task of an `EvalConfig` and writes
`results.json` plus the three-dimension report.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from glm5.core.config import to_dict
from glm5.core.io import atomic_write_json

from .lm import EvalModel
from .loaders import DataError
from .tasks import Task, TaskConfig, build_task

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ModelSpec:
    model: str  # checkpoint directory, preset name, or http(s):// URL of an OpenAI-compatible server
    backend: Literal["engine", "hf"] = "engine"  # checkpoints: glm5 engine, or transformers (any causal LM)
    gguf_file: str | None = None  # hf backend: GGUF file name inside `model` (e.g. the SmolLM2 teacher)
    name: str | None = None  # label in results (default: model)
    tokenizer: str | None = None  # URL models: tokenizer directory for log-likelihood scoring
    api_model: str | None = None  # URL models: model name on the server (default: its first)
    api_key: str | None = None  # URL models: bearer token
    max_length: int = 2048  # tokens per scored request
    add_special_tokens: bool = True  # tokenizer's prefix on scored text (lm-eval `hf`: yes; `local-completions`: no)
    batch_size: int = 64  # requests handed to the engine (or per HTTP request: 16 at most) at once
    device: str | None = None  # engine device (default: cuda when available)
    dtype: str | None = None  # engine dtype (CPU always computes in float32)

    @property
    def label(self) -> str:
        return self.name or self.model


@dataclass(kw_only=True)
class EvalConfig:
    output_dir: str = "runs/eval"  # per model x task OUT.json + records, results.json, report.md/.png
    models: list[ModelSpec] = field(default_factory=list)
    tasks: list[TaskConfig] = field(default_factory=list)
    report: bool = True  # write report.md and report.png


def is_url(model: str) -> bool:
    return model.startswith(("http://", "https://"))


def build_model(spec: ModelSpec) -> EvalModel:
    if is_url(spec.model):
        from .openai_model import OpenAIModel  # noqa: PLC0415
        tok = None
        if spec.tokenizer:
            from glm5.data.tokenizer import load_tokenizer  # noqa: PLC0415
            tok = load_tokenizer(spec.tokenizer)
        return OpenAIModel(spec.model, tokenizer=tok, model=spec.api_model, api_key=spec.api_key,
                           max_length=spec.max_length, batch_size=min(16, spec.batch_size), name=spec.label,
                           add_special_tokens=spec.add_special_tokens)
    if spec.backend == "hf":
        from .hf_model import HFModel  # noqa: PLC0415
        return HFModel(spec.model, gguf_file=spec.gguf_file, max_length=spec.max_length,
                       batch_size=min(16, spec.batch_size), add_special_tokens=spec.add_special_tokens,
                       name=spec.label, device=spec.device or "cpu")
    from .engine_model import EngineModel  # noqa: PLC0415
    opts = {k: v for k, v in (("device", spec.device), ("dtype", spec.dtype)) if v is not None}
    return EngineModel(spec.model, max_length=spec.max_length, batch_size=spec.batch_size, name=spec.label,
                       add_special_tokens=spec.add_special_tokens, **opts)


class RecordStore:
    """Append-only JSONL of finished records keyed by document id, valid for one fingerprint."""

    def __init__(self, path: Path, fingerprint: dict):
        self.path, self.fingerprint = path, json.loads(json.dumps(fingerprint))

    def load(self) -> dict[str, dict]:
        if not self.path.is_file():
            return {}
        lines = self.path.read_text(encoding="utf-8").splitlines()
        try:
            header = json.loads(lines[0])["fingerprint"] if lines else None
        except (json.JSONDecodeError, KeyError, TypeError):
            header = None
        if header != self.fingerprint:
            log.warning("%s was made with other settings; moved to .stale and starting over", self.path)
            self.path.replace(self.path.with_name(self.path.name + ".stale"))
            return {}
        done = {}
        for line in lines[1:]:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash: its documents run again
            done[obj["id"]] = obj["record"]
        return done

    def append(self, items: list[tuple[str, dict]]) -> None:
        new = not self.path.is_file() or self.path.stat().st_size == 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            if new:
                f.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")
            for doc_id, rec in items:
                f.write(json.dumps({"id": doc_id, "record": rec}, ensure_ascii=False) + "\n")
            f.flush()


def _check_ids(task: Task, docs) -> None:
    seen = set()
    for d in docs:
        if d.id in seen:
            raise DataError(f"{task.name}: document id {d.id!r} appears twice")
        seen.add(d.id)


def run_task(task: Task, model: EvalModel | None, out: Path, *, model_name: str, label: str | None = None,
             limit: int | None = None, chunk: int = 32, progress: bool = True) -> dict:
    """Evaluate (resuming from `OUT.records.jsonl`), aggregate, write and return the result dict."""
    docs = task.docs()[:limit]
    _check_ids(task, docs)
    fingerprint = {"model": model_name, "task": task.name, **task.fingerprint()}
    store = RecordStore(out.with_suffix(".records.jsonl"), fingerprint)
    done = store.load()
    todo = [d for d in docs if d.id not in done]
    bar = _progress(progress, len(docs), len(docs) - len(todo), f"{label or task.name} | {model_name}")
    for start in range(0, len(todo), chunk):
        part = todo[start:start + chunk]
        records = task.evaluate(model, part)
        store.append([(d.id, r) for d, r in zip(part, records)])
        done.update((d.id, r) for d, r in zip(part, records))
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    records = [done[d.id] for d in docs]
    metrics = task.aggregate(records)
    result = {"task": label or task.name, "model": model_name, "dimension": task.dimension, "primary": task.primary,
              "metrics": {k: v for k, (v, _) in metrics.items()}, "stderr": {k: se for k, (_, se) in metrics.items()},
              "n": task.scored(records), "documents": len(docs), "chance": task.chance(records),
              "config": fingerprint}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    return result


def _progress(enabled: bool, total: int, initial: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm  # noqa: PLC0415
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip("_")[-80:] or "model"


def run_config(cfg: EvalConfig, progress: bool = True) -> list[dict]:
    """Every model x task; one model is loaded at a time. Returns (and writes) all results."""
    root = Path(cfg.output_dir)
    tasks = [(t, build_task(t)) for t in cfg.tasks]  # bad task files fail before any model loads
    results = []
    for spec in cfg.models:
        model = None if all(t.samples for t, _ in tasks) else build_model(spec)
        for tcfg, task in tasks:
            out = root / _slug(spec.label) / f"{_slug(tcfg.name)}.json"
            results.append(run_task(task, model, out, model_name=spec.label, label=tcfg.name, limit=tcfg.limit,
                                    progress=progress))
        del model
    atomic_write_json(root / "results.json", {"results": results, "config": to_dict(cfg)})
    if cfg.report:
        from .report import write_report  # noqa: PLC0415
        write_report(results, root)
    return results
