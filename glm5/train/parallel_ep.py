"""Expert parallelism (EP): each rank of an EP group holds a contiguous slice of every MoE layer's routed
experts, and tokens travel to the rank that owns their expert and back with `all_to_all_single`.

Owns `EPExperts` (a drop-in for `glm5.model.moe.Experts`: same `forward(x, idx, weights, keep)`, same
parameter names) and `convert_to_ep(model, ep_mesh)`, which swaps every `MoE.experts` in place. The expert
weights become DTensors `Shard(0)` on the "ep" mesh dimension, so the distributed checkpoint sees the full
[E, ...] tensors under the usual names and can reshard them to another world size; forward uses the
local slice (`to_local`, differentiable). Both all-to-alls go through torch's differentiable
`all_to_all_single_autograd` (the one torchtitan uses; verified with gloo), so gradients flow back to
the sending rank's tokens and router weights.

Dims: N tokens, H hidden, A experts per token, E routed experts, L = E / ep local experts, M assignments
sent by this rank, R rows received by this rank, P = ep ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils import parametrize

from glm5.model.lora import EXPERT_PARAMS, ExpertLoRA
from glm5.model.moe import Experts, MoE, grouped_swiglu


def _expert_chain(experts: nn.Module, name: str) -> tuple[nn.Module | None, ExpertLoRA | None]:
    """(frozen storage parametrization, LoRA parametrization) of `experts.<name>`, each None if absent:
    a quantised base's dequantisation (marked `frozen_storage`, glm5/finetune/quant_base.py) first,
    then one `ExpertLoRA` (glm5.model.lora); nothing else can be sharded."""
    if not parametrize.is_parametrized(experts, name):
        return None, None
    chain = list(experts.parametrizations[name])
    quant = chain.pop(0) if getattr(chain[0], "frozen_storage", False) else None
    if len(chain) > 1 or (chain and not isinstance(chain[0], ExpertLoRA)):
        kinds = [type(c).__name__ for c in experts.parametrizations[name]]
        raise ValueError(f"expert parallel: {name} carries parametrizations {kinds}; only a quantised base's "
                         "storage and one LoRA adapter (ExpertLoRA) can be sharded")
    return quant, (chain[0] if chain else None)


class _LocalStorage(nn.Module):
    """A quantised base's parametrization (`select`ed to this rank's experts) run on the local shard of
    the [E, ...] storage DTensor: dequantised locally, returned as the same Shard(0) DTensor in the
    compute dtype (its scales are plain local tensors: frozen, never all-gathered)."""

    frozen_storage = True

    def __init__(self, inner: nn.Module, mesh: DeviceMesh):
        super().__init__()
        self.inner, self.mesh = inner, mesh

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        local = self.inner(w.to_local() if isinstance(w, DTensor) else w)
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False)


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: backward sends the gradients back the same way."""
    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group))


def _exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [E] rows this rank sends to each expert -> [P, L] rows each source rank sends to each of
    this rank's experts (the sizes of the token all-to-all must be known before it runs)."""
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)  # equal splits: chunk p = rank p's experts
    return recv


