"""`glm5 plan --preset glm-5 --gpus 1024 --tp 8 --pp 4 --ep 32`: per-GPU memory, communication per step
and a roofline step time for a parallel layout (arithmetic only; glm5/train/plan.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from glm5.model.config import ModelConfig, list_presets
from glm5.train.plan import ACCELERATORS, Layout, plan, report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="glm5 plan", description=__doc__)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help=f"one of {list_presets()}")
    src.add_argument("--model", help="a checkpoint directory or config.json")
    ap.add_argument("--gpus", type=int, required=True, help="world size")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    ap.add_argument("--pp", type=int, default=1, help="pipeline parallel degree")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel degree")
    ap.add_argument("--dp", type=int, default=0, help="FSDP degree besides ep (0 = the rest)")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch per data rank")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--grad-accum", type=int, default=8, help="micro-batches per optimizer step")
    ap.add_argument("--schedule", choices=["1f1b", "interleaved_1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--stages-per-rank", type=int, default=1)
    ap.add_argument("--pipeline-split", type=int, nargs="*", default=[], help="main layers per stage")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--accelerator", choices=sorted(ACCELERATORS), default="H100")
    ap.add_argument("--no-mtp", action="store_true", help="plan without the MTP layer and loss")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_preset(args.preset) if args.preset else ModelConfig.from_pretrained(args.model)
    lay = Layout(gpus=args.gpus, tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, micro_batch=args.micro_batch,
                 seq_len=args.seq_len, grad_accum=args.grad_accum, stages_per_rank=args.stages_per_rank,
                 schedule=args.schedule, pipeline_split=tuple(args.pipeline_split),
                 gpus_per_node=args.gpus_per_node, mtp=not args.no_mtp)
    acc = ACCELERATORS[args.accelerator]
    try:
        p = plan(cfg, lay, acc)
    except ValueError as e:
        print(f"glm5 plan: {e}", file=__import__("sys").stderr)
        return 2
    if args.json:
        print(json.dumps({**dataclasses.asdict(p), "accelerator": dataclasses.asdict(acc)}, indent=2))
    else:
        print(report(p, acc, args.preset or args.model))
    return 0
