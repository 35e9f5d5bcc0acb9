"""Tensor parallelism (TP) for GLM-5, applied from outside the model with DTensor `parallelize_module`.

Layout on a "tp" mesh of size P (Megatron TP without sequence parallelism: the residual stream between
blocks is replicated, every TP rank holds the whole [B, T, H] activation):

- MLA: heads are split after the low-rank projections. `q_a_proj`, `kv_a_proj_with_mqa`, their norms and
  the DSA indexer stay replicated (small, and the indexer needs every head's query for its top-k);
  `q_b_proj` and `kv_b_proj` are column-parallel (this rank's H/P heads), `o_proj` row-parallel (partial
  outputs all-reduced). The module's `n_heads` becomes H/P, so the model's views see local heads.
- Dense MLP and shared experts: gate/up column-parallel, down row-parallel (one all-reduce out, one in
  backward).
- Routed experts: token-parallel. Each TP rank runs 1/P of the tokens through the experts (with expert
  parallel, dispatches them over its EP group) and the outputs are all-gathered: the same FLOPs as
  splitting every expert P ways, without the reduction. Their gradients differ per TP rank and are
  summed by FSDP over the (dp, tp) ranks (see parallel.py).
- Embedding row-parallel (vocab-sharded, output all-reduced), LM head column-parallel with a
  vocab-parallel cross entropy (`loss_parallel`): the [T, V] logits are never gathered.

- A quantised base (glm5/finetune/quant_base.py): a split weight's int8 / fp8 storage is split like the
  plain weight with its scales (`_held_style`), and each rank dequantises its shard (`_TPStorage`); a
  FP8 split that would cut a scale tile is refused naming the layer.

Gradient rule that makes this exact: a replicated activation that feeds head-sharded computation gets
a partial gradient on each rank and must be all-reduced exactly once. `ColwiseParallel` does this for
its input (q_b_proj, MLP gate/up). The latent `c_kv` and the rope key `k_rope` reach the heads also
without a module call (absorbed sparse attention, the shared rope key), so they get an explicit
`_grad_all_reduce` after `kv_a_layernorm` / on the rope slice of `kv_a_proj_with_mqa`, and `kv_b_proj`
uses a column-parallel style that leaves its input gradient partial. Parameters outside these regions
then get identical gradients on every TP rank.

Not supported with TP (refused with the reason): tied embeddings, `moe_type = "soft"`, the DSA indexer
KL loss / warm-up (its target is the attention over all heads).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)
from torch.nn.utils import parametrize

from glm5.model.attention import MLAttention
from glm5.model.config import ModelConfig
from glm5.model.layers import SwiGLU
from glm5.model.lora import LoRALinear
from glm5.model.moe import MoE


class _GradAllReduce(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over `group` backward (Megatron's "f")."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def grad_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward, gradient summed over `group` backward: for a replicated tensor that joins
    head-sharded computation outside the regions this plan reduces (fine-tuning's MLA prefix entries)."""
    return _GradAllReduce.apply(x, group)


class _ReplicateKeepPartial(torch.autograd.Function):
    """A plain tensor -> DTensor Replicate whose backward hands the (partial) local gradient back
    unreduced: the reduction happens once, upstream (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, mesh):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad):
        return (grad.to_local() if isinstance(grad, DTensor) else grad), None


class _ColwiseKeepPartial(ColwiseParallel):
    """ColwiseParallel whose input gradient stays partial (its input was already marked with
    `_grad_all_reduce` upstream)."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        return x if isinstance(x, DTensor) else _ReplicateKeepPartial.apply(x, device_mesh)


class _TokenScatter(torch.autograd.Function):
    """Forward: this rank's chunk of the rows; backward: all-gather the chunk gradients (the rows are
    replicated on every TP rank, so the full gradient must be too)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.size = group, size
        return x.chunk(size)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.contiguous(), ctx.group, ctx.size), None, None, None


class _TokenGather(torch.autograd.Function):
    """Forward: all-gather every rank's rows; backward: this rank's chunk of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.rank, ctx.size = rank, size
        return _all_gather_rows(x.contiguous(), group, size)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size)[ctx.rank].contiguous(), None, None, None


