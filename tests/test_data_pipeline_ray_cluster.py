"""`glm5 data run` on a simulated 2-node Ray cluster (`ray.cluster_utils.Cluster`, 1 CPU per node), joined
through `--run.ray_address`: jobs run on both nodes and the output is the local executor's (slow)."""

from pathlib import Path

import pytest

from glm5.data.pipeline import runner
from glm5.data.pipeline.executor import ExecutorConfig, RayExecutor
from tests.test_data_pipeline_ray import ROOT, _cfg, outputs, write_sample

ray = pytest.importorskip("ray")  # the `cluster` extra; CI installs it (.ci/run)


def _node_of(_):
    import time

    time.sleep(0.5)  # long enough that both nodes' workers get a job
    return ray.get_runtime_context().get_node_id()


@pytest.mark.slow
def test_two_node_cluster_matches_local(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    sample = write_sample(tmp_path / "sample.jsonl.gz")
    runner.run(_cfg(sample, tmp_path / "local"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the executor hands it to the cluster's workers
        out = tmp_path / "cluster"
        runner.run(_cfg(sample, out, "--run.executor=ray", f"--run.ray_address={cluster.address}",
                        "--run.num_workers=0"))
        assert not ray.is_initialized()  # the executor closed the session it opened
        assert outputs(out) == outputs(tmp_path / "local")
        ex = RayExecutor(ExecutorConfig(executor="ray", ray_address=cluster.address))
        try:
            assert len(set(ex.map(_node_of, [(i,) for i in range(4)], ["n"] * 4, "nodes"))) == 2
        finally:
            ex.close()
    finally:
        cluster.shutdown()
