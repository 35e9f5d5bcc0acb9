"""The quality claims, measured on the embedded model (SmolLM2-135M-Instruct converted to GLM-5), in one
resumable run with a Markdown + PNG report (OUT/quality.md, OUT/quality.png, OUT/quality.json).

    python bench/quality.py --out runs/quality                    # every section (each resumes)
    python bench/quality.py --out runs/quality --only distill     # one section

Sections (rerunning skips what is done; an interrupted training run resumes from its last checkpoint):
- `distill` (seed M7): `glm5 prune` cuts a student with half the teacher's parameters out of the embedded
  model (configs/distill/prune-smollm2.toml), `glm5 distill` heals it on the bundled corpus
  (configs/distill/smollm2-heal.toml: the teacher's top-64 distributions, 30 steps x 2,048 tokens), and
  the same student is trained the same steps without the teacher (alpha = 1). Teacher, pruned-only,
  distilled and no-teacher are scored on held-out cross entropy (the bundled validation split, the same
  rows for all) and, through `glm5 eval`, on four tasks where the teacher is clearly above chance:
  cloze MMLU and cloze C-Eval (the bundled sets), hellaswag-style endings and lambada-style last words
  (held-out fortunes). Kept share = (student - chance) / (teacher - chance); target >= 0.7.
- `int8` (seed I1): bench/convert_int8.py (perplexity change, decode speed, weight memory vs fp32).
- `eval` (E1): `glm5 eval --config eval/embedded` (every bundled set, chance levels, standard errors).
Every row of the report carries the command that reproduces it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TASKS = ("mmlu_continuation", "ceval_continuation", "continuation", "lambada")
ROLES = ("teacher", "pruned", "distilled", "no_teacher")
LABELS = {"teacher": "teacher (embedded model)", "pruned": "pruned only", "distilled": "pruned + distilled",
          "no_teacher": "pruned + trained without teacher"}


def log(msg: str) -> None:
    print(f"[quality] {msg}", flush=True)


def load_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def save_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


# ---- distill -------------------------------------------------------------------------------------------
def heal_config(out: Path, role: str, student: Path, extra: list[str]):
    from glm5.core.config import load_config
    from glm5.core.resources import config_file
    from glm5.distill.run import DistillConfig
    return load_config(DistillConfig, config_file("distill/smollm2-heal"), [
        f"--model.name={student}", f"--log.run_dir={out / role}", f"--distill.cache_dir={out / 'teacher_cache'}",
        "--checkpoint.resume=auto", *extra])


def train(out: Path, role: str, student: Path, extra: list[str]) -> dict:
    """One healing run (resumes); returns its summary with the wall time."""
    done = load_json(out / f"{role}.json")
    if done is not None:
        return done
    from glm5.distill.run import build
    t0 = time.perf_counter()
    cfg = heal_config(out, role, student, extra)
    trainer = build(cfg)  # kd: fills the teacher cache first (counted in the wall time)
    t1 = time.perf_counter()
    summary = trainer.fit()
    summary.update(wall_s=round(time.perf_counter() - t0, 1), train_s=round(time.perf_counter() - t1, 1),
                   steps=cfg.train.steps, tokens=cfg.train.steps * cfg.text.batch_size * cfg.text.seq_len,
                   command=f"glm5 distill --config distill/smollm2-heal --model.name={student} "
                           f"--log.run_dir={out / role} {' '.join(extra)}".strip())
    save_json(out / f"{role}.json", summary)
    return summary


@torch.no_grad()
def heldout_loss(model_dir: Path, rows: torch.Tensor) -> float:
    """Mean cross entropy (nats/token) of the checkpoint on the validation rows, the model's own forward."""
    import glm5
    model = glm5.from_pretrained(model_dir, dtype=torch.float32)
    total = 0.0
    for b in range(0, len(rows), 8):
        batch = rows[b:b + 8]
        total += F.cross_entropy(model(batch[:, :-1]).logits.float().flatten(0, 1), batch[:, 1:].flatten(),
                                 reduction="sum").item()
    return total / rows[:, 1:].numel()


def validation_rows(teacher: Path, out: Path) -> torch.Tensor:
    from transformers import AutoTokenizer

    from glm5.distill.data import pack, read_texts
    cfg = heal_config(out, "kd", teacher, [])
    tok = AutoTokenizer.from_pretrained(str(teacher))
    return pack(tok, read_texts(cfg.text.validation), cfg.text.seq_len, cfg.text.val_tokens)


def final_dir(run: Path) -> Path:
    return run / "final"