def _all_gather_rows(x: torch.Tensor, group, size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse, before any compute, a model that `tensor_parallel = tp` cannot split evenly."""
    if tp <= 1:
        return
    if cfg.attention_kind == "gqa":
        raise ValueError(f"parallel.tensor_parallel={tp}: the tensor-parallel plan splits MLA heads; model_type "
                         f"{cfg.model_type!r} has grouped-query attention (use data / expert / pipeline parallel)")
    sizes = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
             "moe_intermediate_size * n_shared_experts": cfg.moe_intermediate_size * cfg.n_shared_experts,
             "vocab_size": cfg.vocab_size}
    for name, n in sizes.items():
        if n % tp:
            raise ValueError(f"parallel.tensor_parallel={tp} does not divide the model's {name}={n}")
    if cfg.tie_word_embeddings:
        raise ValueError("parallel.tensor_parallel > 1 needs untied embeddings (tie_word_embeddings = false): "
                         "the embedding is row-parallel and the LM head column-parallel")
    if cfg.moe_type == "soft":
        raise ValueError("parallel.tensor_parallel > 1 needs top-k routing (moe_type = 'soft' runs every "
                         "token through every expert)")


class TokenParallel:
    """Forward hooks that run a routed-experts module on 1/P of the tokens of each TP rank.

    `Experts.forward(x [N, H], idx [N, A], weights [N, A], keep [N, A] | None)`: the pre-hook takes this
    rank's rows of every argument, the post-hook all-gathers the output rows. N must divide by P (the
    trainer checks batch x seq_len)."""

    def __init__(self, tp_mesh: DeviceMesh):
        self.group, self.rank, self.size = tp_mesh.get_group(), tp_mesh.get_local_rank(), tp_mesh.size()

    def pre(self, module, args, kwargs):
        x, idx, weights, *rest = args
        keep = rest[0] if rest else kwargs.pop("keep", None)
        if x.shape[0] % self.size:
            raise ValueError(f"tensor parallel: {x.shape[0]} tokens per micro-batch do not split over "
                             f"tensor_parallel={self.size} ranks (make data.batch_size x seq_len divisible)")
        split = lambda t: _TokenScatter.apply(t, self.group, self.rank, self.size)  # noqa: E731
        keep = None if keep is None else keep.chunk(self.size)[self.rank]
        return (split(x), idx.chunk(self.size)[self.rank], split(weights), keep), kwargs

    def post(self, module, args, output):
        return _TokenGather.apply(output, self.group, self.rank, self.size)


def _mlp_plan(prefix: str, adapted: bool = False) -> dict:
    """Column-parallel gate/up, row-parallel down; one input all-reduce in backward (the DTensor input
    collects both partial gradients before it is reduced). With LoRA on the MLP (`adapted`) the input
    stays a plain tensor (the adapters' replicated A cannot take a DTensor) and gate and up each reduce
    their input gradient: one more all-reduce per MLP in backward."""
    if adapted:
        return {f"{prefix}.gate_proj": ColwiseParallel(), f"{prefix}.up_proj": ColwiseParallel(),
                f"{prefix}.down_proj": RowwiseParallel()}
    return {prefix: PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                       use_local_output=False),
            f"{prefix}.gate_proj": ColwiseParallel(), f"{prefix}.up_proj": ColwiseParallel(),
            f"{prefix}.down_proj": RowwiseParallel()}


class _PartialGrad(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the TP degree. On a LoRA branch whose base
    layer leaves its input gradient partial (kv_b_proj): the branch's own input gradient is complete on
    every rank, so each rank hands back its 1/P share of the sum that is all-reduced once upstream."""

    @staticmethod
    def forward(ctx, x, size):
        ctx.size = size
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.size, None


class _ColwiseLoRALinear(LoRALinear):
    """A LoRALinear whose base and B are column-parallel (set by `_lora_styles`, a class swap: the
    forward is LoRALinear's). Its `.weight` (read by absorbed MLA) lifts the replicated A onto B's mesh
    as a Replicate DTensor: B A is then this rank's rows, and A's gradient, partial on each rank, is
    all-reduced in backward."""

    def delta_weight(self) -> torch.Tensor:
        a, b = self.lora_A.weight, self.lora_B.weight
        if isinstance(b, DTensor) and not isinstance(a, DTensor):
            a = DTensor.from_local(a, b.device_mesh, [Replicate()] * b.device_mesh.ndim, run_check=False)
        return (b @ a) * self.scaling


class _TPStorage(nn.Module):
    """A quantised base's weight under tensor parallel (glm5/finetune/quant_base.py): the int8 / fp8 storage
    is this rank's rows (column-parallel, Shard(0)) or columns (row-parallel, Shard(1)) of the matrix,
    `inner` the parametrization `split` to them (its scale a DTensor on the same split); the local shard is
    dequantised here and returned as the DTensor the style expects."""

    frozen_storage = True

    def __init__(self, inner: nn.Module, mesh: DeviceMesh, placement: Shard):
        super().__init__()
        self.inner, self.mesh, self.placement = inner, mesh, placement

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        scale = self.inner.scale
        local = self.inner.dequant(w.to_local(), scale.to_local() if isinstance(scale, DTensor) else scale)
        return DTensor.from_local(local, self.mesh, [self.placement], run_check=False)


def _shard_held(linear: nn.Linear, mesh: DeviceMesh, dim: int, name: str) -> None:
    """Split a quantised weight's storage and scales on `dim` (0: rows, 1: columns) in place."""
    chain = linear.parametrizations.weight
    if len(chain) != 1 or not getattr(chain[0], "frozen_storage", False):
        raise ValueError(f"tensor parallel: a weight with parametrizations {[type(c).__name__ for c in chain]} "
                         "cannot be split")
    q = chain.original
    P, rank = mesh.size(), mesh.get_local_rank()
    n = q.shape[dim] // P
    lo = rank * n
    try:  # every rank's slice, so that all ranks refuse together (FP8 tiles split across ranks)
        inner = [chain[0].split(dim - 2, r * n, (r + 1) * n) for r in range(P)][rank]
    except ValueError as e:
        raise ValueError(f"parallel.tensor_parallel={P}: {name}: {e}") from None
    local = q.detach().narrow(dim, lo, n).clone()
    chain._parameters["original"] = nn.Parameter(DTensor.from_local(local, mesh, [Shard(dim)], run_check=False),
                                                 requires_grad=False)
    scale = inner.scale  # int8 [N] split with the rows; fp8 tiles [1, R, C] split on theirs
    on = (0 if scale.ndim == 1 else scale.ndim - 2) if dim == 0 else (None if scale.ndim == 1 else scale.ndim - 1)
    inner.scale = DTensor.from_local(scale, mesh, [Replicate() if on is None else Shard(on)], run_check=False)
    chain[0] = _TPStorage(inner, mesh, Shard(dim))


def _held_style(style, linear: nn.Linear, name: str):
    """`style` (column- or row-parallel) for a linear whose weight a quantised base holds: torch's
    partition cannot take a parametrized weight, so its storage and scales are split here
    (`_shard_held`) and the rest of the module (a bias) as the style would."""
    rowwise = isinstance(style, RowwiseParallel)
    out = copy.copy(style)

    def partition(_, module, mesh):
        if module is not linear:
            return
        _shard_held(module, mesh, 1 if rowwise else 0, name)
        for key, p in list(module._parameters.items()):
            if p is not None and not isinstance(p, DTensor):  # the bias
                placement = Replicate() if rowwise else Shard(0)
                module.register_parameter(key, nn.Parameter(DTensor.from_local(
                    p.detach().chunk(mesh.size())[mesh.get_local_rank()].clone() if not rowwise else p.detach(),
                    mesh, [placement], run_check=False), requires_grad=p.requires_grad))

    out._partition_linear_fn = partition
    return out


def _held_styles(root: nn.Module, plan: dict) -> dict:
    """`plan` with the styles of quantised linears replaced by `_held_style`."""
    out = {}
    for name, style in plan.items():
        mod = root.get_submodule(name)
        held = isinstance(mod, nn.Linear) and parametrize.is_parametrized(mod, "weight")
        out[name] = _held_style(style, mod, getattr(mod, "_qualified_name", name)) if held else style
    return out


def _lora_styles(root: nn.Module, plan: dict, size: int) -> dict:
    """`plan` with every LoRALinear target split consistently with its base weight: the base layer takes
    the style; column-parallel base -> B [out, r] column-parallel too (sharded on out), A replicated;
    row-parallel base -> A [r, in] row-parallel (sharded on in, its [.., r] output all-reduced), B
    replicated. The rank r is never split. Replicated adapters get identical gradients on every TP rank
    (their inputs and output gradients are replicated), as the replicated base parameters do."""
    out = {}
    for name, style in plan.items():
        mod = root.get_submodule(name)
        if not isinstance(mod, LoRALinear):
            out[name] = style
            continue
        out[f"{name}.base_layer"] = style
        if isinstance(style, RowwiseParallel):
            out[f"{name}.lora_A"] = RowwiseParallel()
        else:
            out[f"{name}.lora_B"] = ColwiseParallel(output_layouts=style.output_layouts[0],
                                                    use_local_output=style.use_local_output)
            mod.__class__ = _ColwiseLoRALinear
            if isinstance(style, _ColwiseKeepPartial):
                mod.lora_A.register_forward_pre_hook(lambda m, args: (_PartialGrad.apply(args[0], size),))
    return _held_styles(root, out)


def check_lora_tp(model: nn.Module, tp: int) -> None:
    """Refuse, before any compute, LoRA adapters that `tensor_parallel = tp` cannot split like their base
    weights (the output dimension of a column-parallel target, the input of a row-parallel one)."""
    if tp <= 1:
        return
    for name, mod in model.named_modules():
        if not isinstance(mod, LoRALinear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        dim = {"q_b_proj": "out", "kv_b_proj": "out", "gate_proj": "out", "up_proj": "out", "lm_head": "out",
               "o_proj": "in", "down_proj": "in"}.get(leaf)
        if dim is None or (".indexer." in name):
            continue  # replicated under TP (q_a_proj, kv_a_proj_with_mqa, the indexer): nothing to split
        n = mod.out_features if dim == "out" else mod.in_features
        if n % tp:
            raise ValueError(f"parallel.tensor_parallel={tp} does not divide LoRA target {name}'s "
                             f"{dim}_features={n} (its lora_{'B' if dim == 'out' else 'A'} is split on it)")


def _attention(attn: MLAttention, tp_mesh: DeviceMesh) -> None:
    P, group = tp_mesh.size(), tp_mesh.get_group()
    parallelize_module(attn, tp_mesh, _lora_styles(attn, {"q_b_proj": ColwiseParallel(),
                                                          "kv_b_proj": _ColwiseKeepPartial(),
                                                          "o_proj": RowwiseParallel()}, P))
    rank = attn.kv_rank

    def rope_slice(module, args, out):  # [.., R + P]: only the rope key goes to the heads unprojected
        return torch.cat([out[..., :rank], _GradAllReduce.apply(out[..., rank:], group)], dim=-1)

    attn.kv_a_proj_with_mqa.register_forward_hook(rope_slice)
    attn.kv_a_layernorm.register_forward_hook(lambda m, a, out: _GradAllReduce.apply(out, group))
    attn.n_heads = attn.n_heads // P  # the model's views now see this rank's heads


def _adapted(mlp: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in mlp.children())


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Tensor-parallelise `model` (a GLM5ForCausalLM, after expert parallel) over `tp_mesh`, in place."""
    P = tp_mesh.size()
    check_tp(model.config, P)
    for name, mod in model.named_modules():  # a quantised weight that cannot be split is refused by name
        if isinstance(mod, nn.Linear) and parametrize.is_parametrized(mod, "weight"):
            mod._qualified_name = name
    plan = {}  # a pipeline stage may lack the embedding or the head
    if hasattr(model.model, "embed_tokens"):
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if hasattr(model, "lm_head"):
        plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    check_lora_tp(model, P)
    parallelize_module(model, tp_mesh, _lora_styles(model, plan, P))
    tokens = TokenParallel(tp_mesh)
    layers = model.model.layers
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        _attention(layer.self_attn, tp_mesh)
        if isinstance(layer.mlp, SwiGLU):
            parallelize_module(layer, tp_mesh, _lora_styles(layer, _mlp_plan("mlp", _adapted(layer.mlp)), P))
        elif isinstance(layer.mlp, MoE):
            shared = _mlp_plan("mlp.shared_experts", _adapted(layer.mlp.shared_experts))
            parallelize_module(layer, tp_mesh, _lora_styles(layer, shared, P))
            layer.mlp.experts.register_forward_pre_hook(tokens.pre, with_kwargs=True)
            layer.mlp.experts.register_forward_hook(tokens.post)
    return model
