"""Mixture of experts: GLM-5's sigmoid router with a selection-only correction bias, grouped experts,
an always-on shared expert; plus the seeds' options (softmax top-k gating, router temperature, capacity
factor with token dropping, expert dropout, and a dense "soft" mixture). One forward for training and
serving: with a `PagedContext` the capacity rule reads each sequence's earlier routes from the cache.

Expert modules are swappable (INT8, offloaded, expert-parallel): they provide `forward(x, idx, weights,
keep)` and `forward_dense(x, probs)`; `ExpertLoop` gives both from one `ffn(e, rows)` per expert. A
`TaggedExperts` module also receives the paged step's per-token tags (`AttnMetadata.row_tags`) as a forward
argument: what they mean is the engine's (e.g. which weights a token's request runs on).

Experts are stored fused as transformers v5 keeps them in memory: `gate_up_proj` [E, 2I, H] (gate rows
first) and `down_proj` [E, H, I]; the HF adapter converts from/to the per-expert on-disk names.

Dims: N tokens, H hidden, E routed experts, A experts per token, I expert FFN width, G groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import SwiGLU
from .paged import PagedContext


class Router(nn.Module):
    """Top-k router. Logits in fp32; the bias only steers *which* experts win, never their weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(self.n_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        """x [N, H] -> logits [N, E] fp32, scores [N, E] fp32, weights [N, A] fp32, idx [N, A] long."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float()) / cfg.router_temperature  # [N, E]
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.float()
        if cfg.n_group > 1:  # group-limited routing: keep the topk_group groups with the best top-2 sums
            G = cfg.n_group
            grouped = choice.view(-1, G, self.n_experts // G)  # [N, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.n_experts // G, dim=1), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [N, A]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, scores, weights * cfg.routed_scaling_factor, idx


# Without autograd on CPU, a step with at least this many expert assignments per expert on average (prefill
# chunks, wide batches) runs one BLAS matmul pair per expert (`expert_loop`): on one layer of the bench's
# 64-expert, top-4 checkpoint (1 thread, one run) 1.2-1.4x faster than `grouped_experts` and 1.3-2.2x faster
# than the native kernel built with 16-column GEMM tiles (AVX2; glm5/infer/kernels.py) from 256 to 2,048
# tokens, while at 1-4 per expert the native kernel or `grouped_experts` is faster (docs/bench-engine.md,
# "Routed experts by step size"). The native kernel built with AVX-512 tiles beats the loop at every size and
# serves them all (`NativeExperts.wide_gemm`).
LOOP_MIN_ROWS_PER_EXPERT = 8


class Experts(nn.Module):
    """E SwiGLU experts as two fused 3-D weights; `forward` sorts tokens by expert (grouped matmuls)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.n_experts, self.inter = E, I
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                keep: torch.Tensor | None = None, static_shapes: bool = False) -> torch.Tensor:
        """x [N, H], idx/weights [N, A] (keep [N, A] bool: assignments that survive capacity/dropout).
        static_shapes (a captured step, `AttnMetadata.static_shapes`): always `grouped_experts`, whose ops
        have shapes fixed by N and no host sync (the loops read routes on the host).

        Without autograd on CPU (serving, `generate_greedy`): `grouped_experts`, a fixed number of ops
        whatever the routing (two grouped matmuls; no per-expert Python); for a single token the loop over
        its A experts, since CPU `_grouped_mm` walks every expert, empty ones included (0.6 vs 1.2 ms per
        layer on the bench's 64-expert checkpoint), and the loop again once the experts get enough rows
        each for BLAS GEMMs (`LOOP_MIN_ROWS_PER_EXPERT`)."""
        if static_shapes:
            return grouped_experts(x, idx, weights, keep, self.gate_up_proj, self.down_proj, static_shapes=True)
        if not torch.is_grad_enabled() and not x.is_cuda:
            gu, dn = self.gate_up_proj, self.down_proj  # read once: a parametrized (LoRA) weight recomputes per read
            if (x.shape[0] == 1 and keep is None  # batch-1 decode: CPU _grouped_mm visits all E experts
                    or idx.numel() >= LOOP_MIN_ROWS_PER_EXPERT * self.n_experts):
                return expert_loop(x, idx, weights, keep, self.n_experts, lambda e, xs: swiglu(xs, gu[e], dn[e]))
            return grouped_experts(x, idx, weights, keep, gu, dn)
        order, token, counts = sort_by_expert(idx, self.n_experts, keep)
        xs = x.index_select(0, token)  # [M, H] (index_select: several times faster than x[token] on CPU)
        ys = grouped_swiglu(xs, self.gate_up_proj, self.down_proj, counts)  # [M, H]
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
        # accumulate in the experts' output dtype (bf16 under autocast while x may be fp32)
        return torch.zeros(x.shape, dtype=ys.dtype, device=x.device).index_add_(0, token, ys)

    def forward_dense(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Every token through every expert, mixed by probs [N, E] (the soft-MoE variant)."""
        h = torch.einsum("nh,eih->eni", x, self.gate_up_proj)  # [E, N, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch.einsum("eni,ehi->enh", F.silu(gate) * up, self.down_proj)  # [E, N, H]
        return torch.einsum("enh,ne->nh", y, probs.to(y.dtype))


def swiglu(xs: torch.Tensor, gate_up, down, linear: Callable = F.linear) -> torch.Tensor:
    """One expert on rows xs [n, H]: gate_up [2I, H] (gate rows first), down [H, I] -> [n, H]. `linear(x,
    weight)` forms the two products (an engine passes its own for weights it holds in another form)."""
    gate, up = linear(xs, gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, down)


class TaggedExperts(nn.Module):
    """Base of experts modules whose rows depend on a per-token tag of the paged step. The MoE calls them as
    `forward(x [N, H], idx [N, A], weights [N, A], keep [N, A] | None, row_tags [N] | None) -> [N, H]`, with
    `AttnMetadata.row_tags` (None without a paged context or without tags), and `forward_dense(x, probs)`
    as any experts module. Row data travels as an argument, built per step with the metadata, so no state
    is written into the module before each step; the tag's meaning is the engine's (glm5/infer)."""


class ExpertLoop(nn.Module):
    """Base for inference expert modules (INT8, offloaded): subclasses give `ffn(e, rows [n, H]) -> [n, H]`
    and inherit the routed and the soft (dense mixture) forwards."""

    n_experts: int

    def ffn(self, e: int, xs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, keep=None) -> torch.Tensor:
        """x [N, H], idx/weights [N, A] -> [N, H] (the same token sort as `Experts`)."""
        return expert_loop(x, idx, weights, keep, self.n_experts, self.ffn)

    def forward_dense(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Every token through every expert, mixed by probs [N, E] (soft MoE)."""
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            out += self.ffn(e, x) * probs[:, e:e + 1].to(x.dtype)
        return out


def sort_by_expert(idx: torch.Tensor, n_experts: int, keep=None):
    """Assignments grouped by expert: (order [M] into the flat N*A list, token [M], counts [E])."""
    A = idx.shape[1]
    flat = idx.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, n_experts)  # dropped -> a virtual expert E
    order = torch.argsort(flat, stable=True)  # [N*A] assignments grouped by expert, token order kept
    counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts]
    order = order[: int(counts.sum())]
    return order, order // A, counts


