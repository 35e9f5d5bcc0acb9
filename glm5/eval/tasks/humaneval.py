"""HumanEval-format code generation scored by execution, with the unbiased pass@k estimator.

A problem has `task_id, prompt, entry_point, test`. Each completion is cut at the stop sequences of
bigcode-evaluation-harness's HumanEval task (a new top-level `def`/`class`/decorator/`if`/`print`/comment,
or a closing code fence, ends the function body), then the program
`prompt + completion + test + check(entry_point)` runs in the sandbox (glm5/eval/sandbox.py). With
`samples` (JSONL of `task_id, completion`) the given completions are scored and nothing is generated.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..lm import EvalModel, GenerationParams, cut_at_stop, decoding_fingerprint
from ..loaders import DataError, read_humaneval, read_jsonl
from ..metrics import Metric, mean_stderr, pass_at_k
from ..sandbox import Limits, run_program
from .base import Doc, Task

# Codex's stop sequences plus the two bigcode-evaluation-harness adds for its HumanEval task: a decorator
# starting a new top-level definition, and the end of a Markdown code block (instruct models close the
# fence after the body and go on to explain it).
STOP = ("\nclass", "\ndef", "\n#", "\n@", "\nif", "\nprint", "\n```")


def program(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


class HumanEvalTask(Task):
    name, dimension, primary = "humaneval", "skills", "pass@1"

    def __init__(self, data: str | Path, *, samples: str | Path | None = None, n: int = 1, k: tuple[int, ...] = (1,),
                 params: GenerationParams | None = None, limits: Limits | None = None, workers: int = 2):
        self.data, self.samples, self.n, self.k = Path(data), samples, n, tuple(k)
        self.params = params or GenerationParams(max_tokens=384, n=n, stop=STOP)
        self.limits, self.workers = limits or Limits(), workers
        self._given: dict[str, list[str]] | None = None

    def docs(self) -> list[Doc]:
        return [Doc(p["task_id"], p) for p in read_humaneval(self.data)]

    def given_completions(self) -> dict[str, list[str]]:
        if self._given is None:
            self._given = defaultdict(list)
            for line, obj in read_jsonl(self.samples, required=("task_id", "completion")):
                if not isinstance(obj["completion"], str):
                    raise DataError(f"{self.samples}:{line}: completion must be a string")
                self._given[obj["task_id"]].append(obj["completion"])
        return self._given

    def completions(self, model: EvalModel | None, docs: list[Doc]) -> list[list[str]]:
        if self.samples is not None:
            given = self.given_completions()
            return [given.get(d.id, []) for d in docs]
        if model is None:
            raise ValueError("humaneval needs a model or --samples")
        return model.generate([d.data["prompt"] for d in docs], self.params)

    def evaluate(self, model: EvalModel | None, docs: list[Doc]) -> list[dict]:
        comps = self.completions(model, docs)
        jobs = [(i, program(d.data, cut_at_stop(c, STOP))) for i, (d, cs) in enumerate(zip(docs, comps)) for c in cs]
        with ThreadPoolExecutor(self.workers) as pool:
            results = list(pool.map(lambda job: run_program(job[1], self.limits), jobs))
        statuses: list[list[str]] = [[] for _ in docs]
        for (i, _), r in zip(jobs, results):
            statuses[i].append(r.status)
        return [{"n": len(s), "correct": s.count("pass"), "status": s,
                 "completion": cs[0] if cs else None} for s, cs in zip(statuses, comps)]

    def aggregate(self, records: list[dict]) -> dict[str, Metric]:
        scored = [r for r in records if r["n"]]
        out = {}
        for k in self.k:
            if scored and all(r["n"] >= k for r in scored):
                out[f"pass@{k}"] = mean_stderr([pass_at_k(r["n"], r["correct"], k) for r in scored])
        return out

    def chance(self, records: list[dict]) -> float | None:
        return 0.0  # a random program does not pass the unit tests

    def scored(self, records: list[dict]) -> int:
        """Problems with at least one completion (a --samples file may cover only some of them)."""
        return sum(1 for r in records if r["n"])

    def fingerprint(self) -> dict:
        p = self.params
        return {"samples": str(self.samples) if self.samples else None, **decoding_fingerprint(p)}
