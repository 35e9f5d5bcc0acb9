"""Native CPU kernels (glm5/native) against their PyTorch references, and the engine's `kernels` option:
the routed-expert kernel == the per-expert loop (odd widths that leave vector tails, dropped assignments,
experts with no rows, 1 and 2 threads), bad inputs refused, and an engine on the native kernels serving
the same greedy tokens as one on PyTorch's, hot swap included; without a compiler, `auto` falls back."""

import pytest
import torch

from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.kernels import NativeDecoderLayer, NativeExperts, NativeGQAttention, NativeLinear, NativeMLAttention
from glm5.model.attention import MLAttention
from glm5.model.model import DecoderLayer
from glm5.model.latent_attention import dense_latent_attention
from glm5.model.moe import expert_loop, swiglu
from glm5.native import NativeError, build, load

from ._tiny import tiny_model
from .test_engine_fast_paths import _greedy, ragged_latent_case


@pytest.fixture(scope="module")
def kernels():
    k = load()
    if k is None:
        pytest.skip("no C compiler here: the native kernels cannot be built")
    return k


def _experts(E, H, inter, g):
    """gate_up [E, 2I, H], down [E, H, I] stored [in, out] row-major (the engine's CPU layout)."""
    gu = torch.randn(E, H, 2 * inter, generator=g).mul_(0.2).transpose(-2, -1)
    dn = torch.randn(E, inter, H, generator=g).mul_(0.2).transpose(-2, -1)
    return gu, dn


@pytest.mark.parametrize("E,H,inter,A", [(8, 64, 32, 2), (5, 36, 20, 3), (64, 48, 24, 4), (3, 7, 5, 1)])
def test_moe_kernel_equals_the_per_expert_loop(kernels, E, H, inter, A):
    g = torch.Generator().manual_seed(E * H)
    gu, dn = _experts(E, H, inter, g)
    for N in (1, 2, 9, 70):
        x = torch.randn(N, H, generator=g)
        idx = torch.rand(N, E, generator=g).topk(A, dim=-1).indices
        if N > 2:
            idx[:, 0] = 0  # a crowded expert (more than 4 rows: the row-block path), others empty
        if N == 9:
            x = x * 300  # gate values far beyond exp's range on both sides: SwiGLU saturates, no inf / NaN
        w = torch.rand(N, A, generator=g)
        keep = torch.rand(N, A, generator=g) > 0.25
        for k in (None, keep):
            ref = expert_loop(x, idx, w, k, E, lambda e, xs: swiglu(xs, gu[e], dn[e]))
            for threads in (1, 2):
                got = kernels.moe(x, idx, w if k is None else w * k, gu.transpose(-2, -1), dn.transpose(-2, -1), threads)
                tol = 1e-5 * max(1.0, float(ref.abs().max()))
                assert torch.allclose(got, ref, atol=tol, rtol=1e-5), (N, threads, (got - ref).abs().max())
                assert torch.isfinite(got).all()


@pytest.mark.parametrize("H,W,R", [(3, 12, 8), (6, 40, 32), (9, 21, 13)])
def test_latent_kernel_equals_dense_latent_attention(kernels, H, W, R):
    """Ragged lengths, causal rows (T = 2: a draft row sees one key less), a fully masked row (padding),
    odd widths (vector tails), more than 8 heads (two head blocks), 1 and 2 threads."""
    g = torch.Generator().manual_seed(H * W)
    for T in (1, 2):
        qq, latent, key_slots, _, bias, lens = ragged_latent_case(g, T, H, W)
        ref = dense_latent_attention(qq, latent, key_slots, bias, R, 0.3, lens)
        for threads in (1, 2):
            got = kernels.latent_decode(qq, latent, key_slots, bias, R, 0.3, lens, threads)
            assert torch.allclose(got, ref, atol=1e-5), (T, threads, (got - ref).abs().max())
    bias[4, 1] = float("-inf")  # a query row that may see nothing: zeros (the PyTorch kernel gives NaN)
    got = kernels.latent_decode(qq, latent, key_slots, bias, R, 0.3, lens)
    assert torch.equal(got[4, 1], torch.zeros(H, R)) and torch.allclose(got[:4], ref[:4], atol=1e-5)
    with pytest.raises(NativeError, match="key slot outside"):
        kernels.latent_decode(qq, latent[:10], key_slots, bias, R, 0.3, lens)
    with pytest.raises(ValueError, match="kv_rank"):
        kernels.latent_decode(qq, latent, key_slots, bias, W + 1, 0.3, lens)


@pytest.mark.parametrize("H,G,D", [(6, 2, 64), (8, 8, 12), (7, 1, 20), (16, 2, 9)])
def test_gqa_kernel_equals_the_modules_grouped_attention(kernels, H, G, D):
    """`NativeKernels.gqa_decode` == GQAttention's own `_attend_group` (its PyTorch statement) over paged
    [k | v] rows: ragged lengths, causal draft rows (T = 2), MHA (G = H), MQA (G = 1), odd head dims (vector
    tails), more than 6 query heads per key/value head (two head blocks), 1 and 2 threads; a query row that
    may see nothing gets zeros; bad key tables and head counts are refused."""
    from glm5.model.config import ModelConfig
    from glm5.model.gqa_attention import GQAttention
    from glm5.model.paged import AttnGroup

    from .test_hf_glm4 import GQA

    cfg = ModelConfig.from_dict(dict(GQA, num_attention_heads=H, num_key_value_heads=G, head_dim=D))
    att = GQAttention(cfg, 0).eval()
    g = torch.Generator().manual_seed(H * G * D)
    for T in (1, 2):
        _, _, key_slots, allowed, bias, lens = ragged_latent_case(g, T, 1, 1)
        B, S = key_slots.shape
        rows = torch.randn(64, 2 * G * D, generator=g)
        q = torch.randn(B * T, H, D, generator=g)
        grp = AttnGroup(q_index=torch.arange(B * T).view(B, T), q_valid=torch.ones(B, T, dtype=torch.bool),
                        q_pos=torch.zeros(B, T, dtype=torch.long), key_slots=key_slots,
                        key_valid=torch.arange(S)[None] < torch.tensor(lens)[:, None], allowed=allowed,
                        is_identity=True, key_lens=lens)
        with torch.no_grad():
            ref = att._attend_group(grp, q, rows)  # [B, T, H, D]
        for threads in (1, 2):
            got = kernels.gqa_decode(q.view(B, T, H, D), rows, G, key_slots, bias, att.scale, lens, threads)
            assert torch.allclose(got, ref, atol=1e-5), (T, threads, (got - ref).abs().max())
    bias[4, 1] = float("-inf")
    got = kernels.gqa_decode(q.view(B, T, H, D), rows, G, key_slots, bias, att.scale, lens)
    assert torch.equal(got[4, 1], torch.zeros(H, D)) and torch.allclose(got[:4], ref[:4], atol=1e-5)
    with pytest.raises(NativeError, match="key slot outside"):
        kernels.gqa_decode(q.view(B, T, H, D), rows[:10], G, key_slots, bias, att.scale, lens)
    with pytest.raises(ValueError, match="shape"):
        kernels.gqa_decode(q.view(B, T, H, D), rows[:, 1:], G, key_slots, bias, att.scale, lens)
    with pytest.raises(ValueError, match="not a multiple"):
        kernels.gqa_decode(q.view(B, T, H, D), torch.randn(64, 2 * (H + 1) * D), H + 1, key_slots, bias, att.scale, lens)


