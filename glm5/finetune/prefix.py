"""Prefix tuning for MLA: P trainable *latent cache entries* per decoder layer.

Where the prefix lives: an MLA layer caches, per token, the normalised latent c_kv [R], the rotated
shared rope key [rope] and (full-indexer layers) the DSA indexer key [D]; attention reads keys and
values only through these. A prefix is therefore exactly P such entries per layer, with no projection
in between: the cheapest parameterisation (P * (R + rope + D) numbers per layer, versus P * H *
(qk + v) for per-head K/V), identical to a P-token prompt whose cache was edited, and servable by
writing the entries into the first P cache slots, where the engine's prefix cache can share them
between requests. Real tokens sit at positions P, P+1, ... (as after a P-token prompt), since the rope
key of a prefix entry is a free vector whose rotation fixes its position once trained.

`PrefixMLAttention` is the converter: each layer's `MLAttention` gets this subclass (the class swap
torch's parametrize also uses) whose `project_kv` and indexer keys prepend the prefix and whose mask
puts the queries after it; the attention math is the base class's. Rows must not be packed (every row
sees the prefix from its first token). Files: `adapter_config.json` (`peft_type: GLM5_MLA_PREFIX`) +
`adapter_model.safetensors` (`prefix.layers.{i}.latent` [P, R], `.rope_key` [P, rope], `.index_key`
[P, D]); PEFT's PREFIX_TUNING stores per-head K/V for standard attention and cannot express MLA latents
or DSA indexer keys (see docs/finetune.md).

Dims: P virtual tokens, R kv_lora_rank, D indexer head dim, B batch, T tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from glm5.core.io import atomic_dir
from glm5.model import peft_adapter
from glm5.model.attention import MLAttention
from glm5.model.indexer import Indexer
from glm5.model.masks import MaskSpec



class LatentPrefix(nn.Module):
    """One layer's prefix latents and rope keys, stored as the cache stores them (unit-RMS random init)."""

    def __init__(self, num_tokens: int, kv_rank: int, rope_dim: int, device=None, dtype=None):
        super().__init__()
        self.latent = nn.Parameter(torch.randn(num_tokens, kv_rank, device=device, dtype=dtype))
        self.rope_key = nn.Parameter(torch.randn(num_tokens, rope_dim, device=device, dtype=dtype))


class PrefixIndexer(Indexer):
    """Indexer whose keys start with the layer's prefix indexer keys `prefix_key` [P, D] (fp32)."""

    prefix_key: nn.Parameter

    def project_k(self, x, cos, sin):
        k = super().project_k(x, cos, sin)  # [B, T, D]
        return torch.cat([self.prefix_key.to(k.dtype)[None].expand(x.shape[0], -1, -1), k], dim=1)


class PrefixMLAttention(MLAttention):
    """MLAttention whose keys start with the layer's `prefix` entries (see the module docstring)."""

    prefix: LatentPrefix

    def project_kv(self, x, cos, sin):
        c_kv, k_rope = super().project_kv(x, cos, sin)  # [B, T, R], [B, T, rope]
        B = x.shape[0]
        lat = self.prefix.latent.to(c_kv.dtype)[None].expand(B, -1, -1)  # [B, P, R]
        rope = self.prefix.rope_key.to(k_rope.dtype)[None].expand(B, -1, -1)  # [B, P, rope]
        return torch.cat([lat, c_kv], dim=1), torch.cat([rope, k_rope], dim=1)

    def forward(self, x, cos, sin, ctx, prev_sel=None):
        if isinstance(ctx, MaskSpec):
            if ctx.segment_ids is not None or ctx.attention_mask is not None:
                raise ValueError("prefix tuning needs unpacked causal rows (no segment_ids / attention_mask)")
            ctx = dataclasses.replace(ctx, q_offset=ctx.q_offset + self.prefix.latent.shape[0])
        return super().forward(x, cos, sin, ctx, prev_sel)


def _attentions(model: nn.Module) -> list[MLAttention]:
    return [layer.self_attn for layer in model.model.main_layers]


def apply_prefix(model: nn.Module, num_tokens: int, freeze: bool = True) -> nn.Module:
    """Give every decoder layer (MTP excluded) a trainable prefix of `num_tokens` entries (in place)."""
    if has_prefix(model):
        raise ValueError("the model already has a prefix")
    _require_mla(model)
    if freeze:
        model.requires_grad_(False)
    cfg = model.config
    for attn in _attentions(model):
        w = attn.kv_a_proj_with_mqa.weight
        attn.__class__ = PrefixMLAttention
        attn.prefix = LatentPrefix(num_tokens, cfg.kv_lora_rank, cfg.qk_rope_head_dim, w.device, w.dtype)
        if attn.indexer is not None:
            attn.indexer.__class__ = PrefixIndexer
            attn.indexer.prefix_key = nn.Parameter(torch.randn(num_tokens, cfg.index_head_dim, device=w.device))
    return model


