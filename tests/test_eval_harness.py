"""Harness behaviour: incremental records and resume, settings changes never mix records, results.json
and the report, and the `glm5 eval` CLI end to end (tiny checkpoint through the engine; HumanEval
samples scored in the sandbox)."""

import json

import pytest

from glm5.cli.main import main as glm5_main
from glm5.eval.harness import EvalConfig, ModelSpec, run_task
from glm5.eval.lm import EvalModel, GenerationParams
from glm5.eval.tasks import TaskConfig, build_task

from .eval_fixtures import make_checkpoint, make_mmlu


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) % 251 + 3 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class FakeModel(EvalModel):
    """Deterministic scores (prefers the continuation whose last token is largest); counts calls and
    fails on call number `fail_at`."""

    def __init__(self, fail_at=None):
        self.tokenizer, self.prefix_token_id, self.max_length, self.name = CharTokenizer(), 1, 512, "fake"
        self.calls, self.fail_at, self.scored = 0, fail_at, 0

    def score(self, pairs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("server went away")
        self.scored += len(pairs)
        return [(-1.0 / (1 + cont[-1]), False) for _, cont in pairs]

    def generate(self, prompts, params: GenerationParams):
        return [["4"] * params.n for _ in prompts]


def test_resume_after_failure_evaluates_only_the_rest(tmp_path):
    task = build_task(TaskConfig(task="mmlu", data=str(make_mmlu(tmp_path / "mmlu"))))
    out = tmp_path / "out" / "mmlu.json"
    with pytest.raises(ConnectionError):
        run_task(task, FakeModel(fail_at=2), out, model_name="fake", chunk=3, progress=False)
    lines = out.with_suffix(".records.jsonl").read_text().splitlines()
    assert len(lines) == 1 + 3 and not out.exists()  # header + the first chunk; no result yet
    again = FakeModel()
    res = run_task(task, again, out, model_name="fake", chunk=3, progress=False)
    assert again.scored == 4 * (8 - 3)  # four choices per remaining document
    fresh = run_task(task, FakeModel(), tmp_path / "fresh.json", model_name="fake", progress=False)
    assert res["metrics"] == fresh["metrics"] and res["n"] == 8
    assert json.loads(out.read_text())["metrics"]["acc"] == pytest.approx(0.25)  # always picks D


def test_other_settings_start_over(tmp_path):
    data = str(make_mmlu(tmp_path / "mmlu"))
    out = tmp_path / "mmlu.json"
    run_task(build_task(TaskConfig(task="mmlu", data=data)), FakeModel(), out, model_name="fake", progress=False)
    m = FakeModel()
    run_task(build_task(TaskConfig(task="mmlu", data=data, num_fewshot=1)), m, out, model_name="fake", progress=False)
    assert m.scored == 32 and (tmp_path / "mmlu.records.jsonl.stale").exists()


def test_eval_config_writes_results_and_report(tmp_path):
    from glm5.eval.harness import run_config
    import glm5.eval.harness as harness

    data = str(make_mmlu(tmp_path / "mmlu"))
    exact = tmp_path / "exact.jsonl"
    exact.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=", "answer": "6"}\n')
    cfg = EvalConfig(output_dir=str(tmp_path / "run"), models=[ModelSpec(model="a"), ModelSpec(model="b")],
                     tasks=[TaskConfig(task="mmlu", data=data), TaskConfig(task="exact", data=str(exact))])
    orig = harness.build_model
    harness.build_model = lambda spec: FakeModel()
    try:
        results = run_config(cfg, progress=False)
    finally:
        harness.build_model = orig
    assert len(results) == 4
    saved = json.loads((tmp_path / "run" / "results.json").read_text())["results"]
    assert {(r["model"], r["task"]) for r in saved} == {("a", "mmlu"), ("a", "exact"), ("b", "mmlu"), ("b", "exact")}
    exact_res = next(r for r in saved if r["task"] == "exact")
    assert exact_res["metrics"]["exact_match"] == 0.5 and exact_res["n"] == 2 and exact_res["chance"] == 0.0
    assert next(r for r in saved if r["task"] == "mmlu")["chance"] == 0.25  # four choices
    md = (tmp_path / "run" / "report.md").read_text()
    assert "| mmlu | acc | 0.2500 |" in md and "| exact | exact_match | 0.0000 |" in md
    assert "| knowledge |" in md and "| skills |" in md
    assert (tmp_path / "run" / "report.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def test_cli_mmlu_and_ppl_on_a_checkpoint(tmp_path, ckpt, one_thread, capsys):
    data = make_mmlu(tmp_path / "mmlu")
    out = tmp_path / "mmlu.json"
    argv = ["eval", "--model", str(ckpt), "--task", "mmlu", "--data", str(data), "--num-fewshot", "1",
            "--output", str(out), "--no-progress", "--max-length", "256"]
    assert glm5_main(argv) == 0
    res = json.loads(out.read_text())
    assert res["task"] == "mmlu" and res["n"] == 8 and set(res["metrics"]) == {"acc", "acc_norm"}
    assert 0 <= res["metrics"]["acc"] <= 1 and res["stderr"]["acc"] > 0
    hf_out = tmp_path / "mmlu_hf.json"  # the transformers backend scores the same questions the same way
    assert glm5_main(argv[:-5] + ["--output", str(hf_out), "--no-progress", "--max-length", "256",
                                  "--backend", "hf"]) == 0
    hf_lls = [json.loads(x)["record"]["lls"] for x in hf_out.with_suffix(".records.jsonl").read_text().splitlines()[1:]]
    lls = [json.loads(x)["record"]["lls"] for x in out.with_suffix(".records.jsonl").read_text().splitlines()[1:]]
    assert sum(hf_lls, []) == pytest.approx(sum(lls, []), abs=2e-4)
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "Hello world."}\n{"text": "你好，世界。"}\n')
    assert glm5_main(["eval", "--model", str(ckpt), "--task", "ppl", "--data", str(texts), "--output",
                      str(tmp_path / "ppl.json"), "--no-progress", "--max-length", "64"]) == 0
    ppl = json.loads((tmp_path / "ppl.json").read_text())["metrics"]
    # a random model over an 8k vocabulary: about ln(8192) nats per token
    assert 5 < ppl["bits_per_byte"] < 20 and ppl["token_perplexity"] > 1000
    assert "mmlu (n=8, chance 0.2500)" in capsys.readouterr().out


def test_cli_humaneval_samples_and_bad_input(tmp_path, capsys):
    problems = tmp_path / "he.jsonl"
    rows = [{"task_id": "t/0", "prompt": "def add(a, b):\n", "entry_point": "add",
             "test": "def check(f):\n    assert f(2, 3) == 5\n"},
            {"task_id": "t/1", "prompt": "def neg(a):\n", "entry_point": "neg",
             "test": "def check(f):\n    assert f(2) == -2\n"},
            {"task_id": "t/2", "prompt": "def one():\n", "entry_point": "one",  # no samples: not scored
             "test": "def check(f):\n    assert f() == 1\n"}]
    problems.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = tmp_path / "samples.jsonl"
    comps = [("t/0", "    return a + b\n"), ("t/0", "    return a - b\n"), ("t/1", "    return -a\n"),
             ("t/1", "    while True: pass\n")]
    samples.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in comps))
    out = tmp_path / "he.json"
    assert glm5_main(["eval", "--task", "humaneval", "--data", str(problems), "--samples", str(samples),
                      "--k", "1,2", "--timeout", "2", "--output", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    assert res["metrics"] == {"pass@1": 0.5, "pass@2": 1.0}
    assert res["n"] == 2 and res["documents"] == 3 and res["chance"] == 0.0  # n: problems scored
    statuses = [json.loads(line)["record"]["status"] for line in out.with_suffix(".records.jsonl").read_text()
                .splitlines()[1:]]
    assert statuses == [["pass", "fail"], ["pass", "timeout"], []]
    samples.write_text('{"task_id": "t/0"}\n')
    assert glm5_main(["eval", "--task", "humaneval", "--data", str(problems), "--samples", str(samples),
                      "--output", str(tmp_path / "he2.json"), "--no-progress"]) == 2
    assert "samples.jsonl:1: missing field(s) ['completion']" in capsys.readouterr().err
