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

# Commands whose own parser takes `--debug` (the others never see it)
OWN_DEBUG_FLAG = {"convert", "prune"}


def usage() -> str:
    lines = ["usage: glm5 <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user asked for something wrong (a path, a preset, a config key, a checkpoint
    that cannot be used, a request the model cannot serve): one line on stderr and exit 2, not a traceback.
    Imported only when an error is being reported, so `glm5 --help` stays cheap."""
    from glm5.apps.ocr.image import ImageError  # noqa: PLC0415
    from glm5.convert.llama import ConversionError  # noqa: PLC0415
    from glm5.core.config import ConfigError  # noqa: PLC0415
    from glm5.core.io import CheckpointError  # noqa: PLC0415
    from glm5.data.sft import SFTDataError  # noqa: PLC0415
    from glm5.data.pipeline.executor import JobFailed  # noqa: PLC0415
    from glm5.distill.prune import PruneError  # noqa: PLC0415
    from glm5.eval.loaders import DataError  # noqa: PLC0415
    from glm5.infer.infill import InfillError  # noqa: PLC0415
    from glm5.model.config import ModelConfigError  # noqa: PLC0415
    from glm5.model.peft_adapter import AdapterError  # noqa: PLC0415

    return (ImageError, ConversionError, ConfigError, CheckpointError, SFTDataError, JobFailed, PruneError, DataError,
            InfillError, ModelConfigError, AdapterError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError)


def run_command(name: str, rest: list[str]) -> int:
    """Run `glm5 <name> rest...`; a user mistake prints `glm5 <name>: <message>` and returns 2. `--debug`
    (anywhere after the command) re-raises it with its traceback."""
    debug = "--debug" in rest
    module = importlib.import_module(f"glm5.cli.{COMMANDS[name][0]}")
    try:
        return int(module.main(rest if name in OWN_DEBUG_FLAG else [a for a in rest if a != "--debug"]) or 0)
    except Exception as e:  # noqa: BLE001 (sorted below: only user mistakes become one line)
        if debug or not isinstance(e, user_errors()):
            raise
        print(f"glm5 {name}: {e}".replace("\n", " "), file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"glm5: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return run_command(name, rest)


if __name__ == "__main__":
    sys.exit(main())
