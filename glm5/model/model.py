"""The GLM-5 decoder (`GlmMoeDsaForCausalLM`) and its multi-token-prediction (MTP) layer.

Pre-norm blocks: h = x + Attn(RMSNorm(x)); out = h + MLP(RMSNorm(h)), where MLP is a dense SwiGLU for the
first `first_k_dense_replace` layers and the MoE block after. Each layer hands its key selection to the
next so that "shared" (IndexShare) layers reuse the last full indexer's top-k. Module names equal the
HF names, so a state dict maps 1:1 except the fused experts (see hf_adapter.py).

One forward serves training and the engine: given `attn_metadata` + `kv_cache` (paged.py) the same
layers run over the flat tokens of many sequences, writing and reading the paged latent cache.

Dims: B batch, T sequence, H hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MLAttention
from .config import ModelConfig
from .gqa_attention import GQAttention
from .generation_config import GenerationConfig
from .layers import RMSNorm, SwiGLU, rope_angles
from .kv_cache import LatentKVCache
from .masks import MaskSpec
from .moe import MoE
from .paged import AttnMetadata, PagedContext


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    hidden_states: torch.Tensor  # [B, T, H] after the final norm
    mtp_logits: torch.Tensor | None = None  # [B, T, V]: position t predicts token t+2
    mtp_hidden_states: torch.Tensor | None = None  # [B, T, H]: the first MTP layer's normed output (its head input)
    router_stats: list[dict] = field(default_factory=list)  # one dict per MoE layer (see moe.MoE)
    selections: list = field(default_factory=list)  # per layer (idx, valid) or None (dense)

    def __getitem__(self, i):  # tuple-style access: out[0] is the logits
        return (self.logits, self.hidden_states, self.mtp_logits)[i]


def build_attention(cfg: ModelConfig, layer_idx: int, has_indexer: bool) -> MLAttention | GQAttention:
    """The one layer that differs across the family: MLA with the DSA indexer (`glm_moe_dsa`), MLA alone
    (`glm4_moe_lite`), or grouped-query attention (`glm4_moe`)."""
    if cfg.attention_kind == "gqa":
        return GQAttention(cfg, layer_idx)
    return MLAttention(cfg, layer_idx, has_indexer and cfg.attention_kind == "dsa")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, sparse_mlp: bool, has_indexer: bool):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = build_attention(cfg, layer_idx, has_indexer)
        self.mlp = MoE(cfg, layer_idx) if sparse_mlp else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx: MaskSpec | PagedContext, prev_sel=None):
        """-> (hidden [B, T, H], selection or None, router stats dict or None)."""
        a, sel = self.self_attn(self.input_layernorm(x), cos, sin, ctx, prev_sel)
        out, stats = self.feed_forward(x + a, ctx)
        return out, sel, stats

    def feed_forward(self, h, ctx: MaskSpec | PagedContext) -> tuple[torch.Tensor, dict | None]:
        """The block's second half: h + MLP(RMSNorm(h)) -> (hidden, router stats dict or None)."""
        hn = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            m, stats = self.mlp(hn, ctx if isinstance(ctx, PagedContext) else None)
            return h + m, stats
        return h + self.mlp(hn), None


class SharedHead(nn.Module):
    """The MTP layer's output norm; its `head` is the main lm_head (not stored in GLM-5 checkpoints)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """DeepSeek-V3 MTP block stored at `model.layers.{num_hidden_layers}`:
    z = eh_proj([enorm(embed(token_{t+1})) ; hnorm(h_t)]) -> a full MoE decoder layer -> shared_head.norm
    -> lm_head, predicting token t+2. Embedding and head are tied to the main model's."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx, sparse_mlp=True, has_indexer=True)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward_mtp(self, emb_next, hidden, cos, sin, ctx: MaskSpec | PagedContext):
        """emb_next [B, T, H] (embedding of token t+1), hidden [B, T, H] (main h_t) -> normed [B, T, H]."""
        z = self.eh_proj(torch.cat([self.enorm(emb_next), self.hnorm(hidden)], dim=-1))
        z, _, stats = self.forward(z, cos, sin, ctx, None)
        return self.shared_head.norm(z), stats


