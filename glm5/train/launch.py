"""Command line of a training run: `glm5 train` / `python -m glm5.train` / `torchrun ... -m glm5.train`.

  glm5 train --config configs/train/tiny.toml [--resume auto|PATH] [--section.key=value ...]

Every `--section.key=value` overrides the TOML (unknown keys are rejected with the valid ones listed).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from glm5.core.config import ConfigError, load_config, to_dict
from glm5.core.dist import is_main

from .config import TrainConfig
from .stability import TrainingDiverged


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="glm5 train", description="Pretrain a GLM-5 model.",
                                epilog="Any --section.key=value overrides the config file.")
    p.add_argument("--config", help="TOML file (configs/train/*.toml); defaults apply without it")
    p.add_argument("--resume", help="'auto' (latest checkpoint of the run dir) or a checkpoint dir")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        p.error(f"unrecognised arguments {bad}; overrides look like --section.key=value")
    if args.resume:
        rest.append(f"--checkpoint.resume={json.dumps(args.resume)}")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(TrainConfig, args.config, overrides)
    except ConfigError as e:
        print(f"glm5 train: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .trainer import Trainer  # heavy imports only once the config is valid
    try:
        trainer = Trainer(cfg)
    except (ValueError, FileNotFoundError) as e:  # a setting, the data or a checkpoint: say which, no traceback
        print(f"glm5 train: {e}", file=sys.stderr)
        return 2
    try:
        summary = trainer.fit()
    except TrainingDiverged as e:
        print(f"glm5 train: diverged: {e}", file=sys.stderr)
        return 3
    if summary and is_main():
        print(json.dumps({"run_dir": cfg.log.run_dir, **summary}))
    return 0
