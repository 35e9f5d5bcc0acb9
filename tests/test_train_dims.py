"""`ParallelDims` in one process: every degree 1, no process group, every collective the identity, and
the gradient norm / clipping equal to torch's (`torch.nn.utils.clip_grad_norm_`). The multi-process side
is exercised by the trainer under torchrun (tests/test_distributed_trainer.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from glm5.train.config import ParallelConfig
from glm5.train.dims import ParallelDims
from glm5.train.stability import layer_groups
from tests._tiny import tiny_model


def test_one_process_is_the_degenerate_mesh(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dims = ParallelDims.from_env(ParallelConfig(expert_parallel=2, tensor_parallel=2))
    assert not dist.is_initialized()
    assert (dims.world, dims.dp, dims.ep, dims.tp, dims.pp) == (1, 1, 1, 1, 1)
    assert not dims.distributed and not dims.pp_enabled and not dims.dp_enabled
    assert (dims.data_rank, dims.data_world, dims.replicas) == (0, 1, 1)
    assert dims.data_group is None and dims.pp_group is None and dims.pipeline is None and dims.is_main
    model = torch.nn.Linear(2, 2)
    assert dims.parallelize(model, None, parallelize_fn=lambda m, c: 1 / 0) == (model, dims)  # never called


def test_collectives_are_the_identity():
    dims = ParallelDims()
    assert dims.sum(3.5) == 3.5 and dims.sum(7, divide_by=1) == 7
    assert dims.sum([1.0, 2.0], divide_by=1) == [1.0, 2.0]
    assert dims.mean({"loss": 2.0, "tokens": 5}) == {"loss": 2.0, "tokens": 5}
    assert dims.max(0.0) == 0.0
    counts = torch.arange(4.0)
    assert torch.equal(dims.sum_over_data_(counts.clone()), counts)
    loads = {1: torch.tensor([3.0, 1.0])}
    assert dims.gather_stages(loads) is loads
    dims.barrier()
    with dims.loss_context():
        pass


def _with_grads(seed: int = 0):
    model = tiny_model()
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def test_grad_norm_and_global_clip_match_torch():
    dims = ParallelDims()
    model, ref = _with_grads(0), _with_grads(0)
    params = [p for p in model.parameters()]
    norm = dims.grad_norm(params)
    max_norm = float(norm) / 4
    ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm)
    torch.testing.assert_close(norm, ref_norm)
    dims.clip_global(params, max_norm, norm)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_layerwise_clip_caps_each_layer_like_torch():
    dims = ParallelDims()
    model, ref = _with_grads(1), _with_grads(1)
    norms = dims.clip_layerwise(layer_groups(model), base=0.01)
    for (key, params), ref_params in zip(layer_groups(model).items(), layer_groups(ref).values()):
        grads = [p.grad for p in ref_params if p.grad is not None]
        before = torch.nn.utils.get_total_norm(grads)
        assert abs(norms[key] - float(before)) <= 1e-4 * float(before)
        threshold = 0.01 * (1 + 0.1 * torch.log(before))  # stability.layerwise_threshold's formula
        torch.nn.utils.clip_grad_norm_(ref_params, float(threshold))
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)

