"""`glm5 plan`: its per-GPU parameter shards equal what parallel.py really builds (checked on every rank
of a fake process group: sharding needs no communication), bad layouts are refused, and the CLI runs on
the real GLM-5 configuration."""

import pytest
import torch
import torch.distributed as dist

from glm5.cli.main import main
from glm5.train.plan import ACCELERATORS, Layout, plan
from tests._tiny import tiny_config

CFG = dict(num_hidden_layers=4, num_nextn_predict_layers=1, vocab_size=512)


def _stored_elements(rank: int, world: int, lay: Layout) -> int:
    """Elements of every parameter shard that `rank` holds after apply_parallel (fake collectives)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from glm5.model.model import GLM5ForCausalLM
    from glm5.train.parallel import apply_parallel
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        model = GLM5ForCausalLM(tiny_config(**CFG)).train()
        model = apply_parallel(model, ep=lay.ep, tp=lay.tp, pp=lay.pp, dp=lay.dp, schedule=lay.schedule,
                               stages_per_rank=lay.stages_per_rank)
        return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("lay", [
    Layout(gpus=8, tp=2, ep=2, dp=2),
    Layout(gpus=8, pp=2, tp=2, ep=2),
    Layout(gpus=4, pp=2, dp=2, schedule="interleaved_1f1b", stages_per_rank=2),
], ids=["dp2-ep2-tp2", "pp2-ep2-tp2", "pp2-dp2-interleaved"])
def test_planned_shards_equal_the_built_ones(lay):
    p = plan(tiny_config(**CFG), lay, ACCELERATORS["H100"])
    grid = torch.arange(lay.gpus).view(p.shape["pp"], -1)  # pipeline rank of each global rank
    for pp_rank, ranks in enumerate(grid.tolist()):
        measured = [_stored_elements(r, lay.gpus, lay) for r in ranks]
        mean = sum(measured) / len(measured)
        assert abs(mean - p.params_per_rank[pp_rank]) <= 0.005 * mean, (pp_rank, measured, p.params_per_rank)


def test_plan_refuses_layouts_that_do_not_fit():
    with pytest.raises(ValueError, match="num_attention_heads"):
        plan(tiny_config(), Layout(gpus=8, tp=8), ACCELERATORS["H100"])
    with pytest.raises(ValueError, match="world size"):
        plan(tiny_config(), Layout(gpus=6, tp=4), ACCELERATORS["H100"])


def test_glm5_plan_cli_on_the_real_configuration(capsys):
    assert main(["plan", "--preset", "glm-5", "--gpus", "1024", "--tp", "8", "--pp", "4", "--ep", "32",
                 "--accelerator", "H200"]) == 0
    out = capsys.readouterr().out
    assert "pp 4 x dp 1 x ep 32 x tp 8" in out and "optimizer states" in out and "all_to_all" in out
    assert main(["plan", "--preset", "glm-5", "--gpus", "1000", "--tp", "16"]) == 2
    assert "world size 1000" in capsys.readouterr().err
