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
