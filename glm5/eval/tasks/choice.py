"""Multiple choice by log-likelihood: MMLU and C-Eval with lm-evaluation-harness's standard prompts.

The context is the subject description, then `num_fewshot` solved examples from the subject's dev
file (the first ones, lm-eval's `first_n` sampler), then the question:

    The following are multiple choice questions (with answers) about {subject}.\n\n
    {question}\nA. {A}\nB. {B}\nC. {C}\nD. {D}\nAnswer: {letter}\n\n      <- each example
    {question}\nA. {A}\nB. {B}\nC. {C}\nD. {D}\nAnswer:

(C-Eval: 以下是中国关于{科目}的单项选择题，请选出其中的正确答案。 and 答案：). Each choice is scored as the
continuation " A" .. " D"; acc takes the most likely, acc_norm divides by the choice's length in
characters (lm-eval's definition; equal to acc for letter choices).

`mmlu_continuation` is lm-eval's cloze variant of MMLU (its `mmlu_continuation` tasks): no options in
the prompt, and each answer *text* is the scored continuation, which small models can do above chance
where letters are still noise:

    The following are questions (with answers) about {subject}.\n\n
    Question: {question}\nAnswer: {answer text}\n\n                                   <- each example
    Question: {question}\nAnswer:

`ceval_continuation` is the same cloze form for C-Eval (lm-eval has no C-Eval cloze task; the wording
follows its C-Eval prompt and the answer text follows 答案： after the same " " delimiter as the letters):

    以下是关于{科目}的问题（附答案）。\n\n
    问题：{question}\n答案： {answer text}\n\n                                          <- each example
    问题：{question}\n答案：

`MultipleChoice` is the scoring shared with the held-out sentence endings (glm5/eval/tasks/heldout.py).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ..lm import EvalModel
from ..loaders import LETTERS, ChoiceDoc, find_dev_file, find_split_files, read_ceval_csv, read_mmlu_csv
from ..metrics import Metric, mean_stderr
from .base import Doc, Task


def mmlu_description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def mmlu_question(doc: ChoiceDoc) -> str:
    a, b, c, d = doc.choices
    return f"{doc.question.strip()}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:"


def mmlu_cloze_description(subject: str) -> str:
    return f"The following are questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def mmlu_cloze_question(doc: ChoiceDoc) -> str:
    return f"Question: {doc.question.strip()}\nAnswer:"


def ceval_subject(subject: str) -> str:
    """The Chinese name of a C-Eval subject (lm-eval's descriptions), else the subject with spaces."""
    names = json.loads(resources.files("glm5.eval").joinpath("data/ceval_subjects.json").read_text("utf-8"))
    return names.get(subject, subject.replace("_", " "))


def ceval_description(subject: str) -> str:
    return f"以下是中国关于{ceval_subject(subject)}的单项选择题，请选出其中的正确答案。\n\n"


def ceval_question(doc: ChoiceDoc) -> str:
    a, b, c, d = doc.choices
    return f"{doc.question.strip()}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\n答案："


def ceval_cloze_description(subject: str) -> str:
    return f"以下是关于{ceval_subject(subject)}的问题（附答案）。\n\n"


def ceval_cloze_question(doc: ChoiceDoc) -> str:
    return f"问题：{doc.question.strip()}\n答案："


STYLES = {  # name -> (reader, description, question, default split)
    "mmlu": (read_mmlu_csv, mmlu_description, mmlu_question, "test"),
    "ceval": (read_ceval_csv, ceval_description, ceval_question, "val"),
    "mmlu_continuation": (read_mmlu_csv, mmlu_cloze_description, mmlu_cloze_question, "test"),
    "ceval_continuation": (read_ceval_csv, ceval_cloze_description, ceval_cloze_question, "val"),
}
CLOZE = ("mmlu_continuation", "ceval_continuation")  # the answer texts are scored, not the letters


class MultipleChoice(Task):
    """Each choice scored as the continuation " {choice}" of its context: `acc` takes the most likely,
    `acc_norm` divides the log-likelihood by the choice's length in characters (lm-eval's definition)."""

    def score_choices(self, model: EvalModel, items: list[tuple[str, list[str], int]]) -> list[dict]:
        """One record per (context, choices, gold index): log-likelihoods, gold, acc, acc_norm."""
        scores = iter(model.loglikelihood([(ctx, f" {c}") for ctx, choices, _ in items for c in choices]))
        records = []
        for _, choices, gold in items:
            lls = [next(scores)[0] for _ in choices]
            norm = [lp / len(c) for lp, c in zip(lls, choices)]  # lm-eval: characters, no delimiter
            records.append({"lls": lls, "gold": gold, "acc": float(lls.index(max(lls)) == gold),
                            "acc_norm": float(norm.index(max(norm)) == gold)})
        return records

    def aggregate(self, records: list[dict]) -> dict[str, Metric]:
        return {"acc": mean_stderr([r["acc"] for r in records]),
                "acc_norm": mean_stderr([r["acc_norm"] for r in records])}

    def chance(self, records: list[dict]) -> float | None:
        """One over the number of choices, averaged over the documents."""
        return sum(1 / len(r["lls"]) for r in records) / len(records) if records else None


class ChoiceTask(MultipleChoice):
    dimension, primary = "knowledge", "acc"

    def __init__(self, name: str, data: str | Path, num_fewshot: int = 0, split: str | None = None):
        if name not in STYLES:
            raise ValueError(f"unknown multiple-choice style {name!r}; choose from {sorted(STYLES)}")
        self.name, self.data, self.num_fewshot = name, Path(data), num_fewshot
        self.read, self.describe, self.question, default_split = STYLES[name]
        self.split = split or default_split
        self._shots: dict[str, list[ChoiceDoc]] = {}

    def docs(self) -> list[Doc]:
        out = []
        for path in find_split_files(self.data, self.split):
            if self.num_fewshot:
                dev = find_dev_file(path, self.data)
                shots = self.read(dev) if dev else []
                if len(shots) < self.num_fewshot:
                    raise ValueError(f"{path}: {self.num_fewshot}-shot needs {self.num_fewshot} examples in "
                                     f"its <subject>_dev.csv, found {len(shots)}{'' if dev else ' (no dev file)'}")
                self._shots[str(path)] = shots[: self.num_fewshot]
            out += [Doc(d.id, (str(path), d)) for d in self.read(path)]
        return out

    def choices(self, doc: ChoiceDoc) -> list[str]:
        """What is scored after the prompt (and a space): the letters, or the answer texts (cloze)."""
        return list(doc.choices) if self.name in CLOZE else list(LETTERS)

    def context(self, path: str, doc: ChoiceDoc) -> str:
        shots = "".join(f"{self.question(s)} {self.choices(s)[s.answer]}\n\n" for s in self._shots.get(path, []))
        return self.describe(doc.subject) + shots + self.question(doc)

    def evaluate(self, model: EvalModel, docs: list[Doc]) -> list[dict]:
        items = [(self.context(path, d), self.choices(d), d.answer) for path, d in (x.data for x in docs)]
        records = self.score_choices(model, items)
        for doc, r in zip(docs, records):
            r["subject"] = doc.data[1].subject
        return records

    def fingerprint(self) -> dict:
        return {"num_fewshot": self.num_fewshot, "split": self.split}
