"""`TrainConfig`: the typed config of a pretraining run, one dataclass per TOML section.

Sections: model, data (the loader's own `DataLoaderConfig`), optim, schedule, train, balance,
stability, dsa, precision, checkpoint, parallel, log. Loaded with
`glm5.core.config.load_config(TrainConfig, path, overrides)`; the resolved config is saved next to
every checkpoint and at the top of the metrics log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from glm5.data.loader import DataLoaderConfig


@dataclass(kw_only=True)
class ModelSection:
    name: str = "tiny"
    """Preset name (`tiny`, `small`, ...) or a HF checkpoint directory (continued pretraining)."""
    load_weights: bool = True
    """When `name` is a checkpoint directory: start from its weights (else only its config)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """`ModelConfig` fields to override, e.g. `{num_hidden_layers = 2}`."""


@dataclass(kw_only=True)
class OptimConfig:
    name: Literal["adamw", "adamw8bit", "lamb", "muon"] = "adamw"
    """AdamW (default), AdamW with 8-bit block-wise quantised moments (bitsandbytes; seed F2), LAMB
    (seed T2), or Muon on hidden matrices + AdamW on the rest."""
    lr: float = 3e-4
    """Peak learning rate (of the AdamW/LAMB groups; of Muon too unless `muon_lr` is set)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam/LAMB moment decay rates."""
    eps: float = 1e-8
    """Adam/LAMB denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay on matrices; never on norms, biases (and embeddings, see below)."""
    decay_embeddings: bool = False
    """Apply weight decay to embedding tables too."""
    lamb_max_trust: float = 10.0
    """LAMB: upper clamp of the trust ratio ||w|| / ||update||."""
    muon_lr: float = 0.0
    """Muon: LR of the hidden-matrix group (0 = same as `lr`, right for `match_rms_adamw`)."""
    muon_momentum: float = 0.95
    """Muon: momentum coefficient."""
    muon_nesterov: bool = True
    """Muon: Nesterov momentum."""
    muon_ns_steps: int = 5
    """Muon: Newton-Schulz iterations."""
    muon_adjust_lr: Literal["match_rms_adamw", "original", "none"] = "match_rms_adamw"
    """Muon: per-matrix LR scale (Moonlight 0.2*sqrt(max(A,B)) / Keller sqrt(max(1,A/B)) / none)."""


@dataclass(kw_only=True)
class ScheduleConfig:
    name: Literal["cosine", "wsd", "linear", "constant"] = "cosine"
    """LR shape after warmup."""
    warmup_steps: int = 10000
    """Linear warmup length in optimizer steps (seed T2: 10,000)."""
    warmup_init: float = 0.0
    """LR factor the warmup starts from."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    decay_ratio: float = 0.2
    """WSD: fraction of all steps spent decaying at the end."""
    decay_type: Literal["linear", "cosine", "sqrt"] = "linear"
    """WSD: shape of the final decay."""


@dataclass(kw_only=True)
class TrainSection:
    steps: int = 1000
    """Optimizer steps (0 with `mtp_init`: the closed-form fit alone)."""
    seed: int = 0
    """Seed of model init, the objective draw and everything else random."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (at the end of any batch ramp); seed T1 uses 8."""
    batch_ramp_start: int = 0
    """Global batch size (sequences) at step 0 of the ramp; 0 = no ramp (seed T2: 256 -> 2048)."""
    batch_ramp_steps: int = 0
    """Steps over which the global batch grows to micro_batch * world * grad_accum."""
    objectives: dict[str, float] = field(default_factory=lambda: {"clm": 1.0})
    """Objective mix by ratio per micro-batch: `clm` (causal LM), `glm` (GLM blank infilling), `fim`
    (sentinel fill-in-the-middle, causal; needs a tokenizer with FIM tokens)."""
    mtp_weight: float = 0.3
    """Weight of the multi-token-prediction loss (0 = do not run the MTP layer)."""
    time_limit_min: float = 0.0
    """Wall-time budget of the training loop in minutes (0 = none): the LR schedule follows whichever
    of steps or time is further along, and training stops (then validates and saves) at the limit."""
    num_threads: int = 0
    """CPU threads for torch; 0 = auto: 1 when the machine is already busy (load >= cores, where
    OpenMP threads stall each other), else torch's default."""
    keep_grad_buffers: bool = True
    """One process on CPU: keep gradient buffers allocated between steps (zeroed, not freed; gradients a
    step does not touch are still skipped by the optimizer). Saves re-faulting the freed pages every step
    (~9% of a `small` step) at the cost of holding the gradients' memory during the forward pass."""
    trainable: Literal["all", "mtp", "indexer"] = "all"
    """What trains; the rest is frozen (requires_grad False, not in the optimizer, its MoE biases fixed):
    `mtp` = the MTP layer(s) on a frozen trunk (run under no_grad; tied embedding and lm_head frozen),
    `indexer` = the DSA lightning indexers by KL to the frozen model's dense attention."""
    mtp_target: Literal["data", "self"] = "data"
    """MTP loss: `data` = cross entropy against token t+2; `self` = self-distillation, KL(trunk's own
    next-token distribution at t+1 || MTP at t), detached target: maximises speculative acceptance."""
    mtp_init: Literal["none", "lstsq"] = "none"
    """Before step 0: `lstsq` fits the MTP layer's linear maps (eh_proj, attention and shared-expert
    output projections) to the frozen trunk's next hidden state in closed form (glm5/train/mtp_init.py)."""
    mtp_init_batches: int = 0
    """Batches (of `data.batch_size` rows) the `lstsq` warm start fits on (their trunk states are kept);
    0 = one pass over the training rows (chat JSONL data)."""
    mtp_init_ridge: float = 1e-3
    """Ridge of the `lstsq` fits, relative to the mean diagonal of each Gram matrix."""


