"""MoE balance terms against brute-force formulas; the aux-loss-free bias update."""

import pytest
import torch
from torch import nn

from glm5.train.balance import (LoadTracker, balance_loss, balance_losses, find_gates, load_metrics,
                                update_expert_bias, z_loss)


def _stats(n=12, e=4, a=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g)
    scores = logits.sigmoid()
    topk = scores.topk(a, dim=-1).indices
    return {"router_logits": logits, "scores": scores, "topk_idx": topk,
            "tokens_per_expert": torch.bincount(topk.flatten(), minlength=e)}


def _brute_balance(scores, topk, groups):
    n, e = scores.shape
    a, t = topk.shape[1], n // groups
    total = 0.0
    for gi in range(groups):
        sl = slice(gi * t, (gi + 1) * t)
        s = scores[sl] / scores[sl].sum(-1, keepdim=True)
        for i in range(e):
            f = e / (a * t) * sum(int(i in topk[k].tolist()) for k in range(gi * t, (gi + 1) * t))
            total += f * float(s[:, i].mean())
    return total / groups


@pytest.mark.parametrize("groups", [1, 3])
def test_balance_loss_matches_brute_force(groups):
    st = _stats()
    got = balance_loss(st["scores"], st["topk_idx"], groups)
    assert float(got) == pytest.approx(_brute_balance(st["scores"], st["topk_idx"], groups), rel=1e-5)


def test_balance_loss_is_1_when_perfectly_balanced():
    # 4 experts, top-1, each expert chosen by exactly one token with uniform scores.
    scores = torch.full((4, 4), 0.5)
    topk = torch.arange(4).view(4, 1)
    assert float(balance_loss(scores, topk, 1)) == pytest.approx(1.0)


def test_z_loss_and_weighting():
    st = [_stats(seed=0), _stats(seed=1)]
    expected = sum(float(torch.logsumexp(s["router_logits"], -1).pow(2).mean()) for s in st)
    assert float(z_loss(st)) == pytest.approx(expected, rel=1e-6)
    out = balance_losses(st, batch_size=3, seq_coef=1e-4, batch_coef=0.01, z_coef=0.0)
    assert set(out) == {"seq_aux_loss", "aux_loss"}
    assert float(out["aux_loss"]) == pytest.approx(0.01 * sum(
        _brute_balance(s["scores"], s["topk_idx"], 1) for s in st), rel=1e-5)


def test_balance_loss_has_gradient_towards_balance():
    logits = torch.zeros(8, 4, requires_grad=True)
    with torch.no_grad():
        logits[:, 0] += 2.0  # everyone prefers expert 0
    scores = logits.sigmoid()
    loss = balance_loss(scores, scores.topk(1, -1).indices, 1)
    loss.backward()
    assert (logits.grad[:, 0] > 0).all()  # gradient descent lowers expert 0's logit


class Gate(nn.Module):
    def __init__(self, e):
        super().__init__()
        self.register_buffer("e_score_correction_bias", torch.zeros(e))


class Layer(nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.gate = Gate(4) if moe else nn.Linear(2, 2)


def test_bias_update_rule_and_tracker():
    model = nn.Module()
    model.layers = nn.ModuleList([Layer(False), Layer(True), Layer(True)])
    gates = find_gates(model)
    assert sorted(gates) == [1, 2]
    tracker = LoadTracker()
    tracker.add([{"layer": 1, "tokens_per_expert": torch.tensor([5, 1, 1, 1])},
                 {"layer": 2, "tokens_per_expert": torch.tensor([2, 2, 2, 2])}])
    tracker.add([{"layer": 1, "tokens_per_expert": torch.tensor([3, 1, 0, 3])}])  # layer 2 did not run
    loads = tracker.reduce()
    assert loads[1].tolist() == [8, 2, 1, 4] and loads[2].tolist() == [2, 2, 2, 2]
    update_expert_bias(gates, loads, rate=1e-3)
    # mean load 3.75: experts 0 and 3 overloaded -> bias down, 1 and 2 underloaded -> bias up.
    assert gates[1].e_score_correction_bias.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, -1e-3])
    assert gates[2].e_score_correction_bias.tolist() == [0, 0, 0, 0]  # balanced: sign(0) = 0
    m = load_metrics(loads)
    assert m["moe_layers"] == [1, 2]
    assert m["moe_imbalance_per_layer"][0] == pytest.approx(8 / 3.75, rel=1e-3)
    assert m["expert_load"][1] == [0.25] * 4
