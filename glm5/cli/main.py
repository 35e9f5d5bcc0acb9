"""`glm5` console script: dispatches `glm5 <command> ...` to `glm5.cli.<module>:main(argv)`.

Each command lives in its own module so that importing the CLI stays cheap (the server's FastAPI,
for example, is only imported by `glm5 serve`).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "info": ("info", "parameter accounting of a preset or checkpoint (no memory: meta device)"),
    "data": ("data", "data pipeline: `glm5 data run|stats|tokenizer|corpus ...`"),
    "train": ("train", "pretraining: `glm5 train --config configs/train/tiny.toml`"),
    "plot": ("plot", "PNG plots of a training run: `glm5 plot RUN_DIR`"),
    "plan": ("plan", "plan a parallel run: per-GPU memory, communication, step time (`glm5 plan --preset glm-5 ...`)"),
    "generate": ("generate", "generate text: `glm5 generate --model PATH --prompt ...`"),
    "serve": ("serve", "OpenAI-compatible server: `glm5 serve --model PATH`"),
    "convert": ("convert", "FP8 dequantisation / re-sharding; `glm5 convert --from-llama SRC OUT`: Llama, Mistral, "
                           "Qwen2 -> GLM-5 (exact)"),
    "finetune": ("finetune", "LoRA / prefix / full fine-tuning: `glm5 finetune --config configs/finetune/lora.toml`"),
    "merge": ("merge", "fold a LoRA adapter into its base: `glm5 merge BASE ADAPTER OUT`"),
    "eval": ("eval", "evaluate: `glm5 eval --model PATH_OR_URL --task mmlu --data DIR --output OUT.json`"),
    "distill": ("distill", "knowledge distillation into a small student: `glm5 distill --config ...`"),
    "prune": ("prune", "importance-guided depth/width/expert pruning of a checkpoint (Minitron): `glm5 prune CKPT OUT`"),
    "lm-eval": ("lm_eval_cli", "lm-evaluation-harness with `--model glm5` registered: `glm5 lm-eval run ...`"),
    "quickstart": ("quickstart", "the main job: data pipeline -> train tiny -> generate"),
    "ocr": ("ocr", "OCR agent: `glm5 ocr IMAGE... [--format json|md|txt] [--rounds N] [--model CKPT]`"),
}


def usage() -> str:
    lines = ["usage: glm5 <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"glm5: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"glm5.cli.{COMMANDS[name][0]}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
