"""The LM loss fused with the head equals cross entropy over the materialised logits (value and both
gradients, ignored positions and a ragged last chunk included), and the Trainer's step is the same
with and without it."""

import torch
import torch.nn.functional as F

from glm5.train.loss import linear_ce_sum


def test_linear_ce_matches_materialised_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37), generator=g)
    labels[0, :5] = -100
    got = linear_ce_sum(h, w, labels, chunk=8)  # 74 rows: 9 full chunks and a ragged one
    (got * 0.7).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    (ref * 0.7).backward()
    torch.testing.assert_close(got, ref.float())
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(linear_ce_sum(h, w, labels), ref.float())


def test_trainer_step_is_the_same_with_the_fused_loss(tmp_path):
    from tests.test_train_loop import make
    runs = [make(tmp_path / str(fused), steps=3, train={"fused_ce": fused, "mtp_weight": 0.3}) for fused in (False, True)]
    for t in runs:
        t.fit()
    for a, b in zip(*[[h["loss"] for h in t.history] for t in runs]):
        assert abs(a - b) < 1e-5
