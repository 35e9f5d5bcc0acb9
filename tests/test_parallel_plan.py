"""Bad parallel layouts are refused before any compute, naming the `parallel.*` key (no processes)."""

import pytest

from glm5.core.config import ConfigError, from_dict
from glm5.train.config import ParallelConfig, TrainConfig
from glm5.train.parallel import check_model, mesh_shape
from tests._tiny import tiny_config


def test_mesh_shape_fills_data_parallel_and_names_the_bad_degree():
    assert mesh_shape(16, ep=2, tp=2, pp=2) == {"pp": 2, "dp": 2, "ep": 2, "tp": 2}
    assert mesh_shape(4, dp=2, ep=2) == {"pp": 1, "dp": 2, "ep": 2, "tp": 1}
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        mesh_shape(8, tp=3)
    with pytest.raises(ValueError, match="data_parallel=3.*world size is 8"):
        mesh_shape(8, dp=3, ep=2)
    with pytest.raises(ValueError, match="pipeline_parallel=4"):
        mesh_shape(2, pp=4)
    with pytest.raises(ValueError, match="does not divide the world size 12"):
        mesh_shape(12, ep=2, tp=4)  # 8 does not divide 12 though each degree does


def test_model_that_the_mesh_cannot_split_is_refused():
    cfg = tiny_config()  # 4 heads, 8 experts, 3 layers, vocab 512
    shape = lambda **kw: {"pp": 1, "dp": 1, "ep": 1, "tp": 1, **kw}  # noqa: E731
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        check_model(cfg, shape(tp=8))
    with pytest.raises(ValueError, match="n_routed_experts=8"):
        check_model(cfg, shape(ep=3))
    with pytest.raises(ValueError, match="stage would be empty"):
        check_model(cfg, shape(pp=4), stages=4)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        check_model(tiny_config(tie_word_embeddings=True), shape(tp=2))
    check_model(cfg, shape(tp=4, ep=2), stages=3)  # fits


@pytest.mark.parametrize("bad, match", [
    ({"pipeline_split": [2, 0]}, "empty pipeline stage"),
    ({"tensor_parallel": 0}, "tensor_parallel must be >= 1"),
    ({"pipeline_schedule": "interleaved_1f1b"}, "stages_per_rank >= 2"),
    ({"stages_per_rank": 2}, "interleaved_1f1b"),
])
def test_parallel_config_validation(bad, match):
    with pytest.raises((ValueError, ConfigError), match=match):
        from_dict(TrainConfig, {"parallel": bad})
    assert ParallelConfig().data_parallel == 0


def test_pipeline_split_layers():
    from glm5.train.parallel_pp import local_stages, split_layers
    cfg = tiny_config(num_hidden_layers=6, num_nextn_predict_layers=1)
    assert split_layers(cfg, 4) == [[0, 1], [2, 3], [4], [5, 6]]  # earlier stages one more; MTP (6) last
    assert split_layers(cfg, 2, [1, 5]) == [[0], [1, 2, 3, 4, 5, 6]]
    with pytest.raises(ValueError, match="pipeline_split"):
        split_layers(cfg, 2, [6, 0])
    with pytest.raises(ValueError, match="stage would be empty"):
        split_layers(cfg, 7)
    # IndexShare: a stage may not start on a shared-indexer layer (its top-k comes from the layer before)
    shared = tiny_config(num_hidden_layers=6, indexer_types=["full", "shared", "shared", "full", "shared", "full"])
    assert split_layers(shared, 2) == [[0, 1, 2], [3, 4, 5]]
    assert split_layers(shared, 3) == [[0, 1, 2], [3, 4], [5]]  # boundaries 2 and 4 move to full layers 3 and 5
    with pytest.raises(ValueError, match="shared-indexer"):
        split_layers(shared, 2, [2, 4])
    assert local_stages(1, 2, 2) == [1, 3]  # loop order for the interleaved schedule


def test_comm_stats_from_profiler_events():
    """gloo ops count with their wall time and input elements; NCCL kernels give the device time."""
    from types import SimpleNamespace as E

    from glm5.train.comm import collect
    gloo = collect([E(name="gloo:all_reduce", input_shapes=[[4, 8]], cpu_time_total=2000.0, device_time_total=0.0),
                    E(name="gloo:all_to_all", input_shapes=[[6, 16], [6]], cpu_time_total=500.0, device_time_total=0.0),
                    E(name="gloo:all_reduce", input_shapes=[[10]], cpu_time_total=1000.0, device_time_total=0.0),
                    E(name="aten::mm", input_shapes=[[4, 4]], cpu_time_total=9e9, device_time_total=0.0)])
    assert gloo.calls == {"all_reduce": 2, "all_to_all": 1}
    assert gloo.elements == {"all_reduce": 42, "all_to_all": 96}
    assert abs(gloo.total_seconds - 0.0035) < 1e-9
    m = gloo.as_metrics(0.01)
    assert m["comm_frac"] == 0.35 and m["comm_all_reduce_elems"] == 42
    nccl = collect([E(name="nccl:all_gather", input_shapes=[[128]], cpu_time_total=5.0, device_time_total=0.0),
                    E(name="ncclDevKernel_AllGather_RING_LL", input_shapes=[], cpu_time_total=0.0,
                      device_time_total=300.0)])
    assert nccl.calls == {"all_gather": 1} and nccl.seconds == {"all_gather": 0.0003}


def test_gloo_reduce_scatter_counts_as_reduce_scatter():
    from types import SimpleNamespace as E

    from glm5.train.comm import collect
    st = collect([E(name="c10d::_reduce_scatter_base_", input_shapes=[[50], [100], [], []], cpu_time_total=1.0,
                    device_time_total=0.0),
                  E(name="gloo:all_reduce", input_shapes=[[100]], cpu_time_total=7.0, device_time_total=0.0),
                  E(name="gloo:all_reduce", input_shapes=[[100]], cpu_time_total=3.0, device_time_total=0.0)])
    assert st.calls == {"reduce_scatter": 1, "all_reduce": 1} and st.elements["reduce_scatter"] == 100
