"""Distillation losses: KL between the teacher's and the student's token distributions at temperature T.

Targets are either the teacher's full log-probs or its top-k (ids + log-probs) with the remaining mass
as one "tail" bucket, so that a teacher can run once and be cached compactly; with k = V the two agree
exactly. The student's distribution is reduced to the same buckets. Both directions are supported:
forward KL(p_teacher || q_student) (mode-covering, Hinton et al.) and reverse KL(q || p) (mode-seeking,
MiniLLM). Each is multiplied by T^2 (Hinton: keeps gradient scale independent of T) and *summed* over
target positions, as the trainer's losses are. Dims: B batch, T sequence, V vocab, K kept ids, N = B*T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TINY = 1e-20


@dataclass
class TeacherTargets:
    """Teacher log-probs at the distillation temperature. Full: `logprobs` [B, T, V], `ids` None.
    Top-k: `ids` [B, T, K], `logprobs` [B, T, K], `tail` [B, T] = log of the mass outside the top-k."""

    logprobs: torch.Tensor
    ids: torch.Tensor | None = None
    tail: torch.Tensor | None = None


def log_tail(logprobs_topk: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(logprobs))) over the last dim, clamped away from log(0)."""
    return torch.log((1 - logprobs_topk.exp().sum(-1)).clamp_min(TINY))


def topk_targets(teacher_logits: torch.Tensor, temperature: float, k: int) -> TeacherTargets:
    """Top-k of the teacher's tempered distribution plus its tail mass (to cache)."""
    lp = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)  # [B, T, V]
    top_lp, top_ids = lp.topk(k, dim=-1)  # [B, T, K]
    return TeacherTargets(top_lp, top_ids, log_tail(top_lp))


def full_targets(teacher_logits: torch.Tensor, temperature: float) -> TeacherTargets:
    return TeacherTargets(torch.log_softmax(teacher_logits.float() / temperature, dim=-1))


def _buckets(p_lp: torch.Tensor, q_lp: torch.Tensor, p_tail, q_tail):
    """Stack the tail bucket onto the kept ids: ([N, K(+1)] teacher, [N, K(+1)] student) log-probs."""
    if p_tail is None:
        return p_lp, q_lp
    return torch.cat([p_lp, p_tail[:, None]], -1), torch.cat([q_lp, q_tail[:, None]], -1)


def kd_sums(student_logits: torch.Tensor, targets: TeacherTargets, mask: torch.Tensor, temperature: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward KL sum, reverse KL sum) over positions where `mask` [B, T] is True, each times T^2.

    student_logits [B, T, V]; the teacher's vocabulary must be the student's (checked before training)."""
    sel = mask.reshape(-1)
    q_all = torch.log_softmax(student_logits.float().reshape(-1, student_logits.shape[-1])[sel] / temperature, -1)
    p_lp = targets.logprobs.reshape(-1, targets.logprobs.shape[-1])[sel]  # [N, K]
    if targets.ids is None:
        p, q = p_lp, q_all  # [N, V]
    else:
        ids = targets.ids.reshape(-1, targets.ids.shape[-1])[sel]  # [N, K]
        q_k = q_all.gather(1, ids)  # [N, K]
        p, q = _buckets(p_lp, q_k, targets.tail.reshape(-1)[sel], log_tail(q_k))
    forward = (p.exp() * (p - q)).sum()
    reverse = (q.exp() * (q - p)).sum()
    t2 = temperature ** 2
    return forward * t2, reverse * t2
