"""OCR agent evaluation and speed, on pages generated from the bundled corpus (validation split).

    python bench/ocr.py eval --model runs/ocr-lm/final [--layouts ...] [--conditions ...] [--seeds 0]
                             [--out docs/ocr-eval.json] [--plots docs/img]
    python bench/ocr.py speed [--pages 5] [--model CKPT]      # pages/s + peak RSS per stage
    python bench/ocr.py report --log eval.log --plots docs/img  # tables + plots from an eval's output

`eval` reads every (layout, condition, seed) page once with the full agent (`--rounds`, default 2) and
scores the text as it stood after round 0 (recogniser), round 1 (re-recognition) and round 2+
(language model): CER and WER of the reading-order text, recognition-only CER (lines matched by
position), reading-order accuracy, and code indentation accuracy. Pages whose fonts are missing (no
CJK font -> no `mixed` pages) are skipped and listed.

`speed` runs each stage in its own process on the same pages, so peak RSS is per stage: `library`
(RapidOCR's own det + cls + rec pipeline, the library used alone), `perception` (our detector +
confusion-network recogniser), `agent-r1` (+ layout + re-recognition), `agent-r2` (+ language model).
Run it under `flock /tmp/glm5-bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from glm5.apps.ocr import metrics as M  # noqa: E402
from glm5.apps.ocr.pages import CONDITIONS, LAYOUTS, bundled_pool, degrade, layout_fonts, render_page  # noqa: E402


def pages(layouts, conditions, seeds):
    pool = bundled_pool("validation")
    for layout in layouts:
        if layout_fonts(layout) is None:
            print(f"skip {layout}: a font is missing", file=sys.stderr)
            continue
        for seed in seeds:
            clean = render_page(layout, pool, seed)
            for cond in conditions:
                yield degrade(clean, cond, seed)


def evaluate(args) -> dict:
    from glm5.apps.ocr.agent import OcrAgent, OcrConfig  # noqa: PLC0415
    agent = OcrAgent(OcrConfig(rounds=args.rounds, model=args.model, lm_weight=args.lm_weight))
    rows = []
    for page in pages(args.layouts, args.conditions, args.seeds):
        t = time.perf_counter()
        res = agent.read(np.asarray(page.image), f"{page.layout}-{page.condition}-{page.seed}")
        row = {"layout": page.layout, "condition": page.condition, "seed": page.seed,
               "seconds": time.perf_counter() - t, "rounds": res.rounds, "changes": len(res.changes),
               "reading_order": M.reading_order_accuracy(res, page), "indent": M.indent_accuracy(res, page)}
        for r in range(args.rounds + 1):
            row[f"cer{r}"] = M.cer(res.reading_text(r), page.text())
            row[f"wer{r}"] = M.wer(res.reading_text(r), page.text())
            row[f"line_cer{r}"] = M.line_cer(res, page, r)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
    return {"rounds": args.rounds, "model": args.model, "lm_weight": args.lm_weight, "pages": rows,
            "summary": summarise(rows, args.rounds)}


def summarise(rows, rounds) -> dict:
    out = {}
    for key in ("condition", "layout"):
        groups = defaultdict(list)
        for r in rows:
            groups[r[key]].append(r)
        out[key] = {g: {m: [_rate(rs, f"{m}{k}") for k in range(rounds + 1)] for m in ("cer", "wer", "line_cer")}
                    | {"reading_order": float(np.mean([r["reading_order"] for r in rs])), "pages": len(rs)}
                    for g, rs in groups.items()}
    return out


def _rate(rows, key) -> float:
    edits, total = sum(r[key][0] for r in rows), sum(r[key][1] for r in rows)
    return edits / total if total else 0.0


def plot(result, out_dir) -> list[str]:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for key in ("condition", "layout"):
        groups = result["summary"][key]
        names = list(groups)
        rounds = result["rounds"]
        fig, ax = plt.subplots(figsize=(8, 3.6))
        width = 0.8 / (rounds + 1)
        for r in range(rounds + 1):
            label = ["recogniser (round 0)", "+ re-recognition (round 1)", "+ language model (round 2)"][min(r, 2)]
            ax.bar([i + r * width for i in range(len(names))], [100 * groups[n]["cer"][r] for n in names], width,
                   label=label)
        ax.set_xticks([i + width * rounds / 2 for i in range(len(names))], names)
        ax.set_ylabel("CER (%)")
        ax.set_title(f"OCR agent: CER by {key}, after each round")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"ocr-cer-by-{key}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def speed_stage(args) -> dict:
    """One stage over the pages, in this process: pages/s and peak RSS."""
    imgs = [np.asarray(p.image) for p in pages(LAYOUTS[:args.pages], ["clean", "combo"], [0])]
    if args.stage == "library":
        from rapidocr_onnxruntime import RapidOCR  # noqa: PLC0415
        engine = RapidOCR()
        run = lambda rgb: engine(np.ascontiguousarray(rgb[:, :, ::-1]))  # noqa: E731
    elif args.stage == "perception":
        from glm5.apps.ocr.perception import Perception  # noqa: PLC0415
        run = Perception()
    else:
        from glm5.apps.ocr.agent import OcrAgent, OcrConfig  # noqa: PLC0415
        agent = OcrAgent(OcrConfig(rounds=int(args.stage[-1]), model=args.model))
        run = agent.read
    run(imgs[0])  # warm-up (session creation, first-call allocations)
    t = time.perf_counter()
    for img in imgs:
        run(img)
    dt = time.perf_counter() - t
    return {"stage": args.stage, "pages": len(imgs), "seconds": dt, "pages_per_s": len(imgs) / dt,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def speed(args) -> list[dict]:
    stages = ["library", "perception", "agent-r1"] + (["agent-r2"] if args.model else [])
    out = []
    for stage in stages:
        cmd = [sys.executable, __file__, "_stage", "--stage", stage, "--pages", str(args.pages)]
        if args.model:
            cmd += ["--model", args.model]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        print(json.dumps(res), flush=True)
        out.append(res)
    base = out[0]["pages_per_s"]
    for r in out:
        r["speed_vs_library"] = r["pages_per_s"] / base
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=["eval", "speed", "report", "_stage"])
    ap.add_argument("--log", default=None, help="report: an `eval` run's stdout (one JSON line per page)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="glm5 checkpoint for the language-model round")
    ap.add_argument("--lm-weight", type=float, default=0.5)
    ap.add_argument("--pages", type=int, default=5, help="speed: layouts used (x clean + combo)")
    ap.add_argument("--stage", default="library")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plots", default=None, help="directory for the CER plots")
    args = ap.parse_args(argv)
    if args.mode == "_stage":
        print(json.dumps(speed_stage(args)))
        return 0
    if args.mode == "report":  # summarise the pages an eval run printed (also a run cut short)
        with open(args.log) as f:
            rows = [json.loads(line) for line in f if line.startswith("{\"layout\"")]
        result = {"rounds": args.rounds, "pages": rows, "summary": summarise(rows, args.rounds)}
    else:
        result = evaluate(args) if args.mode == "eval" else {"speed": speed(args)}
    if args.mode in ("eval", "report"):
        print(json.dumps(result["summary"], indent=1))
        if args.plots:
            result["plots"] = plot(result, args.plots)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
