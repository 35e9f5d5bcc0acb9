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
from glm5.train.checkpointer import Checkpointer, DCPCheckpointer
from glm5.train.trainer import Trainer

from glm5.model import peft_adapter

from . import prefix
from .adapters import GLM5AdapterModel, from_pretrained
from .config import FinetuneConfig
from .domain import UnfreezeSchedule, add_domain_tokens
from .parallel import assemble, check_mesh, gather_trainable, parallelize
from .sft_data import MixedData, SFTData

def tokenizer_dir(cfg: FinetuneConfig) -> Path:
    """`data.tokenizer`, else the base checkpoint's tokenizer files, else the bundled tokenizer."""
    if cfg.data.tokenizer:
        return resolve_path(cfg.data.tokenizer)
    base = Path(cfg.model.name)
    return base if (base / "tokenizer.json").is_file() else bundled("tokenizer-8k")


def build_model(cfg: FinetuneConfig, data_rank: int = 0, data_world: int = 1):
    """-> (model with the method's trainable part attached, tokenizer, data: rank `data_rank` of
    `data_world` data ranks' rows)."""
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
    data = SFTData(cfg.data, tok, position_offset=P, rank=data_rank, world=data_world)
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
        check_mesh(cfg, dist.world_size())
        coords = (0, 1)  # (data rank, data degree): the data is built before the mesh
        if dist.world_size() > 1:
            from glm5.train.parallel import data_coords  # the distributed modules load only when needed
            coords = data_coords(cfg.parallel, dist.rank(), dist.world_size())
        torch.manual_seed(cfg.train.seed)  # adapter init (A matrices, random prefixes) follows the seed
        model, self.tokenizer, data = build_model(cfg, *coords)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=cfg.resolved_lr()))
        self.method = cfg.method
        self.unfreeze = UnfreezeSchedule(model, cfg.domain.unfreeze_every) if cfg.domain.unfreeze_every else None
        self.base = model.name_or_path
        report = model.trainable_report()  # before sharding: the single-process counts
        super().__init__(cfg, model=model.train(), data=data, parallelize_fn=parallelize)
        assert (self.dims.data_rank, self.dims.data_world) == coords, "data_coords disagrees with the mesh"
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

    def build_checkpointer(self) -> Checkpointer:
        """Adapters on the mesh: DCP checkpoints of the trained tensors only (the frozen base is the base
        checkpoint's) with the gathered PEFT adapter as each checkpoint's `model/`, resumable at any world size."""
        if self.distributed and self.method != "full":
            return DCPCheckpointer(self.model, self.raw_model, self.optimizer, export=self.export_trained,
                                   trainable_only=True)
        return super().build_checkpointer()

    def save_final(self) -> Path | None:
        """`RUN_DIR/final`: the adapter (lora/prefix) or the full model, plus the tokenizer."""
        if self.distributed and self.method == "full":
            return super().save_final()
        final = self.run_dir / "final"
        self.export_trained(final, tokenizer=True)
        return final

    # --- on the mesh: adapters gathered into the single-process layout -----------------------------------
    def export_trained(self, directory: Path, tokenizer: bool = False) -> None:
        """Write the adapter (PEFT LoRA / latent prefix files, + the tokenizer) into `directory`
        atomically. Distributed: collective; the shards are gathered and rank 0 writes exactly what one
        process would."""
        error = None
        try:
            if self.distributed:
                tensors = gather_trainable(self.model)
                model = assemble(self.cfg, self.raw_model.config, tensors, self.base) if tensors is not None else None
            else:
                model = self.raw_model
            if model is not None:
                with atomic_dir(directory) as tmp:
                    self.write_model(model, tmp)
                    if tokenizer:
                        self.tokenizer.save(tmp)
        except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
            error = e
        # rank 0 alone assembles and writes: a failure there is raised on every rank, not left to hang the
        # others in their next collective (it did: an adapter name assemble refused, then the exit save)
        if self.distributed and dist.all_reduce_scalars([float(error is not None)], "max")[0] > 0:
            raise error or RuntimeError(f"rank 0 could not write the adapter to {directory}")
        if error is not None:
            raise error
