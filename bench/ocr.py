"""OCR agent evaluation and speed, on pages generated from the bundled corpus (validation split).

    python bench/ocr.py eval --model runs/ocr-lm/final [--layouts ...] [--conditions ...] [--seeds 0]
                             [--out docs/ocr-eval.json] [--plots docs/img]
    python bench/ocr.py speed [--pages 5] [--model CKPT]      # pages/s + peak RSS per stage
    python bench/ocr.py report --log eval.log --plots docs/img  # tables + plots from an eval's output
    python bench/ocr.py tune --model runs/ocr-lm/final --seeds 1 --cache runs/ocr-cache  # round-2 rule

`--cache DIR` (eval, tune) keeps every page's state after round 1 (the recogniser's confusion networks,
round-1 history) as JSON, so rounds 0-1 run once per page and the language-model round can be
re-run on exactly the same lines with another model or rule; the agent code is the same either way
(`OcrAgent.read` through round 1, then `OcrAgent.lm_rounds`).

`eval` reads every (layout, condition, seed) page once with the full agent (`--rounds`, default 2) and
scores the text as it stood after round 0 (recogniser), round 1 (re-recognition) and round 2+
(language model): CER and WER of the reading-order text, recognition-only CER (lines matched by
position), reading-order accuracy, code indentation accuracy, and the structure found (after the last
round: heading and list-item precision/recall, tables found with the right shape, table cells read
right; `metrics.StructureScores`). Pages whose fonts are missing (no
CJK font -> no `mixed` pages) are skipped and listed.

`tune` searches the language-model round's decision rule (`LmRule`: lm_weight, the confidence under
which a character may change, the margin a candidate must win by, candidate and edit limits) on pages
that must not be the evaluation's (`--seeds`, default 1; the evaluation uses seed 0), and keeps the rule
with the lowest CER on degraded pages among those that do not raise CER over round 1 on clean pages (nor
on any condition). Language-model scores are cached per text, so a grid costs little more than one rule.

`speed` runs each stage in its own process on the same pages, so peak RSS is per stage: `library`
(RapidOCR's own det + cls + rec pipeline, the library used alone), `perception` (our detector +
confusion-network recogniser), `agent-r1` (+ layout + re-recognition), `agent-r2` (+ language model).
Run it under `flock /tmp/glm5-bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, fields
from itertools import product

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


def page_name(page) -> str:
    return f"{page.layout}-{page.condition}-{page.seed}"


def save_round1(res, path: str) -> None:
    """A page read through round 1 -> JSON: lines (quad, confusion network, source, history), changes, rounds."""
    def slots(reading):
        return [[[t, float(p)] for t, p in s.options] for s in reading.slots]

    lines = [{"quad": ln.quad.tolist(), "slots": slots(ln.reading), "source": ln.source, "history": ln.history,
              "alternatives": [[name, slots(r)] for name, r in ln.alternatives]} for ln in res.lines]
    doc = {"name": res.name, "width": res.width, "height": res.height, "lines": lines,
           "changes": [asdict(c) for c in res.changes], "rounds": res.rounds}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, ensure_ascii=False)
    os.replace(tmp, path)


def load_round1(path: str, bgr):
    """Inverse of `save_round1`; the layout is analysed again from the lines, as the agent does after round 1."""
    from glm5.apps.ocr import ctc, layout  # noqa: PLC0415
    from glm5.apps.ocr.perception import Line, Reading  # noqa: PLC0415
    from glm5.apps.ocr.render import Change, PageResult  # noqa: PLC0415
    with open(path) as f:
        doc = json.load(f)
    def reading(slots):
        return Reading([ctc.Slot([(t, p) for t, p in s]) for s in slots])

    lines = [Line(np.asarray(d["quad"], dtype=np.float32), reading(d["slots"]), d["source"], d["history"],
                  [(name, reading(s)) for name, s in d["alternatives"]]) for d in doc["lines"]]
    return PageResult(doc["width"], doc["height"], lines, layout.analyse(lines, bgr),
                      [Change(**c) for c in doc["changes"]], doc["rounds"], doc["name"])


class CachedScorer:
    """Memoises a scorer's log-probabilities per text (optionally on disk, one JSON file per model)."""

    def __init__(self, scorer, path: str | None = None):
        self.scorer, self.path, self.calls = scorer, path, 0
        self.memo: dict[str, float] = {}
        if path and os.path.exists(path):
            with open(path) as f:
                self.memo = json.load(f)

    def logprob(self, texts: list[str]) -> list[float]:
        todo = list(dict.fromkeys(t for t in texts if t not in self.memo))
        for k in range(0, len(todo), 256):  # saved as it goes: a run cut short keeps what it scored
            self.calls += len(todo[k:k + 256])
            self.memo.update(zip(todo[k:k + 256], self.scorer.logprob(todo[k:k + 256])))
            self.save()
        return [self.memo[t] for t in texts]

    def save(self) -> None:
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.memo, f, ensure_ascii=False)
            os.replace(self.path + ".tmp", self.path)


