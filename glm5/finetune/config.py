"""`FinetuneConfig`: a `TrainConfig` (same sections, same trainer) plus what fine-tuning adds.

`method` picks what trains: `lora` (adapters, base frozen), `prefix` (per-layer latent prefixes, base
frozen) or `full` (every weight). `[data]` is chat JSONL (`SFTDataConfig`), `[lora]`, `[prefix]`,
`[full]` and `[domain]` configure the methods and domain adaptation. Defaults differ from pretraining
where fine-tuning differs: short warm-up, no MTP loss, no router-bias updates or balance losses (the
base's routing is kept), LR from the method (`optim.lr = 0`: LoRA 5e-4, prefix 5e-3, full = the
pretraining LR / 10). Loaded with `glm5.core.config.load_config(FinetuneConfig, path, overrides)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from glm5.train.config import (BalanceConfig, LogConfig, ModelSection, OptimConfig, ScheduleConfig,
                               TrainConfig, TrainSection)

from glm5.model.lora import LoraConfig

METHOD_LR = {"lora": 5e-4, "prefix": 5e-3}


@dataclass(kw_only=True)
class SFTDataConfig:
    train_path: str = "bundled:sft/train.jsonl.gz"
    """Chat (or {"text": ...}) JSONL, .jsonl or .jsonl.gz; default: the bundled bilingual SFT set."""
    val_path: str = "bundled:sft/heldout.jsonl.gz"
    """Held-out JSONL for the validation loss (default: the bundled set's held-out split; "" = none)."""
    tokenizer: str = ""
    """Tokenizer directory; "" = the base checkpoint's, else `bundled:tokenizer-8k`."""
    batch_size: int = 8
    """Rows per micro-batch."""
    seq_len: int = 512
    """Row length; longer conversations are cut."""
    seed: int = 1234
    """Seeds the per-epoch order of conversations."""
    keep_reasoning: bool = True
    """Train every turn's reasoning (clear_thinking=false); else earlier turns render as at inference."""
    pack: bool = True
    """Pack several conversations per row (per-document attention); prefix tuning needs one per row."""


@dataclass(kw_only=True)
class PrefixConfig:
    num_virtual_tokens: int = 16
    """Prefix entries per layer (each a latent, a rope key and, on full-indexer layers, an indexer key)."""
    init: Literal["tokens", "random"] = "tokens"
    """`tokens`: the cache entries of the first training row's first tokens; `random`: unit-RMS noise."""


@dataclass(kw_only=True)
class FullConfig:
    lr_ratio: float = 0.1
    """With optim.lr = 0: LR = pretraining LR * lr_ratio (seed F2: 1/10)."""
    pretrain_lr: float = 0.0
    """Pretraining LR; 0 = read it from the base run's metrics.jsonl / train_config.json (else 3e-4)."""


@dataclass(kw_only=True)
class DomainConfig:
    unfreeze_every: int = 0
    """Gradual unfreezing (seed F3): start with the LM head + final norm, unfreeze one more decoder layer
    from the top every N steps, the embeddings last (0 = everything trainable from step 0)."""
    general_path: str = ""
    """Token-shard directory of general text (`glm5 data tokenize` output) replayed during training."""
    general_ratio: float = 0.0
    """Fraction of micro-batches drawn from `general_path` (the rest from `[data]`, the domain)."""
    new_tokens: list[str] = field(default_factory=list)
    """Domain tokens added to the tokenizer; embedding and LM head rows grow, initialised to the mean."""


@dataclass(kw_only=True)
class FinetuneModelSection(ModelSection):
    base_quant: Literal["none", "int8", "fp8"] = "none"
    """How the frozen base's linear and routed-expert weights are held (LoRA and prefix only): "none" (the
    compute dtype), "int8" (per output channel, as `glm5 serve --quantization int8`) or "fp8" (e4m3, 128 x
    128 block scales, as the released checkpoints; a FP8 checkpoint loads as stored). Dequantised per
    module at each use; the adapters train in the compute dtype (glm5/finetune/quant_base.py)."""


# Pretraining sections with fine-tuning defaults (a TOML section that sets some keys keeps these for the rest)
@dataclass(kw_only=True)
class FinetuneOptimConfig(OptimConfig):
    lr: float = 0.0
    """Peak LR; 0 = the method's default (LoRA 5e-4, prefix 5e-3, full = pretraining LR * full.lr_ratio)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (none by default: adapters start at zero, full FT stays near the base)."""


@dataclass(kw_only=True)
class FinetuneScheduleConfig(ScheduleConfig):
    warmup_steps: int = 10
    """Linear warm-up steps (short: fine-tuning runs are short)."""


@dataclass(kw_only=True)
class FinetuneTrainSection(TrainSection):
    steps: int = 200
    """Optimizer steps."""
    mtp_weight: float = 0.0
    """The MTP layer is not fine-tuned (no adapters there, transformers has none): no MTP loss."""


@dataclass(kw_only=True)
class FinetuneBalanceConfig(BalanceConfig):
    bias_update_rate: float = 0.0
    """Router-bias updates off: the base's routing is kept."""
    seq_aux_coef: float = 0.0
    """No balance loss (the router is frozen in LoRA / prefix runs)."""


@dataclass(kw_only=True)
class FinetuneLogConfig(LogConfig):
    run_dir: str = "runs/finetune"
    """Where metrics.jsonl, checkpoints and `final/` go."""


@dataclass(kw_only=True)
class FinetuneConfig(TrainConfig):
    method: Literal["lora", "prefix", "full"] = "lora"
    """What trains: LoRA adapters, latent prefixes, or every weight."""
    model: FinetuneModelSection = field(default_factory=FinetuneModelSection)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    full: FullConfig = field(default_factory=FullConfig)
    domain: DomainConfig = field(default_factory=DomainConfig)
    optim: FinetuneOptimConfig = field(default_factory=FinetuneOptimConfig)
    schedule: FinetuneScheduleConfig = field(default_factory=FinetuneScheduleConfig)
    train: FinetuneTrainSection = field(default_factory=FinetuneTrainSection)
    balance: FinetuneBalanceConfig = field(default_factory=FinetuneBalanceConfig)
    log: FinetuneLogConfig = field(default_factory=FinetuneLogConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.model.base_quant not in ("none", "int8", "fp8"):  # (a dataclass built in code skips the loader's check)
            raise ValueError(f"model.base_quant = {self.model.base_quant!r}: must be one of ['none', 'int8', 'fp8']")
        if self.method == "full" and self.model.base_quant != "none":
            raise ValueError(f"model.base_quant = {self.model.base_quant!r} holds a frozen base: it needs "
                             "method = 'lora' or 'prefix' (full fine-tuning trains every weight)")
        if set(self.train.objectives) != {"clm"}:
            raise ValueError("train.objectives: fine-tuning trains the causal LM only ({clm = 1.0})")
        if self.method == "prefix" and self.data.pack:
            raise ValueError("method = 'prefix' needs data.pack = false (every row sees the prefix from "
                             "position 0; packed documents would share one row)")
        if not 0.0 <= self.domain.general_ratio < 1.0:
            raise ValueError(f"domain.general_ratio must be in [0, 1), got {self.domain.general_ratio}")
        if self.domain.general_ratio > 0 and not self.domain.general_path:
            raise ValueError("domain.general_ratio > 0 needs domain.general_path (token shards of general text)")

    def resolved_lr(self) -> float:
        """optim.lr, or the method's default when it is 0."""
        if self.optim.lr > 0:
            return self.optim.lr
        if self.method == "full":
            return self.full.lr_ratio * (self.full.pretrain_lr or pretrain_lr(self.model.name))
        return METHOD_LR[self.method]


def pretrain_lr(base: str) -> float:
    """The LR the base was pretrained with: `train_config.json` next to a training checkpoint's model, or
    the config event of the run's metrics.jsonl (`RUN_DIR/final` -> `RUN_DIR/metrics.jsonl`); else the
    pretraining default."""
    path = Path(base)
    for cfg_file in (path / "train_config.json", path.parent / "train_config.json"):
        if cfg_file.is_file():
            return float(json.loads(cfg_file.read_text())["optim"]["lr"])
    metrics = path.parent / "metrics.jsonl"
    if metrics.is_file():
        with open(metrics) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("event") == "config":
                    return float(rec["config"]["optim"]["lr"])
    return OptimConfig().lr
