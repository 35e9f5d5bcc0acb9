"""The trainer's data for fine-tuning: `SFTData` (chat JSONL, assistant-only loss) and `MixedData`
(domain batches mixed with replayed general pretraining text, seed F3).

Both implement `glm5.train.data.DataSource`. SFTData encodes every conversation once, then walks
per-epoch permutations (a pure function of seed and epoch), packing rows as it goes, so the state is
(epoch, cursor) and a resumed run sees exactly the batches an uninterrupted one would. Validation
packs the held-out file in order. Rendering, masks and packing are `glm5.data.sft`'s.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from glm5.data import sft
from glm5.data.loader import DataLoaderConfig, PackedLoader
from glm5.data.tokenizer import GLMTokenizer
from glm5.train.data import DataSource


def _batch(rows: dict[str, np.ndarray], position_offset: int) -> dict[str, torch.Tensor]:
    out = {k: torch.from_numpy(v) for k, v in rows.items()}
    if position_offset:
        out["position_ids"] = out["position_ids"] + position_offset
    return out


class SFTData(DataSource):
    """Packed (or one-per-row, `pack=False`) chat rows. `position_offset` shifts positions (prefix
    tuning: real tokens follow the virtual prefix tokens). On `world` data ranks each call walks the
    global batch of batch_size x world rows and `rank` keeps rows [rank x B, (rank + 1) x B): the
    state (epoch, cursor) is global, so a run resumed at another world size continues at its rows and
    every global batch is the one a single process with batch_size x world rows would see."""

    def __init__(self, cfg, tokenizer: GLMTokenizer, position_offset: int = 0, rank: int = 0, world: int = 1):
        self.cfg, self.tokenizer, self.position_offset = cfg, tokenizer, position_offset
        self.rank, self.world = rank, world
        self.micro_batch_size, self.vocab_size = cfg.batch_size, tokenizer.vocab_size
        self.docs = sft.encode_file(tokenizer, cfg.train_path, cfg.keep_reasoning)
        self.val_docs = sft.encode_file(tokenizer, cfg.val_path, cfg.keep_reasoning) if cfg.val_path else []
        self.epoch, self.cursor = 0, 0
        self._rows = self._epoch_rows(0)

    def _epoch_rows(self, epoch: int) -> dict[str, np.ndarray]:
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.docs))
        return self._pack([self.docs[i] for i in order])

    def _pack(self, docs) -> dict[str, np.ndarray]:
        if self.cfg.pack:
            return sft.pack(docs, self.cfg.seq_len, self.tokenizer.pad_token_id)
        # one conversation per row, right-padded: plain causal attention (padding comes last, no loss)
        rows = [sft.pack([d], self.cfg.seq_len, self.tokenizer.pad_token_id) for d in docs]
        return {k: np.concatenate([r[k] for r in rows]) for k in rows[0] if k != "segment_ids"}

    def next_batch(self, objective: str = "clm") -> dict:
        take: dict[str, list[np.ndarray]] = {k: [] for k in self._rows}
        B = self.micro_batch_size
        need = B * self.world
        while need:
            n = min(need, len(self._rows["input_ids"]) - self.cursor)
            for k, v in self._rows.items():
                take[k].append(v[self.cursor:self.cursor + n])
            self.cursor += n
            need -= n
            if self.cursor == len(self._rows["input_ids"]):  # epoch done: next permutation
                self.epoch, self.cursor = self.epoch + 1, 0
                self._rows = self._epoch_rows(self.epoch)
        lo = self.rank * B
        return _batch({k: np.concatenate(v)[lo:lo + B] for k, v in take.items()}, self.position_offset)

    def val_batches(self, n: int) -> list[dict]:
        if not self.val_docs:
            return []
        rows = self._pack(self.val_docs)
        B, W = self.micro_batch_size, self.world
        total = len(rows["input_ids"])
        # global batches of B x W rows, this rank's B; only those that give every rank rows (the ranks'
        # forwards are collective under FSDP, so they must run the same number of batches)
        starts = [i for i in range(0, min(total, n * B * W), B * W) if i + (W - 1) * B < total]
        return [_batch({k: v[i + self.rank * B:i + (self.rank + 1) * B] for k, v in rows.items()}, self.position_offset)
                for i in starts]

    def first_row(self) -> np.ndarray:
        """Token ids of the first training row (prefix initialisation)."""
        return self._rows["input_ids"][0]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._rows = self._epoch_rows(self.epoch)

    def save_tokenizer(self, directory: Path) -> None:
        self.tokenizer.save(directory)


class MixedData(DataSource):
    """Each micro-batch comes from the general data with probability `general_ratio`, else from the domain
    data; the draw is a pure function of (seed, step, micro-batch index), so resuming repeats it."""

    def __init__(self, domain: SFTData, general_path: str, general_ratio: float, seed: int):
        self.domain, self.ratio, self.seed = domain, general_ratio, seed
        cfg = domain.cfg
        self.general = PackedLoader(DataLoaderConfig(train_path=general_path, val_path="", batch_size=cfg.batch_size,
                                                     seq_len=cfg.seq_len, seed=seed), domain.rank, domain.world)
        general_vocab = int(self.general.shards.meta.get("vocab_size", 0))
        self.micro_batch_size, self.vocab_size = domain.micro_batch_size, max(domain.vocab_size, general_vocab)
        self.step, self.micro, self.counts = 0, 0, {"domain": 0, "general": 0}

    def set_step(self, step: int) -> None:
        self.step, self.micro = step, 0
        self.domain.set_step(step)

    def next_batch(self, objective: str = "clm") -> dict:
        u = np.random.default_rng([self.seed, self.step, self.micro]).random()
        self.micro += 1
        source = "general" if u < self.ratio else "domain"
        self.counts[source] += 1
        return self.general.next_batch("clm") if source == "general" else self.domain.next_batch()

    def val_batches(self, n: int) -> list[dict]:
        return self.domain.val_batches(n)

    def state_dict(self) -> dict:
        return {"domain": self.domain.state_dict(), "general": self.general.state_dict(), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.domain.load_state_dict(state["domain"])
        self.general.load_state_dict(state["general"])
        self.counts = {k: int(v) for k, v in state["counts"].items()}

    def save_tokenizer(self, directory: Path) -> None:
        self.domain.save_tokenizer(directory)
