"""The engine's fast paths against their plain references on tiny configs: grouped experts vs the
per-expert loop, the blocked dense latent kernel vs one block, and a mixed paged step (first prefill
chunks on expanded K/V, a continued chunk, decode rows of different lengths on the absorbed kernel)
vs the model's training forward of each whole sequence."""

import torch

from glm5.infer.input_batch import SeqChunk, build_metadata
from glm5.model.kv_cache import LatentKVCache
from glm5.model.latent_attention import dense_latent_attention
from glm5.model.moe import MoE, expert_loop, swiglu

from ._tiny import reference_experts, tiny_config, tiny_model


def test_grouped_experts_equal_per_expert_loop_with_dropped_assignments():
    torch.manual_seed(0)
    m = MoE(tiny_config(n_routed_experts=8, num_experts_per_tok=2))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1, generator=g)
        gu, dn = m.experts.gate_up_proj, m.experts.down_proj
        for n in (1, 5, 33):
            x = torch.randn(n, 64, generator=g)
            _, _, w, idx = m.gate(x)
            for keep in (None, torch.rand(n, 2, generator=g) > 0.3):
                ref = expert_loop(x, idx, w, keep, 8, lambda e, xs: swiglu(xs, gu[e], dn[e]))
                got = m.experts(x, idx, w, keep)  # no autograd, CPU: the grouped path
                assert torch.allclose(got, ref, atol=1e-6), (n, keep is None)
            assert torch.allclose(m.experts(x, idx, w), reference_experts(gu, dn, x, idx, w), atol=1e-6)


def test_blocked_dense_latent_attention_equals_one_block():
    """Ragged key counts (longest first), several blocks, and one query row per sequence or two."""
    g = torch.Generator().manual_seed(0)
    H, W, R = 3, 12, 8
    for T in (1, 2):
        qq, latent, key_slots, allowed, bias, lens = ragged_latent_case(g, T, H, W)
        # the plain formula: every padded key of each sequence, softmax(q k^T * scale) over the allowed ones
        lat = latent[key_slots]  # [B, S, W]
        sc = torch.einsum("bthw,bsw->bths", qq, lat) * 0.3
        sc = sc.masked_fill(~allowed[:, :, None, :], float("-inf"))
        ref = torch.einsum("bths,bsr->bthr", sc.softmax(-1), lat[..., :R])
        for block_bytes in (1, 2 * 9 * W * 4, 10**9):
            got = dense_latent_attention(qq, latent, key_slots, bias, R, 0.3, lens, block_bytes=block_bytes)
            assert torch.allclose(got, ref, atol=1e-6), (T, block_bytes)


def ragged_latent_case(g: torch.Generator, T: int, H: int, W: int):
    """5 sequences of 11, 9, 6, 6, 2 keys (longest first) at random rows of a 64-row latent table, T query
    rows each (causal: the last row sees every key) -> (qq, latent, key_slots, allowed, bias, lens)."""
    B, S, lens = 5, 11, [11, 9, 6, 6, 2]
    latent = torch.randn(64, W, generator=g)
    key_slots = torch.randperm(64, generator=g)[: B * S].view(B, S)
    qq = torch.randn(B, T, H, W, generator=g)
    allowed = torch.arange(S)[None, None, :] < torch.tensor(lens)[:, None, None] - torch.arange(T)[None, :, None]
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    return qq, latent, key_slots, allowed, bias, lens


def test_mixed_paged_steps_equal_training_forward():
    model = tiny_model(seed=3)
    gen = torch.Generator().manual_seed(0)
    seqs = {k: torch.randint(2, 512, (n,), generator=gen).tolist() for k, n in (("a", 13), ("b", 10), ("c", 20))}
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9, 10, 11]}
    with torch.no_grad():
        ref = {k: model(torch.tensor([ids])).logits[0] for k, ids in seqs.items()}
    cache = LatentKVCache(model.config, num_blocks=12, block_size=4)
    # (key, start, end) per chunk, one step per list: first chunks (expanded, causal), then a continued
    # chunk of c next to decode rows of a and b, then decode rows of all three (absorbed, ragged lengths)
    steps = [[("a", 0, 11), ("b", 0, 9), ("c", 0, 10)],
             [("a", 11, 12), ("c", 10, 19), ("b", 9, 10)],
             [("b", 10, 10), ("a", 12, 13), ("c", 19, 20)]]
    got = {k: [] for k in seqs}
    attn = model.model.layers[0].self_attn
    kinds = set()
    with torch.inference_mode():
        for step in steps:
            chunks = [SeqChunk(k, a, seqs[k][a:b], blocks[k]) for k, a, b in step if b > a]
            flat, meta = build_metadata(chunks, 4, "cpu")
            kinds |= {attn._expands(g, None) for g in meta.groups}
            logits = model(flat[None], attn_metadata=meta, kv_cache=cache).logits[0]
            n = 0
            for c in chunks:
                got[c.key].append(logits[n:n + len(c.token_ids)])
                n += len(c.token_ids)
    assert kinds == {True, False}  # both kernels ran
    for k in seqs:
        assert torch.allclose(torch.cat(got[k]), ref[k], atol=1e-4), k


def _greedy(engine, prompts, n=6):
    from glm5.infer.sampling import SamplingParams
    for i, p in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=p, params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


