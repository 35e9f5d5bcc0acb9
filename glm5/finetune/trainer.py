"""`FinetuneTrainer(cfg).fit()`: the pretraining `Trainer` with a fine-tuning model and data.

Built here, used unchanged from `glm5.train.trainer`: the step (forward/backward, clipping, NaN guard),
schedule, logging (metrics.jsonl, tqdm, `glm5 plot`), validation and resumable atomic checkpoints.
What differs: the model is the base checkpoint plus the method's trainable part (LoRA adapters,
latent prefixes, or everything), the data is chat JSONL (`SFTData`, optionally mixed with general text),
the LR defaults to the method's, gradual unfreezing runs before each step, and for the adapter
methods checkpoints and `final/` hold only the adapter (PEFT directory) + tokenizer, not the base.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from glm5.core import dist
from glm5.core.io import atomic_dir
from glm5.core.resources import bundled, resolve_path
from glm5.data.tokenizer import load_tokenizer
from glm5.train.trainer import Trainer

from glm5.model import peft_adapter

from . import prefix
from .adapters import GLM5AdapterModel, from_pretrained
from .config import FinetuneConfig
from .domain import UnfreezeSchedule, add_domain_tokens
from .sft_data import MixedData, SFTData

def tokenizer_dir(cfg: FinetuneConfig) -> Path:
    """`data.tokenizer`, else the base checkpoint's tokenizer files, else the bundled tokenizer."""
    if cfg.data.tokenizer:
        return resolve_path(cfg.data.tokenizer)
    base = Path(cfg.model.name)
    return base if (base / "tokenizer.json").is_file() else bundled("tokenizer-8k")


def build_model(cfg: FinetuneConfig):
    """-> (model with the method's trainable part attached, tokenizer, data)."""
    base = Path(cfg.model.name)
    if not (base / "config.json").is_file():
        raise ValueError(f"model.name = {cfg.model.name!r}: fine-tuning needs a base checkpoint directory "
                         "(config.json + safetensors), e.g. runs/tiny/final")
    if cfg.model.overrides:
        raise ValueError("model.overrides: a fine-tuned model keeps its base's architecture")
    model = from_pretrained(base, base_quant=cfg.model.base_quant)
    tok = load_tokenizer(tokenizer_dir(cfg))
    if cfg.domain.new_tokens:
        tok = add_domain_tokens(model, tok, cfg.domain.new_tokens)
    P = cfg.prefix.num_virtual_tokens if cfg.method == "prefix" else 0
    data = SFTData(cfg.data, tok, position_offset=P)
    if cfg.method == "lora":
        model.add_lora(cfg.lora)
    elif cfg.method == "prefix":
        prefix.apply_prefix(model, P)
        if cfg.prefix.init == "tokens":
            prefix.init_from_tokens(model, torch.from_numpy(data.first_row()[:P]))
    else:
        model.requires_grad_(True)
    if cfg.domain.general_ratio > 0:
        data = MixedData(data, cfg.domain.general_path, cfg.domain.general_ratio, cfg.data.seed)
    return model, tok, data


class FinetuneTrainer(Trainer):
    def __init__(self, cfg: FinetuneConfig):
        torch.manual_seed(cfg.train.seed)  # adapter init (A matrices, random prefixes) follows the seed
        model, self.tokenizer, data = build_model(cfg)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=cfg.resolved_lr()))
        self.method = cfg.method
        self.unfreeze = UnfreezeSchedule(model, cfg.domain.unfreeze_every) if cfg.domain.unfreeze_every else None
        super().__init__(cfg, model=model.train(), data=data)
        if self.distributed and self.method != "full":
            raise ValueError(f"method = {self.method!r} runs in one process (adapters are small); "
                             "use method = 'full' under torchrun")
        report = self.raw_model.trainable_report()
        dist.print0(f"finetune ({self.method}): {report['trainable_params']:,} trainable of "
                    f"{report['total_params']:,} parameters ({report['trainable_fraction']:.3%}), "
                    f"lr {cfg.optim.lr:.2e}")

    # --- one step -----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        if self.unfreeze is not None:
            self.unfreeze.apply(self.step)
        metrics = super().train_step()
        if self.unfreeze is not None:
            metrics["unfrozen_groups"] = self.unfreeze.groups_at(self.step - 1)
        if isinstance(self.data, MixedData):
            metrics["general_batches"] = self.data.counts["general"]
        return metrics

    # --- what a checkpoint holds --------------------------------------------------------------------
    def write_model(self, model: GLM5AdapterModel, directory: Path) -> None:
        """Checkpoints and `final/` hold what trains: the PEFT adapter, the prefix, or the whole model."""
        if self.method == "lora":
            peft_adapter.write_adapter(model, directory, model.name_or_path)
        elif self.method == "prefix":
            prefix.write_prefix(model, directory, model.name_or_path)
        else:
            super().write_model(model, directory)

    def read_model(self, model: GLM5AdapterModel, directory: Path) -> None:
        if self.method == "lora":
            peft_adapter.copy_adapter_weights(model, directory)
        elif self.method == "prefix":
            prefix.load_prefix(model, directory, apply=False)
        else:
            super().read_model(model, directory)

    def save_final(self) -> Path | None:
        """`RUN_DIR/final`: the adapter (lora/prefix) or the full model, plus the tokenizer."""
        if self.distributed:
            return super().save_final()
        final = self.run_dir / "final"
        with atomic_dir(final) as tmp:
            self.write_model(self.raw_model, tmp)
            self.tokenizer.save(tmp)
        return final
