"""Optimisers and their parameter groups: AdamW (default), LAMB, Muon (+ AdamW for non-matrix params).

Owns: sorting a model's parameters into groups (weight decay only on matrices; embeddings
optionally excluded; Muon only on hidden matrices), the LAMB and Muon update rules, and
`build_optimizer(model, cfg)`. Knows nothing about schedules: every group carries `base_lr`, and the
trainer sets `lr = base_lr * schedule(step)`.

Muon here is ours rather than `torch.optim.Muon` because torch's casts to bf16 (pathologically slow on
CPU) and accepts only 2-D params, while grouped MoE experts are stored as [E, out, in] stacks that
must be orthogonalised matrix by matrix.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch import nn
from torch.optim.adam import adam as adam_fn

# Keller Jordan's quintic Newton-Schulz coefficients (also torch.optim.Muon's defaults).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# Parameter names that always go to AdamW under Muon (output heads, MTP head); routers and
# embeddings are detected structurally in `classify_params`.
ADAMW_NAME_PATTERNS = ("lm_head", "shared_head")


def classify_params(model: nn.Module, decay_embeddings: bool = False,
                    extra_adamw_patterns: Iterable[str] = ()) -> dict[str, str]:
    """Map each trainable parameter name to "muon", "decay" or "no_decay".

    - "no_decay": tensors with ndim < 2 (norm weights, biases, scalar gates) and, unless
      `decay_embeddings`, embedding tables. They never get weight decay.
    - "decay": matrices that Muon must not touch: embeddings (when decayed), output heads, routers
      (modules owning an `e_score_correction_bias` buffer or named `gate`), `extra_adamw_patterns`.
    - "muon": every other matrix (or [E, out, in] stack of matrices): the hidden projections.
    AdamW and LAMB treat "muon" like "decay".
    """
    embed_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    router_params = set()
    for name, m in model.named_modules():
        is_router = hasattr(m, "e_score_correction_bias") or name.split(".")[-1] in ("gate", "router")
        if is_router and not isinstance(m, (nn.Embedding,)):
            router_params.update(id(p) for p in m.parameters(recurse=False))
    patterns = tuple(ADAMW_NAME_PATTERNS) + tuple(extra_adamw_patterns)
    kinds = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or (id(p) in embed_params and not decay_embeddings):
            kinds[name] = "no_decay"
        elif id(p) in embed_params or id(p) in router_params or any(s in name for s in patterns):
            kinds[name] = "decay"
        else:
            kinds[name] = "muon"
    return kinds


def param_groups(model: nn.Module, lr: float, weight_decay: float, decay_embeddings: bool = False,
                 muon: bool = False, muon_lr: float | None = None,
                 extra_adamw_patterns: Iterable[str] = ()) -> list[dict]:
    """Torch optimizer param groups; each has `name`, `base_lr`, `use_muon` and `weight_decay`."""
    kinds = classify_params(model, decay_embeddings, extra_adamw_patterns)
    params = dict(model.named_parameters())
    by_kind: dict[str, list] = {"muon": [], "decay": [], "no_decay": []}
    for name, kind in kinds.items():
        if kind == "muon" and not muon:
            kind = "decay"  # AdamW/LAMB: hidden matrices are ordinary decayed params
        by_kind[kind].append(params[name])
    groups = []
    for kind, ps in by_kind.items():
        if not ps:
            continue
        glr = muon_lr if (kind == "muon" and muon_lr) else lr
        groups.append({"params": ps, "name": kind, "lr": glr, "base_lr": glr, "use_muon": kind == "muon",
                       "weight_decay": 0.0 if kind == "no_decay" else weight_decay})
    return groups


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  coeffs: tuple[float, float, float] = NS_COEFFS) -> torch.Tensor:
    """Approximately orthogonalise the last two dims of `g` ([..., m, n]) by a quintic Newton-Schulz.

    Works batched over leading dims (an expert stack [E, out, in] is E independent matrices). Runs
    in bf16 on GPU (as the reference) and fp32 on CPU, where bf16 matmul is very slow.
    """
    a, b, c = coeffs
    work = torch.bfloat16 if g.is_cuda else (torch.float64 if g.dtype == torch.float64 else torch.float32)
    x = g.to(work)
    transposed = g.size(-2) > g.size(-1)
    if transposed:
        x = x.mT  # [..., n, m]: iterate on the wide orientation, the Gram matrix is smaller
    # Normalise each matrix so its spectral norm is <= 1 (Frobenius bounds spectral).
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT  # [..., m, m]
        x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.mT
    return x.to(g.dtype)


def muon_lr_scale(shape: torch.Size, mode: str) -> float:
    """Per-matrix LR factor. "match_rms_adamw" (Moonlight): 0.2*sqrt(max(A, B)), so the AdamW LR works
    for Muon too; "original" (Keller Jordan): sqrt(max(1, A/B)); "none": 1."""
    rows, cols = shape[-2], shape[-1]
    if mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if mode == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0



def _closure_loss(closure):
    """The optimizer-step closure contract: re-evaluate the loss with grad enabled, if one is given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()

