"""`glm5 convert SRC DST [--dtype bfloat16] [--max-shard-size 5GB]`: re-write a HF GLM-5 checkpoint.

Dequantises FP8 block-scaled weights (`weight_scale_inv`), casts to `--dtype` (router, its bias and the
indexer head weights stay fp32) and re-shards, streaming tensor by tensor: memory stays near one shard.
The result loads in glm5 (`glm5.from_pretrained`) and in transformers.
"""

from __future__ import annotations

import argparse
import json

import torch

from glm5.model.hf_adapter import convert_checkpoint


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 convert", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("dst", help="output directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "keep"],
                    help="storage dtype of the output ('keep' = as stored; FP8 becomes fp32)")
    ap.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB")
    args = ap.parse_args(argv)
    dtype = None if args.dtype == "keep" else getattr(torch, args.dtype)
    print(json.dumps(convert_checkpoint(args.src, args.dst, dtype, args.max_shard_size)))
    return 0
