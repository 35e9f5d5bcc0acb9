"""Native CPU kernels in the served model (`EngineConfig.kernels`), chosen once at engine build by module swap.

Each swapped module is a subclass of the model's own module holding the same Parameter objects (same
state_dict keys; in-place writes such as an expert hot swap land in them) whose no-grad fp32 CPU forward
calls a typed operator of glm5/native (`torch.ops.glm5_native.*`, glm5/native/ops.py) for the cases the
kernel covers and the inherited PyTorch forward for every other (autograd, other dtypes or devices, other
layouts, sizes where PyTorch is faster): the swap never changes what the model computes, only how fast.
The model's Python forward stays the one statement of each layer; the tuned size bounds below are the
only place that decides which path a step takes, each with the measurement that set it.

  RMSNorm -> NativeRMSNorm          nn.Linear ([in, out]-stored) -> NativeLinear
  Int8Linear -> NativeInt8Linear    SwiGLU (dense MLP, shared expert) -> NativeSwiGLU
  Router -> NativeRouter            Experts -> NativeExperts (routed experts)
  MLAttention -> NativeMLAttention  (rotary, dense latent attention, fused small-step MLA)
  GQAttention -> NativeGQAttention  (rotary in place, decode attention over the paged cache)
  DecoderLayer -> NativeDecoderLayer (the whole-layer decode kernel, see below)

Measured on the bench's 64-expert checkpoint (7 MoE layers, 1 thread, `grouped_experts` time / kernel
time): 3.1x for one token, 1.9x for 8 and 64 decode rows, 1.3-1.8x for 256-2,048 prefill tokens (BLAS
GEMMs plus the gather/scale/scatter around them vs one pass per expert; docs/bench-engine.md).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from glm5.model.attention import MLAttention, _rows
from glm5.model.gqa_attention import GQAttention
from glm5.model.layers import RMSNorm, SwiGLU
from glm5.model.model import DecoderLayer, MTPLayer
from glm5.model.moe import LOOP_MIN_ROWS_PER_EXPERT, Experts, MoE, Router, expert_loop, swiglu
from glm5.model.paged import AttnGroup, PagedContext
from glm5.native import LayerSpec, NativeKernels, key_table, rows_stride
from glm5.native.ops import ops

from .layout import is_transposed
from .onednn import ONEDNN_MIN_ROWS, OneDNNWeight
from .quant import Int8Experts, Int8Linear


def _cpu_f32(x: torch.Tensor) -> bool:
    """The case every kernel covers: no autograd, an fp32 CPU tensor."""
    return not torch.is_grad_enabled() and x.dtype == torch.float32 and x.device.type == "cpu"


class NativeExperts(Experts):
    """`Experts` whose no-grad fp32 CPU forward runs the native MoE kernel (`glm5_moe`: the gather, both
    GEMMs, SwiGLU, weighting and the per-token sum in one call) over the [in, out]-stored weights.

    Steps of at least `LOOP_MIN_ROWS_PER_EXPERT` assignments per expert (prefill chunks, wide batches) take
    it too where its GEMM has wide (AVX-512) tiles (`wide_gemm`, from `NativeKernels.gemm_width` at the
    swap); with 16-column tiles they take the model's per-expert loop instead, on oneDNN GEMMs when the
    engine packed the weights (`use_onednn`). Measured on one layer of the bench checkpoint (64 experts of
    192, top-4, 1 thread, Zen 5, 2026-12-08): 2,048 tokens 22-24 ms native against 27-31 ms for the
    oneDNN loop; 256 tokens 5.5-6.5 against 8.5-9.6 ms."""

    onednn: tuple[list[OneDNNWeight], list[OneDNNWeight]] | None = None  # per expert: gate_up, down
    wide_gemm: bool = False  # the native GEMM has 32-column tiles: it serves prefill-sized steps too

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None = None, static_shapes: bool = False) -> torch.Tensor:
        gu, dn = self.gate_up_proj, self.down_proj
        loop = (idx.numel() >= LOOP_MIN_ROWS_PER_EXPERT * self.n_experts and not static_shapes
                and not self.wide_gemm)
        if loop and self.onednn is not None and _cpu_f32(x):  # the model's per-expert loop on oneDNN GEMMs
            gus, dns = self.onednn
            return expert_loop(x, idx, weights, keep, self.n_experts,
                               lambda e, xs: swiglu(xs, gus[e], dns[e], OneDNNWeight.apply) if len(xs) >= ONEDNN_MIN_ROWS
                               else swiglu(xs, gu[e], dn[e]))
        if (not _cpu_f32(x) or loop or gu.dtype != torch.float32 or not (is_transposed(gu) and is_transposed(dn))):
            return super().forward(x, idx, weights, keep, static_shapes)
        w = weights if keep is None else weights * keep
        return ops.moe(x.contiguous(), idx, w, gu, dn)


class NativeRMSNorm(RMSNorm):
    """`RMSNorm` whose no-grad fp32 CPU forward is one kernel call instead of PyTorch's composite
    (pow, mean, add, rsqrt, two products: ~27 us a call for one 384-wide row; the decode step runs 4 per
    layer)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (not _cpu_f32(x) or rows_stride(x) is None or type(w) is not nn.Parameter or w.dtype != torch.float32):
            return super().forward(x)
        return ops.rms_norm(x, w, self.eps)


