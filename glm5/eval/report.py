"""Side-by-side report of several models: `report.md` (tables) and `report.png` (bars per task, and a
radar of the three dimensions of docs/SEEDS.md E1: knowledge, skills, real queries).

A dimension's score is the mean of its tasks' primary metrics (acc, pass@1, exact_match, overlap), all in
[0, 1]; "language" tasks (perplexity, lower is better, and the held-out continuation/lambada sets) are
reported in the table only.
"""

from __future__ import annotations

import math
from pathlib import Path

DIMENSIONS = ("knowledge", "skills", "queries")


def _fmt(value: float | None, se: float | None = None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4f}" + (f" ± {se:.4f}" if se is not None else "")


def dimension_scores(results: list[dict]) -> dict[str, dict[str, float]]:
    """model -> dimension -> mean primary metric over that dimension's tasks."""
    acc: dict[str, dict[str, list[float]]] = {}
    for r in results:
        if r["dimension"] in DIMENSIONS and r["primary"] in r["metrics"]:
            acc.setdefault(r["model"], {}).setdefault(r["dimension"], []).append(r["metrics"][r["primary"]])
    return {m: {d: sum(v) / len(v) for d, v in dims.items()} for m, dims in acc.items()}


def markdown(results: list[dict]) -> str:
    models = list(dict.fromkeys(r["model"] for r in results))
    tasks = list(dict.fromkeys((r["task"], r["primary"]) for r in results))
    by = {(r["model"], r["task"]): r for r in results}
    lines = ["# Evaluation report", "", "## Per task (primary metric ± standard error; n documents scored; "
             "chance: the metric of random guessing, - where it is not defined)", "",
             "| task | metric | chance | " + " | ".join(models) + " |", "|---|---|---|" + "---|" * len(models)]
    for task, primary in tasks:
        cells = []
        for m in models:
            r = by.get((m, task))
            cells.append("-" if r is None else f"{_fmt(r['metrics'].get(primary), r['stderr'].get(primary))} "
                                                f"(n={r['n']})")
        chance = next((by[(m, task)].get("chance") for m in models if (m, task) in by), None)
        lines.append(f"| {task} | {primary} | {_fmt(chance)} | " + " | ".join(cells) + " |")
    dims = dimension_scores(results)
    lines += ["", "## Three dimensions (mean primary metric of the dimension's tasks)", "",
              "| dimension | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for d in DIMENSIONS:
        lines.append(f"| {d} | " + " | ".join(_fmt(dims.get(m, {}).get(d)) for m in models) + " |")
    lines += ["", "## All metrics", ""]
    for r in results:
        ms = ", ".join(f"{k} {_fmt(v, r['stderr'].get(k))}" for k, v in r["metrics"].items())
        lines.append(f"- {r['model']} / {r['task']} (n={r['n']}): {ms}")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    models = list(dict.fromkeys(r["model"] for r in results))
    tasks = [t for t in dict.fromkeys(r["task"] for r in results)
             if any(r["task"] == t and r["dimension"] in DIMENSIONS for r in results)]
    by = {(r["model"], r["task"]): r for r in results}
    fig = plt.figure(figsize=(13, 5))
    ax = fig.add_subplot(1, 2, 1)
    width = 0.8 / max(1, len(models))
    for i, m in enumerate(models):
        vals = [by[(m, t)]["metrics"].get(by[(m, t)]["primary"], 0.0) if (m, t) in by else 0.0 for t in tasks]
        errs = [(by[(m, t)]["stderr"].get(by[(m, t)]["primary"]) or 0.0) if (m, t) in by else 0.0 for t in tasks]
        ax.bar([x + i * width for x in range(len(tasks))], vals, width, yerr=errs, label=m, capsize=2)
    ax.set_xticks([x + width * (len(models) - 1) / 2 for x in range(len(tasks))])
    ax.set_xticklabels([f"{t}\n({next(r['primary'] for r in results if r['task'] == t)})" for t in tasks])
    ax.set_ylim(0, 1)
    ax.set_title("primary metric per task")
    ax.legend(fontsize=8)
    radar = fig.add_subplot(1, 2, 2, projection="polar")
    dims = dimension_scores(results)
    angles = [2 * math.pi * i / len(DIMENSIONS) for i in range(len(DIMENSIONS))] + [0.0]
    for m in models:
        vals = [dims.get(m, {}).get(d, 0.0) for d in DIMENSIONS]
        radar.plot(angles, vals + vals[:1], marker="o", label=m)
        radar.fill(angles, vals + vals[:1], alpha=0.1)
    radar.set_xticks(angles[:-1])
    radar.set_xticklabels(DIMENSIONS)
    radar.set_ylim(0, 1)
    radar.set_title("three dimensions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: list[dict], out_dir: str | Path) -> tuple[Path, Path | None]:
    """report.md always; report.png when matplotlib is installed (the `plot` extra)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "report.md"
    md.write_text(markdown(results), encoding="utf-8")
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return md, None
    png = out_dir / "report.png"
    plot(results, png)
    return md, png