@dataclass(kw_only=True)
class BalanceConfig:
    bias_update_rate: float = 1e-3
    """Aux-loss-free balancing: b_i += rate * sign(mean_load - load_i) after each step (0 = off)."""
    seq_aux_coef: float = 1e-4
    """Sequence-wise balance loss weight (DeepSeek-V3 / GLM-5 style, tiny)."""
    aux_coef: float = 0.0
    """Batch-level balance penalty weight (the seeds' expert-balance penalty uses 0.01)."""
    z_loss_coef: float = 0.0
    """Router z-loss weight (ST-MoE uses 1e-3)."""


@dataclass(kw_only=True)
class StabilityConfig:
    clip: Literal["global", "layerwise", "both", "none"] = "global"
    """Gradient clipping: global norm, the seeds' adaptive layer-wise rule, both, or none."""
    max_grad_norm: float = 1.0
    """Global clipping norm."""
    layerwise_base: float = 1.0
    """Layer-wise rule: threshold = base * (1 + 0.1 * ln(layer_norm))."""
    max_bad_steps: int = 10
    """Stop after this many skipped non-finite steps."""
    nan_lr_factor: float = 0.9
    """LR multiplier applied after each skipped non-finite step (seed T6: lower LR by 10%)."""


@dataclass(kw_only=True)
class DSAConfig:
    indexer_warmup_steps: int = 0
    """Dense warm-up steps training only the DSA indexer by KL to the attention (0 = skip)."""
    indexer_warmup_lr: float = 1e-3
    """Learning rate of the indexer during the warm-up."""
    indexer_loss_coef: float = 0.0
    """Sparse stage: weight of the indexer KL loss on the selected keys (input detached)."""
    indexer_kl_rows: int = 0
    """Query rows per sequence, drawn at random each step, that the indexer KL is computed on (warm-up,
    `train.trainable = "indexer"`, sparse stage; 0 = all). Its cost is rows x keys per layer."""

    def __post_init__(self):
        for key in ("indexer_warmup_steps", "indexer_kl_rows"):
            if getattr(self, key) < 0:
                raise ValueError(f"dsa.{key} must be >= 0, got {getattr(self, key)}")
        if not self.indexer_warmup_lr > 0:
            raise ValueError(f"dsa.indexer_warmup_lr must be > 0, got {self.indexer_warmup_lr}")
        if not self.indexer_loss_coef >= 0:
            raise ValueError(f"dsa.indexer_loss_coef must be >= 0, got {self.indexer_loss_coef}")


