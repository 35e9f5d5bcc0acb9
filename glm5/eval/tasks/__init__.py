"""Task registry: `TaskConfig` (one `[[tasks]]` table of an eval config, or the `glm5 eval` flags) ->
a `Task`. `data = None` means the set bundled with glm5 (package data, see docs/eval.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from glm5.core.resources import resolve_path

from ..lm import GenerationParams
from ..sandbox import Limits
from .base import Doc, Task
from .choice import ChoiceTask
from .generation import ExactTask, QueriesTask
from .heldout import ContinuationTask, LambadaTask
from .humaneval import STOP, HumanEvalTask
from .ppl import PerplexityTask

TaskName = Literal["ppl", "mmlu", "mmlu_continuation", "ceval", "ceval_continuation", "continuation", "lambada",
                   "humaneval", "exact", "queries"]
BUNDLED = {  # task -> file or directory under glm5/eval/data, or a bundled asset
    "ppl": "bundled:corpus/validation.jsonl.gz",
    "mmlu": "mmlu_corpus",
    "mmlu_continuation": "mmlu_corpus",
    "ceval": "ceval_corpus",
    "ceval_continuation": "ceval_corpus",
    "continuation": "continuation_heldout.jsonl",  # held-out text (the corpus's validation split)
    "lambada": "lambada_heldout.jsonl",
    "humaneval": "HumanEval.jsonl.gz",
    "exact": "exact_corpus.jsonl",
    "queries": "queries_corpus.jsonl",
}


@dataclass(kw_only=True)
class TaskConfig:
    task: TaskName  # which task format
    data: str | None = None  # file or directory; None = the bundled set
    label: str | None = None  # name in results and reports (default: the task)
    split: str | None = None  # mmlu/ceval: eval split (default test / val)
    num_fewshot: int = 0  # mmlu/ceval (and their _continuation): solved examples from the dev split
    limit: int | None = None  # evaluate only the first N documents
    samples: str | None = None  # humaneval: JSONL of {task_id, completion} to score instead of generating
    n: int = 1  # humaneval: samples per problem
    k: list[int] = field(default_factory=lambda: [1])  # humaneval: pass@k values (k <= n)
    temperature: float = 0.0  # generation temperature (0 = greedy)
    top_p: float = 1.0
    max_tokens: int | None = None  # generated tokens (default: humaneval 384, exact 64, queries 128)
    stop: list[str] | None = None  # stop strings (default: humaneval bigcode's stops (none with chat), exact newline)
    seed: int | None = 0  # sampling seed
    beam_width: int = 1  # generation tasks: > 1 = beam search of this width (temperature must be 0)
    temperature_schedule: list[float] | None = None  # generation tasks: [start, end], linear over max_tokens
    regex: str | None = None  # exact: extract the answer with this pattern (first group)
    regex_last: bool = False  # exact: use the last match instead of the first
    text_key: str = "text"  # ppl: JSONL field with the text
    chat: bool = False  # exact/queries: prompts as one user turn through the model's chat template
    judge_url: str | None = None  # queries: OpenAI-compatible judge server
    judge_model: str | None = None  # queries: judge model name (default: the server's first)
    timeout_s: float = 10.0  # humaneval: wall seconds per program (CPU limit: the same, rounded up)

    def __post_init__(self):
        if self.num_fewshot < 0 or self.n < 1 or any(k < 1 for k in self.k):
            raise ValueError("num_fewshot must be >= 0, n >= 1 and every k >= 1")
        if max(self.k) > self.n and self.samples is None:
            raise ValueError(f"pass@{max(self.k)} needs n >= {max(self.k)} samples per problem, got n={self.n}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.beam_width < 1 or (self.beam_width > 1 and (self.temperature != 0 or self.n > self.beam_width
                                                            or self.temperature_schedule is not None)):
            raise ValueError(f"beam_width={self.beam_width}: must be >= 1; beam search needs temperature 0, no "
                             f"temperature_schedule and n <= beam_width (got temperature {self.temperature}, n {self.n})")
        sched = self.temperature_schedule
        if sched is not None and (len(sched) != 2 or any(not 0 <= t <= 2 for t in sched)):
            raise ValueError(f"temperature_schedule must be [start, end] with 0 <= each <= 2, got {sched}")

    @property
    def name(self) -> str:
        return self.label or self.task


def bundled_path(task: str) -> Path:
    name = BUNDLED[task]
    if name.startswith("bundled:"):
        return resolve_path(name)  # held-out split of the bundled corpus (glm5/data/assets)
    path = Path(str(resources.files("glm5.eval").joinpath("data", name)))
    if not path.exists():
        raise FileNotFoundError(f"no bundled data for {task!r} ({path}); pass --data")
    return path


def _params(cfg: TaskConfig, max_tokens: int, stop: tuple[str, ...], n: int = 1) -> GenerationParams:
    return GenerationParams(max_tokens=cfg.max_tokens or max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            n=n, stop=tuple(cfg.stop) if cfg.stop is not None else stop, seed=cfg.seed,
                            chat=cfg.chat, beam_width=cfg.beam_width,
                            temperature_schedule=tuple(cfg.temperature_schedule) if cfg.temperature_schedule else None)


def build_task(cfg: TaskConfig) -> Task:
    data = Path(cfg.data) if cfg.data else bundled_path(cfg.task)
    if cfg.task == "ppl":
        return PerplexityTask(data, cfg.text_key)
    if cfg.task in ("mmlu", "mmlu_continuation", "ceval", "ceval_continuation"):
        return ChoiceTask(cfg.task, data, cfg.num_fewshot, cfg.split)
    if cfg.task in ("continuation", "lambada"):
        if cfg.num_fewshot:
            raise ValueError(f"{cfg.task} is 0-shot (no dev split), got num_fewshot={cfg.num_fewshot}")
        return ContinuationTask(data) if cfg.task == "continuation" else LambadaTask(data)
    if cfg.task == "humaneval":
        limits = Limits(cpu_s=max(1, int(cfg.timeout_s + 0.999)), wall_s=cfg.timeout_s + 5)
        return HumanEvalTask(data, samples=cfg.samples, n=cfg.n, k=tuple(cfg.k), params=_params(cfg, 384, () if cfg.chat else STOP, cfg.n),
                             limits=limits)
    if cfg.task == "exact":
        return ExactTask(data, regex=cfg.regex, regex_last=cfg.regex_last, params=_params(cfg, 64, ("\n",)))
    judge = None
    if cfg.judge_url:
        from ..judge import Judge  # noqa: PLC0415
        judge = Judge(cfg.judge_url, cfg.judge_model)
    return QueriesTask(data, params=_params(cfg, 128, ()), judge=judge)


__all__ = ["Doc", "Task", "TaskConfig", "build_task", "bundled_path"]
