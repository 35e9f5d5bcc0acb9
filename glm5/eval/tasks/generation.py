"""Generated answers scored against references: exact match (math, short answers) and real-user
queries scored by overlap, optionally by a judge model.

exact: JSONL `{"prompt", "answer"}`; the output (greedy, cut at `stop`) is reduced by `regex` (its first
group, or the whole match; the last match with `regex_last`) and compared after normalisation
(case, punctuation, articles, width). queries: JSONL `{"prompt", "reference"?, "keywords"?}`; `f1` is
word-overlap F1 against the reference, `keyword_recall` the share of rubric keywords present, and
`overlap` their mean per query; with a judge, `judge` is its 1-10 grade / 10.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..judge import Judge
from ..lm import EvalModel, GenerationParams, decoding_fingerprint
from ..loaders import DataError, read_jsonl
from ..metrics import Metric, keyword_recall, mean_stderr, normalize_answer, token_f1
from .base import Doc, Task


def _jsonl_docs(path: Path, required: tuple[str, ...]) -> list[Doc]:
    out = []
    for line, obj in read_jsonl(path, required=required):
        for k in required:
            if not isinstance(obj[k], str):
                raise DataError(f"{path}:{line}: {k!r} must be a string")
        out.append(Doc(str(obj.get("id", f"line{line}")), obj))
    return out


class ExactTask(Task):
    name, dimension, primary = "exact", "skills", "exact_match"

    def __init__(self, data: str | Path, *, regex: str | None = None, regex_last: bool = False,
                 params: GenerationParams | None = None):
        self.data, self.regex, self.regex_last = Path(data), regex, regex_last
        self.pattern = re.compile(regex) if regex else None
        self.params = params or GenerationParams(max_tokens=64, stop=("\n",))

    def docs(self) -> list[Doc]:
        return _jsonl_docs(self.data, ("prompt", "answer"))

    def extract(self, output: str) -> str:
        if self.pattern is None:
            return output.strip()
        matches = list(self.pattern.finditer(output))
        if not matches:
            return ""
        m = matches[-1] if self.regex_last else matches[0]
        return m.group(1) if m.groups() else m.group(0)

    def evaluate(self, model: EvalModel, docs: list[Doc]) -> list[dict]:
        outs = model.generate([d.data["prompt"] for d in docs], self.params)
        records = []
        for d, (out, *_) in zip(docs, outs):
            got = self.extract(out)
            records.append({"output": out, "extracted": got,
                            "exact_match": float(normalize_answer(got) == normalize_answer(d.data["answer"]))})
        return records

    def aggregate(self, records: list[dict]) -> dict[str, Metric]:
        return {"exact_match": mean_stderr([r["exact_match"] for r in records])}

    def chance(self, records: list[dict]) -> float | None:
        return 0.0  # free-form answers: a random string is not the exact answer

    def fingerprint(self) -> dict:
        p = self.params
        return {"regex": self.regex, "regex_last": self.regex_last, **decoding_fingerprint(p)}


class QueriesTask(Task):
    name, dimension, primary = "queries", "queries", "overlap"

    def __init__(self, data: str | Path, *, params: GenerationParams | None = None, judge: Judge | None = None):
        self.data, self.judge = Path(data), judge
        self.params = params or GenerationParams(max_tokens=128)

    def docs(self) -> list[Doc]:
        docs = _jsonl_docs(self.data, ("prompt",))
        for d in docs:
            if "reference" not in d.data and "keywords" not in d.data:
                raise DataError(f"{self.data}: query {d.id} has neither 'reference' nor 'keywords'")
        return docs

    def evaluate(self, model: EvalModel, docs: list[Doc]) -> list[dict]:
        outs = [o[0] for o in model.generate([d.data["prompt"] for d in docs], self.params)]
        records = []
        for d, out in zip(docs, outs):
            r: dict = {"output": out}
            if "reference" in d.data:
                r["f1"] = token_f1(out, d.data["reference"])
            if d.data.get("keywords"):
                r["keyword_recall"] = keyword_recall(out, d.data["keywords"])
            parts = [r[k] for k in ("f1", "keyword_recall") if k in r]
            r["overlap"] = sum(parts) / len(parts) if parts else 0.0
            if self.judge is not None:
                r["judge"] = self.judge.grade(d.data["prompt"], out, d.data.get("reference"), d.data.get("keywords"))
            records.append(r)
        return records

    def aggregate(self, records: list[dict]) -> dict[str, Metric]:
        out = {}
        for k in ("overlap", "f1", "keyword_recall", "judge"):
            xs = [r[k] for r in records if r.get(k) is not None]
            if xs:
                out[k] = mean_stderr(xs)
        return out

    def fingerprint(self) -> dict:
        return {**decoding_fingerprint(self.params), "judge": self.judge.name if self.judge else None}
