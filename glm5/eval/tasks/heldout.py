"""Held-out text: sentence endings (hellaswag-style) and the last word (lambada-style), 0-shot.

Unlike the knowledge sets (built from the corpus's training split), the bundled sets come from the
held-out English fortunes (glm5/eval/build_sets.py): they measure how well a model continues text it
was not trained on.

continuation: JSONL `{"id", "context", "endings": [...], "label"}`; each ending is scored as the
continuation " {ending}" of the context (lm-eval's hellaswag: `{{query}}`, the default " " delimiter);
`acc` takes the most likely, `acc_norm` (primary, as lm-eval's hellaswag) divides by the ending's length
in characters. lambada: JSONL `{"id", "context", "target"}`; the target is scored as " {target}" and `acc`
is 1 when every one of its tokens is the greedy argmax (lm-eval's lambada `acc`); `perplexity` is
exp(-mean log-likelihood of the target), lm-eval's lambada aggregation.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..lm import EvalModel
from ..loaders import DataError, read_jsonl
from ..metrics import Metric, mean_stderr
from .base import Doc, Task
from .choice import MultipleChoice


def _docs(path: Path, required: tuple[str, ...]) -> list[tuple[int, dict]]:
    rows = read_jsonl(path, required=required)
    for line, obj in rows:
        if not isinstance(obj["context"], str):
            raise DataError(f"{path}:{line}: 'context' must be a string")
    return rows


class ContinuationTask(MultipleChoice):
    name, dimension, primary = "continuation", "language", "acc_norm"

    def __init__(self, data: str | Path):
        self.data = Path(data)

    def docs(self) -> list[Doc]:
        out = []
        for line, obj in _docs(self.data, ("context", "endings", "label")):
            endings, label = obj["endings"], obj["label"]
            if not (isinstance(endings, list) and len(endings) >= 2 and all(isinstance(e, str) and e for e in endings)):
                raise DataError(f"{self.data}:{line}: 'endings' must be a list of 2+ non-empty strings")
            if not (isinstance(label, int) and 0 <= label < len(endings)):
                raise DataError(f"{self.data}:{line}: 'label' must index 'endings', got {label!r}")
            out.append(Doc(str(obj.get("id", f"line{line}")), obj))
        return out

    def evaluate(self, model: EvalModel, docs: list[Doc]) -> list[dict]:
        return self.score_choices(model, [(d.data["context"], d.data["endings"], d.data["label"]) for d in docs])


class LambadaTask(Task):
    name, dimension, primary = "lambada", "language", "acc"

    def __init__(self, data: str | Path):
        self.data = Path(data)

    def docs(self) -> list[Doc]:
        out = []
        for line, obj in _docs(self.data, ("context", "target")):
            if not (isinstance(obj["target"], str) and obj["target"].strip()):
                raise DataError(f"{self.data}:{line}: 'target' must be a non-empty string")
            out.append(Doc(str(obj.get("id", f"line{line}")), obj))
        return out

    def evaluate(self, model: EvalModel, docs: list[Doc]) -> list[dict]:
        scores = model.loglikelihood([(d.data["context"], f" {d.data['target']}") for d in docs])
        return [{"ll": lp, "greedy": greedy, "acc": float(greedy)} for lp, greedy in scores]

    def aggregate(self, records: list[dict]) -> dict[str, Metric]:
        lls = [r["ll"] for r in records]
        ppl = math.exp(min(700.0, -sum(lls) / len(lls))) if lls else float("nan")
        return {"acc": mean_stderr([r["acc"] for r in records]), "perplexity": (ppl, None)}

    def chance(self, records: list[dict]) -> float | None:
        """Guessing a word out of the vocabulary: 0."""
        return 0.0
