"""KV cache layout: latent + rope key (+ indexer key on full-indexer layers) per token, sized from a budget."""

import torch

from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.kv_cache import num_blocks_for_budget
from glm5.model.kv_cache import LatentKVCache, bytes_per_token, expanded_bytes_per_token
from glm5.model.config import ModelConfig

from ._tiny import tiny_config, tiny_model


def test_bytes_per_token_latent_vs_expanded():
    cfg = tiny_config(num_hidden_layers=4, index_topk_freq=2, index_skip_topk_offset=1)  # F S F S
    R, P, D, H = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_head_dim, cfg.num_attention_heads
    assert bytes_per_token(cfg) == 4 * (4 * (R + P) + 2 * D)
    assert expanded_bytes_per_token(cfg) == 4 * (4 * H * (cfg.qk_head_dim + cfg.v_head_dim) + 2 * D)
    cache = LatentKVCache(cfg, num_blocks=3, block_size=4)
    assert cache.nbytes == 12 * cache.bytes_per_token()
    assert [t is None for t in cache.index_k] == [False, True, False, True]
    g5 = ModelConfig.from_preset("glm-5")  # 78 layers: (512 + 64) latent + 128 indexer key, bf16
    assert bytes_per_token(g5, torch.bfloat16) == 2 * (78 * 576 + g5.indexer_types.count("full") * 128)
    assert expanded_bytes_per_token(g5, torch.bfloat16) > 40 * bytes_per_token(g5, torch.bfloat16)


def test_cache_sized_from_budget_and_written_by_slot():
    cfg = tiny_config()
    per_block = 8 * bytes_per_token(cfg)
    assert num_blocks_for_budget(cfg, 8, 10 * per_block + 5, torch.float32) == 10
    engine = LLMEngine(EngineConfig(device="cpu", block_size=8, kv_cache_memory=10 * per_block, max_model_len=72),
                       model=tiny_model())
    assert engine.block_manager.num_blocks == 10 and engine.runner.cache.latent[0].shape[0] == 80
    cache = engine.runner.cache
    slots = torch.tensor([3, 17])
    c_kv, k_rope = torch.randn(2, cfg.kv_lora_rank), torch.randn(2, cfg.qk_rope_head_dim)
    ki = torch.randn(2, cfg.index_head_dim)
    cache.write(0, slots, c_kv, k_rope, ki)
    assert torch.equal(cache.gather_latent(0, slots), torch.cat([c_kv, k_rope], -1))
    assert torch.equal(cache.gather_index_k(0, slots), ki)