def has_prefix(model: nn.Module) -> bool:
    return any(isinstance(a, PrefixMLAttention) for a in _attentions(model))


def remove_prefix(model: nn.Module) -> nn.Module:
    for attn in _attentions(model):
        if not isinstance(attn, PrefixMLAttention):  # (GQA layers never have one)
            continue
        del attn.prefix
        attn.__class__ = MLAttention
        if isinstance(attn.indexer, PrefixIndexer):
            del attn.indexer.prefix_key
            attn.indexer.__class__ = Indexer
    return model


def _require_mla(model: nn.Module) -> None:
    if model.config.attention_kind == "gqa":
        raise ValueError(f"a latent prefix lives in MLA's latent cache; model_type {model.config.model_type!r} has "
                         "grouped-query attention (use LoRA)")


def _set_classes(model: nn.Module, attn_cls: type, indexer_cls: type) -> None:
    _require_mla(model)
    for attn in _attentions(model):
        attn.__class__ = attn_cls
        if attn.indexer is not None:
            attn.indexer.__class__ = indexer_cls


def _prefix_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """File key -> parameter: `prefix.layers.{i}.latent|rope_key|index_key`."""
    out = {}
    for i, attn in enumerate(_attentions(model)):
        out[f"prefix.layers.{i}.latent"] = attn.prefix.latent
        out[f"prefix.layers.{i}.rope_key"] = attn.prefix.rope_key
        if attn.indexer is not None:
            out[f"prefix.layers.{i}.index_key"] = attn.indexer.prefix_key
    return out


@torch.no_grad()
def init_from_tokens(model: nn.Module, ids: torch.Tensor) -> None:
    """Set every layer's prefix to the cache entries the model computes for `ids` [P] at positions
    0..P-1 (the prefix then starts out equal to that real prompt)."""
    P = ids.numel()
    captured: dict[int, tuple] = {}

    def keep_inputs(i):
        def hook(module, args):  # must return None: a returned value would replace the arguments
            captured[i] = args[:3]  # (x, cos, sin) of this layer's attention
        return hook

    params = _prefix_params(model)
    P_model = next(iter(params.values())).shape[0]
    if P != P_model:
        raise ValueError(f"init_from_tokens got {P} ids for a prefix of {P_model} entries")
    hooks = [attn.register_forward_pre_hook(keep_inputs(i)) for i, attn in enumerate(_attentions(model))]
    try:  # the plain classes (prefix parameters stay attached, unused) compute the prompt's cache entries
        _set_classes(model, MLAttention, Indexer)
        model(ids.reshape(1, P))
    finally:
        _set_classes(model, PrefixMLAttention, PrefixIndexer)
        for h in hooks:
            h.remove()
    for i, attn in enumerate(_attentions(model)):
        x, cos, sin = captured[i]
        c_kv, k_rope = MLAttention.project_kv(attn, x, cos, sin)
        params[f"prefix.layers.{i}.latent"].copy_(c_kv[0])
        params[f"prefix.layers.{i}.rope_key"].copy_(k_rope[0])
        if attn.indexer is not None:
            params[f"prefix.layers.{i}.index_key"].copy_(Indexer.project_k(attn.indexer, x, cos, sin)[0])


# --- files (format: glm5/model/peft_adapter.py) -------------------------------------------------------
def prefix_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().cpu().contiguous() for k, p in _prefix_params(model).items()}


def write_prefix(model: nn.Module, directory: str | Path, base_model_name_or_path: str = "") -> None:
    P = _attentions(model)[0].prefix.latent.shape[0]
    peft_adapter.write_prefix_files(directory, peft_adapter.prefix_config(model.config, P, base_model_name_or_path),
                                    prefix_tensors(model))


def save_prefix(model: nn.Module, path: str | Path, base_model_name_or_path: str = "") -> Path:
    path = Path(path)
    with atomic_dir(path) as tmp:
        write_prefix(model, tmp, base_model_name_or_path)
    return path


@torch.no_grad()
def load_prefix(model: nn.Module, path: str | Path, apply: bool = True) -> int:
    """Apply (or, with `apply=False`, refill the existing) prefix from `path`; every tensor is checked
    before the model is touched. Returns the number of virtual tokens."""
    P, tensors = peft_adapter.read_prefix(model.config, path)
    if apply:
        apply_prefix(model, P)
    params = _prefix_params(model)
    for key, t in tensors.items():
        params[key].copy_(t.to(params[key].dtype))
    return P
