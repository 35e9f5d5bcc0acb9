"""Gradient stability: global-norm clipping, the seeds' adaptive layer-wise clipping (T3) and a
non-finite guard that skips bad steps (T6).

Owns the gradient post-processing between `backward()` and `optimizer.step()`. Order matters: the
guard runs on the raw gradient norms first (clipping an inf gradient turns it into NaN and hides
which parameters broke), then clipping.
"""

from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn

logger = logging.getLogger("glm5.train")

_LAYER_RE = re.compile(r"^(.*?layers\.\d+)\.")


class TrainingDiverged(RuntimeError):
    """Raised when more than `max_bad_steps` steps had non-finite loss or gradients."""


def layer_groups(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Group trainable params by layer: `...layers.<i>` prefixes, else the top-level module name
    (embeddings, final norm, lm_head, MTP each form their own group)."""
    groups: dict[str, list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        m = _LAYER_RE.match(name)
        key = m.group(1) if m else name.rsplit(".", 1)[0] if "." in name else name
        groups.setdefault(key, []).append(p)
    return groups


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())


def grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of the gradients of `params` (fp32 scalar tensor; inf/NaN if any grad is)."""
    return _norm([p.grad for p in params if p.grad is not None])


def layerwise_threshold(norm: torch.Tensor, base: float) -> torch.Tensor:
    """Seed T3: threshold = base * (1 + 0.1 * ln(norm))."""
    return base * (1.0 + 0.1 * torch.log(norm))


def _scale(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    torch._foreach_mul_(grads, scale.to(grads[0].dtype))


@torch.no_grad()
def clip_layerwise(groups: dict[str, list[nn.Parameter]], base: float, norm_fn=_norm,
                   scale_fn=_scale) -> dict[str, float]:
    """Seed T3 per layer: grad *= min(1, threshold / norm), threshold = base * (1 + 0.1 * ln(norm)).

    The threshold is <= 0 only when norm <= e^-10, where the formula would flip the gradient's sign;
    such tiny gradients are left alone. Returns each layer's pre-clip norm. `norm_fn`/`scale_fn` let
    sharded (DTensor) gradients use their distributed versions (glm5/train/parallel.py).
    """
    norms = {}
    for key, params in groups.items():
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            continue
        norm = norm_fn(grads).float().cpu()
        threshold = layerwise_threshold(norm, base)
        scale = torch.where((norm > 0) & (threshold > 0), (threshold / norm).clamp(max=1.0),
                            torch.ones_like(norm))
        scale_fn(grads, scale)
        norms[key] = float(norm)
    return norms


@torch.no_grad()
def clip_global(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """grad *= min(1, max_norm / norm) with a precomputed global `norm` (as clip_grad_norm_)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale.to(grads[0].dtype))


def nonfinite_params(model: nn.Module) -> list[str]:
    """Names of parameters whose gradient holds a NaN or inf."""
    return [n for n, p in model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())]


class NonFiniteGuard:
    """Skips optimizer steps whose loss or gradient norm is not finite.

    On a bad step: logs the non-finite parameters, zeroes the gradients (the caller must not call
    `optimizer.step()`), multiplies `lr_scale` by `lr_factor` (seed T6: "lower LR by 10%" = 0.9), and
    raises `TrainingDiverged` once more than `max_bad_steps` steps were skipped in total.
    """

    def __init__(self, max_bad_steps: int = 10, lr_factor: float = 1.0):
        self.max_bad_steps, self.lr_factor = max_bad_steps, lr_factor
        self.bad_steps = 0
        self.lr_scale = 1.0

    def check(self, model: nn.Module, loss: float, norm: float, step: int) -> bool:
        """True if the step may proceed; False if it was skipped (grads zeroed)."""
        if math.isfinite(loss) and math.isfinite(norm):
            return True
        bad = nonfinite_params(model)
        self.bad_steps += 1
        self.lr_scale *= self.lr_factor
        shown = ", ".join(bad[:8]) + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
        logger.warning("step %d: non-finite loss=%s grad_norm=%s; skipping step %d/%d; bad grads: %s",
                       step, loss, norm, self.bad_steps, self.max_bad_steps, shown or "none")
        for p in model.parameters():
            p.grad = None
        if self.bad_steps > self.max_bad_steps:
            raise TrainingDiverged(f"{self.bad_steps} non-finite steps (limit stability.max_bad_steps="
                                   f"{self.max_bad_steps}); last bad params: {shown or 'none'}")
        self.last_bad = bad
        return False

    def state_dict(self) -> dict:
        return {"bad_steps": self.bad_steps, "lr_scale": self.lr_scale}

    def load_state_dict(self, d: dict) -> None:
        self.bad_steps, self.lr_scale = int(d["bad_steps"]), float(d["lr_scale"])
