"""Self-distillation of a model's MTP layer on its own greedy answers: `train_mtp_self(model_dir, out_dir)`.

Speculative drafts are accepted where the MTP layer predicts what the model itself generates, so the
best training text is the model's own output: `self_answers` renders prompts of the bundled chat set
(glm5/data/assets/sft/train.jsonl.gz, spread over all its tasks; the held-out file is never used) with
the model's chat template and generates greedy answers with the engine (`glm5.LLM`, batched); the
conversations (prompt + the model's answer) are written as chat JSONL. `train_mtp_self` then runs the
MTP recipe of `glm5.train.mtp_recipe` (frozen trunk, closed-form warm start, self-distillation steps)
on that file, within one time budget for both. Lives here because it needs both the engine and the
trainer (glm5/train and glm5/infer never import each other).

    from glm5.distill.mtp import train_mtp_self
    path = train_mtp_self("runs/smollm2-glm5", "runs/smollm2-mtp", minutes=4)
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Callable

import torch

from glm5.core.io import atomic_write_text
from glm5.core.resources import resolve_path
from glm5.infer.llm import LLM
from glm5.infer.sampling import SamplingParams
from glm5.train.mtp_recipe import train_mtp

PROMPTS = "bundled:sft/train.jsonl.gz"


def chat_prompts(path: str, n: int) -> list[list[dict]]:
    """The conversations of `path` up to (not including) their last assistant turn, `n` of them evenly
    spread over the file (its tasks are in blocks)."""
    with gzip.open(resolve_path(path), "rt", encoding="utf-8") if str(path).endswith(".gz") \
            else open(resolve_path(path), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    step = max(1, len(rows) // max(1, n))
    out = []
    for row in rows[::step][:n]:
        msgs = row.get("messages") or []
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=len(msgs))
        if msgs[:last]:
            out.append([{"role": m["role"], "content": m.get("content") or ""} for m in msgs[:last]])
    return out


def self_answers(model_dir: str | Path, out_path: str | Path, prompts: int = 96, max_tokens: int = 64,
                 source: str = PROMPTS, log: Callable[[str], None] = print) -> Path:
    """Greedy answers of `model_dir` to `prompts` prompts of `source`, written (atomically) as chat JSONL
    lines {"messages": [..., {"role": "assistant", "content": answer}]}; an existing file is reused."""
    out_path = Path(out_path)
    if out_path.is_file():
        log(f"mtp self-answers: reusing {out_path}")
        return out_path
    t0 = time.monotonic()
    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=max(1, prompts))
    chats = chat_prompts(source, prompts)
    ids = [llm.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    room = llm.engine.config.max_model_len - max_tokens  # prompts longer than the model's context are left out
    kept = [(c, i) for c, i in zip(chats, ids) if len(i) <= room]
    if not kept:
        raise ValueError(f"{model_dir}: none of the {len(ids)} prompts of {source} fits the model's context "
                         f"({llm.engine.config.max_model_len} tokens) with {max_tokens} to generate")
    chats, ids = [c for c, _ in kept], [i for _, i in kept]
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    lines, tokens = [], 0
    for chat, o in zip(chats, outs):
        tokens += len(o.outputs[0].token_ids)
        answer = llm.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        lines.append(json.dumps({"messages": chat + [{"role": "assistant", "content": answer}]}, ensure_ascii=False))
    atomic_write_text(out_path, "\n".join(lines) + "\n")
    log(f"mtp self-answers: {len(lines)} answers, {tokens} tokens in {time.monotonic() - t0:.0f} s "
        f"({torch.get_num_threads()} threads) -> {out_path}")
    return out_path


def train_mtp_self(model_dir: str | Path, out_dir: str | Path, minutes: float = 4.0, prompts: int = 96,
                   max_tokens: int = 64, log: Callable[[str], None] = print, work: str | Path | None = None,
                   overrides: list[str] = ()) -> Path:
    """`self_answers` then `train_mtp` on them, both within `minutes` (the training's time limit is what
    the answers left). Resumable: the answers file and the training run live in `work` (default
    `<out_dir>.run/`). Returns `out_dir`, an HF checkpoint with the input's files."""
    t0 = time.monotonic()
    out_dir = Path(out_dir)
    work = Path(work) if work is not None else out_dir.with_name(out_dir.name + ".run")
    work.mkdir(parents=True, exist_ok=True)
    data = self_answers(model_dir, work / "self_answers.jsonl", prompts, max_tokens, log=log)
    left = max(0.5, minutes - (time.monotonic() - t0) / 60)
    return train_mtp(model_dir, out_dir, minutes=left, log=log, run_dir=work / "train",
                     overrides=[f"--data.train_path={data}", "--train.mtp_init_batches=0", *overrides])