def read_through_round1(agent, page, cache: str | None):
    """(result after round 1, BGR page, seconds spent reading): from the cache when it holds the page."""
    rgb = np.asarray(page.image)
    bgr = np.ascontiguousarray(rgb[:, :, ::-1])
    path = os.path.join(cache, page_name(page) + ".json") if cache else None
    if path and os.path.exists(path):
        return load_round1(path, bgr), bgr, None
    t = time.perf_counter()
    res = agent.read(rgb, page_name(page), rounds=1)
    seconds = time.perf_counter() - t
    if path:
        os.makedirs(cache, exist_ok=True)
        save_round1(res, path)
    return res, bgr, seconds


def score_page(res, page, rounds: int) -> dict:
    row = {"layout": page.layout, "condition": page.condition, "seed": page.seed}
    for r in range(rounds + 1):
        row[f"cer{r}"] = M.cer(res.reading_text(r), page.text())
        row[f"wer{r}"] = M.wer(res.reading_text(r), page.text())
        row[f"line_cer{r}"] = M.line_cer(res, page, r)
    return row


def make_agent(args):
    from glm5.apps.ocr.agent import OcrAgent, OcrConfig  # noqa: PLC0415
    opts = {k: v for k, v in (("lm_weight", args.lm_weight), ("lm_threshold", args.lm_threshold),
                              ("lm_margin", args.lm_margin), ("max_candidates", args.max_candidates),
                              ("max_edits", args.max_edits), ("lm_alternatives", None if args.lm_alternatives is None else bool(args.lm_alternatives)),
                              ("lm_same_length", None if args.lm_same_length is None else bool(args.lm_same_length)),
                              ("lm_unsupported", None if args.lm_unsupported is None else bool(args.lm_unsupported)),
                              ("lm_protect_conf", args.lm_protect_conf), ("lm_min_rival", args.lm_min_rival),
                              ("lm_min_gain", args.lm_min_gain))
            if v is not None}
    return OcrAgent(OcrConfig(rounds=args.rounds, model=args.model, **opts))


def evaluate(args) -> dict:
    agent = make_agent(args)
    rule = agent.config.lm_rule
    memo = os.path.join(args.cache, f"lm-{_model_tag(args.model)}.json") if args.cache else None
    scorer = CachedScorer(agent.scorer, memo) if agent.scorer is not None else None
    trace_file = open(args.trace, "w") if args.trace else None
    rows = []
    for page in pages(args.layouts, args.conditions, args.seeds):
        t = time.perf_counter()
        if args.cache is None:  # the whole agent in one call
            res, seconds = agent.read(np.asarray(page.image), page_name(page)), None
        else:
            res, bgr, seconds = read_through_round1(agent, page, args.cache)
            if args.rounds >= 2 and scorer is not None:
                trace = [] if trace_file else None
                agent.lm_rounds(res, bgr, args.rounds, rule, scorer, trace=trace)
                for line_trace in trace or []:
                    trace_file.write(json.dumps({"page": page_name(page)} | label_trace(line_trace, res, page),
                                                ensure_ascii=False) + "\n")
                trace_file.flush()
        row = score_page(res, page, args.rounds) | {
            "seconds": time.perf_counter() - t, "seconds_rounds01": seconds, "rounds": res.rounds,
            "changes": len(res.changes), "reading_order": M.reading_order_accuracy(res, page),
            "indent": M.indent_accuracy(res, page),
            "structure": asdict(M.structure_scores(res, page)),
            "lm_fixed_broken": [M.correction_effects(res, page, r) for r in range(2, args.rounds + 1)],
            "lm_changes": [[c.before.strip(), c.after.strip()] for c in res.changes if c.round >= 2]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}, ensure_ascii=False), flush=True)
    if trace_file:
        trace_file.close()
    return {"rounds": args.rounds, "model": args.model, "rule": asdict(rule), "cache": args.cache,
            "pages": rows, "summary": summarise(rows, args.rounds)}


