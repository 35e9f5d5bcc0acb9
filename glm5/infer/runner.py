"""`ModelRunner`: owns the KV cache tensors; turns a `ScheduleOutput` into sampled tokens.

One step: build the model's `AttnMetadata` from the scheduled chunks (input_batch.py) -> run the model's
own forward over the flat tokens with the paged cache (`model(ids, attn_metadata=..., kv_cache=...)`:
every layer, option and kernel is the model's) -> logits only for rows that sample (and prompt-logprob
rows) -> sample with the engine `Sampler` or verify MTP drafts -> propose the next drafts. It never
allocates blocks: block tables come from the scheduler.

Dims: N flat tokens, H hidden, V vocab, M logit rows.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch

from glm5.model.kv_cache import LatentKVCache, selection_possible
from glm5.model.model import GLM5ForCausalLM
from glm5.model.paged import AttnMetadata

from .config import EngineConfig
from .graphs import DecodeGraphs, bucket_sizes
from .input_batch import SeqChunk, build_metadata
from .outputs import PositionLogprobs
from .sampling import Sampler, logprobs_of, position_logprobs, requested_logprobs, with_requested
from .scheduler import ScheduleOutput, ScheduledRequest

log = logging.getLogger(__name__)


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # accepted drafts + one new token
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)  # this chunk's
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts for the next step
    hidden: torch.Tensor | None = None  # [N, H] final-norm hidden states of the step (MTP input)
    router_stats: list[dict] = field(default_factory=list)  # the model's, one dict per MoE layer
    nonfinite: set[str] = field(default_factory=set)  # requests whose logits held NaN / inf (not sampled)


@dataclass
class _Rows:
    """Which logit rows belong to whom: sampling rows per request and prompt-logprob rows per request."""

    indices: list[int] = field(default_factory=list)  # flat token index of each logit row
    sample: list[tuple[ScheduledRequest, int, int]] = field(default_factory=list)  # (s, first row, n)
    prompt: list[tuple[ScheduledRequest, int, int]] = field(default_factory=list)  # (s, first row, n)


class ModelRunner:
    def __init__(self, model: GLM5ForCausalLM, config: EngineConfig, num_blocks: int,
                 sampler: Sampler | None = None, device: str | torch.device = "cpu",
                 cache_dtype: torch.dtype = torch.float32, sort_by_length: bool = True):
        """sort_by_length: order each decode group's sequences longest first (the PyTorch latent attention
        trims its key blocks by it; the native kernels read each sequence's own keys and need no order)."""
        self.model, self.config, self.device = model, config, torch.device(device)
        self.sort_by_length = sort_by_length
        self.cfg = model.config
        self.block_size = config.block_size
        self.with_mtp = config.speculative_num_tokens > 0
        if self.with_mtp and self.cfg.num_nextn_predict_layers < 1:
            raise ValueError("speculative_num_tokens > 0 needs a checkpoint with an MTP layer "
                             "(num_nextn_predict_layers >= 1)")
        # no indexer keys when no request can outgrow the top-k (every key is attended; e.g. max_model_len
        # <= index_topk): the projection, RoPE and cache write of the indexer key are skipped on every layer
        max_keys = (config.max_model_len or self.cfg.max_position_embeddings) + config.speculative_num_tokens
        mode = "none" if config.enforce_eager or self.with_mtp else config.compile_decode
        if self.with_mtp and config.compile_decode != "none" and not config.enforce_eager:
            # every step verifies drafts (and the proposer reads the step's hidden states): none is a decode
            log.warning("compile_decode=%r has no effect with speculative decoding (speculative_num_tokens > 0)",
                        config.compile_decode)
        # a captured decode (graphs.py) gets one block more: the scratch block its padding rows write to,
        # outside the block manager's pool (ids 0..num_blocks-1)
        self.cache = LatentKVCache(self.cfg, num_blocks + (mode != "none"), config.block_size, cache_dtype,
                                   self.device, self.with_mtp, index_keys=selection_possible(self.cfg, max_keys))
        self.graphs = None if mode == "none" else DecodeGraphs(
            model, self.cache, mode, bucket_sizes(config.max_num_seqs), config.block_size, max_keys,
            scratch_block=num_blocks, backend=config.compile_backend)
        self.sampler = sampler or Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.proposer = None
        if self.with_mtp:
            from .mtp import MTPProposer  # noqa: PLC0415 (only when speculation is on)
            self.proposer = MTPProposer(self, config.speculative_num_tokens,
                                         (config.prompt_lookup_min, config.prompt_lookup_max))

    # ---- forward ----------------------------------------------------------------------------------
    def metadata(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, AttnMetadata]:
        ids, meta = build_metadata(chunks, self.block_size, self.device, sort_by_length=self.sort_by_length)
        return ids, meta

    @torch.inference_mode()
    def run(self, out: ScheduleOutput, tag_version: int | None = None) -> RunnerOutput:
        """`tag_version`: the expert version whose old weights a hot swap holds (glm5/infer/hot_swap.py); a step
        with a request on it tags every token with its request's version (`AttnMetadata.row_tags`)."""
        result = RunnerOutput()
        if out.is_empty():
            return result
        tag = tag_version is not None and any(s.request.model_version == tag_version for s in out.scheduled)
        chunks = [self._chunk(s, tag) for s in out.scheduled]
        rows = self._logit_rows(out, [0, *itertools.accumulate(c.num_tokens for c in chunks)])
        captured = None if tag_version is not None else self._captured(chunks, rows)
        if captured is not None:  # a decode bucket (graphs.py): logits of every row, no hidden states
            logits, result.router_stats = captured
            meta = None
        else:
            ids, meta = self.metadata(chunks)
            meta.logits_indices = torch.tensor(rows.indices, dtype=torch.long, device=self.device)
            fwd = self.model(ids[None], attn_metadata=meta, kv_cache=self.cache)
            result.hidden, result.router_stats = fwd.hidden_states[0], fwd.router_stats
            logits = fwd.logits[0]
        logits = logits.float()  # [M, V]
        bad = self._nonfinite(logits, rows)
        if bad:  # those requests are aborted by the engine; the rest of the batch is sampled as usual
            result.nonfinite = bad
            rows.prompt = [o for o in rows.prompt if o[0].request_id not in bad]
            rows.sample = [o for o in rows.sample if o[0].request_id not in bad]
        for s, r0, n in rows.prompt:
            self._prompt_logprobs(s, logits[r0:r0 + n], result)
        if rows.sample:
            self._sample(logits, rows.sample, result)
        if self.proposer is not None:
            result.draft_token_ids = self.proposer.propose(out, meta, result.hidden, result.sampled)
        return result

    def _captured(self, chunks: list[SeqChunk], rows: _Rows) -> tuple[torch.Tensor, list[dict]] | None:
        """The step through a captured decode bucket when it is one: every chunk one token that samples
        (logit row i = token i), no GLM 2D positions, no LoRA rows; else None (eager). Never while a hot swap
        holds an old version (`run` checks): its `VersionedExperts` are not part of the captured graphs."""
        if self.graphs is None or rows.indices != list(range(len(chunks))):
            return None
        if any(c.num_tokens != 1 or c.position_ids is not None or c.block_position_ids is not None
               or c.prefix_len or c.adapter_id >= 0 for c in chunks):
            return None
        return self.graphs.run(chunks)

    def _chunk(self, s: ScheduledRequest, tag: bool = False) -> SeqChunk:
        req = s.request
        tokens = (req.all_token_ids + s.spec_token_ids)[s.start:s.start + s.num_tokens]
        chunk = SeqChunk(req.request_id, s.start, tokens, req.block_ids, adapter_id=req.adapter_id,
                         row_tag=req.model_version if tag else None)
        if req.infill is not None:  # GLM blank infilling: 2D positions, bidirectional Part A
            end = s.start + s.num_tokens
            chunk.position_ids = req.infill.position_ids(s.start, end)
            chunk.block_position_ids = req.infill.block_position_ids(s.start, end)
            chunk.prefix_len = req.infill.part_a_len
        return chunk

    @staticmethod
    def _logit_rows(out: ScheduleOutput, query_start: list[int]) -> _Rows:
        """Rows that need logits: prompt positions that predict a prompt token (prompt_logprobs), then the
        last 1 + drafts positions of each chunk that samples (query_start [C + 1]: flat chunk offsets)."""
        rows = _Rows()
        for i, s in enumerate(out.scheduled):
            q0, q1 = query_start[i], query_start[i + 1]
            if s.request.params.prompt_logprobs is not None:
                last = min(s.start + s.num_tokens, s.request.num_prompt_tokens - 1)  # [start, last) predict
                n = max(last - s.start, 0)
                rows.prompt.append((s, len(rows.indices), n))
                rows.indices.extend(range(q0, q0 + n))
            if s.samples:
                n = 1 + len(s.spec_token_ids)
                rows.sample.append((s, len(rows.indices), n))
                rows.indices.extend(range(q1 - n, q1))
        return rows

    @staticmethod
    def _nonfinite(logits: torch.Tensor, rows: _Rows) -> set[str]:
        """Ids of the requests with a NaN or infinite logit in their rows (one reduction when all are fine).
        Rows are independent through every layer, so such a request poisons only its own rows."""
        finite = torch.isfinite(logits).all(dim=-1)
        if bool(finite.all()):
            return set()
        ok = finite.tolist()
        return {s.request_id for s, r0, n in (*rows.prompt, *rows.sample) if not all(ok[r0:r0 + n])}

    def _sample(self, logits: torch.Tensor, owners, result: RunnerOutput) -> None:
        plain = [(s, r0) for s, r0, n in owners if n == 1]  # rows without drafts: one batched sampler call
        if plain:
            so = self.sampler(logits[[r0 for _, r0 in plain]], [s.request.sampling_row() for s, _ in plain])
            ids = so.token_ids.tolist()
            for j, (s, _) in enumerate(plain):
                req = s.request
                result.sampled[req.request_id] = [ids[j]]
                k = req.params.logprobs
                if k is not None:
                    k = so.logprobs.shape[1] - 1 if k == -1 else k
                    rank = int(so.sampled_ranks[j])
                    entry = position_logprobs(so.logprob_token_ids[j], so.logprobs[j], rank, k)
                    result.logprobs[req.request_id] = [with_requested(entry, so.requested and so.requested[j])]
        for s, r0, n in owners:
            if n == 1:
                continue
            req = s.request
            tokens = self.proposer.verify(logits[r0:r0 + n], [req.sampling_row(j) for j in range(n)], s)
            result.sampled[req.request_id] = tokens
            if req.params.logprobs is not None:
                rows_lp = logits[r0:r0 + len(tokens)]
                entries = logprobs_of(rows_lp, tokens, req.params.logprobs)
                extra = requested_logprobs(rows_lp, [req.params.logprob_token_ids] * len(tokens))
                result.logprobs[req.request_id] = [with_requested(e, x) for e, x in zip(entries, extra)]

    @staticmethod
    def _prompt_logprobs(s: ScheduledRequest, logits: torch.Tensor, result: RunnerOutput) -> None:
        """Logprobs of prompt tokens start+1 .. predicted inside this chunk (position p predicts p+1)."""
        req = s.request
        entries: list[PositionLogprobs | None] = [None] if s.start == 0 else []
        n = logits.shape[0]
        if n:
            targets = req.prompt_token_ids[s.start + 1:s.start + 1 + n]
            entries += logprobs_of(logits, targets, req.params.prompt_logprobs)
        result.prompt_logprobs[req.request_id] = entries
