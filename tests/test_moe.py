"""Grouped MoE vs the per-expert loop, routing rules, and the seeds' routing options."""

import math

import pytest
import torch

from glm5.model.moe import MoE

from ._tiny import autograd_expert_loop, reference_experts, reference_moe, tiny_config


def _moe(seed=0, **kw):
    torch.manual_seed(seed)
    m = MoE(tiny_config(**kw))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)
        m.gate.e_score_correction_bias.normal_(0, 0.1)
    return m


def test_grouped_equals_reference_forward_and_backward():
    m = _moe(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    x = torch.randn(3, 11, 64, requires_grad=True)
    y, _ = m(x)
    gy = torch.randn_like(y)
    g_fast = torch.autograd.grad(y, [x] + list(m.parameters()), gy)
    y_ref = reference_moe(m, x)
    g_ref = torch.autograd.grad(y_ref, [x] + list(m.parameters()), gy)
    assert torch.allclose(y, y_ref, atol=1e-5)
    for a, b in zip(g_fast, g_ref):
        assert torch.allclose(a, b, atol=1e-5)


def test_grouped_swiglu_matches_reference_balanced_and_skewed():
    from glm5.model.moe import grouped_swiglu
    m = _moe(n_routed_experts=8)
    xs = torch.randn(40, 64, requires_grad=True)
    for counts in (torch.tensor([5] * 8), torch.tensor([33, 0, 1, 1, 1, 2, 1, 1])):
        y = grouped_swiglu(xs, m.experts.gate_up_proj, m.experts.down_proj, counts)
        e = torch.repeat_interleave(torch.arange(8), counts)
        ref = torch.stack([reference_experts(m.experts.gate_up_proj, m.experts.down_proj, xs[i:i + 1], e[i:i + 1, None],
                                             torch.ones(1, 1))[0]
                           for i in range(40)])
        assert torch.allclose(y, ref, atol=1e-5)


def test_router_matches_formula():
    m = _moe(n_routed_experts=8, num_experts_per_tok=2)
    x = torch.randn(5, 64)
    logits, scores, w, idx = m.gate(x)
    s = torch.sigmoid(x @ m.gate.weight.T)
    choice = s + m.gate.e_score_correction_bias
    assert torch.equal(idx.sort(-1).values, choice.topk(2).indices.sort(-1).values)
    expect = s.gather(1, idx) / s.gather(1, idx).sum(-1, keepdim=True) * 2.5  # bias never in the weights
    assert torch.allclose(w, expect, atol=1e-6)


def test_group_limited_routing_stays_in_kept_groups():
    m = _moe(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
    x = torch.randn(50, 64)
    _, scores, _, idx = m.gate(x)
    choice = (scores + m.gate.e_score_correction_bias).view(50, 4, 4)
    keep = choice.topk(2, -1).values.sum(-1).topk(2, -1).indices  # [N, 2] groups
    assert all(set((idx[n] // 4).tolist()) <= set(keep[n].tolist()) for n in range(50))


def test_softmax_top2_gating_and_temperature():
    m = _moe(scoring_func="softmax", num_experts_per_tok=2, router_temperature=2.0, routed_scaling_factor=1.0)
    x = torch.randn(7, 64)
    logits, scores, w, idx = m.gate(x)
    ref = torch.softmax((x @ m.gate.weight.T) / 2.0, -1)
    assert torch.allclose(scores, ref, atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(7), atol=1e-6)


def test_capacity_factor_per_sequence_causal_budget():
    """Token t of a sequence keeps expert e iff fewer than ceil(cf * (t + 1) * A / E) earlier tokens of the
    same sequence went to e (a Python loop as the reference); rows of a batch never share a budget."""
    m = _moe(n_routed_experts=8, num_experts_per_tok=2, moe_capacity_factor=0.5)
    x = torch.randn(2, 40, 64)
    with torch.no_grad():
        y, stats = m(x)
        idx = m.gate(x.reshape(-1, 64))[3].view(2, 40, 2)
        want = torch.zeros(2, 40, 2, dtype=torch.bool)
        for b in range(2):
            seen = [0] * 8
            for t in range(40):
                cap = math.ceil(0.5 * (t + 1) * 2 / 8)
                for a in range(2):
                    e = int(idx[b, t, a])
                    want[b, t, a] = seen[e] < cap
                for a in range(2):
                    seen[int(idx[b, t, a])] += 1
        assert stats["dropped_tokens"] == int((~want).sum()) > 0
        keep = m._keep_mask(idx.view(-1, 2), x.shape, None)
        assert torch.equal(keep.view(2, 40, 2), want)
        y1, _ = m(x[1:, :25])  # a prefix of one row alone: same outputs (causal, per sequence)
        assert torch.allclose(y1, y[1:, :25], atol=1e-6)


def test_expert_dropout_only_in_training():
    m = _moe(expert_dropout=0.5)
    x = torch.randn(1, 30, 64)
    m.eval()
    assert m(x)[1]["dropped_tokens"] == 0
    m.train()
    torch.manual_seed(0)
    assert m(x)[1]["dropped_tokens"] > 0


def test_soft_moe_is_dense_mixture_and_causal_safe():
    m = _moe(moe_type="soft", scoring_func="softmax", routed_scaling_factor=1.0)
    x = torch.randn(1, 6, 64)
    y, _ = m(x)
    y2, _ = m(x[:, :3])  # a token's output never depends on later tokens
    assert torch.allclose(y[:, :3], y2, atol=1e-6)
    xf = x[0]
    p = torch.softmax(xf @ m.gate.weight.T, -1)
    ref = sum(p[:, e:e + 1] * reference_experts(m.experts.gate_up_proj, m.experts.down_proj, xf, torch.full((6, 1), e),
                                                torch.ones(6, 1))
              for e in range(8))
    assert torch.allclose(y[0], ref + m.shared_experts(xf), atol=1e-5)


def test_stats_count_tokens_per_expert():
    m = _moe()
    _, stats = m(torch.randn(2, 9, 64))
    assert stats["tokens_per_expert"].sum() == 2 * 9 * 2
    assert stats["router_logits"].dtype == torch.float32 and stats["router_logits"].shape == (18, 8)


@pytest.mark.gpu
def test_cuda_bf16_grouped_mm_matches_reference():
    m = _moe(n_routed_experts=16, num_experts_per_tok=4).cuda().to(torch.bfloat16)
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        _, _, w, idx = m.gate(x)
        fast = m.experts(x, idx, w)
        ref = reference_experts(m.experts.gate_up_proj, m.experts.down_proj, x, idx, w)
    assert (fast.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max()


@pytest.mark.gpu
def test_cuda_autocast_grouped_mm_trains_fp32_masters():
    m = _moe(n_routed_experts=16, num_experts_per_tok=4).cuda()  # fp32 master weights
    x = torch.randn(200, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, _ = m(x[None])
    y.float().sum().backward()
    assert m.experts.gate_up_proj.grad is not None and m.experts.gate_up_proj.grad.dtype == torch.float32
    with torch.no_grad():
        ref = reference_moe(m, x[None])
    assert (y.float() - ref).abs().max() <= 5e-2 * ref.abs().max()


def test_inference_expert_loop_equals_reference():
    """Without autograd (the engine) the experts run the grouped path; one token and several."""
    m = _moe(n_routed_experts=8, num_experts_per_tok=2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (1, 7):
            x = torch.randn(n, 64, generator=g)
            _, _, w, idx = m.gate(x)
            ref = reference_experts(m.experts.gate_up_proj, m.experts.down_proj, x, idx, w)
            assert torch.allclose(m.experts(x, idx, w), ref, atol=1e-6)


def test_grouped_swiglu_backward_matches_autograd_loop():
    """The hand-written backward of the CPU expert loop equals autograd through per-expert F.linear
    (experts with no rows included), and passes gradcheck in float64."""
    from glm5.model.moe import grouped_swiglu
    g = torch.Generator().manual_seed(0)
    E, H, I = 5, 6, 4
    counts = torch.tensor([3, 0, 2, 4, 0])
    xs = torch.randn(int(counts.sum()), H, generator=g, dtype=torch.float64, requires_grad=True)
    gu = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64, requires_grad=True)
    dn = torch.randn(E, H, I, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b, c: grouped_swiglu(a, b, c, counts), (xs, gu, dn))
    up = torch.randn(xs.shape, generator=g, dtype=torch.float64)
    (grouped_swiglu(xs, gu, dn, counts) * up).sum().backward()
    got = [t.grad.clone() for t in (xs, gu, dn)]
    for t in (xs, gu, dn):
        t.grad = None
    (autograd_expert_loop(xs, gu, dn, counts) * up).sum().backward()
    for a, t in zip(got, (xs, gu, dn)):
        torch.testing.assert_close(a, t.grad)


@pytest.mark.parametrize("hooked", [False, True])
def test_grouped_swiglu_accumulates_into_existing_grads_like_autograd(hooked):
    """With `.grad` already set (gradient accumulation, or a trainer that zeroes instead of freeing),
    the weight gradients are added in place; the result equals autograd's accumulation of the per-expert
    F.linear loop over two backward passes (one of them with an empty expert), hooks or not."""
    from glm5.model.moe import grouped_swiglu
    g = torch.Generator().manual_seed(3)
    E, H, I = 4, 6, 5
    gu = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64, requires_grad=True)
    dn = torch.randn(E, H, I, generator=g, dtype=torch.float64, requires_grad=True)
    calls = []
    if hooked:  # a post-accumulate hook must still see every accumulation
        gu.register_post_accumulate_grad_hook(lambda p: calls.append(1))
    passes = [(torch.tensor([2, 3, 0, 1]), torch.randn(6, H, generator=g, dtype=torch.float64)),
              (torch.tensor([1, 1, 4, 2]), torch.randn(8, H, generator=g, dtype=torch.float64))]
    ups = [torch.randn(x.shape, generator=g, dtype=torch.float64) for _, x in passes]
    for (counts, x), up in zip(passes, ups):
        (grouped_swiglu(x, gu, dn, counts) * up).sum().backward()
    got = gu.grad.clone(), dn.grad.clone()
    assert len(calls) == (2 if hooked else 0)
    gu.grad = dn.grad = None
    for (counts, x), up in zip(passes, ups):
        (autograd_expert_loop(x, gu, dn, counts) * up).sum().backward()
    torch.testing.assert_close(got[0], gu.grad)
    torch.testing.assert_close(got[1], dn.grad)
