"""The training step's fast paths against plain autograd references written here: the LM loss fused
with the head (glm5/train/loss.py) against cross entropy over materialised logits, and the whole
one-process step (fused loss + the expert loop's hand-written backward in glm5/model/moe.py) against
the model's logits, F.cross_entropy and an autograd expert loop: loss and the gradient of every
parameter, with and without MTP, with ignored positions and a loss mask, fp32."""

import pytest
import torch
import torch.nn.functional as F

from glm5.model import moe
from glm5.model.config import ModelConfig
from glm5.model.model import GLM5ForCausalLM
from glm5.train.balance import balance_losses
from glm5.train.config import BalanceConfig
from glm5.train.loss import linear_ce_sum
from glm5.train.data import SyntheticData
from glm5.train.step import forward_micro, micro_loss
from glm5.train.trainer import Trainer
from tests._tiny import autograd_expert_loop
from tests.test_train_loop import MODEL, make


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_ce_matches_materialised_logits(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 37, 16, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37), generator=g)
    labels[0, :5] = -100
    got = linear_ce_sum(h, w, labels, chunk=8)  # 74 rows: 9 full chunks and a ragged one
    (got * 0.7).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = F.cross_entropy((h @ w.t()).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    (ref * 0.7).backward()
    assert gh.dtype == dtype and gw.dtype == dtype
    torch.testing.assert_close(got, ref.float())
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)
    assert gh[0, :5].abs().max() == 0  # ignored positions get no gradient
    with torch.no_grad():  # evaluation: the loss alone
        ev = linear_ce_sum(h, w, labels)
    assert not ev.requires_grad
    torch.testing.assert_close(ev, ref.float())


