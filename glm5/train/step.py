"""One micro-batch's forward and loss: language modelling (causal or GLM blank infilling), MTP and
the MoE balance terms.

Labels are aligned with the inputs (`labels[t]` is the target of position t, -100 = no loss), as the
data loader produces them for both objectives. Losses are returned as *sums* over target tokens so
that the trainer can normalise by the token count of the whole optimizer step (gradient accumulation
then equals one big batch exactly). Dims: B batch, T sequence, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .balance import balance_losses
from .indexer_warmup import indexer_kl
from .loss import linear_ce_sum

IGNORE = -100
MODEL_KEYS = ("input_ids", "position_ids", "segment_ids", "attention_mask", "block_position_ids")


@dataclass
class MicroResult:
    """Sums over the micro-batch's target tokens (not yet normalised) and side outputs."""

    lm_sum: torch.Tensor
    lm_tokens: int
    mtp_sum: torch.Tensor | None
    mtp_tokens: int
    balance: dict[str, torch.Tensor] = field(default_factory=dict)  # weighted extra terms (balance, indexer)
    router_stats: list[dict] = field(default_factory=list)


def mtp_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets of the MTP logits: position t predicts token t+2 = labels[t+1]. Positions whose next
    token is not a continuation (labels[t] == -100: document end, padding) get no MTP target."""
    nxt = F.pad(labels[:, 1:], (0, 1), value=IGNORE)  # [B, T]
    return torch.where(labels != IGNORE, nxt, IGNORE)


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy in fp32 over the non-ignored positions; logits [B, T, V], labels [B, T].

    Vocab-sharded logits (a DTensor from tensor parallel's LM head, inside `loss_parallel`) are never
    gathered: the result, the same on every TP rank, comes back as a plain tensor."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss.to_local() if isinstance(loss, DTensor) else loss


def forward_micro(model, batch: dict, objective: str, mtp_weight: float, balance_cfg,
                  indexer_coef: float = 0.0, capture=None, data_group=None, fused_ce: bool = False) -> MicroResult:
    """Run the model on one micro-batch; MTP runs only on causal-LM batches (GLM blank infilling is
    not left-to-right over Part A, so "token t+2" has no meaning there). With `capture` (an
    indexer_warmup.AttnCapture) and `indexer_coef`, adds the sparse-stage indexer KL term.
    `data_group`: the data-parallel process group (the batch balance loss sees the global batch).
    `fused_ce`: the LM and MTP losses straight from the final (and MTP) hidden states and the head's
    weight (`loss.linear_ce_sum`: no [tokens, vocab] logits; one process, unsharded head only)."""
    inputs = {k: batch[k] for k in MODEL_KEYS if batch.get(k) is not None}
    if capture is not None:
        capture.clear()
    cfg = getattr(model, "config", None)
    use_mtp = mtp_weight > 0 and objective in ("clm", "fim") and getattr(cfg, "num_nextn_predict_layers", 0) > 0
    labels = batch["labels"]
    if fused_ce:  # the model's logits only for the last position; the loss from the hidden states
        out = model(**inputs, return_mtp=use_mtp, logits_to_keep=1)
        lm_sum = linear_ce_sum(out.hidden_states, model.lm_head.weight, labels)
    else:
        out = model(**inputs, return_mtp=use_mtp)
        lm_sum = ce_sum(out.logits, labels)
    res = MicroResult(lm_sum=lm_sum, lm_tokens=int((labels != IGNORE).sum()),
                      mtp_sum=None, mtp_tokens=0, router_stats=list(out.router_stats or []))
    if use_mtp and out.mtp_logits is not None:
        targets = mtp_labels(labels)
        res.mtp_sum = (linear_ce_sum(out.mtp_hidden_states, model.lm_head.weight, targets) if fused_ce
                       else ce_sum(out.mtp_logits, targets))
        res.mtp_tokens = int((targets != IGNORE).sum())
    res.balance = balance_losses(res.router_stats, labels.shape[0], balance_cfg.seq_aux_coef,
                                 balance_cfg.aux_coef, balance_cfg.z_loss_coef, data_group)
    if capture is not None and indexer_coef:
        res.balance["indexer_kl"] = indexer_coef * indexer_kl(capture.records, out.selections)
        capture.clear()
    aux = getattr(out, "aux_loss", None)
    if isinstance(aux, torch.Tensor):
        res.balance["model_aux_loss"] = aux
    return res


def micro_loss(res: MicroResult, step_tokens: float, step_mtp_tokens: float, mtp_weight: float,
               n_micro: int) -> torch.Tensor:
    """The differentiable loss of one micro-batch, normalised so that the sum over the step's
    micro-batches is mean-LM-loss + mtp_weight * mean-MTP-loss + mean balance terms.

    With D data-parallel ranks pass the global token counts divided by D: the mean of the ranks'
    gradients (FSDP) is then the gradient of the global token mean, however the tokens fall on ranks."""
    loss = res.lm_sum / max(1, step_tokens)
    if res.mtp_sum is not None and step_mtp_tokens:
        loss = loss + mtp_weight * res.mtp_sum / step_mtp_tokens
    for term in res.balance.values():
        loss = loss + term / n_micro
    return loss