@pytest.mark.parametrize("H,G,D", [(6, 2, 64), (8, 8, 12), (7, 1, 20), (16, 2, 9)])
def test_gqa_prefill_kernel_equals_the_modules_causal_attention(kernels, H, G, D):
    """`NativeKernels.gqa_prefill` (a sequence's first chunk, causal) == GQAttention's own `_attend_group` on
    the same group: chunks shorter than one key block, across several blocks with a partial last one, MHA /
    MQA, odd head dims, queries given as rows of a wider tensor (strided), slots scattered over the cache,
    1 and 2 threads; bad inputs are refused."""
    from glm5.model.config import ModelConfig
    from glm5.model.gqa_attention import GQAttention
    from glm5.model.paged import AttnGroup

    from .test_hf_glm4 import GQA

    cfg = ModelConfig.from_dict(dict(GQA, num_attention_heads=H, num_key_value_heads=G, head_dim=D))
    att = GQAttention(cfg, 0).eval()
    g = torch.Generator().manual_seed(H * G * D + 1)
    rows = torch.randn(160, 2 * G * D, generator=g)
    for T in (1, 9, 33, 70):
        slots = torch.randperm(160, generator=g)[:T]
        wide = torch.randn(T, H * D + 5, generator=g)
        q = wide[:, 5:].view(T, H, D)  # rows H * D + 5 apart
        pos = torch.arange(T)
        grp = AttnGroup(q_index=pos[None], q_valid=torch.ones(1, T, dtype=torch.bool), q_pos=pos[None],
                        key_slots=slots[None], key_valid=torch.ones(1, T, dtype=torch.bool),
                        allowed=(pos[None, :] <= pos[:, None])[None], is_identity=True, key_lens=[T],
                        causal_from_start=True)
        with torch.no_grad():
            ref = att._attend_group(grp, q.contiguous(), rows)[0]  # [T, H, D]
        for threads in (1, 2):
            got = kernels.gqa_prefill(q, rows, G, slots, att.scale, threads)
            assert torch.allclose(got, ref, atol=1e-5), (T, threads, (got - ref).abs().max())
    with pytest.raises(NativeError, match="key slots outside"):
        kernels.gqa_prefill(q, rows[:10], G, slots, att.scale)
    with pytest.raises(ValueError, match="one key per query"):
        kernels.gqa_prefill(q, rows, G, slots[:-1], att.scale)
    with pytest.raises(ValueError, match="not a multiple"):
        kernels.gqa_prefill(q, torch.randn(160, 2 * (H + 1) * D), H + 1, slots, att.scale)


@pytest.mark.parametrize("B,T,H,D,r", [(1, 5, 6, 64, 32), (2, 3, 4, 16, 16), (1, 1, 2, 20, 10)])
def test_rope_heads_kernel_equals_gqa_rotate(kernels, B, T, H, D, r):
    """In-place partial rotary (`rope_heads_`) == GQAttention's `_rotate` (apply_rope on the first r values,
    the rest kept), on a contiguous tensor and on a head slice of a wider row (a fused projection's k);
    the values outside the slice are untouched."""
    from glm5.model.layers import apply_rope

    g = torch.Generator().manual_seed(B * T * H * D)
    ang = torch.randn(B, T, r // 2, generator=g)
    cos, sin = ang.cos(), ang.sin()
    base = torch.randn(B * T, 3 * H * D, generator=g)
    before = base.clone()
    for x in (torch.randn(B, T, H, D, generator=g), base[:, H * D:2 * H * D].view(B, T, H, D)):
        ref = torch.cat([apply_rope(x[..., :r], cos[:, :, None], sin[:, :, None], interleave=False), x[..., r:]], -1)
        assert torch.allclose(kernels.rope_heads_(x, cos, sin, r), ref, atol=1e-6)
    assert torch.equal(base[:, :H * D], before[:, :H * D]) and torch.equal(base[:, 2 * H * D:], before[:, 2 * H * D:])
    with pytest.raises(ValueError, match="rope_heads_"):
        kernels.rope_heads_(torch.randn(B, T, H, D), cos, sin, D + 2)


class _Spy:
    """The native ops namespace, recording the name of each op called through it."""

    def __init__(self, ops, names: list):
        self._ops, self._names = ops, names

    def __getattr__(self, name):
        op = getattr(self._ops, name)
        return lambda *a, **k: self._names.append(name) or op(*a, **k)


def test_engine_swaps_gqa_attention_and_serves_the_same_tokens(kernels, monkeypatch):
    """A glm4_moe engine on the native kernels: its attention modules are `NativeGQAttention` sharing the
    (swapped) projections, and its greedy tokens and paged logits equal the PyTorch engine's, the prompts'
    first chunks running the causal prefill kernel."""
    from .test_hf_glm4 import CORNERS, _model

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (1, 7, 19, 30)]
    opts = dict(device="cpu", dtype="float32", block_size=4, num_blocks=64, max_model_len=48)
    plain = LLMEngine(EngineConfig(**opts, kernels="torch"), model=_model(CORNERS["gqa_qknorm_bias_partial"], seed=3))
    fast = LLMEngine(EngineConfig(**opts, kernels="native"), model=_model(CORNERS["gqa_qknorm_bias_partial"], seed=3))
    attn = fast.model.model.layers[0].self_attn
    assert type(attn) is NativeGQAttention and type(attn.q_proj) is NativeLinear
    assert type(plain.model.model.layers[0].self_attn) is not NativeGQAttention
    assert fast.model.state_dict().keys() == plain.model.state_dict().keys()
    calls, inner = [], NativeGQAttention._attend_group
    monkeypatch.setattr(NativeGQAttention, "_attend_group",
                        lambda self, g, q, rows: calls.append(g.q_index.shape) or inner(self, g, q, rows))
    import glm5.infer.kernels as kmod

    names = []
    monkeypatch.setattr(kmod, "ops", _Spy(kmod.ops, names))
    assert _greedy(fast, prompts) == _greedy(plain, prompts)
    for p in prompts:
        assert torch.allclose(_logits(fast, p + [5, 6]), _logits(plain, p + [5, 6]), atol=1e-4)
    assert any(shape[1] == 1 for shape in calls)  # the decode steps went through the swapped module
    assert names.count("gqa_prefill") >= 2  # the 19- and 30-token prompts' first chunks: the causal kernel


