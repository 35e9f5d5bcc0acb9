"""Layer-wise clipping formula (seed T3), global clipping, the non-finite guard."""

import math

import pytest
import torch
from torch import nn

from glm5.train.stability import (NonFiniteGuard, TrainingDiverged, clip_global, clip_layerwise, grad_norm,
                                  layer_groups)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.head = nn.Linear(4, 5)


def test_layer_groups():
    groups = layer_groups(Net())
    assert sorted(groups) == ["embed", "head", "layers.0", "layers.1", "layers.2"]
    assert len(groups["layers.1"]) == 2


@pytest.mark.parametrize("scale", [1e-3, 0.5, 3.0, 50.0])
def test_layerwise_clip_formula(scale):
    torch.manual_seed(0)
    net = Net()
    for p in net.parameters():
        p.grad = torch.randn_like(p) * scale
    before = {k: [p.grad.clone() for p in ps] for k, ps in layer_groups(net).items()}
    base = 2.0
    norms = clip_layerwise(layer_groups(net), base)
    for key, params in layer_groups(net).items():
        n = math.sqrt(sum(float(g.pow(2).sum()) for g in before[key]))
        assert norms[key] == pytest.approx(n, rel=1e-5)
        threshold = base * (1 + 0.1 * math.log(n))
        factor = min(1.0, threshold / n) if threshold > 0 else 1.0
        for p, g in zip(params, before[key]):
            torch.testing.assert_close(p.grad, g * factor)
    if scale == 50.0:
        assert all(grad_norm(ps) < n for ps, n in zip(layer_groups(net).values(), norms.values()))


def test_global_clip():
    net = Net()
    for p in net.parameters():
        p.grad = torch.full_like(p, 3.0)
    params = list(net.parameters())
    norm = grad_norm(params)
    clip_global(params, 1.0, norm)
    assert float(grad_norm(params)) == pytest.approx(1.0, rel=1e-4)


def test_guard_skips_and_names_bad_params():
    net = Net()
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    net.layers[1].weight.grad[0, 0] = float("inf")
    guard = NonFiniteGuard(max_bad_steps=1, lr_factor=0.9)
    norm = float(grad_norm(list(net.parameters())))
    assert not guard.check(net, loss=1.0, norm=norm, step=7)
    assert guard.last_bad == ["layers.1.weight"]
    assert all(p.grad is None for p in net.parameters())
    assert guard.lr_scale == pytest.approx(0.9)
    assert guard.check(net, loss=1.0, norm=1.0, step=8)
    with pytest.raises(TrainingDiverged):
        guard.check(net, loss=float("nan"), norm=1.0, step=9)
