"""`AttnMetadata`: what the model's paged forward needs to know about a batch of flat tokens.

The engine runs `model(input_ids [1, N], attn_metadata=meta, kv_cache=cache)` with the tokens of many
sequences back to back (no batch dim, no padding in the projections and MLPs). The metadata says
where each token's cache row goes (`slot_mapping`), its RoPE position, and how queries are grouped
for attention: a group is a padded batch of sequences attended together (the engine puts all short
chunks -- decodes, draft verification -- in one group and each long prefill chunk in its own), with
each query's flat index, its index within its sequence, the cache slots of the sequence's keys and
the [B, T, S] mask of keys each query may see. The engine's runner builds it (glm5/infer/input_batch.py);
the layers only read it. Without metadata the model runs its dense training path.

Extension points, so later features extend this dataclass instead of forking the forward:
  * GLM blank infilling at inference (issue 13): `block_position_ids` [N] is added to the embedding
    as in the training forward; a bidirectional Part A is a mask rule (the builder's `prefix_len`: keys
    at sequence index < prefix_len are visible to every query of the sequence, Part B stays causal);
    RoPE positions are per token and need not be increasing (`positions`).
  * Multi-LoRA serving (issue 9): `adapter_ids` [N] is the per-token adapter slot (-1 = base model), in
    the same flat order as the hidden states every projection sees ([1, N, H]); swapped LoRA linear
    modules gather their per-row adapters from it (the layers already receive the paged context).

Backends: none here. The metadata is plain data (tensors, ints, flags); which kernels compute a layer is
decided once, when the engine is built, by swapping modules (glm5/infer/kernels.py), never per step.

Per-token tags: `row_tags` [N] int64 is a tag per flat token that the engine sets for the experts
modules it swaps in (`glm5.model.moe.TaggedExperts`, which receive it as a forward argument); the model
gives tags no meaning and only passes them on. The metadata is built anew for every step, so such modules
read per-step row data from their arguments, never from state written into them before each step.

Captured decode (`static_shapes`): the engine's bucketed decode step (glm5/infer/graphs.py) runs this same
forward on persistent per-bucket buffers with padded static shapes; the flag makes the layers pick their
capture-safe branch (the MoE's grouped experts instead of the per-expert loop), decided in Python, never
from tensor values.

Dims: N flat tokens, B sequences in a group, T queries per sequence (padded), S keys (padded), M logit rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .kv_cache import LatentKVCache


@dataclass
class AttnGroup:
    """A padded batch of sequences attended together."""

    q_index: torch.Tensor  # [B, T] flat token index of each query (padding: 0)
    q_valid: torch.Tensor  # [B, T] bool
    q_pos: torch.Tensor  # [B, T] index of each query within its sequence (= its key index; padding: 0)
    key_slots: torch.Tensor  # [B, S] cache slot of each key index (padding: slot of key 0)
    key_valid: torch.Tensor  # [B, S] bool: key index < the sequence's context length
    allowed: torch.Tensor  # [B, T, S] bool: keys each query may attend to (padded rows: key 0 only)
    is_identity: bool = False  # [B, T] rows are the step's N tokens in flat order (B = 1, or T = 1): views, no gather/scatter
    key_lens: list[int] | None = None  # keys of each sequence (its context length); kernels trim padding by it
    causal_from_start: bool = False  # one sequence, queries = keys 0..S-1, plain causal mask (a first chunk)
    out_index: torch.Tensor | None = None  # [n] flat token index of each valid query, in [B*T] row order
    valid_rows: torch.Tensor | None = None  # [n] position of each valid query in [B*T] (None: all valid)
    _key_bias: torch.Tensor | None = field(default=None, repr=False)  # `key_bias`, once built

    @property
    def num_keys(self) -> int:
        return int(self.key_slots.shape[1])

    @property
    def key_bias(self) -> torch.Tensor:
        """`allowed` as an additive fp32 mask [B, T, S] (0 / -inf), built once per step for every layer (cached
        in a field, not by `functools.cached_property`, whose lock torch.compile cannot trace)."""
        if self._key_bias is None:
            self._key_bias = torch.zeros(self.allowed.shape, dtype=torch.float32,
                                         device=self.allowed.device).masked_fill_(~self.allowed, float("-inf"))
        return self._key_bias


@dataclass
class AttnMetadata:
    positions: torch.Tensor  # [N] RoPE positions
    slot_mapping: torch.Tensor  # [N] cache slot each token's KV row is written to
    query_start: list[int]  # [num_seqs + 1] offsets of each sequence's tokens in the flat batch
    groups: list[AttnGroup] = field(default_factory=list)
    logits_indices: torch.Tensor | None = None  # [M] rows to compute logits for (None = every row)
    block_position_ids: torch.Tensor | None = None  # [N] GLM 2D positions (blank infilling, issue 13)
    adapter_ids: torch.Tensor | None = None  # [N] LoRA adapter slot per token, -1 = base (issue 9)
    row_tags: torch.Tensor | None = None  # [N] int64 per-token tag for swapped-in `TaggedExperts` (None: no tags)
    # a captured step (glm5/infer/graphs.py: torch.compile, CUDA graphs): shapes are the bucket's, and the
    # layers take only branches without host syncs or data-dependent shapes (a Python-static choice)
    static_shapes: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass
class PagedContext:
    """The metadata and the cache of one paged forward, handed to every layer."""

    meta: AttnMetadata
    cache: LatentKVCache
