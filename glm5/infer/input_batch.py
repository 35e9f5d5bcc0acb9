"""Building the model's `AttnMetadata` from a step's scheduled chunks (the runner's only model input).

A chunk is one sequence's share of a forward: tokens at sequence indices [start, start + len). The
tokens of all chunks are laid out back to back (N flat tokens); each token's cache slot comes from
the sequence's block table (slot = block_id * block_size + offset). Attention groups keep padding
small: every short chunk (decodes, draft verification) goes in one padded group, ordered by context
length (longest first) so that kernels can attend a few sequences at a time and cut each block's keys at
its own longest context; each longer prefill chunk gets a group of its own.

Per-chunk extensions (see glm5/model/paged.py): `position_ids` (RoPE positions, default the sequence
indices), `prefix_len` (a bidirectional Part A: keys at sequence index < prefix_len are visible to every
query of the sequence; the whole prefix must be in the chunk that computes it), `block_position_ids`
(GLM 2D positions), `adapter_id` (multi-LoRA slot, -1 = base), `row_tag` (a tag for swapped-in
`TaggedExperts`, -1 where unset; the engine's hot swap tags a request's version).

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
    row_tag: int | None = None  # the chunk's tokens' tag (AttnMetadata.row_tags; hot swap: the request's version)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start + len(self.token_ids)


def build_metadata(chunks: list[SeqChunk], block_size: int, device,
                   sort_by_length: bool = True) -> tuple[torch.Tensor, AttnMetadata]:
    """-> (input_ids [N], metadata) for the chunks laid out back to back. Built with a fixed number of
    tensor ops per step (one padded block table [C, max_blocks]), never a loop of tensor ops per chunk.
    sort_by_length=False keeps the short chunks' group in step order (for an attention kernel that trims
    each sequence's keys itself, e.g. the native one): a step of single-token decodes is then attended
    on views of the step's rows, without a gather and a scatter."""
    C = len(chunks)
    n_tok = torch.tensor([c.num_tokens for c in chunks])  # [C]
    start = torch.tensor([c.start for c in chunks])  # [C]
    offsets = torch.zeros(C + 1, dtype=torch.long)
    torch.cumsum(n_tok, 0, out=offsets[1:])
    max_blocks = max(len(c.block_ids) for c in chunks)
    table = torch.tensor([c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks])  # [C, max_blocks]
    N = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(C), n_tok)  # [N] chunk of each token
    index = torch.arange(N) - offsets[seq] + start[seq]  # [N] sequence index of each token
    slots = table[seq, index // block_size] * block_size + index % block_size  # [N]
    positions = index
    if any(c.position_ids is not None for c in chunks):
        positions = torch.tensor([p for c in chunks for p in (c.position_ids if c.position_ids is not None
                                                             else range(c.start, c.context_len))])
    meta = AttnMetadata(positions.to(device), slots.to(device), offsets.tolist())
    if any(c.block_position_ids is not None for c in chunks):
        meta.block_position_ids = torch.tensor([b for c in chunks for b in (c.block_position_ids or [0] * c.num_tokens)],
                                               dtype=torch.long, device=device)
    if any(c.row_tag is not None for c in chunks):
        meta.row_tags = torch.tensor([-1 if c.row_tag is None else c.row_tag for c in chunks for _ in c.token_ids],
                                     dtype=torch.long, device=device)
    if any(c.adapter_id >= 0 for c in chunks):
        meta.adapter_ids = torch.tensor([c.adapter_id for c in chunks for _ in c.token_ids], device=device)
    batch = _Batch(n_tok, start, offsets, table, torch.tensor([c.prefix_len for c in chunks]), block_size)
    short = [i for i, c in enumerate(chunks) if c.num_tokens <= SHORT_CHUNK]
    if sort_by_length:
        short.sort(key=lambda i: -chunks[i].context_len)  # stable: equal lengths keep their order
    long_ = [[i] for i, c in enumerate(chunks) if c.num_tokens > SHORT_CHUNK]
    for members in ([short] if short else []) + long_:
        meta.groups.append(batch.group(members, device))
    ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=device)
    return ids, meta


@dataclass
class _Batch:
    """Per-chunk tensors of one step, from which attention groups are cut."""

    n_tok: torch.Tensor  # [C] tokens of each chunk
    start: torch.Tensor  # [C] sequence index of each chunk's first token
    offsets: torch.Tensor  # [C + 1] flat offsets
    table: torch.Tensor  # [C, max_blocks] block tables (padded with block 0)
    prefix: torch.Tensor  # [C] bidirectional prefix lengths
    block_size: int

    def group(self, members: list[int], device) -> AttnGroup:
        m = torch.tensor(members)
        n, st = self.n_tok[m], self.start[m]  # [B]
        ctx = st + n  # [B] context length
        T, S = int(n.max()), int(ctx.max())
        t = torch.arange(T)[None]  # [1, T]
        q_valid = t < n[:, None]  # [B, T]
        q_index = (self.offsets[m][:, None] + t) * q_valid  # [B, T] (padding: 0)
        q_pos = (st[:, None] + t) * q_valid  # [B, T] (padding: 0)
        keys = torch.arange(S)
        blk = (keys // self.block_size).clamp(max=self.table.shape[1] - 1)
        key_slots = self.table[m][:, blk] * self.block_size + keys % self.block_size  # [B, S]
        key_valid = keys[None, :] < ctx[:, None]  # [B, S]
        allowed = (keys[None, None, :] <= q_pos[:, :, None]) | (keys[None, None, :] < self.prefix[m][:, None, None])
        allowed &= key_valid[:, None, :]  # [B, T, S]
        allowed &= q_valid[:, :, None] | (keys == 0)[None, None, :]  # padded query rows see key 0 only
        N = int(self.offsets[-1])
        # the group's rows are the step's tokens in order: one sequence holding the whole step, or one token
        # of every sequence in step order
        identity = (len(members) == 1 and T == N) or (T == 1 and len(members) == N and members == list(range(N)))
        all_valid = bool(q_valid.all())
        valid_rows = None if all_valid else q_valid.reshape(-1).nonzero()[:, 0]  # [n]
        out_index = q_index.reshape(-1) if all_valid else q_index.reshape(-1)[valid_rows]  # [n]
        first = len(members) == 1 and int(st[0]) == 0 and int(self.prefix[m[0]]) == 0
        return AttnGroup(q_index.to(device), q_valid.to(device), q_pos.to(device), key_slots.to(device),
                         key_valid.to(device), allowed.to(device), is_identity=identity, key_lens=ctx.tolist(),
                         causal_from_start=first, out_index=out_index.to(device),
                         valid_rows=None if valid_rows is None else valid_rows.to(device))
