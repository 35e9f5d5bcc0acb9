"""The topology of a training job, `ParallelDims`, and the collectives the trainer calls on it.

`ParallelDims.from_env(cfg.parallel)` joins the torchrun process group (when launched by torchrun) and
knows the world size; `dims.parallelize(model, cfg)` applies `glm5.train.parallel.parallelize` and
returns the model with the dims that hold its `ParallelPlan` (the 4-D mesh, the data / pipeline process
groups, the pipeline runner). One process is the degenerate case, as in torchtitan's `ParallelDims`:
every degree 1, no process group, no plan, and every collective below is the identity (sums, maxima and
means return their input, `barrier` returns, the gradient norm is the local one), so the training loop
calls them unconditionally and reads like the single-process loop.

Groups: "all ranks" (the default group) for the metric sums; the data group (the dp x ep ranks that read
different rows; tensor and pipeline peers share a shard, `replicas` of them) for the unigram counts and
the expert loads; the pipeline group for the gradient norm and the per-stage expert loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

import torch
from torch import nn

from glm5.core import dist

from . import stability
from .config import ParallelConfig

if TYPE_CHECKING:  # parallel.py pulls in FSDP / DTensor / pipelining: imported only by a torchrun job
    from .parallel import ParallelPlan
    from .parallel_pp import PipelineRunner

Metrics = TypeVar("Metrics", float, list[float], dict[str, float])  # a scalar, or several in one all-reduce


@dataclass(frozen=True)
class ParallelDims:
    """World size and, once the model is parallelised, its plan. `ParallelDims()` is one process."""

    world: int = 1
    plan: ParallelPlan | None = None  # what `parallelize` built; None in one process

    @classmethod
    def from_env(cls, par: ParallelConfig) -> ParallelDims:
        """Join torchrun's process group (`parallel.backend`; nothing to join in one process)."""
        dist.init_from_env(None if par.backend == "auto" else par.backend)
        return cls(world=dist.world_size())

    def parallelize(self, model: nn.Module, cfg, parallelize_fn: Callable | None = None
                    ) -> tuple[nn.Module, ParallelDims]:
        """(model, dims) with the mesh of `cfg.parallel` applied: `parallelize_fn(model, cfg)` (default
        `glm5.train.parallel.parallelize`) on several processes; the model and self unchanged in one."""
        if not self.distributed:
            return model, self
        if parallelize_fn is None:
            from .parallel import parallelize as parallelize_fn
        model = parallelize_fn(model, cfg)
        return model, dataclasses.replace(self, plan=getattr(model, "parallel_plan", None))

    # --- degrees -------------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def dp(self) -> int:
        """FSDP ranks (besides the expert-parallel ones); every rank without a plan."""
        return self.plan.dp if self.plan else self.world

    @property
    def ep(self) -> int:
        return self.plan.ep if self.plan else 1

    @property
    def tp(self) -> int:
        return self.plan.tp if self.plan else 1

    @property
    def pp(self) -> int:
        return self.plan.pp if self.plan else 1

    @property
    def pp_enabled(self) -> bool:
        return self.pipeline is not None

    @property
    def dp_enabled(self) -> bool:
        """More than one data rank (rows of the global batch split over ranks)."""
        return self.data_world > 1

    @property
    def data_rank(self) -> int:
        return self.plan.data_rank if self.plan else dist.rank()

    @property
    def data_world(self) -> int:
        """Ranks that read different rows of the global batch (dp x ep)."""
        return self.plan.data_world if self.plan else self.world

    @property
    def replicas(self) -> int:
        """Ranks that hold the same data shard (tensor and pipeline peers)."""
        return self.world // self.data_world

    @property
    def data_group(self) -> torch.distributed.ProcessGroup | None:
        return self.plan.data_group if self.plan else None

    @property
    def pp_group(self) -> torch.distributed.ProcessGroup | None:
        return self.plan.pp_group if self.plan else None

    @property
    def pipeline(self) -> PipelineRunner | None:
        return self.plan.pipeline if self.plan else None

    @property
    def is_main(self) -> bool:
        return dist.is_main()

    def loss_context(self):
        """Around forward *and* backward: tensor parallel's vocab-parallel cross entropy, else nothing."""
        return self.plan.loss_context() if self.plan else contextlib.nullcontext()

    # --- collectives (the identity in one process) ---------------------------------------------------
    def sum(self, value: Metrics, divide_by: int = 1) -> Metrics:
        """A scalar, a list or a dict of scalars summed over all ranks (one all-reduce), each divided by
        `divide_by` (the ranks holding every value); `value` itself in one process."""
        return self._reduce(value, "sum", divide_by)

    def mean(self, value: Metrics) -> Metrics:
        """The same averaged over all ranks."""
        return self._reduce(value, "sum", self.world)

    def max(self, value: Metrics) -> Metrics:
        """The maximum over all ranks (e.g. "has any rank passed its deadline")."""
        return self._reduce(value, "max", 1)

    def _reduce(self, value: Metrics, op: str, divide_by: int) -> Metrics:
        if not self.distributed:
            return value
        keys = list(value) if isinstance(value, dict) else None
        values = [value[k] for k in keys] if keys is not None else value if isinstance(value, list) else [value]
        out = [v / divide_by for v in dist.all_reduce_scalars(values, op)]
        if keys is not None:
            return dict(zip(keys, out))
        return out if isinstance(value, list) else out[0]

    def sum_over_data_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed in place over the data ranks (e.g. the unigram counts); unchanged without a plan."""
        if self.data_group is not None:
            torch.distributed.all_reduce(t, group=self.data_group)
        return t

    def barrier(self) -> None:
        if dist.is_dist():
            torch.distributed.barrier()

    def gather_stages(self, parts: dict) -> dict:
        """A dict of this pipeline stage's entries (e.g. per-layer expert loads) merged with every other
        stage's, for the log; `parts` itself without a pipeline."""
        if self.pp_group is None:
            return parts
        gathered: list = [None] * torch.distributed.get_world_size(self.pp_group)
        torch.distributed.all_gather_object(gathered, {k: v.cpu() if isinstance(v, torch.Tensor) else v
                                                       for k, v in parts.items()}, group=self.pp_group)
        return {k: v for part in gathered for k, v in part.items()}

    # --- gradients: one norm over every mesh and pipeline stage --------------------------------------
    def grad_norm(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The global L2 norm of the gradients: sharded (DTensor) gradients on several meshes completed
        across them and summed over the pipeline stages (a tied weight counted once)."""
        if not self.distributed:
            return stability.grad_norm(params)
        from .parallel import grad_norm
        if self.pipeline is not None:
            params = self.pipeline.norm_params(params)
        return grad_norm(params, self.pp_group)

    def clip_layerwise(self, groups: dict[str, list[nn.Parameter]], base: float) -> dict[str, float]:
        """`stability.clip_layerwise` with the norm and scaling of (possibly sharded) gradients."""
        if not self.distributed:
            return stability.clip_layerwise(groups, base)
        from .parallel import scale_, total_norm
        return stability.clip_layerwise(groups, base, total_norm, scale_)

    def clip_global(self, params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
        """grad *= min(1, max_norm / norm) over all parameters (`norm`: their global gradient norm; the
        distributed form recomputes it over the same parameters)."""
        if not self.distributed:
            stability.clip_global(params, max_norm, norm)
            return
        from .parallel import clip_grad_norm_
        clip_grad_norm_(params, max_norm, self.grad_norm(params))
