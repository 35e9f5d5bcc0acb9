"""Cross entropy fused with the LM head: the [tokens, vocab] logits never exist at once.

`linear_ce_sum(h, weight, labels)` = sum over positions of CE(h @ weight^T, labels) (labels -100 are
skipped), computed over row chunks. The matmuls run in the autocast dtype when autocast is on (as the
head's F.linear would), softmax and the loss in fp32. Because the loss is a sum of per-row terms, its
gradient with respect to each chunk's logits (softmax - one-hot) is known in the forward pass: the
forward also computes d/dh and d/dweight chunk by chunk (the same three matmuls as logits + their
backward), and the backward only scales them by the incoming gradient. Peak extra memory is one
[chunk, vocab] block instead of the [tokens, vocab] logits, their log-softmax and its gradient (the
"fused linear cross entropy" of Liger-Kernel / torchtune, written with plain matmuls).
`linear_self_kl(z, h, weight, ...)` is the same for self-distillation through a shared head (the MTP
layer's `self` target): KL from the teacher rows h @ weight^T (detached) to the student rows z @ weight^T,
its gradient q - p known in the forward pass likewise.
"""

from __future__ import annotations

import torch

IGNORE = -100


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int, dtype: torch.dtype, grad_enabled: bool):
        """h [N, H], weight [V, H], labels [N] -> summed loss (0-d fp32); matmuls in `dtype`.
        `grad_enabled`: the caller's grad mode (needs_input_grad ignores torch.no_grad(), and evaluation
        must not pay for the gradients)."""
        need_h, need_w = (need and grad_enabled for need in ctx.needs_input_grad[:2])
        hc, wc = h.to(dtype), weight.to(dtype)
        d_h = torch.empty_like(hc) if need_h else None
        d_w = torch.zeros_like(wc, dtype=torch.float32) if need_w else None  # accumulated over chunks in fp32
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for lo in range(0, h.shape[0], chunk):
            rows = slice(lo, min(h.shape[0], lo + chunk))
            logits = (hc[rows] @ wc.t()).float()  # [c, V]
            lab = labels[rows]
            valid = lab != IGNORE
            safe = torch.where(valid, lab, 0)
            picked = logits.gather(1, safe[:, None])[:, 0]
            top = logits.amax(dim=-1)
            e = logits.sub_(top[:, None]).exp_()  # in place: one pass for exp(logits - max)
            z = e.sum(dim=-1)
            total += ((top + z.log() - picked) * valid).sum()  # logsumexp - target logit
            if need_h or need_w:
                # d loss / d logits = softmax - one-hot, zero on ignored rows (in place over the block)
                grad = e.div_(z[:, None])
                grad.scatter_add_(1, safe[:, None], -torch.ones_like(z[:, None]))
                grad = grad.mul_(valid[:, None]).to(dtype)
                if need_h:
                    torch.mm(grad, wc, out=d_h[rows])
                if need_w and dtype == torch.float32:
                    d_w.addmm_(grad.t(), hc[rows])
                elif need_w:
                    d_w += grad.t() @ hc[rows]
        ctx.save_for_backward(d_h if need_h else None, d_w if need_w else None)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, grad):
        d_h, d_w = ctx.saved_tensors
        g_h = (d_h * grad).to(ctx.dtypes[0]) if d_h is not None else None
        g_w = (d_w * grad).to(ctx.dtypes[1]) if d_w is not None else None
        return g_h, g_w, None, None, None, None


def linear_ce_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int | None = None
                  ) -> torch.Tensor:
    """Summed cross entropy of the logits h @ weight^T against labels (-100 = no loss), without
    materialising the logits; h [..., H], labels [...] (same leading shape), weight [V, H].
    `chunk`: rows per logits block; default: as many as keep one fp32 [rows, V] block within 8 MiB (at
    least 64). On CPU glibc serves such blocks from its heap, reused step after step, while a 32 MiB
    block is a fresh mapping whose pages fault in every step (8k faults a step on `small`)."""
    chunk = chunk or max(64, (8 << 20) // (4 * weight.shape[0]))
    dev = h.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(h.dtype, weight.dtype)
    with torch.autocast(dev, enabled=False):  # the Function's matmuls write into buffers of `dtype`
        return _LinearCE.apply(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), chunk, dtype,
                               torch.is_grad_enabled())