class Muon(torch.optim.Optimizer):
    """Muon on groups with `use_muon=True`, AdamW on the others (one optimizer, one state_dict).

    Muon step (per matrix, as torch.optim.Muon): B = mu*B + g; U = g + mu*B (nesterov) or B;
    O = NS(U); p *= 1 - lr*wd; p -= lr * scale(shape) * O.
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr: str = "match_rms_adamw",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, adjust_lr=adjust_lr, betas=betas, eps=eps, use_muon=True)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            (self._muon_group if group["use_muon"] else self._adamw_group)(group)
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buf.mul_(mu).add_(g)
            update = g.add(buf, alpha=mu) if group["nesterov"] else buf
            ortho = newton_schulz(update, group["ns_steps"])
            p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-lr * muon_lr_scale(p.shape, group["adjust_lr"]))

    def _adamw_group(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            st = self.state[p]
            if "exp_avg" not in st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p)
                st["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        adam_fn(
            params, [p.grad for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
            decoupled_weight_decay=True, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False, foreach=None)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019; DeepSpeed's FusedLamb formula), per parameter tensor:

    m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2;  (bias-corrected m^, v^)
    u = m^ / (sqrt(v^) + eps) + wd * p
    trust = ||p|| / ||u|| (1 when either norm is 0), clamped to [0, max_trust]
    p -= lr * trust * u
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, max_trust: float = 10.0,
                 bias_correction: bool = True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_trust=max_trust,
                        bias_correction=bias_correction)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                st["step"] += 1
                t = st["step"].item()
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                c1, c2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
                u = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if group["weight_decay"]:
                    u.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), u.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                trust = trust.clamp(max=group["max_trust"])
                p.add_(u * trust, alpha=-group["lr"])
        return loss


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """Build the optimizer named by `cfg.name` (an `OptimConfig`) over `model`'s trainable params."""
    use_muon = cfg.name == "muon"
    groups = param_groups(model, cfg.lr, cfg.weight_decay, cfg.decay_embeddings, muon=use_muon,
                          muon_lr=cfg.muon_lr or None)
    betas = tuple(cfg.betas)
    if cfg.name == "adamw":
        # torch's fused AdamW runs on CUDA and CPU (8x faster than the per-tensor loop on the `small`
        # preset's CPU step: 0.14 vs 1.1 s); sharded DTensor parameters keep the default implementation
        params = [p for g in groups for p in g["params"]]
        fused = bool(params) and all(p.device.type in ("cuda", "cpu") and not isinstance(p, DTensor)
                                     for p in params)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, fused=fused or None)
    if cfg.name == "adamw8bit":
        return adamw_8bit(groups, cfg.lr, betas, cfg.eps)
    if cfg.name == "lamb":
        return Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, max_trust=cfg.lamb_max_trust)
    if cfg.name == "muon":
        return Muon(groups, lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                    ns_steps=cfg.muon_ns_steps, adjust_lr=cfg.muon_adjust_lr, betas=betas, eps=cfg.eps)
    raise ValueError(f"optim.name: unknown optimizer {cfg.name!r}")


def adamw_8bit(groups: list[dict], lr: float, betas: tuple, eps: float) -> torch.optim.Optimizer:
    """bitsandbytes' AdamW8bit: both Adam moments block-wise quantised to 8 bits (a dynamic code with one
    absmax per 256-value block; tensors under 4096 values keep fp32 moments), so optimizer state is
    2 bytes per parameter instead of 8. Runs on CPU and GPU; optional dependency (`glm5[finetune]`)."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise ImportError("optim.name = 'adamw8bit' needs bitsandbytes: "
                          "pip install -c constraints.txt 'glm5[finetune]'") from e
    return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=eps)
