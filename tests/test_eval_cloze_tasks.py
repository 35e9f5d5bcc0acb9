"""Cloze and held-out tasks: `ceval_continuation` (C-Eval without options, answer texts scored),
`continuation` (hellaswag-style sentence endings) and `lambada` (last word) on held-out fortunes.
The bundled files rebuild byte for byte and come from the held-out split; prompts have the documented
shape; a fake model gives the expected acc / acc_norm / chance; and lm-eval 0.4.13's own pipeline (its
hellaswag and lambada_openai metric definitions, over our files) scores the same per document."""

import gzip
import json
import math
import re
from importlib import resources
from pathlib import Path
from typing import get_args

import pytest

from glm5.core.resources import bundled
from glm5.eval import build_sets
from glm5.eval.harness import run_task
from glm5.eval.lm import EvalModel, GenerationParams
from glm5.eval.tasks import TaskConfig, TaskName, build_task, bundled_path

NEW = ("ceval_continuation", "continuation", "lambada")


class CharTokenizer:
    """One token per character (ids = code points), so a fake can read the text it scores."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class TextModel(EvalModel):
    """Scores each (context, continuation) text pair with `fn`; records the pairs it saw."""

    def __init__(self, fn):
        self.tokenizer, self.prefix_token_id, self.max_length, self.name = CharTokenizer(), 0, 1 << 20, "fake"
        self.fn, self.seen = fn, []

    def score(self, pairs):
        texts = [(self.tokenizer.decode(c), self.tokenizer.decode(x)) for c, x in pairs]
        self.seen += texts
        return [self.fn(c, x) for c, x in texts]

    def generate(self, prompts, params: GenerationParams):
        raise AssertionError("log-likelihood tasks never generate")


def _rows(task: str) -> list[dict]:
    return [json.loads(line) for line in bundled_path(task).read_text(encoding="utf-8").splitlines()]


def _compact(text: str) -> str:
    return "".join(text.split())


def _validation() -> dict[str, str]:
    with gzip.open(bundled("corpus/validation.jsonl.gz"), "rt", encoding="utf-8") as f:
        return {d["id"]: d["text"] for d in map(json.loads, f) if d["source"] == "fortunes-en"}


def _pseudo_ll(context: str, cont: str) -> tuple[float, bool]:
    """Deterministic, length-dependent scores where acc and acc_norm disagree on some documents."""
    lp = -sum(((ord(c) * 31 + len(context)) % 17) / 8 + 0.3 for c in cont)
    return lp, len(cont) % 3 == 0


# ---- the bundled files ---------------------------------------------------------------------------

def test_heldout_sets_rebuild_identically(tmp_path, monkeypatch):
    monkeypatch.setattr(build_sets, "OUT", tmp_path)
    assert build_sets.write_heldout() == (136, 161)
    committed = Path(str(resources.files("glm5.eval").joinpath("data")))
    for name in ("continuation_heldout.jsonl", "lambada_heldout.jsonl"):
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name


def test_sets_are_held_out_fortunes_of_the_documented_shape():
    texts = _validation()
    ends = {r["endings"][r["label"]] for r in _rows("continuation")}
    for r in _rows("continuation"):
        gold, n = r["endings"][r["label"]], len((r["context"] + " " + r["endings"][r["label"]]).split())
        assert r["id"] in texts and _compact(r["context"] + gold) in _compact(texts[r["id"]])
        assert 12 <= n <= 80 and 0.4 <= len(r["context"].split()) / n <= 0.75
        assert len(set(r["endings"])) == 4 and set(r["endings"]) <= ends  # distractors: other fortunes' endings
        assert r["context"] == r["context"].strip() and all(e == e.strip() for e in r["endings"])
    for r in _rows("lambada"):
        body = texts[r["id"]].split("\t\t--")[0]
        rest = _compact(body).split(_compact(r["context"] + r["target"]), 1)
        assert len(rest) == 2 and not re.search(r"\w", rest[1])  # the last word; only punctuation after it
        assert r["target"].isalpha() and len(r["target"]) >= 3 and len(r["context"].split()) >= 8
    assert len({r["label"] for r in _rows("continuation")}) == 4


def test_requests_have_the_documented_shape():
    model = TextModel(lambda c, x: (0.0, True))
    task = build_task(TaskConfig(task="ceval_continuation"))
    docs = task.docs()[:3]
    task.evaluate(model, docs)
    for i, d in enumerate(docs):
        doc = d.data[1]
        for (ctx, cont), choice in zip(model.seen[4 * i:4 * i + 4], doc.choices):
            assert ctx == f"以下是关于linux commands的问题（附答案）。\n\n问题：{doc.question.strip()}\n答案："
            assert cont == f" {choice}"
    shots = build_task(TaskConfig(task="ceval_continuation", num_fewshot=2))
    path, doc = shots.docs()[0].data
    s0, s1 = shots._shots[path]
    assert shots.context(path, doc) == ("以下是关于linux commands的问题（附答案）。\n\n"
                                        f"问题：{s0.question}\n答案： {s0.choices[s0.answer]}\n\n"
                                        f"问题：{s1.question}\n答案： {s1.choices[s1.answer]}\n\n"
                                        f"问题：{doc.question}\n答案：")
    for name in ("continuation", "lambada"):
        model = TextModel(lambda c, x: (0.0, True))
        task = build_task(TaskConfig(task=name))
        task.evaluate(model, task.docs()[:5])
        rows = _rows(name)[:5]
        want = ([(r["context"], f" {e}") for r in rows for e in r["endings"]] if name == "continuation"
                else [(r["context"], f" {r['target']}") for r in rows])
        assert model.seen == want


# ---- metrics with fake models ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ceval_continuation", "continuation"])
def test_choice_metrics_and_chance(name, tmp_path):
    task = build_task(TaskConfig(task=name))
    docs = task.docs()
    if name == "continuation":
        items = [(d.data["context"], d.data["endings"], d.data["label"]) for d in docs]
    else:
        items = [(task.context(*d.data), d.data[1].choices, d.data[1].answer) for d in docs]
    gold = {(ctx, f" {choices[g]}") for ctx, choices, g in items}
    oracle = TextModel(lambda c, x: (0.0 if (c, x) in gold else -5.0, False))
    res = run_task(task, oracle, tmp_path / "oracle.json", model_name="oracle", progress=False)
    assert res["metrics"] == {"acc": 1.0, "acc_norm": 1.0} and res["chance"] == 0.25
    assert res["n"] == res["documents"] == len(docs) and res["primary"] == task.primary
    # the same log-prob per character: acc picks the shortest choice, acc_norm (per character) the longest
    flat = TextModel(lambda c, x: (-0.7 * len(x), False))
    res = run_task(task, flat, tmp_path / "flat.json", model_name="flat", limit=60, progress=False)
    lens = [[len(c) for c in choices] for _, choices, _ in items[:60]]
    shortest = sum(ls.index(min(ls)) == g for ls, (_, _, g) in zip(lens, items)) / 60
    longest = sum(ls.index(max(ls)) == g for ls, (_, _, g) in zip(lens, items)) / 60
    assert res["metrics"]["acc"] == pytest.approx(shortest) and res["metrics"]["acc_norm"] == pytest.approx(longest)
    assert res["n"] == 60 and res["chance"] == 0.25


def test_lambada_acc_is_the_greedy_flag(tmp_path):
    rows = _rows("lambada")
    greedy = {r["context"] for r in rows[::2]}  # the model "predicts" every other target greedily
    model = TextModel(lambda c, x: (-1.0 if c in greedy else -0.5, c in greedy))  # not the log-likelihood's order
    res = run_task(build_task(TaskConfig(task="lambada")), model, tmp_path / "l.json", model_name="m",
                   progress=False)
    assert res["metrics"]["acc"] == pytest.approx(len(rows[::2]) / len(rows)) and res["chance"] == 0.0
    lls = [-1.0 if r["context"] in greedy else -0.5 for r in rows]
    assert res["metrics"]["perplexity"] == pytest.approx(math.exp(-sum(lls) / len(lls)))
    assert res["n"] == len(rows) == 161 and res["primary"] == "acc" and res["stderr"]["perplexity"] is None


def test_registered_everywhere():
    from glm5.cli.eval import parse
    for name in get_args(TaskName):  # `glm5 eval --task` accepts every task name
        assert parse(["--task", name])[0].task == name
    for name in NEW:
        assert bundled_path(name).exists()
    with pytest.raises(ValueError, match="0-shot"):
        build_task(TaskConfig(task="lambada", num_fewshot=1))


# ---- lm-eval 0.4.13 as the reference -----------------------------------------------------------------

def _lm_eval_task(root: Path, name: str, data: Path) -> str:
    """lm-eval's own hellaswag / lambada_openai YAML over our file: only the dataset and the fields change
    (hellaswag's `process_docs` builds `query`/`choices`; ours are `context`/`endings` already)."""
    lm_eval = pytest.importorskip("lm_eval")
    import yaml
    tasks = Path(lm_eval.__file__).parent / "tasks"
    if name == "continuation":
        text = (tasks / "hellaswag" / "hellaswag.yaml").read_text(encoding="utf-8")
        cfg = yaml.safe_load("\n".join(x for x in text.splitlines() if "!function" not in x))
        cfg.update(doc_to_text="{{context}}", doc_to_choice="endings")
        assert cfg["doc_to_target"] == "{{label}}" and cfg["output_type"] == "multiple_choice"
    else:
        cfg = yaml.safe_load((tasks / "lambada" / "lambada_openai.yaml").read_text(encoding="utf-8"))
        cfg.update(doc_to_text="{{context}}", doc_to_target="{{' '+target}}")
    task = f"glm5_{name}"
    cfg.update(task=task, dataset_path="json", dataset_kwargs={"data_files": {"test": str(data)}},
               test_split="test", validation_split=None, training_split=None, tag=[])
    cfg.pop("dataset_name", None)
    (root / f"{task}.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True), encoding="utf-8")
    return task


@pytest.mark.parametrize("name", ["continuation", "lambada"])
def test_metrics_match_lm_eval(name, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    class ReferenceLM(LM):
        def loglikelihood(self, requests):
            return [_pseudo_ll(*r.args) for r in requests]

        def loglikelihood_rolling(self, requests):
            raise AssertionError("hellaswag / lambada never ask for rolling log-likelihood")

        def generate_until(self, requests):
            raise AssertionError("hellaswag / lambada never generate")

    limit = 40
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _rows(name)[:limit]) + "\n", encoding="utf-8")
    (tmp_path / "tasks").mkdir()
    task_name = _lm_eval_task(tmp_path / "tasks", name, data)
    out = lm_eval.simple_evaluate(model=ReferenceLM(), tasks=[task_name], num_fewshot=0, log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path / "tasks"),
                                                           include_defaults=False))
    ref = sorted(out["samples"][task_name], key=lambda s: s["doc_id"])
    ours = run_task(build_task(TaskConfig(task=name)), TextModel(_pseudo_ll), tmp_path / "ours.json",
                    model_name="fake", limit=limit, progress=False)
    records = [json.loads(x)["record"] for x in (tmp_path / "ours.records.jsonl").read_text().splitlines()[1:]]
    assert len(ref) == len(records) == limit
    keys = ("acc", "acc_norm") if name == "continuation" else ("acc",)
    for s, rec in zip(ref, records):
        assert all(float(s[k]) == rec[k] for k in keys)
    if name == "continuation":
        assert 0 < sum(r["acc"] != r["acc_norm"] for r in records)  # the normalisation matters here
    for k in keys + (("perplexity",) if name == "lambada" else ()):
        assert out["results"][task_name][f"{k},none"] == pytest.approx(ours["metrics"][k])
