"""`glm5 ocr`: read page images with the OCR agent (needs `pip install glm5[ocr]`).

    glm5 ocr page.png                                    # Markdown on stdout
    glm5 ocr a.png b.jpg --format json --rounds 3 --model runs/ocr-lm/final
    glm5 ocr scan.png --format txt --output scan.txt

`--rounds 0` is the recogniser alone, 1 adds re-recognition of doubtful lines, 2+ adds language-model
rounds with `--model` (a glm5 checkpoint directory with its tokenizer). JSON holds blocks, lines,
boxes, confidences, reading order and every correction. A file that is not a readable image, a page
over the work budget (`--max-work-mpx`, docs/ocr.md) and one past the per-page time limit
(`--timeout-s`; none by default) are each reported on one line naming the file and skipped (exit
status 1); the other files are still read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="glm5 ocr", description=__doc__.split("\n")[0])
    p.add_argument("images", nargs="+", help="image files (PNG, JPEG, WebP, BMP, TIFF, GIF)")
    p.add_argument("--format", choices=["md", "json", "txt"], default="md", help="output format (default md)")
    p.add_argument("--rounds", type=int, default=2, help="correction rounds (default 2)")
    p.add_argument("--model", default=None, help="glm5 checkpoint for the language-model rounds (default: the "
                   "embedded model bundled:smollm2-glm5)")
    p.add_argument("--no-model", action="store_true", help="skip the language-model rounds")
    p.add_argument("--threshold", type=float, default=None, help="confidence under which a line is doubtful")
    p.add_argument("--lm-weight", type=float, default=None, help="language model weight vs the recogniser")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime threads (0 = default)")
    from glm5.apps.ocr.limits import MAX_WORK_MPX  # noqa: PLC0415 - numpy only, no OCR extra needed

    p.add_argument("--max-work-mpx", type=float, default=None, help="refuse pages whose estimated recogniser "
                   f"work exceeds this many megapixels (> 0; default {MAX_WORK_MPX:g}, inf = no limit)")
    p.add_argument("--timeout-s", type=float, default=None, help="stop a page after this many seconds "
                   "(> 0; default: no limit)")
    p.add_argument("--output", default=None, help="write here instead of stdout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from glm5.apps.ocr.agent import OcrAgent, OcrConfig  # noqa: PLC0415 - keep `glm5 --help` cheap
    from glm5.apps.ocr.image import ImageError, read_image_file  # noqa: PLC0415
    from glm5.apps.ocr.limits import OcrOverBudget, OcrTimeout  # noqa: PLC0415
    from glm5.apps.ocr.perception import OcrUnavailable  # noqa: PLC0415
    from glm5.apps.ocr.render import to_json, to_markdown, to_text  # noqa: PLC0415

    for flag, value, unit in (("--max-work-mpx", args.max_work_mpx, "megapixels (inf for no limit)"),
                              ("--timeout-s", args.timeout_s, "seconds (leave it out for no limit)")):
        if value is not None and not value > 0:
            print(f"glm5 ocr: {flag}: must be > 0 {unit}, got {value:g}", file=sys.stderr)
            return 2
    opts = {k: v for k, v in (("threshold", args.threshold), ("lm_weight", args.lm_weight),
                              ("timeout_s", args.timeout_s), ("max_work_mpx", args.max_work_mpx)) if v is not None}
    try:
        model = args.model
        if args.rounds >= 2 and not args.no_model:
            from glm5.cli.models import resolve_model  # noqa: PLC0415
            model = resolve_model(model)
        agent = OcrAgent(OcrConfig(rounds=args.rounds, model=None if args.no_model else model,
                                   num_threads=args.threads, **opts))
    except (ValueError, FileNotFoundError, OcrUnavailable) as e:
        print(f"glm5 ocr: {e}", file=sys.stderr)
        return 2
    if args.rounds >= 2 and args.no_model:
        print("glm5 ocr: --no-model: the language-model rounds are skipped", file=sys.stderr)
    outputs, failed = [], 0
    for path in args.images:
        try:
            res = agent.read(read_image_file(path, agent.config.max_pixels), Path(path).name,
                             deadline=agent.deadline())
        except (ImageError, OcrOverBudget) as e:  # their messages start with the file's name
            print(f"glm5 ocr: {e}", file=sys.stderr)
            failed += 1
            continue
        except OcrTimeout as e:
            print(f"glm5 ocr: {Path(path).name}: {e}", file=sys.stderr)
            failed += 1
            continue
        outputs.append(res)
    if args.format == "json":
        docs = [to_json(r) for r in outputs]
        text = json.dumps(docs[0] if len(docs) == 1 else docs, ensure_ascii=False, indent=1) + "\n"
    else:
        render = to_markdown if args.format == "md" else to_text
        text = "\n".join((f"<!-- {r.name} -->\n" if len(outputs) > 1 and args.format == "md" else "") + render(r)
                         for r in outputs)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 1 if failed else 0
