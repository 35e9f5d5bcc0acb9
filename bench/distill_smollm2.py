"""Distillation result: SmolLM2-135M-Instruct (teacher) -> GLM-5-architecture tiny student, against the
same student trained for the same steps without the teacher, on the bundled corpus (2 CPU cores).

    python bench/distill_smollm2.py --out runs/distill                     # every stage
    python bench/distill_smollm2.py --out runs/distill --stage kd          # one stage (each resumes)

Stages (each under ~45 min on the shared 2-core box; rerunning a stage resumes it):
1. `kd`: `glm5 distill` with configs/distill/smollm2-tiny.toml. The teacher's top-k log-probs of every
   training row are computed first, once, into OUT/teacher_cache; training then reads the disk only.
2. `baseline`: the same config with alpha = 1 (no teacher): same seed, data, steps and schedule.
3. `teacher` (optional, may run while the students train): the teacher's held-out CE and task records.
4. `eval`: held-out cross entropy (nats/token) of teacher, distilled and baseline on the same validation
   rows, and the harness on the bundled sets, all three through the same transformers backend with
   lm-eval's tokenisation: mmlu_continuation (lm-eval's cloze MMLU: the answer texts are scored), exact
   (name the module) with plain prompts and with the chat template (the teacher is an instruct model),
   queries with the chat template. (Letter MMLU, C-Eval and plain-prompt queries left every model,
   the teacher included, at chance or 0 in the first run, so they are not repeated.) Writes
   OUT/distill.json, OUT/eval/{results.json, report.md, report.png} and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from glm5.core.config import load_config
from glm5.core.resources import config_file
from glm5.distill.run import DistillConfig, build
from glm5.distill.data import TextData
from glm5.distill.teacher import Teacher, load_hf_tokenizer, resolve_teacher
from glm5.eval.harness import run_task
from glm5.eval.hf_model import HFModel
from glm5.eval.report import write_report
from glm5.eval.tasks import TaskConfig, build_task

MODULE = "([A-Za-z_][A-Za-z0-9_]*)"
CHANCE = {"mmlu_continuation": 0.25, "exact": 0.0, "exact_chat": 0.0, "queries_chat": 0.0}
TASKS = [TaskConfig(task="mmlu_continuation", limit=60),
         TaskConfig(task="exact", regex=MODULE, max_tokens=8, limit=40),
         TaskConfig(task="exact", regex=MODULE, max_tokens=16, limit=40, chat=True, label="exact_chat"),
         TaskConfig(task="queries", max_tokens=32, limit=20, chat=True, label="queries_chat")]
MODELS = ("teacher (SmolLM2-135M)", "distilled student", "baseline student")


def config(out: Path, name: str, args, *extra: str) -> DistillConfig:
    return load_config(DistillConfig, config_file("distill/smollm2-tiny"), [
        f"--log.run_dir={out / name}", f"--train.steps={args.steps}", f"--text.max_train_tokens={args.max_train_tokens}",
        f"--text.val_tokens={args.val_tokens}", f"--distill.cache_dir={out / 'teacher_cache'}",
        "--checkpoint.resume=auto", "--log.progress=false", f"--log.eval_batches={args.val_tokens // (8 * 129) + 1}",
        *extra])


def train(out: Path, name: str, args, *extra: str) -> dict:
    t0 = time.perf_counter()
    trainer = build(config(out, name, args, *extra))  # kd: fills the teacher cache first (if needed)
    t1 = time.perf_counter()
    done = trainer.step >= args.steps and (out / name / "final").is_dir()
    summary = trainer.evaluate() if done else trainer.fit()
    t2 = time.perf_counter()
    info = {**summary, "setup_s": t1 - t0, "train_s": t2 - t1, "steps": args.steps, "load_avg": os.getloadavg()}
    (out / f"{name}.summary.json").write_text(json.dumps(info, indent=2, default=float))
    return info


@torch.no_grad()
def teacher_val_loss(out: Path, args) -> float:
    """The teacher's CE on the students' validation rows (same tokenizer, same rows); cached in OUT."""
    path = out / "teacher_val.json"
    if path.is_file():
        return json.loads(path.read_text())["val_loss"]
    t = config(out, "baseline", args).text
    data = TextData(load_hf_tokenizer("smollm2"), t.train, t.validation, t.seq_len, t.batch_size,
                    t.max_train_tokens, t.val_tokens)
    teacher = Teacher("smollm2")
    total, count = 0.0, 0
    for b in data.val_batches(10_000):
        logits = teacher.logits(b["input_ids"])
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum"))
        count += b["labels"].numel()
    path.write_text(json.dumps({"val_loss": total / count, "val_tokens": count}))
    return total / count


def evaluate(out: Path, models: tuple[str, ...] = MODELS, tasks: list[TaskConfig] = TASKS) -> list[dict]:
    """Every task on each of `models` (records resume: a model evaluated before is not run again)."""
    directory, gguf = resolve_teacher("smollm2")
    makers = {MODELS[0]: lambda: HFModel(directory, gguf_file=gguf, max_length=512),
              MODELS[1]: lambda: HFModel(str(out / "kd" / "final"), max_length=512),
              MODELS[2]: lambda: HFModel(str(out / "baseline" / "final"), max_length=512)}
    results = []
    for label in models:
        model = makers[label]()
        for t in tasks:
            path = out / "eval" / label.split()[0] / f"{t.name}.json"
            results.append(run_task(build_task(t), model, path, model_name=label, label=t.name, limit=t.limit,
                                    progress=False))
        del model
    return results


def kept(task: str, teacher: float, student: float) -> dict:
    """Share of the teacher's score, raw and above chance (where the teacher is above chance)."""
    chance = CHANCE[task]
    if teacher <= chance:
        return {"teacher_above_chance": False, "kept": None, "kept_above_chance": None}
    return {"teacher_above_chance": True, "kept": student / teacher,
            "kept_above_chance": (student - chance) / (teacher - chance)}


