"""`ModelRunner`: owns the model and the KV cache tensors; turns a `ScheduleOutput` into sampled tokens.

One step: flatten the scheduled chunks into `AttnMetadata` (paged_attention.py), run the paged forward
(per layer: project, write latent / rope key / indexer key into the cache slots, absorbed MLA over the
cache with DSA top-k when the context exceeds index_topk, shared IndexShare layers reusing the previous
full layer's selection, then the dense MLP or MoE exactly as the model), compute logits only for rows
that sample (and prompt-logprob rows), sample with the engine `Sampler` or verify MTP drafts, and
propose the next drafts. It never allocates blocks: block tables come from the scheduler.

Dims: N flat tokens, H hidden, V vocab, R kv_lora_rank, P rope dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glm5.model.layers import rope_angles
from glm5.model.model import GLM5ForCausalLM
from glm5.model.moe import MoE

from .config import EngineConfig
from .kv_cache import KVCache
from .outputs import Logprob, PositionLogprobs
from .paged_attention import AttnMetadata, SeqChunk, attend_group, build_metadata, select_topk
from .sampling import Sampler, gather_logprobs
from .scheduler import ScheduleOutput, ScheduledRequest


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # accepted drafts + one new token
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)  # this chunk's
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts for the next step
    hidden: torch.Tensor | None = None  # [N, H] final-norm hidden states of the step (MTP input)


class ModelRunner:
    def __init__(self, model: GLM5ForCausalLM, config: EngineConfig, num_blocks: int,
                 sampler: Sampler | None = None, device: str | torch.device = "cpu",
                 cache_dtype: torch.dtype = torch.float32):
        self.model, self.config, self.device = model, config, torch.device(device)
        self.cfg = model.config
        if self.cfg.sparse_attention != "dsa":
            raise ValueError("the paged engine runs DSA sparse attention only (sparse_attention='dsa'); "
                             f"got {self.cfg.sparse_attention!r}")
        self.block_size = config.block_size
        self.with_mtp = config.speculative_num_tokens > 0
        if self.with_mtp and self.cfg.num_nextn_predict_layers < 1:
            raise ValueError("speculative_num_tokens > 0 needs a checkpoint with an MTP layer "
                             "(num_nextn_predict_layers >= 1)")
        self.cache = KVCache(self.cfg, num_blocks, config.block_size, cache_dtype, self.device, self.with_mtp)
        self.sampler = sampler or Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.proposer = None
        if self.with_mtp:
            from .mtp import MTPProposer  # noqa: PLC0415 (only when speculation is on)
            self.proposer = MTPProposer(self, config.speculative_num_tokens)

    # ---- forward ----------------------------------------------------------------------------------
    def metadata(self, chunks: list[SeqChunk]) -> AttnMetadata:
        return build_metadata(chunks, self.block_size, self.cfg.index_topk, self.device)

    def rope(self, meta: AttnMetadata):
        return rope_angles(meta.positions[None], self.model.model.inv_freq)  # [1, N, P/2] each

    @torch.inference_mode()
    def forward(self, meta: AttnMetadata) -> torch.Tensor:
        """Paged forward of the main layers -> final-norm hidden states [N, H]."""
        x = self.model.model.embed_tokens(meta.input_ids)[None]  # [1, N, H]
        cos, sin = self.rope(meta)
        sels: dict[int, tuple] = {}
        for i, layer in enumerate(self.model.model.main_layers):
            x = self.layer_forward(i, layer, x, cos, sin, meta, sels)
        return self.model.model.norm(x)[0]

    def layer_forward(self, cache_layer: int, layer, x, cos, sin, meta: AttnMetadata, sels: dict) -> torch.Tensor:
        """One decoder layer over the flat tokens x [1, N, H]; `sels` carries each group's top-k."""
        attn = layer.self_attn
        xn = layer.input_layernorm(x)
        q_nope, q_rope, q_resid = attn.project_q(xn, cos, sin)  # [1, N, h, E], [1, N, h, P]
        c_kv, k_rope = attn.project_kv(xn, cos, sin)  # [1, N, R], [1, N, P]
        ki = attn.indexer.project_k(xn, cos, sin)[0] if attn.indexer is not None else None  # [N, D]
        self.cache.write(cache_layer, meta.slot_mapping, c_kv[0], k_rope[0], ki)
        qq = torch.cat([attn.absorb_q(q_nope), q_rope], dim=-1)[0]  # [N, h, R+P]
        qi = wi = None
        if attn.indexer is not None and any(g.needs_selection for g in meta.groups):
            qi, wi = attn.indexer.project_q(xn, q_resid, cos, sin)
            qi, wi = qi[0], wi[0]  # [N, I, D], [N, I]
        o_lat = None if meta.groups[0].is_identity else qq.new_zeros(qq.shape[0], qq.shape[1], self.cfg.kv_lora_rank)
        for g_id, group in enumerate(meta.groups):
            sel = None
            if group.needs_selection:
                if attn.indexer is not None:
                    sels[g_id] = select_topk(attn.indexer, self.cache, cache_layer, group, qi, wi,
                                             self.cfg.index_topk)
                elif g_id not in sels:
                    raise ValueError(f"layer {attn.layer_idx} shares a top-k selection nobody produced")
                sel = sels[g_id]
            o = attend_group(self.cache, cache_layer, group, qq, sel, attn.scale)  # [B, T, h, R]
            if group.is_identity:
                o_lat = o[0]  # [N, h, R]: the group is the whole step, in order
            else:
                o_lat[group.q_index[group.q_valid]] = o[group.q_valid]
        h = x + attn.latent_to_output(o_lat)[None]
        return h + mlp_forward(layer.mlp, layer.post_attention_layernorm(h))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()  # [M, V]

    # ---- one engine step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, out: ScheduleOutput) -> RunnerOutput:
        result = RunnerOutput()
        if out.is_empty():
            return result
        chunks = [self._chunk(s) for s in out.scheduled]
        meta = self.metadata(chunks)
        hidden = self.forward(meta)
        result.hidden = hidden
        sample_rows, row_owner = [], []
        for i, s in enumerate(out.scheduled):
            q0, q1 = meta.query_start[i], meta.query_start[i + 1]
            if s.request.params.prompt_logprobs is not None:
                self._prompt_logprobs(s, hidden[q0:q1], result)
            if s.samples:
                n = 1 + len(s.spec_token_ids)
                sample_rows.extend(range(q1 - n, q1))
                row_owner.append((s, len(sample_rows) - n, n))
        if sample_rows:
            logits = self.logits(hidden[torch.tensor(sample_rows, device=self.device)])  # [M, V]
            self._sample(logits, row_owner, result)
        if self.proposer is not None:
            result.draft_token_ids = self.proposer.propose(out, meta, hidden, result.sampled)
        return result

    def _chunk(self, s: ScheduledRequest) -> SeqChunk:
        req = s.request
        tokens = (req.all_token_ids + s.spec_token_ids)[s.start:s.start + s.num_tokens]
        return SeqChunk(req.request_id, s.start, tokens, req.block_ids)

    def _sample(self, logits: torch.Tensor, row_owner, result: RunnerOutput) -> None:
        rows = [s.request.sampling_row(j) for s, _, n in row_owner for j in range(n)]
        plain = [r0 for _, r0, n in row_owner if n == 1]  # rows without drafts: one batched sampler call
        sampled = {}
        if plain:
            ids = self.sampler(logits[plain], [rows[r] for r in plain]).token_ids.tolist()
            sampled = dict(zip(plain, ids))
        for s, r0, n in row_owner:
            req = s.request
            if n == 1:
                tokens = [sampled[r0]]
            else:
                tokens = self.proposer.verify(logits[r0:r0 + n], rows[r0:r0 + n], s)
            result.sampled[req.request_id] = tokens
            if req.params.logprobs is not None:
                result.logprobs[req.request_id] = self._logprobs(logits[r0:r0 + len(tokens)], tokens,
                                                                 req.params.logprobs)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: list[int], k: int) -> list[PositionLogprobs]:
        """log_softmax of the raw logits: the chosen token (with its rank) plus the top-k."""
        k = raw.shape[-1] if k == -1 else k
        ids, lps, ranks = gather_logprobs(raw, torch.tensor(tokens, device=raw.device), k)
        return [to_position_logprobs(ids[j], lps[j], int(ranks[j])) for j in range(len(tokens))]

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor, result: RunnerOutput) -> None:
        """Logprobs of prompt tokens start+1 .. predicted inside this chunk (position p predicts p+1)."""
        req = s.request
        last = min(s.start + s.num_tokens, req.num_prompt_tokens - 1)  # positions [start, last) predict
        entries: list[PositionLogprobs | None] = [None] if s.start == 0 else []
        if last > s.start:
            logits = self.logits(hidden[: last - s.start])  # [last - start, V]
            targets = torch.tensor(req.prompt_token_ids[s.start + 1:last + 1], device=logits.device)
            k = req.params.prompt_logprobs
            ids, lps, ranks = gather_logprobs(logits, targets, logits.shape[-1] if k == -1 else k)
            entries += [to_position_logprobs(ids[j], lps[j], int(ranks[j])) for j in range(ids.shape[0])]
        result.prompt_logprobs[req.request_id] = entries


def mlp_forward(mlp, x: torch.Tensor) -> torch.Tensor:
    """The layer's MLP as the model computes it; a plain top-k MoE skips the router statistics the
    training loop needs (bincounts, logits kept for losses), which cost real time per decode step."""
    cfg = getattr(mlp, "cfg", None)
    if isinstance(mlp, MoE) and cfg.moe_type == "topk" and cfg.moe_capacity_factor is None:
        xf = x.reshape(-1, x.shape[-1])  # [N, H]
        _, _, weights, idx = mlp.gate(xf)
        return mlp.experts(xf, idx, weights).to(x.dtype).view(x.shape) + mlp.shared_experts(x)
    m = mlp(x)
    return m[0] if isinstance(m, tuple) else m


def to_position_logprobs(ids: torch.Tensor, lps: torch.Tensor, rank: int) -> PositionLogprobs:
    """Row of gather_logprobs (column 0 = the chosen token) -> {token_id: Logprob}."""
    ids, lps = ids.tolist(), lps.tolist()
    out = {ids[0]: Logprob(lps[0], rank)}
    for j, (t, lp) in enumerate(zip(ids[1:], lps[1:])):
        out.setdefault(t, Logprob(lp, j + 1))
    return out
