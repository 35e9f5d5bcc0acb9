"""Parameter accounting: total and per-token active parameters with a breakdown, on the meta device.

Categories: embeddings (embed_tokens), lm_head, attention (MLA), indexer, dense FFN, shared experts,
routed experts, router (gate weight + correction bias), norms, block-position embedding, and the MTP
layer (everything under model.layers.{>= num_hidden_layers}, except nothing: it is counted apart).
"Active" counts what one token touches in the main model: all dense parts plus `num_experts_per_tok`
routed experts per MoE layer; "active non-embedding" leaves out embed_tokens and lm_head.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

from .config import ModelConfig
from .model import GLM5ForCausalLM

CATEGORIES = ("embeddings", "lm_head", "attention", "indexer", "dense_ffn", "shared_experts", "routed_experts",
              "router", "norms", "block_positions")


def _category(name: str) -> str:
    if name.startswith("model.embed_tokens"):
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if "block_position_embeddings" in name:
        return "block_positions"
    if ".indexer." in name:
        return "indexer"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_ffn"
    return "norms"  # layer norms, final norm, MTP enorm/hnorm/eh_proj land in their own bucket below


def count_parameters(cfg: ModelConfig) -> dict:
    """Build `cfg` on the meta device (no memory) and count. Returns a dict of totals and breakdowns."""
    with torch.device("meta"):
        model = GLM5ForCausalLM(cfg)
    named = dict(model.named_parameters())
    named.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    main, mtp = defaultdict(int), defaultdict(int)
    mtp_layers = set(range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers))
    for name, p in named.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        bucket = mtp if (m and int(m.group(1)) in mtp_layers) else main
        bucket[_category(name)] += p.numel()
    total = sum(main.values())
    n_moe = len(cfg.moe_layers)
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    inactive = n_moe * (cfg.n_routed_experts - cfg.num_experts_per_tok) * per_expert
    bias = n_moe * cfg.n_routed_experts  # a buffer used only for selection: not compute
    active = total - inactive - bias
    if cfg.moe_type == "soft":
        active = total - bias
    active_non_emb = active - main["embeddings"] - main["lm_head"]
    return {
        "total": total,
        "total_with_mtp": total + sum(mtp.values()),
        "mtp": sum(mtp.values()),
        "active": active,
        "active_non_embedding": active_non_emb,
        "active_with_lm_head": active_non_emb + main["lm_head"],
        "breakdown": {k: main[k] for k in CATEGORIES if main[k]},
        "mtp_breakdown": {k: v for k, v in mtp.items() if v},
    }


def format_count(n: int) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def report(cfg: ModelConfig, name: str = "") -> str:
    c = count_parameters(cfg)
    lines = [f"model {name or cfg.model_type}: {cfg.num_hidden_layers} layers "
             f"({len(cfg.moe_layers)} MoE), hidden {cfg.hidden_size}, {cfg.n_routed_experts} routed experts "
             f"top-{cfg.num_experts_per_tok} + {cfg.n_shared_experts} shared, vocab {cfg.vocab_size}",
             f"  total parameters (no MTP)      {c['total']:>20,}  ({format_count(c['total'])})",
             f"  total with MTP layer(s)        {c['total_with_mtp']:>20,}  ({format_count(c['total_with_mtp'])})",
             f"  active per token               {c['active']:>20,}  ({format_count(c['active'])})",
             f"  active, non-embedding          {c['active_non_embedding']:>20,}  "
             f"({format_count(c['active_non_embedding'])})",
             f"  active, non-embedding + head   {c['active_with_lm_head']:>20,}  "
             f"({format_count(c['active_with_lm_head'])})",
             "  breakdown (main model):"]
    for k, v in c["breakdown"].items():
        lines.append(f"    {k:<16} {v:>20,}  ({100 * v / c['total']:5.2f}%)")
    if c["mtp"]:
        lines.append(f"    {'mtp':<16} {c['mtp']:>20,}  (extra: not in the total)")
    return "\n".join(lines)
