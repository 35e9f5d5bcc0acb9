"""Building the model's `AttnMetadata` from a step's scheduled chunks (the runner's only model input).

A chunk is one sequence's share of a forward: tokens at sequence indices [start, start + len). The
tokens of all chunks are laid out back to back (N flat tokens); each token's cache slot comes from
the sequence's block table (slot = block_id * block_size + offset). Attention groups keep padding
small: every short chunk (decodes, draft verification) goes in one padded group, each longer prefill
chunk in a group of its own.

Per-chunk extensions (see glm5/model/paged.py): `position_ids` (RoPE positions, default the sequence
indices), `prefix_len` (a bidirectional Part A: keys at sequence index < prefix_len are visible to every
query of the sequence; the whole prefix must be in the chunk that computes it), `block_position_ids`
(GLM 2D positions), `adapter_id` (multi-LoRA slot, -1 = base).

Dims: N flat tokens, B sequences in a group, T queries per sequence (padded), S keys (padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm5.model.paged import AttnGroup, AttnMetadata

SHORT_CHUNK = 8  # chunks up to this many tokens share one padded group


@dataclass
class SeqChunk:
    """One sequence's share of a forward: tokens at sequence indices [start, start + len(token_ids))."""

    key: str
    start: int
    token_ids: list[int]
    block_ids: list[int]
    position_ids: list[int] | None = None  # RoPE positions of the chunk's tokens (None = the indices)
    prefix_len: int = 0  # bidirectional Part A length (GLM blank infilling)
    block_position_ids: list[int] | None = None  # GLM 2D positions of the chunk's tokens
    adapter_id: int = -1  # LoRA adapter slot (-1 = base model)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of sequence indices [start, end) of a sequence with block table `block_ids`."""
    pos = torch.arange(start, end)
    table = torch.as_tensor(block_ids, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def build_metadata(chunks: list[SeqChunk], block_size: int, device) -> tuple[torch.Tensor, AttnMetadata]:
    """-> (input_ids [N], metadata) for the chunks laid out back to back."""
    ids, pos, slots, starts = [], [], [], [0]
    for c in chunks:
        ids.extend(c.token_ids)
        pos.append(torch.arange(c.start, c.context_len) if c.position_ids is None
                   else torch.as_tensor(c.position_ids, dtype=torch.long))
        slots.append(slots_for(c.block_ids, c.start, c.context_len, block_size))
        starts.append(starts[-1] + c.num_tokens)
    meta = AttnMetadata(torch.cat(pos).to(device), torch.cat(slots).to(device), starts)
    if any(c.block_position_ids is not None for c in chunks):
        meta.block_position_ids = torch.tensor([b for c in chunks for b in (c.block_position_ids or [0] * c.num_tokens)],
                                               dtype=torch.long, device=device)
    if any(c.adapter_id >= 0 for c in chunks):
        meta.adapter_ids = torch.tensor([c.adapter_id for c in chunks for _ in c.token_ids], device=device)
    short = [i for i, c in enumerate(chunks) if c.num_tokens <= SHORT_CHUNK]
    long_ = [[i] for i, c in enumerate(chunks) if c.num_tokens > SHORT_CHUNK]
    for members in ([short] if short else []) + long_:
        meta.groups.append(_group(chunks, starts, members, block_size, device))
    return torch.tensor(ids, dtype=torch.long, device=device), meta


def _group(chunks: list[SeqChunk], starts: list[int], members: list[int], block_size: int, device) -> AttnGroup:
    cs = [chunks[i] for i in members]
    B, T, S = len(cs), max(c.num_tokens for c in cs), max(c.context_len for c in cs)
    q_index = torch.zeros(B, T, dtype=torch.long)
    q_valid = torch.zeros(B, T, dtype=torch.bool)
    q_pos = torch.zeros(B, T, dtype=torch.long)
    key_slots = torch.zeros(B, S, dtype=torch.long)
    ctx_len = torch.tensor([c.context_len for c in cs])
    prefix = torch.tensor([c.prefix_len for c in cs])
    for b, (i, c) in enumerate(zip(members, cs)):
        n = c.num_tokens
        q_index[b, :n] = torch.arange(starts[i], starts[i] + n)
        q_valid[b, :n] = True
        q_pos[b, :n] = torch.arange(c.start, c.context_len)
        key_slots[b, : c.context_len] = slots_for(c.block_ids, 0, c.context_len, block_size)
    keys = torch.arange(S)
    key_valid = keys[None, :] < ctx_len[:, None]  # [B, S]
    allowed = (keys[None, None, :] <= q_pos[:, :, None]) | (keys[None, None, :] < prefix[:, None, None])
    allowed &= key_valid[:, None, :]  # [B, T, S]
    allowed &= q_valid[:, :, None] | (keys == 0)[None, None, :]  # padded query rows see key 0 only
    identity = B == 1 and T == starts[-1]  # a single sequence holding all of the step's tokens
    return AttnGroup(q_index.to(device), q_valid.to(device), q_pos.to(device), key_slots.to(device),
                     key_valid.to(device), allowed.to(device), is_identity=identity)
