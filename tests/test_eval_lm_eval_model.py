"""glm5 inside lm-evaluation-harness: `--model glm5` is registered and lm-eval's own task pipeline
(its few-shot sampler, delimiters and metrics, on an MMLU-style task YAML over the bundled set) gives the
same per-question log-likelihoods and accuracy as `glm5 eval --task mmlu`; the slow test also runs
lm-eval's `hf` model (transformers) on the same checkpoint and task."""

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from glm5.eval.harness import run_task  # noqa: E402
from glm5.eval.tasks import TaskConfig, build_task, bundled_path  # noqa: E402

from .eval_fixtures import make_checkpoint  # noqa: E402

# lm-eval's MMLU template (tasks/mmlu/default/_default_template_yaml) over our CSV columns
TASK_YAML = """task: glm5_python_stdlib
dataset_path: csv
dataset_kwargs:
  data_files:
    test: {test}
    dev: {dev}
  column_names: [question, A, B, C, D, answer]
test_split: test
fewshot_split: dev
fewshot_config:
  sampler: first_n
output_type: multiple_choice
description: "The following are multiple choice questions (with answers) about python stdlib.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{A}}}}\\nB. {{{{B}}}}\\nC. {{{{C}}}}\\nD. {{{{D}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: "{{{{['A', 'B', 'C', 'D'].index(answer)}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
LIMIT, SHOTS = 6, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("lmeval")
    data = bundled_path("mmlu")
    (root / "tasks").mkdir()
    (root / "tasks" / "task.yaml").write_text(TASK_YAML.format(test=data / "python_stdlib_test.csv",
                                                               dev=data / "python_stdlib_dev.csv"))
    ckpt = make_checkpoint(root / "ckpt")
    task = build_task(TaskConfig(task="mmlu", num_fewshot=SHOTS))
    ours = run_task(task, _engine(ckpt), root / "ours.json", model_name="tiny", limit=LIMIT, progress=False)
    records = [json.loads(line)["record"] for line in (root / "ours.records.jsonl").read_text().splitlines()[1:]]
    return root, ckpt, ours, records


def _engine(ckpt):
    from glm5.eval.engine_model import EngineModel
    return EngineModel(str(ckpt), max_length=512, device="cpu")


def _lm_eval(root: Path, model, model_args):
    import lm_eval
    from lm_eval.tasks import TaskManager

    import glm5.eval.lm_eval_model  # noqa: F401  (registers "glm5")
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["glm5_python_stdlib"],
                                   num_fewshot=SHOTS, limit=LIMIT, log_samples=True, device="cpu",
                                   task_manager=TaskManager(include_path=str(root / "tasks"), include_defaults=False))


def _check(out, ours, records):
    samples = out["samples"]["glm5_python_stdlib"]
    assert len(samples) == LIMIT
    for s, rec in zip(sorted(samples, key=lambda s: s["doc_id"]), records):
        lls = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in s["resps"]]
        assert lls == pytest.approx(rec["lls"], abs=2e-4)
    assert out["results"]["glm5_python_stdlib"]["acc,none"] == pytest.approx(ours["metrics"]["acc"])


def test_lm_eval_with_model_glm5_matches_glm5_eval(setup):
    root, ckpt, ours, records = setup
    _check(_lm_eval(root, "glm5", f"pretrained={ckpt},max_length=512"), ours, records)


@pytest.mark.slow
def test_lm_eval_hf_model_matches_glm5_eval(setup):
    root, ckpt, ours, records = setup
    _check(_lm_eval(root, "hf", f"pretrained={ckpt},dtype=float32,max_length=512"), ours, records)
