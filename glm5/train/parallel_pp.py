"""Pipeline parallelism with `torch.distributed.pipelining`: stages from a layer split, 1F1B / GPipe /
interleaved 1F1B schedules, micro-batches from the step's gradient-accumulation micro-batches.

Cutting (`split_layers`, `prune_to_stages`): the S = pp x stages_per_rank stages take contiguous runs of
the main decoder layers (as even as possible, earlier stages one more, or `parallel.pipeline_split`);
the MTP layer and the MTP loss join the last stage. Stage s runs on pipeline rank s % pp (torch's
"loop" order, which the interleaved schedule expects). Each rank keeps one `GLM5ForCausalLM` pruned to
its stages' layers (`model.layers` becomes a ModuleDict keyed by the original index, so parameter
names, checkpoints and the gates' layer numbers do not change); the first stage keeps the embedding,
the last the final norm and LM head, and -- when the model has an MTP layer -- its own copy of the
embedding (MTP embeds token t+1), tied to the first stage's by summing their gradients each step
(Megatron's shared-embedding group).

Running (`PipelineRunner`): each local stage is a `PipelineStageModule` view over the pruned model
that runs its layers with the model's own `_run_layers` / `_mtp`. The step's micro-batches are
concatenated and handed to the schedule, which splits them back along the batch dimension (the same
rows per micro-batch as without the pipeline). The last stage's loss is the trainer's: summed cross
entropy (vocab-parallel under TP) normalised by the step's global token count, plus MTP; the MoE balance
terms of every stage are added through the backward of the stage's output (`_AuxGrad`, Megatron's
MoEAuxLossAutoScaler), so they need no extra pipeline traffic. Gradient scaling by the schedule is off:
the normalisation already makes the micro-batches sum to the step's mean.

With pipeline parallel every micro-batch of a step has the same objective (the trainer draws it per
step), since one schedule call runs one batch layout. Shared-indexer (IndexShare) layers must not start
a stage: their top-k comes from the layer before, which would be on another rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                                    ScheduleLoopedBFS)

from glm5.model.config import ModelConfig
from glm5.model.layers import rope_angles

from .balance import balance_losses
from .step import IGNORE, ce_sum, mtp_labels

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B}


def split_layers(cfg: ModelConfig, n_stages: int, split: list[int] | tuple[int, ...] = ()) -> list[list[int]]:
    """Layer indices of each stage: contiguous main layers, the MTP layers appended to the last stage.
    Raises ValueError (naming `parallel.*`) on an empty stage or a stage that starts on a shared-indexer
    layer; an automatic split moves such a boundary to the nearest full-indexer layer."""
    L = cfg.num_hidden_layers
    if n_stages > L:
        raise ValueError(f"parallel.pipeline_parallel x stages_per_rank = {n_stages} stages for "
                         f"num_hidden_layers={L}: a stage would be empty")
    if split:
        if len(split) != n_stages or sum(split) != L or min(split) < 1:
            raise ValueError(f"parallel.pipeline_split {list(split)} must have {n_stages} entries >= 1 "
                             f"summing to num_hidden_layers={L}")
        sizes = list(split)
    else:
        sizes = [L // n_stages + (s < L % n_stages) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    shared = [t != "full" for t in cfg.indexer_types]
    for s in range(1, n_stages):
        starts[s] = max(starts[s], starts[s - 1] + 1)  # an earlier boundary may have moved forward
        if not shared[starts[s]]:
            continue
        if split:
            raise ValueError(f"parallel.pipeline_split: stage {s} starts at layer {starts[s]}, a shared-indexer "
                             "layer that needs the previous layer's top-k; move the boundary")
        lo, hi = starts[s - 1] + 1, L - (n_stages - s - 1)  # keep every stage non-empty
        fulls = [b for b in range(lo, hi) if not shared[b]]
        if not fulls:
            raise ValueError(f"no pipeline split into {n_stages} stages starts every stage on a full-indexer layer")
        starts[s] = min(fulls, key=lambda b: (abs(b - starts[s]), b))  # the nearest, earlier on a tie
    bounds = starts + [L]
    stages = [list(range(bounds[s], bounds[s + 1])) for s in range(n_stages)]
    stages[-1] += list(range(L, L + cfg.num_nextn_predict_layers))
    return stages


def local_stages(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """Stage indices run by pipeline rank `pp_rank` (loop order: rank r runs r, r + pp, ...)."""
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def prune_to_stages(model: nn.Module, stages: list[list[int]], mine: list[int]) -> None:
    """Keep only what this rank's stages need, in place (see the module docstring)."""
    n_stages = len(stages)
    keep = {i for s in mine for i in stages[s]}
    inner = model.model
    inner.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers) if i in keep})
    first, last = 0 in mine, n_stages - 1 in mine
    if last and not first and model.config.num_nextn_predict_layers:
        inner.embed_tokens = copy.deepcopy(inner.embed_tokens)  # the MTP layer's tied copy
    if not first and not (last and model.config.num_nextn_predict_layers):
        del inner.embed_tokens
    if not first and hasattr(inner, "block_position_embeddings"):
        del inner.block_position_embeddings
    if not last:
        del inner.norm, model.lm_head