def test_linear_ce_under_bf16_autocast_matches_the_autocast_head():
    """Under autocast the logits matmul runs in bf16, as the head's F.linear would; loss in fp32."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    w = torch.randn(30, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 30, (40,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_ce_sum(h, w, labels, chunk=16)
        ref = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
    got.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref.backward()
    assert got.dtype == torch.float32 and gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gh, h.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, w.grad, rtol=2e-2, atol=2e-2)


def test_linear_ce_only_ignored_labels_is_zero():
    h = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    loss = linear_ce_sum(h, w, torch.full((3,), -100))
    loss.backward()
    assert float(loss.detach()) == 0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def _reference_loss(model, batch, mtp_weight, bal):
    """Loss of one micro-batch from the model's logits: mean CE + mtp_weight * mean MTP CE + balance."""
    labels = batch["labels"]
    out = model(batch["input_ids"], return_mtp=mtp_weight > 0)
    lm = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    loss = lm / (labels != -100).sum()
    if mtp_weight > 0:  # position t predicts token t+2 = labels[t+1], only where t itself has a target
        nxt = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        targets = torch.where(labels != -100, nxt, -100)
        mtp = F.cross_entropy(out.mtp_logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        loss = loss + mtp_weight * mtp / (targets != -100).sum()
    for term in balance_losses(out.router_stats, labels.shape[0], bal.seq_aux_coef, bal.aux_coef,
                               bal.z_loss_coef).values():
        loss = loss + term
    return loss


@pytest.mark.parametrize("mtp_weight", [0.0, 0.3])
@pytest.mark.parametrize("masked", [False, True])
def test_one_process_step_matches_autograd_reference(monkeypatch, mtp_weight, masked):
    cfg = ModelConfig.from_preset("tiny", **{**MODEL, "n_routed_experts": 12})
    model = GLM5ForCausalLM(cfg).init_weights(0).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 96, (2, 21), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # no target past the end
    if masked:  # a loss mask (prompt tokens of an SFT row) and a padded tail
        labels[0, :7] = -100
        labels[1, 15:] = -100
    batch = {"input_ids": ids, "labels": labels}
    bal = BalanceConfig(aux_coef=0.01, seq_aux_coef=0.001)

    res = forward_micro(model, batch, "clm", mtp_weight, bal, fused_ce=True)
    got = micro_loss(res, res.lm_tokens, res.mtp_tokens, mtp_weight, 1)
    got.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    monkeypatch.setattr(moe, "grouped_swiglu", autograd_expert_loop)
    ref = _reference_loss(model, batch, mtp_weight, bal)
    ref.backward()
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    assert any("experts.gate_up_proj" in n for n in grads) and "lm_head.weight" in grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_trainer_uses_the_fused_loss_only_for_a_plain_head(tmp_path):
    """One process with a plain head: the fused loss; a LoRA head (dropout on its input) keeps logits."""
    from glm5.model import lora
    t = make(tmp_path / "plain", steps=1)
    assert t.fused_ce and t.micro_fn.keywords == {"fused_ce": True}
    model = GLM5ForCausalLM(ModelConfig.from_preset("tiny", **MODEL)).init_weights(0)
    lora.apply_lora(model, lora.resolve_targets(model, lora.LoraConfig(r=2, targets=["lm_head"])), dropout=0.1)
    cfg = make(tmp_path / "plain2", steps=1).cfg
    t = Trainer(cfg, model=model.train(), data=SyntheticData(96, 4, 24, seed=1))
    assert not t.fused_ce and t.micro_fn is forward_micro


def test_mtp_loss_from_hidden_states_without_full_logits():
    """The fused path asks the model for the last position's logits only (main and MTP) and takes both
    losses from the hidden states; the MTP sum equals CE over the full MTP logits of the plain path."""
    cfg = ModelConfig.from_preset("tiny", **MODEL)
    model = GLM5ForCausalLM(cfg).init_weights(0).train()
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(4))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    full = model(ids, return_mtp=True)
    kept = model(ids, return_mtp=True, logits_to_keep=1)
    assert kept.mtp_logits.shape == (2, 1, cfg.vocab_size)
    torch.testing.assert_close(kept.mtp_logits, full.mtp_logits[:, -1:])
    torch.testing.assert_close(model.lm_head(kept.mtp_hidden_states), full.mtp_logits)
    bal = BalanceConfig()
    fused = forward_micro(model, {"input_ids": ids, "labels": labels}, "clm", 0.3, bal, fused_ce=True)
    plain = forward_micro(model, {"input_ids": ids, "labels": labels}, "clm", 0.3, bal, fused_ce=False)
    assert fused.mtp_tokens == plain.mtp_tokens > 0
    torch.testing.assert_close(fused.mtp_sum, plain.mtp_sum, rtol=1e-6, atol=1e-5)


def test_kept_gradient_buffers_train_like_freed_ones(tmp_path):
    """The one-process trainer keeps gradient buffers between steps (glm5/train/grads.py); with causal
    steps (MTP on) and blank-infilling steps (the MTP layer gets no gradient) mixed, the weights after
    6 steps equal those of a trainer that frees its gradients (zero_grad(set_to_none=True)): untouched
    parameters are skipped by AdamW, not stepped on zero gradients."""
    sections = {"train": {"objectives": {"clm": 1.0, "glm": 1.0}, "mtp_weight": 0.3}}
    kept = make(tmp_path / "a", steps=6, **sections)
    freed = make(tmp_path / "b", steps=6, **{"train": {**sections["train"], "keep_grad_buffers": False}})
    assert kept.kept_grads is not None and freed.kept_grads is None
    for t in (kept, freed):
        t.fit()
    drawn = [{k for k, n in h["objectives"].items() if n} for h in kept.history]
    assert {"clm"} in drawn and {"glm"} in drawn
    want = dict(freed.model.named_parameters())
    for name, p in kept.model.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_kept_grads_drop_untouched_and_accumulate():
    from glm5.train.grads import KeptGrads
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    kept = KeptGrads()
    ((a * 2).sum() + b.sum()).backward()
    kept.zero([a, b])
    assert a.grad.abs().max() == 0 and b.grad is not None
    (a * 3).sum().backward()
    kept.drop_untouched()
    assert b.grad is None and torch.equal(a.grad, torch.full((3,), 3.0))