def test_transposed_weight_layout_serves_the_same_model():
    """weight_layout="transposed" (the CPU default) re-stores nn.Linear and expert weights [in, out]
    row-major under unchanged shapes and keys: same greedy tokens and logits as the native layout, and
    an expert hot swap writes into the new storage."""
    from glm5.infer.config import EngineConfig
    from glm5.infer.engine import LLMEngine
    from glm5.infer.layout import is_transposed

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (1, 7, 19, 30)]
    opts = dict(device="cpu", block_size=4, num_blocks=64, max_model_len=48)
    native = LLMEngine(EngineConfig(**opts, weight_layout="native"), model=tiny_model(seed=5))
    moved = LLMEngine(EngineConfig(**opts), model=tiny_model(seed=5))
    attn, mlp = moved.model.model.layers[1].self_attn, moved.model.model.layers[1].mlp
    assert is_transposed(attn.q_a_proj.weight) and is_transposed(mlp.experts.gate_up_proj)
    assert is_transposed(moved.model.lm_head.weight) and not is_transposed(attn.kv_b_proj.weight)
    assert not is_transposed(native.model.lm_head.weight)
    ref = native.model.state_dict()
    for k, v in moved.model.state_dict().items():
        assert v.shape == ref[k].shape and torch.equal(v, ref[k]), k
    assert _greedy(moved, prompts) == _greedy(native, prompts)
    update = {(1, 3): {"gate_proj": torch.randn(32, 64, generator=gen), "up_proj": torch.randn(32, 64, generator=gen),
                       "down_proj": torch.randn(64, 32, generator=gen)}}
    native.swap_experts(update)
    moved.swap_experts(update)
    assert is_transposed(mlp.experts.gate_up_proj)
    assert torch.equal(mlp.experts.gate_up_proj[3, :32], update[(1, 3)]["gate_proj"])
    assert _greedy(moved, prompts) == _greedy(native, prompts)


def test_no_indexer_keys_when_no_request_can_outgrow_the_top_k():
    """max_model_len <= index_topk: every key is always attended, so the cache holds no indexer keys and the
    forward skips computing them; a longer max_model_len keeps them. Same greedy tokens either way."""
    from glm5.infer.config import EngineConfig
    from glm5.infer.engine import LLMEngine

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 12, 25)]
    opts = dict(device="cpu", block_size=4, num_blocks=128)
    short = LLMEngine(EngineConfig(**opts, max_model_len=32), model=tiny_model(seed=2, index_topk=32))
    long = LLMEngine(EngineConfig(**opts, max_model_len=96), model=tiny_model(seed=2, index_topk=32))
    assert all(k is None for k in short.runner.cache.index_k)
    assert any(k is not None for k in long.runner.cache.index_k)
    assert _greedy(short, prompts) == _greedy(long, prompts)
    window = LLMEngine(EngineConfig(**opts, max_model_len=32),
                       model=tiny_model(seed=2, index_topk=32, sparse_attention="window"))
    assert any(k is not None for k in window.runner.cache.index_k)  # the window pattern always selects


def test_small_inference_attention_equals_sdpa():
    """At inference on CPU, small score matrices take three batched products instead of SDPA (which pads v
    to q's head dim): the same values, for plain causal, causal after a cached prefix and a GLM-style mask."""
    from glm5.model.masks import MaskSpec
    attn = tiny_model(seed=1).model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    B, T, S, H = 2, 5, 9, attn.n_heads
    q_nope, q_rope = torch.randn(B, T, H, attn.nope, generator=g), torch.randn(B, T, H, attn.rope, generator=g)
    c_kv, k_rope = torch.randn(B, S, attn.kv_rank, generator=g), torch.randn(B, S, attn.rope, generator=g)
    part_a = torch.zeros(B, T, S, dtype=torch.bool)
    part_a[:, :, :4] = True
    part_a |= torch.ones(T, S, dtype=torch.bool).tril(S - T)
    for mask, t in ((MaskSpec(causal=True), S), (MaskSpec(causal=True, q_offset=S - T), T),
                    (MaskSpec(causal=False, attention_mask=part_a), T)):
        args = (q_nope[:, :t], q_rope[:, :t], c_kv, k_rope, mask) if t == T else \
            (torch.randn(B, S, H, attn.nope, generator=g), torch.randn(B, S, H, attn.rope, generator=g), c_kv, k_rope, mask)
        with torch.no_grad():
            fast = attn._dense_heads(*args)
        ref = attn._dense_heads(*args)  # grad enabled: the SDPA path
        assert torch.allclose(fast, ref, atol=1e-5), mask


def test_decode_rows_in_step_order_are_attended_as_views():
    """One token from each of several sequences, kept in step order (the native kernel trims keys per
    sequence itself): the group's rows are the step's rows (no gather/scatter); sorted by length they are not."""
    chunks = [SeqChunk(k, n - 1, [7], list(range(i * 4, i * 4 + 4))) for i, (k, n) in enumerate((("a", 3), ("b", 9), ("c", 5)))]
    _, plain = build_metadata(chunks, 4, "cpu", sort_by_length=False)
    _, by_len = build_metadata(chunks, 4, "cpu")
    assert plain.groups[0].is_identity and not by_len.groups[0].is_identity
    assert by_len.groups[0].q_index[:, 0].tolist() == [1, 2, 0]
    x = torch.arange(3 * 2).view(3, 2)
    from glm5.model.attention import _place, _rows
    g = plain.groups[0]
    assert torch.equal(_rows(g, x), x[:, None]) and _rows(g, x).data_ptr() == x.data_ptr()
    assert torch.equal(_place(None, g, _rows(g, x), 3), x)