class _LinearSelfKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, h, weight, valid, labels, chunk: int, dtype: torch.dtype, grad_enabled: bool):
        """z [N, H] (student: the MTP layer's normed output), h [N, H] (teacher: the trunk's final hidden
        states, row by row the position whose next-token distribution z must match), weight [V, H],
        valid [N] bool (rows with a KL term), labels [N] (the teacher's own LM targets, -100 = none) ->
        (KL sum, teacher CE sum, argmax agreements), the last two not differentiable."""
        need_z, _, need_w = (need and grad_enabled for need in ctx.needs_input_grad[:3])
        zc, hc, wc = z.to(dtype), h.to(dtype), weight.to(dtype)
        d_z = torch.zeros_like(zc) if need_z else None
        d_w = torch.zeros_like(wc, dtype=torch.float32) if need_w else None
        kl = torch.zeros((), dtype=torch.float32, device=z.device)
        ce, agree = torch.zeros_like(kl), torch.zeros((), dtype=torch.int64, device=z.device)
        for lo in range(0, z.shape[0], chunk):
            rows = slice(lo, min(z.shape[0], lo + chunk))
            ok, lab = valid[rows], labels[rows]
            with torch.no_grad():
                logp = (hc[rows] @ wc.t()).float().log_softmax(-1)  # [c, V] teacher, never differentiated
            has = lab != IGNORE
            ce -= (logp.gather(1, torch.where(has, lab, 0)[:, None])[:, 0] * has).sum()
            if not bool(ok.any()):
                continue
            logq = (zc[rows] @ wc.t()).float().log_softmax(-1)  # [c, V] student
            agree += ((logq.argmax(-1) == logp.argmax(-1)) & ok).sum()
            p = logp.exp()
            kl += ((p * (logp - logq)).sum(-1) * ok).sum()
            if need_z or need_w:
                grad = logq.exp_().sub_(p).mul_(ok[:, None]).to(dtype)  # d KL / d student logits = q - p
                if need_z:
                    torch.mm(grad, wc, out=d_z[rows])
                if need_w and dtype == torch.float32:
                    d_w.addmm_(grad.t(), zc[rows])
                elif need_w:
                    d_w += grad.t() @ zc[rows]
        ctx.save_for_backward(d_z if need_z else None, d_w if need_w else None)
        ctx.dtypes = (z.dtype, weight.dtype)
        ctx.mark_non_differentiable(ce, agree)
        return kl, ce, agree

    @staticmethod
    def backward(ctx, grad, _ce, _agree):
        d_z, d_w = ctx.saved_tensors
        g_z = (d_z * grad).to(ctx.dtypes[0]) if d_z is not None else None
        g_w = (d_w * grad).to(ctx.dtypes[1]) if d_w is not None else None
        return g_z, None, g_w, None, None, None, None, None


def linear_self_kl(z: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor,
                   labels: torch.Tensor, chunk: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Self-distillation through one shared head, without materialising either [tokens, vocab] block:
    sum over `valid` rows of KL(softmax(h @ W^T) || softmax(z @ W^T)) (the teacher h detached), plus, as
    by-products of the teacher logits, the teacher's CE sum against `labels` and the number of valid rows
    whose student argmax equals the teacher's (greedy draft acceptance, teacher-forced). Rows are
    aligned: row i of z is trained towards row i of h. Gradients reach z (and `weight`, when it
    requires grad: only through the student logits); shapes as `linear_ce_sum`."""
    chunk = chunk or max(64, (8 << 20) // (4 * weight.shape[0]))
    dev = z.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else torch.promote_types(z.dtype, weight.dtype)
    H = z.shape[-1]
    with torch.autocast(dev, enabled=False):
        return _LinearSelfKL.apply(z.reshape(-1, H), h.detach().reshape(-1, H), weight, valid.reshape(-1),
                                   labels.reshape(-1), chunk, dtype, torch.is_grad_enabled())
