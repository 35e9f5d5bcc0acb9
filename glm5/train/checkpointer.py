"""The trainer's checkpoint writer, chosen once from the `ParallelDims` (`make_checkpointer`).

- One process, `LocalCheckpointer`: `RUN_DIR/checkpoints/step_N/` in safetensors (glm5/train/checkpoint.py),
  `model/` written and read by the trainer's `write_model` / `read_model` (fine-tuning: the adapter only),
  and `final/` the raw model in HF layout.
- Several processes, `DCPCheckpointer`: every rank writes its shards with DCP (glm5/train/parallel_ckpt.py,
  reloadable at any world size), and `final/` is the gathered model exported by rank 0.
Both read a DCP checkpoint (DCP reshards to any world size, 1 included); a single-process checkpoint
(no `dcp/`) is read by one process only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from glm5.core import dist
from glm5.core.io import atomic_dir
from glm5.model.hf_adapter import save_pretrained

from .checkpoint import load_checkpoint, save_checkpoint
from .dims import ParallelDims

ModelIO = Callable[[nn.Module, Path], None]  # write_model / read_model: (model, model_dir)


@dataclass
class Checkpointer(ABC):
    model: nn.Module  # what trains (the parallelised module under torchrun)
    raw_model: nn.Module  # the unwrapped module
    optimizer: torch.optim.Optimizer

    def load(self, path: Path) -> dict:
        """Restore model, optimizer and RNG from `path` in place; returns the trainer state (with `step`)."""
        if (path / "dcp").is_dir():  # written by torchrun: DCP reshards to any world size, 1 included
            from .parallel_ckpt import load_train_checkpoint
            return load_train_checkpoint(path, self.model, self.optimizer)
        return self.load_plain(path)

    @abstractmethod
    def load_plain(self, path: Path) -> dict:
        """`load` of a single-process checkpoint (no `dcp/`)."""

    @abstractmethod
    def save(self, ckpt_root: Path, step: int, state: dict, config: dict, keep_last: int) -> Path | None:
        """Write `ckpt_root/step_<step>` (atomic; all but the newest `keep_last` removed); `state` is
        this rank's trainer state. Returns the directory (None on a rank that did not write it)."""

    @abstractmethod
    def save_final(self, final: Path, add_files: Callable[[Path], None]) -> Path:
        """`final/`: the model in HF layout, plus what `add_files(dir)` writes (the tokenizer)."""


@dataclass
class LocalCheckpointer(Checkpointer):
    write_model: ModelIO
    read_model: ModelIO

    def load_plain(self, path: Path) -> dict:
        return load_checkpoint(path, self.raw_model, self.optimizer, read_model=self.read_model)

    def save(self, ckpt_root: Path, step: int, state: dict, config: dict, keep_last: int) -> Path | None:
        path = None
        if dist.is_main():
            path = save_checkpoint(ckpt_root, step, self.raw_model, self.optimizer, state, config, keep_last,
                                   write_model=self.write_model)
        if dist.is_dist():
            torch.distributed.barrier()
        return path

    def save_final(self, final: Path, add_files: Callable[[Path], None]) -> Path:
        with atomic_dir(final) as tmp:
            save_pretrained(self.raw_model, tmp)
            add_files(tmp)
        return final


@dataclass
class DCPCheckpointer(Checkpointer):
    # a fine-tuning run's adapters: its checkpoints hold only what trains (the frozen base is the base
    # checkpoint's) and `export(dir)` (collective) writes the gathered adapter as each checkpoint's model/
    export: Callable[[Path], None] | None = None
    trainable_only: bool = False

    def load_plain(self, path: Path) -> dict:
        if self.trainable_only:  # its model/ is an adapter, not a base the run could start from
            raise ValueError(f"{path} is a single-process checkpoint (no dcp/): resume it with one process "
                             "(a fine-tuning run resumes on the mesh from checkpoints written under torchrun)")
        raise ValueError(f"{path} is a single-process checkpoint (no dcp/); resume it with one process, "
                         "or start the distributed run from its weights: --model.name=PATH/model")

    def save(self, ckpt_root: Path, step: int, state: dict, config: dict, keep_last: int) -> Path | None:
        """Collective: every rank writes its shards."""
        from .parallel_ckpt import save_train_checkpoint
        return save_train_checkpoint(ckpt_root, step, self.model, self.optimizer, state, config, keep_last,
                                     export=self.export, trainable_only=self.trainable_only)

    def save_final(self, final: Path, add_files: Callable[[Path], None]) -> Path:
        from .parallel_ckpt import export_hf
        export_hf(self.model, final)  # collective; rank 0 writes
        if dist.is_main():
            add_files(final)
        return final


def make_checkpointer(dims: ParallelDims, model: nn.Module, raw_model: nn.Module, optimizer: torch.optim.Optimizer,
                      write_model: ModelIO, read_model: ModelIO) -> Checkpointer:
    """DCP under torchrun, plain safetensors (through `write_model` / `read_model`) in one process."""
    if dims.distributed:
        return DCPCheckpointer(model, raw_model, optimizer)
    return LocalCheckpointer(model, raw_model, optimizer, write_model, read_model)
