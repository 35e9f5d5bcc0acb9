"""`glm5 eval`: evaluate a checkpoint or an OpenAI-compatible server on a task, or run a config.

    glm5 eval --model runs/tiny/final --task mmlu --data mmlu/data --num-fewshot 5 --output out/mmlu.json
    glm5 eval --model http://127.0.0.1:8000 --tokenizer runs/tiny/final --task ceval --output ceval.json
    glm5 eval --task humaneval --samples samples.jsonl --output he.json         # score given completions
    glm5 eval --config configs/eval/tiny.toml --output_dir=runs/eval           # models x tasks + report

Without --data the bundled set is used. Finished documents are kept in OUT.records.jsonl: a rerun of the
same command resumes. Exit 2 on a bad file or option (the message names it), 1 when the model's
server stays unreachable (finished results are kept).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glm5.core.config import ConfigError, apply_overrides, from_dict, load_toml


def parse(argv):
    ap = argparse.ArgumentParser(prog="glm5 eval", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML with [[models]] and [[tasks]] (see configs/eval/)")
    ap.add_argument("--model", help="checkpoint directory, preset, or http(s):// server URL (default: the "
                    "embedded model bundled:smollm2-glm5)")
    ap.add_argument("--task", choices=["ppl", "mmlu", "mmlu_continuation", "ceval", "ceval_continuation",
                                       "continuation", "lambada", "humaneval", "exact", "queries"])
    ap.add_argument("--data", help="task file or directory (default: the bundled set)")
    ap.add_argument("--output", help="OUT.json (default: runs/eval/TASK.json)")
    ap.add_argument("--num-fewshot", type=int, default=0)
    ap.add_argument("--split", help="mmlu/ceval split to evaluate (default test / val)")
    ap.add_argument("--limit", type=int, help="first N documents only")
    ap.add_argument("--samples", help="humaneval: JSONL of {task_id, completion} to score")
    ap.add_argument("--n", type=int, default=1, help="humaneval: samples per problem")
    ap.add_argument("--k", default="1", help="humaneval: comma-separated pass@k values")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--beam-width", type=int, default=1, help="generation tasks: beam search of this width")
    ap.add_argument("--temperature-schedule", type=float, nargs=2, metavar=("START", "END"),
                    help="generation tasks: temperature decayed linearly from START to END (the seeds' 0.8 0.2)")
    ap.add_argument("--timeout", type=float, default=10.0, help="humaneval: seconds per program")
    ap.add_argument("--regex", help="exact: answer extraction pattern (first group)")
    ap.add_argument("--chat", action="store_true", help="exact/queries/humaneval: prompts through the chat template (humaneval: the reply's code block is run)")
    ap.add_argument("--judge-url", help="queries: OpenAI-compatible judge server")
    ap.add_argument("--judge-model")
    ap.add_argument("--tokenizer", help="URL models: tokenizer directory (needed for log-likelihood tasks)")
    ap.add_argument("--api-model", help="URL models: model name on the server")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--backend", choices=["engine", "hf"], default="engine",
                    help="checkpoints: the glm5 engine, or transformers for any causal LM")
    ap.add_argument("--gguf-file", help="hf backend: GGUF file inside --model")
    ap.add_argument("--device")
    ap.add_argument("--no-special-tokens", action="store_true",
                    help="score text without the tokenizer's prefix tokens (as lm-eval's local-completions)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_known_args(argv)


def config_from_flags(args):
    from glm5.eval.harness import EvalConfig, ModelSpec
    from glm5.eval.tasks import TaskConfig

    if not args.task:
        raise ConfigError("give --task (or --config)")
    if not args.model and not (args.task == "humaneval" and args.samples):
        from glm5.cli.models import resolve_model  # noqa: PLC0415 (builds the embedded model on first use)
        args.model = resolve_model(None)
    task = TaskConfig(task=args.task, data=args.data, split=args.split, num_fewshot=args.num_fewshot, limit=args.limit,
                      samples=args.samples, n=args.n, k=[int(k) for k in args.k.split(",")],
                      temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, regex=args.regex,
                      judge_url=args.judge_url, judge_model=args.judge_model, timeout_s=args.timeout,
                      chat=args.chat, beam_width=args.beam_width, temperature_schedule=args.temperature_schedule)
    spec = ModelSpec(model=args.model or "samples", backend=args.backend, gguf_file=args.gguf_file,
                     tokenizer=args.tokenizer, api_model=args.api_model,
                     max_length=args.max_length, batch_size=args.batch_size, device=args.device,
                     add_special_tokens=not args.no_special_tokens)
    return spec, task


def run_single(args) -> dict:
    from glm5.eval.harness import build_model, run_task
    from glm5.eval.tasks import build_task

    spec, tcfg = config_from_flags(args)
    task = build_task(tcfg)
    model = None if tcfg.samples else build_model(spec)
    out = Path(args.output or f"runs/eval/{tcfg.name}.json")
    return run_task(task, model, out, model_name=spec.label, label=tcfg.name, limit=tcfg.limit,
                    progress=not args.no_progress)


def run_config_file(args, overrides) -> list[dict]:
    from glm5.eval.harness import EvalConfig, run_config

    from glm5.core.resources import config_file

    cfg = from_dict(EvalConfig, apply_overrides(load_toml(config_file(args.config)), overrides))
    return run_config(cfg, progress=not args.no_progress)


def main(argv: list[str] | None = None) -> int:
    from glm5.eval.loaders import DataError
    from glm5.eval.openai_model import ModelUnavailable

    args, rest = parse(argv)
    try:
        if args.config:
            results = run_config_file(args, rest)
        else:
            if rest:
                raise ConfigError(f"unknown arguments {rest}")
            results = [run_single(args)]
    except (ConfigError, DataError, FileNotFoundError, ValueError) as e:
        print(f"glm5 eval: {e}", file=sys.stderr)
        return 2
    except ModelUnavailable as e:
        print(f"glm5 eval: {e}; finished documents are kept, rerun to resume", file=sys.stderr)
        return 1
    for r in results:
        ms = "  ".join(f"{k}={v:.4f}" for k, v in r["metrics"].items())
        chance = "" if r.get("chance") is None else f", chance {r['chance']:.4f}"
        print(f"{r['model']} | {r['task']} (n={r['n']}{chance}): {ms}")
    return 0
