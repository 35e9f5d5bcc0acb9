"""`glm5 plan --preset glm-5 --gpus 1024 --tp 8 --pp 4 --ep 32`: per-GPU memory, communication per step
and a roofline step time for a parallel layout (arithmetic only; glm5/train/plan.py). With `--finetune
lora|prefix|full` (`--lora.r`, `--lora.targets`, `--prefix.num-virtual-tokens`, `--base-quant`): memory
per GPU for fine-tuning (glm5/finetune/plan.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from glm5.finetune.plan import FinetuneLayout, plan_finetune, report_finetune
from glm5.model.config import ModelConfig, list_presets
from glm5.model.lora import LoraConfig
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
    ap.add_argument("--finetune", choices=["lora", "prefix", "full"], help="plan fine-tuning by this method")
    ap.add_argument("--lora.r", dest="lora_r", type=int, default=8, help="LoRA rank")
    ap.add_argument("--lora.targets", dest="lora_targets", nargs="+", default=["attn"],
                    help="LoRA target groups or name suffixes (as [lora] targets)")
    ap.add_argument("--prefix.num-virtual-tokens", dest="prefix_tokens", type=int, default=16)
    ap.add_argument("--base-quant", choices=["none", "int8", "fp8"], default="none",
                    help="how the frozen base is held (model.base_quant)")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_preset(args.preset) if args.preset else ModelConfig.from_pretrained(args.model)
    lay = Layout(gpus=args.gpus, tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, micro_batch=args.micro_batch,
                 seq_len=args.seq_len, grad_accum=args.grad_accum, stages_per_rank=args.stages_per_rank,
                 schedule=args.schedule, pipeline_split=tuple(args.pipeline_split),
                 gpus_per_node=args.gpus_per_node, mtp=not args.no_mtp)
    acc = ACCELERATORS[args.accelerator]
    name = args.preset or args.model
    try:
        if args.finetune:
            ft = FinetuneLayout(method=args.finetune, lora=LoraConfig(r=args.lora_r, targets=args.lora_targets),
                                prefix_tokens=args.prefix_tokens, base_quant=args.base_quant)
            p = plan_finetune(cfg, lay, acc, ft)
        else:
            if args.base_quant != "none":
                raise ValueError("--base-quant holds a frozen fine-tuning base: give --finetune lora or prefix")
            p = plan(cfg, lay, acc)
    except ValueError as e:
        print(f"glm5 plan: {e}", file=__import__("sys").stderr)
        return 2
    if args.json:
        print(json.dumps({**dataclasses.asdict(p), "accelerator": dataclasses.asdict(acc)}, indent=2))
    elif args.finetune in ("lora", "prefix"):
        print(report_finetune(p, acc, name, ft))
    else:
        print(report(p, acc, name))
    return 0