def summarize(out: Path, results: list[dict], teacher_loss: float, tasks: list[TaskConfig] = TASKS) -> dict:
    kd = json.loads((out / "kd.summary.json").read_text())
    base = json.loads((out / "baseline.summary.json").read_text())
    by = {(r["model"], r["task"]): r for r in results}
    rows = []
    for t in tasks:
        tr, st, bs = (by[(m, t.name)] for m in MODELS)
        p = tr["primary"]
        rows.append({"task": t.name, "metric": p, "n": tr["n"], "teacher": tr["metrics"][p],
                     "distilled": st["metrics"][p], "baseline": bs["metrics"][p],
                     **kept(t.name, tr["metrics"][p], st["metrics"][p])})
    return {"held_out_ce": {"teacher": teacher_loss, "distilled": kd["val_loss"], "baseline": base["val_loss"]},
            "val_tokens": kd["val_tokens"], "unigram_ce": kd.get("unigram_loss"), "tasks": rows,
            "train_s": {"kd": kd["train_s"], "baseline": base["train_s"]},
            "teacher_cache_s": kd["setup_s"], "load_avg_end": {"kd": kd["load_avg"], "baseline": base["load_avg"]}}


def table(s: dict) -> str:
    ce = s["held_out_ce"]
    lines = ["| | teacher | distilled | baseline | kept (raw / above chance) |", "|---|---|---|---|---|",
             f"| held-out CE (nats/token, {s['val_tokens']} tokens) | {ce['teacher']:.3f} | {ce['distilled']:.3f} | "
             f"{ce['baseline']:.3f} | |"]
    for r in s["tasks"]:
        k = "teacher at/below chance" if r["kept"] is None else f"{r['kept']:.0%} / {r['kept_above_chance']:.0%}"
        lines.append(f"| {r['task']} {r['metric']} (n={r['n']}) | {r['teacher']:.3f} | {r['distilled']:.3f} | "
                     f"{r['baseline']:.3f} | {k} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/distill")
    ap.add_argument("--stage", choices=["kd", "baseline", "teacher", "eval", "all"], default="all")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--max-train-tokens", type=int, default=32768)
    ap.add_argument("--tasks", default="", help="comma-separated task labels (default: all of TASKS)")
    ap.add_argument("--val-tokens", type=int, default=8256)
    args = ap.parse_args()
    out = Path(args.out)
    tasks = [t for t in TASKS if not args.tasks or t.name in args.tasks.split(",")]
    if args.stage in ("kd", "all"):
        print(json.dumps({"stage": "kd", **train(out, "kd", args)}, default=float), flush=True)
    if args.stage in ("baseline", "all"):
        print(json.dumps({"stage": "baseline", **train(out, "baseline", args, "--distill.alpha=1.0")}, default=float),
              flush=True)
    if args.stage == "teacher":  # independent of the students: can run while they train
        print(json.dumps({"teacher_val_loss": teacher_val_loss(out, args)}), flush=True)
        evaluate(out, MODELS[:1], tasks)
    if args.stage in ("eval", "all"):
        teacher_loss = teacher_val_loss(out, args)
        results = evaluate(out, MODELS, tasks)
        write_report(results, out / "eval")
        summary = summarize(out, results, teacher_loss, tasks)
        (out / "distill.json").write_text(json.dumps(summary, indent=2))
        print(table(summary))


if __name__ == "__main__":
    main()
