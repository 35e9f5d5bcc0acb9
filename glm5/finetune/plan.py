"""`glm5 plan --finetune lora|prefix|full`: memory per rank for fine-tuning a preset on a mesh (arithmetic).

Full fine-tuning trains every weight: its memory is the pretraining plan's (glm5/train/plan.py) without the
MTP layer and loss. LoRA and prefix tuning keep the base frozen, which changes what each rank holds:
- Base weights: the FSDP shard of every base tensor (the same placement as pretraining: TP-split
  projections / (tp x D), replicated ones / D, routed experts / (ep x dp x tp)) at the dtype it is held in:
  the compute dtype (bf16), fp32 for the router and `indexer.weights_proj`, or with `base_quant` the
  int8 / fp8 bytes plus their scales (fp32 per output channel; fp32 per 128 x 128 tile) for the tensors
  glm5/finetune/quant_base.py holds quantised. No gradients, masters or optimizer states for it.
- While a unit computes, FSDP holds it unsharded (2 units: the one running and the one prefetched), at
  the held dtype; a quantised weight is dequantised per module (one module's matrix at a time in forward).
- Adapters (the LoRA pairs `resolve_targets` picks, or the latent prefixes `apply_prefix` adds, counted
  on the meta model): fp32 parameters, gradients and AdamW moments (4 + 4 + 8 bytes per element), sharded
  like the base tensor they adapt.
- Activations: the pretraining estimate per layer and token for the main layers, plus LoRA's rank-r
  intermediates (T x r per adapted matrix, top-k x T/tp x r per expert target) and the logits. Autograd
  keeps each quantised module's dequantised matrix for its backward: without activation checkpointing
  every layer's (unsharded per rank, compute dtype), with it one layer's.
Pipeline parallel is not planned here: fine-tuning runs on FSDP + EP + TP.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from glm5.model.config import ModelConfig
from glm5.model.hf_adapter import FP32_SUFFIXES
from glm5.model.lora import LoraConfig, base_shape, resolve_targets
from glm5.model.model import GLM5ForCausalLM
from glm5.train.parallel import check_model, mesh_shape
from glm5.train.plan import (Accelerator, Layout, Plan, _layer_activation_elems, _stored, _unit_of, _unsharded,
                             plan)

from . import prefix as prefix_mod
from .quant_base import FP8_BLOCK, check_base_quant, quant_targets

GB = 1e9


@dataclass
class FinetuneLayout:
    """What trains (the `glm5 finetune` keys this plan reads)."""

    method: str = "lora"  # lora | prefix | full
    lora: LoraConfig = field(default_factory=LoraConfig)
    prefix_tokens: int = 16  # prefix.num_virtual_tokens
    base_quant: str = "none"  # model.base_quant

    def __post_init__(self):
        if self.method not in ("lora", "prefix", "full"):
            raise ValueError(f"finetune method {self.method!r}: must be one of ['lora', 'prefix', 'full']")
        check_base_quant(self.base_quant, "base_quant")
        if self.method == "full" and self.base_quant != "none":
            raise ValueError(f"base_quant = {self.base_quant!r} holds a frozen base: it needs lora or prefix")


@dataclass
class FinetunePlan(Plan):
    adapter_params: int = 0  # trainable elements (LoRA pairs or prefixes)
    memory_bytes: dict[str, float] = field(default_factory=dict)  # memory_gb unrounded, in bytes


def held_bytes(shape: torch.Size, kind: str, parts: int) -> float:
    """Bytes of one weight held quantised: 1 per element + fp32 scales (per output channel for int8,
    per 128 x 128 tile of each fused part for fp8)."""
    *lead, n, k = shape
    lead_n = int(torch.Size(lead).numel())
    if kind == "int8":
        return lead_n * n * (k + 4)
    rows, cols = -(-(n // parts) // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1])
    return lead_n * (n * k + 4 * parts * rows * cols)


def _adapters(model: GLM5ForCausalLM, ft: FinetuneLayout) -> list[tuple[str, int, int]]:
    """(base tensor name, adapter elements, LoRA rank or 0) for what trains."""
    if ft.method == "lora":
        out = []
        for t in resolve_targets(model, ft.lora):
            shape = base_shape(model, t)
            e = shape[0] if t.param is not None else 1
            out.append((t.key if t.param else f"{t.name}.weight", e * t.r * (shape[-1] + shape[-2]), t.r))
        return out
    prefix_mod.apply_prefix(model, ft.prefix_tokens)
    return [(n, p.numel(), 0) for n, p in model.named_parameters() if p.requires_grad]


def plan_finetune(cfg: ModelConfig, lay: Layout, acc: Accelerator, ft: FinetuneLayout) -> Plan:
    """Per-GPU memory for `ft` on `lay` (the busiest rank; all ranks hold the same without pipeline)."""
    lay = replace(lay, mtp=False)  # no MTP loss in fine-tuning
    if ft.method == "full":
        return plan(cfg, lay, acc)
    shape = mesh_shape(lay.gpus, lay.dp, lay.ep, lay.tp, lay.pp)
    if shape["pp"] > 1:
        raise ValueError("--pp: fine-tuning runs on FSDP + EP + TP (no pipeline parallel)")
    check_model(cfg, shape)
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg)
    cb = lay.compute_bytes
    quant = {name: (getattr(mod, attr).shape, parts) for name, mod, attr, parts in quant_targets(model)} \
        if ft.base_quant != "none" else {}
    table = [(n, *_unit_of(n), p.numel()) for n, p in model.named_parameters()]
    stored = units = 0.0
    unit_bytes: dict = {}
    deq_layer: dict = {}  # dequantised bytes per layer (unsharded, compute dtype)
    for name, kind, layer, n in table:
        if name in quant:
            b = held_bytes(quant[name][0], ft.base_quant, quant[name][1])
            deq_layer[layer] = deq_layer.get(layer, 0.0) + _unsharded(kind, n, shape) * cb
        else:
            b = n * (4 if name.endswith(FP32_SUFFIXES) else cb)
        stored += _stored(kind, b, shape)
        key = (layer, kind == "expert" and (shape["ep"] > 1 or shape["tp"] > 1))
        unit_bytes[key] = unit_bytes.get(key, 0.0) + _unsharded(kind, b, shape)
    adapters = _adapters(model, ft)
    adapter_stored = sum(_stored(_unit_of(base)[0], n, shape) for base, n, _ in adapters)
    T, h, tp = lay.micro_batch * lay.seq_len, cfg.hidden_size, shape["tp"]
    n_main = cfg.num_hidden_layers
    moe = sum(1 for x in range(n_main) if cfg.mlp_layer_types[x] == "sparse")
    act_layer = [_layer_activation_elems(cfg, lay, shape, m) for m in (False, True)]
    k = cfg.num_experts_per_tok
    lora_act = sum((T / tp) * k * r if _unit_of(base)[0] == "expert" else T * r for base, _, r in adapters)
    act_all = (n_main - moe) * act_layer[0] + moe * act_layer[1] + lora_act
    logits = T * cfg.vocab_size / tp * 4 * 2
    deq_main = {l_: b for l_, b in deq_layer.items() if l_ is not None and l_ < n_main}
    held = f"{ft.base_quant} + scales" if ft.base_quant != "none" else f"{8 * cb}-bit"
    mem = {f"base weights (frozen shard, {held})": stored / GB,
           "base weights (unsharded compute copies, 2 units)": sum(sorted(unit_bytes.values())[-2:]) / GB,
           "dequantised weights (one module, forward)": max(
               (_unsharded(_unit_of(n)[0], torch.Size(s).numel(), shape) * cb for n, (s, _) in quant.items()),
               default=0.0) / GB,
           "adapter parameters (fp32 shard)": 4 * adapter_stored / GB,
           "adapter gradients (fp32 shard)": 4 * adapter_stored / GB,
           "optimizer states (AdamW m, v)": 8 * adapter_stored / GB,
           "activations (no checkpointing)": (cb * act_all + sum(deq_main.values()) + logits) / GB,
           "activations (checkpointing)": (cb * (n_main * T * h + max(act_layer) + lora_act / n_main)
                                           + max(deq_main.values(), default=0.0) + logits) / GB}
    return FinetunePlan(lay, shape, sum(n for *_, n in table), [round(stored)],
                        memory_gb={k_: round(v, 3) for k_, v in mem.items()},
                        memory_bytes={k_: v * GB for k_, v in mem.items()},
                        tokens_per_step=lay.grad_accum * T * shape["dp"] * shape["ep"],
                        adapter_params=sum(n for _, n, _ in adapters))


def report_finetune(p: FinetunePlan, acc: Accelerator, name: str, ft: FinetuneLayout) -> str:
    lay, sh = p.layout, p.shape
    what = f"LoRA r={ft.lora.r} on {ft.lora.targets}" if ft.method == "lora" else \
        f"prefix of {ft.prefix_tokens} entries per layer"
    lines = [f"plan: fine-tuning {name} ({what}, base {ft.base_quant}) on {lay.gpus} x {acc.name}: "
             f"dp {sh['dp']} x ep {sh['ep']} x tp {sh['tp']}",
             f"  batch: {lay.micro_batch} x {lay.seq_len} tokens per micro-batch per data rank, {lay.grad_accum} "
             f"micro-batches -> {p.tokens_per_step:,} tokens per step",
             f"  parameters: {p.params_total:,} base, {p.adapter_params:,} trainable; "
             f"base per GPU (FSDP shard): {p.params_per_rank[0] / GB:.2f} GB",
             "  memory per GPU, GB:"]
    lines += [f"    {k:<52} {v:10.3f}" for k, v in p.memory_gb.items()]
    base = sum(v for k, v in p.memory_gb.items() if not k.startswith("activations"))
    for k in ("activations (no checkpointing)", "activations (checkpointing)"):
        lines.append(f"    {'total with ' + k:<52} {base + p.memory_gb[k]:10.3f}  (HBM {acc.hbm_gb:.0f})")
    return "\n".join(lines)