@pytest.mark.parametrize("H,E,V,P,R", [(3, 8, 8, 4, 16), (7, 13, 9, 6, 21)])
def test_mla_kernel_equals_absorb_attend_and_w_uv(kernels, H, E, V, P, R):
    """The fused absorbed path == W_uk through the query, the PyTorch latent kernel, W_uv on the output; q_nope
    a strided slice of a wider projection (as `project_q` leaves it), causal draft rows, ragged lengths."""
    g = torch.Generator().manual_seed(H * E)
    kv_b = torch.randn(H * (E + V), R, generator=g) * 0.2
    w = kv_b.view(H, E + V, R)
    for T in (1, 2):
        _, latent, key_slots, _, bias, lens = ragged_latent_case(g, T, H, R + P)
        q = torch.randn(5, T, H, E + P + 3, generator=g)
        q_nope, q_rope = q[..., :E], q[..., E:E + P].contiguous()
        q_lat = torch.einsum("bthe,her->bthr", q_nope, w[:, :E])
        o_lat = dense_latent_attention(torch.cat([q_lat, q_rope], -1), latent, key_slots, bias, R, 0.3, lens)
        ref = torch.einsum("bthr,hvr->bthv", o_lat, w[:, E:])
        for threads in (1, 2):
            got = kernels.mla_decode(q_nope, q_rope, kv_b, latent, key_slots, bias, 0.3, lens, threads)
            assert torch.allclose(got, ref, atol=1e-5), (T, threads, (got - ref).abs().max())


@pytest.mark.parametrize("wide", [False, True])
def test_prefill_sized_expert_steps_follow_the_gemm_width(kernels, monkeypatch, wide):
    """A step with many rows per expert (a prefill chunk) runs the native kernel where its GEMM has wide
    (AVX-512) tiles, and then the experts get no oneDNN copy; with 16-column tiles the model's per-expert
    loop. Either way the output is the model experts' (`Experts.forward`)."""
    import glm5.infer.kernels as kmod
    from glm5.infer.kernels import _swapped, use_onednn
    from glm5.model.moe import Experts

    from glm5.infer import onednn

    from .test_onednn import served_experts_and_step

    if not wide and not onednn.available():
        pytest.skip("this PyTorch build has no oneDNN")
    ref, (x, idx, w) = served_experts_and_step(2)
    fast = _swapped(NativeExperts, ref, wide_gemm=wide)
    loops = []
    monkeypatch.setattr(kmod, "expert_loop", lambda *a: loops.append(1) or expert_loop(*a))
    with torch.no_grad():
        assert torch.allclose(fast(x, idx, w), Experts.forward(ref, x, idx, w), atol=1e-5)
    assert (use_onednn(fast) == 0) == wide
    with torch.no_grad():
        assert torch.allclose(fast(x, idx, w), Experts.forward(ref, x, idx, w), atol=1e-5)
    assert len(loops) == (0 if wide else 1)  # the oneDNN loop, once the weights were packed
    assert kernels.gemm_width in (16, 32)


def test_moe_kernel_refuses_bad_inputs(kernels):
    g = torch.Generator().manual_seed(0)
    gu, dn = _experts(4, 16, 8, g)
    x, w = torch.randn(3, 16, generator=g), torch.rand(3, 2, generator=g)
    gut, dnt = gu.transpose(-2, -1), dn.transpose(-2, -1)
    with pytest.raises(NativeError, match=r"expert ids outside \[0, 4\)"):
        kernels.moe(x, torch.tensor([[0, 1], [2, 4], [3, 0]]), w, gut, dnt)
    with pytest.raises(ValueError, match="float32"):
        kernels.moe(x.double(), torch.zeros(3, 2, dtype=torch.long), w, gut, dnt)
    with pytest.raises(ValueError, match="row-major"):
        kernels.moe(x, torch.zeros(3, 2, dtype=torch.long), w, gu, dnt)  # [out, in] storage
    with pytest.raises(ValueError, match=r"must both be \[3, A\]"):
        kernels.moe(x, torch.zeros(3, 2, dtype=torch.long), w[:2], gut, dnt)


