"""Which keys each query may attend to, produced a block of query rows at a time (never [T, T] unless asked).

A `MaskSpec` combines three rules: causal order, packed-document `segment_ids` (attend only within the
same document) and an explicit boolean `attention_mask` [B, Tq, Tk] (GLM blank infilling: bidirectional
over Part A, causal over Part B). Queries sit at absolute key indices `q_offset + i` (a KV cache prefix),
or at per-row indices `q_positions` [B, Tq] (the engine's padded groups of sequences).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MaskSpec:
    causal: bool = True
    segment_ids: torch.Tensor | None = None  # [B, Tk] int; query rows use segment_ids[:, q_offset + i]
    attention_mask: torch.Tensor | None = None  # [B, Tq, Tk] bool, True = may attend
    q_offset: int = 0
    q_positions: torch.Tensor | None = None  # [B|1, Tq] key index of each query; overrides q_offset

    def query_index(self, q0: int, q1: int, device=None) -> torch.Tensor:
        """Key index of query rows [q0, q1): [B|1, q1-q0]."""
        if self.q_positions is not None:
            return self.q_positions[:, q0:q1]
        return (torch.arange(q0, q1, device=device) + self.q_offset)[None]

    @property
    def is_plain_causal(self) -> bool:
        return self.causal and self.segment_ids is None and self.attention_mask is None

    def rows(self, q0: int, q1: int, num_keys: int, device=None) -> torch.Tensor | None:
        """Allowed keys for query rows [q0, q1): bool [B or 1, q1-q0, num_keys], or None if all allowed."""
        m = None
        if self.causal:
            qi = self.query_index(q0, q1, device)[:, :, None]  # [B|1, c, 1]
            m = torch.arange(num_keys, device=device)[None, None, :] <= qi  # [B|1, c, Tk]
        if self.segment_ids is not None:
            assert self.q_positions is None, "segment_ids index queries by q_offset"
            seg = self.segment_ids
            same = seg[:, None, :num_keys] == seg[:, q0 + self.q_offset:q1 + self.q_offset, None]  # [B, c, Tk]
            m = same if m is None else (m & same)
        if self.attention_mask is not None:
            am = self.attention_mask[:, q0:q1, :num_keys].bool()
            m = am if m is None else (m & am)
        return m

    def dense(self, num_queries: int, num_keys: int, device=None) -> torch.Tensor | None:
        return self.rows(0, num_queries, num_keys, device)
