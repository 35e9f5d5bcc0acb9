"""Elastic data order through the real command line: `glm5 train` in one process and under `torchrun`
(gloo, CPU) on the same global batch logs the same losses, and a checkpoint resumes at another world
size at its exact data position (slow: several process launches).

The reference is the single-process run of the same config (per-rank batch x data ranks kept equal);
before elastic order the 2-process run read other documents and its losses were ~0.1 apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from glm5.core.log import read_metrics
from tests.test_train_cli import _shards

STEPS = 5
MODEL = ("--model.overrides={hidden_size = 32, num_hidden_layers = 2, intermediate_size = 64, "
         "moe_intermediate_size = 16, num_attention_heads = 4, num_key_value_heads = 4}")


def _argv(tokens: Path, run_dir: Path, batch: int, *extra: str) -> list[str]:
    return ["--config", "configs/train/tiny.toml", MODEL,
            f"--data.train_path={json.dumps(str(tokens / 'train'))}",
            f"--data.val_path={json.dumps(str(tokens / 'validation'))}",
            f"--data.batch_size={batch}", "--data.seq_len=48", f"--train.steps={STEPS}",
            "--train.time_limit_min=0", "--schedule.warmup_steps=2", "--checkpoint.every=3",
            "--checkpoint.at_exit=false", f"--log.run_dir={json.dumps(str(run_dir))}", "--log.every=1",
            "--log.progress=false", "--log.eval_batches=2", "--log.measure_peak=false",
            "--train.num_threads=1", *extra]


def _run(nproc: int, argv: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", "glm5.train", *argv]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "glm5.train", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def _val(run_dir: Path) -> float:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("event") == "final"][-1]["val_loss"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return _shards(tmp_path_factory.mktemp("elastic"))


@pytest.mark.slow
def test_two_processes_log_the_losses_of_one_and_resume_elsewhere(tokens, tmp_path):
    _run(1, _argv(tokens, tmp_path / "one", 4))
    ref = _losses(tmp_path / "one")
    assert sorted(ref) == list(range(1, STEPS + 1))
    # FSDP + EP=2 over 2 processes, each reading half of the same global batch
    _run(2, _argv(tokens, tmp_path / "two", 2, "--parallel.expert_parallel=2"))
    two = _losses(tmp_path / "two")
    assert max(abs(two[s] - ref[s]) for s in ref) <= 1e-4, (two, ref)
    assert abs(_val(tmp_path / "two") - _val(tmp_path / "one")) <= 1e-4  # validation is elastic too
    # the 2-process step-3 checkpoint resumes in one process (whole batch) at its data position
    ckpt = tmp_path / "two" / "checkpoints" / "step_00000003"
    _run(1, _argv(tokens, tmp_path / "resumed", 4, f"--checkpoint.resume={json.dumps(str(ckpt))}"))
    resumed = _losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5] and max(abs(resumed[s] - ref[s]) for s in resumed) <= 1e-4, (resumed, ref)


@pytest.mark.slow
def test_two_agents_as_two_nodes_train_like_one_process(tokens, tmp_path):
    """Multi-node launch: two `torchrun --nnodes 2 --rdzv-backend c10d` agents on this machine, one process
    each, rendezvous over TCP as two nodes and train FSDP + EP=2 with the single-process losses; the
    profiled steps log their communication time beside MFU."""
    import socket
    _run(1, _argv(tokens, tmp_path / "one", 4))
    ref = _losses(tmp_path / "one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    argv = _argv(tokens, tmp_path / "nodes", 2, "--parallel.expert_parallel=2", "--log.profile_comm_every=2")
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=glm5-two-nodes",
         f"--rdzv-conf=is_host={int(node == 0)}", "-m", "glm5.train", *argv],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in range(2)]
    outs = [a.communicate(timeout=600) for a in agents]
    assert all(a.returncode == 0 for a in agents), [o[1][-3000:] for o in outs]
    recs = read_metrics(tmp_path / "nodes" / "metrics.jsonl")
    two = {r["step"]: r["loss"] for r in recs if "loss" in r}
    assert max(abs(two[s] - ref[s]) for s in ref) <= 1e-4, (two, ref)
    profiled = [r for r in recs if "comm_s" in r]
    assert [r["step"] for r in profiled] == [1, 3, 5]  # steps 0, 2, 4 (0-based) are profiled
    assert all(r["comm_s"] > 0 and 0 < r["comm_frac"] < 1 and r["comm_all_to_all_elems"] > 0 for r in profiled)
    assert all("mfu" in r for r in profiled)