def expert_loop(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, keep, n_experts: int, ffn) -> torch.Tensor:
    """Routed-expert output [N, H] for x [N, H], idx/weights [N, A]: tokens sorted by expert, then
    `ffn(e, rows [n, H]) -> [n, H]` once per expert that received tokens (contiguous slices)."""
    if x.shape[0] == 1 and keep is None:  # one token (batch-1 decode): no sort, same summation order
        out = torch.zeros_like(x)  # [1, H]
        w = weights[0].tolist()
        for a, e in sorted(enumerate(idx[0].tolist()), key=lambda ae: ae[1]):
            out += ffn(e, x) * w[a]  # w[a] came from fp32: the product is the one the sorted path forms
        return out
    order, token, counts = sort_by_expert(idx, n_experts, keep)
    xs = x.index_select(0, token)  # [M, H]
    w = weights.reshape(-1)[order, None]  # [M, 1]
    out, start = torch.zeros_like(x), 0
    for e, n in enumerate(counts.tolist()):
        if n:  # each expert's rows added as they come: the sum runs in expert order, as one add of all would
            ys = ffn(e, xs[start:start + n])
            out.index_add_(0, token[start:start + n], ys * w[start:start + n].to(ys.dtype))
            start += n
    return out


@torch.library.custom_op("glm5::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a [M, K], b [E, K, N], offs [E])` -> [M, N] as an opaque op for compiled and captured
    steps: torch's fake (meta) kernel of `_grouped_mm` accepts bf16 only, while the CPU kernel runs fp32 too."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _grouped_mm_fake(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


def grouped_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, keep, gate_up: torch.Tensor,
                    down: torch.Tensor, delta: Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor | None]
                    | None = None, static_shapes: bool = False) -> torch.Tensor:
    """Routed-expert output [N, H] for x [N, H], idx/weights [N, A] (inference, CPU): the N*A assignments
    sorted by expert (stable: token order within an expert), `torch._grouped_mm` over the [E, ., .] weights
    for gate_up and down (each expert's rows are one slice; experts with none are skipped), then summed per
    token in that order. Dropped assignments (keep False) are computed with weight 0.
    `delta(name, rows_in [M, in], order [M])`, if given, returns a per-row term added to the output of the
    `gate_up_proj` / `down_proj` product (per-row adapters when serving many LoRAs), or None.

    The same products and summation order as a loop of one matmul pair per expert, in 12 ops: at decode
    sizes the loop's per-expert Python and dispatch cost more than the matmuls. static_shapes (a compiled or
    captured step): the products go through the `grouped_mm` op, which torch.compile can trace in fp32."""
    mm = grouped_mm if static_shapes else (lambda a, b, offs: torch._grouped_mm(a, b, offs=offs))
    A = idx.shape[1]
    flat = idx.reshape(-1)  # [N*A]
    order = torch.argsort(flat, stable=True)  # [M = N*A]
    offs = expert_counts(flat, gate_up.shape[0]).cumsum(0).to(torch.int32)  # [E] end of each expert
    token = order // A  # [M]
    xs = x.index_select(0, token)  # [M, H]
    h = mm(xs, gate_up.transpose(-2, -1), offs)  # [M, 2I]
    if delta is not None and (d := delta("gate_up_proj", xs, order)) is not None:
        h = h + d
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up  # [M, I]
    ys = mm(a, down.transpose(-2, -1), offs)  # [M, H]
    if delta is not None and (d := delta("down_proj", a, order)) is not None:
        ys = ys + d
    w = weights.reshape(-1) if keep is None else weights.reshape(-1) * keep.reshape(-1)
    return torch.zeros_like(x).index_add_(0, token, ys * w.index_select(0, order)[:, None].to(ys.dtype))


