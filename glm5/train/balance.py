"""MoE load balance for training (seed M2, T4, T6): router z-loss, sequence-level and batch-level
balance losses, the aux-loss-free bias update, and per-layer expert-load statistics.

Reads the model's `out.router_stats` (one dict per MoE layer: `tokens_per_expert [E]`,
`router_logits [N, E]` fp32, `scores [N, E]`, `topk_idx [N, A]`; N = B*T tokens) and the gates'
persistent `e_score_correction_bias [E]` buffers. Knows nothing about the model's structure beyond
that. Letters: B batch, T sequence, N tokens, E routed experts, A active experts per token, L layers.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from glm5.core import dist as gdist

_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def z_loss(router_stats: list[dict]) -> torch.Tensor:
    """ST-MoE router z-loss, summed over layers: mean over tokens of logsumexp(router_logits)^2."""
    losses = [torch.logsumexp(s["router_logits"].float(), dim=-1).pow(2).mean() for s in router_stats]
    return torch.stack(losses).sum() if losses else torch.zeros(())


def balance_loss(scores: torch.Tensor, topk_idx: torch.Tensor, num_groups: int,
                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """DeepSeek-V3 balance loss sum_i f_i * P_i, averaged over `num_groups` equal token groups.

    f_i = E / (A * T) * #{tokens t of the group routing to expert i}   (1 everywhere when balanced)
    P_i = mean_t s'_{t,i}, with s' the scores normalised to sum 1 per token.
    One group per sequence gives the sequence-wise auxiliary loss; one group for the whole batch
    gives the GShard/Switch-style batch balance loss (the seeds' "balance penalty").

    `group` (batch loss only: the D data-parallel ranks, each holding an equal share of the global
    batch) makes the batch the global one: f counts the tokens of every rank (all-reduced, no
    gradient) and the result is D x this rank's share of sum_i f_i * P_i, so that the mean of the
    ranks' gradients (what FSDP computes) is the gradient of the global-batch loss, at any D.
    """
    n, e = scores.shape
    a = topk_idx.shape[-1]
    t = n // num_groups
    probs = scores.float() / scores.float().sum(-1, keepdim=True).clamp(min=1e-20)
    probs = probs.view(num_groups, t, e)  # [G, T, E]
    counts = torch.zeros(num_groups, e, device=scores.device, dtype=torch.float32)
    ones = torch.ones(num_groups, t * a, device=scores.device, dtype=torch.float32)
    counts.scatter_add_(1, topk_idx.reshape(num_groups, t * a).long(), ones)  # [G, E]
    d = dist.get_world_size(group) if group is not None else 1
    if d > 1:
        if num_groups != 1:
            raise ValueError("balance_loss: a process group only applies to the batch loss (num_groups=1)")
        dist.all_reduce(counts, group=group)  # [1, E] over the global batch of d * t tokens
    f = counts * (e / (a * t * d))
    p = probs.mean(1)  # [G, E]; d x (this rank's sum) / (d * t) = the rank's share times d
    return (f * p).sum(-1).mean()


def balance_losses(router_stats: list[dict], batch_size: int, seq_coef: float, batch_coef: float,
                   z_coef: float, group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """The weighted balance terms to add to the loss (only those with a non-zero coefficient),
    each summed over MoE layers: `seq_aux_loss`, `aux_loss`, `z_loss`. `group`: the data-parallel
    ranks; the batch loss then balances the global batch (see `balance_loss`); the per-sequence and
    per-token terms are means over equal shares, already global once FSDP averages the gradients."""
    out: dict[str, torch.Tensor] = {}
    if not router_stats:
        return out
    if seq_coef:
        out["seq_aux_loss"] = seq_coef * sum(balance_loss(s["scores"], s["topk_idx"], batch_size)
                                             for s in router_stats)
    if batch_coef:
        out["aux_loss"] = batch_coef * sum(balance_loss(s["scores"], s["topk_idx"], 1, group) for s in router_stats)
    if z_coef:
        out["z_loss"] = z_coef * z_loss(router_stats)
    return out


def find_gates(model: nn.Module) -> dict[int, nn.Module]:
    """The MoE gate modules (owning an `e_score_correction_bias` buffer) by layer index: the `<i>` of
    a `layers.<i>.` module path, else their order."""
    gates = {}
    for name, m in model.named_modules():
        if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor):
            match = _LAYER_RE.search(name)
            gates[int(match.group(1)) if match else len(gates)] = m
    return gates


class LoadTracker:
    """Sums `tokens_per_expert` per MoE layer over the micro-batches of one optimizer step.

    Layers are keyed by the stats' `layer` index (else their position), so micro-batches that run
    different layer sets (the MTP layer runs only on causal-LM batches) add up correctly."""

    def __init__(self):
        self.loads: dict[int, torch.Tensor] = {}

    def add(self, router_stats: list[dict]) -> None:
        for i, s in enumerate(router_stats):
            layer = int(s.get("layer", i))
            count = s["tokens_per_expert"].detach().float()
            if layer in self.loads:
                self.loads[layer] += count
            else:
                self.loads[layer] = count.clone()

    def reduce(self, group: dist.ProcessGroup | None = None) -> dict[int, torch.Tensor]:
        """The step's loads, summed over the data-parallel ranks of `group` (default: all ranks). Every
        rank of the group must call this and must have run the same layers."""
        if self.loads and gdist.is_dist():
            keys = sorted(self.loads)
            flat = torch.stack([self.loads[k] for k in keys])  # [L, E]
            dist.all_reduce(flat, group=group)
            self.loads = dict(zip(keys, flat.unbind(0)))
        return self.loads

    def reset(self) -> None:
        self.loads = {}


@torch.no_grad()
def update_expert_bias(gates: dict[int, nn.Module], loads: dict[int, torch.Tensor], rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): b_i += rate * sign(mean_load - load_i) per layer.

    Underloaded experts get a larger selection bias, overloaded ones a smaller one. `loads` must be
    the same on every rank (see `LoadTracker.reduce`).
    """
    if rate == 0:
        return
    for layer, load in loads.items():
        if layer not in gates:
            raise ValueError(f"MoE layer {layer} reported loads but the model has no gate there "
                             f"(gates at {sorted(gates)})")
        bias = gates[layer].e_score_correction_bias
        delta = torch.sign(load.mean() - load).to(device=bias.device, dtype=bias.dtype)
        bias.add_(delta, alpha=rate)


def load_metrics(loads: dict[int, torch.Tensor]) -> dict:
    """Per-layer expert-load summary for the metrics log: max/mean ("imbalance", 1 = perfect), the
    fraction of experts that got no token, and each layer's load vector as fractions (for plots)."""
    if not loads:
        return {}
    imbalance, dead, fractions = [], [], []
    for _, load in sorted(loads.items()):
        total = float(load.sum())
        mean = total / load.numel() if load.numel() else 0.0
        imbalance.append(float(load.max()) / mean if mean > 0 else 0.0)
        dead.append(float((load == 0).float().mean()))
        fractions.append([round(float(x) / total, 5) if total else 0.0 for x in load])
    return {"moe_layers": sorted(loads), "moe_imbalance": max(imbalance), "moe_imbalance_per_layer": [round(x, 4) for x in imbalance],
            "moe_dead_frac_per_layer": dead, "expert_load": fractions}
