"""The captured decode step (glm5/infer/graphs.py) against the engine's eager forward on tiny configs: the
bucketed step on its persistent buffers (padding rows on a scratch block, keys padded to the static bound,
DSA top-k selecting) equals the normal paged step; it traces whole (no graph break); torch.compile of it
equals eager; the engine with `compile_decode` produces the eager engine's greedy tokens, reports its build
time, and falls back to eager with one warning when the build fails. CUDA graphs: replay vs eager (gpu)."""

import copy
import logging

import pytest
import torch

from glm5.infer.config import EngineConfig
from glm5.infer.engine import LLMEngine
from glm5.infer.graphs import DecodeBuffers, DecodeGraphs, bucket_sizes, decode_step, key_bounds
from glm5.infer.input_batch import SeqChunk, build_metadata
from glm5.infer.sampling import SamplingParams
from glm5.model.kv_cache import LatentKVCache
from glm5.native import load as load_native

from ._tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK, NUM_BLOCKS, KEYS = 4, 16, 40  # KEYS: the static key bound (max_model_len), 10 blocks of 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# DSA top-k 6 below most contexts here: the bucket selects over its padded keys, as the eager step over its own
MODEL_KW = dict(index_topk=6, num_hidden_layers=3, index_topk_freq=2, index_skip_topk_offset=1)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, bias_std=0.1, **MODEL_KW)


def filled_cache(model, device="cpu", dtype=torch.float32) -> LatentKVCache:
    """A cache with one scratch block past the pool (block NUM_BLOCKS) and random rows everywhere."""
    cache = LatentKVCache(model.config, NUM_BLOCKS + 1, BLOCK, dtype=dtype, device=device)
    g = torch.Generator().manual_seed(1)
    for t in cache.latent + [k for k in cache.index_k if k is not None]:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def decode_chunks() -> list[SeqChunk]:
    """Three decode rows of 10, 3 and 7 keys (the new token is the last), in step order."""
    return [SeqChunk("a", 9, [11], [1, 2, 3]), SeqChunk("b", 2, [12], [4]), SeqChunk("c", 6, [13], [5, 6])]


def eager_logits(model, cache, chunks) -> torch.Tensor:
    ids, meta = build_metadata(chunks, BLOCK, "cpu")
    return model(ids[None], attn_metadata=meta, kv_cache=cache).logits[0]