def section_distill(out: Path, teacher: Path, progress: bool) -> dict:
    from glm5.core.resources import config_file
    from glm5.distill.prune import count_parameters
    from glm5.model.config import ModelConfig
    out.mkdir(parents=True, exist_ok=True)
    student = out / "student"
    if not (student / "config.json").is_file():
        log("prune: glm5 prune TEACHER student --config distill/prune-smollm2")
        from glm5.core.config import load_config
        from glm5.distill.prune import PruneConfig, prune
        prune(teacher, student, load_config(PruneConfig, config_file("distill/prune-smollm2")), log=log)
    runs = {"distilled": train(out, "kd", student, []),
            "no_teacher": train(out, "baseline", student, ["--distill.alpha=1.0"])}
    dirs = {"teacher": teacher, "pruned": student, "distilled": final_dir(out / "kd"),
            "no_teacher": final_dir(out / "baseline")}
    losses = load_json(out / "heldout.json") or {}
    if len(losses) < len(ROLES):
        rows = validation_rows(teacher, out)
        for role in ROLES:
            if role not in losses:
                losses[role] = heldout_loss(dirs[role], rows)
                log(f"held-out loss {role}: {losses[role]:.4f} nats/token ({rows[:, 1:].numel():,} tokens)")
                save_json(out / "heldout.json", losses)
    from glm5.eval.harness import EvalConfig, ModelSpec, run_config
    from glm5.eval.tasks import TaskConfig
    cfg = EvalConfig(output_dir=str(out / "eval"), models=[ModelSpec(model=str(dirs[r]), name=r) for r in ROLES],
                     tasks=[TaskConfig(task=t) for t in TASKS])
    results = run_config(cfg, progress=progress)
    scores = {(r["model"], r["task"]): r for r in results}
    params = {role: count_parameters(ModelConfig.from_pretrained(dirs[role])) for role in ROLES}
    params["teacher_compact"] = compact_teacher_parameters(teacher, student)
    table = {}
    for task in TASKS:
        t = scores[("teacher", task)]
        chance, primary = t["chance"], t["primary"]
        row = {"chance": chance, "metric": primary, "n": t["n"]}
        for role in ROLES:
            r = scores[(role, task)]
            v = r["metrics"][primary]
            row[role] = {"score": v, "stderr": r["stderr"].get(primary),
                         "kept": (v - chance) / (t["metrics"][primary] - chance)}
        table[task] = row
    pruning = load_json(student / "pruning.json") or {}
    result = {"parameters": params, "heldout_loss": losses, "tasks": table, "runs": runs,
              "prune_seconds": pruning.get("seconds"),
              "commands": {"prune": f"glm5 prune bundled:smollm2-glm5 {student} --config distill/prune-smollm2",
                           "distilled": runs["distilled"]["command"], "no_teacher": runs["no_teacher"]["command"],
                           "eval": "glm5 eval --model DIR --task TASK (each of " + ", ".join(TASKS) + ")"}}
    save_json(out / "distill.json", result)
    return result


def compact_teacher_parameters(teacher: Path, student: Path) -> int:
    """The teacher cut on the student's exact axes only (its upcycled routed copies merged into the
    student's expert count, the student's indexer heads and non-rotary dims), every neuron kept: the
    teacher's own function at its compact size, against which the lossy part of the cut is measured."""
    from dataclasses import replace

    from glm5.distill.prune import count_parameters
    from glm5.model.config import ModelConfig
    t, s = ModelConfig.from_pretrained(teacher), ModelConfig.from_pretrained(student)
    per_expert = t.moe_intermediate_size // s.n_routed_experts  # one copy's neurons split across the experts
    return count_parameters(replace(
        t, n_routed_experts=s.n_routed_experts, num_experts_per_tok=s.n_routed_experts,
        moe_intermediate_size=per_expert, n_shared_experts=t.n_shared_experts * t.moe_intermediate_size // per_expert,
        index_n_heads=s.index_n_heads, qk_nope_head_dim=s.qk_nope_head_dim))


def distill_markdown(d: dict) -> str:
    p = d["parameters"]
    lines = ["## Distillation (seed M7): a pruned student healed by `glm5 distill`", "",
             f"Teacher {p['teacher']:,} parameters; student {p['pruned']:,} "
             f"(**{p['teacher'] / p['pruned']:.2f}x fewer**); the teacher at its exact compact size (routed copies "
             f"merged, the student's indexer heads and non-rotary dims, every neuron kept) has "
             f"{p['teacher_compact']:,}: the lossy cut is **{p['teacher_compact'] / p['pruned']:.2f}x**. Healing: {d['runs']['distilled']['steps']} steps, "
             f"{d['runs']['distilled']['tokens']:,} tokens; distilled run {d['runs']['distilled']['wall_s'] / 60:.1f} "
             f"min (teacher cache included), no-teacher run {d['runs']['no_teacher']['wall_s'] / 60:.1f} min.", "",
             "| | " + " | ".join(LABELS[r] for r in ROLES) + " |", "|---|" + "---|" * len(ROLES),
             "| held-out loss (nats/token) | " + " | ".join(f"{d['heldout_loss'][r]:.4f}" for r in ROLES) + " |"]
    for task, row in d["tasks"].items():
        cells = []
        for r in ROLES:
            c = row[r]
            cells.append(f"{c['score']:.3f} ± {c['stderr']:.3f}" + ("" if r == "teacher" else f" (kept {c['kept']:.2f})"))
        lines.append(f"| {task} {row['metric']} (n={row['n']}, chance {row['chance']:.2f}) | " + " | ".join(cells) + " |")
    kept = [row["distilled"]["kept"] for row in d["tasks"].values()]
    lines += ["", f"Kept share of the above-chance score, distilled student: mean {sum(kept) / len(kept):.2f}, "
              f"min {min(kept):.2f} (target >= 0.7).", "", "Reproduce:", ""]
    lines += [f"- {k}: `{v}`" for k, v in d["commands"].items()]
    return "\n".join(lines)


