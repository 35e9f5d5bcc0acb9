"""`glm5 plan --finetune`: the per-rank bytes of a frozen (int8 / fp8) base and of the LoRA state, against a
hand count from the parameter formulas of GLM5_ARCHITECTURE.md section 3.2 on the `small` preset."""

import pytest

from glm5.cli.main import main
from glm5.finetune.plan import FinetuneLayout, plan_finetune
from glm5.model.config import ModelConfig
from glm5.model.lora import LoraConfig
from glm5.train.plan import ACCELERATORS, Layout, plan


def _hand_count(c: ModelConfig, held) -> tuple[int, float]:
    """(parameters, bytes of the base) with `held(N, K)` the bytes of a linear weight [N, K] held
    quantised; everything else bf16 but the routers and indexer heads (fp32)."""
    H, V, rq, rkv, nh = c.hidden_size, c.vocab_size, c.q_lora_rank, c.kv_lora_rank, c.num_attention_heads
    dn, dr, dv, ni, di = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.index_n_heads, c.index_head_dim
    I, Ie, E, S = c.intermediate_size, c.moe_intermediate_size, c.n_routed_experts, c.n_shared_experts
    mla_mats = [(rq, H), (nh * (dn + dr), rq), (rkv + dr, H), (nh * (dn + dv), rkv), (H, nh * dv)]
    idx_mats = [(ni * di, rq), (di, H)]
    mla = sum(n * k for n, k in mla_mats) + rq + rkv  # section 3.2's MLA (q_a / kv_a norms)
    idx = sum(n * k for n, k in idx_mats) + 2 * di + H * ni
    dense, expert = 3 * H * I, 3 * H * Ie
    moe = (E + S) * expert + E * H  # (the bias is a buffer)
    mla_b = sum(held(n, k) for n, k in mla_mats) + 2 * (rq + rkv)
    idx_b = sum(held(n, k) for n, k in idx_mats) + 2 * 2 * di + 4 * H * ni
    dense_b = 2 * held(I, H) + held(H, I)
    # routed gate and up are two tensors on disk (fused in memory, each keeps its own fp8 tiles)
    moe_b = E * (2 * held(Ie, H) + held(H, Ie)) + 2 * held(S * Ie, H) + held(H, S * Ie) + 4 * E * H
    n_dense = c.first_k_dense_replace
    n_moe = c.num_hidden_layers - n_dense
    params = n_dense * (mla + idx + dense + 2 * H) + n_moe * (mla + idx + moe + 2 * H) + 2 * V * H + H
    params += (mla + idx + moe + 2 * H) + 2 * H * H + 3 * H  # the MTP layer
    base = n_dense * (mla_b + idx_b + dense_b + 4 * H) + n_moe * (mla_b + idx_b + moe_b + 4 * H) + 4 * V * H + 2 * H
    base += (mla_b + idx_b + moe_b + 4 * H) + held(H, 2 * H) + 2 * 3 * H
    return params, base


@pytest.mark.parametrize("quant", ["none", "int8", "fp8"])
def test_lora_plan_matches_a_hand_count_on_small(quant):
    c = ModelConfig.from_preset("small")
    held = {"none": lambda n, k: 2 * n * k,
            "int8": lambda n, k: n * k + 4 * n,  # + one fp32 scale per output channel
            "fp8": lambda n, k: n * k + 4 * -(-n // 128) * -(-k // 128)}[quant]  # + one per 128 x 128 tile
    lay = Layout(gpus=8, ep=8, seq_len=1024)  # D = dp x ep = 8: every tensor's FSDP shard is 1/8
    ft = FinetuneLayout(method="lora", lora=LoraConfig(r=8, targets=["attn"]), base_quant=quant)
    p = plan_finetune(c, lay, ACCELERATORS["H200"], ft)
    params, base = _hand_count(c, held)
    assert p.params_total == params
    b = p.memory_bytes
    assert b[f"base weights (frozen shard, {'16-bit' if quant == 'none' else quant + ' + scales'})"] == \
        pytest.approx(base / 8, rel=1e-9)
    H, rq, rkv = c.hidden_size, c.q_lora_rank, c.kv_lora_rank
    nh, dn, dr, dv = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    lora = 8 * ((H + rq) + (rq + nh * (dn + dr)) + (H + rkv + dr) + (rkv + nh * (dn + dv)) + (nh * dv + H))
    assert p.adapter_params == c.num_hidden_layers * lora  # r (in + out) per matrix, MTP layer excluded
    shard = c.num_hidden_layers * lora / 8
    assert b["adapter parameters (fp32 shard)"] == pytest.approx(4 * shard)
    assert b["adapter gradients (fp32 shard)"] == pytest.approx(4 * shard)
    assert b["optimizer states (AdamW m, v)"] == pytest.approx(8 * shard)
    # the largest module dequantised at once: one layer's routed gate_up, 1/ep of it, bf16
    one = 2 * c.n_routed_experts // 8 * 2 * c.moe_intermediate_size * H if quant != "none" else 0
    assert b["dequantised weights (one module, forward)"] == pytest.approx(one)


def test_full_finetune_is_the_pretraining_plan_without_mtp():
    c = ModelConfig.from_preset("small")
    lay = Layout(gpus=8, ep=8, seq_len=1024)
    p = plan_finetune(c, lay, ACCELERATORS["H200"], FinetuneLayout(method="full"))
    assert p.memory_gb == plan(c, Layout(gpus=8, ep=8, seq_len=1024, mtp=False), ACCELERATORS["H200"]).memory_gb


def test_plan_cli_finetune(capsys):
    args = ["plan", "--preset", "small", "--gpus", "8", "--ep", "8", "--accelerator", "H200"]
    assert main([*args, "--finetune", "lora", "--lora.r", "8", "--base-quant", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "base fp8" in out and "fp8 + scales" in out and "adapter parameters" in out
    assert main([*args, "--finetune", "prefix", "--base-quant", "int8"]) == 0
    assert "prefix of 16 entries" in capsys.readouterr().out
    assert main([*args, "--base-quant", "fp8"]) == 2
    assert "--base-quant" in capsys.readouterr().err
    assert main([*args, "--finetune", "full", "--base-quant", "int8"]) == 2
    assert "base_quant = 'int8'" in capsys.readouterr().err
