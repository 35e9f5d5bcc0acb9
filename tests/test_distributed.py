"""Distributed training on 2 CPU processes (gloo) against single-process references computed here.

One spawn of 2 workers (module fixture) runs every distributed scenario and writes its results to a
temp dir; the tests compare them with the same computation done in this process:
- expert parallel: one MoE layer split over 2 ranks gives the single-process outputs and gradients;
- FSDP2 (dp=2) and FSDP2 + EP=2: 3 AdamW steps (global-norm clipping included) on the same global
  batch and the same init give the single-process losses and final weights;
- distributed checkpoint: written by the EP run at world size 2, loaded here at world size 1 (model and
  optimizer); written here at world size 1, loaded by the EP workers; HF export from the sharded model.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from glm5.model.hf_adapter import from_pretrained
from glm5.model.moe import MoE
from tests._tiny import tiny_config

WORLD, STEPS, B, T, LR = 2, 3, 4, 16, 1e-2
CFG = dict(num_hidden_layers=2, num_nextn_predict_layers=1)  # dense, MoE (8 experts, top-2), MTP (MoE)


# --- shared by workers and references -----------------------------------------------------------------
def make_model():
    from glm5.model.model import GLM5ForCausalLM
    torch.manual_seed(0)
    return GLM5ForCausalLM(tiny_config(**CFG)).init_weights(seed=0).train()


def global_batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 512, (B, T + 1), generator=g) for _ in range(STEPS)]


def loss_fn(model, ids):
    """Next-token loss + 0.3 x MTP loss (position t predicts token t+2; MTP runs through forward_mtp)."""
    out = model(ids[:, :-1], return_mtp=True)
    lm = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
    mtp = F.cross_entropy(out.mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
    return lm + 0.3 * mtp


def ref_clip(params, max_norm):
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def train(model, batches, clip_fn=ref_clip, start_optimizer=None):
    """3 AdamW steps with global-norm clipping at 0.5; returns per-step losses and the optimizer."""
    opt = start_optimizer or torch.optim.AdamW(model.parameters(), lr=LR)
    plan = getattr(model, "parallel_plan", None)
    losses = []
    for ids in batches:
        with plan.loss_context() if plan else contextlib.nullcontext():  # TP: vocab-parallel loss
            loss = loss_fn(model, ids)
            loss.backward()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        clip_fn([p for p in model.parameters() if p.grad is not None], 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, opt


def moe_inputs(cfg):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(WORLD * 12, cfg.hidden_size, generator=g)
    up = torch.randn(WORLD * 12, cfg.hidden_size, generator=g)  # upstream gradient
    return x, up


def make_moe(cfg):
    torch.manual_seed(3)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
        moe.gate.e_score_correction_bias.normal_(0, 0.05)  # unequal loads, some experts empty per rank
    return moe


# --- worker -------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, out: str, scenarios: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from glm5.core.dist import init_from_env
    init_from_env("gloo")
    try:
        globals()[scenarios](rank, Path(out))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, out: Path, scenarios: str) -> dict:
    mp.spawn(_worker, args=(world, _free_port(), str(out), scenarios), nprocs=world, join=True)
    return json.loads((out / "results.json").read_text())


def _scenarios_dp2_ep2(rank: int, out: Path) -> None:
    """World 4 = dp 2 x ep 2: experts sharded over ep and FSDP-sharded over dp (2-D DTensors)."""
    from glm5.train import parallel, parallel_ckpt
    batches = [b.chunk(4)[rank] for b in global_batches()]
    model = parallel.apply_parallel(make_model(), ep=2)
    assert model.parallel_plan.dp == 2 and model.parallel_plan.ep == 2
    losses, opt = train(model, batches, parallel.clip_grad_norm_)
    res = {"ep": [parallel.mean_over_ranks(v) for v in losses]}
    parallel_ckpt.save_dcp(out / "dcp_ws4", model, opt)
    if rank == 0:
        (out / "results.json").write_text(json.dumps(res))


def _scenarios(rank: int, out: Path) -> None:
    from glm5.train import parallel, parallel_ckpt, parallel_ep
    from safetensors.torch import save_file
    res: dict = {}
    # 1. one MoE layer under EP=2: each rank routes its own half of the tokens
    cfg = tiny_config(**CFG)
    moe = make_moe(cfg)
    x, up = moe_inputs(cfg)
    xs, ups = x.chunk(WORLD)[rank].clone().requires_grad_(), up.chunk(WORLD)[rank]
    parallel_ep.convert_to_ep(moe, parallel.build_mesh(WORLD)["ep"])
    y, _ = moe(xs)
    (y * ups).sum().backward()
    save_file({"y": y.detach(), "x_grad": xs.grad, "router_grad": moe.gate.weight.grad,
               "gate_up_grad": moe.experts.gate_up_proj.grad.to_local().contiguous(),
               "down_grad": moe.experts.down_proj.grad.to_local().contiguous()}, str(out / f"moe_{rank}.st"))
    # 1b. with a capacity limit (token dropping is decided by the sender, on its own tokens)
    moe = make_moe(tiny_config(**CFG, moe_capacity_factor=0.5))
    parallel_ep.convert_to_ep(moe, parallel.build_mesh(WORLD)["ep"])
    xs.grad = None
    y, stats = moe(xs)
    (y * ups).sum().backward()
    save_file({"y": y.detach(), "x_grad": xs.grad, "dropped": torch.tensor(stats["dropped_tokens"]),
               "gate_up_grad": moe.experts.gate_up_proj.grad.to_local().contiguous()},
              str(out / f"moe_cap_{rank}.st"))
    # 2. FSDP2 (dp=2) and FSDP2 + EP=2 (dp=1): 3 steps on this rank's half of each global batch
    batches = [b.chunk(WORLD)[rank] for b in global_batches()]
    for name, ep in (("fsdp", 1), ("ep", WORLD)):
        model = parallel.apply_parallel(make_model(), ep=ep)
        losses, opt = train(model, batches, parallel.clip_grad_norm_)
        res[name] = [parallel.mean_over_ranks(v) for v in losses]
    # 3. checkpoints of the EP run: DCP (model + optimizer) and the HF export
    parallel_ckpt.save_dcp(out / "dcp_ws2", model, opt)
    parallel_ckpt.export_hf(model, out / "hf_ws2")
    # 3b. tensor parallel (tp=2, both ranks read the whole global batch): 3 steps, then its checkpoint
    model = parallel.apply_parallel(make_model(), tp=WORLD)
    assert model.parallel_plan.tp == WORLD and model.parallel_plan.data_world == 1
    res["tp"], opt_tp = train(model, global_batches(), parallel.clip_grad_norm_)
    parallel_ckpt.save_dcp(out / "dcp_tp", model, opt_tp)
    # 3c. TP gradients of one forward/backward, sparse attention path included (index_topk < T / 4)
    for name, kw in (("dense", {}), ("sparse", {"index_topk": 4})):
        save_file(_tp_grads(rank, kw), str(out / f"tp_grads_{name}_{rank}.st"))
    # 4. load the world-size-1 checkpoint written by the test into a fresh EP model, export it
    model = parallel.apply_parallel(make_model(), ep=WORLD)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    parallel_ckpt.load_dcp(out / "dcp_ws1", model, opt)
    parallel_ckpt.export_hf(model, out / "hf_from_ws1")
    res["resumed"], _ = train(model, batches[:1], parallel.clip_grad_norm_, start_optimizer=opt)
    res["resumed"] = [parallel.mean_over_ranks(v) for v in res["resumed"]]
    if rank == 0:
        (out / "results.json").write_text(json.dumps(res))


def make_tp_model(**kw):
    from glm5.model.model import GLM5ForCausalLM
    return GLM5ForCausalLM(tiny_config(**CFG, **kw)).init_weights(seed=0).train()


def _tp_grads(rank: int, kw: dict) -> dict:
    """Full gradients after one TP=2 forward/backward of loss_fn (no FSDP): expert gradients are
    token-parallel partials, so they are summed over the TP ranks here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from glm5.train.parallel_tp import apply_tp
    model = apply_tp(make_tp_model(**kw), init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))["tp"])
    with loss_parallel():
        loss_fn(model, global_batches()[0]).backward()
    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
        if ".experts." in n:
            dist.all_reduce(g)
        out[n] = g.contiguous()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- single-process references ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Write the world-size-1 checkpoint the workers load, spawn them, return (out_dir, results)."""
    from glm5.train.parallel_ckpt import save_dcp
    out = tmp_path_factory.mktemp("dist")
    model = make_model()
    _, opt = train(model, global_batches()[-1:])
    save_dcp(out / "dcp_ws1", model, opt)
    return out, _spawn(WORLD, out, "_scenarios")


@pytest.fixture(scope="module")
def reference():
    """The single-process run on the global batches: (model, optimizer, losses)."""
    model = make_model()
    losses, opt = train(model, global_batches())
    return model, opt, losses


def test_ep_moe_layer_matches_single_process(run):
    from safetensors.torch import load_file
    out, _ = run
    cfg = tiny_config(**CFG)
    moe = make_moe(cfg)
    x, up = moe_inputs(cfg)
    x = x.clone().requires_grad_()
    y, _ = moe(x)
    (y * up).sum().backward()
    parts = [load_file(str(out / f"moe_{r}.st")) for r in range(WORLD)]
    torch.testing.assert_close(torch.cat([p["y"] for p in parts]), y.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p["x_grad"] for p in parts]), x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sum(p["router_grad"] for p in parts), moe.gate.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p["gate_up_grad"] for p in parts]), moe.experts.gate_up_proj.grad,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([p["down_grad"] for p in parts]), moe.experts.down_proj.grad,
                               atol=1e-5, rtol=1e-5)


def test_ep_moe_with_capacity_limit_matches_per_rank_moe(run):
    """With a capacity factor each rank drops from its own tokens: the oracle is the single-process MoE
    run on each rank's tokens separately (expert gradients summed over the ranks)."""
    from safetensors.torch import load_file
    out, _ = run
    moe = make_moe(tiny_config(**CFG, moe_capacity_factor=0.5))
    x, up = moe_inputs(moe.cfg)
    parts = [load_file(str(out / f"moe_cap_{r}.st")) for r in range(WORLD)]
    for r, (xr, upr) in enumerate(zip(x.chunk(WORLD), up.chunk(WORLD))):
        xr = xr.clone().requires_grad_()
        y, stats = moe(xr)
        (y * upr).sum().backward()
        assert stats["dropped_tokens"] == int(parts[r]["dropped"]) > 0
        torch.testing.assert_close(parts[r]["y"], y.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(parts[r]["x_grad"], xr.grad, atol=1e-5, rtol=1e-5)
    grad = torch.cat([p["gate_up_grad"] for p in parts])
    torch.testing.assert_close(grad, moe.experts.gate_up_proj.grad, atol=1e-5, rtol=1e-5)


def test_fsdp_and_ep_losses_match_single_process(run, reference):
    _, res = run
    _, _, ref = reference
    assert len(res["fsdp"]) == len(res["ep"]) == STEPS
    assert ref[-1] < ref[0]  # the steps really train
    for name in ("fsdp", "ep"):
        assert max(abs(a - b) for a, b in zip(res[name], ref)) < 1e-5, (name, res[name], ref)


def test_dcp_saved_at_world_2_loads_at_world_1(run, reference):
    out, _ = run
    from glm5.train.parallel_ckpt import load_dcp
    ref_model, ref_opt, _ = reference
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    load_dcp(out / "dcp_ws2", model, opt)
    hf = from_pretrained(out / "hf_ws2", dtype=torch.float32)
    sd, ref_sd, hf_sd = model.state_dict(), ref_model.state_dict(), hf.state_dict()
    assert set(sd) == set(hf_sd)
    for k in sd:
        torch.testing.assert_close(sd[k], hf_sd[k], atol=0, rtol=0)  # DCP and HF export agree exactly
        # and match the 1-process run (Adam turns 1e-7 gradient noise on near-zero moments into ~1e-5)
        torch.testing.assert_close(sd[k], ref_sd[k], atol=1e-4, rtol=1e-3)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    p, ref_p = dict(model.named_parameters())[name], dict(ref_model.named_parameters())[name]
    for key in ("exp_avg", "exp_avg_sq", "step"):  # the optimizer state came back too
        torch.testing.assert_close(opt.state[p][key], ref_opt.state[ref_p][key], atol=1e-6, rtol=1e-4)


def test_dcp_saved_at_world_1_loads_at_world_2(run):
    out, res = run
    from glm5.train.parallel_ckpt import load_dcp
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    load_dcp(out / "dcp_ws1", model, opt)
    hf = from_pretrained(out / "hf_from_ws1", dtype=torch.float32).state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(hf[k], v, atol=0, rtol=0)
    ref, _ = train(model, global_batches()[:1], start_optimizer=opt)
    assert abs(res["resumed"][0] - ref[0]) < 1e-5  # the resumed optimizer state behaves identically


def test_tp_losses_and_gradients_match_single_process(run, reference):
    """Tensor parallel (tp=2): MLA heads, dense/shared MLPs and vocabulary split, routed experts
    token-parallel; 3 steps give the single-process losses, and one step's gradients equal the
    single-process ones on both attention paths (dense SDPA and absorbed sparse)."""
    from safetensors.torch import load_file
    out, res = run
    _, _, ref = reference
    assert max(abs(a - b) for a, b in zip(res["tp"], ref)) < 1e-5, (res["tp"], ref)
    for name, kw in (("dense", {}), ("sparse", {"index_topk": 4})):
        model = make_tp_model(**kw)
        loss_fn(model, global_batches()[0]).backward()
        for r in range(WORLD):
            got = load_file(str(out / f"tp_grads_{name}_{r}.st"))
            want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert set(got) == set(want)
            for n in want:
                torch.testing.assert_close(got[n], want[n], atol=1e-5, rtol=1e-4, msg=f"{name} {n}")


def test_dcp_saved_by_tp_loads_at_world_1(run, reference):
    out, _ = run
    from glm5.train.parallel_ckpt import load_dcp
    ref_model, _, _ = reference
    model = make_model()
    load_dcp(out / "dcp_tp", model, torch.optim.AdamW(model.parameters(), lr=LR))
    ref_sd = ref_model.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_sd[k], atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_dp2_x_ep2_on_4_processes(tmp_path, reference):
    """Experts split over ep=2 and FSDP-sharded over dp=2: the gradient divide factor and the 2-D
    expert layout give the single-process losses, and the checkpoint loads at world size 1."""
    from glm5.train.parallel_ckpt import load_dcp
    res = _spawn(4, tmp_path, "_scenarios_dp2_ep2")
    ref_model, _, ref = reference
    assert max(abs(a - b) for a, b in zip(res["ep"], ref)) < 1e-5, (res["ep"], ref)
    model = make_model()
    load_dcp(tmp_path / "dcp_ws4", model, torch.optim.AdamW(model.parameters(), lr=LR))
    ref_sd = ref_model.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_sd[k], atol=1e-4, rtol=1e-3)
