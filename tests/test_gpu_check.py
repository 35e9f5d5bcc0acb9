"""bench/gpu_check.py, the prepared GPU script, in its CPU dry-run mode (`--device cpu --quick`): the JSON
lines and the Markdown summary it leaves, its time budget and its per-section isolation. The CUDA
measurements themselves run only on a lent GPU (docs/bench-engine.md, docs/bench-train.md)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parent.parent
_spec = importlib.util.spec_from_file_location("bench_gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]


def status(rs: list[dict]) -> dict[str, str]:
    return {r["section"]: r["status"] for r in rs if r["name"] == "status"}


def gpu_marked_tests() -> int:
    """The `gpu` tests counted from the sources (a decorator per test), not by pytest."""
    marks = (re.findall(r"^@pytest\.mark\.gpu\s*$", p.read_text(), re.M) for p in (ROOT / "tests").glob("test_*.py"))
    return sum(map(len, marks))


def test_dry_run_of_the_cheap_sections_records_the_gpu_tests(tmp_path):
    gpu_check.main(["--device", "cpu", "--quick", "--only", "env,peak,tests", "--out", str(tmp_path)])
    rs = rows(tmp_path)
    assert status(rs) == {"env": "ok", "peak": "ok", "tests": "ok"}
    tests = next(r for r in rs if r["name"] == "pytest_gpu")
    assert tests["tests"] == gpu_marked_tests() > 0
    assert tests["exit_code"] == 0 and tests["failures"] == tests["errors"] == 0
    assert tests["skipped"] == tests["tests"]  # no CUDA here: every one skips, none is deselected by mistake
    graph = next(r for r in rs if r["name"] == "engine_graph_path")
    assert isinstance(graph["present"], bool) and graph["note"]
    assert next(r for r in rs if r["name"] == "matmul_peak")["tflops"] > 0
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## env: ok" in md and "## tests: ok" in md and "pytest_gpu" in md


def test_budget_skips_sections_and_one_failure_keeps_the_others(tmp_path, monkeypatch):
    def broken(run):
        raise RuntimeError("planted")
    monkeypatch.setitem(gpu_check.SECTIONS, "env", broken)
    gpu_check.main(["--device", "cpu", "--quick", "--only", "env,peak", "--out", str(tmp_path)])
    rs = rows(tmp_path)
    assert status(rs) == {"env": "error", "peak": "ok"}
    assert "planted" in next(r for r in rs if r["section"] == "env")["error"]
    out = tmp_path / "skip"
    gpu_check.main(["--device", "cpu", "--quick", "--budget-s", "0", "--out", str(out)])
    rs = rows(out)
    assert status(rs) == dict.fromkeys(gpu_check.SECTIONS, "skipped")
    assert all("time budget" in r["reason"] for r in rs)
    assert "## train: skipped" in (out / "gpu_check.md").read_text()


def test_unknown_section_and_missing_cuda_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--only", "env,bogus", "--out", str(tmp_path)])
    assert "bogus" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu_check.main(["--out", str(tmp_path)])  # --device cuda is the default
        assert "--device cpu --quick" in capsys.readouterr().err
    assert not (tmp_path / "gpu_check.jsonl").exists()  # refused before anything ran


@pytest.mark.slow
def test_full_dry_run_every_section(tmp_path):
    """Every code path on CPU; the engine's greedy outputs equal transformers' (fp32 on CPU)."""
    gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    rs = rows(tmp_path)
    assert status(rs) == dict.fromkeys(gpu_check.SECTIONS, "ok")
    offline = next(r for r in rs if r["name"] == "offline_throughput")
    assert offline["identical_outputs"] == f"{offline['num_prompts']}/{offline['num_prompts']}"
    assert next(r for r in rs if r["name"] == "single_stream_decode")["glm5_tok_s"] > 0
    assert {r["name"] for r in rs if r["section"] == "train"} >= {"glm5_round0", "glm5-plain_round0", "hf_round0",
                                                                 "trainer_vs_transformers"}
