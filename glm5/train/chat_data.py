"""`ChatData`: the trainer's `DataSource` over a chat JSONL file, rendered with the model's own tokenizer.

Used when `data.train_path` names a `.jsonl` / `.jsonl.gz` file (`bundled:sft/train.jsonl.gz`, the bundled
chat set) instead of a shard directory: no `glm5 data tokenize` step. Each line is a conversation
(`{"messages": [...]}`, OpenAI format, as `glm5.data.sft` reads it) or `{"text": ...}`. Conversations
are rendered with the chat template of the tokenizer in `model.name` (a checkpoint directory), exactly
as the engine renders a chat prompt plus its answer. The targets are the assistant turns (what the
model generates, its end-of-turn tokens included; where speculative drafts are made), the rest is
context: each turn's tokens are those the full rendering adds after the prompt rendered with the
generation prompt (a template for which that is not a prefix makes the whole conversation targets).
`text` lines are targets throughout. Documents are packed into rows of `data.seq_len` with
`segment_ids` (attention stays inside each conversation) and positions restarting at 0.

Order: epoch e walks a permutation of the conversations that depends only on (data.seed, e); global
row k of the epoch's packed rows goes to data rank (k // B) % W, so the state is (epoch, row cursor)
and a resumed run sees the rows an uninterrupted one would. Validation packs `data.val_path` in order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from glm5.data import sft
from glm5.data.tokenizer import GLMTokenizer, copy_tokenizer_files, load_tokenizer

from .data import DataSource



def is_chat_path(path: str) -> bool:
    """A chat JSONL file (rendered by the trainer) rather than a shard directory of `glm5 data tokenize`."""
    return str(path).endswith((".jsonl", ".jsonl.gz"))


def assistant_mask(tokenizer: GLMTokenizer, messages: list[dict], tools=None) -> tuple[list[int], np.ndarray]:
    """(ids, mask): the conversation rendered with the chat template, mask True on the assistant turns'
    tokens (see the module docstring)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False)
    mask = np.zeros(len(ids), dtype=bool)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True) if i else []
        upto = tokenizer.apply_chat_template(messages[:i + 1], tools=tools, add_generation_prompt=False)
        if ids[:len(upto)] != upto or upto[:len(prompt)] != prompt:
            return ids, np.ones(len(ids), dtype=bool)  # not prefix-consistent: every token a target
        mask[len(prompt):len(upto)] = True
    return ids, mask


def encode_chat_file(tokenizer: GLMTokenizer, path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids, target mask) of every line of `path`: a conversation rendered with the chat template
    (targets: the assistant turns), or a `text` line plus EOS (all targets). A line that cannot be
    rendered raises naming it."""
    if tokenizer.chat_template is None:
        raise ValueError(f"data.train_path {path} is chat JSONL but the tokenizer has no chat template")
    out = []
    for n, ex in enumerate(sft.read_chat_jsonl(path), 1):
        if ex.text is not None:
            ids = tokenizer.encode(ex.text) + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
            mask = np.ones(len(ids), dtype=bool)
        else:
            try:
                ids, mask = assistant_mask(tokenizer, ex.messages, ex.tools)
            except Exception as e:  # template errors
                raise sft.SFTDataError(f"{path}: example {n} (id {ex.meta.get('id', '?')}): cannot render: {e}") from e
        if len(ids) >= 2:
            out.append((np.asarray(ids, dtype=np.int64), mask))
    if not out:
        raise sft.SFTDataError(f"{path}: no example of two or more tokens")
    return out


class ChatData(DataSource):
    """Packed chat rows for the trainer (see the module docstring); `rank` / `world_size` are the data
    rank and degree."""

    def __init__(self, cfg, rank: int = 0, world_size: int = 1, tokenizer: GLMTokenizer | None = None):
        self.cfg, self.rank, self.world = cfg.data, rank, world_size
        if cfg.data.stages:
            raise ValueError("data.stages (a curriculum over shard groups) does not apply to a chat JSONL "
                             "data.train_path; use data.seq_len")
        self.tokenizer_dir = None
        if tokenizer is None:
            source = Path(cfg.model.name)
            if not (source / "tokenizer.json").is_file():
                raise ValueError(f"data.train_path {cfg.data.train_path} is chat JSONL, rendered with the tokenizer "
                                 f"of model.name, but {cfg.model.name!r} is not a checkpoint directory with a "
                                 "tokenizer.json")
            tokenizer, self.tokenizer_dir = load_tokenizer(source), source
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.micro_batch_size = cfg.data.batch_size
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        self.docs = encode_chat_file(tokenizer, cfg.data.train_path)
        self.val_docs = encode_chat_file(tokenizer, cfg.data.val_path) if cfg.data.val_path else []
        self.epoch, self.cursor = 0, 0
        self._rows = self._epoch_rows(0)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(ids) for ids, _ in self.docs))

    def epoch_batches(self) -> int:
        """Batches of this rank that cover one pass over the packed training rows."""
        per_call = self.micro_batch_size * self.world
        return -(-len(self._rows["input_ids"]) // per_call)

    def _pack(self, docs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
        return sft.pack(docs, self.cfg.seq_len, self.pad_id)

    def _epoch_rows(self, epoch: int) -> dict[str, np.ndarray]:
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.docs))
        return self._pack([self.docs[i] for i in order])

    def next_batch(self, objective: str = "clm") -> dict:
        if objective != "clm":
            raise ValueError(f"chat data has causal-LM batches only, not {objective!r}: set train.objectives = {{clm = 1.0}}")
        B, parts = self.micro_batch_size, []
        for i in range(B * self.world):  # every rank walks the global rows and keeps its own B
            if i // B == self.rank:
                parts.append({k: v[self.cursor] for k, v in self._rows.items()})
            self.cursor += 1
            if self.cursor == len(self._rows["input_ids"]):  # epoch done: the next permutation
                self.epoch, self.cursor = self.epoch + 1, 0
                self._rows = self._epoch_rows(self.epoch)
        return {k: torch.from_numpy(np.stack([p[k] for p in parts])) for k in parts[0]}

    def val_batches(self, n: int) -> list[dict]:
        if not self.val_docs:
            return []
        rows = self._pack(self.val_docs)
        B, W = self.micro_batch_size, self.world
        out = []
        for k in range(0, len(rows["input_ids"]), B * W):
            if n and len(out) >= n:
                break
            lo = k + self.rank * B
            if lo < len(rows["input_ids"]):
                out.append({key: torch.from_numpy(v[lo:lo + B]) for key, v in rows.items()})
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._rows = self._epoch_rows(self.epoch)

    def save_tokenizer(self, directory: Path) -> None:
        """The source checkpoint's tokenizer files, copied as they are (else the tokenizer re-serialised)."""
        directory = Path(directory)
        if self.tokenizer_dir is None:
            self.tokenizer.save(directory)
            return
        copy_tokenizer_files(self.tokenizer_dir, directory)
