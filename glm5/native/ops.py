"""The native CPU kernels as typed PyTorch operators: `torch.ops.glm5_native.<name>`.

Each kernel of `NativeKernels` is declared once here with a schema (argument and result types, and which
argument an in-place op writes), a CPU implementation (the compiled kernel, `glm5.native.load()`) and a
fake implementation (the result's shape and dtype from the inputs' alone), so that:
  * the modules the engine swaps in (glm5/infer/kernels.py) call them like any aten op;
  * `torch.compile` traces through them without a graph break (the fake implementation stands in for the
    kernel while tracing), so a captured decode step can run the native kernels too;
  * `torch.library.opcheck` checks each schema against its implementation (tests/test_native_ops.py).

Nothing here decides *when* a kernel runs: the swapped modules check the case (no autograd, fp32, CPU,
layouts) and fall back to the model's own forward otherwise. The ops are registered on import; their CPU
implementations fail with `NativeError` when no compiler built the kernels (the engine never swaps the
modules in then).

Overhead: a `torch.library` op costs about 2-3 us of dispatch over a direct ctypes call here; the
`custom_op` decorator's Python wrapper about 6-7 us (measured on this 2-core machine, 1 thread), hence
`Library.define` / `impl`.
"""

from __future__ import annotations

import torch

from . import NativeError, load

NAMESPACE = "glm5_native"
_LIB = torch.library.Library(NAMESPACE, "DEF")


def _kernels():
    k = load()
    if k is None:
        raise NativeError("native CPU kernels are not available here (no C compiler built them)")
    return k


def _op(schema: str, impl, fake) -> None:
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(-2, -1)


# --- RMSNorm, linear layers, rotary ---------------------------------------------------------------------
_op("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    lambda x, weight, eps: _kernels().rms_norm(x, weight, eps),
    lambda x, weight, eps: torch.empty(x.shape, dtype=x.dtype, device=x.device))

_op("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
    lambda x, weight, bias: _kernels().linear(x, weight, bias),
    lambda x, weight, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))

_op("linear_int8(Tensor x, Tensor weight, Tensor scale, Tensor? bias) -> Tensor",
    lambda x, weight, scale, bias: _kernels().linear_int8(x, weight, scale, bias),
    lambda x, weight, scale, bias: x.new_empty(*x.shape[:-1], weight.shape[0]))

_op("swiglu(Tensor x, Tensor gate, Tensor up, Tensor down) -> Tensor",
    lambda x, gate, up, down: _kernels().swiglu(x, gate, up, down),
    lambda x, gate, up, down: x.new_empty(*x.shape[:-1], down.shape[0]))

_op("rope(Tensor x, Tensor cos, Tensor sin, bool interleave) -> Tensor",
    lambda x, cos, sin, interleave: _kernels().rope(x, cos, sin, interleave),
    lambda x, cos, sin, interleave: torch.empty(x.shape, dtype=x.dtype, device=x.device))


def _rope_heads_(x, cos, sin, rotary_dim):
    _kernels().rope_heads_(x, cos, sin, rotary_dim)


_op("rope_heads_(Tensor(a!) x, Tensor cos, Tensor sin, int rotary_dim) -> ()", _rope_heads_,
    lambda x, cos, sin, rotary_dim: None)


# --- MoE ---------------------------------------------------------------------------------------------------
def _route_fake(x, weight, bias, top_k, temperature, softmax, n_group, topk_group, norm_topk, scaling):
    N, E = x.shape[0], weight.shape[0]
    return (x.new_empty(N, E), x.new_empty(N, E), x.new_empty(N, top_k),
            torch.empty(N, top_k, dtype=torch.int64, device=x.device))


_op("route(Tensor x, Tensor weight, Tensor bias, int top_k, float temperature, bool softmax, int n_group, "
    "int topk_group, bool norm_topk, float scaling) -> (Tensor, Tensor, Tensor, Tensor)",
    lambda *a: _kernels().route(*a), _route_fake)

# gate_up [E, 2I, H] / down [E, H, I] as the experts module holds them, each matrix stored [in, out]
_op("moe(Tensor x, Tensor idx, Tensor weights, Tensor gate_up, Tensor down) -> Tensor",
    lambda x, idx, weights, gate_up, down: _kernels().moe(x, idx, weights, _t(gate_up), _t(down)),
    lambda x, idx, weights, gate_up, down: torch.empty(x.shape, dtype=x.dtype, device=x.device))


# --- attention over the paged cache -------------------------------------------------------------------------
_op("latent_decode(Tensor qq, Tensor latent, Tensor key_slots, Tensor bias, int kv_rank, float scale, "
    "int[]? key_lens) -> Tensor",
    lambda qq, latent, key_slots, bias, kv_rank, scale, key_lens:
        _kernels().latent_decode(qq, latent, key_slots, bias, kv_rank, scale, key_lens),
    lambda qq, latent, key_slots, bias, kv_rank, scale, key_lens: qq.new_empty(*qq.shape[:3], kv_rank))

_op("mla_decode(Tensor q_nope, Tensor q_rope, Tensor kv_b, Tensor latent, Tensor key_slots, Tensor bias, "
    "float scale, int[]? key_lens) -> Tensor",
    lambda q_nope, q_rope, kv_b, latent, key_slots, bias, scale, key_lens:
        _kernels().mla_decode(q_nope, q_rope, kv_b, latent, key_slots, bias, scale, key_lens),
    lambda q_nope, q_rope, kv_b, latent, key_slots, bias, scale, key_lens:
        q_rope.new_empty(*q_nope.shape[:3], kv_b.shape[0] // q_nope.shape[2] - q_nope.shape[3]))

_op("gqa_decode(Tensor q, Tensor cache, int num_kv_heads, Tensor key_slots, Tensor bias, float scale, "
    "int[]? key_lens) -> Tensor",
    lambda q, cache, num_kv_heads, key_slots, bias, scale, key_lens:
        _kernels().gqa_decode(q, cache, num_kv_heads, key_slots, bias, scale, key_lens),
    lambda q, cache, num_kv_heads, key_slots, bias, scale, key_lens: torch.empty(q.shape, dtype=q.dtype,
                                                                                   device=q.device))

_op("gqa_prefill(Tensor q, Tensor cache, int num_kv_heads, Tensor key_slots, float scale) -> Tensor",
    lambda q, cache, num_kv_heads, key_slots, scale: _kernels().gqa_prefill(q, cache, num_kv_heads, key_slots, scale),
    lambda q, cache, num_kv_heads, key_slots, scale: torch.empty(q.shape, dtype=q.dtype, device=q.device))

ops = getattr(torch.ops, NAMESPACE)
