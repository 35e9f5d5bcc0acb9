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

from glm5.model.layers import rope_angles

from .balance import balance_losses
from .indexer_warmup import dense_attention, indexer_kl
from .loss import linear_ce_sum, linear_self_kl

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
    mtp_agree: int | None = None  # `self` target: MTP targets whose argmax equals the trunk's at t+1


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


def self_kl_sum(logits: torch.Tensor, mtp_logits: torch.Tensor, labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The `self` MTP target from logits [B, T, V]: sum over MTP positions t (those `mtp_labels` keeps) of
    KL(softmax(logits[t+1]) detached || softmax(mtp_logits[t])), and the count of those t whose MTP
    argmax equals the trunk's argmax at t+1. Vocab-sharded logits (TP) are refused: use the data target."""
    if isinstance(logits, DTensor) or isinstance(mtp_logits, DTensor):
        raise ValueError("train.mtp_target = 'self' is not supported with tensor parallel (vocab-sharded logits)")
    valid = (mtp_labels(labels) != IGNORE)[:, :-1]  # [B, T-1]
    logp = F.log_softmax(logits[:, 1:].detach().float(), dim=-1)
    logq = F.log_softmax(mtp_logits[:, :-1].float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    agree = (logq.argmax(-1) == logp.argmax(-1)) & valid
    return (kl * valid).sum(), agree.sum()


def _self_kl_fused(z: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """`self_kl_sum` from hidden states (`loss.linear_self_kl`): MTP row t sits beside trunk row t+1
    (z shifted right by one), so one pass over the trunk's rows also gives its full LM CE sum.
    -> (KL sum, trunk LM CE sum, agreements)."""
    valid = mtp_labels(labels) != IGNORE
    z_at = F.pad(z[:, :-1], (0, 0, 1, 0))  # row s holds the MTP output of position s-1
    valid_at = F.pad(valid[:, :-1], (1, 0), value=False)
    return linear_self_kl(z_at, h, weight, valid_at, labels)


def forward_micro(model, batch: dict, objective: str, mtp_weight: float, balance_cfg,
                  indexer_coef: float = 0.0, capture=None, data_group=None, fused_ce: bool = False,
                  trainable: str = "all", mtp_target: str = "data") -> MicroResult:
    """Run the model on one micro-batch; MTP runs only on causal-LM batches (GLM blank infilling is
    not left-to-right over Part A, so "token t+2" has no meaning there). With `capture` (an
    indexer_warmup.AttnCapture) and `indexer_coef`, adds the sparse-stage indexer KL term.
    `data_group`: the data-parallel process group (the batch balance loss sees the global batch).
    `fused_ce`: the LM and MTP losses straight from the final (and MTP) hidden states and the head's
    weight (`loss.linear_ce_sum`: no [tokens, vocab] logits; one process, unsharded head only).
    `trainable` (`train.trainable`): "mtp" / "indexer" run the rest of the model as a frozen forward
    (`frozen_trunk_mtp`, `frozen_indexer`). `mtp_target` (`train.mtp_target`): "data" = CE against token
    t+2, "self" = KL to the trunk's own (detached) next-token distribution at t+1."""
    if trainable == "mtp":
        return frozen_trunk_mtp(model, batch, objective, balance_cfg, data_group, fused_ce, mtp_target)
    if trainable == "indexer":
        return frozen_indexer(model, batch, capture, fused_ce)
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
        if mtp_target == "self" and fused_ce:
            res.mtp_sum, _, agree = _self_kl_fused(out.mtp_hidden_states, out.hidden_states, model.lm_head.weight,
                                                   labels)
            res.mtp_agree = int(agree)
        elif mtp_target == "self":
            res.mtp_sum, agree = self_kl_sum(out.logits, out.mtp_logits, labels)
            res.mtp_agree = int(agree)
        else:
            res.mtp_sum = (linear_ce_sum(out.mtp_hidden_states, model.lm_head.weight, targets) if fused_ce
                           else ce_sum(out.mtp_logits, targets))
        res.mtp_tokens = int((targets != IGNORE).sum())
    res.balance = balance_losses(res.router_stats, labels.shape[0], balance_cfg.seq_aux_coef,
                                 balance_cfg.aux_coef, balance_cfg.z_loss_coef, data_group)
    if capture is not None and indexer_coef:
        res.balance["indexer_kl"] = indexer_coef * indexer_kl(capture.records, out.selections, capture.rows)
        capture.clear()
    aux = getattr(out, "aux_loss", None)
    if isinstance(aux, torch.Tensor):
        res.balance["model_aux_loss"] = aux
    return res


def frozen_trunk_mtp(model, batch: dict, objective: str, balance_cfg, data_group=None, fused_ce: bool = False,
                     mtp_target: str = "data") -> MicroResult:
    """`train.trainable = "mtp"`: the trunk (embedding, main layers, final norm, head) runs under no_grad,
    a forward only; the MTP layer(s) then run on its detached final hidden states with autograd, so only
    they (and their loss through the frozen shared head) cost a backward. The LM loss is the frozen
    trunk's (for the log); the balance terms cover the MTP layers' routers only (the trunk's are fixed)."""
    if objective != "clm":
        raise ValueError(f"train.trainable = 'mtp' trains on causal-LM batches only, got a {objective!r} batch")
    inputs = {k: batch[k] for k in MODEL_KEYS if batch.get(k) is not None}
    labels = batch["labels"]
    with torch.no_grad():
        out = model(**inputs, logits_to_keep=1 if fused_ce else 0)
    h = out.hidden_states
    mtp_logits, z, mstats = run_mtp(model, inputs, h, logits_to_keep=1 if fused_ce else 0)
    B = labels.shape[0]
    targets = mtp_labels(labels)
    res = MicroResult(lm_sum=torch.zeros(()), lm_tokens=int((labels != IGNORE).sum()), mtp_sum=None,
                      mtp_tokens=int((targets != IGNORE).sum()), router_stats=list(out.router_stats) + mstats)
    weight = model.lm_head.weight
    if mtp_target == "self" and fused_ce:
        res.mtp_sum, res.lm_sum, agree = _self_kl_fused(z, h, weight, labels)
        res.mtp_agree = int(agree)
    elif mtp_target == "self":
        res.mtp_sum, agree = self_kl_sum(out.logits, mtp_logits, labels)
        res.mtp_agree = int(agree)
    else:
        res.mtp_sum = linear_ce_sum(z, weight, targets) if fused_ce else ce_sum(mtp_logits, targets)
    if not (mtp_target == "self" and fused_ce):
        with torch.no_grad():
            res.lm_sum = linear_ce_sum(h, weight, labels) if fused_ce else ce_sum(out.logits, labels)
    res.balance = balance_losses(mstats, B, balance_cfg.seq_aux_coef, balance_cfg.aux_coef,
                                 balance_cfg.z_loss_coef, data_group)
    return res


def run_mtp(model, inputs: dict, h: torch.Tensor, logits_to_keep: int = 0):
    """The model's MTP layers alone on given trunk hidden states h [B, T, H] (final-normed, as
    `ModelOutput.hidden_states`), with the positions and mask `inputs` describe, as the model's own forward
    would run them -> (MTP logits, the first layer's normed output, router stats)."""
    ids = inputs["input_ids"]
    B, T = ids.shape
    pos = inputs.get("position_ids")
    pos = torch.arange(T, device=ids.device)[None].expand(B, -1) if pos is None else pos
    cos, sin = rope_angles(pos, model.model.inv_freq)
    mask = model._mask(inputs.get("attention_mask"), inputs.get("segment_ids"), B, T)
    return model._mtp(ids, None, h, cos, sin, mask, logits_to_keep=logits_to_keep)


def frozen_indexer(model, batch: dict, capture, fused_ce: bool = False) -> MicroResult:
    """`train.trainable = "indexer"`: a frozen dense forward under no_grad (the indexer warm-up's), then
    the indexers' KL to the head-summed attention distribution over every key a query may attend to
    (`indexer_kl`; inputs captured detached, so the loss reaches the indexers only)."""
    if capture is None:
        raise ValueError("train.trainable = 'indexer' needs the trainer's attention capture")
    inputs = {k: batch[k] for k in MODEL_KEYS if batch.get(k) is not None}
    labels = batch["labels"]
    capture.clear()
    with torch.no_grad(), dense_attention(model):
        out = model(**inputs, logits_to_keep=1 if fused_ce else 0)
        lm_sum = linear_ce_sum(out.hidden_states, model.lm_head.weight, labels) if fused_ce else ce_sum(out.logits, labels)
    res = MicroResult(lm_sum=lm_sum, lm_tokens=int((labels != IGNORE).sum()), mtp_sum=None, mtp_tokens=0,
                      router_stats=list(out.router_stats or []))
    if capture.enabled:  # off during evaluation
        res.balance["indexer_kl"] = indexer_kl(capture.records, rows=capture.rows)
    capture.clear()
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