def test_engine_on_native_kernels_serves_the_same_tokens(kernels):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (1, 7, 19, 30)]
    opts = dict(device="cpu", dtype="float32", block_size=4, num_blocks=64, max_model_len=48)
    plain = LLMEngine(EngineConfig(**opts, kernels="torch"), model=tiny_model(seed=5))
    fast = LLMEngine(EngineConfig(**opts, kernels="native"), model=tiny_model(seed=5))
    experts = fast.model.model.layers[1].mlp.experts
    attn = fast.model.model.layers[1].self_attn
    assert type(attn) is NativeMLAttention and type(plain.model.model.layers[1].self_attn) is MLAttention
    assert type(fast.model.model.layers[1]) is NativeDecoderLayer and type(plain.model.model.layers[1]) is DecoderLayer
    assert type(attn.q_a_proj) is NativeLinear and type(attn.kv_b_proj) is torch.nn.Linear  # (read as a matrix)
    assert type(experts) is NativeExperts and type(plain.model.model.layers[1].mlp.experts) is not NativeExperts
    assert fast.model.state_dict().keys() == plain.model.state_dict().keys()
    assert _greedy(fast, prompts) == _greedy(plain, prompts)
    layer_kernel, calls, whole = _layer_kernel(fast), [], []
    _count_calls(fast, "absorbed_heads", calls)  # count the fused MLA calls
    _set_layer_kernel(fast, lambda *a: (lambda r: whole.append(r is not None) or r)(layer_kernel(*a)))
    for p in prompts:  # the same logits, prefill and decode steps included
        ids = torch.tensor([p + [5, 6]])
        with torch.no_grad():
            ref = plain.model(ids).logits
        assert torch.allclose(_logits(fast, p + [5, 6]), ref[0, -3:], atol=1e-4)
        _set_layer_kernel(fast, None)  # the same without the whole-layer kernel: the fused MLA call runs
        assert torch.allclose(_logits(fast, p + [5, 6]), ref[0, -3:], atol=1e-4)
        _set_layer_kernel(fast, lambda *a: (lambda r: whole.append(r is not None) or r)(layer_kernel(*a)))
    assert calls  # the one-token decode steps ran the fused MLA kernel without the layer kernel ...
    assert any(whole) and not all(whole)  # ... and the whole-layer kernel with it (prefill: the modules)
    update = {(1, 3): {"gate_proj": torch.randn(32, 64, generator=gen), "up_proj": torch.randn(32, 64, generator=gen),
                       "down_proj": torch.randn(64, 32, generator=gen)}}
    plain.swap_experts(update)
    fast.swap_experts(update)  # writes into the parameters the kernel reads
    assert torch.equal(experts.gate_up_proj[3, 32:], update[(1, 3)]["up_proj"])
    assert _greedy(fast, prompts) == _greedy(plain, prompts)


def _layer_kernel(engine):
    """The whole-layer kernel the engine's decoder layers share (`NativeDecoderLayer.layer_kernel`)."""
    return next(m.layer_kernel for m in engine.model.modules() if isinstance(m, NativeDecoderLayer))


def _set_layer_kernel(engine, fn) -> None:
    """Give every native decoder layer of the engine's model `fn` as its layer kernel (None: one that never
    applies, so the layers run their modules)."""
    for m in engine.model.modules():
        if isinstance(m, NativeDecoderLayer):
            m.layer_kernel = fn if fn is not None else (lambda *a: None)


def _count_calls(engine, method: str, calls: list) -> None:
    """Record the first argument's shape of every call of the native attention modules' `method`."""
    for m in engine.model.modules():
        if isinstance(m, NativeMLAttention):
            orig = getattr(m, method)
            setattr(m, method, lambda *a, _orig=orig: calls.append(a[1].shape) or _orig(*a))


