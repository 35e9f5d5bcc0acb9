"""The task contract: documents in, one JSON record per document out, metrics from the records.

A record depends only on its document and the model, so finished records are stored as they come and
a rerun skips them (glm5/eval/harness.py). `fingerprint()` holds every option that changes a record:
results made under other options are not reused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from ..lm import EvalModel
from ..metrics import Metric

Dimension = Literal["knowledge", "skills", "queries", "language"]


@dataclass
class Doc:
    id: str  # stable across runs (subject/index, task_id, JSONL id or line)
    data: object  # the task's own document type


class Task(ABC):
    name: str
    dimension: Dimension
    primary: str  # the metric the report plots

    @abstractmethod
    def docs(self) -> list[Doc]:
        """The documents to evaluate, in a fixed order."""

    @abstractmethod
    def evaluate(self, model: EvalModel, docs: list[Doc]) -> list[dict]:
        """One JSON-able record per document, in order."""

    @abstractmethod
    def aggregate(self, records: list[dict]) -> dict[str, Metric]:
        """metric name -> (value, standard error or None)."""

    def chance(self, records: list[dict]) -> float | None:
        """The primary metric of a model that guesses at random, on these records (None: not defined,
        e.g. perplexity or text overlap)."""
        return None

    def scored(self, records: list[dict]) -> int:
        """How many of the records were scored (the report's n)."""
        return len(records)

    def fingerprint(self) -> dict:
        """Options that change records (the base: none)."""
        return {}
