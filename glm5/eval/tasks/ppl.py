"""Perplexity and bits per byte of a JSONL text set (lm-eval's wikitext metrics).

Each text is scored whole (rolling windows, glm5/eval/lm.py). Corpus-level ratios, so no standard
error: word_perplexity = exp(-sum logprob / words), byte_perplexity = exp(-sum logprob / UTF-8 bytes),
bits_per_byte = -sum logprob / (bytes * ln 2), token_perplexity = exp(-sum logprob / tokens).
"""

from __future__ import annotations

import math
from pathlib import Path

from ..lm import EvalModel
from ..loaders import DataError, read_jsonl
from ..metrics import Metric
from .base import Doc, Task


class PerplexityTask(Task):
    name, dimension, primary = "ppl", "language", "bits_per_byte"

    def __init__(self, data: str | Path, text_key: str = "text"):
        self.data, self.text_key = Path(data), text_key

    def docs(self) -> list[Doc]:
        out = []
        for line, obj in read_jsonl(self.data, required=(self.text_key,)):
            text = obj[self.text_key]
            if not isinstance(text, str):
                raise DataError(f"{self.data}:{line}: {self.text_key!r} must be a string")
            out.append(Doc(str(obj.get("id", f"line{line}")), text))
        return out

    def evaluate(self, model: EvalModel, docs: list[Doc]) -> list[dict]:
        scores = model.loglikelihood_rolling([d.data for d in docs])
        return [{"logprob": lp, "tokens": n, "bytes": len(d.data.encode()), "words": len(d.data.split())}
                for d, (lp, n) in zip(docs, scores)]

    def aggregate(self, records: list[dict]) -> dict[str, Metric]:
        lp = sum(r["logprob"] for r in records)
        tokens, nbytes, nwords = (max(1, sum(r[k] for r in records)) for k in ("tokens", "bytes", "words"))
        return {"bits_per_byte": (-lp / nbytes / math.log(2), None),
                "byte_perplexity": (math.exp(-lp / nbytes), None),
                "word_perplexity": (math.exp(min(700.0, -lp / nwords)), None),
                "token_perplexity": (math.exp(min(700.0, -lp / tokens)), None)}

    def fingerprint(self) -> dict:
        return {"text_key": self.text_key}
