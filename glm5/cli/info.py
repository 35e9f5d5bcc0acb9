"""`glm5 info --preset glm-5` / `glm5 info --model DIR`: parameter accounting on the meta device."""

from __future__ import annotations

import argparse
import json

from glm5.model.config import ModelConfig, list_presets
from glm5.model.params import count_parameters, report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 info", description=__doc__)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"one of {list_presets()}")
    src.add_argument("--model", help="a checkpoint directory or config.json")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_preset(args.preset) if args.preset else ModelConfig.from_pretrained(args.model)
    print(json.dumps(count_parameters(cfg), indent=2) if args.json else report(cfg, args.preset or args.model))
    return 0
