"""Captured decode: the model's own paged forward over static per-bucket buffers, compiled or graph-captured.

A decode step (one new token per sequence) is padded to a bucket: a batch size (1, 2, 4, 8, ... up to
`max_num_seqs`) and a static key bound (256 keys, doubling, up to `max_model_len` + draft tokens; the
smallest that holds the step's longest context). Padding rows are token 0 at position 0 writing its KV row
to a scratch block the block manager never hands out, and attending only that row. Each bucket owns
persistent input buffers (`DecodeBuffers`: token ids, positions, slot mapping, block table, context
lengths), allocated once and filled in place each step. `decode_step` derives the attention group's
tensors (key slots, masks) from them with tensor ops, and runs `model(ids, attn_metadata=...,
kv_cache=...)` with `AttnMetadata.static_shapes` set: keys padded to the bucket's bound and masked, no
per-step Python lists of lengths, no host syncs, so the same call can be traced whole by
`torch.compile(fullgraph=True)` or recorded into a `torch.cuda.CUDAGraph` and replayed.

`DecodeGraphs` (owned by the runner) holds one compiled callable or CUDA graph per bucket, built on
first use; a build failure (a graph break, a missing compiler) switches it off with one warning and the
engine runs eagerly. Steps it does not cover run eagerly too: prefill and mixed chunks, MTP speculation,
LoRA rows, GLM 2D positions, steps while an expert hot swap holds an old version, and batches past the largest bucket.

Dims: B bucket size (rows), W block-table width, S keys (the static bound), V vocab, A experts per token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from glm5.model.kv_cache import LatentKVCache
from glm5.model.model import GLM5ForCausalLM
from glm5.model.moe import Experts, MoE, expert_counts
from glm5.model.paged import AttnGroup, AttnMetadata

from .input_batch import SeqChunk

log = logging.getLogger(__name__)

CompileMode = Literal["inductor", "cuda_graphs"]  # EngineConfig.compile_decode when it is not "none"


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below `max_num_seqs`, then `max_num_seqs` itself: [1, 2, 4, ..., max_num_seqs]."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


@dataclass
class DecodeBuffers:
    """One bucket's persistent step inputs (device tensors, filled in place; never reallocated)."""

    input_ids: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long: RoPE position = sequence index of the new token
    slot_mapping: torch.Tensor  # [B] long: cache slot its KV row goes to
    block_table: torch.Tensor  # [B, W] long: the sequence's blocks (padding: block 0; dummy rows: scratch)
    context_lens: torch.Tensor  # [B] long: keys of the sequence, the new token included (dummy rows: 1)

    @classmethod
    def allocate(cls, rows: int, width: int, device: torch.device) -> "DecodeBuffers":
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(rows), z(rows), z(rows), z(rows, width), z(rows))

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    def fill(self, chunks: list[SeqChunk], block_size: int, scratch_block: int) -> None:
        """Write a step of single-token chunks (at most `rows`) into the buffers; the rest are dummy rows.
        One host tensor per step, one copy into the device buffers."""
        B, W = self.block_table.shape
        pad = B - len(chunks)
        dummy = [0, 0, scratch_block * block_size, 1] + [scratch_block] * W
        host = torch.tensor([[c.token_ids[0], c.start, c.block_ids[c.start // block_size] * block_size
                              + c.start % block_size, c.context_len] + c.block_ids[:W] + [0] * (W - len(c.block_ids))
                             for c in chunks] + [dummy] * pad, dtype=torch.long)  # [B, 4 + W]
        for dst, src in zip((self.input_ids, self.positions, self.slot_mapping, self.context_lens),
                            host[:, :4].t()):
            dst.copy_(src, non_blocking=True)
        self.block_table.copy_(host[:, 4:], non_blocking=True)


def decode_step(model: GLM5ForCausalLM, cache: LatentKVCache, buf: DecodeBuffers, num_keys: int,
                block_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's paged forward for a bucket of decode rows -> (logits [B, V], topk_idx [B, A] per MoE layer).

    Every row is one sequence's new token and samples, so the single attention group is the step's rows in
    order (`is_identity`) and logits are taken at every row. Keys are indices 0..num_keys-1 of each
    sequence; those at or past its context length are masked (`key_valid`), so the shapes depend only on
    the bucket."""
    B, dev = buf.rows, buf.input_ids.device
    keys = torch.arange(num_keys, device=dev)  # [S]
    key_slots = buf.block_table[:, keys // block_size] * block_size + keys % block_size  # [B, S]
    key_valid = keys[None, :] < buf.context_lens[:, None]  # [B, S]: also causal (the new token is the last key)
    rows = torch.arange(B, device=dev)[:, None]  # [B, 1] flat index of each query
    group = AttnGroup(q_index=rows, q_valid=torch.ones(B, 1, dtype=torch.bool, device=dev),
                      q_pos=(buf.context_lens - 1)[:, None], key_slots=key_slots, key_valid=key_valid,
                      allowed=key_valid[:, None, :], is_identity=True, out_index=rows[:, 0])
    meta = AttnMetadata(buf.positions, buf.slot_mapping, list(range(B + 1)), [group], static_shapes=True)
    out = model(buf.input_ids[None], attn_metadata=meta, kv_cache=cache)
    return out.logits[0], [st["topk_idx"] for st in out.router_stats]


@dataclass
class _Bucket:
    buffers: DecodeBuffers
    run: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]  # the compiled step, or a graph replay


# The smallest static key bound of a bucket; bounds double from it up to max_model_len (+ drafts), so a
# decode row attends at most twice its context's keys (masked) past this, instead of max_model_len's.
MIN_BUCKET_KEYS = 256


def key_bounds(num_keys: int, block_size: int, min_keys: int = MIN_BUCKET_KEYS) -> list[int]:
    """Static key bounds of the buckets: min_keys (in whole blocks), doubling, then num_keys itself."""
    bounds, k = [], -(-min_keys // block_size) * block_size
    while k < num_keys:
        bounds.append(k)
        k *= 2
    return bounds + [num_keys]


@dataclass
class DecodeGraphs:
    """Compiled / CUDA-graph decode steps per (batch size, key bound) bucket, built on first use (see the
    module doc)."""

    model: GLM5ForCausalLM
    cache: LatentKVCache
    mode: CompileMode  # "inductor" (torch.compile, any device) or "cuda_graphs" (CUDA graph of the eager step)
    buckets: list[int]  # batch sizes
    block_size: int
    num_keys: int  # the largest static key bound (max_model_len + draft tokens)
    scratch_block: int  # a cache block outside the block manager's pool (dummy rows write there)
    backend: str = "inductor"  # torch.compile backend (mode "inductor")
    min_keys: int = MIN_BUCKET_KEYS  # the smallest key bound (see key_bounds)
    compile_seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # (rows, keys) -> build seconds
    num_steps: int = 0  # steps run through a bucket
    disabled: str | None = None  # why the captured path was switched off (a build failure), else None
    key_buckets: list[int] = field(init=False)  # the static key bounds (key_bounds)
    _built: dict[tuple[int, int], _Bucket] = field(default_factory=dict)
    _compiled: Callable | None = None

    def __post_init__(self):
        if self.mode not in ("inductor", "cuda_graphs"):
            raise ValueError(f"compile_decode: unknown mode {self.mode!r}; choose none, inductor or cuda_graphs")
        if self.mode == "cuda_graphs" and self.cache.latent[0].device.type != "cuda":
            raise ValueError("compile_decode='cuda_graphs' needs a CUDA device; on CPU use 'inductor'")
        self.key_buckets = key_bounds(self.num_keys, self.block_size, self.min_keys)
        reason = unsupported(self.model)
        if reason:  # the documented fallback: eager, one warning, the reason in the engine's stats
            self.disabled = reason
            log.warning("compile_decode=%r is off: %s", self.mode, reason)

    def bucket_for(self, chunks: list[SeqChunk]) -> tuple[int, int] | None:
        """(rows, key bound) of the smallest bucket that holds the step, or None."""
        rows = next((b for b in self.buckets if b >= len(chunks)), None)
        need = max(c.context_len for c in chunks)
        keys = next((k for k in self.key_buckets if k >= need), None)
        return None if rows is None or keys is None else (rows, keys)

    def run(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, list[dict]] | None:
        """(logits [n, V], router stats per MoE layer) for a step of single-token decode chunks, or None
        when no bucket takes it (too many rows, or the path is off): the caller then runs it eagerly."""
        key = self.bucket_for(chunks)
        if self.disabled is not None or key is None:
            return None
        bucket = self._built.get(key) or self._build(key, chunks)
        if bucket is None:
            return None
        bucket.buffers.fill(chunks, self.block_size, self.scratch_block)
        try:
            logits, idx = bucket.run()
        except Exception as e:  # noqa: BLE001 (e.g. a recompile past the limit after a module swap)
            return self._off(key, e)  # the eager step rewrites the same cache rows: the writes are idempotent
        self.num_steps += 1
        n = len(chunks)
        stats = [{"layer": layer, "tokens_per_expert": expert_counts(i[:n], self.model.config.n_routed_experts)}
                 for layer, i in zip(self.model.config.moe_layers, idx)]
        return logits[:n], stats

    def _build(self, key: tuple[int, int], chunks: list[SeqChunk]) -> _Bucket | None:
        """Compile (or capture) bucket (rows, keys), running it once on this step's rows; None and off on
        failure."""
        rows, keys = key
        buf = DecodeBuffers.allocate(rows, -(-keys // self.block_size), self.cache.latent[0].device)
        buf.fill(chunks, self.block_size, self.scratch_block)
        t = time.perf_counter()
        try:
            run = self._compile(buf, keys) if self.mode == "inductor" else self._capture(buf, keys)
        except Exception as e:  # noqa: BLE001 (any build failure: the eager forward still serves the step)
            return self._off(key, e)
        self.compile_seconds[key] = time.perf_counter() - t
        log.info("compile_decode=%r: decode bucket of %d rows x %d keys built in %.1f s", self.mode, rows, keys,
                 self.compile_seconds[key])
        self._built[key] = _Bucket(buf, run)
        return self._built[key]

    def _off(self, key: tuple[int, int], error: Exception) -> None:
        """Switch the captured path off for good (one warning); the caller runs the step eagerly."""
        self.disabled = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        log.warning("compile_decode=%r: the decode step of bucket %s (rows, keys) failed (%s); decode runs "
                    "eagerly", self.mode, key, self.disabled)
        return None

    def _compile(self, buf: DecodeBuffers, keys: int) -> Callable:
        if self._compiled is None:
            self._compiled = torch.compile(decode_step, fullgraph=True, dynamic=False, backend=self.backend)
        fn, args = self._compiled, (self.model, self.cache, buf, keys, self.block_size)
        # one dynamo cache entry per bucket, on decode_step's code object: shared by every engine of the
        # process, so the default limit (8) is lifted for this compiling call only
        with torch._dynamo.config.patch(recompile_limit=1024):
            fn(*args)  # compiles (and runs the step)
        return lambda: fn(*args)

    def _capture(self, buf: DecodeBuffers, keys: int) -> Callable:
        """Warm up on a side stream (allocator, lazy init), then record the step; replays reuse `buf`'s
        storage and the graph's own output tensors (read them before the next replay)."""
        args = (self.model, self.cache, buf, keys, self.block_size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            decode_step(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_step(*args)

        def replay():
            graph.replay()
            return out
        return replay

    def stats(self) -> dict:
        return {"decode_compile_mode": self.mode, "decode_compile_s": round(sum(self.compile_seconds.values()), 3),
                "decode_compiled_buckets": [list(k) for k in sorted(self.compile_seconds)],
                "decode_graph_steps": self.num_steps,
                "decode_compile_disabled": self.disabled}


def unsupported(model: GLM5ForCausalLM) -> str | None:
    """Why the model's forward has no capture-safe decode branch, or None: the MoE capacity rule reads
    data-dependent rows, and routed experts must be the plain fused module (its grouped branch)."""
    cfg = model.config
    if cfg.moe_capacity_factor is not None:
        return "the MoE capacity factor keeps data-dependent rows; unset moe_capacity_factor"
    for layer in model.model.main_layers:
        if isinstance(layer.mlp, MoE) and not _plain_experts(layer.mlp):
            return (f"layer {layer.layer_idx}'s routed experts are {type(layer.mlp.experts).__name__} (INT8 or "
                    "offload), which has no static-shape branch; serve without quantization or offload")
    return None


def _plain_experts(moe: MoE) -> bool:
    """The fused experts module, or a subclass keeping its forward's `static_shapes` branch (the engine's
    native module, glm5/infer/kernels.py)."""
    return isinstance(moe.experts, Experts)
