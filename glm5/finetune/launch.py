"""`glm5 finetune --config configs/finetune/<name>.toml [--method lora|prefix|full] [--resume auto]
[--section.key=value ...]`: LoRA / prefix / full fine-tuning of a base checkpoint on chat JSONL.
Also `python -m glm5.finetune ...` and `torchrun --nproc_per_node N -m glm5.finetune ... --parallel.*`
(the mesh keys of `glm5 train`: data, expert and tensor parallel for every method).

Same loop, logs, plots (`glm5 plot RUN_DIR`) and resumable checkpoints as `glm5 train`; `RUN_DIR/final`
holds the adapter (lora, prefix) or the model (full) plus the tokenizer. See docs/finetune.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from glm5.core.config import ConfigError, load_config, to_dict
from glm5.core.dist import is_main
from glm5.train.stability import TrainingDiverged

from .config import FinetuneConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="glm5 finetune", description=__doc__.splitlines()[0],
                                epilog="Any --section.key=value overrides the config file.")
    p.add_argument("--config", help="TOML file (configs/finetune/*.toml)")
    p.add_argument("--method", choices=["lora", "prefix", "full"], help="overrides the config's method")
    p.add_argument("--resume", help="'auto' (latest checkpoint of the run dir) or a checkpoint dir")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    bad = [a for a in overrides if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        p.error(f"unrecognised arguments {bad}; overrides look like --section.key=value")
    overrides += [f"method={json.dumps(args.method)}"] if args.method else []
    overrides += [f"checkpoint.resume={json.dumps(args.resume)}"] if args.resume else []
    try:
        cfg = load_config(FinetuneConfig, args.config, overrides)
    except (ConfigError, ValueError) as e:
        print(f"glm5 finetune: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .trainer import FinetuneTrainer  # heavy imports only once the config is valid
    try:
        trainer = FinetuneTrainer(cfg)
    except (ValueError, FileNotFoundError) as e:  # base / adapter / data problems found while building
        print(f"glm5 finetune: {e}", file=sys.stderr)
        return 2
    try:
        summary = trainer.fit()
    except TrainingDiverged as e:
        print(f"glm5 finetune: diverged: {e}", file=sys.stderr)
        return 3
    if is_main():
        print(json.dumps({"run_dir": cfg.log.run_dir, "method": cfg.method, **summary}))
    return 0