def expert_counts(idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert [E] (long) for expert ids idx [...] in [0, E): `bincount` with its output
    shape fixed at E (bincount's depends on the largest id, which a compiled or captured step cannot have)."""
    flat = idx.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.long, device=idx.device).index_add_(0, flat, torch.ones_like(flat))


_GROUPED_MM_OK: dict = {}  # per CUDA device: does torch._grouped_mm run here (sm90+ in torch 2.13)?


def grouped_swiglu(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU over expert-sorted rows xs [M, H] with counts [E] rows per expert -> [M, H].

    CUDA + bf16: `torch._grouped_mm`, one kernel for all experts. Elsewhere (CPU `_grouped_mm` has no
    backward in torch 2.13): one matmul per non-empty expert on contiguous splits of the sorted rows,
    with a hand-written backward (`_GroupedSwiGLU`) that writes every gradient in place.
    On an idle 2-core CPU this beat a zero-padded [E, C_max, H] batched matmul (66 vs 81 ms fwd+bwd
    for 1024 tokens x top-4 over 64 experts; `python bench/model.py moe`), since padding to the busiest
    expert wastes work; the bmm only wins when the cores are oversubscribed.
    """
    bf16 = xs.dtype == torch.bfloat16 or (xs.is_cuda and torch.is_autocast_enabled("cuda")
                                         and torch.get_autocast_dtype("cuda") == torch.bfloat16)
    if xs.is_cuda and bf16 and _GROUPED_MM_OK.get(xs.device.index, True):
        try:  # under bf16 autocast the fp32 master weights are cast here, as autocast casts F.linear's
            xs16, gu16, dn16 = xs.to(torch.bfloat16), gate_up.to(torch.bfloat16), down.to(torch.bfloat16)
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(xs16, gu16.transpose(-2, -1), offs=offs)  # [M, 2I]
            gate, up = h.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, dn16.transpose(-2, -1), offs=offs)
        except (RuntimeError, AttributeError):  # GPU/shape the kernel does not support: loop instead
            _GROUPED_MM_OK[xs.device.index] = False
    dev = xs.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else xs.dtype
    xs, gate_up, down = xs.to(dtype), gate_up.to(dtype), down.to(dtype)  # as autocast would cast F.linear's
    with torch.autocast(dev, enabled=False):  # the Function's matmuls write into buffers of `dtype`
        return _GroupedSwiGLU.apply(xs, gate_up, down, counts.tolist())


class _GroupedSwiGLU(torch.autograd.Function):
    """The per-expert loop with a hand-written backward: every matmul writes straight into its slice
    of the output / input-gradient rows or into expert e's slot of the [E, ...] weight gradients.
    Autograd's version of the same loop (split rows, unbind weights, chunk gate/up, cat outputs)
    spent as long copying -- stacking 64 per-expert weight gradients, concatenating row gradients --
    as half its matmuls on the `small` CPU step. Only the matmuls loop over experts: the SwiGLU and
    its derivative run once over all M rows (a handful of ops per layer instead of ~10 per expert,
    whose dispatch cost more than their arithmetic at 64 rows an expert). Saves xs, the [M, 2I]
    gate/up pre-activations and the [M, I] activations fed to `down`. When a weight already holds a
    `.grad` (gradient accumulation; the trainer keeps its buffers between steps, glm5/train/grads.py)
    its per-expert gradients are added into that buffer directly, as autograd would add them, without
    a fresh [E, ...] buffer: at >= 32 MiB glibc maps it anew each step and every page faults in."""

    @staticmethod
    def forward(ctx, xs, gate_up, down, counts: list[int]):
        M, H = xs.shape
        inter = down.shape[-1]
        h = xs.new_empty(M, 2 * inter)  # [M, 2I] gate | up
        segs = _segments(counts)
        for e, seg in segs:
            torch.mm(xs[seg], gate_up[e].t(), out=h[seg])
        g, u = h.split(inter, dim=-1)
        a = F.silu(g).mul_(u)  # [M, I]
        out = xs.new_empty(M, H)
        for e, seg in segs:
            torch.mm(a[seg], down[e].t(), out=out[seg])
        ctx.save_for_backward(xs, gate_up, down, h, a)
        ctx.segs = segs
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xs, gate_up, down, h, a = ctx.saved_tensors
        inter = down.shape[-1]
        grad_out = grad_out.contiguous()
        need_x, need_gu, need_down = ctx.needs_input_grad[:3]
        d_xs = torch.empty_like(xs) if need_x else None
        acc_gu, acc_down = _grad_in_place(gate_up), _grad_in_place(down)
        d_gu = (acc_gu if acc_gu is not None else _expert_grad(gate_up, ctx.segs)) if need_gu else None
        d_down = (acc_down if acc_down is not None else _expert_grad(down, ctx.segs)) if need_down else None
        da = torch.empty_like(a)  # [M, I] d loss / d (silu(gate) * up)
        for e, seg in ctx.segs:
            if need_down and acc_down is not None:
                d_down[e].addmm_(grad_out[seg].t(), a[seg])
            elif need_down:
                torch.mm(grad_out[seg].t(), a[seg], out=d_down[e])  # [H, I]
            torch.mm(grad_out[seg], down[e], out=da[seg])  # [n, I]
        g, u = h.split(inter, dim=-1)
        d_h = torch.empty_like(h)
        torch.ops.aten.silu_backward.grad_input(da * u, g, grad_input=d_h[:, :inter])  # d gate = da * up * silu'(gate)
        torch.mul(da, F.silu(g), out=d_h[:, inter:])  # d up = da * silu(gate)
        for e, seg in ctx.segs:
            if need_gu and acc_gu is not None:
                d_gu[e].addmm_(d_h[seg].t(), xs[seg])
            elif need_gu:
                torch.mm(d_h[seg].t(), xs[seg], out=d_gu[e])  # [2I, H]
            if need_x:
                torch.mm(d_h[seg], gate_up[e], out=d_xs[seg])  # [n, H]
        return d_xs, None if acc_gu is not None else d_gu, None if acc_down is not None else d_down, None


def _grad_in_place(w: torch.Tensor) -> torch.Tensor | None:
    """w's existing .grad when the weight gradient can be added to it directly (what autograd would do
    after this backward returns), else None."""
    if not (w.is_leaf and w.requires_grad) or w.grad is None or w._backward_hooks or \
            getattr(w, "_post_accumulate_grad_hooks", None):
        return None
    g = w.grad
    ok = g.layout == torch.strided and g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
    return g if ok and not torch.is_grad_enabled() else None


def _segments(counts: list[int]) -> list[tuple[int, slice]]:
    """(expert, its rows) for every expert with rows, over rows sorted by expert."""
    segs, lo = [], 0
    for e, n in enumerate(counts):
        if n:
            segs.append((e, slice(lo, lo + n)))
            lo += n
    return segs


def _expert_grad(w: torch.Tensor, segs: list[tuple[int, slice]]) -> torch.Tensor:
    """Uninitialised [E, ...] gradient for w with the slots of experts without rows zeroed (every other
    slot is written by its matmul)."""
    grad = torch.empty_like(w)
    busy = torch.zeros(w.shape[0], dtype=torch.bool)
    busy[[e for e, _ in segs]] = True
    if not bool(busy.all()):
        grad[~busy.to(w.device)] = 0
    return grad


class MoE(nn.Module):
    """Routed experts + shared expert(s). Returns the output and router statistics for monitoring."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = -1):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor, ctx: PagedContext | None = None) -> tuple[torch.Tensor, dict]:
        """x [B, T, H] (paged: [1, N, H] flat tokens) -> (out [B, T, H], router stats)."""
        shape = x.shape
        xf = x.reshape(-1, shape[-1])  # [N, H]
        logits, scores, weights, idx = self.gate(xf)
        stats = {"router_logits": logits, "scores": scores, "topk_idx": idx,
                 "tokens_per_expert": expert_counts(idx, self.cfg.n_routed_experts)}
        if self.cfg.moe_type == "soft":
            probs = (logits.softmax(-1) if self.cfg.scoring_func == "softmax" else scores / scores.sum(-1, True))
            routed = self.experts.forward_dense(xf, probs * self.cfg.routed_scaling_factor)
        else:
            keep = self._keep_mask(idx, shape, ctx)
            stats["dropped_tokens"] = 0 if keep is None else int((~keep).sum())
            if ctx is not None and ctx.meta.static_shapes:  # a captured step (never while a hot swap holds a version)
                routed = self.experts(xf, idx, weights, keep, static_shapes=True)
            elif isinstance(self.experts, TaggedExperts):
                routed = self.experts(xf, idx, weights, keep, None if ctx is None else ctx.meta.row_tags)
            else:
                routed = self.experts(xf, idx, weights, keep)
        out = routed.to(x.dtype).view(shape) + self.shared_experts(x)
        return out, stats

    def _keep_mask(self, idx: torch.Tensor, shape, ctx: PagedContext | None) -> torch.Tensor | None:
        """Assignments kept after expert dropout (training) and the capacity limit (None = keep all)."""
        cfg = self.cfg
        keep = None
        if self.training and cfg.expert_dropout > 0:
            keep = torch.rand(idx.shape, device=idx.device) >= cfg.expert_dropout
        if cfg.moe_capacity_factor is None:
            return keep
        if ctx is not None:
            return self._paged_capacity(idx, ctx)
        B, T, A = shape[0] if len(shape) == 3 else 1, shape[-2], idx.shape[1]
        hist = idx if keep is None else idx.masked_fill(~keep, -1)  # dropout-dropped assignments queue nowhere
        qpos = torch.arange(T, device=idx.device)[None].expand(B, -1)  # [B, T]
        within = capacity_keep(idx.view(B, T, A), hist.view(B, T, A), qpos, cfg.moe_capacity_factor,
                               cfg.n_routed_experts).view(-1, A)
        return within if keep is None else keep & within

    def _paged_capacity(self, idx: torch.Tensor, ctx: PagedContext) -> torch.Tensor:
        """Capacity per sequence over flat tokens: this step's routes go into the cache first, then each
        group reads its sequences' whole route history (earlier steps included) -> keep [N, A]."""
        meta, routes = ctx.meta, ctx.cache.routes[self.layer_idx]
        routes.index_copy_(0, meta.slot_mapping, idx.to(routes.dtype))
        keep = torch.ones_like(idx, dtype=torch.bool)
        for g in meta.groups:
            hist = routes[g.key_slots].long().masked_fill(~g.key_valid[..., None], -1)  # [B, S, A]
            k = capacity_keep(idx[g.q_index], hist, g.q_pos, self.cfg.moe_capacity_factor, self.cfg.n_routed_experts)
            keep[g.q_index[g.q_valid]] = k[g.q_valid]
        return keep


def capacity_keep(idx: torch.Tensor, history: torch.Tensor, qpos: torch.Tensor, capacity_factor: float,
                  n_experts: int) -> torch.Tensor:
    """The per-sequence, causal capacity rule: the assignment of a token at sequence index p to expert e
    survives iff fewer than ceil(capacity_factor * (p + 1) * A / E) earlier tokens of the sequence were
    routed to e -- the budget a sequence ending at p gets, spent in token order. A token's fate never
    depends on later tokens, so cached decoding equals full recompute.

    idx [B, T, A] the queries' experts; history [B, S, A] expert ids of the sequence's tokens 0..S-1
    (-1 = none: padding, dropout); qpos [B, T] sequence index of each query (< S) -> keep [B, T, A] bool.
    """
    B, S, A = history.shape
    onehot = F.one_hot(history.clamp(min=0), n_experts) * (history >= 0)[..., None]  # [B, S, A, E]
    per_pos = onehot.sum(2)  # [B, S, E]
    before = per_pos.cumsum(1) - per_pos  # [B, S, E]: assignments at indices < s
    rank = before.gather(1, qpos[..., None].expand(-1, -1, n_experts)).gather(2, idx)  # [B, T, A]
    cap = torch.ceil((qpos + 1).double() * (capacity_factor * A / n_experts))  # [B, T]
    return rank < cap[..., None]
