"""`glm5 data run` and `glm5 data tokenize` on Ray (`--run.executor=ray`): the same bytes as the local
executor at 1 and 2 workers, a killed worker retried, a failing shard named (slow: a Ray session).

One local Ray cluster (2 CPUs) for the module; workers import this checkout (PYTHONPATH)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from glm5.core.config import load_config
from glm5.core.resources import bundled
from glm5.data.pipeline import runner, stages
from glm5.data.pipeline.config import DataConfig
from glm5.data.pipeline.executor import ExecutorConfig, JobFailed, LocalExecutor, RayExecutor
from glm5.data.pipeline.shards import make_input_shards, read_jsonl, write_jsonl

ray = pytest.importorskip("ray")  # the `cluster` extra; CI installs it (.ci/run)
ROOT = Path(__file__).resolve().parents[1]
TIMING = ("seconds", "docs_per_s", "mb_per_s")


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


def write_sample(path: Path) -> Path:
    """Every 120th bundled document (179, 4 shards of <= 60) plus an exact and a near duplicate; a second file
    (`sample-b`, 3 shards) holds every 120th from offset 60: input sharding has two jobs. Returns the glob."""
    docs = [d for i, d in enumerate(read_jsonl(bundled("corpus/train.jsonl.gz"))) if i % 120 == 0]
    prose = next(d for d in docs if d["source"] == "python-docs")
    docs.append({**prose, "id": "planted/exact", "text": prose["text"].upper()})
    docs.append({**prose, "id": "planted/near", "text": prose["text"].replace("the", "a", 3)})
    write_jsonl(path, docs)
    write_jsonl(path.with_name("sample-b.jsonl.gz"),
                [d for i, d in enumerate(read_jsonl(bundled("corpus/train.jsonl.gz"))) if i % 120 == 60])
    return path.with_name("sample*.jsonl.gz")


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> Path:
    return write_sample(tmp_path_factory.mktemp("corpus") / "sample.jsonl.gz")


def _cfg(sample: Path, out: Path, *overrides: str) -> DataConfig:
    return load_config(DataConfig, "configs/data/default.toml",
                       [f"--input.paths=['{sample}']", f"--run.output_dir={out}", "--run.shard_docs=60",
                        "--run.num_workers=1", "--run.progress=false", "--quality.max_train_docs=200", *overrides])


def outputs(out: Path) -> dict[str, bytes]:
    """data/ and excluded/ bytes, the quality model, and stats.json without its timings (which differ
    between any two runs, on one executor too)."""
    files = {p.relative_to(out).as_posix(): p.read_bytes() for sub in ("data", "excluded")
             for p in sorted((out / sub).glob("*"))}
    stats = json.loads((out / "stats.json").read_text())
    stats.pop("wall_seconds")
    stats["stages"] = [{k: v for k, v in s.items() if k not in TIMING} for s in stats["stages"]]
    return {**files, "quality_model.npz": (out / "quality_model.npz").read_bytes(), "stats.json": stats}


@pytest.fixture(scope="module")
def local_run(sample, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("local")
    runner.run(_cfg(sample, out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_ray_run_matches_local_executor(local_run, sample, tmp_path, workers):
    out = tmp_path / "ray"
    stats = runner.run(_cfg(sample, out, "--run.executor=ray", f"--run.num_workers={workers}"))
    assert stats["num_shards"] == 7 and stats["drops"]["dedup:near_dup"] >= 1 and stats["drops"]["dedup:exact_dup"] >= 1
    assert outputs(out) == outputs(local_run)


def _dies_once(marker: Path, *job):
    """`stages.local_shard`, but the worker process running its first attempt is killed (os._exit)."""
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        os._exit(9)
    return stages.local_shard(*job)


@pytest.mark.slow
def test_killed_worker_is_retried_with_the_same_result(local_run, sample, tmp_path):
    cfg = _cfg(sample, tmp_path)
    manifest = make_input_shards([str(sample)], "text", cfg.run.shard_docs, tmp_path / "shards", 0,
                                 LocalExecutor(cfg.run))
    jobs = [(tmp_path / f"marker-{i}", cfg, tmp_path / "shards" / s["path"], tmp_path / "local" / f"{i:05d}")
            for i, s in enumerate(manifest["shards"][:2])]
    RayExecutor(ExecutorConfig(executor="ray", num_workers=2, max_retries=1)).map(
        _dies_once, jobs, ["shard 0", "shard 1"], "local pass")
    assert all(j[0].exists() for j in jobs)  # both first attempts died
    for i in range(2):
        for name in ("docs.jsonl.gz", "excluded.jsonl.gz", "keys.json", "signatures.npy"):
            want = local_run / "work" / "local" / f"{i:05d}" / name
            assert (tmp_path / "local" / f"{i:05d}" / name).read_bytes() == want.read_bytes()


def _broken(x):
    raise ValueError(f"bad input {x}")


@pytest.mark.slow
def test_job_failing_on_every_retry_is_named():
    ex = RayExecutor(ExecutorConfig(executor="ray", max_retries=1))
    with pytest.raises(JobFailed, match=r"^local pass shard 00003 failed after 2 attempts: ValueError: bad input 3$"):
        ex.map(_broken, [(3,)], ["local pass shard 00003"], "local pass")


@pytest.mark.slow
def test_tokenize_on_ray_matches_local(local_run, tmp_path):
    from glm5.data.tokenize_cli import TokenizeConfig, run

    def shards(executor: str, workers: int) -> dict[str, bytes]:
        out = tmp_path / "tokens"  # one directory: meta.json records its path
        shutil.rmtree(out, ignore_errors=True)
        run(TokenizeConfig(splits={"train": [str(local_run / "data")]}, output=str(out), batch_docs=16,
                           run=ExecutorConfig(executor=executor, num_workers=workers)))
        files = sorted(p for p in (out / "train").rglob("*") if p.is_file())
        return {p.relative_to(out).as_posix(): p.read_bytes() for p in files}

    local = shards("local", 1)
    assert any(k.endswith(".bin") for k in local)
    assert shards("ray", 2) == local
