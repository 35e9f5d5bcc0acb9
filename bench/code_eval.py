"""Code-completion quality on held-out Python (seed A1): single-line completion and fill-in-the-middle.

Held-out set: CPython 3.11 standard-library files that are not in the bundled corpus (Debian's
libpython3.11-stdlib; the same selection as bench/code_tokens.py). From them, with a fixed seed:
  - single-line completion: the cursor after a line's indentation; the model writes the rest of the
    line (causal prompt = the text before the cursor, stop at the newline). Metrics: exact match of the
    line, edit similarity (1 - Levenshtein / longer length), and whether the file with the predicted line
    in place still parses (`ast`).
  - FIM: a random middle of 1-3 whole lines; prefix before it, suffix after it, through `LLM.infill` in
    each format the model supports (sentinel SPM/PSM, GLM [MASK]). Same three metrics on the middle.
Decoding: greedy, beam search (width 4), and the seeds' temperature schedule 0.8 -> 0.2 (seeded). Prefix
and suffix are cut to fit the context, as the server does.

    python3 bench/code_eval.py --model runs/code/final [--n 200] [--out docs/bench-code-eval.md]
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import random
import time
from pathlib import Path

from glm5.infer.infill import InfillError, choose_format
from glm5.infer.llm import LLM
from glm5.infer.sampling import SamplingParams

from code_tokens import held_out_python  # noqa: E402 (bench/ is run as a script directory)

MAX_LEN, MAX_NEW = 320, 48
DECODINGS = {
    "greedy": SamplingParams(temperature=0, max_tokens=MAX_NEW),
    "beam 4": SamplingParams(temperature=0, max_tokens=MAX_NEW, use_beam_search=True, beam_width=4),
    "schedule 0.8->0.2": SamplingParams(temperature_schedule=(0.8, 0.2), max_tokens=MAX_NEW, seed=0, top_p=0.95),
}


def edit_similarity(a: str, b: str) -> float:
    if not a and not b:
        return 1.0
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return 1 - prev[-1] / max(len(a), len(b))


def parses(text: str) -> bool:
    try:
        ast.parse(text)
        return True
    except (SyntaxError, ValueError):
        return False


def line_cases(files: list[str], n: int, rng: random.Random) -> list[dict]:
    """(prefix up to the cursor after a line's indentation, the rest of that line, the file's rest)."""
    cases = []
    while len(cases) < n:
        text = rng.choice(files)
        if not parses(text):
            continue
        lines = text.split("\n")
        i = rng.randrange(1, len(lines)) if len(lines) > 1 else 0
        body = lines[i].lstrip(" ")
        if i == 0 or len(body) < 8 or body.startswith("#"):  # i == 0: nothing before the cursor
            continue
        indent = lines[i][: len(lines[i]) - len(body)]
        prefix = "\n".join(lines[:i] + [indent])
        cases.append({"prefix": prefix, "target": body, "after": "\n" + "\n".join(lines[i + 1:])})
    return cases


def fim_cases(files: list[str], n: int, rng: random.Random) -> list[dict]:
    cases = []
    while len(cases) < n:
        text = rng.choice(files)
        if not parses(text):
            continue
        lines = text.split("\n")
        i = rng.randrange(len(lines))
        j = min(len(lines), i + rng.randint(1, 3))
        middle = "\n".join(lines[i:j]) + "\n"
        if len(middle.strip()) < 8:
            continue
        cases.append({"prefix": "\n".join(lines[:i]) + ("\n" if i else ""), "target": middle,
                      "suffix": "\n".join(lines[j:])})
    return cases


def score(preds: list[str], cases: list[dict], whole) -> dict:
    em = sum(p.strip() == c["target"].strip() for p, c in zip(preds, cases)) / len(cases)
    es = sum(edit_similarity(p.strip(), c["target"].strip()) for p, c in zip(preds, cases)) / len(cases)
    ok = sum(parses(whole(p, c)) for p, c in zip(preds, cases)) / len(cases)
    return {"exact_match": em, "edit_similarity": es, "parses": ok, "n": len(cases)}


def run_lines(llm: LLM, cases: list[dict], params: SamplingParams) -> list[str]:
    tok = llm.tokenizer
    keep = MAX_LEN - MAX_NEW - 8
    prompts = [tok.encode(c["prefix"])[-keep:] for c in cases]
    if not params.use_beam_search:
        params = dataclasses.replace(params, stop=["\n"])
    outs = llm.beam_search(prompts, params) if params.use_beam_search else llm.generate(prompts, params)
    return [o.outputs[0].text.split("\n")[0] for o in outs]


def run_fim(llm: LLM, cases: list[dict], params: SamplingParams, fmt: str) -> list[str]:
    outs = llm.infill([c["prefix"] for c in cases], [c["suffix"] for c in cases], params, format=fmt)
    return [o.outputs[0].text for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (with its tokenizer)")
    ap.add_argument("--n", type=int, default=200, help="cases per task (beam search: a quarter)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    ap.add_argument("--decodings", nargs="+", choices=list(DECODINGS), default=list(DECODINGS),
                    help="which decodings to run (default: all)")
    args = ap.parse_args()
    llm = LLM(args.model, device="cpu", max_model_len=MAX_LEN, max_num_batched_tokens=4096)
    if llm.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer files: the evaluation needs text in and out "
                         "(a run's final/ directory has them; a raw checkpoint's model/ does not)")
    files = held_out_python()
    rng = random.Random(args.seed)
    lines, fims = line_cases(files, args.n, rng), fim_cases(files, args.n, rng)
    formats = []
    for fmt in ("spm", "psm", "glm"):
        try:
            choose_format(llm.tokenizer, llm.engine.model_config.block_position_embedding, fmt)
            formats.append(fmt)
        except InfillError:
            pass
    rows = []
    for name in args.decodings:
        params = DECODINGS[name]
        n = max(args.n // 4, 10) if params.use_beam_search else args.n
        t0 = time.perf_counter()
        preds = run_lines(llm, lines[:n], params)
        rows.append(("single line", name, score(preds, lines[:n], lambda p, c: c["prefix"] + p + c["after"]),
                     time.perf_counter() - t0))
        print(json.dumps({"task": "line", "decoding": name, **rows[-1][2], "seconds": round(rows[-1][3])}), flush=True)
        for fmt in formats:
            t0 = time.perf_counter()
            preds = run_fim(llm, fims[:n], params, fmt)
            rows.append((f"FIM ({fmt})", name, score(preds, fims[:n], lambda p, c: c["prefix"] + p + c["suffix"]),
                         time.perf_counter() - t0))
            print(json.dumps({"task": f"fim-{fmt}", "decoding": name, **rows[-1][2], "seconds": round(rows[-1][3])}),
                  flush=True)
    table = ["| task | decoding | n | exact match | edit similarity | file parses | seconds |", "|---|---|---|---|---|---|---|"]
    table += [f"| {t} | {d} | {m['n']} | {m['exact_match']:.3f} | {m['edit_similarity']:.3f} | {m['parses']:.3f} | "
              f"{s:.0f} |" for t, d, m, s in rows]
    print("\n".join(table))
    if args.out:
        Path(args.out).write_text("\n".join(table) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