def _logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits of the last 3 tokens of ids through the engine's paged forward: a prefill of all but the last
    two tokens, then two one-token decode steps (the model's forward with metadata, as the runner calls it)."""
    from glm5.infer.input_batch import SeqChunk
    runner, out = engine.runner, []
    blocks = list(range(engine.config.num_blocks))[: (len(ids) + 3) // 4 + 1]
    for start, end in ((0, len(ids) - 2), (len(ids) - 2, len(ids) - 1), (len(ids) - 1, len(ids))):
        tok, meta = runner.metadata([SeqChunk("s", start, ids[start:end], blocks)])
        with torch.no_grad():
            logits = engine.model(tok[None], attn_metadata=meta, kv_cache=runner.cache).logits
        out.append(logits[0, -1])
    return torch.stack(out)


def test_without_a_compiler_auto_falls_back_and_native_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-compiler-glm5")
    with pytest.raises(NativeError, match="no C compiler"):
        build(b"int f(void) { return 0; }", tmp_path)
    monkeypatch.setattr("glm5.infer.engine.load_native", lambda: None)
    opts = dict(device="cpu", dtype="float32", block_size=4, num_blocks=16, max_model_len=16)
    engine = LLMEngine(EngineConfig(**opts), model=tiny_model(seed=1))
    assert type(engine.model.model.layers[1].mlp.experts) is not NativeExperts
    with pytest.raises(ValueError, match="kernels='native'"):
        LLMEngine(EngineConfig(**opts, kernels="native"), model=tiny_model(seed=1))


def test_build_reports_compiler_errors(tmp_path):
    if load() is None:
        pytest.skip("no C compiler here")
    with pytest.raises(NativeError, match="failed"):
        build(b"this is not C", tmp_path)
    lib = build(b"int glm5_probe(void) { return 7; }", tmp_path)
    assert lib.exists() and build(b"int glm5_probe(void) { return 7; }", tmp_path) == lib  # cached


def test_huge_page_rehome_keeps_values_layout_and_serving():
    from glm5.infer.hugepages import HUGE, available, huge_empty, rehome
    g = torch.Generator().manual_seed(0)
    if available():
        assert huge_empty(1 << 20, torch.float32).data_ptr() % HUGE == 0
    w = torch.randn(700, 1500, generator=g).t()  # a transposed [in, out] weight, 4.2 MB
    mod = torch.nn.Module()
    mod.w = torch.nn.Parameter(w.clone())
    big = torch.randn(300, 300, generator=g)
    mod.part = torch.nn.Parameter(big[:, :200])  # not dense (a column slice of a larger tensor): left in place
    ptr, part_ptr = mod.w.data_ptr(), mod.part.data_ptr()
    assert rehome(mod) == (1 if available() else 0)
    assert torch.equal(mod.w, w) and mod.w.stride() == w.stride() and mod.part.data_ptr() == part_ptr
    assert (mod.w.data_ptr() != ptr) == available()
    opts = dict(device="cpu", dtype="float32", block_size=4, num_blocks=64, max_model_len=48, kernels="torch")
    model = tiny_model(seed=2, vocab_size=8192)  # a 2 MiB embedding and head: moved
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = LLMEngine(EngineConfig(**opts), model=model)
    plain = LLMEngine(EngineConfig(**opts, huge_pages=False), model=tiny_model(seed=2, vocab_size=8192))
    after = moved.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    if available():  # one arena for all of them (64-byte aligned offsets)
        head, embed = moved.model.lm_head.weight, moved.model.model.embed_tokens.weight
        assert head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr()
        assert head.data_ptr() % 64 == 0 and embed.data_ptr() % 64 == 0
        assert rehome(moved.model) > 0  # (again: every large tensor is movable)
    prompts = [[3, 4, 5], list(range(10, 40))]
    assert _greedy(moved, prompts) == _greedy(plain, prompts)


def test_rms_norm_kernel_equals_rmsnorm_on_contiguous_and_sliced_rows(kernels):
    from glm5.model.layers import RMSNorm
    from glm5.native import rows_stride
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(20, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
        wide = torch.randn(2, 3, 27, generator=g)
        for x in (wide[..., :20], wide[..., 7:], wide[0, :, 3:23], torch.randn(20, generator=g), wide[:, :1, :20]):
            got = kernels.rms_norm(x, norm.weight, norm.eps)
            assert got.is_contiguous() and torch.allclose(got, norm(x.contiguous()), atol=1e-6)
    assert rows_stride(wide.transpose(0, 1)[..., :20]) is None and rows_stride(wide.transpose(1, 2)) is None
    with pytest.raises(ValueError, match="evenly spaced"):
        kernels.rms_norm(wide.transpose(0, 1)[..., :20], norm.weight, norm.eps)


def test_rope_kernel_equals_apply_rope(kernels):
    """The rope slices of the q and kv_a projections (strided rows; per-head and shared), both pair layouts."""
    from glm5.model.layers import apply_rope, rope_angles, rope_inv_freq
    g = torch.Generator().manual_seed(0)
    N, H, E, P = 7, 3, 5, 8
    cos, sin = rope_angles(torch.randint(0, 100, (1, N), generator=g), rope_inv_freq(P, 10000.0))  # [1, N, P/2]
    q = torch.randn(1, N, H, E + P, generator=g)
    kv = torch.randn(1, N, 12 + P, generator=g)
    for interleave in (True, False):
        for x, c, s in ((q[..., E:], cos[:, :, None], sin[:, :, None]), (kv[..., 12:], cos, sin)):
            got = kernels.rope(x, c, s, interleave)
            assert got.is_contiguous() and torch.allclose(got, apply_rope(x, c, s, interleave), atol=1e-6)
    with pytest.raises(ValueError, match="rope: unsupported"):
        kernels.rope(q[..., E:].double(), cos[:, :, None], sin[:, :, None], True)


def test_linear_kernel_equals_f_linear_and_native_linear_falls_back(kernels):
    """A few rows through an [in, out]-stored weight, with and without bias, odd widths, strided rows; the
    module runs the kernel only for few rows and small weights (F.linear otherwise: same values)."""
    import torch.nn.functional as F
    from glm5.infer.kernels import LINEAR_MAX_ROWS, NativeLinear, use_native_kernels
    g = torch.Generator().manual_seed(0)
    for K, N in ((20, 13), (64, 48), (7, 3)):
        w = torch.randn(N, K, generator=g).t().contiguous().t()  # [out, in] values, [in, out] storage
        b = torch.randn(N, generator=g)
        wide = torch.randn(4, K + 5, generator=g)
        for x in (wide[:1, :K], wide[:, 2:K + 2], torch.randn(2, 3, K, generator=g)[:, :1]):
            for bias in (None, b):
                assert torch.allclose(kernels.linear(x, w, bias), F.linear(x, w, bias), atol=1e-5)
    lin = torch.nn.Linear(16, 8)
    with torch.no_grad():
        lin.weight.data = lin.weight.data.t().contiguous().t()
    model = torch.nn.Sequential(lin)
    assert use_native_kernels(model, kernels) == 1 and type(model[0]) is NativeLinear
    with torch.no_grad():
        assert kernels.linear(torch.zeros(0, 16), lin.weight).shape == (0, 8)  # no rows: nothing written
        for rows in (0, 1, LINEAR_MAX_ROWS, LINEAR_MAX_ROWS + 3):
            x = torch.randn(rows, 16, generator=g)
            assert torch.allclose(model(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)


def _paged(engine, chunks, layer_kernel):
    """One paged forward of `chunks` (SeqChunk list) with or without the whole-layer kernel -> ModelOutput."""
    runner = engine.runner
    if any(isinstance(m, NativeDecoderLayer) for m in engine.model.modules()):
        _set_layer_kernel(engine, layer_kernel)
    tok, meta = runner.metadata(chunks)
    with torch.no_grad():
        return engine.model(tok[None], attn_metadata=meta, kv_cache=runner.cache)


@pytest.mark.parametrize("opts", [
    {},
    dict(scoring_func="softmax", norm_topk_prob=False, router_temperature=0.7, attention_bias=True),
    dict(n_group=4, topk_group=2, n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=2),
    dict(rope_interleave=False, indexer_rope_interleave=False, routed_scaling_factor=1.0),
    dict(hidden_size=256, q_lora_rank=256, moe_intermediate_size=256, intermediate_size=512),  # >= LIN_SPLIT weights
    dict(index_topk=8),  # DSA top-k past 8 keys: the layers' own indexers
    dict(index_topk=6, indexer_types=["full", "full", "shared"]),  # ... and a layer reusing the previous selection
    dict(moe_type="soft"),  # MLPs the kernel leaves to DecoderLayer.feed_forward after its attention half
    dict(moe_capacity_factor=1.0, index_topk=8),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_layer_kernel_equals_the_layer_modules(kernels, opts, threads, request):
    """`NativeLayerKernel` (a whole decoder layer per call) == the layer's own (native-swapped) modules on
    decode steps of one and two rows (two sequences, or one sequence's two- and five-token chunks): logits, the cache
    rows written (latent and indexer key), router stats; options: softmax scores, no renormalisation, router
    temperature, attention biases, group-limited routing with a correction bias, several shared experts,
    half-split RoPE; DSA top-k selection (own indexer and a "shared" layer; the selections equal too); 1 and 2
    threads (weight-row bands of the linear layers, experts split)."""
    from glm5.infer.input_batch import SeqChunk
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernels run on torch's thread count
    request.addfinalizer(lambda: torch.set_num_threads(prev))
    engines = []
    for _ in range(2):
        m = tiny_model(seed=3, bias_std=0.05 if opts.get("n_group") else 0.0, **opts)
        if opts.get("attention_bias"):
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if name.endswith(".bias") and "norm" not in name:
                        p.normal_(0, 0.1)
        engines.append(LLMEngine(EngineConfig(device="cpu", dtype="float32", block_size=4, num_blocks=32,
                                              max_model_len=120, kernels="native"), model=m))
    fast, plain = engines
    lk = _layer_kernel(fast)
    ran = []
    counted = lambda *a: (lambda r: ran.append(r is not None) or r)(lk(*a))  # noqa: E731
    assert fast.runner.cache.index_k[1] is not None  # max_model_len > index_topk: indexer keys are cached
    gen = torch.Generator().manual_seed(1)
    seqs = {"a": torch.randint(2, 500, (13,), generator=gen).tolist(), "b": torch.randint(2, 500, (6,), generator=gen).tolist()}
    blocks = {"a": list(range(0, 8)), "b": list(range(8, 16))}
    steps = [[("a", 0, 11), ("b", 0, 5)], [("a", 11, 12), ("b", 5, 6)], [("a", 12, 13)]]  # prefill, 2 rows, 1 row
    seqs["b"] += [7]
    steps += [[("b", 6, 7)]]
    seqs["a"] += [9, 10, 11, 12, 13, 14, 15]
    steps += [[("a", 13, 15)], [("a", 15, 20)]]  # one sequence: a two-token chunk, a five-token chunk
    for step in steps:
        chunks = [SeqChunk(r, s, seqs[r][s:e], blocks[r]) for r, s, e in step]
        n = len(ran)
        got, ref = _paged(fast, chunks, counted), _paged(plain, chunks, None)
        assert (len(ran) > n and all(ran[n:])) == (step[0][1] > 0)  # decode steps run the kernel, prefill not
        assert torch.allclose(got.logits, ref.logits, atol=1e-5, rtol=1e-4)
        for gs, rs in zip(got.selections, ref.selections, strict=True):  # per layer: None or one group's (idx, valid)
            assert (gs is None or gs[0] is None) == (rs is None or rs[0] is None)
            if rs is not None and rs[0] is not None:
                (gi, gv), (ri, rv) = gs[0], rs[0]
                assert gi.shape == ri.shape and torch.equal(gv.sum(-1), rv.sum(-1))
                assert all(sorted(gi.reshape(-1, gi.shape[-1])[r][gv.reshape(-1, gv.shape[-1])[r]].tolist())
                           == sorted(ri.reshape(-1, ri.shape[-1])[r][rv.reshape(-1, rv.shape[-1])[r]].tolist())
                           for r in range(gi.shape[0] * gi.shape[1]))
        for st, rs in zip(got.router_stats, ref.router_stats, strict=True):
            assert torch.equal(st["tokens_per_expert"], rs["tokens_per_expert"])
            assert torch.equal(st["topk_idx"].sort(-1).values, rs["topk_idx"].sort(-1).values)
            assert torch.allclose(st["router_logits"], rs["router_logits"], atol=1e-5)
            assert torch.allclose(st["scores"], rs["scores"], atol=1e-6)
    for a, b in zip(fast.runner.cache.latent + fast.runner.cache.index_k, plain.runner.cache.latent + plain.runner.cache.index_k):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-5))


def test_decode_layer_kernel_steps_aside(kernels):
    """Where the whole-layer kernel does not apply it returns None and the layer's modules run (the
    window+global selector, training), or it runs the attention half and `feed_forward` the rest (a
    capacity factor, soft MoE); a DSA top-k selection it runs itself."""
    from glm5.infer.input_batch import SeqChunk
    opts = dict(device="cpu", dtype="float32", block_size=4, num_blocks=40, max_model_len=150, kernels="native")
    for kw, expect in [({}, True), (dict(index_topk=8), True), (dict(sparse_attention="window"), False),
                       (dict(moe_capacity_factor=1.5), True), (dict(moe_type="soft"), True)]:
        eng = LLMEngine(EngineConfig(**opts), model=tiny_model(seed=4, **kw))
        lk, ran = _layer_kernel(eng), []
        ids = list(range(3, 23))
        _paged(eng, [SeqChunk("s", 0, ids[:-1], list(range(8)))], lk)
        _paged(eng, [SeqChunk("s", len(ids) - 1, ids[-1:], list(range(8)))],
               lambda *a: (lambda r: ran.append(r is not None) or r)(lk(*a)))
        assert ran and all(ran) == expect and any(ran) == expect, kw
    from glm5.infer.kernels import layer_plan
    soft = layer_plan(eng.model.model.layers[1], True)  # soft MoE: the attention half only
    assert soft.spec is not None and not soft.mlp_native
    eng = LLMEngine(EngineConfig(**opts), model=tiny_model(seed=4))
    layer = eng.model.model.layers[1]
    plan = layer_plan(layer, True)
    assert plan.spec is not None and plan.valid()
    layer.train()
    assert not plan.valid() and layer_plan(layer, True).spec is None
    layer.eval()
    assert plan.valid()
    o_proj = layer.self_attn.o_proj
    old = o_proj.weight.data
    o_proj.weight.data = old.clone()  # re-stored elsewhere (same layout): a new plan points there
    assert not plan.valid() and layer_plan(layer, True).spec.wo == o_proj.weight.data_ptr() != old.data_ptr()
    o_proj.weight.data = old.contiguous()  # [out, in] storage: the kernel does not apply
    assert not plan.valid() and layer_plan(layer, True).spec is None
    o_proj.weight.data = old
    assert plan.valid()
    with torch.no_grad():
        layer.mlp.experts.gate_up_proj.mul_(2)  # in place (hot swap): the plan stays valid
    assert plan.valid()
    layer.mlp.shared_experts.up_proj = torch.nn.Linear(64, 32)  # a swapped module: the MLP is left to the modules
    assert not plan.valid() and not layer_plan(layer, True).mlp_native
    layer.self_attn.o_proj = torch.nn.Linear(64, 64)  # ... in the attention: the whole layer is
    assert layer_plan(layer, True).spec is None


def test_decode_layer_kernel_on_a_wide_decode_batch(kernels):
    """A decode step of 14 sequences (the kernel's many-row matmul regimes: 14 rows through each projection,
    several rows per expert) == the layer modules: logits, cache rows, expert counts."""
    from glm5.infer.input_batch import SeqChunk
    opts = dict(device="cpu", dtype="float32", block_size=4, num_blocks=96, max_model_len=40, kernels="native")
    fast, plain = (LLMEngine(EngineConfig(**opts), model=tiny_model(seed=6)) for _ in range(2))
    lk, ran = _layer_kernel(fast), []
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(2, 500, (int(n),), generator=gen).tolist() for n in torch.randint(3, 20, (14,), generator=gen)]
    blocks = [list(range(6 * i, 6 * i + 6)) for i in range(14)]
    for eng, layer_kernel in ((fast, None), (plain, None)):  # prefill each sequence (the modules)
        for i, s in enumerate(seqs):
            _paged(eng, [SeqChunk(str(i), 0, s[:-1], blocks[i])], layer_kernel)
    step = [SeqChunk(str(i), len(s) - 1, s[-1:], blocks[i]) for i, s in enumerate(seqs)]
    got = _paged(fast, step, lambda *a: (lambda r: ran.append(r is not None) or r)(lk(*a)))
    ref = _paged(plain, step, None)
    assert ran and all(ran)
    assert torch.allclose(got.logits, ref.logits, atol=1e-5, rtol=1e-4)
    assert all(torch.equal(a["tokens_per_expert"], b["tokens_per_expert"]) for a, b in zip(got.router_stats, ref.router_stats))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(fast.runner.cache.latent, plain.runner.cache.latent))


def test_decode_layer_kernel_refuses_bad_keys_before_writing(kernels):
    """A slot, key length or selected key outside the cache / sequence is refused (NativeError) before the
    kernel writes anything into the cache."""
    from glm5.infer.input_batch import SeqChunk
    eng = LLMEngine(EngineConfig(device="cpu", dtype="float32", block_size=4, num_blocks=16, max_model_len=40,
                                 kernels="native"), model=tiny_model(seed=7, index_topk=4))
    lk, seen = _layer_kernel(eng), []
    ids = list(range(3, 15))
    _paged(eng, [SeqChunk("s", 0, ids[:-1], list(range(4)))], lk)
    real = eng.kernels.decode_layer
    eng.kernels.decode_layer = lambda *a: seen.append(a) or real(*a)
    _paged(eng, [SeqChunk("s", len(ids) - 1, ids[-1:], list(range(4)))], lk)
    spec, x, cos, sin, slot_mapping, lat, ik, slots, bias, lens, T, topk, sel_in, _ = seen[2]  # layer 2: own top-k
    assert topk == 4 and sel_in is None
    before = [lat.clone(), ik.clone()]
    bad = [dict(slot_mapping=torch.tensor([lat.shape[0]])), dict(slots=slots + lat.shape[0]),
           dict(lens=lens + slots.shape[1] + 1), dict(sel_in=torch.tensor([[0, 1, 2, 99]]))]
    for change in bad:
        args = dict(slot_mapping=slot_mapping, slots=slots, lens=lens, sel_in=None) | change
        with pytest.raises(NativeError, match="refused"):
            real(spec, x, cos, sin, args["slot_mapping"], lat, ik, args["slots"], bias, args["lens"], T, topk,
                 args["sel_in"])
        assert torch.equal(lat, before[0]) and torch.equal(ik, before[1])


def test_a_served_model_can_be_copied_and_pickled(kernels):
    """The engine's module swaps call typed ops (no kernel object inside the modules but the layer kernel's,
    which a copy shares and a pickle re-opens by path): `copy.deepcopy` and a pickle round trip of the served
    model compute the same, on the native modules."""
    import copy
    import pickle
    model = tiny_model(seed=8)
    eng = LLMEngine(EngineConfig(device="cpu", dtype="float32", block_size=4, num_blocks=16, max_model_len=40,
                                 kernels="native"), model=model)
    ids = torch.tensor([[3, 4, 5, 6]])
    for twin in (copy.deepcopy(eng.model), pickle.loads(pickle.dumps(eng.model))):
        lin = twin.model.layers[1].self_attn.q_a_proj
        assert type(lin) is NativeLinear and type(twin.model.layers[1]) is NativeDecoderLayer
        with torch.no_grad():
            assert torch.equal(twin(ids).logits, eng.model(ids).logits)
            x = torch.randn(1, lin.in_features)
            assert torch.equal(lin(x), eng.model.model.layers[1].self_attn.q_a_proj(x))  # the native op
    assert _layer_kernel(eng).kernels.path == pickle.loads(pickle.dumps(_layer_kernel(eng).kernels)).path


@pytest.mark.parametrize("opts", [{}, dict(index_topk=6, attention_bias=True)])
def test_decode_layer_kernel_on_int8_weights(kernels, opts):
    """INT8 engines (glm5.infer.quant): the layer kernel reads Int8Linear / Int8Experts weights (int8 rows times
    fp32 activations, then the per-channel scale: the "dequant" kernel's arithmetic) == the modules on
    decode steps of 1 and 2 sequences (incl. top-k selection); more than INT8_MAX_ROWS rows step aside."""
    from glm5.infer.input_batch import SeqChunk
    from glm5.infer.kernels import INT8_MAX_ROWS
    o = dict(device="cpu", dtype="float32", block_size=4, num_blocks=80, max_model_len=40, kernels="native",
             quantization="int8", int8_kernel="dequant")
    fast, plain = (LLMEngine(EngineConfig(**o), model=tiny_model(seed=9, **opts)) for _ in range(2))
    lk, ran = _layer_kernel(fast), []
    counted = lambda *a: (lambda r: ran.append(r is not None) or r)(lk(*a))  # noqa: E731
    gen = torch.Generator().manual_seed(3)
    n_seq = INT8_MAX_ROWS + 1
    seqs = [torch.randint(2, 500, (int(n),), generator=gen).tolist() for n in torch.randint(9, 16, (n_seq,), generator=gen)]
    blocks = [list(range(8 * i, 8 * i + 8)) for i in range(n_seq)]
    for eng in (fast, plain):
        for i, s in enumerate(seqs):
            _paged(eng, [SeqChunk(str(i), 0, s[:-3], blocks[i])], None)
    pos = [len(s) - 3 for s in seqs]  # each sequence's next position
    for rows in (1, 2, n_seq):  # decode steps of the first `rows` sequences
        chunks = [SeqChunk(str(i), pos[i], seqs[i][pos[i]:pos[i] + 1], blocks[i]) for i in range(rows)]
        for i in range(rows):
            pos[i] += 1
        n = len(ran)
        got, ref = _paged(fast, chunks, counted), _paged(plain, chunks, None)
        assert all(ran[n:]) == (rows <= INT8_MAX_ROWS) and any(ran[n:]) == (rows <= INT8_MAX_ROWS)
        assert torch.allclose(got.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_layer_kernel_takes_a_short_prompt(kernels):
    """A step holding one short prompt (<= LAYER_MAX_QUERIES tokens from position 0: causal within the chunk)
    runs on the layer kernel and equals the modules: logits of every position, cache rows."""
    from glm5.infer.input_batch import SeqChunk
    from glm5.infer.kernels import LAYER_MAX_QUERIES
    o = dict(device="cpu", dtype="float32", block_size=4, num_blocks=16, max_model_len=40, kernels="native")
    fast, plain = (LLMEngine(EngineConfig(**o), model=tiny_model(seed=10)) for _ in range(2))
    lk, ran = _layer_kernel(fast), []
    prompt = [5, 9, 2, 7, 3, 8][:LAYER_MAX_QUERIES]
    chunk = [SeqChunk("p", 0, prompt, list(range(4)))]
    got = _paged(fast, chunk, lambda *a: (lambda r: ran.append(r is not None) or r)(lk(*a)))
    ref = _paged(plain, chunk, None)
    assert ran and all(ran) and got.logits.shape[1] == len(prompt)
    assert torch.allclose(got.logits, ref.logits, atol=1e-5, rtol=1e-4)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fast.runner.cache.latent, plain.runner.cache.latent))


def test_the_layer_struct_mirror_is_checked_against_the_c_layout(kernels):
    """`LayerSpec` (ctypes) is compared with kernels.c's `layer_t` field by field when the library loads; a
    mirror with a field of the wrong type, a missing field or fields out of order is refused naming it."""
    import ctypes
    from glm5.native import LayerSpec, check_layout
    check_layout(kernels.lib, LayerSpec)  # the shipped mirror matches
    fields = list(LayerSpec._fields_)
    wrong_type = [(n, ctypes.c_long if n == "eps_in" else t) for n, t in fields]
    swapped = fields[:2][::-1] + fields[2:]
    for bad, name in ((wrong_type, "eps_in"), (fields[:-1], "s_dn"), (swapped, "D")):
        mirror = type("Mirror", (ctypes.Structure,), {"_fields_": bad})
        with pytest.raises(NativeError, match=name):
            check_layout(kernels.lib, mirror)


def test_a_model_option_the_layer_kernel_does_not_know_switches_it_off(kernels):
    """A config field the whole-layer kernel was not written for (a new model option, here a subclass of
    ModelConfig with one more field) set away from its default: the kernel steps aside on every layer and the
    engine still serves the model's own greedy tokens; at its default the kernel runs. Every field of today's
    ModelConfig is classified (computed with by the kernel, or outside one decoder layer's math)."""
    import dataclasses
    from glm5.infer.kernels import LAYER_KERNEL_FIELDS, OUTSIDE_THE_LAYER, unknown_options
    from glm5.infer.input_batch import SeqChunk
    from glm5.model.config import ModelConfig
    from glm5.model.model import GLM5ForCausalLM

    assert {f.name for f in dataclasses.fields(ModelConfig)} == LAYER_KERNEL_FIELDS | OUTSIDE_THE_LAYER

    @dataclasses.dataclass
    class NewOptionConfig(ModelConfig):
        new_option: float = 0.0

    base = tiny_model(seed=4).config
    opts = dict(device="cpu", dtype="float32", block_size=4, num_blocks=40, max_model_len=150, kernels="native")
    ids = list(range(3, 23))
    for value, expect in ((0.0, True), (0.5, False)):
        cfg = NewOptionConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(ModelConfig) if f.init},
                              new_option=value)
        assert unknown_options(cfg) == ([] if expect else ["new_option"])
        torch.manual_seed(4)
        model = GLM5ForCausalLM(cfg).init_weights(4).eval()
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1]
        eng = LLMEngine(EngineConfig(**opts), model=model)
        lk, ran = _layer_kernel(eng), []
        _paged(eng, [SeqChunk("s", 0, ids[:-1], list(range(8)))], lk)
        out = _paged(eng, [SeqChunk("s", len(ids) - 1, ids[-1:], list(range(8)))],
                     lambda *a: (lambda r: ran.append(r is not None) or r)(lk(*a)))
        assert ran and all(r == expect for r in ran)
        assert torch.allclose(out.logits[0, -1], ref, atol=1e-4)
