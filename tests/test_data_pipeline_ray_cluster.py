"""`glm5 data run` on a simulated 2-node Ray cluster (`ray.cluster_utils.Cluster`, 1 CPU per node), joined
through `--run.ray_address`: jobs run on both nodes and the output is the local executor's; and on the local
cluster the executor starts itself (`--run.ray_address=""`) (slow)."""

import os
import time
from pathlib import Path

import pytest

from glm5.data.pipeline import runner
from glm5.data.pipeline.executor import ExecutorConfig, JobFailed, RayExecutor
from tests.test_data_pipeline_ray import ROOT, _broken, _cfg, outputs, write_sample

ray = pytest.importorskip("ray")  # the `cluster` extra; CI installs it (.ci/run)


def _node_of(marks: str):
    """This job's node id, once jobs have run on two nodes (or after 30 s): each job writes its node id under
    `marks` and waits for another node's, so no job ends before the other node's worker has one, however
    long that worker takes to start; jobs that only ever ran on one node return after the wait and fail the
    test."""
    node = ray.get_runtime_context().get_node_id()
    Path(marks, node).touch()
    deadline = time.monotonic() + 30
    while len(os.listdir(marks)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return node


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
            marks = tmp_path / "nodes"
            marks.mkdir()
            assert len(set(ex.map(_node_of, [(str(marks),) for _ in range(4)], ["n"] * 4, "nodes"))) == 2
        finally:
            ex.close()
    finally:
        cluster.shutdown()


def _pid(_):
    return os.getpid()


@pytest.mark.slow
def test_local_cluster_started_by_the_executor(tmp_path):
    """No session and no address: the executor starts a local cluster in the background and runs jobs in the
    driver until it is up (a failing one named as on Ray), then on Ray; same bytes; `close` stops it."""
    assert not ray.is_initialized()
    sample = write_sample(tmp_path / "sample.jsonl.gz")
    runner.run(_cfg(sample, tmp_path / "local"))
    runner.run(_cfg(sample, tmp_path / "ray", "--run.executor=ray", "--run.num_workers=2"))
    assert not ray.is_initialized()  # the executor stopped the cluster it started
    assert outputs(tmp_path / "ray") == outputs(tmp_path / "local")

    ex = RayExecutor(ExecutorConfig(executor="ray", num_workers=2, max_retries=1))
    try:
        assert not ex.up.is_set()  # the cluster takes seconds to start: these two maps run in the driver
        with pytest.raises(JobFailed, match=r"^local pass shard 00003 failed after 2 attempts: ValueError: bad input 3$"):
            ex.map(_broken, [(3,)], ["local pass shard 00003"], "local pass")
        assert ex.map(_pid, [(0,)], ["j"], "driver") == [os.getpid()]
        ex.up.wait()
        workers = set(ex.map(_pid, [(i,) for i in range(4)], ["j"] * 4, "ray"))
        assert os.getpid() not in workers and ray.is_initialized()
    finally:
        ex.close()
    assert not ray.is_initialized()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{p}") for p in workers)  # the cluster's workers are gone


def _wait_or_mark(marker, first):
    """The first job waits (up to 60 s) for another to write `marker`; the others write it."""
    if not first:
        Path(marker).touch()
        return os.getpid(), True
    deadline = time.monotonic() + 60
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.getpid(), os.path.exists(marker)


@pytest.mark.slow
def test_cluster_takes_jobs_while_the_driver_still_runs_one(tmp_path):
    """A job the driver started while the local cluster came up does not hold the rest back: once the
    cluster is up, the other jobs run on Ray while the driver's job is still running."""
    marker = str(tmp_path / "ray-ran")
    ex = RayExecutor(ExecutorConfig(executor="ray", num_workers=2))
    try:
        assert not ex.up.is_set()
        out = ex.map(_wait_or_mark, [(marker, True)] + [(marker, False)] * 3, ["j"] * 4, "overlap")
    finally:
        ex.close()
    assert out[0] == (os.getpid(), True)  # the driver's job saw a Ray job's marker before it ended
    assert all(pid != os.getpid() for pid, _ in out[1:])


@pytest.mark.slow
def test_local_cluster_falls_back_to_ray_init_without_the_node_api(tmp_path, monkeypatch):
    """Where Ray's private node API is not there (another Ray release), the local cluster starts through
    `ray.init` instead: the same jobs run on Ray workers and `close` stops it."""
    import builtins
    real_import = builtins.__import__

    def no_node_api(name, *a, **kw):
        if name == "ray._private.node":
            raise ImportError("no ray._private.node here")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_node_api)
    assert not ray.is_initialized()
    ex = RayExecutor(ExecutorConfig(executor="ray", num_workers=2, max_retries=1))
    try:
        ex.up.wait()
        assert isinstance(ex.boot_error, ImportError)
        workers = set(ex.map(_pid, [(i,) for i in range(4)], ["j"] * 4, "ray"))
        assert os.getpid() not in workers and ray.is_initialized()
    finally:
        ex.close()
    assert not ray.is_initialized()
