"""`TextData`: the trainer's DataSource over JSONL text tokenized with the teacher's (HF) tokenizer.

Documents (optionally a seeded sample up to `max_train_tokens`) are encoded, joined with the end-of-text
token and cut into rows of `seq_len + 1` tokens; a row gives `input_ids = row[:-1]`, `labels = row[1:]`.
Training rows are visited in a seeded order, epoch after epoch; the state is one counter, so a resumed
run sees the same batches. Validation rows come from the start of the validation file.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import torch

from glm5.core.resources import resolve_path


def read_texts(path: str) -> list[str]:
    p = resolve_path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def pack(tokenizer, texts: list[str], seq_len: int, max_tokens: int = 0) -> torch.Tensor:
    """[R, seq_len + 1] rows of the concatenated documents (each followed by end-of-text)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for t in texts:
        ids += tokenizer.encode(t, add_special_tokens=False) + [eos]
        if max_tokens and len(ids) >= max_tokens:
            ids = ids[:max_tokens]
            break
    n = len(ids) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{len(ids)} tokens do not fill one row of {seq_len + 1}")
    return torch.tensor(ids[: n * (seq_len + 1)]).view(n, seq_len + 1)


class TextData:
    def __init__(self, tokenizer, train: str, validation: str, seq_len: int, batch_size: int,
                 max_train_tokens: int = 0, val_tokens: int = 8192, seed: int = 0):
        self.tokenizer, self.micro_batch_size, self.seed = tokenizer, batch_size, seed
        texts = read_texts(train)
        random.Random(seed).shuffle(texts)  # a mixed sample (en / zh / code) when the budget is small
        self.rows = pack(tokenizer, texts, seq_len, max_train_tokens)
        self.val_rows = pack(tokenizer, read_texts(validation), seq_len, val_tokens)
        self.vocab_size = len(tokenizer)
        self.cursor = 0

    def _batch(self, rows: torch.Tensor) -> dict:
        B, T = rows.shape[0], rows.shape[1] - 1
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous(),
                "position_ids": torch.arange(T).expand(B, T).contiguous()}

    def next_batch(self, objective: str) -> dict:
        if objective != "clm":
            raise ValueError(f"distillation data serves causal LM batches only, not {objective!r}")
        n = len(self.rows)
        idx = []
        for _ in range(self.micro_batch_size):
            epoch, pos = divmod(self.cursor, n)
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
            idx.append(int(order[pos]))
            self.cursor += 1
        return self._batch(self.rows[idx])

    def val_batches(self, n: int) -> list[dict]:
        B = self.micro_batch_size
        return [self._batch(self.val_rows[i:i + B]) for i in range(0, min(len(self.val_rows), n * B), B)]

    def set_step(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])

    def save_tokenizer(self, directory: Path) -> None:
        self.tokenizer.save_pretrained(str(directory))