def bucket(chunks, rows: int = 4, device="cpu") -> DecodeBuffers:
    buf = DecodeBuffers.allocate(rows, -(-KEYS // BLOCK), torch.device(device))
    buf.fill(chunks, BLOCK, NUM_BLOCKS)
    return buf


def test_bucket_sizes_and_key_bounds():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    assert key_bounds(40, 4) == [40]
    assert key_bounds(1000, 16) == [256, 512, 1000]
    assert key_bounds(40, 4, min_keys=7) == [8, 16, 32, 40]


@torch.inference_mode()
def test_buckets_by_rows_and_key_bound(model):
    """Steps land in the smallest (rows, keys) bucket; each bucket's logits equal the eager step's."""
    graphs = DecodeGraphs(model, filled_cache(model), "inductor", [1, 2, 4], BLOCK, KEYS, NUM_BLOCKS,
                          backend="eager", min_keys=8)
    ref_cache = filled_cache(model)
    assert graphs.bucket_for(decode_chunks()[:2]) == (2, 16)
    for chunks, key in ((decode_chunks(), (4, 16)), (decode_chunks()[1:2], (1, 8))):  # (a trace each: ~5 s)
        assert graphs.bucket_for(chunks) == key
        got, stats = graphs.run(chunks)
        assert torch.allclose(got, eager_logits(model, ref_cache, chunks), atol=1e-5), key
        assert len(stats) == len(model.config.moe_layers)
    assert sorted(graphs.compile_seconds) == [(1, 8), (4, 16)] and graphs.disabled is None
    assert graphs.bucket_for([SeqChunk("x", 0, [1], [1])] * 5) is None  # more rows than the largest bucket


@torch.inference_mode()
def test_bucketed_step_equals_the_eager_step_and_pads_on_the_scratch_block(model):
    chunks = decode_chunks()
    ref_cache, cache = filled_cache(model), filled_cache(model)
    ref = eager_logits(model, ref_cache, chunks)
    buf = bucket(chunks)
    assert buf.block_table[3].tolist() == [NUM_BLOCKS] * buf.block_table.shape[1]  # the dummy row
    assert buf.slot_mapping.tolist() == [3 * BLOCK + 1, 4 * BLOCK + 2, 6 * BLOCK + 2, NUM_BLOCKS * BLOCK]
    logits, idx = decode_step(model, cache, buf, KEYS, BLOCK)
    assert logits.shape == (4, model.config.vocab_size)
    assert torch.allclose(logits[:3], ref, atol=1e-5), (logits[:3] - ref).abs().max()
    assert len(idx) == len(model.config.moe_layers) and idx[0].shape == (4, model.config.num_experts_per_tok)
    pool = slice(0, NUM_BLOCKS * BLOCK)  # the real rows' writes equal the eager step's; padding wrote the scratch
    for got, want in zip(cache.latent + cache.index_k, ref_cache.latent + ref_cache.index_k):
        if got is not None:
            assert torch.allclose(got[pool], want[pool], atol=1e-6)
    assert not torch.equal(cache.latent[0][NUM_BLOCKS * BLOCK], ref_cache.latent[0][NUM_BLOCKS * BLOCK])


@torch.inference_mode()
def test_step_traces_without_graph_breaks(model):
    explained = torch._dynamo.explain(decode_step)(model, filled_cache(model), bucket(decode_chunks()), KEYS, BLOCK)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.slow
@torch.inference_mode()
def test_inductor_compiled_step_equals_eager(model):
    """torch.compile(fullgraph=True) with the inductor backend (C++ codegen on CPU): ~30-60 s here."""
    chunks = decode_chunks()
    ref = decode_step(model, filled_cache(model), bucket(chunks), KEYS, BLOCK)[0]
    step = torch.compile(decode_step, fullgraph=True, dynamic=False)
    got = step(model, filled_cache(model), bucket(chunks), KEYS, BLOCK)[0]
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def engine(model, **kw) -> LLMEngine:
    opts = dict(device="cpu", kernels="torch", num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=KEYS,
                max_num_batched_tokens=16, max_num_seqs=4)
    return LLMEngine(EngineConfig(**{**opts, **kw}), model=model)


def greedy(e: LLMEngine, prompts) -> list[list[int]]:
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY)
    done = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in (3, 11, 19)]


@pytest.fixture(scope="module")
def eager_tokens(model, prompts):
    return greedy(engine(model), prompts)


def test_engine_captured_decode_equals_eager_engine(model, prompts, eager_tokens):
    """The engine path (buckets, buffers, scratch block, logit rows, router stats) with dynamo's `eager`
    backend: the whole step is still traced with fullgraph=True, without inductor's code generation."""
    e = engine(model, compile_decode="inductor", compile_backend="eager")
    assert greedy(e, prompts) == eager_tokens
    stats = e.get_stats()
    assert stats["decode_graph_steps"] > 0 and stats["decode_compile_disabled"] is None
    assert stats["decode_compiled_buckets"] and stats["decode_compile_s"] > 0
    assert {rows for rows, _ in stats["decode_compiled_buckets"]} <= {1, 2, 4}
    assert {keys for _, keys in stats["decode_compiled_buckets"]} == {KEYS}  # one key bound below 256 keys
    load = stats["expert_load"]  # padding rows are not counted: the same expert load as the eager engine
    assert load == engine_load(model, prompts)


def test_native_kernels_step_traces_whole_and_equals_eager(model, prompts, eager_tokens):
    """With the native CPU kernels swapped in (typed ops with fake implementations, glm5/native/ops.py) the
    captured step still traces whole (fullgraph) and serves the eager engine's greedy tokens; the whole-layer
    kernel steps aside inside a captured step."""
    if load_native() is None:
        pytest.skip("no C compiler here: the native kernels cannot be built")
    e = engine(copy.deepcopy(model), compile_decode="inductor", compile_backend="eager", kernels="native")
    assert e.kernels is not None
    assert greedy(e, prompts) == eager_tokens
    stats = e.get_stats()
    assert stats["decode_graph_steps"] > 0 and stats["decode_compile_disabled"] is None


def engine_load(model, prompts) -> dict:
    e = engine(model)
    greedy(e, prompts)
    return e.get_stats()["expert_load"]


