"""LR schedule shapes, batch-size ramp, objective draw."""

import math
from collections import Counter

import pytest

from glm5.train.config import ScheduleConfig
from glm5.train.schedule import BatchRamp, lr_factor, pick_objective


def _curve(cfg, total):
    return [lr_factor(s, cfg, total) for s in range(total)]


def test_warmup_then_cosine():
    cfg = ScheduleConfig(name="cosine", warmup_steps=10, min_lr_ratio=0.1)
    f = _curve(cfg, 111)
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(b > a for a, b in zip(f[:10], f[1:10]))  # linear ramp up
    assert all(b <= a for a, b in zip(f[10:], f[11:]))  # monotone decay
    assert f[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # midpoint
    assert f[-1] == pytest.approx(0.1)


def test_seed_default_warmup_is_10k():
    assert ScheduleConfig().warmup_steps == 10000
    assert lr_factor(4999, ScheduleConfig(), 100_000) == pytest.approx(0.5)


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "sqrt"])
def test_wsd_is_flat_then_decays(decay_type):
    cfg = ScheduleConfig(name="wsd", warmup_steps=5, decay_ratio=0.2, decay_type=decay_type, min_lr_ratio=0.0)
    f = _curve(cfg, 101)
    assert all(x == 1.0 for x in f[5:80])
    assert f[80] == 1.0 and all(b < a for a, b in zip(f[80:], f[81:]))
    assert f[90] == pytest.approx({"linear": 0.5, "cosine": 0.5, "sqrt": 1 - math.sqrt(0.5)}[decay_type])


def test_constant_and_linear():
    assert _curve(ScheduleConfig(name="constant", warmup_steps=2), 10)[2:] == [1.0] * 8
    f = _curve(ScheduleConfig(name="linear", warmup_steps=0, min_lr_ratio=0.0), 11)
    assert f == pytest.approx([1 - i / 10 for i in range(11)])


def test_batch_ramp():
    ramp = BatchRamp(micro_batch=4, world_size=2, grad_accum=8, start=16, ramp_steps=100)
    assert ramp.global_batch(0) == 16 and ramp.accum(0) == 2
    sizes = [ramp.global_batch(s) for s in range(120)]
    assert sizes == sorted(sizes) and sizes[-1] == 64 and sizes[99] < 64 and sizes[100] == 64
    assert all(s % 8 == 0 for s in sizes)
    assert BatchRamp(4, 1, 3).accum(0) == 3  # no ramp


def test_pick_objective_is_deterministic_and_proportional():
    mix = {"clm": 3.0, "glm": 1.0}
    draws = [pick_objective(mix, 0, s, m) for s in range(500) for m in range(2)]
    assert draws == [pick_objective(mix, 0, s, m) for s in range(500) for m in range(2)]
    frac = Counter(draws)["glm"] / len(draws)
    assert 0.2 < frac < 0.3
    assert pick_objective({"clm": 1.0, "glm": 0.0}, 0, 3, 0) == "clm"
