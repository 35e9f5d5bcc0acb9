"""`glm5 merge BASE ADAPTER OUT [--dtype keep]`: fold a LoRA adapter into its base checkpoint.

Writes a plain HF checkpoint (config.json + safetensors + the base's tokenizer files) that glm5 and
transformers load like any other; adapter errors (wrong base, rank, targets, pickle files) exit 2.
"""

from __future__ import annotations

import argparse
import sys

import torch

from glm5.finetune.adapters import merge_checkpoint
from glm5.model.peft_adapter import AdapterError


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 merge", description=__doc__.splitlines()[0])
    ap.add_argument("base", help="base HF checkpoint directory")
    ap.add_argument("adapter", help="PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)")
    ap.add_argument("out", help="output checkpoint directory")
    ap.add_argument("--dtype", default="keep", choices=["keep", "bfloat16", "float16", "float32"],
                    help="storage dtype of the merged weights (keep = the base's load dtype)")
    args = ap.parse_args(argv)
    try:
        out = merge_checkpoint(args.base, args.adapter, args.out,
                               None if args.dtype == "keep" else getattr(torch, args.dtype))
    except (AdapterError, FileNotFoundError) as e:
        print(f"glm5 merge: {e}", file=sys.stderr)
        return 2
    print(f"merged {args.adapter} into {args.base} -> {out}")
    return 0
