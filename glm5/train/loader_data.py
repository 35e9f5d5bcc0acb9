"""`LoaderData`: the trainer's `DataSource` over the data pipeline's packed loader.

The trainer draws each micro-batch's objective (`train.objectives`) and asks the loader for a batch
of exactly that objective; the loader's own per-row mixing (`data.infill_ratio`) is therefore not
used. The curriculum (seed D3: mixture weights and sequence length by stage) follows the optimizer
step through `set_step`. Validation packs `data.val_path` at the current stage's sequence length.
"""

from __future__ import annotations

from pathlib import Path

from glm5.data.loader import PackedLoader, eval_batches
from glm5.data.tokenizer import load_tokenizer

from .data import DataSource


class LoaderData(DataSource):
    """`rank` / `world_size` are the *data* rank and degree: ranks that must see the same batch (tensor or
    pipeline parallel peers) pass the same data rank."""

    def __init__(self, cfg, rank: int, world_size: int):
        if cfg.data.infill_ratio > 0:
            raise ValueError("data.infill_ratio mixes objectives inside the loader; the trainer mixes them "
                             "per micro-batch: set train.objectives = {clm = ..., glm = ...} instead")
        self.cfg, self.rank, self.world = cfg.data, rank, world_size
        self.loader = PackedLoader(cfg.data, rank, world_size)
        self.micro_batch_size = cfg.data.batch_size
        meta = self.loader.shards.meta
        self.vocab_size = int(meta.get("vocab_size", 0))
        self.tokenizer_path = meta.get("tokenizer")
        self.step = 0

    def next_batch(self, objective: str) -> dict:
        return self.loader.next_batch(objective)

    def set_step(self, step: int) -> None:
        self.step = step
        self.loader.set_step(step)

    def val_batches(self, n: int) -> list[dict]:
        seq_len = self.cfg.stage_at(self.step).seq_len
        return list(eval_batches(self.cfg.val_path, seq_len, self.cfg.batch_size, self.rank, self.world,
                                 max_batches=n))

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """The loader's position is global (the same on every rank), so it resumes exactly at any rank and
        world size (elastic order, see glm5/data/loader.py)."""
        self.loader.load_state_dict(state)

    def save_tokenizer(self, directory: Path) -> None:
        """Copy the shards' tokenizer next to the model, so that `glm5 generate --model DIR` works."""
        if not self.tokenizer_path:
            return
        path = Path(self.tokenizer_path)
        if not path.exists():  # stored relative to where `glm5 data tokenize` ran; the shards keep a copy
            path = Path(self.cfg.train_path) / "tokenizer"
        if path.exists():
            load_tokenizer(path).save(directory)
