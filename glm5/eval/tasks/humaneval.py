"""HumanEval-format code generation scored by execution, with the unbiased pass@k estimator.

A problem has `task_id, prompt, entry_point, test`. Each completion is cut at the stop sequences of
bigcode-evaluation-harness's HumanEval task (a new top-level `def`/`class`/decorator/`if`/`print`/comment,
or a closing code fence, ends the function body), then the program
`prompt + completion + test + check(entry_point)` runs in the sandbox (glm5/eval/sandbox.py). With `chat`
the problem is asked as a user turn and the reply's code block is run instead (`chat_program`). With
`samples` (JSONL of `task_id, completion`) the given completions are scored and nothing is generated.
"""

from __future__ import annotations

import re
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


# With `chat` (instruct models, which close a raw prompt's code block at once and explain instead), the
# problem goes to the model as one user turn asking for the whole function in a Markdown code block, as
# EvalPlus prompts chat models; the code block of the reply is what is run (see `chat_program`).
CHAT_INSTRUCTION = ("Complete the following Python function. Reply with the complete function, including its "
                    "signature and any imports it needs, in one Markdown ```python code block.")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S | re.I)


def program(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def chat_prompt(problem: dict) -> str:
    return f"{CHAT_INSTRUCTION}\n\n```python\n{problem['prompt'].rstrip()}\n```"


def extract_code(reply: str) -> str:
    """The first fenced code block of a chat reply (an unclosed one runs to the end), else the whole reply."""
    m = _FENCE.search(reply)
    return (m.group(1) if m else reply).strip("\n")


def chat_program(problem: dict, reply: str) -> str:
    """The program run for a chat reply: the problem's prompt (its imports and helper functions), then the
    reply's code, whose definition of the entry point replaces the prompt's docstring-only one; a reply
    holding only a function body is appended to the prompt as a completion."""
    code = extract_code(reply)
    if re.search(rf"^\s*def\s+{re.escape(problem['entry_point'])}\s*\(", code, re.M):
        return program(problem, f"    pass\n\n{code}")
    return program(problem, code)


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
        if self.params.chat:
            return model.generate([chat_prompt(d.data) for d in docs], self.params)
        return model.generate([d.data["prompt"] for d in docs], self.params)

    def evaluate(self, model: EvalModel | None, docs: list[Doc]) -> list[dict]:
        comps = self.completions(model, docs)
        build = ((lambda d, c: chat_program(d.data, c)) if self.params.chat and self.samples is None
                 else (lambda d, c: program(d.data, cut_at_stop(c, STOP))))
        jobs = [(i, build(d, c)) for i, (d, cs) in enumerate(zip(docs, comps)) for c in cs]
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
