"""Domain adaptation (seed F3): gradual unfreezing and new domain tokens.

`UnfreezeSchedule` (ULMFiT's gradual unfreezing): the trainable parameters are split into groups from
the top of the network down (LM head + final norm, decoder layer L-1, ..., layer 0, embeddings); at
step s the first 1 + s // every groups train and the rest are frozen. The optimizer is built over all
of them; a frozen parameter simply gets no gradient that step (AdamW skips it, its state untouched).
`add_domain_tokens` adds tokens to the tokenizer and grows the embedding and LM head, new rows set to
the mean of the existing rows (a neutral start: the new token looks like an average token), so the
saved checkpoint and tokenizer load in transformers as any other GLM-5 checkpoint.
"""

from __future__ import annotations

import re

import torch
from tokenizers import AddedToken, Tokenizer
from torch import nn

from glm5.data.tokenizer import GLMTokenizer


def _group_of(name: str, n_layers: int) -> int:
    """0 = head (lm_head, final norm), 1 = top decoder layer, ..., n_layers = layer 0, n_layers + 1 =
    embeddings; MTP layers go with the head (they sit on top of the last hidden state)."""
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    if m:
        layer = int(m.group(1))
        return 0 if layer >= n_layers else n_layers - layer
    if name.startswith("model.embed_tokens") or name.startswith("model.block_position_embeddings"):
        return n_layers + 1
    return 0


class UnfreezeSchedule:
    """Which of the model's trainable parameters train at a given step (see the module docstring)."""

    def __init__(self, model: nn.Module, every: int):
        if every < 1:
            raise ValueError(f"domain.unfreeze_every must be >= 1, got {every}")
        n_layers = model.config.num_hidden_layers
        self.every, self.num_groups = every, n_layers + 2
        self.params = [(p, _group_of(n, n_layers)) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]

    def groups_at(self, step: int) -> int:
        """Number of groups (from the top) trainable at `step`."""
        return min(self.num_groups, 1 + step // self.every)

    def apply(self, step: int) -> None:
        k = self.groups_at(step)
        for p, g in self.params:
            p.requires_grad_(g < k)

    def trainable_names(self, step: int) -> list[str]:
        k = self.groups_at(step)
        return [n for n, (_, g) in zip(self.names, self.params) if g < k]


def add_domain_tokens(model: nn.Module, tokenizer: GLMTokenizer, tokens: list[str]) -> GLMTokenizer:
    """Add `tokens` (those not yet in the vocabulary) and resize the model to the new vocabulary, in
    place; returns the new tokenizer (the given one is left unchanged)."""
    new = [t for t in dict.fromkeys(tokens) if tokenizer.token_to_id(t) is None]
    if not new:
        return tokenizer
    tok = Tokenizer.from_str(tokenizer.tok.to_str())
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in new])
    out = GLMTokenizer(tok, tokenizer.chat_template, tokenizer.config)
    resize_vocab(model, out.vocab_size, [out.token_to_id(t) for t in new], old_rows=tokenizer.vocab_size)
    return out


@torch.no_grad()
def resize_vocab(model: nn.Module, vocab_size: int, new_ids: list[int], old_rows: int) -> None:
    """Grow embed_tokens / lm_head to `vocab_size` rows (never shrink); rows `new_ids` (and any added
    row) start at the mean of rows [0, old_rows)."""
    emb = model.model.embed_tokens
    V = max(vocab_size, emb.num_embeddings)
    fresh = sorted(set(new_ids) | set(range(emb.num_embeddings, V)))
    model.model.embed_tokens = _grown_embedding(emb, V, fresh, old_rows)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        model.lm_head = _grown_linear(model.lm_head, V, fresh, old_rows)
    model.config.vocab_size = V  # the config describes this model: it now has V rows


def _grown_embedding(emb: nn.Embedding, V: int, fresh: list[int], old_rows: int) -> nn.Embedding:
    w = emb.weight
    out = nn.Embedding(V, w.shape[1], device=w.device, dtype=w.dtype)
    out.weight[: w.shape[0]] = w
    out.weight[fresh] = w[:old_rows].mean(0)
    out.weight.requires_grad_(w.requires_grad)
    return out


def _grown_linear(head: nn.Linear, V: int, fresh: list[int], old_rows: int) -> nn.Linear:
    w = head.weight
    out = nn.Linear(w.shape[1], V, bias=False, device=w.device, dtype=w.dtype)
    out.weight[: w.shape[0]] = w
    out.weight[fresh] = w[:old_rows].mean(0)
    out.weight.requires_grad_(w.requires_grad)
    return out
