"""The native kernels as typed operators (glm5/native/ops.py): each op's schema and fake implementation pass
`torch.library.opcheck`; the per-function kernels added with them (router, fused SwiGLU, int8 GEMV) equal the
model's own modules (`Router`, `SwiGLU`, `Int8Linear`) through the engine's module swap; and a swapped module
compiles with `torch.compile(fullgraph=True)` (the ops trace through their fake implementations)."""

import pytest
import torch
from torch import nn

from glm5.infer.kernels import (ROUTE_MAX_ROWS, NativeInt8Linear, NativeLinear, NativeRMSNorm, NativeRouter, NativeSwiGLU,
                                use_native_kernels)
from glm5.infer.layout import transpose_weights
from glm5.infer.quant import Int8Linear
from glm5.model.layers import RMSNorm, SwiGLU
from glm5.model.moe import Router
from glm5.native import NativeError, load

from ._tiny import tiny_config


@pytest.fixture(scope="module")
def ops():
    if load() is None:
        pytest.skip("no C compiler here: the native kernels cannot be built")
    from glm5.native.ops import ops
    return ops


def _stored_in_out(w: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight stored [in, out] row-major (the engine's CPU layout)."""
    return w.t().contiguous().t()


def test_every_op_passes_opcheck(ops):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=g), torch.randn(40, generator=g)
    lin = _stored_in_out(torch.randn(24, 40, generator=g))
    gate, up = _stored_in_out(torch.randn(16, 40, generator=g)), _stored_in_out(torch.randn(16, 40, generator=g))
    down = _stored_in_out(torch.randn(40, 16, generator=g))
    w8, sc = torch.randint(-127, 128, (24, 40), dtype=torch.int8, generator=g), torch.rand(24, generator=g)
    cases = [(ops.rms_norm, (x, w, 1e-6)), (ops.linear, (x, lin, None)), (ops.linear, (x, lin, torch.randn(24))),
             (ops.swiglu, (x, gate, up, down)), (ops.linear_int8, (x, w8, sc, None)),
             (ops.route, (x, torch.randn(8, 40, generator=g), torch.zeros(8), 2, 1.0, False, 4, 2, True, 2.5)),
             (ops.rope, (torch.randn(3, 2, 8, generator=g), torch.rand(3, 1, 4), torch.rand(3, 1, 4), True)),
             (ops.gqa_prefill, (torch.randn(5, 4, 8, generator=g), torch.randn(16, 32, generator=g), 2,
                                torch.randperm(16, generator=g)[:5], 0.3))]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("opts", [dict(), dict(n_group=4, topk_group=2), dict(scoring_func="softmax"),
                                  dict(norm_topk_prob=False, routed_scaling_factor=1.0, router_temperature=2.0)])
def test_router_kernel_equals_the_router(ops, opts):
    """Same experts per token (as a set: the kernel returns them best first) with the same weights, logits
    and scores, on rows with a correction bias that changes the choice."""
    cfg = tiny_config(n_routed_experts=16, num_experts_per_tok=3, **opts)
    torch.manual_seed(1)
    ref = Router(cfg)
    nn.init.normal_(ref.weight, std=0.3)
    ref.e_score_correction_bias.normal_(0, 0.2)
    fast = use_native_swap(ref)
    assert type(fast) is NativeRouter
    x = torch.randn(37, cfg.hidden_size)
    with torch.no_grad():
        lr, sr, wr, ir = ref(x)
        # the kernel serves steps of up to ROUTE_MAX_ROWS rows (larger ones run the module's own forward)
        lf, sf, wf, i_f = (torch.cat(t) for t in zip(*(fast(c) for c in x.split(ROUTE_MAX_ROWS))))
    assert torch.allclose(lf, lr, atol=1e-5) and torch.allclose(sf, sr, atol=1e-6)
    order_r, order_f = ir.sort(-1), i_f.sort(-1)
    assert torch.equal(order_r.values, order_f.values)
    assert torch.allclose(wr.gather(1, order_r.indices), wf.gather(1, order_f.indices), atol=1e-6)
    chosen = (sf + ref.e_score_correction_bias).gather(1, i_f)
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all())  # best choice (score + correction bias) first


def test_router_kernel_refuses_groups_that_cannot_choose(ops):
    with pytest.raises(NativeError, match="cannot choose"):
        ops.route(torch.randn(2, 8), torch.randn(16, 8), torch.zeros(16), 6, 1.0, False, 8, 2, True, 1.0)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_swiglu_kernel_equals_the_module(ops, rows):
    torch.manual_seed(rows)
    ref = SwiGLU(48, 40)
    for lin in (ref.gate_proj, ref.up_proj, ref.down_proj):
        nn.init.normal_(lin.weight, std=0.2)
    fast = use_native_swap(ref)
    assert type(fast) is NativeSwiGLU and type(fast.gate_proj) is NativeLinear
    x = torch.randn(rows, 48)
    wide = torch.randn(rows, 96)[:, 10:58]  # rows evenly spaced, not contiguous
    with torch.no_grad():
        for v in (x, wide):
            assert torch.allclose(fast(v), ref(v), atol=1e-5)
        many = torch.randn(9, 48)  # past SWIGLU_MAX_ROWS: the module's own forward
        assert torch.allclose(fast(many), ref(many), atol=1e-5)


def test_int8_linear_kernel_equals_the_module(ops):
    """The weight-only int8 product (int8 rows times fp32 activations, then the per-channel scale) == the module
    on its accurate "dequant" kernel; an "int_mm" (W8A8) module keeps its own forward."""
    torch.manual_seed(3)
    base = nn.Linear(72, 40, bias=True)
    ref = Int8Linear(base, {"small": "dequant", "large": "dequant"})
    fast = use_native_swap(ref)
    assert type(fast) is NativeInt8Linear
    with torch.no_grad():
        for rows in (1, 5, 8):
            x = torch.randn(rows, 72)
            assert torch.allclose(fast(x), ref(x), atol=1e-4, rtol=1e-5)
    w8a8 = use_native_swap(Int8Linear(base, {"small": "int_mm", "large": "int_mm"}))
    x = torch.randn(2, 72)
    with torch.no_grad():
        assert torch.equal(w8a8(x), Int8Linear.forward(w8a8, x))


def test_a_swapped_module_compiles_whole(ops):
    """`torch.compile(fullgraph=True)` of a native-swapped SwiGLU + RMSNorm: no graph break (the ops trace
    through their fake implementations) and the compiled function computes what the eager modules do."""
    torch.manual_seed(4)
    mlp, norm = SwiGLU(32, 24), RMSNorm(32)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    holder = nn.Sequential(norm, mlp)
    transpose_weights(holder)
    use_native_kernels(holder, load())
    assert type(holder[0]) is NativeRMSNorm and type(holder[1]) is NativeSwiGLU
    fn = torch.compile(lambda x: holder[1](holder[0](x)) + x, fullgraph=True, backend="eager")
    x = torch.randn(2, 32)
    with torch.no_grad():
        assert torch.allclose(fn(x), holder[1](holder[0](x)) + x, atol=1e-6)


def use_native_swap(mod: nn.Module) -> nn.Module:
    """mod as the engine serves it on CPU: weights stored [in, out], then the native module swap."""
    holder = nn.ModuleDict({"m": mod})
    transpose_weights(holder)
    use_native_kernels(holder, load())
    return holder["m"]
