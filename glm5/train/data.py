"""What the trainer needs from data, and the two sources that provide it.

`DataSource` is the trainer's view: `next_batch(objective)` for "clm" (packed causal LM) or "glm"
(GLM blank infilling), deterministic `val_batches(n)`, `set_step(step)` (the sequence-length
curriculum follows the step), `state_dict()`/`load_state_dict()` for exact resume and
`save_tokenizer(dir)`. `LoaderData` wraps the data pipeline's loader (glm5/data/loader.py);
`SyntheticData` draws token streams from a fixed random bigram table, for tests and benchmarks that
must not depend on a corpus. Batches are dicts of tensors as the model takes them, plus `labels`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from glm5.data.infilling import InfillConfig, InfillTokens, make_infill_sample

IGNORE = -100


class DataSource:
    """Interface (duck-typed) of the trainer's data; see the module docstring."""

    micro_batch_size: int
    vocab_size: int

    def next_batch(self, objective: str) -> dict:
        raise TypeError(f"{type(self).__name__} does not implement next_batch")

    def val_batches(self, n: int) -> list[dict]:
        return []

    def set_step(self, step: int) -> None:
        """Called before each optimizer step (curriculum stages are a function of the step)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def save_tokenizer(self, directory: Path) -> None:
        pass


class SyntheticData(DataSource):
    """Sequences sampled from a fixed random bigram table (learnable structure, low entropy).

    Sample i of the stream is generated from seed (seed, i) alone, so the state is one counter.
    The top 5 ids stand in for [MASK], [sMASK], [gMASK], <sop>, <eop> in "glm" batches.
    Elastic like the packed loader: call k covers global samples [k*B*W, (k+1)*B*W) and data rank r
    gets [k*B*W + r*B, k*B*W + (r+1)*B); the counter is global.
    """

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0, branching: int = 4,
                 rank: int = 0, world_size: int = 1):
        self.vocab_size, self.micro_batch_size, self.seq_len, self.seed = vocab_size, batch_size, seq_len, seed
        self.rank, self.world = rank, world_size
        rng = np.random.default_rng(seed)
        self.n_text = vocab_size - 5
        self.table = rng.integers(0, self.n_text, size=(self.n_text, branching))  # next-token choices
        self.ids = InfillTokens(*range(self.n_text, self.n_text + 5))
        self.index = 0

    def _tokens(self, i: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        out = np.empty(n, dtype=np.int64)
        out[0] = rng.integers(self.n_text)
        picks = rng.integers(0, self.table.shape[1], size=n)
        for t in range(1, n):
            out[t] = self.table[out[t - 1], picks[t]]
        return out

    def _clm(self, i: int) -> dict:
        toks = self._tokens(i, self.seq_len + 1)
        return {"input_ids": toks[:-1], "labels": toks[1:]}

    def _glm(self, i: int) -> dict:
        T = self.seq_len
        rng = np.random.default_rng([self.seed, i, 1])
        s = make_infill_sample(self._tokens(i, T // 2), rng, InfillConfig(min_tokens=4), self.ids)
        n = min(T, len(s.input_ids))
        pad = T - n
        mask = np.tril(np.ones((T, T), dtype=bool))  # padding rows attend causally (never all-masked)
        mask[:n, :n] = s.attention_mask()[:n, :n]
        return {"input_ids": np.pad(s.input_ids[:n], (0, pad)),
                "labels": np.pad(s.labels[:n], (0, pad), constant_values=IGNORE),
                "position_ids": np.pad(s.position_ids[:n], (0, pad)),
                "block_position_ids": np.pad(s.block_position_ids[:n], (0, pad)),
                "attention_mask": mask}

    def _collate(self, samples: list[dict]) -> dict:
        return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}

    def next_batch(self, objective: str) -> dict:
        if objective not in ("clm", "glm"):
            raise ValueError(f"synthetic data has no {objective!r} batches (clm and glm only)")
        make = self._glm if objective == "glm" else self._clm
        B = self.micro_batch_size
        first = self.index + self.rank * B
        batch = self._collate([make(first + b) for b in range(B)])
        self.index += B * self.world
        return batch

    def val_batches(self, n: int) -> list[dict]:
        start, B = 1 << 40, self.micro_batch_size  # far from any training index
        return [self._collate([self._clm(start + (k * self.world + self.rank) * B + b) for b in range(B)])
                for k in range(n)]

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])


def build_data(cfg, rank: int, world_size: int) -> DataSource:
    """The configured data source: the pipeline's loader over `cfg.data`, or, when `data.train_path` is a
    chat JSONL file, the conversations rendered with the model's tokenizer (`chat_data.ChatData`)."""
    from .chat_data import ChatData, is_chat_path
    if is_chat_path(cfg.data.train_path):
        return ChatData(cfg, rank, world_size)
    from .loader_data import LoaderData
    return LoaderData(cfg, rank, world_size)