@dataclass
class StageContext:
    """What the stages of one schedule call need (set by the runner) and what they report back."""

    n_micro: int = 1
    run_mtp: bool = False
    balance: object = None  # TrainConfig.balance
    data_group: dist.ProcessGroup | None = None
    # per stage forward: (router stats, balance terms / n_micro). The schedule's first call also runs a
    # shape-inference forward (and loss) on placeholder tensors; the runner keeps only the last entries.
    records: list[tuple[list[dict], dict[str, float]]] = field(default_factory=list)


class _AuxGrad(torch.autograd.Function):
    """Identity on the hidden state; backward also sends d(loss)/d(aux) = 1 into `aux`, so terms computed
    inside a stage join the loss without travelling down the pipeline."""

    @staticmethod
    def forward(ctx, h, aux):
        ctx.aux_shape = aux.shape
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones(ctx.aux_shape, dtype=torch.float32, device=grad.device)


class PipelineStageModule(nn.Module):
    """One stage: a view over the rank's pruned model running its layers (not an owner of them)."""

    def __init__(self, owner: nn.Module, layer_ids: list[int], first: bool, last: bool, ctx: StageContext):
        super().__init__()
        n = owner.config.num_hidden_layers
        self.first, self.last, self.ctx = first, last, ctx
        self.main = nn.ModuleList([owner.model.layers[str(i)] for i in layer_ids if i < n])
        self.mtp = nn.ModuleList([owner.model.layers[str(i)] for i in layer_ids if i >= n])
        # the stage's own modules are children too, so that FSDP can make this view the stage's root
        inner = owner.model
        if first or (last and len(self.mtp)):
            self.embed = inner.embed_tokens
        if first and hasattr(inner, "block_position_embeddings"):
            self.block_embed = inner.block_position_embeddings
        if last:
            self.norm, self.head = inner.norm, owner.lm_head
        object.__setattr__(self, "owner", owner)  # not a child: the owner also holds other stages' layers

    def forward(self, x: torch.Tensor, position_ids=None, segment_ids=None, attention_mask=None,
                block_position_ids=None, input_ids=None):
        """First stage: x = input_ids [b, T]; others: x = hidden [b, T, H]. Last stage returns
        (logits, aux) or, running MTP, (logits, mtp_logits, aux) (stage outputs must be tensors); others
        the hidden state."""
        m = self.owner
        if self.first:
            x = m.model.embed_tokens(x)
            if block_position_ids is not None:
                x = x + m.model.block_position_embeddings(block_position_ids)
        B, T = x.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(T, device=x.device)[None].expand(B, -1)
        cos, sin = rope_angles(position_ids, m.model.inv_freq)
        mask = m._mask(attention_mask, segment_ids, B, T)
        h, stats, _ = m._run_layers(x, cos, sin, mask, self.main)
        if not self.last:
            return _AuxGrad.apply(h, self._aux(stats, B))
        h = m.model.norm(h)
        logits = m.lm_head(h)
        if self.ctx.run_mtp and len(self.mtp):
            mtp_logits, _, mstats = m._mtp(input_ids, None, h, cos, sin, mask, self.mtp)
            return logits, mtp_logits, self._aux(stats + mstats, B)
        return logits, self._aux(stats, B)

    def _aux(self, stats: list[dict], batch: int) -> torch.Tensor:
        """This stage's MoE balance terms for one micro-batch, / n_micro (as micro_loss weighs them), as
        a [1] tensor (the schedule concatenates the last stage's outputs of an eval call)."""
        ctx = self.ctx
        b = ctx.balance
        terms = balance_losses(stats, batch, b.seq_aux_coef, b.aux_coef, b.z_loss_coef, ctx.data_group)
        total = torch.zeros(1, dtype=torch.float32, device=self.owner.model.inv_freq.device)
        for v in terms.values():
            total = total + v.float() / ctx.n_micro
        ctx.records.append((stats, {k: float(v.detach()) / ctx.n_micro for k, v in terms.items()}))
        return total