class EPExperts(nn.Module):
    """This rank's L = E / ep routed experts; dispatches tokens to their owners and combines the results.

    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] are DTensors sharded on dim 0 over the EP mesh
    (the local tensor is [L, 2I, H] / [L, H, I], experts [rank * L, (rank + 1) * L)). A LoRA-adapted
    source (`ExpertLoRA` parametrization, glm5/model/lora.py) stays adapted: its A [E, r, in] and
    B [E, out, r] are sharded the same way, so this rank trains only its experts' adapters, and the
    parameter names (`parametrizations.<name>.original`, `.0.lora_A`) are the single-process ones.
    A quantised base (glm5/finetune/quant_base.py: int8 / fp8 storage read through a parametrization)
    keeps its storage sharded the same way and this rank's experts' scales (`_LocalStorage`), ahead of
    the LoRA in the chain (`.1.lora_A`, as in one process).
    """

    def __init__(self, experts: Experts, ep_mesh: DeviceMesh):
        super().__init__()
        self.n_experts, self.inter = experts.n_experts, experts.inter
        self.ep_mesh = ep_mesh
        self.ep_size, self.ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
        if self.n_experts % self.ep_size:
            raise ValueError(f"n_routed_experts={self.n_experts} is not divisible by "
                             f"parallel.expert_parallel={self.ep_size}")
        self.n_local = self.n_experts // self.ep_size
        lo, hi = self.ep_rank * self.n_local, (self.ep_rank + 1) * self.n_local
        for name in EXPERT_PARAMS:
            quant, adapter = _expert_chain(experts, name)
            held = quant is not None or adapter is not None
            base = experts.parametrizations[name].original if held else getattr(experts, name)
            local = base.detach()[lo:hi].clone()  # every rank holds identical full weights: no scatter needed
            setattr(self, name, nn.Parameter(self._shard(local), requires_grad=base.requires_grad))
            if quant is not None:  # a quantised base: this rank's experts' int8 / fp8 storage and scales
                parametrize.register_parametrization(self, name, _LocalStorage(quant.select(lo, hi), ep_mesh),
                                                     unsafe=True)
            if adapter is not None:  # LoRA: this rank trains only its experts' A/B slices
                parametrize.register_parametrization(self, name, self._local_adapter(adapter, lo, hi), unsafe=True)

    def _shard(self, local: torch.Tensor) -> DTensor:
        """This rank's expert slice [L, ...] as the full [E, ...] tensor sharded on dim 0 over "ep"."""
        return DTensor.from_local(local, self.ep_mesh, [Shard(0)], run_check=False)

    def _local_adapter(self, adapter: ExpertLoRA, lo: int, hi: int) -> ExpertLoRA:
        """The same `ExpertLoRA` (same parameter names, full [E, ...] shapes for checkpoints and the PEFT
        gather) whose A [E, r, in] / B [E, out, r] are sharded on the expert dimension like the base."""
        E, r, in_f = adapter.lora_A.shape
        out = ExpertLoRA(torch.Size((hi - lo, adapter.lora_B.shape[1], in_f)), r, adapter.alpha,
                         adapter.use_rslora, device="meta")
        for which in ("lora_A", "lora_B"):
            src = getattr(adapter, which)
            setattr(out, which, nn.Parameter(self._shard(src.detach()[lo:hi].clone()), requires_grad=src.requires_grad))
        return out

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if isinstance(p, DTensor) else p

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H], idx/weights [N, A] (keep [N, A] bool) -> routed output [N, H], as `Experts.forward`."""
        N, A = idx.shape
        group = self.ep_mesh.get_group()
        flat = idx.reshape(-1)
        if keep is not None:
            flat = torch.where(keep.reshape(-1), flat, self.n_experts)  # dropped -> virtual expert E
        order = torch.argsort(flat, stable=True)  # [N*A] grouped by expert = by owner rank, then expert
        counts = torch.bincount(flat, minlength=self.n_experts + 1)[: self.n_experts]  # [E]
        order = order[: int(counts.sum())]  # [M] live assignments
        token = order // A  # [M]
        recv_counts = _exchange_counts(counts, group).view(self.ep_size, self.n_local)  # [P, L]
        in_splits = counts.view(self.ep_size, self.n_local).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        recv = _a2a(x[token], out_splits, in_splits, group)  # [R, H] ordered by (source rank, expert)
        ys = self._compute(recv, recv_counts)  # [R, H], same order
        back = _a2a(ys, in_splits, out_splits, group)  # [M, H] in this rank's send order
        back = back * weights.reshape(-1)[order, None].to(back.dtype)
        return torch.zeros_like(x).index_add_(0, token, back.to(x.dtype))

    def _compute(self, recv: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Run the received rows [R, H] through their local experts; recv_counts [P, L]."""
        gate_up, down = self._local(self.gate_up_proj), self._local(self.down_proj)
        if recv.shape[0] == 0:
            # Nothing to do, but the weights must still get a (zero) gradient: FSDP reduce-scatters
            # expert grads over the dp group and every rank has to take part.
            g, u = F.linear(recv, gate_up[0]).chunk(2, dim=-1)
            return F.linear(F.silu(g) * u, down[0])
        local_e = torch.arange(self.n_local, device=recv.device).repeat(self.ep_size)  # [P*L]
        row_expert = torch.repeat_interleave(local_e, recv_counts.reshape(-1))  # [R]
        perm = torch.argsort(row_expert, stable=True)  # rows grouped by local expert
        ys = grouped_swiglu(recv[perm], gate_up, down, recv_counts.sum(0))
        return torch.empty_like(ys).index_copy_(0, perm, ys)  # back to (source rank, expert) order


def convert_to_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[EPExperts]:
    """Replace every `MoE.experts` of `model` by an `EPExperts` over `ep_mesh`; returns the new modules.

    The model must hold the same full weights on every rank (same seed or same checkpoint).
    """
    converted = []
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        if module.cfg.moe_type == "soft":
            raise ValueError(f"{name}: expert parallelism needs top-k routing; moe_type='soft' sends every "
                             "token to every expert (use parallel.expert_parallel = 1)")
        if isinstance(module.experts, EPExperts):
            continue
        module.experts = EPExperts(module.experts, ep_mesh)
        converted.append(module.experts)
    return converted
