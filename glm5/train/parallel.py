"""Parallelism applied to a built model from outside it: `parallelize(model, cfg)` (the trainer's hook).

Layout: world = dp x ep ranks on a 2-D DeviceMesh ("dp", "ep").
- Every rank reads its own data (data parallel over all `world` ranks). Non-expert parameters are
  sharded by FSDP2 (`fully_shard`) over all ranks: one FSDP unit per decoder/MTP layer, then the root.
- Routed experts are split over "ep" (`parallel_ep.EPExperts`: E / ep experts per rank, tokens moved by
  all-to-all) and sharded by FSDP over "dp" (the ranks that hold the same experts). Their gradient
  already sums the contributions of the tokens of all `ep` ranks of the group, so FSDP divides it by
  the world size rather than by dp: both kinds of gradient are then means over the global batch.
- Precision (FSDP's MixedPrecisionPolicy): bf16 parameters with fp32 gradient reduction on GPU, fp32
  on CPU. Master weights and optimizer state stay fp32 and sharded.

Tensor and pipeline parallelism: not implemented. They would slot in here, before FSDP (torchtitan's
order: TP/EP -> activation checkpointing -> compile -> FSDP), as extra mesh dimensions "tp" / "pp":
TP as `parallelize_module` plans on MLA's projections (colwise q_b/kv_b, rowwise o_proj) and the shared
experts, PP by splitting `model.model.layers` into stages with `torch.distributed.pipelining`.
`ParallelConfig` has no knobs for them, so nobody can ask for a parallelism that silently does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from glm5.core import dist as gdist

from .parallel_ep import EPExperts, convert_to_ep


@dataclass
class ParallelPlan:
    """What `parallelize` did: the mesh and the sizes (kept on the model as `model.parallel_plan`)."""

    mesh: DeviceMesh  # 2-D ("dp", "ep")
    dp: int
    ep: int
    mixed_precision: bool

    @property
    def world(self) -> int:
        return self.dp * self.ep

    # data parallel = every rank (dp x ep): each reads its own rows of the global batch
    @property
    def data_rank(self) -> int:
        return self.mesh.get_rank()

    @property
    def data_world(self) -> int:
        return self.world

    @property
    def data_group(self) -> dist.ProcessGroup:
        return dist.group.WORLD


def build_mesh(ep: int, device_type: str | None = None) -> DeviceMesh:
    """The 2-D ("dp", "ep") mesh over the default process group; ep must divide the world size."""
    world = gdist.world_size()
    if ep < 1 or world % ep:
        raise ValueError(f"parallel.expert_parallel={ep} must be >= 1 and divide the world size {world}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("dp", "ep"))


def mixed_precision_policy(device_type: str, dtype: str = "auto") -> MixedPrecisionPolicy:
    """bf16 params / fp32 reduce on GPU (or when dtype == "bf16"); plain fp32 otherwise (CPU: bf16
    matmul is pathologically slow there)."""
    if dtype == "bf16" or (dtype == "auto" and device_type == "cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_parallel(model: nn.Module, ep: int = 1, dtype: str = "auto") -> nn.Module:
    """EP (when ep > 1) then FSDP2 over the world, in place; returns the model (now an FSDP module)."""
    mesh = build_mesh(ep)
    mp = mixed_precision_policy(mesh.device_type, dtype)
    # 1-D view of all ranks for the non-expert FSDP units; `_flatten` keeps it a child of the same root
    # mesh as "dp"/"ep" (torchtitan flattens its dp_shard x cp dimensions the same way)
    world_mesh = mesh._flatten("world") if mesh.size() > 1 else mesh["dp"]
    experts = convert_to_ep(model, mesh["ep"]) if ep > 1 else []
    for ex in experts:  # experts first, so the layer units below leave them to their own FSDP unit
        fully_shard(ex, mesh=mesh["dp"], mp_policy=mp)
        ex.set_gradient_divide_factor(float(mesh.size()))
        if mesh["dp"].size() > 1:
            # SUM then divide (gloo has no PREMUL_SUM reduce-scatter). Not on a 1-rank dp group: there
            # torch 2.13's FSDP skips the collective, divides itself and would divide twice.
            ex.set_force_sum_reduction_for_comms(True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=world_mesh, mp_policy=mp)
        if hasattr(layer, "forward_mtp"):  # MTP layers are entered through forward_mtp, not __call__
            register_fsdp_forward_method(layer, "forward_mtp")
    fully_shard(model, mesh=world_mesh, mp_policy=mp)
    model.parallel_plan = ParallelPlan(mesh, mesh.size() // ep, ep, mp.param_dtype is not None)
    return model


def parallelize(model: nn.Module, cfg) -> nn.Module:
    """The trainer's hook: `cfg` is the `TrainConfig` (reads `parallel` and `precision.dtype`)."""
    par = cfg.parallel
    if par.data_parallel != "fsdp":
        raise ValueError(f"parallel.data_parallel={par.data_parallel!r} with {gdist.world_size()} processes: "
                         "gradients would never be synchronised; use 'fsdp'")
    return apply_parallel(model, ep=par.expert_parallel, dtype=cfg.precision.dtype)


# --- helpers for the training loop --------------------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split a list by DTensor mesh: torch's foreach ops refuse DTensors of different meshes in one call
    (here: FSDP-over-world parameters next to experts on the (dp, ep) mesh)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


@torch.no_grad()
def total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm (fp32 scalar, plain CPU tensor) of possibly sharded tensors: each mesh group's norm
    is completed across its mesh (`full_tensor`), then the groups are combined."""
    sq = torch.zeros((), dtype=torch.float32)
    for group in _by_mesh(tensors):
        n = _full(torch.nn.utils.get_total_norm(group, 2.0)).float().cpu()
        sq = sq + n * n
    return sq.sqrt()


@torch.no_grad()
def scale_(tensors: list[torch.Tensor], scale: torch.Tensor | float) -> None:
    """tensors *= scale in place (one foreach call per mesh group)."""
    for group in _by_mesh(tensors):
        s = scale.to(device=group[0].device, dtype=group[0].dtype) if isinstance(scale, torch.Tensor) else scale
        torch._foreach_mul_(group, s)


def grad_norm(params) -> torch.Tensor:
    """`total_norm` of the gradients of `params` (the distributed version of stability.grad_norm)."""
    return total_norm([p.grad for p in params if p.grad is not None])


def clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for mixed-mesh DTensor gradients; returns the pre-clip norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads)
    scale_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def sum_over_ranks(value: float | list[float]) -> float | list[float]:
    """Per-rank scalars (loss sums, token counts) summed over all ranks in one all-reduce; a float or a
    list of floats; unchanged without a process group."""
    if not gdist.is_dist():
        return value
    values = value if isinstance(value, list) else [value]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    out = t.tolist()
    return out if isinstance(value, list) else out[0]


def mean_over_ranks(value: float) -> float:
    """A per-rank scalar (e.g. the local loss) averaged over all ranks; unchanged without a group."""
    return sum_over_ranks(value) / gdist.world_size() if gdist.is_dist() else value


def expert_modules(model: nn.Module) -> list[EPExperts]:
    return [m for m in model.modules() if isinstance(m, EPExperts)]
