"""Optimisers against direct re-computations of their formulas on small tensors; param groups."""

import math

import pytest
import torch
from torch import nn

from glm5.train.config import OptimConfig
from glm5.train.optim import Lamb, Muon, build_optimizer, classify_params, newton_schulz


class Gate(nn.Module):
    def __init__(self, d, e):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(e, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(e))


class Toy(nn.Module):
    """Shaped like a tiny LM: embedding, a norm, hidden matrices, an expert stack, a router, a head."""

    def __init__(self, v=11, d=8, e=3):
        super().__init__()
        self.embed_tokens = nn.Embedding(v, d)
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 12)
        self.down = nn.Linear(12, d, bias=False)
        self.experts = nn.Parameter(torch.randn(e, 6, d) * 0.1)  # [E, out, in] stack
        self.gate = Gate(d, e)
        self.lm_head = nn.Linear(d, v, bias=False)

    def forward(self, ids):
        x = self.norm(self.embed_tokens(ids))
        x = x + self.down(torch.relu(self.up(x)))
        x = x + torch.einsum("eod,btd->bto", self.experts, x).sum(-1, keepdim=True)
        return self.lm_head(x) + (x @ self.gate.weight.T).sum(-1, keepdim=True)


def test_classify_params():
    kinds = classify_params(Toy())
    assert kinds["embed_tokens.weight"] == "no_decay"
    assert kinds["norm.weight"] == kinds["norm.bias"] == kinds["up.bias"] == "no_decay"
    assert kinds["up.weight"] == kinds["down.weight"] == kinds["experts"] == "muon"
    assert kinds["gate.weight"] == kinds["lm_head.weight"] == "decay"
    assert classify_params(Toy(), decay_embeddings=True)["embed_tokens.weight"] == "decay"


def test_adamw_groups_no_decay_on_norms():
    opt = build_optimizer(Toy(), OptimConfig(name="adamw", weight_decay=0.1))
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["no_decay"]["weight_decay"] == 0.0 and by_name["decay"]["weight_decay"] == 0.1
    assert "muon" not in by_name
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(Toy().parameters()))


def _ref_ns(g, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm()
    for _ in range(steps):
        m = x @ x.T
        x = a * x + b * (m @ x) + c * (m @ m @ x)
    return x.T if g.shape[0] > g.shape[1] else x


def test_newton_schulz_matches_formula_and_is_batched():
    torch.manual_seed(0)
    g = torch.randn(3, 5, 4, dtype=torch.float64)
    out = newton_schulz(g)
    for i in range(3):
        torch.testing.assert_close(out[i], _ref_ns(g[i]), rtol=1e-10, atol=1e-10)
    # NS pushes singular values towards 1 (roughly: the quintic keeps them in ~[0.5, 1.5]).
    s = torch.linalg.svdvals(newton_schulz(torch.randn(16, 8, dtype=torch.float64)))
    assert s.min() > 0.5 and s.max() < 1.5


def test_muon_step_matches_direct_recomputation():
    torch.manual_seed(0)
    w = torch.randn(6, 4, dtype=torch.float64)
    grads = [torch.randn(6, 4, dtype=torch.float64) for _ in range(3)]
    p = nn.Parameter(w.clone())
    lr, wd, mu = 0.02, 0.1, 0.95
    opt = Muon([{"params": [p], "use_muon": True}], lr=lr, weight_decay=wd, momentum=mu,
               adjust_lr="match_rms_adamw")
    ref, buf = w.clone(), torch.zeros_like(w)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        buf = mu * buf + g
        update = _ref_ns(g + mu * buf)
        ref = ref * (1 - lr * wd) - lr * 0.2 * math.sqrt(6) * update
    torch.testing.assert_close(p.detach(), ref, rtol=1e-10, atol=1e-10)


def test_muon_aux_adamw_group_equals_torch_adamw():
    torch.manual_seed(0)
    w = torch.randn(5)
    a, b = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    ours = Muon([{"params": [a], "use_muon": False}], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b)


def test_lamb_step_matches_direct_recomputation():
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=torch.float64)
    grads = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    p = nn.Parameter(w.clone())
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.999, 1e-6, 0.01
    opt = Lamb([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, max_trust=10.0)
    ref, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * ref
        trust = min(ref.norm() / u.norm(), 10.0)
        ref = ref - lr * trust * u
    torch.testing.assert_close(p.detach(), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["adamw", "lamb", "muon"])
def test_each_optimizer_lowers_a_loss(name):
    torch.manual_seed(0)
    model = Toy()
    lr = 5e-2 if name == "lamb" else 1e-2  # LAMB's steps are relative to ||w||
    opt = build_optimizer(model, OptimConfig(name=name, lr=lr, weight_decay=0.0))
    ids = torch.randint(0, 11, (4, 7))
    target = torch.randint(0, 11, (4, 7))
    losses = []
    for _ in range(15):
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    if name == "muon":
        assert {g["name"] for g in opt.param_groups} == {"muon", "decay", "no_decay"}
