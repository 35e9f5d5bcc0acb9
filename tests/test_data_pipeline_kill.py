"""`kill -9` in the middle of a parallel `glm5 data run`, then rerun: same bytes as one clean run (slow)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5.core.resources import bundled
from glm5.data.pipeline.shards import read_jsonl, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _cmd(sample: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "glm5.cli.main", "data", "run", "--config", "configs/data/default.toml",
            f"--input.paths=['{sample}']", f"--run.output_dir={out}", "--run.shard_docs=50",
            "--run.num_workers=2", "--run.progress=false", "--quality.max_train_docs=300"]


def _outputs(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes()
            for sub in ("data", "excluded") for p in sorted((out / sub).glob("*"))}


@pytest.mark.slow
def test_kill_9_then_rerun_matches_clean_run(tmp_path):
    sample = tmp_path / "sample.jsonl.gz"
    write_jsonl(sample, [d for i, d in enumerate(read_jsonl(bundled("corpus/train.jsonl.gz"))) if i % 40 == 0])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(_cmd(sample, tmp_path / "clean"), check=True, env=env, capture_output=True)
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(sample, out), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not list((out / "work" / "local").glob("*/stats.json")):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the parent and its pool workers, mid local pass
    proc.wait()
    assert not (out / "stats.json").exists()
    subprocess.run(_cmd(sample, out), check=True, env=env, capture_output=True)
    assert _outputs(out) == _outputs(tmp_path / "clean")
    assert not list(out.rglob(".tmp-*"))  # the killed run's temporaries were cleaned up