def distill_plot(d: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tasks = list(d["tasks"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.2
    for j, role in enumerate(ROLES):
        vals = [d["tasks"][t][role]["score"] for t in tasks]
        errs = [d["tasks"][t][role]["stderr"] for t in tasks]
        ax.bar([i + (j - 1.5) * width for i in range(len(tasks))], vals, width, yerr=errs, label=LABELS[role])
    for i, t in enumerate(tasks):
        ax.hlines(d["tasks"][t]["chance"], i - 0.45, i + 0.45, colors="k", linestyles="dotted")
    ax.set_xticks(range(len(tasks)), tasks)
    ax.set_ylabel("score (dotted: chance)")
    ax.set_title(f"teacher {d['parameters']['teacher'] / 1e6:.0f}M vs student {d['parameters']['pruned'] / 1e6:.0f}M")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- int8 / eval ---------------------------------------------------------------------------------------
def section_int8(out: Path, teacher: Path) -> dict:
    path = out / "int8.json"
    if not path.is_file():
        subprocess.run([sys.executable, str(ROOT / "bench" / "convert_int8.py"), "--model", str(teacher),
                        "--group-sizes", "64", "--out", str(path)], check=True)
    return json.loads(path.read_text())


def int8_markdown(d: dict) -> str:
    lines = ["## INT8 (seed I1)", "", "| variant | perplexity change | batch-1 decode vs fp32 | weight memory vs fp32 |",
             "|---|---|---|---|"]
    for key, v in d.items():
        if isinstance(v, dict) and "quality" in v:
            s = v["speed"]["speedup"]
            lines.append(f"| {key} | {v['quality']['ppl_change_pct']:+.2f} % | {s['median']:.2f}x "
                         f"({s['min']:.2f}-{s['max']:.2f}) | {v['memory']['ratio']:.2f}x |")
    lines += ["", "Reproduce: `python bench/convert_int8.py --group-sizes 64`"]
    return "\n".join(lines)


def section_eval(out: Path, progress: bool) -> list[dict]:
    from glm5.core.config import load_config
    from glm5.core.resources import config_file
    from glm5.eval.harness import EvalConfig, run_config
    cfg = load_config(EvalConfig, config_file("eval/embedded"), [f"--output_dir={out / 'eval-embedded'}"])
    return run_config(cfg, progress=progress)


def eval_markdown(results: list[dict]) -> str:
    lines = ["## Evaluation of the embedded model (E1)", "", "| task | metric | score | chance | n |", "|---|---|---|---|---|"]
    for r in results:
        m, se = r["metrics"][r["primary"]], r["stderr"].get(r["primary"])
        chance = "-" if r.get("chance") is None else f"{r['chance']:.2f}"
        lines.append(f"| {r['task']} | {r['primary']} | {m:.3f}" + (f" ± {se:.3f}" if se else "") +
                     f" | {chance} | {r['n']} |")
    lines += ["", "Reproduce: `glm5 eval --config eval/embedded`"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/quality")
    ap.add_argument("--only", default="distill,int8,eval", help="comma list of sections")
    ap.add_argument("--teacher", default=None, help="teacher checkpoint (default: the embedded model)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    from glm5.apps.embedded import embedded_model
    teacher = Path(args.teacher) if args.teacher else embedded_model(log=log)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    report = load_json(out / "quality.json") or {}
    for s in sections:
        if s == "distill":
            report["distill"] = section_distill(out / "distill", teacher, not args.no_progress)
            distill_plot(report["distill"], out / "quality.png")
        elif s == "int8":
            report["int8"] = section_int8(out, teacher)
        elif s == "eval":
            report["eval"] = section_eval(out, not args.no_progress)
        else:
            ap.error(f"unknown section {s!r}; choose from distill, int8, eval")
        save_json(out / "quality.json", report)
    md = ["# Quality on the embedded model (bench/quality.py)", ""]
    if "distill" in report:
        md += [distill_markdown(report["distill"]), "", "![distillation](quality.png)", ""]
    if "int8" in report:
        md += [int8_markdown(report["int8"]), ""]
    if "eval" in report:
        md += [eval_markdown(report["eval"]), ""]
    (out / "quality.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