def label_trace(t: dict, res, page) -> dict:
    """A scored line's trace (`correct.lm_correct`) with every edit labelled against the ground-truth
    line under it: `right_before` / `right_after` (the character at that position is read right by the
    recogniser's reading / by the candidate, in an optimal alignment of the whole line)."""
    from rapidfuzz.distance import Levenshtein  # noqa: PLC0415
    owner = M._owner(page, res.lines[t["line"]].box)
    ref = page.lines[owner].text if owner is not None else None

    def right(hyp: str) -> set[int]:
        if ref is None:
            return set()
        return {i for tag, i0, i1, _, _ in Levenshtein.opcodes(hyp, ref) if tag == "equal" for i in range(i0, i1)}

    before = right(t["texts"][0])
    for text, es in zip(t["texts"], t["edits"]):
        after = right(text)
        for e in es:
            e["right_before"], e["right_after"] = e["pos"] in before, e["pos"] in after
    return t | {"ref": ref}


TUNE_GRID = {"alternatives": [False, True], "lm_weight": [0.25, 0.5, 1.0, 1.5], "threshold": [0.5, 0.7, 0.9],
             "min_margin": [0.0, 1.0, 2.0, 4.0, 6.0], "max_candidates": [8, 16], "max_edits": [1, 3]}


def tune(args) -> dict:
    """Grid search of the round-2 rule on cached round-1 pages (see the module docstring)."""
    from glm5.apps.ocr.correct import LmRule  # noqa: PLC0415
    if args.cache is None:
        raise SystemExit("tune: --cache DIR is required (rounds 0-1 are read once per page)")
    if 0 in args.seeds:
        raise SystemExit("tune: seed 0 holds the evaluation pages; tune on other seeds")
    agent = make_agent(args)
    scorer = CachedScorer(agent.scorer, os.path.join(args.cache, f"lm-{_model_tag(args.model)}.json"))
    loaded = []
    for page in pages(args.layouts, args.conditions, args.seeds):
        res, bgr, seconds = read_through_round1(agent, page, args.cache)
        print(f"round 1 ready: {page_name(page)} ({'cached' if seconds is None else f'{seconds:.0f} s'})", flush=True)
        loaded.append((page, bgr, res))
    grid = json.loads(args.grid) if args.grid else TUNE_GRID
    results = []
    for values in product(*grid.values()):
        rule = LmRule(**dict(zip(grid, values)))
        rows = []
        for page, bgr, base in loaded:
            res = copy.deepcopy(base)
            agent.lm_rounds(res, bgr, 2, rule, scorer)
            rows.append({"condition": page.condition, "lm_changes": sum(c.round >= 2 for c in res.changes)}
                        | {f"cer{r}": M.cer(res.reading_text(r), page.text()) for r in range(3)})
        scorer.save()  # before anything else can fail: the language model's scores are the costly part
        by_cond = {c: [_rate([r for r in rows if r["condition"] == c], f"cer{k}") for k in range(3)]
                   for c in dict.fromkeys(r["condition"] for r in rows)}
        results.append({"rule": asdict(rule), "by_condition": by_cond,
                        "clean": _rates(rows, True), "degraded": _rates(rows, False),
                        "lm_changes": sum(r["lm_changes"] for r in rows)})
        print(json.dumps(results[-1]), flush=True)
    best = choose(results)
    print("best:", json.dumps(best), flush=True)
    return {"model": args.model, "seeds": args.seeds, "conditions": args.conditions, "layouts": args.layouts,
            "pages": len(loaded), "grid": grid, "best": best, "results": results}


def _rates(rows, clean: bool) -> list[float]:
    sel = [r for r in rows if (r["condition"] == "clean") == clean]
    return [_rate(sel, f"cer{k}") for k in range(3)]