@dataclass
class PipelineSums:
    """One schedule call's sums on this rank (zeros where the rank has no last stage)."""

    lm_sum: float = 0.0
    mtp_sum: float = 0.0
    stats: list[list[dict]] = field(default_factory=list)
    balance: dict[str, float] = field(default_factory=dict)


class PipelineRunner:
    """Runs the rank's stages under a schedule; see the module docstring."""

    def __init__(self, owner: nn.Module, mesh: DeviceMesh, stages: list[list[int]], mine: list[int],
                 schedule: str, device: torch.device):
        self.owner, self.mesh, self.stages, self.mine = owner, mesh, stages, mine
        self.n_stages, self.schedule_name, self.device = len(stages), schedule, device
        self.pp_group = mesh["pp"].get_group()
        self.ctx = StageContext()
        self.modules = [PipelineStageModule(owner, stages[s], s == 0, s == self.n_stages - 1, self.ctx)
                        for s in mine]
        self.has_first, self.has_last = 0 in mine, self.n_stages - 1 in mine
        self.tied_group = _tied_embedding_group(mesh) if owner.config.num_nextn_predict_layers else None
        self._cache: dict[tuple, object] = {}
        self._norms = (0.0, 0.0)  # step-token normalisers of the running call
        self._mtp_weight = 0.0
        self._loss_records: list[tuple[float, float]] = []  # (lm sum, MTP sum) per loss call

    # --- schedules ------------------------------------------------------------------------------------
    def _schedule(self, key: tuple, n_micro: int):
        """One schedule per (layout, micro-batch count): PipelineStage infers the p2p shapes on its first
        call, so a new sequence length or objective gets fresh stages."""
        if key not in self._cache:
            stages = [PipelineStage(mod, s, self.n_stages, self.device, group=self.pp_group)
                      for mod, s in zip(self.modules, self.mine)]
            cls = SCHEDULES[self.schedule_name]
            if n_micro < self.n_stages // len(self.mine) or not key[0]:
                # fewer micro-batches than pipeline ranks (a batch ramp's early steps, evaluation): 1F1B
                # has no steady state then and torch refuses it; all-forward-then-all-backward is exact
                cls = ScheduleLoopedBFS if len(self.mine) > 1 else ScheduleGPipe
            first = stages if cls in (ScheduleInterleaved1F1B, ScheduleLoopedBFS) else stages[0]
            self._cache[key] = cls(first, n_micro, loss_fn=self._loss, scale_grads=False)
        return self._cache[key]

    def _loss(self, output, labels: torch.Tensor) -> torch.Tensor:
        logits, *mtp, aux = output
        mtp_logits = mtp[0] if mtp else None
        step_tokens, step_mtp = self._norms
        lm = ce_sum(logits, labels)
        loss = lm / max(1.0, step_tokens) + aux.sum()
        mtp_value = 0.0
        if mtp_logits is not None:
            mtp = ce_sum(mtp_logits, mtp_labels(labels))
            mtp_value = float(mtp.detach())
            if step_mtp:
                loss = loss + self._mtp_weight * mtp / step_mtp
        self._loss_records.append((float(lm.detach()), mtp_value))
        return loss

    # --- one call -------------------------------------------------------------------------------------
    def run(self, micro: list[dict], run_mtp: bool, step_tokens: float, step_mtp: float, mtp_weight: float,
            balance, data_group, train: bool = True) -> PipelineSums:
        """Forward (+ backward when `train`) of the micro-batches (same keys and shapes, one objective)
        through the pipeline. `step_tokens` / `step_mtp`: the global token counts / data ranks."""
        batch = {k: torch.cat([b[k] for b in micro]) for k in micro[0] if isinstance(micro[0][k], torch.Tensor)}
        n = len(micro)
        self.ctx.n_micro, self.ctx.run_mtp, self.ctx.balance, self.ctx.data_group = n, run_mtp, balance, data_group
        self.ctx.records, self._loss_records = [], []
        self._norms, self._mtp_weight = (step_tokens, step_mtp), mtp_weight
        key = (train, run_mtp, n, tuple(batch["input_ids"].shape), tuple(sorted(batch)))
        schedule = self._schedule(key, n)
        kwargs = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
        if run_mtp:
            kwargs["input_ids"] = batch["input_ids"]
        args = (batch["input_ids"],) if self.has_first else ()
        target = batch["labels"] if self.has_last else None
        call = schedule.step if train else schedule.eval
        if train:
            call(*args, target=target, return_outputs=False, **kwargs)
        else:
            call(*args, target=target, **kwargs)
        # the real micro-batches are the last ones (a first call's shape inference ran before them)
        records = self.ctx.records[len(self.ctx.records) - n * len(self.mine):]
        losses = self._loss_records[len(self._loss_records) - n:] if self.has_last else []
        sums = PipelineSums(lm_sum=sum(lm for lm, _ in losses), mtp_sum=sum(m for _, m in losses),
                            stats=[st for st, _ in records])
        for _, terms in records:
            for k, v in terms.items():
                sums.balance[k] = sums.balance.get(k, 0.0) + v
        return sums

    def lm_tokens(self, micro: list[dict]) -> int:
        """Labelled tokens the last stage scored (0 on other ranks)."""
        return sum(int((b["labels"] != IGNORE).sum()) for b in micro) if self.has_last else 0

    # --- after backward -------------------------------------------------------------------------------
    def sync_tied_grads(self) -> None:
        """Sum the gradients of the first stage's embedding and the last stage's MTP copy (same sharding
        on both, so the local shards add up)."""
        if self.tied_group is None or not (self.has_first or self.has_last):
            return
        if self.has_first and self.has_last:  # both stages on this rank: one module, nothing to sync
            return
        g = self.owner.model.embed_tokens.weight.grad
        local = g.to_local() if hasattr(g, "to_local") else g
        dist.all_reduce(local, group=self.tied_group)

    def norm_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """`params` without the last stage's tied embedding copy (counted once, on the first stage)."""
        if self.tied_group is None or self.has_first or not self.has_last:
            return params
        copy_ = self.owner.model.embed_tokens.weight
        return [p for p in params if p is not copy_]


def _tied_embedding_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The {first, last} pipeline rank pair with this rank's (dp, ep, tp) coordinates. Every rank creates
    every pair group, in the same order (new_group is collective)."""
    grid = mesh.mesh  # [pp, dp, ep, tp] global ranks
    if grid.shape[0] < 2:
        return None
    mine = None
    me = dist.get_rank()
    for coords in torch.cartesian_prod(*[torch.arange(n) for n in grid.shape[1:]]).reshape(-1, 3).tolist():
        pair = [int(grid[0][tuple(coords)]), int(grid[-1][tuple(coords)])]
        group = dist.new_group(pair)
        if me in pair:
            mine = group
    return mine