# NativeLinear runs the kernel for at most this many rows and weights up to this size: measured at 1 thread
# on the bench checkpoint's projections (MKL / kernel time, cold weights): 1.2-1.9x at 1 row, 1.1-1.9x at 4,
# 0.9-1.4x at 8; the 12.6 MB LM head 0.73x at 1 row (BLAS streams a large weight well, a small one at 6-12
# GB/s).
LINEAR_MAX_ROWS = 4
LINEAR_MAX_BYTES = 4 << 20


class NativeLinear(nn.Linear):
    """`nn.Linear` whose no-grad fp32 CPU forward on a few rows (decode) runs the native linear kernel over
    the [in, out]-stored weight, and on ONEDNN_MIN_ROWS rows or more oneDNN's GEMM over a prepacked copy when
    the engine packed one (`use_onednn`); everything else (other layouts, autograd) is `F.linear`."""

    onednn: OneDNNWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not _cpu_f32(x) or w.dtype != torch.float32 or type(w) is not nn.Parameter:
            return super().forward(x)
        if self.onednn is not None and x.numel() >= ONEDNN_MIN_ROWS * w.shape[1]:
            return self.onednn.linear(x, self.bias)
        if (not 0 < x.numel() <= LINEAR_MAX_ROWS * w.shape[1] or w.stride() != (1, w.shape[0])
                or w.numel() * 4 > LINEAR_MAX_BYTES or rows_stride(x) is None):
            return super().forward(x)
        return ops.linear(x, w, self.bias)


# NativeSwiGLU runs the fused kernel (gate, up, SiLU x up, down in one call) for at most this many rows: the
# same regime as NativeLinear's (the three projections are decode-sized GEMVs).
SWIGLU_MAX_ROWS = LINEAR_MAX_ROWS


class NativeSwiGLU(SwiGLU):
    """`SwiGLU` (a dense MLP or the shared expert) whose no-grad fp32 CPU forward on a few rows is one kernel
    call: the three [in, out]-stored projections and the SiLU x up product without the intermediate tensors.
    Its projections are the model's modules (swapped to `NativeLinear` themselves), used for every other case."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        if (not _cpu_f32(x) or not 0 < x.numel() <= SWIGLU_MAX_ROWS * x.shape[-1] or rows_stride(x) is None
                or type(g) is not NativeLinear or type(u) is not NativeLinear or type(d) is not NativeLinear
                or g.bias is not None or u.bias is not None or d.bias is not None):
            return super().forward(x)
        gw, uw, dw = g.weight, u.weight, d.weight
        if not all(w.dtype == torch.float32 and w.stride() == (1, w.shape[0]) for w in (gw, uw, dw)):
            return super().forward(x)
        return ops.swiglu(x, gw, uw, dw)


# Int8 linear layers (and the whole-layer kernel on INT8 weights, below) run the native int8 kernel for at most
# this many rows: it reads each weight row once per input row (decode sizes); larger steps run the modules'
# own int8 GEMMs (glm5.infer.quant.int8_linear).
INT8_MAX_ROWS = 8


class NativeInt8Linear(Int8Linear):
    """`Int8Linear` whose no-grad fp32 CPU forward on a few rows runs the native int8 kernel (each int8
    weight row converted in registers and dotted with the fp32 rows, then scaled: a quarter of the fp32 weight
    stream). That is the weight-only product exactly ("dequant"'s arithmetic; "int8pack" computes it with bf16
    activations), so it serves modules on either kernel; a module on "int_mm" (W8A8: activations quantised
    too) keeps its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight_int8
        if (not _cpu_f32(x) or not 0 < x.numel() <= INT8_MAX_ROWS * w.shape[1] or rows_stride(x) is None
                or self.kernels["small"] == "int_mm"
                or not w.is_contiguous() or self.scale.dtype != torch.float32
                or (self.bias is not None and self.bias.dtype != torch.float32)):
            return super().forward(x)
        return ops.linear_int8(x, w, self.scale, self.bias)


# NativeRouter runs the kernel for at most this many rows: its logits loop is a GEMV per row. Measured on the
# glm4_moe bench checkpoint's router (64 experts, 384 wide, 1 thread, 2026-12-07), kernel / module time:
# 0.76 at 1 row, 1.04 at 8, 1.6 at 64, 1.9 at 256, 1.3 at 2,048.
ROUTE_MAX_ROWS = 8


class NativeRouter(Router):
    """`Router` whose no-grad fp32 CPU forward is one kernel call (logits, sigmoid / softmax scores, the
    correction bias for the choice, group-limited top-k, weights renormalised and scaled) instead of ~15
    PyTorch ops. Chosen experts come best first (the module's top-k is unsorted; the MoE sums per token)."""

    def forward(self, x: torch.Tensor):
        cfg, w, b = self.cfg, self.weight, self.e_score_correction_bias
        if (not _cpu_f32(x) or x.numel() > ROUTE_MAX_ROWS * x.shape[-1] or rows_stride(x) is None
                or cfg.scoring_func not in ("sigmoid", "softmax")
                or self.n_experts > 1024 or type(w) is not nn.Parameter or w.dtype != torch.float32
                or not w.is_contiguous() or b.dtype != torch.float32 or not b.is_contiguous()):
            return super().forward(x)
        G = max(cfg.n_group, 1)
        return ops.route(x, w, b, self.top_k, float(cfg.router_temperature), cfg.scoring_func == "softmax", G,
                         cfg.topk_group if G > 1 else 1, bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor))


