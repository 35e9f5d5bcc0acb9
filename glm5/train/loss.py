"""Cross entropy fused with the LM head: the [tokens, vocab] logits never exist at once.

`linear_ce_sum(h, weight, labels)` = sum over positions of CE(h @ weight^T, labels) (labels -100 are
skipped), computed over row chunks. The matmuls run in the autocast dtype when autocast is on (as the
head's F.linear would), softmax and the loss in fp32. Because the loss is a sum of per-row terms, its
gradient with respect to each chunk's logits (softmax - one-hot) is known in the forward pass: the
forward also computes d/dh and d/dweight chunk by chunk (the same three matmuls as logits + their
backward), and the backward only scales them by the incoming gradient. Peak extra memory is one
[chunk, vocab] block instead of the [tokens, vocab] logits, their log-softmax and its gradient (the
"fused linear cross entropy" of Liger-Kernel / torchtune, written with plain matmuls).
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
