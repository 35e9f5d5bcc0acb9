"""`glm5 plot RUN_DIR`: PNGs of a training run from its `metrics.jsonl`.

Writes RUN_DIR/plots/{loss,lr,grad_norm,expert_load}.png: training (and MTP / validation) loss,
learning rate, gradient norm, and the per-layer expert load (a heat map of each MoE layer's token
fractions at the last logged step, plus max/mean imbalance per layer over time).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glm5.core.log import read_metrics


def _series(recs: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _line_plot(plt, recs, keys: list[str], title: str, path: Path, log_y: bool = False) -> bool:
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for key in keys:
        xs, ys = _series(recs, key)
        if xs:
            ax.plot(xs, ys, marker="o" if len(xs) < 3 else None, label=key)
            drawn = True
    if drawn:
        ax.set_xlabel("step")
        ax.set_title(title)
        if log_y:
            ax.set_yscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def _expert_plot(plt, recs, path: Path) -> bool:
    loads = [r for r in recs if r.get("expert_load")]
    if not loads:
        return False
    last = loads[-1]
    layers = last.get("moe_layers", list(range(len(last["expert_load"]))))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    im = ax1.imshow(last["expert_load"], aspect="auto", cmap="viridis")
    ax1.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
    ax1.set_xlabel("expert")
    ax1.set_title(f"token fraction per expert, step {last['step']}")
    fig.colorbar(im, ax=ax1)
    steps = [r["step"] for r in loads]
    per_layer = list(zip(*[r["moe_imbalance_per_layer"] for r in loads]))
    for i, ys in zip(layers, per_layer):
        ax2.plot(steps, ys, marker="o" if len(steps) < 3 else None, label=f"layer {i}")
    ax2.set_xlabel("step")
    ax2.set_title("max / mean tokens per expert (1 = balanced)")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the PNGs for `run_dir` and return their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") != "config"]
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    made = []
    jobs = [(["loss", "mtp_loss", "val_loss", "unigram_loss"], "loss (nats/token)", "loss.png", False),
            (["lr"], "learning rate", "lr.png", False),
            (["grad_norm"], "gradient norm (before clipping)", "grad_norm.png", True)]
    for keys, title, name, log_y in jobs:
        if _line_plot(plt, recs, keys, title, out / name, log_y):
            made.append(out / name)
    if _expert_plot(plt, recs, out / "expert_load.png"):
        made.append(out / "expert_load.png")
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="glm5 plot", description="PNG plots of a training run.")
    p.add_argument("run_dir", help="a run directory containing metrics.jsonl")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if not (Path(args.run_dir) / "metrics.jsonl").is_file():
        print(f"glm5 plot: {args.run_dir}/metrics.jsonl not found", file=sys.stderr)
        return 2
    for path in plot_run(args.run_dir):
        print(path)
    return 0