@pytest.mark.slow
def test_inductor_engine_equals_eager_engine(model, prompts, eager_tokens):
    """Inductor's code (its in-place cache writes included: later steps read them) over whole requests:
    one compile per bucket the steps reach (~30-60 s each here)."""
    for kernels in ("torch", "native"):
        e = engine(copy.deepcopy(model), compile_decode="inductor", kernels=kernels)
        assert greedy(e, prompts) == eager_tokens
        stats = e.get_stats()
        assert stats["decode_graph_steps"] > 0 and stats["decode_compile_disabled"] is None


def test_build_failure_falls_back_to_eager_with_one_warning(model, prompts, eager_tokens, caplog):
    e = engine(model, compile_decode="inductor", compile_backend="no_such_backend")
    with caplog.at_level(logging.WARNING, logger="glm5.infer.graphs"):
        assert greedy(e, prompts) == eager_tokens
    warnings = [r for r in caplog.records if r.name == "glm5.infer.graphs"]
    assert len(warnings) == 1 and "decode runs eagerly" in warnings[0].getMessage()
    stats = e.get_stats()
    assert stats["decode_graph_steps"] == 0 and "no_such_backend" in stats["decode_compile_disabled"]


def test_unsupported_experts_and_devices(model):
    e = engine(tiny_model(seed=3, **MODEL_KW), compile_decode="inductor", quantization="int8")  # (quantizes it)
    assert "routed experts" in e.get_stats()["decode_compile_disabled"]
    assert e.runner.graphs.run(decode_chunks()) is None
    assert engine(model, compile_decode="inductor", enforce_eager=True).runner.graphs is None
    auto = engine(model, compile_decode="inductor", kernels="auto")  # auto: the PyTorch kernels, so it is on
    assert auto.kernels is None and auto.get_stats()["decode_compile_disabled"] is None
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graphs.*CUDA"):
            engine(model, compile_decode="cuda_graphs")


@pytest.mark.gpu
@torch.inference_mode()
def test_cuda_graph_replay_equals_eager_step(model):
    """bf16 (CUDA `_grouped_mm` runs bf16): the replayed graph against the same step run eagerly."""
    from glm5.model.hf_adapter import cast_model
    m = cast_model(tiny_model(seed=3, bias_std=0.1, **MODEL_KW), torch.bfloat16).cuda()
    chunks = decode_chunks()
    cache = lambda: filled_cache(m, "cuda", torch.bfloat16)  # noqa: E731
    ref = decode_step(m, cache(), bucket(chunks, device="cuda"), KEYS, BLOCK)[0][:3].float()
    graphs = DecodeGraphs(m, cache(), "cuda_graphs", [4], BLOCK, KEYS, NUM_BLOCKS)
    got, _ = graphs.run(chunks)  # captures (warm-up + record), then replays
    assert graphs.disabled is None, graphs.disabled
    assert torch.allclose(got.float(), ref, atol=2e-2), (got.float() - ref).abs().max()
    again, _ = graphs.run(chunks)  # a second replay over the refilled buffers (the cache rows are rewritten)
    assert torch.allclose(again.float(), ref, atol=2e-2) and graphs.num_steps == 2


@pytest.mark.parametrize("arch", ["glm4_moe", "glm4_moe_lite"])
@torch.inference_mode()
def test_other_architectures_step_equals_eager_and_traces_whole(arch):
    """GLM-4.5-style GQA (paged [k | v] rows) and GLM-4.7-Flash-style MLA without the indexer."""
    from .test_engine_glm4 import ARCHS
    from .test_hf_glm4 import _model
    m = _model({**ARCHS[arch], "num_nextn_predict_layers": 0}, seed=7).eval()
    chunks = decode_chunks()
    ref = eager_logits(m, filled_cache(m), chunks)
    got = decode_step(m, filled_cache(m), bucket(chunks), KEYS, BLOCK)[0][:3]
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    explained = torch._dynamo.explain(decode_step)(m, filled_cache(m), bucket(chunks), KEYS, BLOCK)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_lora_slots_base_rows_still_captured(model, prompts, eager_tokens):
    """With multi-LoRA slots (swapped LoRA modules, no adapter rows in these steps) the step still traces
    whole and serves the eager engine's tokens; steps with adapter rows run eagerly (runner._captured)."""
    e = engine(model, compile_decode="inductor", compile_backend="eager", max_loras=1)
    assert greedy(e, prompts) == eager_tokens
    stats = e.get_stats()
    assert stats["decode_graph_steps"] > 0 and stats["decode_compile_disabled"] is None
