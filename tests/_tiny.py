"""Tiny random configs shared by model tests (>= 16 indexer heads: no exact-zero ReLU ties in top-k)."""

import torch

from glm5.model.config import ModelConfig
from glm5.model.model import GLM5ForCausalLM

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, index_topk=64,
            index_n_heads=16, index_head_dim=16, first_k_dense_replace=1, num_nextn_predict_layers=0,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, eos_token_id=[1], pad_token_id=0)


def tiny_config(**kw) -> ModelConfig:
    return ModelConfig.from_dict({**BASE, **kw})


def tiny_model(seed: int = 0, bias_std: float = 0.0, **kw) -> GLM5ForCausalLM:
    torch.manual_seed(seed)
    m = GLM5ForCausalLM(tiny_config(**kw)).init_weights(seed)
    if bias_std:
        with torch.no_grad():
            for name, b in m.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0, bias_std)
    return m.eval()


def autograd_expert_loop(xs, gate_up, down, counts) -> torch.Tensor:
    """The experts' reference: autograd through one F.linear pair per expert over its contiguous rows."""
    import torch.nn.functional as F
    outs, lo = [], 0
    for e, n in enumerate(counts.tolist()):
        gate, up = F.linear(xs[lo: lo + n], gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e]))
        lo += n
    return torch.cat(outs)


def reference_experts(gate_up, down, x, idx, weights) -> torch.Tensor:
    """Routed experts as a plain per-expert loop (transformers' formulation), the oracle for the grouped
    paths: gate_up [E, 2I, H] (gate rows first), down [E, H, I], x [N, H], idx/weights [N, A] -> [N, H]."""
    import torch.nn.functional as F
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, tok, y * weights[tok, slot, None].to(y.dtype))
    return out


def reference_moe(moe, x) -> torch.Tensor:
    """A top-k `MoE`'s output (no capacity limit, no expert dropout) with its experts run by `reference_experts`:
    x [B, T, H] -> [B, T, H]."""
    xf = x.reshape(-1, x.shape[-1])
    _, _, weights, idx = moe.gate(xf)
    routed = reference_experts(moe.experts.gate_up_proj, moe.experts.down_proj, xf, idx, weights)
    return routed.to(x.dtype).view(x.shape) + moe.shared_experts(x)
