"""Parallelism applied to a built model from outside it: `parallelize(model, cfg)` (the trainer's hook).

Mesh: world = pp x dp x ep x tp ranks on one 4-D DeviceMesh ("pp", "dp", "ep", "tp"), tp innermost (the
ranks that talk most are neighbours). Order of application, as torchtitan: expert parallel -> tensor
parallel -> FSDP2 (pipeline stages are cut before all of them, see parallel_pp.py).

- Data: the dp x ep ranks read different rows of the global batch ("data" = dp, ep flattened; tp peers
  read the same rows). Non-expert parameters are sharded by FSDP2 over "data": one unit per
  decoder/MTP layer, then the root; tensor-parallel weights become 2-D (data, tp) DTensors.
- Experts (`parallel_ep.EPExperts`): E / ep experts per rank, tokens moved by all-to-all over "ep";
  with tp > 1 each TP rank runs 1/tp of the tokens (parallel_tp.TokenParallel). The experts' own FSDP
  unit spans the ranks that hold the same experts and see different tokens: dp x tp. Their gradient
  sums those ranks' tokens (and, through the all-to-all, the ep group's), so FSDP divides it by the
  data-parallel degree D = dp x ep instead of its mesh size: every gradient is then the mean over the
  global batch, the same as one process on the whole batch.
- Precision (FSDP's MixedPrecisionPolicy): bf16 parameters with fp32 gradient reduction on GPU, fp32
  on CPU. Master weights and optimizer state stay fp32 and sharded.
- A mesh that does not divide the world, or a model that a degree does not divide (heads, vocab,
  experts, layers), is refused before any compute, naming the key.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from glm5.core import dist as gdist
from glm5.model.config import ModelConfig

from .parallel_ep import convert_to_ep
from .parallel_pp import PipelineRunner, local_stages, prune_to_stages, split_layers
from .parallel_tp import apply_tp, check_tp

DIMS = ("pp", "dp", "ep", "tp")


@dataclass
class ParallelPlan:
    """What `parallelize` did (kept on the model as `model.parallel_plan`)."""

    mesh: DeviceMesh  # 4-D ("pp", "dp", "ep", "tp")
    dp: int
    ep: int
    tp: int = 1
    pp: int = 1
    mixed_precision: bool = False
    pipeline: PipelineRunner | None = None  # runs the rank's stages when pp > 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    @property
    def data_mesh(self) -> DeviceMesh:
        """The dp x ep ranks that read different rows (1-D, flattened)."""
        return _flat(self.mesh, ("dp", "ep"), "data")

    @property
    def data_rank(self) -> int:
        return self.data_mesh.get_local_rank()

    @property
    def data_world(self) -> int:
        return self.dp * self.ep

    @property
    def data_group(self) -> dist.ProcessGroup:
        return self.data_mesh.get_group()

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["pp"].get_group() if self.pp > 1 else None

    def loss_context(self):
        """Around forward *and* backward: the vocab-parallel cross entropy of tensor parallel."""
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()


def _flat(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """A 1-D view of some mesh dimensions that stays a child of the same root mesh (FSDP and DTensor
    need that to compose); a single dimension is returned as is."""
    return mesh[dims[0]] if len(dims) == 1 else mesh[dims]._flatten(name)


def mesh_shape(world: int, dp: int = 0, ep: int = 1, tp: int = 1, pp: int = 1) -> dict[str, int]:
    """The degrees of each mesh dimension; dp = 0 takes what the others leave. Raises ValueError naming
    the `parallel.*` key when the product cannot equal the world size."""
    for key, n in (("expert_parallel", ep), ("tensor_parallel", tp), ("pipeline_parallel", pp)):
        if n < 1 or world % n:
            raise ValueError(f"parallel.{key}={n} must be >= 1 and divide the world size {world}")
    rest = world // (ep * tp * pp) if world % (ep * tp * pp) == 0 else 0
    if dp == 0:
        if rest == 0:
            raise ValueError(f"parallel.expert_parallel x tensor_parallel x pipeline_parallel = {ep * tp * pp} "
                             f"does not divide the world size {world}")
        dp = rest
    if pp * dp * ep * tp != world:
        raise ValueError(f"parallel.data_parallel={dp} x expert_parallel={ep} x tensor_parallel={tp} x "
                         f"pipeline_parallel={pp} = {pp * dp * ep * tp} ranks, but the world size is {world}")
    return {"pp": pp, "dp": dp, "ep": ep, "tp": tp}


def data_coords(par, rank: int, world: int) -> tuple[int, int]:
    """(data rank, data degree) of `rank` on the mesh `par` (a `ParallelConfig`) describes, before the
    mesh exists (fine-tuning builds its data first): the same as `ParallelPlan.data_rank` /
    `data_world`. The mesh is ("pp", "dp", "ep", "tp") row-major, so tp peers are neighbours."""
    shape = mesh_shape(world, par.data_parallel, par.expert_parallel, par.tensor_parallel, par.pipeline_parallel)
    data_world = shape["dp"] * shape["ep"]
    return (rank // shape["tp"]) % data_world, data_world


def check_model(cfg: ModelConfig, shape: dict[str, int], stages: int = 1) -> None:
    """Refuse a model that the mesh cannot split evenly (before any compute)."""
    ep = shape["ep"]
    if ep > 1 and cfg.n_routed_experts % ep:
        raise ValueError(f"parallel.expert_parallel={ep} does not divide n_routed_experts={cfg.n_routed_experts}")
    check_tp(cfg, shape["tp"])
    if stages > cfg.num_hidden_layers:
        raise ValueError(f"parallel.pipeline_parallel x stages_per_rank = {stages} stages for "
                         f"num_hidden_layers={cfg.num_hidden_layers}: a stage would be empty")


def build_mesh(ep: int = 1, device_type: str | None = None, *, dp: int = 0, tp: int = 1, pp: int = 1) -> DeviceMesh:
    """The 4-D ("pp", "dp", "ep", "tp") mesh over the default process group."""
    shape = mesh_shape(gdist.world_size(), dp, ep, tp, pp)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(device_type, tuple(shape[d] for d in DIMS), mesh_dim_names=DIMS)


def mixed_precision_policy(device_type: str, dtype: str = "auto") -> MixedPrecisionPolicy:
    """bf16 params / fp32 reduce on GPU (or when dtype == "bf16"); plain fp32 otherwise (CPU: bf16
    matmul is pathologically slow there)."""
    if dtype == "bf16" or (dtype == "auto" and device_type == "cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _routed_experts(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp.experts for layer in _layers(model) if hasattr(getattr(layer, "mlp", None), "experts")]


def _layers(model: nn.Module) -> list[nn.Module]:
    layers = model.model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_fsdp(model: nn.Module, plan: ParallelPlan, mp: MixedPrecisionPolicy, own_expert_units: bool) -> None:
    """FSDP2 units: the routed experts (own unit when they are EP- or token-parallel), every layer, then
    the root: the model, or under pipeline parallel each stage module (the model's forward never runs
    there; a stage module holds its embedding / final norm / head, and the schedule then defers the
    gradient reduction to the last micro-batch)."""
    data = plan.data_mesh
    if own_expert_units:
        emesh = _flat(plan.mesh, ("dp", "tp"), "dp_tp") if plan.tp > 1 else plan.mesh["dp"]
        for ex in _routed_experts(model):  # first, so the layer units below leave them alone
            fully_shard(ex, mesh=emesh, mp_policy=mp)
            ex.set_gradient_divide_factor(float(plan.data_world))
            if emesh.size() > 1:
                # SUM then divide (gloo has no PREMUL_SUM reduce-scatter). Not on a 1-rank group: there
                # torch 2.13's FSDP skips the collective, divides itself and would divide twice.
                ex.set_force_sum_reduction_for_comms(True)
    for layer in _layers(model):
        fully_shard(layer, mesh=data, mp_policy=mp)
        if hasattr(layer, "forward_mtp"):  # MTP layers are entered through forward_mtp, not __call__
            register_fsdp_forward_method(layer, "forward_mtp")
    if plan.pipeline is None:
        fully_shard(model, mesh=data, mp_policy=mp)
        return
    for stage in plan.pipeline.modules:  # the roots: embedding / norm / head of the stage, its layers below
        fully_shard(stage, mesh=data, mp_policy=mp)


def _held_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """A quantised base's weights (glm5/finetune/quant_base.py, modules marked `frozen_storage`) are
    dequantised to `dtype`: FSDP's mixed precision casts the parameters it gathers and the activations to
    it, but the int8 / fp8 storage is dequantised after the gather, in the dtype it was given at load."""
    for mod in model.modules():
        if getattr(mod, "frozen_storage", False) and isinstance(getattr(mod, "dtype", None), torch.dtype):
            mod.dtype = dtype


def apply_parallel(model: nn.Module, ep: int = 1, dtype: str = "auto", *, dp: int = 0, tp: int = 1,
                   pp: int = 1, schedule: str = "1f1b", stages_per_rank: int = 1,
                   split: list[int] | tuple[int, ...] = ()) -> nn.Module:
    """Pipeline cut, EP, TP, then FSDP2 over the mesh, in place; returns the model (an FSDP module; under
    pipeline parallel, the rank's pruned model with `parallel_plan.pipeline` to run it)."""
    shape = mesh_shape(gdist.world_size(), dp, ep, tp, pp)
    check_model(model.config, shape, pp * stages_per_rank)
    stages = split_layers(model.config, pp * stages_per_rank, split) if pp > 1 else None
    mesh = build_mesh(ep, dp=dp, tp=tp, pp=pp)
    plan = ParallelPlan(mesh, shape["dp"], ep, tp, pp)
    mp = mixed_precision_policy(mesh.device_type, dtype)
    plan.mixed_precision = mp.param_dtype is not None
    if plan.mixed_precision:
        _held_compute_dtype(model, mp.param_dtype)
    if stages is not None:
        mine = local_stages(mesh["pp"].get_local_rank(), pp, stages_per_rank)
        prune_to_stages(model, stages, mine)
    if ep > 1:
        convert_to_ep(model, mesh["ep"])
    if tp > 1:
        apply_tp(model, mesh["tp"])
    if stages is not None:
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
            else torch.device("cpu")
        plan.pipeline = PipelineRunner(model, mesh, stages, mine, schedule, device)
    apply_fsdp(model, plan, mp, own_expert_units=ep > 1 or tp > 1)
    model.parallel_plan = plan
    return model


def parallelize(model: nn.Module, cfg) -> nn.Module:
    """The trainer's hook: `cfg` is the `TrainConfig` (reads `parallel`, `precision.dtype`, `dsa`)."""
    par = cfg.parallel
    for key in ("tensor_parallel", "pipeline_parallel"):
        if getattr(par, key) > 1 and (cfg.dsa.indexer_loss_coef > 0 or cfg.dsa.indexer_warmup_steps > 0):
            raise ValueError(f"parallel.{key} > 1 with the DSA indexer loss/warm-up is not supported: the "
                             "indexer's target is the attention over all heads of a whole model (set "
                             "dsa.indexer_loss_coef = 0 and dsa.indexer_warmup_steps = 0)")
    return apply_parallel(model, ep=par.expert_parallel, dtype=cfg.precision.dtype, dp=par.data_parallel,
                          tp=par.tensor_parallel, pp=par.pipeline_parallel, schedule=par.pipeline_schedule,
                          stages_per_rank=par.stages_per_rank, split=par.pipeline_split)


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
def total_norm(tensors: list[torch.Tensor], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm (fp32 scalar, plain CPU tensor) of possibly sharded tensors: each mesh group's norm
    is completed across its mesh (`full_tensor`), then the groups are combined; with `pp_group` (pipeline
    stages hold different tensors) the squares are also summed over the stages."""
    sq = torch.zeros((), dtype=torch.float32)
    for group in _by_mesh(tensors):
        n = _full(torch.nn.utils.get_total_norm(group, 2.0)).float().cpu()
        sq = sq + n * n
    if pp_group is not None:
        t = sq.to("cuda") if dist.get_backend(pp_group) == "nccl" else sq
        dist.all_reduce(t, group=pp_group)
        sq = t.cpu()
    return sq.sqrt()


@torch.no_grad()
def scale_(tensors: list[torch.Tensor], scale: torch.Tensor | float) -> None:
    """tensors *= scale in place (one foreach call per mesh group)."""
    for group in _by_mesh(tensors):
        s = scale.to(device=group[0].device, dtype=group[0].dtype) if isinstance(scale, torch.Tensor) else scale
        torch._foreach_mul_(group, s)


def grad_norm(params, pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`total_norm` of the gradients of `params` (the distributed version of stability.grad_norm)."""
    return total_norm([p.grad for p in params if p.grad is not None], pp_group)


def clip_grad_norm_(params, max_norm: float, norm: torch.Tensor | None = None,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for mixed-mesh DTensor gradients; returns the pre-clip norm
    (`norm`: already computed over the same parameters, e.g. without a pipeline's tied copy)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads, pp_group) if norm is None else norm
    scale_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def sum_over_ranks(value: float | list[float]) -> float | list[float]:
    """Per-rank scalars (loss sums, token counts) summed over all ranks in one all-reduce; a float or a
    list of floats; unchanged without a process group."""
    out = gdist.all_reduce_scalars(value if isinstance(value, list) else [value])
    return out if isinstance(value, list) else out[0]


def mean_over_ranks(value: float) -> float:
    """A per-rank scalar (e.g. the local loss) averaged over all ranks; unchanged without a group."""
    return sum_over_ranks(value) / gdist.world_size() if gdist.is_dist() else value
