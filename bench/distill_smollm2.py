"""Distillation result: SmolLM2-135M-Instruct (teacher) -> GLM-5-architecture tiny student, against the
same student trained for the same steps without the teacher, on the bundled corpus (2 CPU cores).

    python bench/distill_smollm2.py --out runs/distill [--steps 40 --max-train-tokens 16384]

1. `glm5 distill` twice with one config: alpha = 0.5 (teacher top-32 at T = 2, cached on disk) and
   alpha = 1 (baseline: no teacher). Same seed, data, steps, schedule. Both resume if interrupted.
2. Held-out cross entropy (nats/token) of teacher, distilled and baseline on the same validation rows.
3. The harness on the bundled sets (all three through the same transformers backend, lm-eval's
   tokenisation): mmlu and ceval 0-shot, exact (module names), queries (overlap).
Writes OUT/distill.json, OUT/eval/{results.json, report.md, report.png} and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from glm5.core.config import load_config
from glm5.core.resources import config_file
from glm5.distill.run import DistillConfig, build
from glm5.distill.teacher import Teacher, resolve_teacher
from glm5.eval.harness import run_task
from glm5.eval.hf_model import HFModel
from glm5.eval.report import write_report
from glm5.eval.tasks import TaskConfig, build_task

CHANCE = {"mmlu": 0.25, "ceval": 0.25, "exact": 0.0, "queries": 0.0}
TASKS = [TaskConfig(task="mmlu"), TaskConfig(task="ceval", limit=60),
         TaskConfig(task="exact", regex="([A-Za-z_][A-Za-z0-9_]*)", max_tokens=8, limit=40),
         TaskConfig(task="queries", max_tokens=24, limit=20)]


def train(out: Path, name: str, alpha: float, args) -> tuple[dict, object]:
    cfg = load_config(DistillConfig, config_file("distill/smollm2-tiny"), [
        f"--log.run_dir={out / name}", f"--distill.alpha={alpha}", f"--train.steps={args.steps}",
        f"--text.max_train_tokens={args.max_train_tokens}", f"--text.val_tokens={args.val_tokens}",
        f"--distill.cache_dir={out / 'teacher_cache'}", "--checkpoint.resume=auto", "--log.progress=false",
        f"--log.eval_batches={args.val_tokens // (8 * 129) + 1}"])
    trainer = build(cfg)
    summary = trainer.fit() if trainer.step < cfg.train.steps or not (out / name / "final").is_dir() else \
        trainer.evaluate()
    return summary, trainer.data


@torch.no_grad()
def teacher_val_loss(data) -> float:
    teacher = Teacher("smollm2")
    total, count = 0.0, 0
    for b in data.val_batches(10_000):
        logits = teacher.logits(b["input_ids"])
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="sum"))
        count += b["labels"].numel()
    return total / count


def evaluate(out: Path) -> list[dict]:
    directory, gguf = resolve_teacher("smollm2")
    models = [("teacher (SmolLM2-135M)", lambda: HFModel(directory, gguf_file=gguf, max_length=512)),
              ("distilled student", lambda: HFModel(str(out / "kd" / "final"), max_length=512)),
              ("baseline student", lambda: HFModel(str(out / "baseline" / "final"), max_length=512))]
    results = []
    for label, make in models:
        model = make()
        for t in TASKS:
            slug = label.split()[0]
            results.append(run_task(build_task(t), model, out / "eval" / slug / f"{t.name}.json", model_name=label,
                                    label=t.name, limit=t.limit, progress=False))
        del model
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/distill")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--max-train-tokens", type=int, default=16384)
    ap.add_argument("--val-tokens", type=int, default=4128)
    args = ap.parse_args()
    out = Path(args.out)
    kd, data = train(out, "kd", 0.5, args)
    base, _ = train(out, "baseline", 1.0, args)
    teacher_loss = teacher_val_loss(data)
    results = evaluate(out)
    write_report(results, out / "eval")
    by = {(r["model"], r["task"]): r for r in results}
    rows = []
    for t in TASKS:
        tr, st, bs = (by[(m, t.name)] for m in ("teacher (SmolLM2-135M)", "distilled student", "baseline student"))
        p = tr["primary"]
        above = tr["metrics"][p] > CHANCE[t.name]
        rows.append({"task": t.name, "metric": p, "n": tr["n"], "teacher": tr["metrics"][p], "distilled": st["metrics"][p],
                     "baseline": bs["metrics"][p], "teacher_above_chance": above,
                     "kept": st["metrics"][p] / tr["metrics"][p] if above and tr["metrics"][p] else None})
    summary = {"held_out_ce": {"teacher": teacher_loss, "distilled": kd["val_loss"], "baseline": base["val_loss"]},
               "val_tokens": kd["val_tokens"], "tasks": rows, "steps": args.steps,
               "max_train_tokens": args.max_train_tokens}
    (out / "distill.json").write_text(json.dumps(summary, indent=2))
    print("| | teacher | distilled | baseline |\n|---|---|---|---|")
    print(f"| held-out CE (nats/token, {kd['val_tokens']} tokens) | {teacher_loss:.3f} | {kd['val_loss']:.3f} | "
          f"{base['val_loss']:.3f} |")
    for r in rows:
        kept = "-" if r["kept"] is None else f"{r['kept']:.0%}"
        print(f"| {r['task']} {r['metric']} (n={r['n']}) | {r['teacher']:.3f} | {r['distilled']:.3f} | "
              f"{r['baseline']:.3f} | kept {kept} |")


if __name__ == "__main__":
    main()
