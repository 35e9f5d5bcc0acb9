"""Fine-tuning on the distributed mesh: which meshes a method can use, and the trained part gathered
from the shards into the single-process layout (for PEFT files written by rank 0).

The model is built as in one process (base + adapters, base frozen), then `glm5.train.parallel.parallelize`
shards it like a pretraining model: FSDP2 units hold frozen and trainable parameters together (torch's
`fully_shard` keeps `requires_grad` per parameter and reduces only the gradients that exist), expert
parallel gives each rank its experts' LoRA slices (`parallel_ep.EPExperts`), tensor parallel splits
each adapter like its base weight (`parallel_tp._lora_styles`), and `parallelize` here adds the
tensor-parallel gradient reduction of prefix entries (`TPPrefixMLAttention`). A quantised base
(`model.base_quant`, glm5/finetune/quant_base.py) is held the same way on every layout: FSDP2 shards its
int8 / fp8 storage like any frozen parameter, expert parallel slices it with its scales, tensor parallel
splits it like the plain weight. Every trained tensor keeps its name
and its full shape (as a DTensor), so `gather_trainable` can rebuild the exact single-process tensors
and DCP can reshard a checkpoint to another world size.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from glm5.core import dist

from . import prefix
from .adapters import GLM5AdapterModel
from .config import FinetuneConfig


def check_mesh(cfg: FinetuneConfig, world: int = 1) -> None:
    """Refuse, before the base is loaded, a mesh the method cannot run on (ValueError naming the key).
    `world`: the number of processes (torchrun's WORLD_SIZE)."""
    par = cfg.parallel
    if cfg.method != "full" and par.pipeline_parallel > 1:
        raise ValueError(f"method = {cfg.method!r} with parallel.pipeline_parallel={par.pipeline_parallel}: "
                         "adapters are not pipelined; use data, expert or tensor parallel "
                         "(parallel.pipeline_parallel = 1), or method = 'full'")


class TPPrefixMLAttention(prefix.PrefixMLAttention):
    """A prefix attention under tensor parallel (a class swap after `parallelize`; the math is the base
    class's). The prefix entries join the latent and the rope key after the points where tensor parallel
    all-reduces the real tokens' gradients (kv_a_layernorm's output, the rope slice of
    kv_a_proj_with_mqa: glm5/train/parallel_tp.py), and they feed this rank's heads only, so their
    slice gets the same reduction here."""

    tp_group: ProcessGroup  # the "tp" mesh dimension's

    def project_kv(self, x, cos, sin):
        from glm5.train.parallel_tp import grad_all_reduce
        c_kv, k_rope = super().project_kv(x, cos, sin)  # [B, P + T, R], [B, P + T, rope]
        P = self.prefix.latent.shape[0]
        reduce = lambda t: torch.cat([grad_all_reduce(t[:, :P], self.tp_group), t[:, P:]], dim=1)  # noqa: E731
        return reduce(c_kv), reduce(k_rope)


def parallelize(model: nn.Module, cfg: FinetuneConfig) -> nn.Module:
    """The trainer's hook: `glm5.train.parallel.parallelize`, then (tensor parallel, prefix tuning) the
    prefix attentions' gradient reduction (`TPPrefixMLAttention`)."""
    from glm5.train.parallel import parallelize as parallelize_model
    model = parallelize_model(model, cfg)
    plan = model.parallel_plan
    if plan.tp > 1 and cfg.method == "prefix":
        group = plan.mesh["tp"].get_group()
        for layer in model.model.main_layers:
            layer.self_attn.__class__ = TPPrefixMLAttention
            layer.self_attn.tp_group = group
    return model


@torch.no_grad()
def gather_trainable(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Collective (every rank, same order): the full CPU tensor of every trainable parameter by name,
    on rank 0; None elsewhere. Sharded parameters (FSDP, expert or tensor parallel DTensors) are
    all-gathered; plain ones are taken as they are."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if dist.is_main():
            out[name] = full.detach().cpu().clone()
    return out if dist.is_main() else None


def _unquantised_name(name: str) -> str:
    """A trained tensor's name on an unquantised base: on a quantised one (glm5/finetune/quant_base.py) the
    routed experts' `ExpertLoRA` follows the dequantisation in the parametrization chain
    (`parametrizations.gate_up_proj.1.lora_A`), on the plain base it is the chain's first (`.0.`)."""
    return re.sub(r"(\.parametrizations\.\w+)\.\d+\.(lora_[AB])$", r"\1.0.\2", name)


def assemble(cfg: FinetuneConfig, config, tensors: dict[str, torch.Tensor], base: str) -> GLM5AdapterModel:
    """A meta-device model with the run's adapter structure (`cfg.method`, `cfg.lora` / `cfg.prefix`)
    holding `tensors` (from `gather_trainable`): what one process would have trained, ready for
    `peft_adapter.write_adapter` / `prefix.write_prefix`. Raises naming a tensor that does not fit."""
    with torch.device("meta"):
        shadow = GLM5AdapterModel(config)
        if cfg.method == "lora":
            shadow.add_lora(cfg.lora)
        elif cfg.method == "prefix":
            prefix.apply_prefix(shadow, cfg.prefix.num_virtual_tokens)
        else:
            raise ValueError(f"method = {cfg.method!r}: only adapters are assembled (full runs export the model)")
    shadow.name_or_path = base
    tensors = {_unquantised_name(n): t for n, t in tensors.items()}
    want = {n: p for n, p in shadow.named_parameters() if p.requires_grad}
    if set(want) != set(tensors):
        odd = sorted(set(want) ^ set(tensors))
        raise ValueError(f"gathered adapter tensors differ from the {cfg.method} structure: {odd[:3]}")
    for name, t in tensors.items():
        if list(t.shape) != list(want[name].shape):
            raise ValueError(f"gathered {name} has shape {list(t.shape)}, expected {list(want[name].shape)}")
    shadow.load_state_dict(tensors, strict=False, assign=True)
    return shadow