@dataclass(kw_only=True)
class PrecisionConfig:
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute dtype: auto = bf16 autocast with fp32 master weights on GPU, fp32 on CPU."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward (less memory, ~1/3 more compute)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    every: int = 0
    """Save every N optimizer steps (0 = only at exit)."""
    keep_last: int = 3
    """Number of step checkpoints kept."""
    resume: str = ""
    """"" = fresh run, "auto" = latest checkpoint in the run dir if any, or a checkpoint path."""
    at_exit: bool = True
    """Also save when the run ends or is interrupted (Ctrl-C)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """The device mesh of a torchrun job: world = pipeline x data x expert x tensor (glm5/train/parallel.py)."""

    data_parallel: int = 0
    """FSDP2 ranks besides the expert-parallel ones (0 = whatever the other degrees leave of the world)."""
    expert_parallel: int = 1
    """Ranks that share one copy of the routed experts (tokens dispatched with all_to_all); they read
    different data, so the data-parallel degree is data_parallel x expert_parallel."""
    tensor_parallel: int = 1
    """Ranks that split every attention head group, dense/shared MLP and the vocabulary (DTensor TP)."""
    pipeline_parallel: int = 1
    """Pipeline stages over ranks (torch.distributed.pipelining); micro-batches = train.grad_accum."""
    pipeline_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule; interleaved_1f1b runs `stages_per_rank` stages on each pipeline rank."""
    stages_per_rank: int = 1
    """Virtual pipeline stages per rank (interleaved_1f1b needs >= 2)."""
    pipeline_split: list[int] = field(default_factory=list)
    """Main decoder layers per stage (sums to num_hidden_layers; [] = as even as possible). The MTP
    layer always joins the last stage."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend (auto: nccl on GPU, gloo on CPU)."""

    def __post_init__(self):
        for key in ("expert_parallel", "tensor_parallel", "pipeline_parallel", "stages_per_rank"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be >= 1, got {getattr(self, key)}")
        if self.data_parallel < 0:
            raise ValueError(f"parallel.data_parallel must be >= 0 (0 = the rest of the world), got {self.data_parallel}")
        if self.pipeline_schedule == "interleaved_1f1b" and self.stages_per_rank < 2:
            raise ValueError("parallel.pipeline_schedule = 'interleaved_1f1b' needs parallel.stages_per_rank >= 2")
        if self.pipeline_schedule != "interleaved_1f1b" and self.stages_per_rank != 1:
            raise ValueError(f"parallel.stages_per_rank = {self.stages_per_rank} needs "
                             "parallel.pipeline_schedule = 'interleaved_1f1b'")
        if any(n < 1 for n in self.pipeline_split):
            raise ValueError(f"parallel.pipeline_split {self.pipeline_split}: every stage needs >= 1 layer "
                             "(an empty pipeline stage is refused)")


@dataclass(kw_only=True)
class LogConfig:
    run_dir: str = "runs/tiny"
    """Where metrics.jsonl, checkpoints and `final/` go."""
    every: int = 10
    """Log metrics every N steps."""
    progress: bool = True
    """Show a tqdm progress bar."""
    eval_every: int = 0
    """Validation loss every N steps (0 = only at the end)."""
    eval_batches: int = 20
    """Validation batches per evaluation."""
    measure_peak: bool = True
    """Measure the matmul peak (cached per machine) to report MFU."""
    profile_comm_every: int = 0
    """Every N steps (and the first), profile the step and log its communication time beside MFU:
    comm_s, comm_frac and per-collective seconds/elements (0 = never; glm5/train/comm.py)."""


@dataclass(kw_only=True)
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainSection = field(default_factory=TrainSection)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    dsa: DSAConfig = field(default_factory=DSAConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self):
        unknown = set(self.train.objectives) - {"clm", "glm", "fim"}
        if unknown:
            raise ValueError(f"train.objectives: unknown objective(s) {sorted(unknown)}; use clm, glm, fim")
        if self.train.steps < 1 and self.dsa.indexer_warmup_steps > 0:
            raise ValueError("train.steps must be >= 1; to train only the indexers (resumable, checkpointed) set "
                             "train.trainable = 'indexer' with train.steps = N and dsa.indexer_warmup_steps = 0")
        if self.train.grad_accum < 1 or self.train.steps < (0 if self.train.mtp_init != "none" else 1):
            raise ValueError("train.steps and train.grad_accum must be >= 1 (train.steps = 0 only with train.mtp_init: "
                             "the closed-form fit alone)")
        if self.train.trainable == "mtp" and self.train.mtp_weight <= 0:
            raise ValueError("train.trainable = 'mtp' needs train.mtp_weight > 0 (the MTP loss is all that trains)")
        if self.train.mtp_target == "self" and self.train.trainable == "indexer":
            raise ValueError("train.mtp_target = 'self' trains the MTP layer; train.trainable = 'indexer' freezes it")
        if self.train.mtp_target == "self" and self.train.mtp_weight <= 0:
            raise ValueError("train.mtp_target = 'self' needs train.mtp_weight > 0 (0 turns the MTP layer off)")
        if self.train.mtp_init != "none" and (self.train.mtp_weight <= 0 or self.train.trainable == "indexer"):
            raise ValueError(f"train.mtp_init = {self.train.mtp_init!r} fits the MTP layer: it needs train.mtp_weight > 0 "
                             "and train.trainable = 'mtp' or 'all'")
        if self.train.mtp_init_batches < 0 or self.train.mtp_init_ridge <= 0:
            raise ValueError("train.mtp_init_batches must be >= 0 and train.mtp_init_ridge > 0")
        if self.train.trainable != "all" and set(self.train.objectives) != {"clm"}:
            raise ValueError(f"train.trainable = {self.train.trainable!r} trains on causal-LM batches only: "
                             f"set train.objectives = {{clm = 1.0}} (got {sorted(self.train.objectives)})")
        if self.train.trainable != "all" and self.dsa.indexer_warmup_steps > 0:
            raise ValueError("dsa.indexer_warmup_steps > 0 trains the indexers before step 0; with "
                             f"train.trainable = {self.train.trainable!r} set it to 0")