def choose(results: list[dict]) -> dict:
    """The rule with the lowest degraded CER after round 2 among those that raise CER over round 1 on
    no condition (clean first of all); ties go to the larger margin, then the smaller lm_weight."""
    safe = [r for r in results if all(c[2] <= c[1] for c in r["by_condition"].values())]
    pool = safe or results
    return min(pool, key=lambda r: (round(r["degraded"][2], 6), round(r["clean"][2], 6),
                                    -r["rule"]["min_margin"], r["rule"]["lm_weight"]))


def _model_tag(model: str | None) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in os.path.abspath(model or "none"))[-80:]


def summarise(rows, rounds) -> dict:
    out = {}
    for key in ("condition", "layout"):
        groups = defaultdict(list)
        for r in rows:
            groups[r[key]].append(r)
        out[key] = {g: {m: [_rate(rs, f"{m}{k}") for k in range(rounds + 1)] for m in ("cer", "wer", "line_cer")}
                    | {"reading_order": float(np.mean([r["reading_order"] for r in rs])), "pages": len(rs),
                       # characters the language-model rounds made right / made wrong (rows without them: 0)
                       "lm_fixed": sum(fb[0] for r in rs for fb in r.get("lm_fixed_broken", [])),
                       "lm_broken": sum(fb[1] for r in rs for fb in r.get("lm_fixed_broken", []))}
                    | {"structure": structure_summary(rs)}
                    for g, rs in groups.items()}
    return out


def structure_summary(rows) -> dict:
    """Pages' `structure` counts summed (rows without them, from older logs, add nothing), and the
    rates made of them (None where the denominator is 0: e.g. no list on any page of the group)."""
    counts = {f.name: 0 for f in fields(M.StructureScores)}
    for r in rows:
        for k, v in r.get("structure", {}).items():
            counts[k] += v

    def rate(num: str, den: str):
        return counts[num] / counts[den] if counts[den] else None

    return counts | {"heading_precision": rate("heading_hits", "heading_predicted"),
                     "heading_recall": rate("heading_hits", "heading_true"),
                     "list_precision": rate("list_hits", "list_predicted"),
                     "list_recall": rate("list_hits", "list_true"),
                     "table_recall": rate("tables_found", "tables_true"),
                     "table_shape": rate("tables_shape", "tables_true"),
                     "cell_accuracy": rate("cells_right", "cells_true")}


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
    ap.add_argument("mode", choices=["eval", "tune", "speed", "report", "_stage"])
    ap.add_argument("--log", default=None, help="report: an `eval` run's stdout (one JSON line per page)")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="glm5 checkpoint for the language-model round")
    ap.add_argument("--lm-weight", type=float, default=None, help="default: OcrConfig's")
    ap.add_argument("--lm-threshold", type=float, default=None)
    ap.add_argument("--lm-margin", type=float, default=None)
    ap.add_argument("--max-candidates", type=int, default=None)
    ap.add_argument("--max-edits", type=int, default=None)
    ap.add_argument("--lm-alternatives", type=int, choices=[0, 1], default=None,
                    help="1: round 2 also draws candidates from round 1's other readings")
    ap.add_argument("--lm-same-length", type=int, choices=[0, 1], default=None,
                    help="1: round 2 only substitutes characters")
    ap.add_argument("--lm-unsupported", type=int, choices=[0, 1], default=None,
                    help="1: round 2 may change a character no other round-1 reading supports (guarded)")
    ap.add_argument("--lm-protect-conf", type=float, default=None)
    ap.add_argument("--lm-min-rival", type=float, default=None)
    ap.add_argument("--lm-min-gain", type=float, default=None)
    ap.add_argument("--trace", default=None, help="eval: write every scored line's candidates, edits and "
                    "scores, each edit labelled against the ground truth, here (JSON lines)")
    ap.add_argument("--cache", default=None, help="eval/tune: directory of pages read through round 1")
    ap.add_argument("--grid", default=None, help="tune: JSON {LmRule field: [values]} (default TUNE_GRID)")
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
        result = {"eval": evaluate, "tune": tune}.get(args.mode, lambda a: {"speed": speed(a)})(args)
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