class GLM5Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers = [DecoderLayer(cfg, i, cfg.mlp_layer_types[i] == "sparse", cfg.indexer_types[i] == "full")
                  for i in range(cfg.num_hidden_layers)]
        layers += [MTPLayer(cfg, cfg.num_hidden_layers + j) for j in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.block_position_embedding:
            n_blocks = cfg.max_block_positions or cfg.max_position_embeddings + 1
            self.block_position_embeddings = nn.Embedding(n_blocks, cfg.hidden_size)
        self.register_buffer("inv_freq", cfg.rope_inv_freq(), persistent=False)

    @property
    def main_layers(self) -> list[nn.Module]:
        # a list, not `self.layers[:n]`: slicing a ModuleList builds a new container (~70 us per forward)
        return list(self.layers)[: self.cfg.num_hidden_layers]

    @property
    def mtp_layers(self) -> list[nn.Module]:
        return list(self.layers)[self.cfg.num_hidden_layers:]


class GLM5ForCausalLM(nn.Module):
    """`model(input_ids)` -> ModelOutput(.logits [B, T, V], ...). Pure math: no I/O, no process groups."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = GLM5Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False
        self.generation_config = GenerationConfig.from_model_config(cfg)  # checkpoints replace it with theirs

    # --- HF conventions: the file formats live in hf_adapter.py (imported on use: it imports this) ------
    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device="cpu", strict: bool = True
                        ) -> "GLM5ForCausalLM":
        """Load an HF-format checkpoint directory (see `glm5.model.hf_adapter.from_pretrained`)."""
        from .hf_adapter import from_pretrained  # noqa: PLC0415
        return from_pretrained(path, dtype=dtype, device=device, strict=strict, model_cls=cls)

    def save_pretrained(self, path, max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None) -> None:
        """Write config.json, generation_config.json and sharded safetensors (transformers' layout)."""
        from .hf_adapter import save_pretrained  # noqa: PLC0415
        save_pretrained(self, path, max_shard_size=max_shard_size, dtype=dtype)

    # --- init -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> "GLM5ForCausalLM":
        """normal(0, initializer_range) for every matrix and expert, ones for norms, zeros for biases."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.fill_(1.0)
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        self.model.inv_freq.copy_(self.config.rope_inv_freq())
        return self

    # --- forward --------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                block_position_ids: torch.Tensor | None = None, return_mtp: bool = False,
                mtp_input_ids: torch.Tensor | None = None, logits_to_keep: int = 0,
                attn_metadata: AttnMetadata | None = None, kv_cache: LatentKVCache | None = None) -> ModelOutput:
        """input_ids [B, T]; position_ids [B, T] (default arange); segment_ids [B, T] (packed documents);
        attention_mask [B, T, T] bool (True = may attend; replaces causal order, e.g. blank infilling) or
        [B, T] 0/1 padding mask; block_position_ids [B, T] (GLM 2D positions; with a block-position table,
        absent ids mean 0, so causal text, Part A and the engine all see the same embedding). With
        return_mtp, also MTP logits where position t predicts token t+2 from h_t and token t+1
        (`mtp_input_ids`, default input_ids shifted left by one) and the hidden states they come from.
        `logits_to_keep` N > 0: logits (main and MTP) of the last N positions only; hidden states stay
        whole (a fused loss takes them with the head's weight). Losses live in glm5.train, not here.

        Paged (the engine): input_ids [1, N] are the flat tokens described by `attn_metadata`, whose KV rows
        are written into `kv_cache` and attended there; positions and block positions default to the
        metadata's; logits only at `attn_metadata.logits_indices` ([1, M, V]); no MTP (see forward_mtp)."""
        cfg = self.config
        if attn_metadata is not None:
            ctx = self._paged_context(input_ids, attn_metadata, kv_cache, segment_ids, attention_mask, return_mtp)
            position_ids = attn_metadata.positions[None] if position_ids is None else position_ids
            if block_position_ids is None and attn_metadata.block_position_ids is not None:
                block_position_ids = attn_metadata.block_position_ids[None]
        B, T = input_ids.shape
        x = self.model.embed_tokens(input_ids)
        if block_position_ids is not None and not cfg.block_position_embedding:
            raise ValueError("block_position_ids given but the config has block_position_embedding = false")
        if cfg.block_position_embedding:  # one rule everywhere: absent ids mean block position 0
            if block_position_ids is None:
                block_position_ids = torch.zeros_like(input_ids)
            x = x + self.model.block_position_embeddings(block_position_ids)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, -1)
        cos, sin = rope_angles(position_ids, self.model.inv_freq)  # [B, T, P/2]
        if attn_metadata is None:
            ctx = self._mask(attention_mask, segment_ids, B, T)
        h, stats, sels = self._run_layers(x, cos, sin, ctx)
        h = self.model.norm(h)
        if attn_metadata is not None and attn_metadata.logits_indices is not None:
            hk = h[:, attn_metadata.logits_indices]  # [1, M, H]
        else:
            hk = h[:, -logits_to_keep:] if logits_to_keep else h
        out = ModelOutput(logits=self.lm_head(hk), hidden_states=h, router_stats=stats, selections=sels)
        if return_mtp and len(self.model.mtp_layers):
            out.mtp_logits, out.mtp_hidden_states, mstats = self._mtp(input_ids, mtp_input_ids, h, cos, sin, ctx,
                                                                      logits_to_keep=logits_to_keep)
            out.router_stats = stats + mstats
        return out

    def forward_mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttnMetadata,
                    kv_cache: LatentKVCache, depth: int = 0) -> ModelOutput:
        """One MTP layer over paged flat tokens (speculative drafting): next_ids [1, N] is token t+1 at each
        position t and hidden [1, N, H] the main model's final-norm h_t (or the previous depth's output).
        -> .hidden_states [1, N, H] (the layer's normed output), .logits at the metadata's logits_indices."""
        layer = self.model.mtp_layers[depth]
        ctx = PagedContext(attn_metadata, kv_cache)
        cos, sin = rope_angles(attn_metadata.positions[None], self.model.inv_freq)
        z, stats = layer.forward_mtp(self.model.embed_tokens(next_ids), hidden, cos, sin, ctx)
        stats["layer"] = layer.layer_idx
        rows = attn_metadata.logits_indices
        return ModelOutput(logits=self.lm_head(z if rows is None else z[:, rows]), hidden_states=z,
                           router_stats=[stats])

    @staticmethod
    def _paged_context(input_ids, meta: AttnMetadata, kv_cache, segment_ids, attention_mask, return_mtp):
        if kv_cache is None:
            raise ValueError("attn_metadata needs a kv_cache: the paged forward writes and reads it")
        if segment_ids is not None or attention_mask is not None or return_mtp:
            raise ValueError("with attn_metadata, masks come from the metadata and MTP runs via forward_mtp")
        if input_ids.shape != (1, meta.num_tokens):
            raise ValueError(f"paged input_ids must be [1, {meta.num_tokens}] (flat tokens), got "
                             f"{list(input_ids.shape)}")
        return PagedContext(meta, kv_cache)

    @staticmethod
    def _mask(attention_mask, segment_ids, B, T) -> MaskSpec:
        if attention_mask is None:
            return MaskSpec(causal=True, segment_ids=segment_ids)
        if attention_mask.dim() == 2:  # HF-style padding mask [B, T]: 1 = real token
            # a padding query also sees itself: its row stays finite (its output is ignored) instead of a
            # softmax over no key, whose NaN would reach every later layer through its key and value
            keep = attention_mask.bool()[:, None, :] | torch.eye(T, dtype=torch.bool, device=attention_mask.device)
            return MaskSpec(causal=True, segment_ids=segment_ids, attention_mask=keep)
        return MaskSpec(causal=False, segment_ids=segment_ids, attention_mask=attention_mask.bool())

    def _run_layers(self, x, cos, sin, ctx: MaskSpec | PagedContext, layers=None):
        """The main decoder layers (or `layers`: a pipeline stage's share of them) -> (x, stats, sels)."""
        stats, sels, sel = [], [], None
        for layer in self.model.main_layers if layers is None else layers:
            if self.gradient_checkpointing and self.training:
                x, sel, st = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, ctx, sel, use_reentrant=False)
            else:
                x, sel, st = layer(x, cos, sin, ctx, sel)
            sels.append(sel)
            if st is not None:
                st["layer"] = layer.layer_idx
                stats.append(st)
        return x, stats, sels

    def _mtp(self, input_ids, mtp_input_ids, h, cos, sin, mask, layers=None, logits_to_keep: int = 0):
        """Depth-j MTP layer sees tokens shifted left by j+1 and the previous depth's states; returns the
        first depth's (logits, normed hidden states, router stats) (GLM-5 has one MTP layer); logits of the
        last `logits_to_keep` positions only when > 0. `layers`: the MTP layers (default: the model's)."""
        logits, hidden, stats, z = None, None, [], h
        for j, layer in enumerate(self.model.mtp_layers if layers is None else layers):
            if mtp_input_ids is None or j > 0:
                src = input_ids if mtp_input_ids is None else mtp_input_ids
                shift = j + 1 if mtp_input_ids is None else 1
                ids = F.pad(src[:, shift:], (0, shift), value=0)
            else:
                ids = mtp_input_ids
            emb = self.model.embed_tokens(ids)
            if mtp_input_ids is None:  # no token t+1 past the end: zero embedding there
                tail = torch.arange(emb.shape[1], device=emb.device) >= emb.shape[1] - (j + 1)
                emb = emb.masked_fill(tail[None, :, None], 0.0)
            z, st = layer.forward_mtp(emb, z, cos, sin, mask)
            st["layer"] = layer.layer_idx
            stats.append(st)
            if logits is None:
                hidden = z
                logits = self.lm_head(z[:, -logits_to_keep:] if logits_to_keep else z)
        return logits, hidden, stats

    # --- helpers --------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
        """Naive greedy decoding by full recompute: the oracle for the engine (slow, O(T^2) per token)."""
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        ids = input_ids
        for _ in range(max_new_tokens):
            nxt = self(ids, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if ids.shape[0] == 1 and int(nxt) in eos:
                break
        return ids

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