# NativeMLAttention runs the fused absorbed MLA (W_uk, attention, W_uv in one call per group) for steps of at
# most this many tokens: it applies W_uk / W_uv per query row, which beats two batched matmuls over the step
# only for very few rows (bench checkpoint, 1 thread, CPU time per decode step fused / split: 0.94 at 1
# sequence, 1.07 at 8, 1.09 at 64)
FUSED_MLA_MAX_ROWS = 2


class NativeMLAttention(MLAttention):
    """`MLAttention` whose rotary embedding, dense latent attention and (small steps) whole absorbed path of
    a group run the native kernels in the no-grad fp32 CPU case; the projections, norms, indexer, cache
    writes and everything else are the module's own."""

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        P = x.shape[-1]
        if (not _cpu_f32(x) or cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous())
                or cos.shape[-1] != P // 2 or P % 2 or rows_stride(x) is None or x.numel() == 0
                or x.numel() % cos.numel()):
            return super().rotate(x, cos, sin)
        return ops.rope(x, cos, sin, bool(self.cfg.rope_interleave))

    def dense_latent(self, g: AttnGroup, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        if not _cpu_f32(q) or latent.dtype != torch.float32:
            return super().dense_latent(g, q, latent)
        return ops.latent_decode(q, latent, g.key_slots, g.key_bias, self.kv_rank, self.scale, g.key_lens)

    def fuses_absorbed(self, ctx: PagedContext) -> bool:
        meta = ctx.meta
        if meta.adapter_ids is not None or meta.num_tokens > FUSED_MLA_MAX_ROWS or torch.is_grad_enabled():
            return False
        mod = self.kv_b_proj
        if type(mod) is not nn.Linear or nn.utils.parametrize.is_parametrized(mod):
            return False
        w = mod.weight
        return (type(w) is nn.Parameter and w.is_contiguous() and w.dtype == torch.float32 and w.device.type == "cpu"
                and ctx.cache.latent[self.layer_idx].dtype == torch.float32)

    def absorbed_heads(self, g: AttnGroup, q_nope: torch.Tensor, q_rope: torch.Tensor,
                       latent: torch.Tensor) -> torch.Tensor:
        if not (_cpu_f32(q_nope) and q_rope.dtype == torch.float32):
            return super().absorbed_heads(g, q_nope, q_rope, latent)
        return ops.mla_decode(q_nope, q_rope, self.kv_b_proj.weight, latent, g.key_slots, g.key_bias, self.scale,
                              g.key_lens)


# NativeGQAttention runs groups of at most this many queries per sequence in the kernel (decode steps, draft
# verification, short chunks); longer chunks keep the module's own products / SDPA. The MLA layer kernel's
# bound (LAYER_MAX_QUERIES below), not tuned separately for GQA; what the kernel gives at decode is in
# docs/bench-engine.md ("vs vLLM-CPU on glm4_moe").
GQA_MAX_QUERIES = 8


class NativeGQAttention(GQAttention):
    """`GQAttention` whose no-grad fp32 CPU attention of a decode-sized group (`_attend_group`) is one
    native call over the paged [k | v] cache rows: no per-step gather of keys and values into [B, G, S, D],
    no score tensor, no mask addition and softmax as separate ops; a sequence's first chunk (a prompt's
    prefill) is one call of the causal block kernel (`gqa_prefill`: 0.58 vs 1.25-1.35 ms for SDPA or the
    module's own products on 256 tokens, 6 heads over 2 of 64, 1 thread); and the rotary embedding in place.
    The projections, norms and cache writes are the module's own (`project`, `write_kv`); everything else is
    inherited."""

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place on x [B, T, H, D] (`project` hands it the fresh output of a projection or a norm): one
        kernel call instead of slicing, six products and two concatenations."""
        B, T = x.shape[:2]
        if (not _cpu_f32(x) or cos.dtype != torch.float32 or x.stride(-1) != 1
                or not (B == 1 or x.stride(0) == T * x.stride(1))
                or cos.numel() != B * T * (self.rotary_dim // 2) or not (cos.is_contiguous() and sin.is_contiguous())):
            return super()._rotate(x, cos, sin)
        ops.rope_heads_(x, cos.view(B, T, -1), sin.view(B, T, -1), self.rotary_dim)
        return x

    def _attend_group(self, g: AttnGroup, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if not _cpu_f32(q) or rows.dtype != torch.float32 or not rows.is_contiguous():
            return super()._attend_group(g, q, rows)
        if g.q_index.shape[1] <= GQA_MAX_QUERIES:
            return ops.gqa_decode(_rows(g, q), rows, self.n_kv, g.key_slots, g.key_bias, self.scale, g.key_lens)
        if g.causal_from_start:  # a sequence's first chunk: causal block attention, no [T, S] mask or scores
            return ops.gqa_prefill(_rows(g, q)[0], rows, self.n_kv, g.key_slots[0], self.scale)[None]
        return super()._attend_group(g, q, rows)


def _swapped(cls: type, mod: nn.Module, **extra) -> nn.Module:
    """An instance of `cls` (a native subclass of mod's class) sharing mod's state: the same Parameter,
    buffer and submodule objects, not copies."""
    new = cls.__new__(cls)
    new.__dict__.update(mod.__dict__)  # _parameters / _buffers / _modules dicts are copied below
    new._parameters, new._buffers, new._modules = dict(mod._parameters), dict(mod._buffers), dict(mod._modules)
    new.__dict__.update(extra)
    return new


# the model's module class -> its native subclass (exact classes only: a LoRA, offloaded, tensor-parallel or
# otherwise specialised module keeps its own forward)
SWAPS: dict[type, type] = {Experts: NativeExperts, RMSNorm: NativeRMSNorm, nn.Linear: NativeLinear,
                           SwiGLU: NativeSwiGLU, Int8Linear: NativeInt8Linear, Router: NativeRouter,
                           MLAttention: NativeMLAttention, GQAttention: NativeGQAttention}


def use_native_kernels(model: nn.Module, kernels: NativeKernels, layer_kernel: bool = True) -> int:
    """Swap every module of a class in `SWAPS` (not parametrised; linear layers only when stored [in, out])
    for its native subclass, and (layer_kernel) every decoder layer for `NativeDecoderLayer`; returns how
    many modules were swapped. Children first, so a swapped parent holds its swapped children."""
    n = 0
    for parent in reversed(list(model.modules())):
        for name, child in list(parent.named_children()):
            cls = SWAPS.get(type(child))
            if cls is None or nn.utils.parametrize.is_parametrized(child):
                continue
            if cls is NativeLinear and not is_transposed(child.weight):
                continue  # (kv_b_proj stays: the absorbed attention reads it as a matrix)
            extra = {"wide_gemm": kernels.gemm_width >= 32} if cls is NativeExperts else {}
            setattr(parent, name, _swapped(cls, child, **extra))
            n += 1
    if not layer_kernel:
        return n
    shared = NativeLayerKernel(kernels)  # one for the model: its key table is built once per step
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) in (DecoderLayer, MTPLayer):
                cls = NativeDecoderLayer if type(child) is DecoderLayer else NativeMTPLayer
                setattr(parent, name, _swapped(cls, child, layer_kernel=shared))
                n += 1
    return n


def _packable(m: nn.Module) -> list[torch.Tensor]:
    """The fp32 weights `use_onednn` packs for module m (none for other modules, nor for weights made under
    `torch.inference_mode`: they keep no version counter, so a pack could not see a later in-place write)."""
    if type(m) is NativeLinear:
        weights = [m.weight]
    elif type(m) is NativeExperts and not m.wide_gemm:  # (wide: the native kernel serves every step size)
        weights = [m.gate_up_proj, m.down_proj]
    else:
        return []
    return weights if all(w.dtype == torch.float32 and _tracks_versions(w) for w in weights) else []


def _tracks_versions(w: torch.Tensor) -> bool:
    """Whether w has a version counter (not so for tensors made under inference mode, even after a `.data`
    swap outside it, where `is_inference()` says False)."""
    try:
        w._version
    except RuntimeError:
        return False
    return True


def packable_bytes(model: nn.Module) -> int:
    """Bytes of the weights `use_onednn` would copy."""
    return sum(w.numel() * w.element_size() for m in model.modules() for w in _packable(m))


def use_onednn(model: nn.Module) -> int:
    """Give every fp32 `NativeLinear` and `NativeExperts` of a swapped model oneDNN copies of its weights
    (glm5/infer/onednn.py) for prefill-sized steps; returns how many modules got them. Run after the last
    change of where the weights live (`rehome`): the packs read the Parameters as they are served."""
    n = 0
    for m in model.modules():
        weights = _packable(m)
        if len(weights) == 1:
            m.onednn = OneDNNWeight(weights[0])
        elif weights:
            m.onednn = tuple([OneDNNWeight(w, e) for e in range(m.n_experts)] for w in weights)
        n += bool(weights)
    return n


# NativeLayerKernel runs steps of at most this many rows (decode: one per sequence). Measured on the bench
# checkpoint (CPU time per decode step, whole-layer kernel / the layer modules on the other native kernels,
# 1 thread): 0.60 at 1 sequence, 0.76 at 4, 0.78 at 8, 0.85 at 16, 0.87 at 32, 0.92 at 64, 0.96 at 128;
# 2 threads (wall): 0.76 at 8, 0.94 at 64.
LAYER_MAX_ROWS = 128
# ... and at most this many per sequence (decode: 1; draft verification: 1 + drafts; a short prompt in a step of
# its own). One sequence's chunk, CPU time layer kernel / modules on the bench checkpoint: 0.50 at 1 query,
# 0.62 at 2, 0.70 at 4, 0.71 at 8.
LAYER_MAX_QUERIES = 8
# ... and for layers with INT8 weights at most INT8_MAX_ROWS rows (above: the same int8 kernel as
# NativeInt8Linear's)


# The whole-layer kernel restates a decoder layer in C, so a model option it was not written for must not
# reach it. ModelConfig fields it computes with (read into its spec, or checked to be a case it runs: MLA,
# DSA or no selection, top-k MoE without a capacity factor, sigmoid or softmax scores) ...
LAYER_KERNEL_FIELDS = frozenset({
    "model_type", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim",
    "attention_bias", "rope_interleave", "rms_norm_eps", "hidden_act", "index_topk", "index_n_heads",
    "index_head_dim", "indexer_rope_interleave", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "scoring_func", "topk_method",
    "moe_router_dtype", "router_temperature", "moe_capacity_factor", "moe_type", "sparse_attention"})
# ... and fields that do not change what one decoder layer computes at decode: other parts' sizes, the layer
# pattern its modules already embody (which layers have an indexer or a MoE), the RoPE angles (computed
# before the layer), training-only options, GQA-only and window-selector-only sizes (the kernel runs neither),
# token ids and carried-through keys.
OUTSIDE_THE_LAYER = frozenset({
    "architectures", "vocab_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "use_qk_norm",
    "attention_dropout", "rope_parameters", "max_position_embeddings", "index_topk_freq", "index_skip_topk_offset",
    "index_topk_pattern", "indexer_types", "index_share_for_mtp_iteration", "first_k_dense_replace",
    "moe_layer_freq", "mlp_layer_types", "layer_types", "initializer_range", "tie_word_embeddings", "use_cache",
    "pad_token_id", "bos_token_id", "eos_token_id", "num_nextn_predict_layers", "expert_dropout", "window_size",
    "window_global_every", "window_routed_blocks", "window_block_size", "block_position_embedding",
    "max_block_positions", "extra"})


def unknown_options(cfg) -> list[str]:
    """The config's fields that neither the whole-layer kernel handles nor leave a decoder layer unchanged,
    set to anything but their default: a new model option switches the kernel off (the layer runs its own
    modules) until the kernel is taught it."""
    out = []
    for f in dataclasses.fields(cfg):
        if f.name in LAYER_KERNEL_FIELDS or f.name in OUTSIDE_THE_LAYER:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if getattr(cfg, f.name) != default:
            out.append(f.name)
    return out


class NativeLayerKernel:
    """`NativeKernels.decode_layer` for `NativeDecoderLayer`: a whole decoder layer in
    one native call for decode steps (at most `max_rows` rows, at most LAYER_MAX_QUERIES per sequence: one
    token, a token and its drafts, a short prompt) in one identity group, attending every allowed key or,
    past `index_topk` keys, a DSA top-k selection (the layer's own indexer, or the previous layer's selection
    for a "shared" indexer layer). It applies when the layer is exactly the plain served form:
    native-swapped norms / linear layers / experts in fp32 with [in, out]-stored weights, a plain
    kv_b_proj, a top-k MoE (sigmoid or softmax scores, group-limited or not) without a capacity factor, no
    per-row adapters, fp32 caches.
    An MLP it does not run (soft MoE, a capacity factor, offloaded experts, ...) or a step with rows pinned
    to an older expert version gets the attention half from the kernel and `DecoderLayer.feed_forward` for
    the rest. Otherwise it returns None and the layer runs its own modules (the same values;
    tests/test_native.py compares the two). Per decode step it replaces ~100 PyTorch ops per layer with one
    call."""

    def __init__(self, kernels: NativeKernels, max_rows: int = LAYER_MAX_ROWS):
        self.kernels, self.max_rows = kernels, max_rows
        self._keys: tuple[AttnGroup, torch.Tensor, torch.Tensor] | None = None  # the step's key table
        self._plans: dict[tuple[int, bool], LayerPlan] = {}  # (id(layer), index key) -> its plan

    # A copy or a pickle of the served model gets a kernel of its own with no plans (plans point at the
    # original layers' weights, and their ctypes specs cannot be pickled); it rebuilds them on first use.
    def __deepcopy__(self, memo) -> "NativeLayerKernel":
        return NativeLayerKernel(self.kernels, self.max_rows)

    def __reduce__(self):
        return (NativeLayerKernel, (self.kernels, self.max_rows))

    def __call__(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ctx: PagedContext, prev_sel: list | None = None) -> tuple[torch.Tensor, list, dict | None] | None:
        """The layer's contract, x [1, N, hidden] and the previous layer's per-group selections -> (out
        [1, N, hidden], per-group selections, router stats or None); None where the kernel does not apply."""
        meta, cache = ctx.meta, ctx.cache
        N = meta.num_tokens
        if (N > self.max_rows or len(meta.groups) != 1 or meta.adapter_ids is not None
                or torch.is_grad_enabled() or x.dtype != torch.float32
                or x.device.type != "cpu" or not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())):
            return None
        g = meta.groups[0]
        att = layer.self_attn
        T = g.q_index.shape[1]
        if not isinstance(att, MLAttention) or not g.is_identity or T > LAYER_MAX_QUERIES:
            return None  # (the native decode layer is MLA's; GQA layers run their modules)
        topk, sel_in = 0, None
        if att.needs_selection(g.num_keys):  # DSA top-k: the layer's own indexer, or the previous layer's keys
            if att.cfg.sparse_attention != "dsa":
                return None
            topk = min(att.cfg.index_topk, g.num_keys)
            if att.indexer is None:
                if not prev_sel or prev_sel[0] is None or prev_sel[0][0].shape[-1] != topk:
                    return None
                idx, valid = prev_sel[0]
                sel_in = torch.where(valid, idx, -1).reshape(N, topk).to(torch.int64).contiguous()
        lat, ik = cache.latent[layer.layer_idx], cache.index_k[layer.layer_idx]
        if att.indexer is None:
            ik = None
        if (lat.dtype != torch.float32 or (ik is not None and ik.dtype != torch.float32)
                or (topk and sel_in is None and ik is None)):
            return None
        key = (id(layer), ik is not None)
        plan = self._plans.get(key)
        if plan is None or not plan.valid():  # (a plan holds its layer: its id is not reused)
            plan = self._plans[key] = layer_plan(layer, ik is not None)
        spec = plan.spec
        if spec is None or meta.slot_mapping.dtype != torch.int64 or (plan.int8 and N > INT8_MAX_ROWS):
            return None
        if self._keys is None or self._keys[0] is not g:  # once per step: every layer attends the same keys
            self._keys = (g, *key_table(g.key_slots, g.key_lens, g.key_slots.shape[0]))
        _, slots, lens = self._keys
        # MLPs the kernel lacks (also an expert hot swap's VersionedExperts) run as modules
        attn_only = not plan.mlp_native
        out, stats, idx, counts, sel = self.kernels.decode_layer(
            spec, x.view(N, -1), cos.view(N, -1), sin.view(N, -1), meta.slot_mapping, lat, ik, slots, g.key_bias,
            lens, T, topk, sel_in, attn_only)
        if not topk:
            sels = [None]
        elif sel_in is not None:
            sels = prev_sel  # a shared layer hands the previous selection on, as the modules do
        else:
            sels = [(sel.clamp(min=0).view(N // T, T, topk), (sel >= 0).view(N // T, T, topk))]
        if attn_only:
            h, router_stats = layer.feed_forward(out.view(1, N, -1), ctx)
            return h, sels, router_stats
        if stats is None:
            return out.view(1, N, -1), sels, None
        return out.view(1, N, -1), sels, {"router_logits": stats[:, 0], "scores": stats[:, 1], "topk_idx": idx,
                                          "tokens_per_expert": counts, "dropped_tokens": 0}


class NativeDecoderLayer(DecoderLayer):
    """`DecoderLayer` whose paged steps are first offered to the whole-layer decode kernel
    (`NativeLayerKernel`, shared by every layer of the model); where it does not apply the layer runs its
    own (native-swapped) modules."""

    layer_kernel: NativeLayerKernel

    def forward(self, x, cos, sin, ctx, prev_sel=None):
        if isinstance(ctx, PagedContext) and not ctx.meta.static_shapes:  # (a captured step traces the modules)
            done = self.layer_kernel(self, x, cos, sin, ctx, prev_sel)
            if done is not None:
                return done
        return super().forward(x, cos, sin, ctx, prev_sel)


class NativeMTPLayer(MTPLayer, NativeDecoderLayer):
    """The MTP layer with `NativeDecoderLayer`'s forward (its `forward_mtp` runs the layer through it)."""


def _f32(t: torch.Tensor | None, shape: tuple[int, ...] | None = None) -> bool:
    return (t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and (shape is None or tuple(t.shape) == shape))


class LayerPlan:
    """A layer's `LayerSpec` and what it was built from: every submodule (by its parent's slot and class)
    and every tensor (by its module's slot and data pointer) the spec points into. `valid()` re-reads those
    slots (a few dict lookups, no module attribute machinery), so a swapped module, a replaced or re-stored
    parameter (e.g. `p.data = ...`), a LoRA parametrisation or train mode rebuilds the spec instead of the
    kernel reading stale pointers; in-place writes (expert hot swap) keep it valid."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.spec: LayerSpec | None = None
        self._mods: list[tuple[dict, str, nn.Module, type]] = []
        self._tensors: list[tuple[dict, str, torch.Tensor, int]] = []
        self.int8 = False  # some of its weights are INT8 (glm5.infer.quant): decode steps of few rows only
        self.mlp_native = True  # False: the kernel runs the attention half, DecoderLayer.feed_forward the rest

    def mod(self, parent: nn.Module, name: str) -> nn.Module | None:
        child = parent._modules.get(name)
        self._mods.append((parent._modules, name, child, type(child)))
        return child

    def tensor(self, mod: nn.Module, name: str) -> torch.Tensor | None:
        slots = mod._parameters if name in mod._parameters else mod._buffers
        t = slots.get(name)
        self._tensors.append((slots, name, t, 0 if t is None else t.data_ptr()))
        return t

    def valid(self) -> bool:
        if self.layer.training:
            return False
        for slots, name, mod, cls in self._mods:  # plain loops: this runs for every layer of every decode step
            if slots.get(name) is not mod or type(mod) is not cls:
                return False
        for slots, name, t, ptr in self._tensors:
            if slots.get(name) is not t or (t is not None and t.data_ptr() != ptr):
                return False
        return True


def _lin(plan: LayerPlan, parent: nn.Module, name: str, n_in: int, n_out: int,
         int8: bool = True) -> tuple[int, int | None, int | None] | None:
    """(weight, bias or None, scale or None) pointers of a `NativeLinear` [n_out, n_in] stored [in, out] in
    fp32, or (int8=True) of an `Int8Linear` (int8 [out, in] row-major with per-output fp32 scales)."""
    mod = plan.mod(parent, name)
    if type(mod) is NativeLinear:
        w, b = plan.tensor(mod, "weight"), plan.tensor(mod, "bias")
        if (type(w) is not nn.Parameter or w.dtype != torch.float32 or w.device.type != "cpu"
                or tuple(w.shape) != (n_out, n_in) or w.stride() != (1, n_out) or (b is not None and not _f32(b, (n_out,)))):
            return None
        return w.data_ptr(), None if b is None else b.data_ptr(), None
    if int8 and type(mod) in (Int8Linear, NativeInt8Linear):
        w, sc, b = plan.tensor(mod, "weight_int8"), plan.tensor(mod, "scale"), plan.tensor(mod, "bias")
        if (w is None or w.dtype != torch.int8 or w.device.type != "cpu" or tuple(w.shape) != (n_out, n_in)
                or not w.is_contiguous() or not _f32(sc, (n_out,)) or (b is not None and not _f32(b, (n_out,)))):
            return None
        plan.int8 = True
        return w.data_ptr(), None if b is None else b.data_ptr(), sc.data_ptr()
    return None


def _norm(plan: LayerPlan, parent: nn.Module, name: str, dim: int) -> tuple[int, float] | None:
    mod = plan.mod(parent, name)
    if type(mod) is not NativeRMSNorm:
        return None
    w = plan.tensor(mod, "weight")
    if type(w) is not nn.Parameter or not _f32(w, (dim,)):
        return None
    return w.data_ptr(), float(mod.eps)


def layer_plan(layer: nn.Module, index_key: bool) -> LayerPlan:
    """The decode-layer kernel's plan for `layer`: `.spec` points into its current weights, or is None when
    the layer is not in the kernel's plain served form (see NativeLayerKernel). index_key: compute and cache
    the indexer key."""
    plan = LayerPlan(layer)
    plan.spec = _build_spec(plan, layer, index_key)
    return plan


def _build_spec(plan: LayerPlan, layer: nn.Module, index_key: bool) -> LayerSpec | None:
    att, mlp = plan.mod(layer, "self_attn"), plan.mod(layer, "mlp")
    cfg = att.cfg
    if layer.training or unknown_options(cfg) or cfg.hidden_act != "silu":
        return None
    D, QR, H = cfg.hidden_size, cfg.q_lora_rank, att.n_heads
    E, P, V, R = att.nope, att.rope, att.v_dim, att.kv_rank
    kvb = plan.mod(att, "kv_b_proj")
    kvw = plan.tensor(kvb, "weight") if kvb is not None else None
    if type(kvb) is not nn.Linear or type(kvw) is not nn.Parameter or not _f32(kvw, (H * (E + V), R)) or not QR:
        return None
    parts = [_norm(plan, layer, "input_layernorm", D), _lin(plan, att, "q_a_proj", D, QR),
             _norm(plan, att, "q_a_layernorm", QR), _lin(plan, att, "q_b_proj", QR, H * (E + P)),
             _lin(plan, att, "kv_a_proj_with_mqa", D, R + P), _norm(plan, att, "kv_a_layernorm", R),
             _lin(plan, att, "o_proj", H * V, D), _norm(plan, layer, "post_attention_layernorm", D)]
    if any(p is None for p in parts) or parts[3][1] is not None:
        return None
    (ln_in, eps_in), (wqa, bqa, s_qa), (ln_q, eps_q), (wqb, _, s_qb), (wkva, bkva, s_kva), (ln_kv, eps_kv), \
        (wo, bo, s_o), (ln_post, eps_post) = parts
    s = LayerSpec(D=D, QR=QR, H=H, E=E, P=P, V=V, R=R, rope_interleave=int(cfg.rope_interleave), eps_in=eps_in,
                  eps_q=eps_q, eps_kv=eps_kv, eps_post=eps_post, scale=att.scale, ln_in=ln_in, wqa=wqa, bqa=bqa,
                  ln_q=ln_q, wqb=wqb, wkva=wkva, bkva=bkva, ln_kv=ln_kv, kvb=kvw.data_ptr(), wo=wo, bo=bo,
                  ln_post=ln_post, s_qa=s_qa, s_qb=s_qb, s_kva=s_kva, s_o=s_o)
    if index_key:
        ix = plan.mod(att, "indexer")
        NI, ID = ix.n_heads, ix.head_dim
        wk, kn = _lin(plan, ix, "wk", D, ID, int8=False), plan.mod(ix, "k_norm")
        wqi, wwp = _lin(plan, ix, "wq_b", QR, NI * ID, int8=False), _lin(plan, ix, "weights_proj", D, NI, int8=False)
        if (wk is None or wqi is None or wwp is None or wqi[1] is not None or wwp[1] is not None
                or type(kn) is not nn.LayerNorm or ix.rope_dim != P):
            return None
        knw, knb = plan.tensor(kn, "weight"), plan.tensor(kn, "bias")
        if not (_f32(knw, (ix.head_dim,)) and _f32(knb, (ix.head_dim,))):
            return None
        s.ID, s.IP, s.index_interleave, s.wk = ID, ix.rope_dim, int(ix.rope_interleave), wk[0]
        s.NI, s.wqi, s.wwp = NI, wqi[0], wwp[0]
        s.ik_w, s.ik_b, s.eps_ik = knw.data_ptr(), knb.data_ptr(), float(kn.eps)
    fields = _mlp_fields(plan, mlp, cfg, D)
    if fields is None:
        plan.mlp_native = False
    else:
        for name, value in fields.items():
            setattr(s, name, value)
    return s


def _mlp_fields(plan: LayerPlan, mlp: nn.Module, cfg, D: int) -> dict | None:
    """The spec's MLP fields (the router and experts, or the dense SwiGLU), or None when the kernel does not run
    this MLP (soft MoE, a capacity factor, offloaded or LoRA experts, ...): the layer then runs
    `DecoderLayer.feed_forward` after the kernel's attention."""
    out: dict = {}
    if isinstance(mlp, MoE):
        if cfg.moe_type != "topk" or cfg.moe_capacity_factor is not None:
            return None
        gate, ex, sh = plan.mod(mlp, "gate"), plan.mod(mlp, "experts"), plan.mod(mlp, "shared_experts")
        NE, A, EI = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        if (type(gate) not in (Router, NativeRouter) or type(ex) not in (NativeExperts, Int8Experts)
                or type(sh) not in (SwiGLU, NativeSwiGLU) or cfg.scoring_func not in ("sigmoid", "softmax") or NE > 1024 or A > 64
                or NE % max(cfg.n_group, 1)):
            return None
        wr, rb = plan.tensor(gate, "weight"), plan.tensor(gate, "e_score_correction_bias")
        if not (_f32(wr, (NE, D)) and _f32(rb, (NE,))):
            return None
        if type(ex) is NativeExperts:
            gu, dn = plan.tensor(ex, "gate_up_proj"), plan.tensor(ex, "down_proj")
            if not (gu.dtype == dn.dtype == torch.float32 and gu.shape == (NE, 2 * EI, D) and dn.shape == (NE, D, EI)
                    and is_transposed(gu) and is_transposed(dn)):
                return None
            out.update(gu_es=gu.stride(0), dn_es=dn.stride(0))
        else:  # Int8Experts: int8 [NE, 2EI, D] / [NE, D, EI] row-major, scales [NE, 2EI] / [NE, D]
            gu, dn = plan.tensor(ex, "gate_up_int8"), plan.tensor(ex, "down_int8")
            gs, ds = plan.tensor(ex, "gate_up_scale"), plan.tensor(ex, "down_scale")
            if not (gu is not None and dn is not None and gu.dtype == dn.dtype == torch.int8 and gu.is_contiguous()
                    and dn.is_contiguous() and gu.shape == (NE, 2 * EI, D) and dn.shape == (NE, D, EI)
                    and _f32(gs, (NE, 2 * EI)) and _f32(ds, (NE, D))):
                return None
            out.update(s_gu=gs.data_ptr(), s_dn=ds.data_ptr())
            plan.int8 = True
        SI = sh.gate_proj.out_features
        if SI:
            ffn = [_lin(plan, sh, "gate_proj", D, SI), _lin(plan, sh, "up_proj", D, SI), _lin(plan, sh, "down_proj", SI, D)]
            if any(f is None or f[1] is not None for f in ffn):
                return None
            out.update(wg=ffn[0][0], s_g=ffn[0][2], wu=ffn[1][0], s_u=ffn[1][2], wd=ffn[2][0], s_d=ffn[2][2])
        out.update(NE=NE, A=A, EI=EI, SI=SI, n_group=cfg.n_group, topk_group=cfg.topk_group,
                 softmax_scores=int(cfg.scoring_func == "softmax"), norm_topk=int(cfg.norm_topk_prob),
                 temperature=cfg.router_temperature, scaling=cfg.routed_scaling_factor, wr=wr.data_ptr(),
                 rbias=rb.data_ptr(), gu=gu.data_ptr(), dn=dn.data_ptr())
    elif type(mlp) in (SwiGLU, NativeSwiGLU):
        FI = mlp.gate_proj.out_features
        ffn = [_lin(plan, mlp, "gate_proj", D, FI), _lin(plan, mlp, "up_proj", D, FI), _lin(plan, mlp, "down_proj", FI, D)]
        if not FI or any(f is None or f[1] is not None for f in ffn):
            return None
        out["FI"] = FI
        out.update(wg=ffn[0][0], s_g=ffn[0][2], wu=ffn[1][0], s_u=ffn[1][2], wd=ffn[2][0], s_d=ffn[2][2])
    else:
        return None
    return out
